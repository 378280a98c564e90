"""Per-user objectives: the problem classes and :func:`make_problem`.

Names: ``logistic`` and ``smoothed-hinge`` (binary ±1 labels), ``softmax`` and ``mlp`` (multiclass,
or binary read as classes 0/1), ``least-squares`` (regression; its label bound comes from
``dataset.extra["label_bound"]`` unless ``label_bound=`` is given), and ``torch``: your own
``torch.nn.Module`` (:mod:`fedkl.problems.torch_model`; ``model=`` an import spec
``"package.module:factory"``, a factory or a module) for any task.
"""

from __future__ import annotations

from fedkl.data.base import FederatedDataset
from fedkl.problems.base import Constants, Problem, user_means
from fedkl.problems.hinge import SmoothedHinge
from fedkl.problems.least_squares import LeastSquares
from fedkl.problems.logistic import BinaryLogistic
from fedkl.problems.mlp import MLP
from fedkl.problems.multiclass import SoftmaxRegression
from fedkl.problems.torch_model import TorchModel

PROBLEMS = ("logistic", "softmax", "least-squares", "smoothed-hinge", "mlp", "torch")
# the problem a run uses when none is named, per task (fedkl run, fedkl.train, the Flower clients)
DEFAULT_PROBLEM = {"binary": "logistic", "multiclass": "softmax", "regression": "least-squares"}
_TASKS = {
    "logistic": ("binary",),
    "smoothed-hinge": ("binary",),
    "softmax": ("binary", "multiclass"),
    "mlp": ("binary", "multiclass"),
    "least-squares": ("regression",),
    "torch": ("binary", "multiclass", "regression"),
}


def make_problem(name: str, dataset: FederatedDataset, reg: float = 0.0, **kw) -> Problem:
    """The problem ``name`` sized for ``dataset`` (extra keyword arguments go to its constructor;
    ``torch`` needs ``model=``, and ``model=`` is refused for the other problems)."""
    if name not in _TASKS:
        raise ValueError(f"unknown problem {name!r}; valid names: {', '.join(PROBLEMS)}")
    if dataset.task not in _TASKS[name]:
        raise ValueError(
            f"problem {name!r} needs a {' or '.join(_TASKS[name])} task, but dataset {dataset.name!r} is {dataset.task}"
        )
    dim = dataset.train.dim
    model = kw.pop("model", None)
    if (name == "torch") != (model is not None):
        raise ValueError(
            "problem 'torch' needs a model ('package.module:factory')"
            if name == "torch"
            else f"a model is given, but problem {name!r} is not 'torch' (use --problem torch)"
        )
    if name == "logistic":
        return BinaryLogistic(dim, reg, **kw)
    if name == "smoothed-hinge":
        return SmoothedHinge(dim, reg, **kw)
    if name == "least-squares":
        kw.setdefault("label_bound", dataset.extra.get("label_bound"))
        return LeastSquares(dim, reg, **kw)
    num_classes = 2 if dataset.task == "binary" else dataset.num_classes
    if name == "torch":
        return TorchModel(model, dim, dataset.task, num_classes, reg, **kw)
    if name == "softmax":
        return SoftmaxRegression(dim, num_classes, reg, **kw)
    return MLP(dim, num_classes=num_classes, reg=reg, **kw)


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
    "TorchModel",
    "make_problem",
    "user_means",
]
