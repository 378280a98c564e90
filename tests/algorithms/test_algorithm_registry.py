"""The algorithm registry: every algorithm's hyperparameters are declared once, in its Params, with
help and a flag; ``fedkl run --algorithm NAME --help`` shows that algorithm's flags; a toy algorithm
registered in this file runs through ``fedkl run`` and Flower; and every registered algorithm trains
over the Flower backend (the real ServerApp/ClientApp pair on the deterministic LocalGrid) to the
same model, bit for bit, and the same ledger as in-process."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import pytest
import torch
from build_helpers import SMALL  # tests/build_helpers.py

from fedkl import cli
from fedkl.algorithms.registry import (
    REGISTRY,
    Algorithm,
    AlgorithmParams,
    AlgorithmResult,
    BuildContext,
    Clip,
    Rounds,
    SmallAudit,
    hyperparameter_fields,
    param,
    register,
    unregister,
)
from fedkl.federation.base import ClippedGradient
from fedkl.flower import codec
from fedkl.flower.server_app import run_flower_simulation
from fedkl.privacy import PrivacyLedger
from fedkl.privacy.guarantee import ZERO_SUMS, Guarantee
from fedkl.runner import ALGORITHMS, RunConfig

pytestmark = pytest.mark.flower


def test_every_hyperparameter_is_declared_once_with_help_and_a_flag():
    run = cli.build_parser().subcommands["run"]
    dests = {a.dest: a for a in run._actions}
    fields = hyperparameter_fields()
    for name, f in fields.items():
        assert f.metadata["help"] and f.metadata["origin"], name
        assert dests[name].default == f.default, name
    for spec in REGISTRY.values():  # every algorithm's field IS the one definition (shared by inheritance)
        assert all(fields[f.name] is f for f in dataclasses.fields(spec.params)), spec.name
        assert spec.summary, f"{spec.name}: its builder needs a one-line docstring"

    @dataclass(frozen=True)
    class Redefined(AlgorithmParams):
        rounds: int = param(99, "a second definition of rounds")

    with pytest.raises(ValueError, match="already defined"):
        register(_declared("redefines-rounds", Redefined))
    assert "redefines-rounds" not in REGISTRY


def _declared(name, params, **overrides):
    """An otherwise complete Algorithm subclass (declarations overridden by ``overrides``; None deletes one)."""
    attrs = {"name": name, "Params": params, "guarantee": Guarantee("zcdp"), "absence": ZERO_SUMS, "small": {}}
    attrs.update(audit=SmallAudit(), run=lambda self, federation, releaser, w0, progress=None: None)
    attrs.update(overrides)
    return type(name, (Algorithm,), {k: v for k, v in attrs.items() if v is not None})


@pytest.mark.parametrize("missing", ["name", "Params", "guarantee", "absence", "small", "audit", "run"])
def test_register_refuses_an_incomplete_algorithm_class_at_import(missing):
    """@register reads the class's declarations and refuses, with one line naming it, a class that lacks one."""
    with pytest.raises(TypeError, match=missing):
        register(_declared("incomplete-alg", ToyParams, **{missing: None}))
    assert "incomplete-alg" not in REGISTRY


def test_register_refuses_small_settings_that_are_not_the_algorithms():
    with pytest.raises(TypeError, match="not settings of ToyParams"):
        register(_declared("bad-small", ToyParams, small={"toy_stepp": 0.1}))
    with pytest.raises(TypeError, match="not settings of ToyParams"):
        register(_declared("bad-audit", ToyParams, audit=SmallAudit(settings={"no_such": 1})))
    with pytest.raises(TypeError, match="step_size"):  # a step size declared without an lr in Params
        register(_declared("bad-lr", ToyParams, step_size=1.0))
    assert not {"bad-small", "bad-audit", "bad-lr"} & set(REGISTRY)


def test_params_check_types_choices_and_ranges():
    with pytest.raises(ValueError, match="--rounds must be an integer"):
        RunConfig.from_settings(rounds=2.5)
    with pytest.raises(ValueError, match="--lr must be > 0"):
        RunConfig.from_settings(lr=-1.0)
    with pytest.raises(ValueError, match="--p002-test must be one of"):
        RunConfig.from_settings(algorithm="phased-erm", p002_test="newton")
    with pytest.raises(ValueError, match="unknown setting 'roundz'"):
        RunConfig.from_settings(roundz=3)
    with pytest.raises(ValueError, match="unknown algorithm"):
        RunConfig(algorithm="no-such")
    cfg = RunConfig.from_settings(algorithm="phased-erm", p002_phases=3, radius=2)
    assert cfg.params.p002_phases == 3 and cfg.params.radius == 2.0 and isinstance(cfg.params.radius, float)
    assert RunConfig.from_settings(**cfg.settings()) == cfg  # the flat settings round-trip


