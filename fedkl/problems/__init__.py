"""Per-user objectives: the problem classes and :func:`make_problem`.

Names: ``logistic`` and ``smoothed-hinge`` (binary ±1 labels), ``softmax`` and ``mlp`` (multiclass,
or binary read as classes 0/1), ``least-squares`` (regression; its label bound comes from
``dataset.extra["label_bound"]`` unless ``label_bound=`` is given), ``huber`` and ``absolute`` (robust
regression GLLs, :mod:`fedkl.problems.robust_regression`; ``absolute`` trains on its Moreau envelope), and ``torch``: your own
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
from fedkl.problems.robust_regression import AbsoluteLoss, Huber
from fedkl.problems.torch_model import TorchModel

PROBLEMS = ("logistic", "softmax", "least-squares", "smoothed-hinge", "mlp", "torch", "huber", "absolute")
# the problem a run uses when none is named, per task (fedkl run, fedkl.train, the Flower clients)
DEFAULT_PROBLEM = {"binary": "logistic", "multiclass": "softmax", "regression": "least-squares"}
_TASKS = {
    "logistic": ("binary",),
    "smoothed-hinge": ("binary",),
    "softmax": ("binary", "multiclass"),
    "mlp": ("binary", "multiclass"),
    "least-squares": ("regression",),
    "huber": ("regression",),
    "absolute": ("regression",),
    "torch": ("binary", "multiclass", "regression"),
}


def problem_spec(name: str, dataset: FederatedDataset, reg: float = 0.0, model=None) -> dict:
    """The public description of problem ``name`` sized for ``dataset``: what
    :func:`problem_from_spec` rebuilds it from without the data (a saved model keeps it). ``torch``
    needs ``model`` (kept in the spec when it is an import spec; a factory or module object is not
    serialisable, so :func:`problem_from_spec` then needs it again), and ``model`` is refused for
    the other problems."""
    if name not in _TASKS:
        raise ValueError(f"unknown problem {name!r}; valid names: {', '.join(PROBLEMS)}")
    if dataset.task not in _TASKS[name]:
        raise ValueError(
            f"problem {name!r} needs a {' or '.join(_TASKS[name])} task, but dataset {dataset.name!r} is {dataset.task}"
        )
    if (name == "torch") != (model is not None):
        raise ValueError(
            "problem 'torch' needs a model ('package.module:factory')"
            if name == "torch"
            else f"a model is given, but problem {name!r} is not 'torch' (use --problem torch)"
        )
    spec = {"name": name, "task": dataset.task, "dim": dataset.train.dim, "reg": float(reg)}
    if name in ("softmax", "mlp", "torch"):
        spec["num_classes"] = 2 if dataset.task == "binary" else dataset.num_classes
    if name == "torch":
        spec["model"] = model if isinstance(model, str) else None
    if name in ("least-squares", "huber", "absolute"):
        spec["label_bound"] = dataset.extra.get("label_bound")
    return spec


def problem_from_spec(spec: dict, model=None, **kw) -> Problem:
    """The problem a :func:`problem_spec` describes (extra keyword arguments go to its constructor;
    ``model``: a torch problem's network when its spec holds none)."""
    name, dim, reg = spec["name"], int(spec["dim"]), float(spec["reg"])
    if name == "logistic":
        return BinaryLogistic(dim, reg, **kw)
    if name == "smoothed-hinge":
        return SmoothedHinge(dim, reg, **kw)
    if name == "least-squares":
        kw.setdefault("label_bound", spec.get("label_bound"))
        return LeastSquares(dim, reg, **kw)
    if name in ("huber", "absolute"):
        kw.setdefault("label_bound", spec.get("label_bound"))
        return (Huber if name == "huber" else AbsoluteLoss)(dim, reg, **kw)
    if name == "softmax":
        return SoftmaxRegression(dim, spec["num_classes"], reg, **kw)
    if name == "mlp":
        return MLP(dim, num_classes=spec["num_classes"], reg=reg, **kw)
    if name == "torch":
        source = model if model is not None else spec.get("model")
        if source is None:
            raise ValueError("this torch problem's network was given as an object: pass model= to rebuild it")
        return TorchModel(source, dim, spec["task"], spec["num_classes"], reg, **kw)
    raise ValueError(f"unknown problem {name!r}; valid names: {', '.join(PROBLEMS)}")


def make_problem(name: str, dataset: FederatedDataset, reg: float = 0.0, **kw) -> Problem:
    """The problem ``name`` sized for ``dataset`` (extra keyword arguments go to its constructor;
    ``torch`` needs ``model=``, and ``model=`` is refused for the other problems)."""
    model = kw.pop("model", None)
    return problem_from_spec(problem_spec(name, dataset, reg, model), model=model, **kw)


__all__ = [
    "AbsoluteLoss",
    "BinaryLogistic",
    "Constants",
    "DEFAULT_PROBLEM",
    "Huber",
    "LeastSquares",
    "MLP",
    "PROBLEMS",
    "Problem",
    "SmoothedHinge",
    "SoftmaxRegression",
    "TorchModel",
    "make_problem",
    "problem_from_spec",
    "problem_spec",
    "user_means",
]
