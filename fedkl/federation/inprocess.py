"""The in-process vectorized federation: every user's records in one set of flat tensors.

Each request is one batched computation over all asked users (per-record terms reduced into users
with ``index_add_``), so a 10,000-user simulation costs a few tensor ops per round, not 10,000
Python calls. It computes exactly what a Flower client computes for its one user, bit for bit: the
problems' record kernels are batch-invariant (:mod:`fedkl.problems.rowwise`) and ``index_add_`` adds a
user's records in record order, so a user's row does not depend on which other users share the call.

Each query type has one answer, registered with :func:`answers` (``@answers(ClippedGradient)``); the
per-user numerics are the problem's (:class:`fedkl.problems.base.Problem`: gradients, losses and the
local solvers), clipping is :func:`fedkl.federation.clipping.clip_rows` (re-exported here).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from fedkl.data.base import FederatedDataset, UserData
from fedkl.federation.base import (
    Answers,
    CertifiedLocalMinimizer,
    ClampedGradient,
    ClampedGradientDifference,
    ClippedGradient,
    ClippedLocalUpdate,
    DualClippedGradient,
    FeatureClippedGradient,
    Federation,
    GradientDifference,
    GradientsAtOwnPoints,
    GradientsAtPoints,
    LocalLoss,
    LocalRegularizedMinimizer,
    Query,
    check_local_query,
)
from fedkl.federation.clipping import (
    clamp_rows,
    clip_rows,
    clip_rows_dual,
    clipped_sum,
    reject_rows_above,
    zero_nonfinite_rows,
)
from fedkl.federation.ghost_clipping import check_against_per_record, ghost_clipped_sum, unsupported_reason
from fedkl.problems.base import Problem
from fedkl.problems.rowwise import fast_kernels

AnswerMethod = Callable[["InProcessFederation", Query, list[int]], tuple[torch.Tensor, torch.Tensor]]

# query type -> its in-process answer (filled by @answers)
_ANSWERS: dict[type, AnswerMethod] = {}


def answers(query_type: type) -> Callable[[AnswerMethod], AnswerMethod]:
    """Register the decorated function as the in-process answer to ``query_type`` (and to its subclasses
    that have no answer of their own): a method of :class:`InProcessFederation`, or a function
    ``(federation, query, users)`` defined elsewhere. It gets validated user positions and returns
    ``(values, bad)``: one row per asked user and the mask of the users whose answer is invalid (their
    rows already zero; :mod:`fedkl.federation.clipping`). A subclass of the backend may override a
    method answer by defining a method of the same name."""

    def register(method: AnswerMethod) -> AnswerMethod:
        if query_type in _ANSWERS:
            raise ValueError(f"{query_type.__name__} already has an in-process answer")
        _ANSWERS[query_type] = method
        return method

    return register


GHOST_FLOAT32 = "float32: the clip is proven on per-record rows only"


class InProcessFederation(Federation):
    """All users of ``dataset`` in this process, computing ``problem``'s per-user quantities.

    Each query type is answered by one method registered with :func:`answers`; the per-user
    numerics (gradients, local solvers) are the problem's own (:class:`fedkl.problems.base.Problem`).

    :meth:`sum` of a :class:`ClippedGradient` on a torch model (:class:`~fedkl.problems.torch_model.TorchModel`,
    the MLP included) is the total from :func:`~fedkl.federation.ghost_clipping.ghost_clipped_sum`
    (one row; no per-record gradients) when ``ghost`` (the default) and the model is covered; otherwise,
    and for :meth:`compute`, the per-record path. Below float64 it is always the per-record path
    (:data:`GHOST_FLOAT32`): a float32 row is clipped with a proven margin
    (:func:`~fedkl.federation.clipping.clip_rows`), while the ghost sum fuses every user's scaled gradient in
    one backward pass, whose float32 rounding (1e-4 relative, measured) no per-user proof bounds. ``clipped_sum_path`` says which, and why (set at the first
    such sum, after comparing both paths' norms on three records). With the fast kernels, the per-record
    path's sum is also one row: the per-user gradients clipped and summed in one step
    (:func:`~fedkl.federation.clipping.clipped_sum`)."""

    def __init__(self, problem: Problem, dataset: FederatedDataset, ghost: bool = True) -> None:
        self.problem = problem
        self.dataset = dataset
        self._train = dataset.train.to(problem.dtype)
        self._test = dataset.test.to(problem.dtype)
        self.ghost = ghost
        self.clipped_sum_path: str | None = None  # "ghost" or "per-record (why)", once decided
        self._everyone = list(range(self._train.num_users))  # the request of a full round, compared in O(1) Python

    def _ghost_covers(self, w: torch.Tensor) -> bool:
        """Whether :meth:`sum` answers ClippedGradient by ghost clipping (decided once, at the first call)."""
        if self.clipped_sum_path is None:
            try:
                reason = unsupported_reason(self.problem) if self.ghost else "ghost clipping off"
                if self.problem.dtype != torch.float64:  # the fused sum has no per-user bound on its rounding
                    reason = reason or GHOST_FLOAT32
                reason = reason or check_against_per_record(self.problem, w, self._train)
            except ValueError as e:  # a layer call ghost clipping cannot read (one line)
                reason = str(e)
            self.clipped_sum_path = "ghost" if reason is None else f"per-record ({reason})"
        return self.clipped_sum_path == "ghost"

    @property
    def user_ids(self) -> tuple[str, ...]:
        return self._train.user_ids

    @property
    def num_params(self) -> int:
        return self.problem.num_params

    def _users(self, users: Sequence[int] | None) -> list[int]:
        """:meth:`Federation._users`; a request for every user in order (a full round, each round) is
        recognised by one list comparison in C instead of the per-user conversion and set."""
        if type(users) is list and users == self._everyone:
            return list(self._everyone)
        return super()._users(users)

    def _data(self, users: list[int], split: str = "train") -> UserData:
        data = {"train": self._train, "test": self._test}.get(split)
        if data is None:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if len(users) == self.num_users and users == self._everyone:  # O(1) for a one-user request
            return data
        return data.subset(users)

    def _params(self, w: torch.Tensor) -> torch.Tensor:
        w = torch.as_tensor(w).to(self.problem.dtype)
        self.problem.check_params(w)
        return w

    def sum(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        if type(query) is not ClippedGradient:
            return super().sum(query, users)
        w = self._params(query.w)
        if self._ghost_covers(w):
            users = self._users(users)
            total, bad = ghost_clipped_sum(self.problem, w, self._data(users), query.clip)
        elif fast_kernels() and self._answers_clipped_gradient_itself():
            users = self._users(users)
            # fast kernels: the per-user gradients clipped and summed in one step (no clipped copy); the
            # reproducible kernels keep the per-user rows (compute), which the bit-for-bit tests pin
            total, bad = clipped_sum(self.problem.per_user_gradients(w, self._data(users)), query.clip)
        else:
            return super().sum(query, users)
        failed = [users[i] for i in torch.nonzero(bad).flatten().tolist()]
        return Answers(users=users, values=total.unsqueeze(0), failed=failed)

    def _answers_clipped_gradient_itself(self) -> bool:
        """Whether :meth:`sum` may clip and sum the per-user gradients directly: not when a subclass
        overrides :meth:`compute` or the ClippedGradient answer (its override must see the request)."""
        cls = type(self)
        return (
            cls.compute is InProcessFederation.compute
            and cls._clipped_gradient is InProcessFederation._clipped_gradient
        )

    def compute(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        users = self._users(users)
        answer = next((_ANSWERS[t] for t in type(query).__mro__ if t in _ANSWERS), None)
        if answer is None:
            raise TypeError(f"unsupported query type {type(query).__name__}")
        values, bad = getattr(type(self), answer.__name__, answer)(self, query, users)  # a subclass's override
        failed = [users[i] for i in torch.nonzero(bad).flatten().tolist()]
        return Answers(users=users, values=values, failed=failed)

    # --- the answers, one per query type ----------------------------------------------------------
    @answers(ClippedGradient)
    def _clipped_gradient(self, query: ClippedGradient, users: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        data = self._data(users)
        grads = self.problem.per_user_gradients(self._params(query.w), data)
        return clip_rows(grads, query.clip)

    @answers(ClampedGradient)
    def _clamped_gradient(self, query: ClampedGradient, users: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        grads = self.problem.per_user_gradients(self._params(query.w), self._data(users))
        return clamp_rows(grads, query.bound)

    @answers(DualClippedGradient)
    def _dual_clipped_gradient(self, query: DualClippedGradient, users: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        grads = self.problem.per_user_gradients(self._params(query.w), self._data(users))
        return clip_rows_dual(grads, query.clip, query.q)

    @answers(FeatureClippedGradient)
    def _feature_clipped_gradient(
        self, query: FeatureClippedGradient, users: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        data = self._data(users)
        X, _ = clip_rows(data.X, query.feature_clip)
        clipped = UserData(X, data.y, data.user_index, data.user_ids)
        grads = self.problem.per_user_gradients(self._params(query.w), clipped)
        return reject_rows_above(grads, query.bound)

    @answers(GradientDifference)
    def _gradient_difference(self, query: GradientDifference, users: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return clip_rows(self._gradient_differences(query, users), query.clip)

    @answers(ClampedGradientDifference)
    def _clamped_gradient_difference(
        self, query: ClampedGradientDifference, users: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return clamp_rows(self._gradient_differences(query, users), query.clip)

    def _gradient_differences(self, query: GradientDifference, users: list[int]) -> torch.Tensor:
        """``grad f_u(w_new) - grad f_u(w_old)`` (not yet clipped) of every asked user."""
        data = self._data(users)
        return self.problem.per_user_gradients(self._params(query.w_new), data) - self.problem.per_user_gradients(
            self._params(query.w_old), data
        )

    @answers(LocalLoss)
    def _local_loss(self, query: LocalLoss, users: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        losses = self.problem.per_user_losses(self._params(query.w), self._data(users, query.split))
        return zero_nonfinite_rows(losses)

    @answers(LocalRegularizedMinimizer)
    def _local_minimizer(self, query: LocalRegularizedMinimizer, users: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return zero_nonfinite_rows(self._local_minimizers(query, users, certified=False))

    @answers(CertifiedLocalMinimizer)
    def _certified_local_minimizer(
        self, query: CertifiedLocalMinimizer, users: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return zero_nonfinite_rows(self._local_minimizers(query, users, certified=True))

    def _local_minimizers(self, query: LocalRegularizedMinimizer, users: list[int], certified: bool) -> torch.Tensor:
        """The problem's local solver (:meth:`fedkl.problems.base.Problem.local_minimizers`) for the
        asked users: ``(len(users), d)``, plus the residual column when ``certified``."""
        center = self._params(query.center)
        check_local_query(query)
        return self.problem.local_minimizers(
            center, query.strength, self._data(users), tol=query.tol, max_iter=query.max_iter, certified=certified
        )

    @answers(GradientsAtPoints)
    def _gradients_at_points_answer(
        self, query: GradientsAtPoints, users: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return zero_nonfinite_rows(self._gradients_at_points(query.points, users))

    @answers(GradientsAtOwnPoints)
    def _gradients_at_own_points_answer(
        self, query: GradientsAtOwnPoints, users: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return zero_nonfinite_rows(self._gradients_at_own_points(query.points, users))

    @answers(ClippedLocalUpdate)
    def _clipped_local_update(self, query: ClippedLocalUpdate, users: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return clip_rows(self._local_updates(query, users), query.clip)

    def _gradients_at_points(self, points: torch.Tensor, users: list[int]) -> torch.Tensor:
        """Per-user mean gradients at k points, ``(len(users), k, d)``: the problem's
        :meth:`~fedkl.problems.base.Problem.gradients_at_points` (vectorized over users and points for
        the generalized linear problems). Every user's rows are bit-for-bit what that user computes
        alone (see :mod:`fedkl.problems.rowwise`)."""
        points = torch.as_tensor(points).to(self.problem.dtype)
        if points.shape[1] != self.num_params or not torch.isfinite(points).all():
            raise ValueError(f"points must be finite with {self.num_params} columns")
        return self.problem.gradients_at_points(points, self._data(users))

    def _gradients_at_own_points(self, points: torch.Tensor, users: list[int]) -> torch.Tensor:
        """Row i: the mean gradient of user ``users[i]`` at ``points[i]``, ``(len(users), d)``.

        The problem's :meth:`~fedkl.problems.base.Problem.gradients_at_own_points` (one batched call for
        the GLMs): each row is bit for bit the one-point ``GradientsAtPoints`` answer that user's Flower
        client computes on its records alone."""
        points = torch.as_tensor(points).to(self.problem.dtype)
        if points.shape != (len(users), self.num_params):
            raise ValueError(
                f"points must have one row of {self.num_params} per asked user ({len(users)}), "
                f"got shape {tuple(points.shape)}"
            )
        if not torch.isfinite(points).all():
            raise ValueError(f"points must be finite with {self.num_params} columns")
        return self.problem.gradients_at_own_points(points, self._data(users))

    def _local_updates(self, query: ClippedLocalUpdate, users: list[int]) -> torch.Tensor:
        """``w_K - w`` (not yet clipped) of every asked user after the query's local SGD steps (or
        epochs: :meth:`~fedkl.problems.base.Problem.local_epoch_updates`): the
        problem's :meth:`~fedkl.problems.base.Problem.local_updates` (a user's row is computed from that
        user's records only, by the same code a Flower client runs for its one user). A user whose
        iterate stops being finite gets a NaN row (reported as failed by the caller's ``clip_rows``)."""
        w = self._params(query.w)
        data = self._data(users)
        if query.local_epochs is None:
            return self.problem.local_updates(w, data, query.local_steps, query.local_lr, query.batch_size)
        return self.problem.local_epoch_updates(w, data, query.local_epochs, query.local_lr, query.batch_size)

    # --- non-private evaluation (research use: docs/concepts/guarantee.md, "What is private") -------------------
    def evaluate(self, w: torch.Tensor, split: str = "test") -> dict[str, float]:
        return self.problem.metrics(self._params(w), self._data(list(range(self.num_users)), split))
