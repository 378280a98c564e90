"""Binary logistic regression: ``l(w; x, y) = log(1 + exp(-y <w, x>))`` with ``y in {-1, +1}``.

Constants under ``||x|| <= R`` (any w): the derivative of ``t -> log(1+e^{-t})`` lies in (-1, 0), so
``||grad l|| <= R`` (L0 = R); its second derivative is at most 1/4, so L1 = R^2/4. Convex; with the
regularizer ``(reg/2)||w||^2`` each per-user objective is reg-strongly convex and L0 grows to
``R + reg*B`` on ``||w|| <= B``.
"""

from __future__ import annotations

import torch

from fedkl.data.base import UserData
from fedkl.problems.base import BinaryLinear, user_weighted_means
from fedkl.problems.glm import GeneralizedLinear
from fedkl.problems.rowwise import sigmoid, softplus


class BinaryLogistic(BinaryLinear, GeneralizedLinear):
    name = "logistic"
    loss_word, curvature_divisor = "logistic", 4

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

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        return softplus(-self._margins(w, data))

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        margins = self._margins(w, data)
        # d/dz log(1+exp(-y z)) = -y * sigmoid(-y z)
        coef = -data.y.to(w.dtype) * sigmoid(-margins)
        grads = user_weighted_means(coef, data.X.to(w.dtype), data)
        return self.plus_reg(grads, w)

    def loss_at_zero(self) -> float:
        return float(torch.log(torch.tensor(2.0)))
