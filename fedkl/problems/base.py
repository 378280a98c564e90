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
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from fedkl.data.base import UserData
from fedkl.problems.rowwise import fast_kernels, row_dots, row_matmul


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
    users: no Python loop over users), :meth:`constants` and :meth:`metrics`. The local solvers that
    the federation backends answer local queries with (:meth:`local_minimizers`,
    :meth:`gradients_at_points`, :meth:`local_updates`) have generic versions here, built on those two;
    a problem with closed-form derivatives overrides them (:class:`fedkl.problems.glm.GeneralizedLinear`).
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

    def plus_reg(self, grads: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``grads + reg * w`` (per-user rows); with the fast kernels and ``reg == 0`` the rows as they are
        (adding 0 changes at most the sign of a zero; one pass over ``(users, d)`` saved)."""
        if self.reg == 0 and fast_kernels():
            return grads
        return grads + self.reg * w

    def gradient(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        """``grad F(w)``, the mean of the per-user gradients."""
        return self.per_user_gradients(w, data).mean(0)

    # --- local solvers: what each user computes on its own records ----------------------------
    # The federation backends answer the local queries with these (the in-process backend for all
    # asked users at once, a Flower client for its one user, with the same code). The generic versions
    # below loop over users with the problem's own losses and gradients; a problem with closed-form
    # derivatives overrides them with vectorized ones (:class:`fedkl.problems.glm.GeneralizedLinear`).
    # Every row must depend only on its own user's records (bit for bit), whoever else shares the call.
    def local_minimizers(
        self,
        center: torch.Tensor,
        strength: float,
        data: UserData,
        *,
        tol: float,
        max_iter: int,
        certified: bool = False,
    ) -> torch.Tensor:
        """``v_u = argmin_v f_u(v) + (strength/2)||v - center||^2`` for every user of ``data``, solved to
        gradient norm ``tol`` in at most ``max_iter`` iterations: ``(num_users, d)``, or with
        ``certified`` ``(num_users, d + 1)``, each row ``[v_u, ||grad f_u(v_u) + strength (v_u - center)||]``
        (the residual recomputed at the returned point, not the solver's own report).

        Generic solver: L-BFGS-B (scipy) per user (a loop over users)."""
        from scipy.optimize import minimize

        out = torch.empty(data.num_users, self.num_params + int(certified), dtype=self.dtype)
        for row in range(data.num_users):
            one = data if data.num_users == 1 else data.subset([row])

            def fun(v: np.ndarray) -> tuple[float, np.ndarray]:
                vt = torch.from_numpy(v).to(self.dtype)
                diff = vt - center
                f = float(self.per_user_losses(vt, one)[0]) + 0.5 * strength * float(diff @ diff)
                g = self.per_user_gradients(vt, one)[0] + strength * diff
                return f, g.double().numpy()

            res = minimize(
                fun,
                center.double().numpy(),
                jac=True,
                method="L-BFGS-B",
                options={"maxiter": max_iter, "gtol": tol, "ftol": 0.0},
            )
            v = torch.from_numpy(res.x).to(self.dtype)
            out[row, : self.num_params] = v
            if certified:  # the residual at the returned point, recomputed (not the solver's own report)
                g = self.per_user_gradients(v, one)[0] + strength * (v - center)
                out[row, -1] = g.norm()
        return out

    def gradients_at_points(self, points: torch.Tensor, data: UserData) -> torch.Tensor:
        """``grad f_u(p_k)`` (regularizer included) for every user of ``data`` and every row ``p_k`` of
        ``points`` ``(k, d)``: ``(num_users, k, d)``. Generic: one :meth:`per_user_gradients` per point."""
        k, d = points.shape
        out = torch.empty(data.num_users, k, d, dtype=points.dtype)
        for j in range(k):
            out[:, j] = self.per_user_gradients(points[j], data)
        return out

    def gradients_at_own_points(self, points: torch.Tensor, data: UserData) -> torch.Tensor:
        """Row u: ``grad f_u(points[u])`` (regularizer included), ``(num_users, d)``, bit for bit what user u
        computes alone for a one-point :meth:`gradients_at_points` request. Generic: that call per user."""
        out = torch.empty(data.num_users, self.num_params, dtype=points.dtype)
        for u in range(data.num_users):
            one = data if data.num_users == 1 else data.subset([u])
            out[u] = self.gradients_at_points(points[u : u + 1], one)[0, 0]
        return out

    def local_updates(
        self, w: torch.Tensor, data: UserData, local_steps: int, local_lr: float, batch_size: int | None
    ) -> torch.Tensor:
        """``w_K - w`` (not clipped) of every user of ``data`` after ``local_steps`` local gradient steps
        of size ``local_lr`` from ``w`` on the user's objective over the cyclic mini-batches of
        :func:`cyclic_batches` (all records when ``batch_size`` is None): ``(num_users, d)``. A user
        whose iterate stops being finite gets a NaN row. Generic: a loop over users."""
        U, d = data.num_users, self.num_params
        if U == 0:
            return torch.zeros(0, d, dtype=w.dtype)
        _, cyclic, _ = cyclic_batches(data, batch_size, w.dtype)
        out = torch.empty(U, d, dtype=w.dtype)
        for r in range(U):
            one = data.subset([r])
            m = torch.tensor(one.num_records)
            wu = w.clone()
            for k in range(local_steps):
                if not torch.isfinite(wu).all():
                    break
                batch = one
                if cyclic:
                    keep = in_cyclic_batch(k, torch.arange(one.num_records), m, batch_size)
                    batch = UserData(one.X[keep], one.y[keep], one.user_index[keep], one.user_ids)
                wu = wu - local_lr * self.per_user_gradients(wu, batch)[0]
            out[r] = wu - w if torch.isfinite(wu).all() else torch.full_like(wu, float("nan"))
        return out

    def local_epoch_updates(
        self, w: torch.Tensor, data: UserData, local_epochs: int, local_lr: float, batch_size: int | None
    ) -> torch.Tensor:
        """``w_K - w`` (not clipped) of every user of ``data`` after ``local_epochs`` passes over its
        records in order, in mini-batches of ``batch_size`` (all records when None; the last batch of a
        pass holds what is left), one step of size ``local_lr`` on each batch's objective:
        ``(num_users, d)`` (:class:`~fedkl.federation.base.ClippedLocalUpdate`'s local epochs). A user
        with no records answers 0; a user whose iterate stops being finite gets a NaN row. Generic: a
        loop over users, each from its own records only (what a client computes alone)."""
        U, d = data.num_users, self.num_params
        out = torch.zeros(U, d, dtype=w.dtype)
        for r in range(U):
            one = data.subset([r])
            m = one.num_records
            b = m if batch_size is None else min(batch_size, m)
            wu = w.clone()
            for _ in range(local_epochs if m else 0):
                for start in range(0, m, b):
                    if not torch.isfinite(wu).all():
                        break
                    keep = slice(start, start + b)
                    batch = UserData(one.X[keep], one.y[keep], one.user_index[keep], one.user_ids)
                    wu = wu - local_lr * self.epoch_step_gradient(wu, batch)
            out[r] = wu - w if torch.isfinite(wu).all() else torch.full_like(wu, float("nan"))
        return out

    def epoch_step_gradient(self, w: torch.Tensor, batch: UserData) -> torch.Tensor:
        """The gradient of one user's objective (mean record loss + regularizer) over ``batch`` (that
        user's records), ``(d,)``: one local-epoch step. Default: :meth:`per_user_gradients`."""
        return self.per_user_gradients(w, batch)[0]

    # --- constants and metrics ---------------------------------------------------------------
    @abstractmethod
    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        """L0, L1, mu under ``||x|| <= feature_bound`` (and ``||w|| <= param_bound`` if needed)."""

    @abstractmethod
    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        """Quality of ``w`` on ``data``: always ``loss``; ``accuracy`` for classification."""

    def predict(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        """The prediction of ``w`` for every row of ``X``, in the labels' encoding: ±1 for binary
        linear models, class indices for softmax/MLP, real values for regression."""
        raise NotImplementedError(f"{self.name} has no predict()")

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


# (user index, its version, num_users, counts, layout) of the last records seen by _grouping: a training
# loop asks about the same records every round, and each answer costs passes over all N records
_LAST_GROUPING: tuple | None = None


def _grouping(data: UserData) -> tuple[torch.Tensor, int | torch.Tensor | None]:
    """``(records per user, layout)``: the layout is ``m`` (int) when every user has ``m`` records in user
    order, the CSR row pointer ``(U + 1,)`` when records are in user order with unequal counts, None when
    they are not grouped. Remembered for the last user index (the tensor itself is held, so its identity
    cannot be reused, and its in-place version counter must match); the counts are read-only."""
    global _LAST_GROUPING
    idx, U = data.user_index, data.num_users
    last = _LAST_GROUPING
    if last is not None and last[0] is idx and last[1] == idx._version and last[2] == U:
        return last[3], last[4]
    N = idx.shape[0]
    counts = data.counts()
    layout: int | torch.Tensor | None = None
    if N and not bool((idx[1:] < idx[:-1]).any()):
        m = N // U
        if N == U * m and bool((counts == m).all()):
            layout = m
        else:
            layout = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    _LAST_GROUPING = (idx, idx._version, U, counts, layout)  # one assignment: a reader sees a whole entry
    return counts, layout


def _grouped_layout(data: UserData) -> int | torch.Tensor | None:
    """Fast kernels only: how the records are grouped by user (:func:`_grouping`); None with the
    reproducible kernels or when the records are not grouped."""
    return _grouping(data)[1] if fast_kernels() else None


def user_weighted_sums(coef: torch.Tensor, X: torch.Tensor, data: UserData) -> torch.Tensor:
    """Per-user sums of the records' rows ``coef_i x_i``, ``(num_users, d)``. Reproducible kernels:
    ``index_add_`` in record order (what a client computes alone). Fast kernels
    (:func:`fedkl.problems.rowwise.kernels`), records grouped by user (the datasets' layout): one segment
    matmul with no ``(N, d)`` temporary, a batched ``(1, m) @ (m, d)`` when every user has ``m``
    records, else a CSR ``(users, N) @ (N, d)`` product; ungrouped records fall back to ``index_add_``."""
    U, N, d = data.num_users, X.shape[0], X.shape[1]
    layout = _grouped_layout(data)
    if layout is None:
        return torch.zeros(U, d, dtype=X.dtype).index_add_(0, data.user_index, coef.unsqueeze(1) * X)
    if isinstance(layout, int):
        return torch.bmm(coef.view(U, 1, layout), X.view(U, layout, d)).squeeze(1)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(layout, torch.arange(N), coef, (U, N), check_invariants=False) @ X


def user_weighted_means(coef: torch.Tensor, X: torch.Tensor, data: UserData) -> torch.Tensor:
    """``user_means(coef[:, None] * X, data)`` (a GLM's per-user gradient), by :func:`user_weighted_sums`:
    the same operations as :func:`user_means` with the reproducible kernels."""
    if fast_kernels():
        counts, layout = _grouping(data)
        if isinstance(layout, int):  # every user has m >= 1 records: the same division by a scalar
            return user_weighted_sums(coef, X, data) / layout
    else:
        counts = data.counts()
    return user_weighted_sums(coef, X, data) / counts.clamp_min(1).to(X.dtype).unsqueeze(1)


def user_row_dots(X: torch.Tensor, W: torch.Tensor, data: UserData) -> torch.Tensor:
    """``<x_i, W[user(i)]>`` for every record ``i`` (``W`` is ``(num_users, d)``): the reproducible
    :func:`~fedkl.problems.rowwise.row_dots`; fast kernels with ``m`` records per user in user order:
    one batched ``(m, d) @ (d, 1)`` per user, no ``(N, d)`` gather of ``W``."""
    layout = _grouped_layout(data)
    if isinstance(layout, int):
        U, d = W.shape
        return torch.bmm(X.view(U, layout, d), W.unsqueeze(2)).reshape(-1)
    return row_dots(X, W[data.user_index])


def cyclic_batches(
    data: UserData, batch_size: int | None, dtype: torch.dtype
) -> tuple[torch.Tensor, bool, torch.Tensor]:
    """The cyclic mini-batch plan of local training (:meth:`Problem.local_updates`): step ``k`` of a user
    with ``m`` records uses its records at positions ``k*B, ..., k*B + B - 1`` (mod m) in record order.

    Returns ``(pos, cyclic, denom)``: every record's position within its user, whether any user has more
    than ``B`` records (else every step uses all records, as with ``batch_size`` None), and each user's
    batch size ``min(m, B)`` (``m`` when not cyclic; at least 1) as ``dtype``."""
    idx = data.user_index
    counts = data.counts()
    # position of every record within its user (record order), for the cyclic mini-batches
    order = torch.sort(idx, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(idx)
    pos[order] = torch.arange(len(idx), dtype=idx.dtype) - starts[idx[order]]
    cyclic = batch_size is not None and bool((counts > batch_size).any())
    denom = (counts.clamp(max=batch_size) if cyclic else counts).clamp_min(1).to(dtype)
    return pos, cyclic, denom


def in_cyclic_batch(k: int, pos: torch.Tensor, m: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Whether the record at position ``pos`` of a user with ``m`` records is in its step-``k`` batch."""
    mm = m.clamp_min(1)
    return torch.remainder(pos - k * batch_size, mm) < m.clamp(max=batch_size)


def binary_predictions(scores: torch.Tensor) -> torch.Tensor:
    """``sign(score)`` as ±1, a zero score predicting +1 (:func:`binary_accuracy`)."""
    return torch.where(scores >= 0, 1.0, -1.0)


def binary_accuracy(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy of predicting ``sign(score)`` for labels in {-1, +1}; a zero score predicts +1 (so the
    all-zero model is the constant +1 predictor, not a predictor that is always wrong)."""
    predicted = binary_predictions(scores).to(labels.dtype)
    return float((predicted == labels).double().mean())


class BinaryLinear:
    """What the binary linear classifiers (labels ±1, score ``<w, x>``) share: the margins ``y <w, x>``, the
    ±1 prediction, loss and accuracy, the majority class's accuracy beside :meth:`loss_at_zero`, and the
    constants of a loss of the margin with slope in [-1, 0] and curvature at most 1/``curvature_divisor``
    (``||x|| <= R``: L0 = R, L1 = R^2 / divisor; with ``(reg/2)||w||^2`` on ``||w|| <= B``: L0 = R + reg B,
    L1 + reg, mu = reg). A mixin listed before its :class:`Problem` base."""

    loss_word: str  # "a regularized <loss_word> loss is Lipschitz only on a bounded domain"
    curvature_divisor: float

    def _margins(self, w: torch.Tensor, data: UserData) -> torch.Tensor:
        self.check_params(w)
        return data.y.to(w.dtype) * row_matmul(data.X.to(w.dtype), w)

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        R, h = float(feature_bound), self.curvature_divisor
        if self.reg > 0:
            if param_bound is None:
                raise ValueError(
                    f"a regularized {self.loss_word} loss is Lipschitz only on a bounded domain: give param_bound"
                )
            return Constants(
                R + self.reg * param_bound, R * R / h + self.reg, self.reg, f"||x|| <= {R}, ||w|| <= {param_bound}"
            )
        return Constants(R, R * R / h, 0.0, f"||x|| <= {R}, any w")

    def predict(self, w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        self.check_params(w)
        return binary_predictions(row_matmul(X.to(w.dtype), w))

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:
        self.check_params(w)
        return {"loss": self.loss(w, data), "accuracy": binary_accuracy(row_matmul(data.X.to(w.dtype), w), data.y)}

    def trivial_metrics(self, train: UserData, test: UserData) -> dict[str, float]:
        majority = 1.0 if float((train.y > 0).double().mean()) >= 0.5 else -1.0
        return {"accuracy": float((test.y == majority).double().mean()), "loss": self.loss_at_zero()}