def test_cli_flags_reach_the_run_config(monkeypatch):
    seen = {}

    def fake_run(cfg, log, resume=None):
        seen["cfg"] = cfg
        return {}

    monkeypatch.setattr("fedkl.runner.run_training", fake_run)
    assert cli.main(
        [
            "run",
            "--algorithm",
            "kl-spider",
            "--kl-gamma",
            "0.5",
            "--kl-phases",
            "3",
            "--kl-f0",
            "none",
            "--kl-max-rounds",
            "7",
        ]
    ) in (0, None)
    p = seen["cfg"].params
    assert (seen["cfg"].algorithm, p.kl_gamma, p.kl_phases, p.kl_f0, p.kl_max_rounds) == ("kl-spider", 0.5, 3, None, 7)
    assert isinstance(p.kl_phases, int) and isinstance(p.kl_gamma, float)
    assert cli.main(["run", "--algorithm", "fkt-phased-erm", "--fkt-solver", "one-shot", "--radius", "4"]) in (0, None)
    assert (seen["cfg"].params.fkt_solver, seen["cfg"].params.radius) == ("one-shot", 4.0)


def test_a_setting_of_another_algorithm_is_refused(capsys):
    assert cli.main(["run", "--algorithm", "noisy-gd", "--p002-phases", "3"]) == 2
    err = capsys.readouterr().err
    assert "p002_phases=3 does not apply to noisy-gd" in err and "phased-erm" in err


def test_help_with_an_algorithm_lists_only_its_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--algorithm", "noisy-gd", "--help"])
    text = capsys.readouterr().out
    assert "--rounds" in text and "--clip" in text and "noisy-gd hyperparameters" in text
    assert "--p002-phases" not in text and "--kl-gamma" not in text and "--sampling-rate" not in text
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = capsys.readouterr().out
    assert "--p002-phases" in text and "--kl-gamma" in text


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kl-phases", "2.5"], "expected a int"),
        (["--fkt-solver", "newton"], "invalid choice"),
        (["--radius", "nan"], "must be finite"),
    ],
)
def test_bad_hyperparameters_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# --- a toy algorithm, defined and registered here: one module's worth of code + one register line ---
@dataclass(frozen=True)
class ToyParams(Rounds, Clip):
    toy_step: float = param(0.5, "toy-one-step: the step size of its single noisy gradient step", positive=True)


class ToyOneStep(Algorithm[ToyParams]):
    """One noisy clipped-gradient step from w0: one Gaussian release of sensitivity 2C (replace-one)."""

    name = "toy-one-step"
    Params = ToyParams
    guarantee = Guarantee("zcdp")
    absence = ZERO_SUMS
    small: dict = {}
    audit = SmallAudit()

    def __init__(self, params: ToyParams, ctx: BuildContext):
        super().__init__(params, ctx)
        self.rho = ctx.rho_left

    def run(self, federation, releaser, w0, progress=None):
        users = list(range(federation.num_users))
        total = federation.sum(ClippedGradient(w0, self.params.clip), users).total()
        noisy = releaser.gaussian(
            total,
            sensitivity=2 * self.params.clip,
            rho=self.rho,
            user_ids=federation.ids_of(users),
            label="toy/step",
            details={},
        )
        w = w0 - self.params.toy_step * noisy.to(w0.dtype) / federation.num_users
        return ToyResult(w, 1)


@dataclass
class ToyResult(AlgorithmResult):
    w: torch.Tensor
    rounds: int


@pytest.fixture
def toy_algorithm():
    register(ToyOneStep)
    yield "toy-one-step"
    unregister("toy-one-step")


