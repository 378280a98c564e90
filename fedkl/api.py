"""fedkl from Python: one call trains a user-level DP model and tells you what it cost.

    >>> import numpy as np, fedkl
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(3000, 4)) / 2
    >>> users = rng.integers(0, 150, size=3000)            # the owner of every record: the unit of privacy
    >>> y = np.where(X[:, 0] - X[:, 1] + 0.2 * rng.normal(size=3000) > 0, 1, 0)
    >>> data = fedkl.from_arrays(X, y, users, task="binary")
    >>> run = fedkl.train(data, algorithm="noisy-gd", epsilon=2.0, noise_seed=0, log=None)
    >>> run.epsilon <= 2.0, run.delta == 1 / 150 ** 1.1
    (True, True)
    >>> run.metrics["accuracy"] > 0.8 > run.baseline["accuracy"]
    True
    >>> sgd = fedkl.algorithm("dp-sgd", rounds=30, lr=2.0)  # typed: checked here, before any data
    >>> fedkl.train(data, sgd, epsilon=2.0, noise_seed=0, log=None).result["config"]["rounds"]
    30
    >>> fedkl.algorithm("dp-sgd", roundz=3)
    Traceback (most recent call last):
        ...
    TypeError: dp-sgd has no hyperparameter 'roundz'; its hyperparameters: accountant, ..., rounds, sampling_rate

``train`` runs exactly what ``fedkl run`` runs (:func:`fedkl.runner.run_training`): the budget is
charged per user to a durable ledger before each release, and ``run.result`` is the result.json
payload. ``data`` is a dataset name (``fedkl.data.DATASETS``) or a :class:`~fedkl.data.FederatedDataset`
(:func:`fedkl.from_arrays`, :func:`fedkl.from_dataframe`); the algorithm's hyperparameters are the
``fedkl run`` flags as keywords (``rounds=20, clip=0.5``; ``fedkl run --help`` lists them).

:func:`load_model` reads a run's ``model.pt`` back (:mod:`fedkl.saved_model`: the released
parameters, the problem and the privacy receipt) as a :class:`SavedModel` that predicts
(``.predict(X)``) and evaluates (``.evaluate(dataset)``)::

    model = fedkl.load_model(run.result["model_path"])
    model.receipt["epsilon"], model.predict(X[:5])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fedkl.algorithms.registry import AlgorithmParams, algorithm_spec
from fedkl.data.base import FederatedDataset
from fedkl.runner import RunConfig, run_training, settings_fields
from fedkl.saved_model import SavedModel, load_model


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm with its typed hyperparameters (:func:`algorithm`)."""

    name: str
    params: AlgorithmParams

    def settings(self) -> dict:
        return {"algorithm": self.name, **dataclasses.asdict(self.params)}


def algorithm(name: str, **hyperparameters: Any) -> Algorithm:
    """``name``'s hyperparameters, typed and checked now (a wrong name, type, choice or range is an
    error here, before any data is read): ``fedkl.train(data, fedkl.algorithm("dp-sgd", rounds=30))``.
    The keywords are the ``fedkl run --algorithm NAME`` flags (``fedkl run --algorithm NAME --help``)."""
    spec = algorithm_spec(name)
    own = sorted(f.name for f in dataclasses.fields(spec.params))
    unknown = sorted(set(hyperparameters) - set(own))
    if unknown:
        raise TypeError(f"{name} has no hyperparameter {unknown[0]!r}; its hyperparameters: {', '.join(own)}")
    return Algorithm(name, spec.params(**hyperparameters))


@dataclass(frozen=True)
class TrainedModel:
    """What :func:`train` returns.

    Attributes:
        model: the released parameters (a private output), or None when the algorithm released ⊥.
        epsilon, delta: the user-level privacy spent (the ledger's largest per-user epsilon) and delta.
        metrics: test metrics of the model (NOT private: held-out records of the same users).
        baseline: the majority-class / constant predictor's metrics on the same test records.
        result: the full result.json payload; ``result["out_dir"]`` holds it and the ledger.
    """

    model: torch.Tensor | None
    epsilon: float
    delta: float
    metrics: dict
    baseline: dict
    result: dict

    @classmethod
    def of(cls, result: dict, network: Any = None) -> TrainedModel:
        """The model a run's or a search's ``result`` saved (``network``: as :func:`load_model`'s ``model``)."""
        w = None if result["model_path"] is None else load_model(result["model_path"], model=network).params
        metrics, baseline = dict(result["test_metrics"]), dict(result.get("trivial_baseline", {}))
        return cls(w, float(result["epsilon"]), float(result["delta"]), metrics, baseline, result)


