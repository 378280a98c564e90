"""Binary logistic regression: ``l(w; x, y) = log(1 + exp(-y <w, x>))`` with ``y in {-1, +1}``.

Constants under ``||x|| <= R`` (any w): the derivative of ``t -> log(1+e^{-t})`` lies in (-1, 0), so
``||grad l|| <= R`` (L0 = R); its second derivative is at most 1/4, so L1 = R^2/4. Convex; with the
regularizer ``(reg/2)||w||^2`` each per-user objective is reg-strongly convex and L0 grows to
``R + reg*B`` on ``||w|| <= B``.
"""

from __future__ import annotations

import torch

from fedkl.data.base import UserData
from fedkl.problems.base import Constants, binary_accuracy, binary_predictions, user_weighted_means
from fedkl.problems.glm import GeneralizedLinear
from fedkl.problems.rowwise import row_matmul, sigmoid, softplus


class BinaryLogistic(GeneralizedLinear):
    name = "logistic"

    # the score functions of the closed-form local solvers (fedkl.problems.glm)
    @staticmethod
    def score_loss(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return softplus(-y * z)

    @staticmethod
    def score_derivative(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -y * sigmoid(-y * z)

    @staticmethod
    def score_curvature(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sg = sigmoid(y * z)
        return sg * (1.0 - sg)

    def _margins(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        self.check_params(w)
        return data.y.to(w.dtype) * row_matmul(data.X.to(w.dtype), w)

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        return softplus(-self._margins(w, data))

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        margins = self._margins(w, data)
        # d/dz log(1+exp(-y z)) = -y * sigmoid(-y z)
        coef = -data.y.to(w.dtype) * sigmoid(-margins)
        grads = user_weighted_means(coef, data.X.to(w.dtype), data)
        return self.plus_reg(grads, w)

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        R = float(feature_bound)
        if self.reg > 0:
            if param_bound is None:
                raise ValueError("a regularized logistic loss is Lipschitz only on a bounded domain: give param_bound")
            return Constants(
                R + self.reg * param_bound, R * R / 4 + self.reg, self.reg, f"||x|| <= {R}, ||w|| <= {param_bound}"
            )
        return Constants(R, R * R / 4, 0.0, f"||x|| <= {R}, any w")

    def predict(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        self.check_params(w)
        return binary_predictions(row_matmul(X.to(w.dtype), w))

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        self.check_params(w)
        scores = row_matmul(data.X.to(w.dtype), w)
        return {"loss": self.loss(w, data), "accuracy": binary_accuracy(scores, data.y)}

    def trivial_metrics(self, train: UserData, test: UserData) -> dict[str, float]:
        majority = 1.0 if float((train.y > 0).double().mean()) >= 0.5 else -1.0
        return {"accuracy": float((test.y == majority).double().mean()), "loss": float(torch.log(torch.tensor(2.0)))}
