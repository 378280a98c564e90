"""fedkl: federated learning with user-level differential privacy.

The public Python API (one screen; ``fedkl.api``'s docstring has a runnable example):

* :func:`train` (``fedkl.train(data, algorithm="noisy-gd", epsilon=2.0, ...)``) trains one
  registered algorithm at a user-level (epsilon, delta) budget, charging a per-user ledger, and
  returns a :class:`TrainedModel` (model, epsilon, delta, metrics, the result.json payload);
* :func:`tune` (``fedkl.tune(data, ["noisy-gd"], {"lr": [0.5, 1]}, epsilon=2.0)``) picks the algorithm
  and its settings by a private search whose whole cost is one ledger charge (:mod:`fedkl.tuning`);
* :func:`algorithm` (``fedkl.algorithm("dp-sgd", rounds=30)``) is an algorithm with typed
  hyperparameters, checked before any data is read, for ``train(data, algorithm=...)``;
* :func:`load_model` (``fedkl.load_model("runs/.../model.pt")``) reads a run's released model and
  its privacy receipt back as a :class:`SavedModel` (``.predict(X)``, ``.evaluate(dataset)``);
* :func:`from_arrays` / :func:`from_dataframe` build a user-partitioned dataset from your records
  and a user-id column (:mod:`fedkl.data.custom`);
* the layers below, for research use: :mod:`fedkl.privacy` (mechanisms, accountants, ledger,
  Releaser), :mod:`fedkl.problems`, :mod:`fedkl.data`, :mod:`fedkl.federation` (the Federation
  interface and its backends), :mod:`fedkl.algorithms`.

The names are resolved on first use, so ``import fedkl.flower.codec`` (a Flower client) does not
import the training stack.
"""

from __future__ import annotations

_LAZY = {
    "algorithm": "fedkl.api",
    "Algorithm": "fedkl.api",
    "train": "fedkl.api",
    "tune": "fedkl.api",
    "TrainedModel": "fedkl.api",
    "load_model": "fedkl.api",
    "SavedModel": "fedkl.api",
    "from_arrays": "fedkl.data.custom",
    "from_dataframe": "fedkl.data.custom",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fedkl' has no attribute {name!r}")
