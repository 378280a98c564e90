"""Per-user objectives and the constants the privacy analyses need.

The user-level objective is ``F(w) = (1/n) sum_u f_u(w)`` with ``f_u(w)`` the mean record loss of
user ``u`` plus ``(reg/2)||w||^2``. Algorithms only ever see per-user quantities (the mean gradient
of one user), which is what makes the sensitivity a per-*user* sensitivity.

A problem states its constants (:class:`Constants`) under explicit bounds: the feature bound R
(``||x|| <= R`` for every record, enforced by the data loaders) and, where the loss is not globally
Lipschitz, a parameter bound B (``||w|| <= B``). Private algorithms still clip per-user gradients
to a norm C: the clip, not the constant, is what enforces the sensitivity, so a wrong constant can
hurt utility but never privacy.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from fedkl.data.base import UserData


@dataclass(frozen=True)
class Constants:
    """Constants of each per-user objective ``f_u`` (every record loss, hence every mean).

    Attributes:
        lipschitz: L0, a bound on ``||grad f_u(w)||`` (over the stated domain).
        smoothness: L1, a bound on the operator norm of the Hessian (None if not smooth).
        strong_convexity: mu (0 if not strongly convex; None if not convex at all).
        domain: the assumptions the constants hold under, in words.
    """

    lipschitz: float
    smoothness: float | None
    strong_convexity: float | None
    domain: str


class Problem(ABC):
    """A loss over flat parameters ``w`` (1-D tensor of ``num_params`` entries).

    Subclasses implement :meth:`record_losses` and :meth:`per_user_gradients` (vectorized over all
    users: no Python loop over users), :meth:`constants` and :meth:`metrics`.
    """

    name: str = "problem"
    convex: bool = True

    def __init__(self, dim: int, reg: float = 0.0, dtype: torch.dtype = torch.float64) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if reg < 0 or not math.isfinite(reg):
            raise ValueError(f"reg must be a finite non-negative number, got {reg}")
        self.dim = dim
        self.reg = float(reg)
        self.dtype = dtype

    # --- shape -------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return self.dim

    def init_params(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """Starting point (zeros for convex problems)."""
        return torch.zeros(self.num_params, dtype=self.dtype)

    def check_params(self, w: torch.Tensor) -> None:
        if w.shape != (self.num_params,):
            raise ValueError(f"{self.name}: expected parameters of shape ({self.num_params},), got {tuple(w.shape)}")
        if not torch.isfinite(w).all():
            raise ValueError(f"{self.name}: parameters contain NaN or inf")

    # --- losses ------------------------------------------------------------------------------
    @abstractmethod
    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        """Loss of every record, ``(N,)``, without the regularizer."""

    def per_user_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        """``f_u(w)`` for every user: mean record loss + (reg/2)||w||^2, ``(num_users,)``."""
        losses = self.record_losses(w, data)
        out = user_means(losses.unsqueeze(1), data).squeeze(1)
        return out + 0.5 * self.reg * w.dot(w)

    def loss(self, w: torch.Tensor, data: UserData) -> float:
        """The user-level objective ``F(w) = mean_u f_u(w)`` over the users with at least one record
        in ``data`` (a user with none, e.g. in a small held-out split, has no loss to report: counting
        it as the regularizer alone would dilute the mean). All users if none has a record."""
        per_user = self.per_user_losses(w, data)
        has_records = data.counts() > 0
        if bool(has_records.any()):
            per_user = per_user[has_records]
        return float(per_user.mean())

    @abstractmethod
    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        """``grad f_u(w)`` for every user, ``(num_users, num_params)``, regularizer included."""

    def gradient(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        """``grad F(w)``, the mean of the per-user gradients."""
        return self.per_user_gradients(w, data).mean(0)

    # --- constants and metrics ---------------------------------------------------------------
    @abstractmethod
    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        """L0, L1, mu under ``||x|| <= feature_bound`` (and ``||w|| <= param_bound`` if needed)."""

    @abstractmethod
    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        """Quality of ``w`` on ``data``: always ``loss``; ``accuracy`` for classification."""

    def trivial_metrics(self, train: UserData, test: UserData) -> dict[str, float]:
        """The same metrics for the best data-free-ish trivial predictor (e.g. the majority class
        of the training labels), the bar a private model must clear."""
        return {}


def user_means(values: torch.Tensor, data: UserData) -> torch.Tensor:
    """Per-user mean of per-record rows: ``values`` is ``(N, k)``, result ``(num_users, k)``.

    A user with no records gets a zero row (its objective is the regularizer alone).
    """
    sums = torch.zeros(data.num_users, values.shape[1], dtype=values.dtype)
    sums.index_add_(0, data.user_index, values)
    counts = data.counts().clamp_min(1).to(values.dtype)
    return sums / counts.unsqueeze(1)


def binary_accuracy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy of predicting ``sign(score)`` for labels in {-1, +1}; a zero score predicts +1 (so the
    all-zero model is the constant +1 predictor, not a predictor that is always wrong)."""
    predicted = torch.where(scores >= 0, 1.0, -1.0).to(labels.dtype)
    return float((predicted == labels).double().mean())