def test_a_toy_algorithm_registered_here_runs_through_fedkl_run_and_flower(tmp_path, toy_algorithm, capsys):
    out = tmp_path / "cli"
    assert (
        cli.main(
            [
                "run",
                "--algorithm",
                toy_algorithm,
                "--dataset",
                "synthetic-logistic",
                "--users",
                "20",
                "--toy-step",
                "0.25",
                "--noise-seed",
                "3",
                "--no-reference",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads((out / "result.json").read_text())
    assert result["algorithm"] == toy_algorithm and result["config"]["toy_step"] == 0.25
    assert result["epsilon"] <= 2.0 and result["test_metric"]["value"] is not None
    ledger = PrivacyLedger(out / "ledger.sqlite")
    ledger.verify()
    assert ledger.num_releases() == 1
    assert "toy-one-step hyperparameters" not in capsys.readouterr().out
    w = _flower_equals_inprocess(tmp_path, toy_algorithm, {"toy_step": 0.25})["w"]
    assert w is not None and bool(torch.isfinite(w).all()) and math.isfinite(float(w.norm()))


def test_every_registered_algorithm_has_a_small_setting():
    assert set(ALGORITHMS) == set(REGISTRY) <= set(SMALL), set(REGISTRY) - set(SMALL)


@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) & set(SMALL)))
def test_algorithm_over_flower_equals_inprocess(tmp_path, name):
    _flower_equals_inprocess(tmp_path, name, SMALL[name])


def test_dp_fedavg_adaptive_clip_over_flower_equals_inprocess(tmp_path):
    """--adaptive-clip: the server-side indicator count rides in the same release, bit for bit over Flower."""
    ref = _flower_equals_inprocess(
        tmp_path, "dp-fedavg", {**SMALL["dp-fedavg"], "adaptive_clip": True, "clip_count_noise": 5.0}
    )
    clips = [r["clip"] for r in ref["history"]]
    assert clips[0] == 1.0 and len(set(clips)) == len(clips) == 3  # the clip adapted every round


# paper 002 through the polynomial-time diameter test (CertifiedLocalMinimizer answers over Flower);
# 60 users > 8 kappa at these budgets
DIAMETER = {
    "phased-erm/matching": (
        "phased-erm",
        {
            "users": 60,
            "epsilon": 8.0,
            "reg": 0.1,
            "p002_phases": 2,
            "p002_test": "matching",
            "p002_delta_rule": "scaled",
            "p002_delta_scale": 50.0,
        },
    ),
    "sc-output-pert/vertex-cover": (
        "sc-output-pert",
        {"users": 40, "epsilon": 8.0, "reg": 0.5, "p002_test": "vertex-cover", "stability_delta": 0.5},
    ),
}


@pytest.mark.parametrize("case", sorted(DIAMETER))
def test_diameter_test_over_flower_equals_inprocess(tmp_path, case):
    name, kw = DIAMETER[case]
    out = _flower_equals_inprocess(tmp_path, name, kw)
    assert out["w"] is not None  # the settings release a model (not only ⊥)


@pytest.mark.parametrize("name,problem", [("gll-phased-sgd", "absolute"), ("noisy-fw", "huber")])
def test_robust_regression_gll_over_flower_equals_inprocess(tmp_path, name, problem):
    """The ClientApp rebuilds huber / absolute (its Moreau beta a public default) and answers like in-process."""
    _flower_equals_inprocess(tmp_path, name, SMALL[name], "synthetic-least-squares", problem)


def _flower_equals_inprocess(tmp_path, name, kw, dataset="synthetic-logistic", problem="logistic"):
    kw = dict(kw)
    users = kw.pop("users", 12)
    spec = codec.ClientSpec.build(
        dataset, problem, {"n_users": users, "m": 6, "d": 3, "seed": 2}, {"reg": kw.get("reg", 0.0)}
    )
    base = {
        **dict(
            dataset=dataset,
            problem=problem,
            algorithm=name,
            epsilon=3.0,
            rounds=3,
            lr=0.5,
            clip=1.0,
            seed=2,
            noise_seed=5,
            reference=False,
            force=True,
            kernels="reproducible",  # bit for bit against Flower
            clients="in-class",  # the opt-in the in-class algorithms need over Flower (harmless for the others)
        ),
        **kw,
    }  # tiny populations test the plumbing, not utility: skip the noise forecast
    quiet = dict(log=lambda s: None, spec=spec)
    # the base rounds/lr/clip apply to the algorithms that have them
    ref = run_flower_simulation(
        RunConfig.from_settings(strict=False, **base, out=str(tmp_path / "ref")), "inprocess", **quiet
    )
    fl = run_flower_simulation(  # Flower nodes holding blocks of 5 users (one user per node: tests/flower)
        RunConfig.from_settings(strict=False, **base, out=str(tmp_path / "fl")),
        "flower-local",
        users_per_node=5,
        **quiet,
    )
    assert fl["user_ids"] == ref["user_ids"]
    assert (fl["w"] is None) == (ref["w"] is None)
    if ref["w"] is not None:
        assert torch.equal(fl["w"], ref["w"])
    views = []
    for out in (ref, fl):
        with PrivacyLedger(out["ledger_path"]) as led:
            led.verify()
            views.append([(u, led.spend(u)) for u in out["user_ids"]])
    assert views[0] == views[1]
    assert ref["ledger"]["releases"] == fl["ledger"]["releases"] >= 1
    return ref


