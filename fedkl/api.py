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

from dataclasses import dataclass
from typing import Any, Callable

import torch

from fedkl.data.base import FederatedDataset
from fedkl.runner import RunConfig, run_training, settings_fields
from fedkl.saved_model import SavedModel, load_model


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


def train(
    data: str | FederatedDataset,
    algorithm: str = "noisy-gd",
    *,
    epsilon: float = 2.0,
    delta: float | None = None,
    log: Callable[[str], None] | None = print,
    **settings: Any,
) -> TrainedModel:
    """Train ``algorithm`` on ``data`` at user-level (epsilon, delta) (module docstring).

    ``settings`` are the ``fedkl run`` settings: :class:`~fedkl.runner.RunConfig`'s run-level fields
    (``problem``, ``reg``, ``noise_seed``, ``ledger``, ``out``, ``reference``, ...) and the
    algorithm's hyperparameters (``rounds``, ``lr``, ``clip``, ...; ``fedkl run --algorithm NAME
    --help`` lists them). A setting the algorithm does not use, at a non-default value, is a
    ValueError. The non-private
    reference is off unless ``reference=True`` (it trains a second, non-private model). ``log=None``
    is silent.
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
    cfg = RunConfig.from_settings(dataset=name, algorithm=algorithm, epsilon=epsilon, delta=delta, **settings)
    if cfg.backend != "inprocess":
        import fedkl.flower.backends  # noqa: F401  (registers the Flower backends)
    result = run_training(cfg, log=log or (lambda _: None), dataset=dataset)
    w = None if result["model_path"] is None else load_model(result["model_path"]).params
    return TrainedModel(
        model=w,
        epsilon=float(result["epsilon"]),
        delta=float(result["delta"]),
        metrics=dict(result["test_metrics"]),
        baseline=dict(result["trivial_baseline"]),
        result=result,
    )


__all__ = ["SavedModel", "TrainedModel", "load_model", "train"]