def train(
    data: str | FederatedDataset,
    algorithm: str | Algorithm = "noisy-gd",
    *,
    epsilon: float = 2.0,
    delta: float | None = None,
    log: Callable[[str], None] | None = print,
    model: str | Callable | torch.nn.Module | None = None,
    **settings: Any,
) -> TrainedModel:
    """Train ``algorithm`` (a registered name, or :func:`algorithm`'s typed choice) on ``data`` at
    user-level (epsilon, delta) (module docstring).

    ``settings`` are the ``fedkl run`` settings: :class:`~fedkl.runner.RunConfig`'s run-level fields
    (``problem``, ``reg``, ``noise_seed``, ``ledger``, ``out``, ``reference``, ...) and the
    algorithm's hyperparameters (``rounds``, ``lr``, ``clip``, ...; ``fedkl run --algorithm NAME
    --help`` lists them). A setting the algorithm does not use, at a non-default value, is a
    ValueError. The non-private
    reference is off unless ``reference=True`` (it trains a second, non-private model). ``log=None``
    is silent.

    ``model``: your own network for the gradient algorithms (problem ``torch``,
    :mod:`fedkl.problems.torch_model`): an import spec ``"package.module:factory"`` (any backend),
    or a factory ``factory(input_dim, num_outputs) -> nn.Module`` or a module (in-process).
    """
    unknown = sorted(set(settings) - set(settings_fields()))
    if unknown:
        raise TypeError(
            f"unknown setting(s) {unknown}; valid: {sorted(set(settings_fields()) - {'dataset', 'algorithm'})}"
        )
    settings.setdefault("reference", False)
    dataset = None
    if isinstance(data, FederatedDataset):
        dataset, name = data, data.name
    elif isinstance(data, str):
        name = data
    else:
        raise TypeError(f"data must be a dataset name or a FederatedDataset (fedkl.from_arrays), got {type(data)}")
    if isinstance(algorithm, Algorithm):
        clash = sorted(set(settings) & set(dataclasses.asdict(algorithm.params)))
        if clash:
            raise TypeError(f"{clash[0]!r} is set in fedkl.algorithm(...); do not repeat it in train(...)")
        settings = {**settings, **dataclasses.asdict(algorithm.params)}
        algorithm = algorithm.name
    if model is not None:
        settings.setdefault("problem", "torch")
        if isinstance(model, str):
            settings["model"] = model
    cfg = RunConfig.from_settings(dataset=name, algorithm=algorithm, epsilon=epsilon, delta=delta, **settings)
    if cfg.backend != "inprocess":
        import fedkl.flower.backends  # noqa: F401  (registers the Flower backends)
    network = None if model is None or isinstance(model, str) else model
    result = run_training(cfg, log=log or (lambda _: None), dataset=dataset, model=network)
    return TrainedModel.of(result, network)


def tune(
    data: str | FederatedDataset,
    algorithms: str | list[str] | tuple[str, ...] = ("noisy-gd",),
    grid: dict | None = None,
    *,
    epsilon: float = 2.0,
    delta: float | None = None,
    trials: float = 5.0,
    stopping: str = "tnb",
    eta: float = 0.0,
    validation_fraction: float = 0.3,
    score_bound: float = 1.0,
    operator_view: bool = False,
    log: Callable[[str], None] | None = print,
    **settings: Any,
) -> TrainedModel:
    """``fedkl tune`` from Python (:mod:`fedkl.tuning`): a private search over ``algorithms`` x ``grid``
    (``{"lr": [0.5, 1, 2], "clip": [0.5, 1]}``) at user-level (epsilon, delta) for the WHOLE search,
    charged once to the ledger before any trial. Returns the selected model as a :class:`TrainedModel`
    (``result["selected"]``: its algorithm, settings and private validation score; ``result["search"]``:
    the charge). ``settings``: the run-level ``fedkl run`` settings (``noise_seed``, ``out``, ``ledger``,
    ``seed``, ``users``, ``problem`` ...) and hyperparameters fixed for every trial. ``operator_view``: also
    write the NOT PUBLIC table and plot of every trial (``fedkl tune --operator-view``; default off)."""
    from fedkl.tuning import run_settings_and_grid
    from fedkl.tuning import tune as _tune

    names = [algorithms] if isinstance(algorithms, str) else list(algorithms)
    unknown = sorted(set(settings) - set(settings_fields()))
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}")
    dataset = data if isinstance(data, FederatedDataset) else None
    name = data.name if dataset is not None else data
    cfg, full_grid = run_settings_and_grid(
        {**settings, "dataset": name, "epsilon": epsilon, "delta": delta, "reference": False}, names, grid or {}
    )
    result = _tune(
        cfg, names, full_grid, trials=trials, stopping=stopping, eta=eta, validation_fraction=validation_fraction,
        score_bound=score_bound, log=log or (lambda _: None), dataset=dataset, operator_view=operator_view,
    )  # fmt: skip
    return TrainedModel.of(result)


__all__ = ["Algorithm", "SavedModel", "TrainedModel", "algorithm", "load_model", "train", "tune"]
