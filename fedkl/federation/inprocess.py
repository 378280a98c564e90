"""The in-process vectorized federation: every user's records in one set of flat tensors.

Each request is one batched computation over all asked users (per-record terms reduced into users
with ``index_add_``), so a 10,000-user simulation costs a few tensor ops per round, not 10,000
Python calls. It computes exactly what a Flower client computes for its one user, bit for bit: the
problems' record kernels are batch-invariant (:mod:`fedkl.problems.rowwise`) and ``index_add_`` adds a
user's records in record order, so a user's row does not depend on which other users share the call.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from scipy.optimize import minimize

from fedkl.data.base import FederatedDataset, UserData
from fedkl.federation.base import (
    Answers,
    CertifiedLocalMinimizer,
    ClippedGradient,
    ClippedLocalUpdate,
    Federation,
    GradientDifference,
    GradientsAtOwnPoints,
    GradientsAtPoints,
    LocalLoss,
    LocalRegularizedMinimizer,
    Query,
    check_local_query,
)
from fedkl.problems.base import Problem, user_means
from fedkl.problems.least_squares import LeastSquares
from fedkl.problems.logistic import BinaryLogistic
from fedkl.problems.rowwise import row_matmul, row_norms, sigmoid, softplus


def clip_rows(values: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip every row to L2 norm <= clip; non-finite rows become zero.

    Returns the clipped rows and a boolean mask of the rows that were non-finite. A zero row stays
    zero (no division by its norm).
    """
    bad = ~torch.isfinite(values).all(dim=1)
    values = torch.where(bad.unsqueeze(1), torch.zeros_like(values), values)
    norms = row_norms(values).unsqueeze(1)
    # rows already inside the ball are returned bit-for-bit; the others are scaled onto it
    scaled = values * (clip / torch.clamp(norms, min=torch.finfo(values.dtype).tiny))
    return torch.where(norms > clip, scaled, values), bad


