"""Per-user objectives: the problem classes and :func:`make_problem`.

Names: ``logistic`` and ``smoothed-hinge`` (binary ±1 labels), ``softmax`` and ``mlp`` (multiclass,
or binary read as classes 0/1), ``least-squares`` (regression; its label bound comes from
``dataset.extra["label_bound"]`` unless ``label_bound=`` is given).
"""

from __future__ import annotations

from fedkl.data.base import FederatedDataset
from fedkl.problems.base import Constants, Problem, user_means
from fedkl.problems.hinge import SmoothedHinge
from fedkl.problems.least_squares import LeastSquares
from fedkl.problems.logistic import BinaryLogistic
from fedkl.problems.mlp import MLP
from fedkl.problems.multiclass import SoftmaxRegression

PROBLEMS = ("logistic", "softmax", "least-squares", "smoothed-hinge", "mlp")
# the problem a run uses when none is named, per task (fedkl run, fedkl.train, the Flower clients)
DEFAULT_PROBLEM = {"binary": "logistic", "multiclass": "softmax", "regression": "least-squares"}
_TASKS = {
    "logistic": ("binary",),
    "smoothed-hinge": ("binary",),
    "softmax": ("binary", "multiclass"),
    "mlp": ("binary", "multiclass"),
    "least-squares": ("regression",),
}


def problem_spec(name: str, dataset: FederatedDataset, reg: float = 0.0) -> dict:
    """The public description of problem ``name`` sized for ``dataset``: what
    :func:`problem_from_spec` rebuilds it from without the data (a saved model keeps it)."""
    if name not in _TASKS:
        raise ValueError(f"unknown problem {name!r}; valid names: {', '.join(PROBLEMS)}")
    if dataset.task not in _TASKS[name]:
        raise ValueError(
            f"problem {name!r} needs a {' or '.join(_TASKS[name])} task, but dataset {dataset.name!r} is {dataset.task}"
        )
    spec = {"name": name, "task": dataset.task, "dim": dataset.train.dim, "reg": float(reg)}
    if name in ("softmax", "mlp"):
        spec["num_classes"] = 2 if dataset.task == "binary" else dataset.num_classes
    if name == "least-squares":
        spec["label_bound"] = dataset.extra.get("label_bound")
    return spec


def problem_from_spec(spec: dict, **kw) -> Problem:
    """The problem a :func:`problem_spec` describes (extra keyword arguments go to its constructor)."""
    name, dim, reg = spec["name"], int(spec["dim"]), float(spec["reg"])
    if name == "logistic":
        return BinaryLogistic(dim, reg, **kw)
    if name == "smoothed-hinge":
        return SmoothedHinge(dim, reg, **kw)
    if name == "least-squares":
        kw.setdefault("label_bound", spec.get("label_bound"))
        return LeastSquares(dim, reg, **kw)
    if name == "softmax":
        return SoftmaxRegression(dim, spec["num_classes"], reg, **kw)
    if name == "mlp":
        return MLP(dim, num_classes=spec["num_classes"], reg=reg, **kw)
    raise ValueError(f"unknown problem {name!r}; valid names: {', '.join(PROBLEMS)}")


def make_problem(name: str, dataset: FederatedDataset, reg: float = 0.0, **kw) -> Problem:
    """The problem ``name`` sized for ``dataset`` (extra keyword arguments go to its constructor)."""
    return problem_from_spec(problem_spec(name, dataset, reg), **kw)


__all__ = [
    "BinaryLogistic",
    "Constants",
    "DEFAULT_PROBLEM",
    "LeastSquares",
    "MLP",
    "PROBLEMS",
    "Problem",
    "SmoothedHinge",
    "SoftmaxRegression",
    "make_problem",
    "problem_from_spec",
    "problem_spec",
    "user_means",
]
