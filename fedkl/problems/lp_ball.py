"""The l_p ball ``W = {w : ||w||_p <= radius}``, 1 < p <= 2, with its linear minimization oracle
(paper 001, Alg 5: variance-reduced Frank–Wolfe over an l_p ball; ``vr-fw-lp``).

``lmo(g) = argmin_{||v||_p <= r} <v, g> = -r sign(g) |g|^(q-1) / ||g||_q^(q-1)``, ``q = p/(p-1)`` (Hölder's
equality case; for p = 2, ``-r g/||g||_2``); ``lmo(0)`` is the centre 0. What a private Frank–Wolfe needs
from it is public and data-free: the centre (the start), ``l2_diameter`` (``2r``: for p <= 2 the l_p ball
lies in the l2 ball of the same radius), which bounds ``||w_t - w_{t-1}||_2``, and ``l2_bound`` (``r``).
"""

from __future__ import annotations

import math

import torch


class LpBall:
    """``{w in R^dim : ||w||_p <= radius}`` for ``1 < p <= 2`` (module docstring)."""

    def __init__(self, dim: int, p: float, radius: float, dtype: torch.dtype = torch.float64) -> None:
        if int(dim) != dim or dim < 1:
            raise ValueError(f"the domain's dimension must be a positive integer, got {dim}")
        if not (1.0 < p <= 2.0):
            raise ValueError(f"the l_p ball needs 1 < p <= 2, got p = {p}")
        if not (radius > 0 and math.isfinite(radius)):
            raise ValueError(f"the l_p ball's radius must be finite and > 0, got {radius}")
        self.dim, self.p, self.radius, self.dtype = int(dim), float(p), float(radius), dtype
        self.q = self.p / (self.p - 1.0)

    @property
    def name(self) -> str:
        return f"l{self.p:g}-ball"

    @property
    def center(self) -> torch.Tensor:
        return torch.zeros(self.dim, dtype=self.dtype)

    @property
    def l2_diameter(self) -> float:
        return 2.0 * self.radius

    @property
    def l2_bound(self) -> float:
        return self.radius

    def lmo(self, g: torch.Tensor) -> torch.Tensor:
        """``argmin_{v in W} <v, g>`` (exact, non-private): a point of the sphere, or 0 for g = 0."""
        g = torch.as_tensor(g).to(self.dtype)
        if g.shape != (self.dim,) or not torch.isfinite(g).all():
            raise ValueError(f"{self.name}: expected a finite vector of shape ({self.dim},), got {tuple(g.shape)}")
        top = float(g.abs().max())
        if top == 0.0:
            return self.center
        a = g.abs() / top  # scaled to max 1: |g|^(q-1) does not overflow for p near 1
        if self.p == 2.0:
            return -self.radius * g / torch.linalg.vector_norm(g)
        a = a / torch.linalg.vector_norm(a, ord=self.q)
        return -self.radius * torch.sign(g) * a ** (self.q - 1.0)

    def describe(self) -> dict:
        return {"domain": self.name, "p": self.p, "radius": self.radius}


__all__ = ["LpBall"]
