"""The federation interface that every server algorithm is written against.

An algorithm asks a federation for per-user quantities of some users ("the clipped gradients of
these users at w") and gets back either the per-user values or their sum, together with which
users answered. It never sees records, never imports a transport, and never adds noise: noise is
added by :class:`fedkl.privacy.release.Releaser` on the server.

Backends: :class:`fedkl.federation.inprocess.InProcessFederation` (all users as stacked tensors,
one batched op per request) and :class:`fedkl.flower.federation.FlowerFederation` (ServerApp <->
ClientApps over Flower Messages), implementing the same methods with the same query types, which
are plain data so that they serialise into Flower ConfigRecords/ArrayRecords
(:mod:`fedkl.flower.codec`).

Clipping is part of the query and is done where the data lives (the client, or the vectorized
backend): that is what bounds each user's contribution. A user whose answer is missing or invalid
(dropout, timeout, NaN, wrong shape) contributes the zero vector and is reported in ``failed``:
the norm bound of every contribution, hence the sensitivity of the sum, is unchanged.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Sequence, Union

import torch


def _check_clip(clip: float) -> None:
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"clip norm must be finite and > 0, got {clip}")


@dataclass(frozen=True)
class ClippedGradient:
    """``clip_C(grad f_u(w))``, ``clip_C(v) = v * min(1, C/||v||)`` (norm <= C, zero stays zero)."""

    w: torch.Tensor
    clip: float

    def __post_init__(self) -> None:
        _check_clip(self.clip)


@dataclass(frozen=True)
class GradientDifference:
    """``clip_C(grad f_u(w_new) - grad f_u(w_old))`` (variance-reduced methods)."""

    w_new: torch.Tensor
    w_old: torch.Tensor
    clip: float

    def __post_init__(self) -> None:
        _check_clip(self.clip)


@dataclass(frozen=True)
class LocalRegularizedMinimizer:
    """``argmin_v f_u(v) + (strength/2)||v - center||^2``, solved locally to gradient norm ``tol``."""

    center: torch.Tensor
    strength: float
    tol: float = 1e-10
    max_iter: int = 500

    allow_zero_strength: ClassVar[bool] = False


@dataclass(frozen=True)
class CertifiedLocalMinimizer(LocalRegularizedMinimizer):
    """The local regularized minimizer ``v`` (as :class:`LocalRegularizedMinimizer`) AND its residual
    ``r = ||grad f_u(v) + strength (v - center)||``: the answer is ``(d + 1,)`` = ``[v, r]``.

    With ``mu`` the strong convexity of ``f_u`` (problem regularizer), ``||v - v*|| <= r/(mu + strength)``
    certifies the distance to the exact minimizer whether or not the local solver converged (the
    deletion tests of paper 002 need a PROVEN bound, not a tolerance that was hoped for). The
    reported ``r`` is the client's word: an algorithm whose privacy needs it true recomputes it from
    gradient answers (:class:`GradientsAtOwnPoints` at ``v``) and uses the report only to flag
    clients whose two answers disagree.
    ``strength`` may be 0 here (a strongly convex f_u alone: the localisation call of Alg 5/6)."""

    allow_zero_strength: ClassVar[bool] = True


def local_strength_ok(query: LocalRegularizedMinimizer) -> bool:
    """A local-minimizer query's strength is valid: finite and > 0 (>= 0 for the certified kind).

    Strength 0 makes sense only for a strongly convex f_u (problem regularizer > 0); the query does
    not know the problem, so the caller must (DiameterSCOutputPert requires reg + strength > 0)."""
    s = query.strength
    return (isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
            and (s > 0 or (query.allow_zero_strength and s == 0)))


def check_local_query(query: LocalRegularizedMinimizer) -> None:
    """ValueError unless strength (:func:`local_strength_ok`), tol (finite, > 0) and max_iter (an
    integer in [1, 100000]) are valid: the same rule on every backend (the codec refuses the same)."""
    if not local_strength_ok(query):
        raise ValueError("the local regularization strength must be finite and > 0 (>= 0 for the certified kind)")
    tol, it = query.tol, query.max_iter
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (math.isfinite(tol) and tol > 0):
        raise ValueError(f"tol must be finite and > 0, got {tol!r}")
    if isinstance(it, bool) or not isinstance(it, (int, float)) or int(it) != it or not 1 <= it <= 100_000:
        raise ValueError(f"max_iter must be an integer in [1, 100000], got {it!r}")


@dataclass(frozen=True)
class LocalLoss:
    """``f_u(w)`` (a scalar per user); also used for evaluation on held-out records."""

    w: torch.Tensor
    split: str = "train"


@dataclass(frozen=True)
class GradientsAtPoints:
    """``grad f_u(p_k)`` for every user and every point ``p_k`` (rows of ``points``, shape ``(k, d)``):
    the UNCLIPPED per-user mean gradients, regularizer included; answer shape ``(users, k, d)``.

    Used by the output-perturbation algorithms (paper 002) whose minimizer is computed by the
    server from exact per-user gradients (no clipping: clipped gradients are not the gradient of
    any loss, and the minimizer-stability argument needs the true loss). Privacy there comes from
    the deletion-stability test, not from a norm bound on the answer. A user whose answer is
    non-finite is reported in ``failed`` and its rows are zero.
    """

    points: torch.Tensor

    def __post_init__(self) -> None:
        if self.points.dim() != 2:
            raise ValueError(f"points must be (k, d), got shape {tuple(self.points.shape)}")


@dataclass(frozen=True)
class GradientsAtOwnPoints:
    """``grad f_u(p_u)`` for every asked user at ITS OWN point ``p_u`` (row i of ``points`` goes to the
    i-th asked user); answer shape ``(users, d)``. The same oracle as :class:`GradientsAtPoints`
    (unclipped mean gradient, problem regularizer included): over Flower each user receives a
    one-point ``GradientsAtPoints`` request, so a client cannot tell the two apart.

    The server uses it to RECOMPUTE a quantity that a client reported and a proof needs to be true
    (paper 002's diameter test: the residual of a reported local minimizer, see
    :mod:`fedkl.algorithms.diameter_output_pert`), instead of trusting the report. A user whose
    answer is non-finite is reported in ``failed`` and its row is zero.
    """

    points: torch.Tensor

    def __post_init__(self) -> None:
        if self.points.dim() != 2:
            raise ValueError(f"points must be (users, d), got shape {tuple(self.points.shape)}")


Query = Union[ClippedGradient, GradientDifference, LocalRegularizedMinimizer, CertifiedLocalMinimizer, LocalLoss,
              GradientsAtPoints, GradientsAtOwnPoints]


@dataclass
class Answers:
    """What a federation returns for one query.

    Attributes:
        users: positions (0..num_users-1) of the users asked, in order.
        values: ``(len(users), ...)``; rows of users in ``failed`` are zero.
        failed: positions of users whose answer was missing or invalid (subset of ``users``).
    """

    users: list[int]
    values: torch.Tensor
    failed: list[int] = field(default_factory=list)

    def total(self) -> torch.Tensor:
        return self.values.sum(0)


class Federation(ABC):
    """Per-user computation over a fixed population of users."""

    @property
    @abstractmethod
    def user_ids(self) -> tuple[str, ...]:
        """Stable external ids of all users (what the ledger charges)."""

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    @abstractmethod
    def num_params(self) -> int:
        """Length of the flat parameter vector the problem uses."""

    @abstractmethod
    def compute(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        """Per-user answers of ``users`` (all users if None)."""

    def sum(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        """Same as :meth:`compute`; a backend with secure aggregation may return only the total
        (then ``values`` has one row). Algorithms that need only the sum call this."""
        return self.compute(query, users)

    def _users(self, users: Sequence[int] | None) -> list[int]:
        """Validated user positions of a request (all users if None); each user at most once."""
        if users is None:
            return list(range(self.num_users))
        out = [int(u) for u in users]
        if len(set(out)) != len(out):
            raise ValueError("each user may be asked once per request")
        if out and (min(out) < 0 or max(out) >= self.num_users):
            raise ValueError(f"user positions must be in [0, {self.num_users}), got {min(out)}..{max(out)}")
        return out

    def ids_of(self, users: Sequence[int]) -> list[str]:
        ids = self.user_ids
        return [ids[u] for u in users]


@dataclass(frozen=True)
class ClippedLocalUpdate:
    """``clip_C(w_K - w)``: the user's clipped model delta after ``local_steps`` local SGD steps.

    ``w_0 = w``, ``w_{k+1} = w_k - local_lr * grad f_u^{(k)}(w_k)`` for ``k < local_steps``, where
    ``f_u^{(k)}`` is the user's objective (mean record loss + regularizer) over the records of step
    ``k``: all of the user's records when ``batch_size`` is None or at least the user's record count,
    else the ``batch_size`` records at positions ``k*batch_size, ..., k*batch_size + batch_size - 1``
    (mod the user's record count) in the user's record order — cyclic mini-batches, deterministic,
    so every backend computes the same answer. The answer has norm <= ``clip`` (``clip_rows``),
    which is what bounds the user's contribution (DP-FedAvg, McMahan et al. 2018). A user with no
    records only decays its weights by the regularizer.
    """

    w: torch.Tensor
    clip: float
    local_steps: int = 1
    local_lr: float = 0.1
    batch_size: int | None = None

    def __post_init__(self) -> None:
        _check_clip(self.clip)
        if isinstance(self.local_steps, bool) or int(self.local_steps) != self.local_steps \
                or not 1 <= self.local_steps <= MAX_LOCAL_STEPS:
            raise ValueError(f"local_steps must be an integer in [1, {MAX_LOCAL_STEPS}], got {self.local_steps}")
        if not (self.local_lr > 0 and math.isfinite(self.local_lr)):
            raise ValueError(f"local_lr must be finite and > 0, got {self.local_lr}")
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or int(self.batch_size) != self.batch_size
                                            or self.batch_size < 1):
            raise ValueError(f"batch_size must be None (all records) or a positive integer, got {self.batch_size}")


MAX_LOCAL_STEPS = 100_000  # bounds the work one request can ask of a client
Query = Union[Query, ClippedLocalUpdate]
