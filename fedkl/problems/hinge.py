"""Smoothed (Huberized) hinge loss for binary ``y in {-1, +1}``, with ``t = y <w, x>`` and
smoothing ``h > 0``::

    l = 0                    if t >= 1
        1 - t - h/2          if t <= 1 - h
        (1 - t)^2 / (2 h)    otherwise

``dl/dt`` is ``-1``, ``-(1-t)/h`` or ``0``: it lies in [-1, 0] and is (1/h)-Lipschitz in t. With
``grad l = (dl/dt) y x`` and ``||x|| <= R`` (any w): **L0 = R**, **L1 = R^2 / h**. Convex, mu = 0;
with ``(reg/2)||w||^2`` on ``||w|| <= B``: L0 = R + reg B, L1 = R^2/h + reg, mu = reg.
"""

from __future__ import annotations

import torch

from fedkl.data.base import UserData
from fedkl.problems.base import BinaryLinear, Problem, user_weighted_means


class SmoothedHinge(BinaryLinear, Problem):
    name = "smoothed-hinge"
    loss_word = "hinge"

    def __init__(self, dim: int, reg: float = 0.0, smoothing: float = 0.5, dtype: torch.dtype = torch.float64) -> None:
        super().__init__(dim, reg, dtype)
        if not smoothing > 0:
            raise ValueError(f"smoothing must be positive, got {smoothing}")
        self.smoothing = float(smoothing)

    @property
    def curvature_divisor(self) -> float:
        return self.smoothing

    def _loss_of_margin(self, t: torch.Tensor) -> torch.Tensor:
        h = self.smoothing
        quad = (1 - t).clamp_min(0) ** 2 / (2 * h)
        return torch.where(t <= 1 - h, 1 - t - h / 2, quad)

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        return self._loss_of_margin(self._margins(w, data))

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        t = self._margins(w, data)
        dldt = -((1 - t) / self.smoothing).clamp(0.0, 1.0)
        coef = dldt * data.y.to(w.dtype)
        return self.plus_reg(user_weighted_means(coef, data.X.to(w.dtype), data), w)

    def loss_at_zero(self) -> float:
        return float(self._loss_of_margin(torch.zeros(1, dtype=torch.float64)))
