"""Robust regression GLLs (paper 001, Def 2): the Huber loss and the absolute loss through its Moreau envelope.

With the residual ``r = <w, x> - y``:

* ``huber`` (threshold ``delta > 0``, 1-Lipschitz normalisation: the textbook Huber loss divided by delta)::

      l(r) = r^2 / (2 delta)        if |r| <= delta
             |r| - delta / 2        otherwise

  ``dl/dr = clamp(r / delta, -1, 1)``, ``d^2l/dr^2 = 1{|r| < delta} / delta``.
* ``absolute``: ``l(r) = |r|``, not smooth. Paper 001 (Alg 1, Lemma 3) accesses a non-smooth GLL only through
  its Moreau envelope ``l_beta(m) = min_u |u - y| + (beta/2)(u - m)^2``, whose prox is closed-form
  (:func:`absolute_prox`: ``u = y + sign(m - y) max(|m - y| - 1/beta, 0)``, so no bisection: alpha = 0) and
  whose gradient ``beta (m - prox(m))`` (:func:`moreau_gradient`) is exactly the Huber derivative with
  ``delta = 1/beta``: the envelope IS ``huber`` with ``delta = 1/beta``. So ``absolute`` trains (gradients,
  local solvers, ``loss``) on ``l_beta`` with ``beta = moreau_beta`` (default :data:`DEFAULT_MOREAU_BETA`,
  a public constant so a Flower client rebuilds the same problem from the spec) and reports the
  absolute loss itself as the metric ``mae``; ``l_beta <= |r| <= l_beta + 1/(2 beta)`` (Lemma 3), so
  the two differ by at most ``1/(2 beta)`` per record. Thm 6's choice ``beta = sqrt(n) L0 / (R D)`` can
  be passed as ``moreau_beta=`` (``make_problem("absolute", ds, moreau_beta=...)``).

**Constants** under ``||x|| <= R`` (any w, ANY label): the scalar loss is 1-Lipschitz in the score
(``|dl/dr| <= 1``, scalar L0 = 1), so ``||grad l|| <= R``: **L0 = R**; **L1 = R^2 / delta** (absolute:
``beta R^2``). Convex, mu = 0 (with ``(reg/2)||w||^2`` on ``||w|| <= B``: L0 = R + reg B, L1 += reg,
mu = reg). The Lipschitz constant, hence every sensitivity, needs no label bound. **Labels** must still
be bounded where a loss VALUE matters (the loss range ``|l| <= |r| <= R B + Y`` on ``||w|| <= B``,
``|y| <= Y``): they are checked where data enters fedkl (:func:`fedkl.data.base.check_record_bounds`
REFUSES, does not clip, a non-finite label or one above the dataset's declared ``label_bound``; the
synthetic regression generator clips its own labels to its bound before that check).
"""

from __future__ import annotations

import math

import torch

from fedkl.data.base import UserData
from fedkl.problems.base import Constants, user_means
from fedkl.problems.glm import GeneralizedLinear
from fedkl.problems.rowwise import row_matmul

DEFAULT_HUBER_DELTA = 1.0
DEFAULT_MOREAU_BETA = 10.0  # absolute: envelope within 1/(2 beta) = 0.05 of |r| per record


def absolute_prox(m: torch.Tensor, y: torch.Tensor, beta: float) -> torch.Tensor:
    """``argmin_u |u - y| + (beta/2)(u - m)^2`` (closed form, soft-thresholding of ``m - y`` at 1/beta)."""
    r = m - y
    return y + torch.sign(r) * (r.abs() - 1.0 / beta).clamp_min(0.0)


def moreau_gradient(m: torch.Tensor, y: torch.Tensor, beta: float) -> torch.Tensor:
    """``d/dm l_beta(m) = beta (m - prox(m))`` of the absolute loss's Moreau envelope (Lemma 3)."""
    return beta * (m - absolute_prox(m, y, beta))


class Huber(GeneralizedLinear):
    """See the module docstring. ``delta``: the threshold (the envelope's ``1/beta``)."""

    name = "huber"

    def __init__(
        self,
        dim: int,
        reg: float = 0.0,
        delta: float = DEFAULT_HUBER_DELTA,
        label_bound: float | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__(dim, reg, dtype)
        if not (delta > 0 and math.isfinite(delta)):
            raise ValueError(f"{self.name}: the Huber threshold must be finite and > 0, got {delta}")
        if label_bound is not None and not label_bound >= 0:
            raise ValueError(f"label_bound must be non-negative, got {label_bound}")
        self.delta = float(delta)
        self.label_bound = None if label_bound is None else float(label_bound)

    # the score functions of the closed-form local solvers (fedkl.problems.glm)
    def score_loss(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        r = (z - y).abs()
        return torch.where(r <= self.delta, r * r / (2 * self.delta), r - self.delta / 2)

    def score_derivative(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((z - y) / self.delta).clamp(-1.0, 1.0)

    def score_curvature(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((z - y).abs() < self.delta).to(z.dtype) / self.delta

    def _scores(self, w: torch.Tensor, data: UserData) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_params(w)
        return row_matmul(data.X.to(w.dtype), w), data.y.to(w.dtype)

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        return self.score_loss(*self._scores(w, data))

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        z, y = self._scores(w, data)
        return user_means(self.score_derivative(z, y).unsqueeze(1) * data.X.to(w.dtype), data) + self.reg * w

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        R = float(feature_bound)
        labels = "any label" if self.label_bound is None else f"|y| <= {self.label_bound:g}"
        if self.reg > 0:
            if param_bound is None:
                raise ValueError(
                    f"a regularized {self.name} loss is Lipschitz only on a bounded domain: give param_bound"
                )
            B = float(param_bound)
            return Constants(
                R + self.reg * B, R * R / self.delta + self.reg, self.reg, f"||x|| <= {R}, ||w|| <= {B}, {labels}"
            )
        return Constants(R, R * R / self.delta, 0.0, f"||x|| <= {R}, any w, {labels}")

    def predict(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        self.check_params(w)
        return row_matmul(X.to(w.dtype), w)

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        z, y = self._scores(w, data)
        return {"loss": self.loss(w, data), "mae": float((z - y).abs().mean()), "mse": float(((z - y) ** 2).mean())}

    def trivial_metrics(self, train: UserData, test: UserData) -> dict[str, float]:
        """The median training label for every record (the best constant for the absolute loss)."""
        c = float(train.y.double().median()) if train.num_records else 0.0
        z = torch.full((test.num_records,), c, dtype=torch.float64)
        y = test.y.double()
        loss = float(user_means(self.score_loss(z, y).unsqueeze(1), test).mean())
        return {"loss": loss, "mae": float((z - y).abs().mean()), "mse": float(((z - y) ** 2).mean())}


class AbsoluteLoss(Huber):
    """The absolute loss ``|<w, x> - y|`` trained through its Moreau envelope (module docstring);
    ``moreau_beta``: the envelope's beta (the Huber threshold is ``1/beta``)."""

    name = "absolute"

    def __init__(
        self,
        dim: int,
        reg: float = 0.0,
        moreau_beta: float = DEFAULT_MOREAU_BETA,
        label_bound: float | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        if not (moreau_beta > 0 and math.isfinite(moreau_beta)):
            raise ValueError(f"absolute: moreau_beta must be finite and > 0, got {moreau_beta}")
        super().__init__(dim, reg, 1.0 / moreau_beta, label_bound, dtype)
        self.moreau_beta = float(moreau_beta)

    def score_derivative(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return moreau_gradient(z, y, self.moreau_beta)  # Alg 1's oracle, closed-form prox (alpha = 0)
