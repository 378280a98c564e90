"""A small multilayer perceptron (ReLU hidden layers, softmax cross-entropy output).

Non-convex (``convex = False``). Its gradient norm and smoothness are not bounded in general (they
grow with the weights), so :meth:`MLP.constants` returns ``lipschitz = inf`` and no smoothness or
strong convexity: private training must rely on clipping the per-user gradients, which is what
bounds the sensitivity anyway.

Parameters are one flat vector, the concatenation of the module's parameters in
``named_parameters()`` order (the order of ``torch.nn.utils.parameters_to_vector``). Per-user
gradients are vectorized: per-record gradients with ``torch.func.vmap(torch.func.grad(...))`` over
chunks of records, summed into users with ``index_add_``; there is no loop over users.
Labels as in :func:`fedkl.problems.multiclass.class_labels` (binary ±1 labels become classes 0/1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedkl.data.base import UserData
from fedkl.problems.base import Constants, Problem
from fedkl.problems.multiclass import class_labels


class MLP(Problem):
    name = "mlp"
    convex = False

    def __init__(
        self,
        dim: int,
        hidden: tuple[int, ...] = (64,),
        num_classes: int = 2,
        reg: float = 0.0,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        chunk_size: int = 4096,
    ) -> None:
        super().__init__(dim, reg, dtype)
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        self.hidden = tuple(int(h) for h in hidden)
        if any(h <= 0 for h in self.hidden):
            raise ValueError(f"hidden sizes must be positive, got {hidden}")
        self.num_classes = int(num_classes)
        self.seed = int(seed)
        self.chunk_size = int(chunk_size)
        self.module = self._build(self.seed)
        self._shapes = [(name, p.shape, p.numel()) for name, p in self.module.named_parameters()]
        self._num_params = sum(n for _, _, n in self._shapes)

    def _build(self, seed: int) -> torch.nn.Sequential:
        """The network with PyTorch's default initialization drawn under ``seed``."""
        sizes = (self.dim, *self.hidden, self.num_classes)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers: list[torch.nn.Module] = []
            for i in range(len(sizes) - 1):
                layers.append(torch.nn.Linear(sizes[i], sizes[i + 1], dtype=self.dtype))
                if i < len(sizes) - 2:
                    layers.append(torch.nn.ReLU())
        return torch.nn.Sequential(*layers)

    @property
    def num_params(self) -> int:
        return self._num_params

    def init_params(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """Default PyTorch init under ``seed`` (or under a seed drawn from ``generator``)."""
        seed = self.seed if generator is None else int(torch.randint(0, 2**62, (1,), generator=generator))
        module = self.module if generator is None else self._build(seed)
        return torch.nn.utils.parameters_to_vector(module.parameters()).detach().clone()

    def _unflatten(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape, n in self._shapes:
            out[name] = w[offset : offset + n].view(shape)
            offset += n
        return out

    def _logits(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, self._unflatten(w), (X,))

    def _prepare(self, w: torch.Tensor, data: UserData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.check_params(w)
        return w.to(self.dtype), data.X.to(self.dtype), class_labels(data.y)

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        w, X, y = self._prepare(w, data)
        return F.cross_entropy(self._logits(w, X), y, reduction="none")

    def _one_record_loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(self.module, params, (x.unsqueeze(0),)), y.unsqueeze(0))

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

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        return Constants(
            lipschitz=float("inf"), smoothness=None, strong_convexity=None, domain="non-convex; rely on clipping"
        )

    def predict(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        self.check_params(w)
        with torch.no_grad():
            return self._logits(w.to(self.dtype), X.to(self.dtype)).argmax(dim=1)

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        w, X, y = self._prepare(w, data)
        with torch.no_grad():
            pred = self._logits(w, X).argmax(dim=1)
        return {"loss": self.loss(w, data), "accuracy": float((pred == y).double().mean())}

    def trivial_metrics(self, train: UserData, test: UserData) -> dict[str, float]:
        majority = int(torch.bincount(class_labels(train.y), minlength=self.num_classes).argmax())
        return {
            "accuracy": float((class_labels(test.y) == majority).double().mean()),
            "loss": math.log(self.num_classes),
        }
