"""Per-user objectives: the problem classes and :func:`make_problem`.

Names: ``logistic`` and ``smoothed-hinge`` (binary ±1 labels), ``softmax`` and ``mlp`` (multiclass,
or binary read as classes 0/1), ``least-squares`` (regression; its label bound comes from
``dataset.extra["label_bound"]`` unless ``label_bound=`` is given), ``huber`` and ``absolute`` (robust
regression GLLs, :mod:`fedkl.problems.robust_regression`; ``absolute`` trains on its Moreau envelope), and ``torch``: your own
``torch.nn.Module`` (:mod:`fedkl.problems.torch_model`; ``model=`` an import spec
``"package.module:factory"``, a factory or a module) for any task.
"""

from __future__ import annotations

import torch

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


DTYPES = ("float32", "float64")  # the float types a problem computes in (its spec's "dtype")


def default_dtype(name: str) -> str:
    """The float type problem ``name`` computes in unless told: float32 for torch models (a torch
    network's own dtype: :class:`TorchModel`'s default), float64 for every other problem."""
    return "float32" if name in ("mlp", "torch") else "float64"


def problem_spec(name: str, dataset: FederatedDataset, reg: float = 0.0, model=None, dtype: str | None = None) -> dict:
    """The public description of problem ``name`` sized for ``dataset``: what
    :func:`problem_from_spec` rebuilds it from without the data (a saved model keeps it). ``torch``
    needs ``model`` (kept in the spec when it is an import spec; a factory or module object is not
    serialisable, so :func:`problem_from_spec` then needs it again), and ``model`` is refused for
    the other problems. ``dtype``: the float type it computes in (None: :func:`default_dtype`), recorded."""
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
    dtype = default_dtype(name) if dtype is None else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    spec = {"name": name, "task": dataset.task, "dim": dataset.train.dim, "reg": float(reg), "dtype": dtype}
    if name in ("softmax", "mlp", "torch"):
        spec["num_classes"] = 2 if dataset.task == "binary" else dataset.num_classes
    if name == "torch":
        spec["model"] = model if isinstance(model, str) else None
    if name in ("least-squares", "huber", "absolute"):
        spec["label_bound"] = dataset.extra.get("label_bound")
    return spec


def problem_from_spec(spec: dict, model=None, **kw) -> Problem:
    """The problem a :func:`problem_spec` describes (extra keyword arguments go to its constructor;
    ``model``: a torch problem's network when its spec holds none; a spec without ``dtype``, written
    before it was recorded, is the problem's :func:`default_dtype`)."""
    name, dim, reg = spec["name"], int(spec["dim"]), float(spec["reg"])
    kw.setdefault("dtype", getattr(torch, spec.get("dtype") or default_dtype(name)))
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
    ``torch`` needs ``model=``, and ``model=`` is refused for the other problems; ``dtype=`` a
    ``torch.dtype`` or one of :data:`DTYPES`, None: :func:`default_dtype`)."""
    model = kw.pop("model", None)
    dtype = kw.pop("dtype", None)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return problem_from_spec(problem_spec(name, dataset, reg, model, dtype), model=model, **kw)


__all__ = [
    "AbsoluteLoss",
    "BinaryLogistic",
    "Constants",
    "DEFAULT_PROBLEM",
    "DTYPES",
    "Huber",
    "LeastSquares",
    "MLP",
    "PROBLEMS",
    "Problem",
    "default_dtype",
    "SmoothedHinge",
    "SoftmaxRegression",
    "TorchModel",
    "make_problem",
    "problem_from_spec",
    "problem_spec",
    "user_means",
]
