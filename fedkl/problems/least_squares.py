"""Least squares: ``l(w; x, y) = 0.5 (<w, x> - y)^2``.

The gradient ``(<w, x> - y) x`` is unbounded over all w, so the constants are stated on
``||x|| <= R``, ``||w|| <= B`` and ``|y| <= Y`` (Y is the constructor's ``label_bound``, e.g. the
``extra["label_bound"]`` of a synthetic dataset): ``|<w, x> - y| <= R B + Y``, hence
**L0 = R (R B + Y)**; the Hessian ``x x^T`` has norm at most ``R^2``: **L1 = R^2**. Convex; strongly
convex only through the regularizer: **mu = reg** (then L0 += reg B, L1 += reg).
"""

from __future__ import annotations

import torch

from fedkl.data.base import UserData
from fedkl.problems.base import Constants, user_means, user_weighted_means
from fedkl.problems.glm import GeneralizedLinear
from fedkl.problems.rowwise import row_matmul


class LeastSquares(GeneralizedLinear):
    name = "least-squares"

    # the score functions of the closed-form local solvers (fedkl.problems.glm)
    @staticmethod
    def score_loss(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.5 * (z - y) ** 2

    @staticmethod
    def score_derivative(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return z - y

    @staticmethod
    def score_curvature(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(z)

    def __init__(
        self, dim: int, reg: float = 0.0, label_bound: float | None = None, dtype: torch.dtype = torch.float64
    ) -> None:
        super().__init__(dim, reg, dtype)
        if label_bound is not None and not label_bound >= 0:
            raise ValueError(f"label_bound must be non-negative, got {label_bound}")
        self.label_bound = None if label_bound is None else float(label_bound)

    def _residuals(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        self.check_params(w)
        return row_matmul(data.X.to(w.dtype), w) - data.y.to(w.dtype)

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        return 0.5 * self._residuals(w, data) ** 2

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        r = self._residuals(w, data)
        return self.plus_reg(user_weighted_means(r, data.X.to(w.dtype), data), w)

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        if param_bound is None:
            raise ValueError("least squares is Lipschitz only on a bounded domain: give param_bound")
        if self.label_bound is None:
            raise ValueError("least-squares constants need the label bound: construct with label_bound=Y")
        R, B, Y = float(feature_bound), float(param_bound), self.label_bound
        return Constants(
            R * (R * B + Y) + self.reg * B, R * R + self.reg, self.reg, f"||x|| <= {R}, ||w|| <= {B}, |y| <= {Y}"
        )

    def predict(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        self.check_params(w)
        return row_matmul(X.to(w.dtype), w)

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        mse = float((self._residuals(w, data) ** 2).mean())
        return {"loss": self.loss(w, data), "mse": mse}

    def trivial_metrics(self, train: UserData, test: UserData) -> dict[str, float]:
        return mean_label_metrics(train, test)


def mean_label_metrics(train: UserData, test: UserData) -> dict[str, float]:
    """The trivial regression predictor: the mean training label for every record (its mse, and
    its squared loss averaged within and then over users, as :meth:`Problem.loss` does)."""
    err = test.y.double() - float(train.y.double().mean())
    loss = float(user_means(0.5 * err.unsqueeze(1) ** 2, test).mean())
    return {"mse": float((err**2).mean()), "loss": loss}
