"""The mean-estimation family of docs/derivations/paper-002.md §7 T6(a): a problem whose optimum is known in
closed form, for paper 002's tests and experiments.

Loss ``l(theta; x) = 0.5 ||theta - x||^2`` (1-strongly convex, 1-smooth; G-Lipschitz on bounded sets).
User u's objective is ``f_u(theta) = 0.5 ||theta - xbar_u||^2 + const (+ reg/2 ||theta||^2)``, so a user is
fully described by its MEAN xbar_u: :func:`draw_user_means` draws the means exactly from
``N(theta_pop, s^2 I / m)`` (records ``x ~ N(theta_pop, s^2 I)``, m of them per user), which makes
m = 10^12 as cheap as m = 1. The empirical minimizer is ``theta* = mean_u xbar_u`` (exact), the
population minimizer ``theta_pop``.

* :class:`QuadraticMean` - the :class:`~fedkl.problems.base.Problem` (constants only: the data live in
  a :class:`~fedkl.federation.means.MeanFederation`, which answers the algorithms' queries from the means).
* :func:`draw_user_means` - the users' means.
* :class:`~fedkl.algorithms.output_perturbation.mean_type_inner.MeanTypeInner` - an exact, efficient DelOutputPert for this
  family, the inner release of the phased algorithms at any n (its module holds the privacy proof).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedkl.data.base import UserData
from fedkl.problems.base import Constants, Problem


class QuadraticMean(Problem):
    """``l(theta; x) = 0.5 ||theta - x||^2`` (+ reg/2 ||theta||^2 per user). Constants on ``||x|| <= X``
    (``feature_bound``) and ``||theta|| <= B``: L0 = B + X + reg B, L1 = mu = 1 + reg."""

    name = "quadratic-mean"

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        if param_bound is None:
            raise ValueError("the quadratic loss is Lipschitz only on a bounded domain: give param_bound")
        X, B = float(feature_bound), float(param_bound)
        return Constants(B + X + self.reg * B, 1.0 + self.reg, 1.0 + self.reg, f"||x|| <= {X}, ||w|| <= {B}")

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:  # pragma: no cover - not used
        raise NotImplementedError("QuadraticMean keeps its data in a MeanFederation (user means only)")

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError("QuadraticMean keeps its data in a MeanFederation (user means only)")

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:  # pragma: no cover
        raise NotImplementedError


def draw_user_means(n: int, m: float, d: int, theta_pop: torch.Tensor, s: float, seed: int) -> torch.Tensor:
    """n user means, exactly N(theta_pop, s^2 I_d / m) (the mean of m records N(theta_pop, s^2 I_d))."""
    g = np.random.default_rng(seed)
    z = g.standard_normal((n, d))
    return torch.as_tensor(theta_pop, dtype=torch.float64) + torch.from_numpy(z) * (s / math.sqrt(m))


__all__ = ["QuadraticMean", "draw_user_means"]
