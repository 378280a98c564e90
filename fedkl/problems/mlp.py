"""A small multilayer perceptron (ReLU hidden layers, softmax cross-entropy output).

Non-convex (``convex = False``). Its gradient norm and smoothness are not bounded in general (they
grow with the weights), so :meth:`MLP.constants` returns ``lipschitz = inf`` and no smoothness or
strong convexity: private training must rely on clipping the per-user gradients, which is what
bounds the sensitivity anyway.

It is fedkl's built-in :class:`~fedkl.problems.torch_model.TorchModel`: the network is a
``torch.nn.Sequential`` of Linear and ReLU layers, and everything else (flat parameters in
``named_parameters()`` order, per-record gradients by ``torch.func.vmap(grad(...))`` summed into
users, the metrics) is the generic torch-model code. Labels as in
:func:`fedkl.problems.multiclass.class_labels` (binary ±1 labels become classes 0/1).
"""

from __future__ import annotations

import torch

from fedkl.problems.torch_model import TorchModel


class MLP(TorchModel):
    name = "mlp"

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
        self.hidden = tuple(int(h) for h in hidden)
        if any(h <= 0 for h in self.hidden):
            raise ValueError(f"hidden sizes must be positive, got {hidden}")
        super().__init__(self._layers, dim, "multiclass", num_classes, reg, seed, dtype, chunk_size)

    def _layers(self, dim: int, num_classes: int) -> torch.nn.Sequential:
        """Linear layers of sizes dim, *hidden, num_classes with ReLU between (PyTorch's default init)."""
        sizes = (dim, *self.hidden, num_classes)
        layers: list[torch.nn.Module] = []
        for i in range(len(sizes) - 1):
            layers.append(torch.nn.Linear(sizes[i], sizes[i + 1], dtype=self.dtype))
            if i < len(sizes) - 2:
                layers.append(torch.nn.ReLU())
        return torch.nn.Sequential(*layers)

    def _logits(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        return self._outputs(w, X)
