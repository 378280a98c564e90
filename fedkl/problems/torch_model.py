"""Your own ``torch.nn.Module`` as the per-user objective (non-convex: the algorithms rely on
clipping the per-user gradients, which is what bounds the sensitivity anyway).

Give the module as a spec ``"package.module:factory"`` or ``"path/to/file.py:factory"`` (what
``fedkl run --problem torch --model ...``, a TOML file and a Flower client name, so every client
builds the same network: in a deployment the module or file must exist on every client) or, from Python, as a factory or a module object (:func:`fedkl.train`, in-process).
A factory is called as ``factory(input_dim, num_outputs)`` and returns the module; its parameters
at that moment are the starting point, drawn under ``torch.manual_seed(seed)`` (a module object
keeps the parameters it has). The module maps a batch of flat feature rows ``(B, input_dim)`` to
``(B, num_outputs)``: logits of the classes (binary tasks read ±1 labels as classes 0/1), or one
prediction per row for regression (loss ``(f(x) - y)^2 / 2``). A module that needs an image shape
reshapes its input itself (``x.view(-1, 1, 28, 28)``).

Parameters are one flat vector, the concatenation of ``named_parameters()`` in order (the order of
``torch.nn.utils.parameters_to_vector``). Per-user gradients: per-record gradients by
``torch.func.vmap(torch.func.grad(...))`` over chunks of records, summed into users with
``index_add_``: no loop over users, and every record's gradient depends on that record alone.

Refused, with one line, at construction: modules with buffers (BatchNorm's running statistics
mix records of different users in training mode, a cross-user operation that breaks the per-user
sensitivity; use GroupNorm or LayerNorm), modules without parameters, and modules whose output
shape does not fit the task.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedkl.data.base import UserData
from fedkl.problems.base import Constants, Problem
from fedkl.problems.least_squares import mean_label_metrics
from fedkl.problems.multiclass import class_labels, majority_class_metrics

TASKS = ("binary", "multiclass", "regression")
ModelSource = Union[str, Callable[[int, int], torch.nn.Module], torch.nn.Module]


def load_factory(spec: str) -> Callable[[int, int], torch.nn.Module]:
    """The factory a spec names: ``"package.module:name"`` (imported) or ``"path/to/file.py:name"``
    (loaded from that file, relative to the working directory). One-line errors."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"a model spec is 'package.module:factory' or 'path/file.py:factory', got {spec!r}")
    module_name, attr = spec.split(":")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise ImportError(f"no file {module_name}")
            loader_spec = importlib.util.spec_from_file_location(
                f"fedkl_user_model_{abs(hash(module_name))}", module_name
            )
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as e:
        raise ValueError(f"model spec {spec!r}: cannot load {module_name!r} ({e})") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model spec {spec!r}: {module_name} has no callable {attr!r}")
    return factory


