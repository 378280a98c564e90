"""Multiclass logistic (softmax) regression: ``l(W; x, y) = logsumexp(W x) - (W x)_y``.

Parameters are flat, ``num_classes * dim`` entries, read row-major as ``W`` of shape
``(num_classes, dim)``. Labels are int64 classes ``0..K-1``; binary ±1 labels are accepted and
read as class ``1`` for ``y > 0`` and class ``0`` otherwise.

Constants under ``||x|| <= R`` (any W). With ``p = softmax(W x)`` the gradient is
``(p - e_y) x^T``, so ``||grad l||_F = ||p - e_y|| ||x||``, and
``||p - e_y||^2 = (1 - p_y)^2 + sum_{k != y} p_k^2 <= 2 (1 - p_y)^2 <= 2``: **L0 = sqrt(2) R**.
The Hessian is ``(diag(p) - p p^T) kron (x x^T)``; by Gershgorin every eigenvalue of
``diag(p) - p p^T`` is at most ``p_k(1-p_k) + p_k(1-p_k) <= 1/2`` (row k: diagonal ``p_k - p_k^2``,
off-diagonal absolute sum ``p_k (1 - p_k)``), and ``x x^T`` has norm ``R^2``: **L1 = R^2 / 2**.
Convex, not strongly convex (mu = 0). With ``(reg/2)||w||^2`` on ``||w|| <= B``:
L0 = sqrt(2) R + reg B, L1 = R^2/2 + reg, mu = reg.
"""

from __future__ import annotations

import math

import torch

from fedkl.data.base import UserData
from fedkl.problems.base import Constants, Problem, user_means
from fedkl.problems.rowwise import cross_entropy_rows, row_matmul, softmax_rows


def class_labels(y: torch.Tensor) -> torch.Tensor:
    """int64 class labels; floating (binary ±1) labels map to ``1`` if ``y > 0`` else ``0``."""
    return (y > 0).long() if y.is_floating_point() else y.long()


class SoftmaxRegression(Problem):
    name = "softmax"

    def __init__(self, dim: int, num_classes: int, reg: float = 0.0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__(dim, reg, dtype)
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        self.num_classes = int(num_classes)

    @property
    def num_params(self) -> int:
        return self.dim * self.num_classes

    def _logits(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        self.check_params(w)
        return row_matmul(data.X.to(w.dtype), w.view(self.num_classes, self.dim).T)  # (N, K)

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        return cross_entropy_rows(self._logits(w, data), class_labels(data.y))

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        logits = self._logits(w, data)
        coef = softmax_rows(logits)
        coef[torch.arange(len(coef)), class_labels(data.y)] -= 1.0  # p - e_y, (N, K)
        X = data.X.to(w.dtype)
        # one (num_users, d) block per class (a loop over classes, not users): memory O(N d)
        grads = torch.stack([user_means(coef[:, k : k + 1] * X, data) for k in range(self.num_classes)], dim=1)
        return self.plus_reg(grads.reshape(data.num_users, -1), w)

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        R = float(feature_bound)
        if self.reg > 0:
            if param_bound is None:
                raise ValueError("a regularized softmax loss is Lipschitz only on a bounded domain: give param_bound")
            return Constants(
                math.sqrt(2) * R + self.reg * param_bound,
                R * R / 2 + self.reg,
                self.reg,
                f"||x|| <= {R}, ||w|| <= {param_bound}",
            )
        return Constants(math.sqrt(2) * R, R * R / 2, 0.0, f"||x|| <= {R}, any w")

    def predict(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        self.check_params(w)
        return row_matmul(X.to(w.dtype), w.view(self.num_classes, self.dim).T).argmax(dim=1)

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        pred = self._logits(w, data).argmax(dim=1)
        return {"loss": self.loss(w, data), "accuracy": float((pred == class_labels(data.y)).double().mean())}

    def trivial_metrics(self, train: UserData, test: UserData) -> dict[str, float]:
        return majority_class_metrics(train, test, self.num_classes)


def majority_class_metrics(train: UserData, test: UserData, num_classes: int) -> dict[str, float]:
    """The trivial classifier: the training majority class for every record (its accuracy), and the
    cross-entropy of the uniform prediction, log(num_classes)."""
    majority = int(torch.bincount(class_labels(train.y), minlength=num_classes).argmax())
    return {"accuracy": float((class_labels(test.y) == majority).double().mean()), "loss": math.log(num_classes)}