def test_new_query_kinds_over_flower_sim_ray(tmp_path):
    """DP-FedAvg's ClippedLocalUpdate and KL-Spider's GradientDifference through Flower's Ray
    simulation engine (one virtual SuperNode per user) release the in-process model bit for bit."""
    spec = codec.ClientSpec.build(
        "synthetic-logistic", "logistic", {"n_users": 6, "m": 5, "d": 3, "seed": 1}, {"reg": 0.1}
    )
    quiet = dict(log=lambda s: None, spec=spec)
    for name in ("dp-fedavg", "kl-spider"):
        base = {
            **dict(
                dataset="synthetic-logistic",
                problem="logistic",
                algorithm=name,
                epsilon=3.0,
                rounds=2,
                lr=0.5,
                seed=1,
                noise_seed=3,
                reference=False,
                reg=0.1,
                kernels="reproducible",  # bit for bit against Flower
            ),
            **SMALL[name],
        }
        base.pop("users", None)
        ref = run_flower_simulation(
            RunConfig.from_settings(strict=False, **base, out=str(tmp_path / f"{name}-ref")), "inprocess", **quiet
        )
        sim = run_flower_simulation(
            RunConfig.from_settings(strict=False, **base, out=str(tmp_path / f"{name}-sim")), "flower-sim", **quiet
        )
        assert sim["user_ids"] == ref["user_ids"] and torch.equal(sim["w"], ref["w"]), name
        assert sim["ledger"]["releases"] == ref["ledger"]["releases"] >= 1


def test_what_clients_see_is_declared_for_every_algorithm(capsys):
    """Every algorithm declares what a participating client receives; the attack-model table
    (docs/concepts/attack-model.md), `--help` and the fkt one-shot mode agree with the declarations."""
    import fnmatch
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "concepts" / "attack-model.md").read_text()
    table = page.split("* **What each party sees", 1)[1].split("* **Public facts", 1)[0]
    rows = [r for r in table.splitlines() if r.strip().startswith("| `")]
    seen = set()
    for row in rows:
        names, _, private = [c.strip() for c in row.strip().strip("|").split("|")]
        default_private = private.startswith("yes")
        for pattern in re.findall(r"`([a-z0-9*-]+)`", names):
            matched = fnmatch.filter(REGISTRY, pattern)
            assert matched, pattern
            for name in matched:
                spec = REGISTRY[name]
                assert spec.clients_see(spec.params()).private_only == default_private, name
                seen.add(name)
    assert seen == set(REGISTRY), set(REGISTRY) - seen
    one_shot = REGISTRY["fkt-phased-erm"]
    assert one_shot.clients_see(one_shot.params(fkt_solver="one-shot")).private_only
    with pytest.raises(SystemExit):
        cli.main(["run", "--algorithm", "fkt-snowball", "--help"])
    assert "What a participating client sees: NOT only private values" in capsys.readouterr().out


def test_register_requires_the_absence_declaration():
    """Every algorithm says how an absent, failed or non-finite user enters its releases (issue 28 §3):
    register refuses one without it, or one whose catch-all rules leave a relation or backend uncovered."""
    from fedkl.privacy.guarantee import Absence

    @dataclass(frozen=True)
    class Undeclared(AlgorithmParams):
        pass

    with pytest.raises(TypeError, match="absence"):
        register(_declared("no-absence", Undeclared, absence=None))
    partial = Absence("zero", "zero rows", relations=("add-remove",))
    with pytest.raises(TypeError, match="replace-one"):
        register(_declared("partial-absence", Undeclared, absence=(partial,)))
    assert "no-absence" not in REGISTRY and "partial-absence" not in REGISTRY
    for spec in REGISTRY.values():
        for relation in ("replace-one", "add-remove"):
            for backend in ("inprocess", "flower"):
                assert spec.absence_rule("any/label", relation, backend).mode in ("zero", "left-out", "replaced")