class TorchModel(Problem):
    """See the module docstring. ``task``: ``binary``, ``multiclass`` (``num_classes`` outputs) or
    ``regression`` (one output)."""

    name = "torch"
    convex = False

    def __init__(
        self,
        model: ModelSource,
        dim: int,
        task: str = "multiclass",
        num_classes: int = 2,
        reg: float = 0.0,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        chunk_size: int = 4096,
    ) -> None:
        super().__init__(dim, reg, dtype)
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        self.task = task
        self.num_classes = 1 if task == "regression" else int(num_classes)
        if task != "regression" and self.num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        self.seed = int(seed)
        self.chunk_size = int(chunk_size)
        self.spec = model if isinstance(model, str) else None
        self._source = load_factory(model) if isinstance(model, str) else model
        self.module = self._build(self.seed)
        self._shapes = [(name, p.shape, p.numel()) for name, p in self.module.named_parameters()]
        self._num_params = sum(n for _, _, n in self._shapes)
        self._check_module()

    # --- the network -----------------------------------------------------------------------------
    def _make(self) -> torch.nn.Module:
        """A fresh module from the factory (or a copy of the given module), in this problem's dtype."""
        if isinstance(self._source, torch.nn.Module):
            return copy.deepcopy(self._source).to(self.dtype)
        module = self._source(self.dim, self.num_classes)
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"the model factory must return a torch.nn.Module, got {type(module).__name__}")
        return module.to(self.dtype)

    def _build(self, seed: int) -> torch.nn.Module:
        """The network with its initialization drawn under ``seed`` (a module object: as given)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self._make()

    def _check_module(self) -> None:
        if self._num_params == 0:
            raise ValueError("the model has no parameters to train")
        if next(self.module.buffers(), None) is not None:
            names = sorted(
                {type(m).__name__ for m in self.module.modules() if next(m.buffers(recurse=False), None) is not None}
            )
            raise ValueError(
                f"the model has buffers ({', '.join(names)}): batch statistics mix records of different users, "
                "which breaks the per-user sensitivity; use GroupNorm or LayerNorm instead of BatchNorm"
            )
        with torch.no_grad():
            out = self.module(torch.zeros(2, self.dim, dtype=self.dtype))
        want = (2, self.num_classes)
        if tuple(out.shape) != want and not (self.task == "regression" and tuple(out.shape) == (2,)):
            raise ValueError(
                f"the model maps (B, {self.dim}) features to {tuple(out.shape)[1:]}; this "
                f"{self.task} task needs (B, {self.num_classes})"
            )

    @property
    def num_params(self) -> int:
        return self._num_params

    def init_params(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """The network's parameters at construction (or rebuilt under a seed drawn from ``generator``;
        a module object is re-initialised with its layers' ``reset_parameters``)."""
        if generator is None:
            module = self.module
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            module = self._build(seed)
            if isinstance(self._source, torch.nn.Module):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    for m in module.modules():
                        if hasattr(m, "reset_parameters"):
                            m.reset_parameters()
        return torch.nn.utils.parameters_to_vector(module.parameters()).detach().clone()

    def _unflatten(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape, n in self._shapes:
            out[name] = w[offset : offset + n].view(shape)
            offset += n
        return out

    def _outputs(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, self._unflatten(w), (X,))

    def _targets(self, data: UserData) -> torch.Tensor:
        return data.y.to(self.dtype) if self.task == "regression" else class_labels(data.y)

    def _prepare(self, w: torch.Tensor, data: UserData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.check_params(w)
        return w.to(self.dtype), data.X.to(self.dtype), self._targets(data)

    def _losses(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.task == "regression":
            return 0.5 * (out.reshape(-1) - y) ** 2
        return F.cross_entropy(out, y, reduction="none")

    # --- the objective ---------------------------------------------------------------------------
    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        w, X, y = self._prepare(w, data)
        return self._losses(self._outputs(w, X), y)

    def _one_record_loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.module, params, (x.unsqueeze(0),))
        if self.task == "regression":
            return 0.5 * (out.reshape(()) - y) ** 2
        return F.cross_entropy(out, y.unsqueeze(0))

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        w, X, y = self._prepare(w, data)
        params = self._unflatten(w)  # differentiate w.r.t. the dict: no slice-backward into a flat buffer
        per_record = vmap(grad(self._one_record_loss), in_dims=(None, 0, 0))
        sums = torch.zeros(data.num_users, self.num_params, dtype=self.dtype)
        for start in range(0, data.num_records, self.chunk_size):
            stop = start + self.chunk_size
            g = per_record(params, X[start:stop], y[start:stop])
            flat = torch.cat([g[name].reshape(g[name].shape[0], -1) for name, _, _ in self._shapes], dim=1)
            sums.index_add_(0, data.user_index[start:stop], flat)
        counts = data.counts().clamp_min(1).to(self.dtype)
        return sums / counts.unsqueeze(1) + self.reg * w

    def local_epoch_updates(
        self, w: torch.Tensor, data: UserData, local_epochs: int, local_lr: float, batch_size: int | None
    ) -> torch.Tensor:
        """:meth:`~fedkl.problems.base.Problem.local_epoch_updates` for a network: a loop over users, each
        from its own records only (what its client computes alone); every step is plain autograd through
        the batch's mean loss (one backward pass, no per-record gradients: local training needs only the
        user's mean gradient) plus ``reg * w``, applied in place layer by layer. The same steps as the
        generic loop, up to floating-point summation order. Runs with one torch thread (small per-user
        tensors: more threads only add synchronisation, many times slower on a loaded machine)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._local_epoch_updates(w, data, local_epochs, local_lr, batch_size)
        finally:
            torch.set_num_threads(threads)

    def _local_epoch_updates(
        self, w: torch.Tensor, data: UserData, local_epochs: int, local_lr: float, batch_size: int | None
    ) -> torch.Tensor:
        w = w.to(self.dtype)
        self.check_params(w)
        U = data.num_users
        out = torch.zeros(U, self.num_params, dtype=self.dtype)
        if U == 0:
            return out
        X_all, y_all = data.X.to(self.dtype), self._targets(data)
        order = torch.sort(data.user_index, stable=True).indices  # records grouped by user, in record order
        counts = data.counts().tolist()
        names = [name for name, _, _ in self._shapes]
        offset = 0
        for r, m in enumerate(counts):
            rows = order[offset : offset + m]
            offset += m
            if m == 0:
                continue
            X, y = X_all[rows], y_all[rows]
            b = m if batch_size is None else min(batch_size, m)
            params = {k: v.detach().clone().requires_grad_(True) for k, v in self._unflatten(w).items()}
            leaves = [params[k] for k in names]
            for _ in range(local_epochs):
                for start in range(0, m, b):
                    loss = self._losses(
                        functional_call(self.module, params, (X[start : start + b],)), y[start : start + b]
                    )
                    grads = torch.autograd.grad(loss.mean(), leaves)
                    with torch.no_grad():
                        for p, g in zip(leaves, grads):
                            if self.reg:
                                g = g + self.reg * p
                            p.sub_(local_lr * g)
            with torch.no_grad():
                flat = torch.cat([p.reshape(-1) for p in leaves])
            out[r] = flat - w if torch.isfinite(flat).all() else torch.full_like(flat, float("nan"))
        return out

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        return Constants(
            lipschitz=float("inf"), smoothness=None, strong_convexity=None, domain="non-convex; rely on clipping"
        )

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        w, X, y = self._prepare(w, data)
        with torch.no_grad():
            out = self._outputs(w, X)
        if self.task == "regression":
            return {"loss": self.loss(w, data), "mse": float(((out.reshape(-1) - y) ** 2).double().mean())}
        return {"loss": self.loss(w, data), "accuracy": float((out.argmax(dim=1) == y).double().mean())}

    def predict(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        """Class indices (classification) or predictions (regression) for feature rows ``X``."""
        with torch.no_grad():
            out = self._outputs(w.to(self.dtype), X.to(self.dtype))
        return out.reshape(-1) if self.task == "regression" else out.argmax(dim=1)

    def trivial_metrics(self, train: UserData, test: UserData) -> dict[str, float]:
        if self.task == "regression":
            return mean_label_metrics(train, test)
        return majority_class_metrics(train, test, self.num_classes)


__all__ = ["ModelSource", "TASKS", "TorchModel", "load_factory"]
