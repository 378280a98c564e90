"""One source of truth for every default (issue 29): for every registered algorithm, the hyperparameters
`fedkl run --algorithm NAME` trains with, those of `fedkl.train(data, NAME)` / `fedkl.algorithm(NAME)`,
and those of research code that builds the class directly (`Cls(Cls.Params(), ctx)`) are the same values,
step size included (the class resolves ``lr=None`` to its declared ``step_size`` itself)."""

from __future__ import annotations

import dataclasses

import pytest

import fedkl
from fedkl import cli
from fedkl.algorithms.catalog import ALGORITHMS, REGISTRY
from fedkl.algorithms.contract import Algorithm, BuildContext
from fedkl.runner import RunConfig


def _cli_params(name: str):
    args = cli.build_parser().parse_args(["run", "--algorithm", name])
    return RunConfig.from_settings(**cli._run_settings(args)).params


@pytest.mark.parametrize("name", ALGORITHMS)
def test_cli_python_api_and_class_build_the_same_hyperparameters(name):
    spec = REGISTRY[name]
    assert spec.cls is not None and issubclass(spec.cls, Algorithm), f"{name} is not an Algorithm class"
    direct = spec.resolve(spec.cls.Params())  # lr None -> the declared step size, as the class's __init__ does
    assert _cli_params(name) == direct, f"{name}: the CLI's defaults differ from {spec.cls.Params.__name__}'s"
    assert spec.resolve(fedkl.algorithm(name).params) == direct
    assert RunConfig.from_settings(algorithm=name).params == direct  # fedkl.train's and the TOML studies' route
    fields = {f.name for f in dataclasses.fields(direct)}
    assert ("lr" in fields) == (spec.cls.step_size is not None)


def test_the_class_resolves_its_own_step_size_as_the_runner_does():
    """Research code that builds noisy-gd directly trains with the CLI's lr (4.0), not a second default."""
    cls = REGISTRY["noisy-gd"].cls
    alg = cls(cls.Params(), BuildContext.fresh(rho=0.5))
    assert alg.params.lr == cls.step_size == REGISTRY["noisy-gd"].resolve(cls.Params()).lr
    assert alg.params.rounds == _cli_params("noisy-gd").rounds
