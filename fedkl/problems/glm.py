"""Generalized linear problems: the record loss is ``l(z, y)`` of the score ``z = <w, x>`` alone, so
every derivative is closed-form (``grad = l'(z, y) x``, ``Hessian = l''(z, y) x x^T``).

:class:`GeneralizedLinear` holds the vectorized local solvers that this structure allows, overriding
the generic loops of :class:`fedkl.problems.base.Problem`:

* :meth:`~GeneralizedLinear.local_minimizers` (certified): damped Newton for every user at once;
* :meth:`~GeneralizedLinear.gradients_at_points`: all users AND all points in one pass;
* :meth:`~GeneralizedLinear.local_updates`: local gradient steps of all users at once.

A subclass states its loss through :meth:`~GeneralizedLinear.score_loss`,
:meth:`~GeneralizedLinear.score_derivative` and :meth:`~GeneralizedLinear.score_curvature` (binary
logistic, least squares). Every operation is row-wise (record dot products by
:func:`fedkl.problems.rowwise.row_matmul` / :func:`~fedkl.problems.rowwise.row_dots`, per-user sums by
``index_add_`` in record order, one LAPACK solve per user), so a user's row is bit for bit what that
user computes alone (a Flower client).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from fedkl.data.base import UserData
from fedkl.problems.base import (
    Problem,
    cyclic_batches,
    in_cyclic_batch,
    user_means,
    user_row_dots,
    user_weighted_sums,
)
from fedkl.problems.rowwise import row_dots, row_matmul, row_norms


class GeneralizedLinear(Problem):
    """A problem whose record loss is ``l(<w, x>, y)`` (plus the regularizer ``(reg/2)||w||^2``), with
    the closed-form local solvers of the module docstring. A subclass that changes the loss must
    restate the three ``score_*`` functions (they are what the solvers use)."""

    @staticmethod
    @abstractmethod
    def score_loss(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``l(z, y)`` elementwise (scores ``z``, labels ``y`` broadcast together)."""

    @staticmethod
    @abstractmethod
    def score_derivative(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``dl/dz (z, y)`` elementwise."""

    @staticmethod
    @abstractmethod
    def score_curvature(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``d^2 l/dz^2 (z, y)`` elementwise."""

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
        """Certified: :meth:`newton_local_minimizers`; plain: the generic L-BFGS solver."""
        if certified:
            return self.newton_local_minimizers(center, strength, data, tol=tol, max_iter=max_iter)
        return super().local_minimizers(center, strength, data, tol=tol, max_iter=max_iter)

    def newton_local_minimizers(
        self, center: torch.Tensor, strength: float, data: UserData, *, tol: float, max_iter: int
    ) -> torch.Tensor:
        """Damped Newton for every user at once: ``(num_users, d + 1)``, each row ``[v_u, ||grad F_u(v_u)||]``
        with ``F_u = f_u + (s/2)||v - c||^2`` (``s = strength``, ``c = center``).

        Per user: from c, Newton direction p = -H^{-1} g (H the user's mean record Hessian + (reg + s) I),
        backtracking t = 1, 1/2, ... until F_u(v + t p) <= F_u(v) + t g.p / 4 (at most 40 halvings; no
        decrease: the user stops; the full step when the Newton decrement g.H^{-1}g < 1e-12), stop when
        ||g|| <= tol, when the full step leaves the iterate unchanged (below), or after min(max_iter, 100)
        steps. A user's iterate is frozen once it stops, and every operation is row-wise (module docstring),
        so a user's row does not depend on the other users.
        The residual column is the gradient's norm at the returned point; it certifies
        ``||v_u - argmin F_u|| <= r_u / (reg + s)`` however the iteration ended (the only accuracy claim:
        ``tol`` is a target, and the diameter test's server recomputes r_u from the user's gradient anyway).
        Each iteration computes only the users still iterating, on their records alone (issue 34: it rebuilt
        every user's margins, Hessian and line-search objective until the last user stopped).

        **Rounding floor (issue 34).** At a large strength ``s`` the gradient cannot get below ``tol`` in
        float64: the representable points next to ``argmin F_u`` are ``ulp(v)`` apart, and
        ``grad F_u`` moves by ~``s ulp(v_i)`` between neighbours (at 100,000 users phased-erm's last phase has
        ``s = 1.1e8`` and ``|v_i| ~ 0.01``: ``s ulp(v_i) / 2 ~ 1e-10``, the default ``tol``; 97% of the users
        sat at residuals 1.9-3.1e-10 for all 100 steps). Such a user's full Newton step rounds away:
        ``fl(v + p) = v`` bit for bit, i.e. ``|p_i| <= ulp(v_i) / 2 <= 2^-53 |v_i|`` in every coordinate,
        so ``||p|| <= 2^-53 ||v||`` and (``g = -H p`` up to the solve's rounding, ``||H|| <= L_u + s``)
        ``r_u <= (L_u + s) 2^-53 ||v_u||``: the float64 floor, not a stall of the method. The user stops
        there, and this changes no output: from a bit-identical iterate the next step recomputes the same
        g, H and p (row-wise, deterministic), so the iterate would stay the same to the cap and the final
        recomputation give the same residual, which is the ``gnorm`` it leaves with (its row equal bit
        for bit to running all the steps with the reproducible kernels; the fast ones may move a row's last
        bit with the batch, as the active-set restriction already could; ``tests/problems/test_newton_active.py``,
        and the 100,000 rows of phased-erm's last 100k-user call equal to the old solver's). A user cycling
        between points (not seen there) still runs to the cap. Nothing private rests on reaching ``tol``:
        the diameter test (phased-erm's inner release) uses ``e_u = r_u / mu`` with ``r_u`` recomputed by the
        server from the user's gradient at the returned point, and a larger ``r_u`` only adds conflict edges.
        """
        dtype = self.dtype
        center = center.to(dtype)
        U, d = data.num_users, self.num_params
        mu = float(self.reg) + float(strength)
        ones = torch.ones(d, dtype=dtype)
        # The users still iterating (act: their positions) and only their records: X, y, each record's user
        # among them (ia) and their record counts, compacted whenever users stop, so an iteration costs the
        # active users' records, not everyone's. A user's sums still run over its records in record order
        # (index_add_), so its row is bit for bit what it computes alone.
        act = torch.arange(U)
        X, y, ia = data.X.to(dtype), data.y.to(dtype), data.user_index
        counts = data.counts().clamp_min(1).to(dtype)

        def margins(V: torch.Tensor) -> torch.Tensor:
            return row_matmul(X * V[ia], ones)

        def objective(V: torch.Tensor) -> torch.Tensor:
            z = margins(V)
            rec = self.score_loss(z, y)
            fit = torch.zeros(V.shape[0], dtype=dtype).index_add_(0, ia, rec) / counts
            diff = V - center
            return fit + 0.5 * self.reg * row_matmul(V * V, ones) + 0.5 * strength * row_matmul(diff * diff, ones)

        def gradient(V: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            coef = self.score_derivative(z, y)
            sums = torch.zeros(V.shape[0], d, dtype=dtype).index_add_(0, ia, coef.unsqueeze(1) * X)
            return sums / counts.unsqueeze(1) + self.reg * V + strength * (V - center)

        def hessian(z: torch.Tensor, n: int) -> torch.Tensor:
            weight = self.score_curvature(z, y)
            H = torch.zeros(n, d, d, dtype=dtype)
            step = max(1, (1 << 22) // max(1, d * d))  # records per chunk: <= 4M entries
            for a in range(0, X.shape[0], step):
                xs = X[a : a + step]
                H.index_add_(0, ia[a : a + step], (weight[a : a + step, None, None] * xs[:, :, None]) * xs[:, None, :])
            H = H / counts.view(-1, 1, 1)
            return H + mu * torch.eye(d, dtype=dtype)

        V = center.expand(U, d).clone()
        residual = torch.empty(U, dtype=dtype)

        def stop(leaving: torch.Tensor, Va: torch.Tensor, gnorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Users ``leaving`` (a mask over the active ones) stop at ``Va``, where ``gnorm`` is their gradient's
            norm (their residual: a recomputation at the end would give the same row); only the others' records
            stay. Returns the masks of the users and of the records kept."""
            nonlocal act, X, y, ia, counts
            V[act[leaving]] = Va[leaving]
            residual[act[leaving]] = gnorm[leaving]
            keep = ~leaving
            rec = keep[ia]
            position = torch.cumsum(keep, 0) - 1
            act, X, y, ia, counts = act[keep], X[rec], y[rec], position[ia[rec]], counts[keep]
            return keep, rec

        Va = V.clone()
        for _ in range(min(int(max_iter), 100)):
            if not act.numel():
                break
            z = margins(Va)
            g = gradient(Va, z)
            gnorm = row_norms(g)
            done = ~(gnorm > tol)  # converged (or a non-finite gradient)
            if done.any():
                keep, rec = stop(done, Va, gnorm)
                Va, g, gnorm, z = Va[keep], g[keep], gnorm[keep], z[rec]
                if not act.numel():
                    break
            H = hessian(z, act.numel())
            # one batched LAPACK call: it factors each user's matrix on its own (bit for bit the per-user solve;
            # tests/problems/test_rowwise.py), without a Python loop over users
            p = -torch.linalg.solve(H, g.unsqueeze(-1)).squeeze(-1)
            slope = row_matmul(g * p, ones)
            # Newton decrement g.H^{-1}g = -slope below 1e-12: inside the quadratic-convergence region, where the
            # objective's rounding (~1e-16 x records) hides the decrease: take the full step
            full = (slope < 0) & (-slope < 1e-12)
            stepped = Va + p
            # the full step rounded away (bit for bit, the sign of a zero included): a fixed point of the
            # iteration, where it would stay to the cap (docstring, "Rounding floor")
            fixed = full & ((stepped == Va) & (torch.signbit(stepped) == torch.signbit(Va))).all(1)
            Va = torch.where(full.unsqueeze(1), stepped, Va)
            f0 = objective(Va)
            t = torch.ones(Va.shape[0], dtype=dtype)
            pending = (slope < 0) & ~full
            for _ in range(40):
                if not pending.any():
                    break
                trial = torch.where(pending.unsqueeze(1), Va + t.unsqueeze(1) * p, Va)
                ok = pending & (objective(trial) <= f0 + 0.25 * t * slope)
                Va = torch.where(ok.unsqueeze(1), trial, Va)
                pending &= ~ok
                t = torch.where(pending, 0.5 * t, t)
            # not a descent direction, or no decrease found, or a fixed point: the user stops where its
            # gradient was taken
            leaving = ~(slope < 0) | pending | fixed
            if leaving.any():
                Va = Va[stop(leaving, Va, gnorm)[0]]
        if act.numel():  # out of iterations: the residual at the last step
            V[act] = Va
            residual[act] = row_norms(gradient(Va, margins(Va)))
        return torch.cat([V, residual.unsqueeze(1)], dim=1)

    def gradients_at_points(self, points: torch.Tensor, data: UserData) -> torch.Tensor:
        """Vectorized over users AND points: the record gradient is ``l'(<p, x>, y) x``, so one
        batch-invariant ``(N, k)`` product gives every coefficient; the per-record terms are reduced
        into users with ``index_add_`` (record order, like a client), a chunk of points at a time so
        memory stays O(N d * chunk)."""
        k, d = points.shape
        U = data.num_users
        X = data.X.to(points.dtype)
        y = data.y.to(points.dtype).unsqueeze(1)
        z = row_matmul(X, points.T)  # (N, k)
        coef = self.score_derivative(z, y)
        grads = torch.empty(U, k, d, dtype=points.dtype)
        chunk = max(1, (1 << 24) // max(1, X.shape[0] * d))  # <= 16M entries (128 MB) per chunk
        for j in range(0, k, chunk):
            c = coef[:, j : j + chunk]
            rec = (c.unsqueeze(2) * X.unsqueeze(1)).reshape(X.shape[0], -1)
            grads[:, j : j + chunk] = user_means(rec, data).reshape(U, c.shape[1], d)
        return grads + self.reg * points.unsqueeze(0)

    def gradients_at_own_points(self, points: torch.Tensor, data: UserData) -> torch.Tensor:
        """Vectorized over users: each record's margin against its own user's point by
        :func:`~fedkl.problems.rowwise.row_dots` (the naive-bmm blocks
        :func:`~fedkl.problems.rowwise.row_matmul` uses for one point, so a row is bit for bit the
        one-point :meth:`gradients_at_points` answer of that user alone), reduced with ``index_add_``."""
        X = data.X.to(points.dtype)
        z = row_dots(X, points[data.user_index])
        coef = self.score_derivative(z, data.y.to(points.dtype))
        return user_means(coef.unsqueeze(1) * X, data) + self.reg * points

    def local_updates(
        self, w: torch.Tensor, data: UserData, local_steps: int, local_lr: float, batch_size: int | None
    ) -> torch.Tensor:
        """Vectorized over users: every record's gradient term ``l'(<w_u, x>, y) x`` uses its own user's
        current iterate (per-record dot products by :func:`~fedkl.problems.rowwise.row_dots`), reduced
        into users with ``index_add_`` in record order."""
        U, d = data.num_users, self.num_params
        if U == 0:
            return torch.zeros(0, d, dtype=w.dtype)
        idx = data.user_index
        counts = data.counts()
        pos, cyclic, denom = cyclic_batches(data, batch_size, w.dtype)
        X, y = data.X.to(w.dtype), data.y.to(w.dtype)
        W = w.unsqueeze(0).expand(U, d).clone()
        for k in range(local_steps):
            z = user_row_dots(X, W, data)
            coef = self.score_derivative(z, y)
            if cyclic:
                coef = torch.where(in_cyclic_batch(k, pos, counts[idx], batch_size), coef, torch.zeros_like(coef))
            sums = user_weighted_sums(coef, X, data)
            W = W - local_lr * (sums / denom.unsqueeze(1) + self.reg * W)
        return W - w