class InProcessFederation(Federation):
    """All users of ``dataset`` in this process, computing ``problem``'s per-user quantities."""

    def __init__(self, problem: Problem, dataset: FederatedDataset) -> None:
        self.problem = problem
        self.dataset = dataset
        self._train = dataset.train.to(problem.dtype)
        self._test = dataset.test.to(problem.dtype)

    @property
    def user_ids(self) -> tuple[str, ...]:
        return self._train.user_ids

    @property
    def num_params(self) -> int:
        return self.problem.num_params

    def _data(self, users: list[int], split: str = "train") -> UserData:
        data = {"train": self._train, "test": self._test}.get(split)
        if data is None:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if users == list(range(self.num_users)):
            return data
        return data.subset(users)

    def _params(self, w: torch.Tensor) -> torch.Tensor:
        w = torch.as_tensor(w).to(self.problem.dtype)
        self.problem.check_params(w)
        return w

    def compute(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        users = self._users(users)
        if isinstance(query, ClippedGradient):
            data = self._data(users)
            grads = self.problem.per_user_gradients(self._params(query.w), data)
            values, bad = clip_rows(grads, query.clip)
        elif isinstance(query, GradientDifference):
            data = self._data(users)
            diff = (self.problem.per_user_gradients(self._params(query.w_new), data)
                    - self.problem.per_user_gradients(self._params(query.w_old), data))
            values, bad = clip_rows(diff, query.clip)
        elif isinstance(query, LocalLoss):
            losses = self.problem.per_user_losses(self._params(query.w), self._data(users, query.split))
            bad = ~torch.isfinite(losses)
            values = torch.where(bad, torch.zeros_like(losses), losses)
        elif isinstance(query, LocalRegularizedMinimizer):  # CertifiedLocalMinimizer too: (d + 1) columns
            values = self._local_minimizers(query, users)
            bad = ~torch.isfinite(values).all(dim=1)
            values = torch.where(bad.unsqueeze(1), torch.zeros_like(values), values)
        elif isinstance(query, GradientsAtPoints):
            values = self._gradients_at_points(query.points, users)
            bad = ~torch.isfinite(values).flatten(1).all(dim=1)
            values = torch.where(bad.view(-1, 1, 1), torch.zeros_like(values), values)
        elif isinstance(query, GradientsAtOwnPoints):
            values = self._gradients_at_own_points(query.points, users)
            bad = ~torch.isfinite(values).all(dim=1)
            values = torch.where(bad.unsqueeze(1), torch.zeros_like(values), values)
        elif isinstance(query, ClippedLocalUpdate):
            values, bad = clip_rows(self._local_updates(query, users), query.clip)
        else:
            raise TypeError(f"unsupported query type {type(query).__name__}")
        failed = [users[i] for i in torch.nonzero(bad).flatten().tolist()]
        return Answers(users=users, values=values, failed=failed)

    def _local_minimizers(self, query: LocalRegularizedMinimizer, users: list[int]) -> torch.Tensor:
        """Reference solver: L-BFGS per user on ``f_u(v) + (s/2)||v - c||^2`` (a loop over users;
        the batched solver belongs with the output-perturbation algorithms that need it)."""
        center = self._params(query.center)
        check_local_query(query)
        certified = isinstance(query, CertifiedLocalMinimizer)
        if certified and type(self.problem) in (BinaryLogistic, LeastSquares):
            return self._newton_local_minimizers(query, users)
        out = torch.empty(len(users), self.num_params + int(certified), dtype=self.problem.dtype)
        for row, u in enumerate(users):
            data = self._data([u])

            def fun(v: np.ndarray) -> tuple[float, np.ndarray]:
                vt = torch.from_numpy(v).to(self.problem.dtype)
                diff = vt - center
                f = float(self.problem.per_user_losses(vt, data)[0]) + 0.5 * query.strength * float(diff @ diff)
                g = self.problem.per_user_gradients(vt, data)[0] + query.strength * diff
                return f, g.double().numpy()

            res = minimize(fun, center.double().numpy(), jac=True, method="L-BFGS-B",
                           options={"maxiter": query.max_iter, "gtol": query.tol, "ftol": 0.0})
            v = torch.from_numpy(res.x).to(self.problem.dtype)
            out[row, :self.num_params] = v
            if certified:  # the residual at the returned point, recomputed (not the solver's own report)
                g = self.problem.per_user_gradients(v, data)[0] + query.strength * (v - center)
                out[row, -1] = g.norm()
        return out

    def _newton_local_minimizers(self, query: CertifiedLocalMinimizer, users: list[int]) -> torch.Tensor:
        """Damped Newton for every user at once (binary logistic, least squares): ``(len(users), d + 1)``,
        each row ``[v_u, ||grad F_u(v_u)||]`` with ``F_u = f_u + (s/2)||v - c||^2``.

        Per user: from c, Newton direction p = -H^{-1} g (H the user's mean record Hessian + (reg + s) I),
        backtracking t = 1, 1/2, ... until F_u(v + t p) <= F_u(v) + t g.p / 4 (at most 40 halvings; no
        decrease: the user stops; the full step when the Newton decrement g.H^{-1}g < 1e-12), stop when ||g|| <= tol or after min(max_iter, 100) steps. A user's
        iterate is frozen once it stops, and every operation is row-wise (record dot products by
        :func:`row_matmul`, per-user sums by ``index_add_`` in record order, one LAPACK solve per user),
        so a user's row does not depend on the other users: it is what that user computes alone (a
        Flower client). The residual column is recomputed at the returned point; it certifies
        ``||v_u - argmin F_u|| <= r_u / (reg + s)`` however the iteration ended.
        """
        problem = self.problem
        dtype = problem.dtype
        center = self._params(query.center).to(dtype)
        data = self._data(users)
        U, d = len(users), self.num_params
        X = data.X.to(dtype)
        y = data.y.to(dtype)
        idx = data.user_index
        counts = data.counts().clamp_min(1).to(dtype)
        mu = float(problem.reg) + float(query.strength)
        logistic = isinstance(problem, BinaryLogistic)
        ones = torch.ones(d, dtype=dtype)

        def margins(V: torch.Tensor) -> torch.Tensor:
            return row_matmul(X * V[idx], ones)

        def objective(V: torch.Tensor) -> torch.Tensor:
            z = margins(V)
            rec = softplus(-y * z) if logistic else 0.5 * (z - y) ** 2
            fit = torch.zeros(U, dtype=dtype).index_add_(0, idx, rec) / counts
            diff = V - center
            return fit + 0.5 * problem.reg * row_matmul(V * V, ones) + 0.5 * query.strength * row_matmul(diff * diff, ones)

        def gradient(V: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            coef = -y * sigmoid(-y * z) if logistic else z - y
            return user_means(coef.unsqueeze(1) * X, data) + problem.reg * V + query.strength * (V - center)

        def hessian(z: torch.Tensor) -> torch.Tensor:
            if logistic:
                sg = sigmoid(y * z)
                weight = sg * (1.0 - sg)
            else:
                weight = torch.ones_like(z)
            H = torch.zeros(U, d, d, dtype=dtype)
            step = max(1, (1 << 22) // max(1, d * d))  # records per chunk: <= 4M entries
            for a in range(0, X.shape[0], step):
                xs = X[a:a + step]
                H.index_add_(0, idx[a:a + step], (weight[a:a + step, None, None] * xs[:, :, None]) * xs[:, None, :])
            H = H / counts.view(-1, 1, 1)
            return H + mu * torch.eye(d, dtype=dtype)

        V = center.expand(U, d).clone()
        active = torch.ones(U, dtype=torch.bool)
        for _ in range(min(int(query.max_iter), 100)):
            z = margins(V)
            g = gradient(V, z)
            active &= row_norms(g) > query.tol
            if not active.any():
                break
            H = hessian(z)
            p = torch.zeros_like(V)
            for u in torch.nonzero(active).flatten().tolist():  # one solve per user (batch-invariant)
                p[u] = -torch.linalg.solve(H[u], g[u])
            slope = row_matmul(g * p, ones)
            # Newton decrement g.H^{-1}g = -slope below 1e-12: inside the quadratic-convergence region, where the
            # objective's rounding (~1e-16 x records) hides the decrease: take the full step
            full = active & (slope < 0) & (-slope < 1e-12)
            V = torch.where(full.unsqueeze(1), V + p, V)
            f0 = objective(V)
            t = torch.ones(U, dtype=dtype)
            pending = active & (slope < 0) & ~full
            active &= slope < 0
            for _ in range(40):
                if not pending.any():
                    break
                trial = torch.where(pending.unsqueeze(1), V + t.unsqueeze(1) * p, V)
                ok = pending & (objective(trial) <= f0 + 0.25 * t * slope)
                V = torch.where(ok.unsqueeze(1), trial, V)
                pending &= ~ok
                t = torch.where(pending, 0.5 * t, t)
            active &= ~pending  # no decrease found: stop that user
        z = margins(V)
        residual = row_norms(gradient(V, z))
        return torch.cat([V, residual.unsqueeze(1)], dim=1)

    def _gradients_at_points(self, points: torch.Tensor, users: list[int]) -> torch.Tensor:
        """Per-user mean gradients at k points, ``(len(users), k, d)``.

        Binary logistic and least squares (generalized linear models) are vectorized over users
        AND points: the record gradient is ``coef(<w, x>, y) * x``, so one batch-invariant
        ``(N, k)`` product gives every coefficient; the per-record terms are reduced into users
        with ``index_add_`` (record order, like a client), a chunk of points at a time so memory
        stays O(N d * chunk). Other problems loop over the points. Every user's rows are bit-for-bit
        what that user computes alone (see :mod:`fedkl.problems.rowwise`).
        """
        points = torch.as_tensor(points).to(self.problem.dtype)
        if points.shape[1] != self.num_params or not torch.isfinite(points).all():
            raise ValueError(f"points must be finite with {self.num_params} columns")
        data = self._data(users)
        k, d = points.shape
        if type(self.problem) in (BinaryLogistic, LeastSquares):
            X = data.X.to(points.dtype)
            y = data.y.to(points.dtype).unsqueeze(1)
            z = row_matmul(X, points.T)  # (N, k)
            coef = -y * sigmoid(-y * z) if isinstance(self.problem, BinaryLogistic) else z - y
            grads = torch.empty(len(users), k, d, dtype=points.dtype)
            chunk = max(1, (1 << 24) // max(1, X.shape[0] * d))  # <= 16M entries (128 MB) per chunk
            for j in range(0, k, chunk):
                c = coef[:, j:j + chunk]
                rec = (c.unsqueeze(2) * X.unsqueeze(1)).reshape(X.shape[0], -1)
                grads[:, j:j + chunk] = user_means(rec, data).reshape(len(users), c.shape[1], d)
            return grads + self.problem.reg * points.unsqueeze(0)
        out = torch.empty(len(users), k, d, dtype=points.dtype)
        for j in range(k):
            out[:, j] = self.problem.per_user_gradients(points[j], data)
        return out

    def _gradients_at_own_points(self, points: torch.Tensor, users: list[int]) -> torch.Tensor:
        """Row i: the mean gradient of user ``users[i]`` at ``points[i]``, ``(len(users), d)``.

        Each user is one one-point :meth:`_gradients_at_points` call on its records alone: exactly
        what a Flower client computes for the one-point ``GradientsAtPoints`` request it receives."""
        points = torch.as_tensor(points).to(self.problem.dtype)
        if points.shape != (len(users), self.num_params):
            raise ValueError(f"points must have one row of {self.num_params} per asked user ({len(users)}), "
                             f"got shape {tuple(points.shape)}")
        out = torch.empty(len(users), self.num_params, dtype=points.dtype)
        for row, u in enumerate(users):
            out[row] = self._gradients_at_points(points[row:row + 1], [u])[0, 0]
        return out

    def _local_updates(self, query: ClippedLocalUpdate, users: list[int]) -> torch.Tensor:
        """``w_K - w`` (not yet clipped) of every asked user after the query's local SGD steps.

        Binary logistic and least squares are vectorized over users: every record's gradient term
        ``coef(<w_u, x>, y) x`` uses its own user's current iterate (per-record dot products in
        batch-invariant naive-bmm blocks, like :func:`fedkl.problems.rowwise.row_matmul`), reduced
        into users with ``index_add_`` in record order. Other problems loop over the users with the
        problem's own ``per_user_gradients``. Either way a user's row is computed from that user's
        records only, by the same code a Flower client runs for its one user. A user whose iterate
        stops being finite gets a NaN row (reported as failed by the caller's ``clip_rows``).
        """
        w = self._params(query.w)
        data = self._data(users)
        U, d = len(users), self.num_params
        if U == 0:
            return torch.zeros(0, d, dtype=w.dtype)
        idx = data.user_index
        counts = data.counts()
        # position of every record within its user (record order), for the cyclic mini-batches
        order = torch.sort(idx, stable=True).indices
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(idx)
        pos[order] = torch.arange(len(idx), dtype=idx.dtype) - starts[idx[order]]
        B = query.batch_size
        cyclic = B is not None and bool((counts > B).any())
        denom = (counts.clamp(max=B) if cyclic else counts).clamp_min(1).to(w.dtype)

        def in_batch(k: int, pos: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            mm = m.clamp_min(1)
            return torch.remainder(pos - k * B, mm) < m.clamp(max=B)

        if type(self.problem) in (BinaryLogistic, LeastSquares):
            X, y = data.X.to(w.dtype), data.y.to(w.dtype)
            W = w.unsqueeze(0).expand(U, d).clone()
            for k in range(query.local_steps):
                z = self._row_dots(X, W[idx])
                coef = -y * sigmoid(-y * z) if isinstance(self.problem, BinaryLogistic) else z - y
                if cyclic:
                    coef = torch.where(in_batch(k, pos, counts[idx]), coef, torch.zeros_like(coef))
                sums = torch.zeros(U, d, dtype=w.dtype).index_add_(0, idx, coef.unsqueeze(1) * X)
                W = W - query.local_lr * (sums / denom.unsqueeze(1) + self.problem.reg * W)
            return W - w
        out = torch.empty(U, d, dtype=w.dtype)
        for r in range(U):
            one = data.subset([r])
            m = torch.tensor(one.num_records)
            wu = w.clone()
            for k in range(query.local_steps):
                if not torch.isfinite(wu).all():
                    break
                batch = one
                if cyclic:
                    keep = in_batch(k, torch.arange(one.num_records), m)
                    batch = UserData(one.X[keep], one.y[keep], one.user_index[keep], one.user_ids)
                wu = wu - query.local_lr * self.problem.per_user_gradients(wu, batch)[0]
            out[r] = wu - w if torch.isfinite(wu).all() else torch.full_like(wu, float("nan"))
        return out

    @staticmethod
    def _row_dots(X: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        """``<X_i, V_i>`` for every row ``i`` of two ``(N, d)`` tensors, in blocks of fewer than 400
        multiply-adds (ATen's naive batched kernel): a row's result depends only on that row."""
        out = X.new_zeros(X.shape[0])
        for c0 in range(0, X.shape[1], 399):
            blk = slice(c0, c0 + 399)
            out = out + torch.bmm(X[:, None, blk], V[:, blk, None]).reshape(-1)
        return out

    # --- non-private evaluation (research use: see README, "What is private") -------------------
    def evaluate(self, w: torch.Tensor, split: str = "test") -> dict[str, float]:
        return self.problem.metrics(self._params(w), self._data(list(range(self.num_users)), split))
