"""Absolute loss of a sigmoid link, a weakly convex NON-smooth generalized linear loss (paper 001's
Sec 5 setting, for ``pg-mirror-descent``): with ``z = <w, x>`` and a target ``y`` (real; the kink is
met where ``sigmoid(z) = y``, i.e. for ``y`` in (0, 1))::

    l(z, y) = |sigmoid(z) - y|

It is the composition ``h(c(z))`` of the convex 1-Lipschitz ``h = |.|`` with the smooth
``c(z) = sigmoid(z) - y``, ``|c'| <= 1/4``, ``|c''| <= M = sqrt(3)/18`` (the maximum of
``s(1-s)(1-2s)``). Hence, with ``||x|| <= R`` (l2; also ``||x||_q <= R`` for every q >= 2) and any w:

* **L0 = R/4**: ``||grad||_q = |h'| |c'| ||x||_q <= R/4``;
* **rho = M R^2** weak convexity, in ``||.||_2`` and in every ``||.||_p`` with p <= 2:
  ``h(c(z')) >= h(c(z)) + s c'(z)(z' - z) - (M/2)(z' - z)^2`` for ``s`` in ``dh(c(z))``, and
  ``<x, w' - w>^2 <= ||x||_q^2 ||w' - w||_p^2``; a mean over records keeps both constants;
* not smooth (the kink), not convex. The subgradient used is ``sign(sigmoid(z) - y) sigmoid'(z) x``
  (0 at the kink, an element of the subdifferential there).

Realizable data ``y = sigmoid(<x, w*>)`` give ``F(w*) = 0 = min F``: the known optimum of the tests.
A Python-level problem (construct it directly); ``fedkl run``'s ``--problem`` choices do not list it.
"""

from __future__ import annotations

import math

import torch

from fedkl.data.base import UserData
from fedkl.problems.base import Constants, Problem, user_means
from fedkl.problems.rowwise import row_matmul, sigmoid

CURVATURE = math.sqrt(3.0) / 18.0  # max |sigmoid''| = max s(1-s)|1-2s|


class SigmoidAbsolute(Problem):
    name = "sigmoid-absolute"
    convex = False

    def _scores(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        self.check_params(w)
        return row_matmul(data.X.to(w.dtype), w)

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        return (sigmoid(self._scores(w, data)) - data.y.to(w.dtype)).abs()

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        s = sigmoid(self._scores(w, data))
        coef = torch.sign(s - data.y.to(w.dtype)) * s * (1.0 - s)
        return user_means(coef.unsqueeze(1) * data.X.to(w.dtype), data) + self.reg * w

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        if self.reg > 0:
            raise ValueError("sigmoid-absolute states its constants without a regularizer (reg = 0)")
        R = float(feature_bound)
        return Constants(R / 4.0, None, None, f"||x|| <= {R}, any w (weakly convex, rho = {CURVATURE * R * R:.4g})")

    def weak_convexity(self, feature_bound: float) -> float:
        """``rho = M R^2`` (module docstring)."""
        return CURVATURE * float(feature_bound) ** 2

    def predict(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        self.check_params(w)
        return sigmoid(row_matmul(X.to(w.dtype), w))

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        return {"loss": self.loss(w, data)}

    def trivial_metrics(self, train: UserData, test: UserData) -> dict[str, float]:
        w = torch.zeros(self.num_params, dtype=self.dtype)
        return {"loss": self.loss(w, test)}
