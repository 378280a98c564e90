"""A federation of users described by their means, for the quadratic family of
:mod:`fedkl.problems.quadratic_mean` (``f_u(theta) = 0.5 ||theta - xbar_u||^2 (+ reg/2 ||theta||^2)``).

:class:`MeanFederation` holds one row per user (xbar_u) and answers, vectorised, the queries fedkl's
algorithms send for this family: :class:`~fedkl.federation.base.ClippedGradient` (noisy GD) and
:class:`~fedkl.federation.base.GradientsAtPoints` (SCOutputPert's certificate and the mean-type test of
:mod:`fedkl.algorithms.output_perturbation.mean_type_inner`), with ``grad f_u(w) = (1 + reg) w - xbar_u``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fedkl.federation.base import (
    Answers,
    ClippedGradient,
    Federation,
    GradientsAtPoints,
)


class MeanFederation(Federation):
    """Users described by their means (rows of ``means``); ``grad f_u(w) = w - xbar_u + reg w``."""

    def __init__(self, means: torch.Tensor, reg: float = 0.0, prefix: str = "user") -> None:
        self.means = torch.as_tensor(means, dtype=torch.float64)
        self.reg = float(reg)
        self._ids = tuple(f"{prefix}:{u}" for u in range(self.means.shape[0]))
        self._all = list(range(self.means.shape[0]))
        self.queries = 0

    @property
    def user_ids(self) -> tuple[str, ...]:
        return self._ids

    @property
    def num_params(self) -> int:
        return int(self.means.shape[1])

    def _grads(self, w: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
        return (1.0 + self.reg) * w.to(torch.float64) - means

    def compute(self, query, users: Sequence[int] | None = None) -> Answers:
        if users is None or (len(users) == len(self._all) and list(users) == self._all):
            users, means = self._all, self.means  # everyone (the common case): no gather
        else:
            users = self._users(users)
            means = self.means[torch.as_tensor(users, dtype=torch.long)]
        self.queries += 1
        if isinstance(query, GradientsAtPoints):
            p = query.points.to(torch.float64)
            values = (1.0 + self.reg) * p.unsqueeze(0) - means.unsqueeze(1)
        elif isinstance(query, ClippedGradient):
            g = self._grads(query.w, means)
            norms = g.norm(dim=1, keepdim=True)
            values = g * torch.clamp(query.clip / norms.clamp_min(1e-300), max=1.0)
        else:
            raise TypeError(f"MeanFederation does not answer {type(query).__name__}")
        return Answers(users=users, values=values, failed=[])


__all__ = ["MeanFederation"]
