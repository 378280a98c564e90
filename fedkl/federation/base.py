"""The federation interface that every server algorithm is written against: the query types, the
registry of their wire kinds, :class:`Answers` and :class:`Federation`.

An algorithm asks a federation for per-user quantities of some users ("the clipped gradients of
these users at w") and gets back either the per-user values or their sum, together with which
users answered. It never sees records, never imports a transport, and never adds noise: noise is
added by :class:`fedkl.privacy.release.Releaser` on the server.

Backends: :class:`fedkl.federation.inprocess.InProcessFederation` (all users as stacked tensors,
one batched op per request) and :class:`fedkl.flower.federation.FlowerFederation` (ServerApp <->
ClientApps over Flower Messages), implementing the same methods with the same query types.

Queries are self-describing: a query type is one frozen dataclass deriving from :class:`Query` that
holds everything a transport needs to know about it, so the transport has no per-kind code:

* its wire name (``kind``; :data:`QUERY_KINDS` maps it back to the class), its scalars and tensors
  for the wire (:meth:`Query.wire_fields`) and their strict decoding (:meth:`Query.wire_shapes`,
  :meth:`Query.from_wire`), used by :mod:`fedkl.flower.codec`;
* the shape of one user's answer (:meth:`Query.answer_shape`), the server-side validation of a
  request (:meth:`Query.check_request`) and of a client's answer (:meth:`Query.check_answer`), used by
  :class:`~fedkl.flower.federation.FlowerFederation` and the ClientApp;
* optionally, the request each user receives when it differs per user (:meth:`Query.for_user`,
  :meth:`Query.user_answer`: :class:`GradientsAtOwnPoints` travels as one-point
  :class:`GradientsAtPoints`).

Adding a query kind touches two places: (1) a ``@dataclass(frozen=True)`` subclass of :class:`Query`
here, with a new ``kind`` (registered in :data:`QUERY_KINDS` by defining the class), its
``tensor_names`` / ``scalar_names``, :meth:`~Query.wire_fields`, :meth:`~Query.from_wire` and, where
they differ from the defaults, :meth:`~Query.answer_shape`, :meth:`~Query.check_request` and
:meth:`~Query.check_answer`; (2) its in-process answer, a method of
:class:`~fedkl.federation.inprocess.InProcessFederation` decorated ``@answers(MyQuery)`` (which a
Flower client runs for its one user). The per-user numerics it needs belong on the problem
(:class:`fedkl.problems.base.Problem`). The codec, the ClientApp and the Flower federation take it from
there; ``tests/flower/test_flower.py`` checks the round trip.

Clipping is part of the query and is done where the data lives (the client, or the vectorized
backend, with :func:`fedkl.federation.clipping.clip_rows`): that is what bounds each user's
contribution. A user whose answer is missing or invalid (dropout, timeout, NaN, wrong shape) contributes
the zero vector and is reported in ``failed``: the norm bound of every contribution, hence the
sensitivity of the sum, is unchanged.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch

from fedkl.federation.clipping import CLIP_SLACK
from fedkl.problems.mirror import row_lp_norms

# wire kind -> query class; filled by defining a Query subclass with a ``kind`` (Query.__init_subclass__)
QUERY_KINDS: dict[str, type["Query"]] = {}
RESERVED_KINDS = ("info",)  # the transport's own handshake (fedkl.flower.codec.INFO), never a query
MAX_POINTS = 4096  # most points one GradientsAtPoints request may carry
MAX_LOCAL_STEPS = 100_000  # bounds the work one ClippedLocalUpdate request can ask of a client
MAX_LOCAL_EPOCHS = 1_000  # the same bound for a request in local epochs


class Query:
    """Base of every query type: what a transport needs to know about a kind of per-user request.

    Class attributes: ``kind`` (the wire name; None for a query that never travels under its own name),
    ``tensor_names`` (the float64 tensors it carries, in wire order) and ``scalar_names`` (its scalar
    parameters on the wire). Subclasses are frozen dataclasses; the defaults below fit a query whose
    tensors are parameter vectors of length ``num_params`` and whose answer is one such vector.
    """

    kind: ClassVar[str | None] = None
    tensor_names: ClassVar[tuple[str, ...]] = ()
    scalar_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is not None:
            if kind in QUERY_KINDS or kind in RESERVED_KINDS:
                raise ValueError(f"query kind {kind!r} is already taken")
            QUERY_KINDS[kind] = cls

    # --- the wire ----------------------------------------------------------------------------------
    def wire_fields(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(scalars, tensors)`` to send: plain ``int``/``float``/``str`` values keyed by
        ``scalar_names``, and the tensors keyed by ``tensor_names`` (in that order)."""
        return {}, {name: getattr(self, name) for name in self.tensor_names}

    @classmethod
    def wire_shapes(cls, declared: Mapping[str, tuple[int, ...]], num_params: int) -> dict[str, tuple[int, ...]]:
        """The shape every received tensor must have, given the shapes the message declares (checked on
        the serialised bytes before anything is deserialised); ValueError if a declared shape is not
        acceptable. Default: a parameter vector ``(num_params,)`` each."""
        return {name: (num_params,) for name in cls.tensor_names}

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> "Query":
        """The query from its received scalars (exactly ``scalar_names``) and tensors (finite, of the
        :meth:`wire_shapes`); ValueError (one line, sent back to the server) for an invalid type or range."""
        raise NotImplementedError(f"{cls.__name__} does not travel under its own kind")

    # --- answers -----------------------------------------------------------------------------------
    def answer_shape(self, num_params: int) -> tuple[int, ...]:
        """Shape of one user's answer (a row of :attr:`Answers.values`); ``()`` for a scalar."""
        return (num_params,)

    def check_request(self, num_params: int, num_users: int) -> None:
        """ValueError unless this request is valid for ``num_params`` parameters and ``num_users`` asked
        users (what a server checks before sending it, and a client before answering it). Default: every
        tensor is a finite parameter vector."""
        for name in self.tensor_names:
            w = torch.as_tensor(getattr(self, name))
            if w.shape != (num_params,):
                raise ValueError(f"expected parameters of shape ({num_params},), got {tuple(w.shape)}")
            if not torch.isfinite(w).all():
                raise ValueError("parameters contain NaN or inf")

    def check_answer(self, value: torch.Tensor) -> None:
        """ValueError if a client's decoded answer (finite, of :meth:`answer_shape`) is still not a valid
        answer (e.g. over the clip bound). Default: any finite answer of the right shape is valid."""

    def check_answers(self, values: torch.Tensor) -> dict[int, str]:
        """:meth:`check_answer` for every row of ``values`` (one user's answer per row, each finite, of
        :meth:`answer_shape`): ``{row: why}`` for the rows it rejects. Default: row by row; a query may check
        the same rule batched (the Flower backend checks a block node's answers this way, each row alone)."""
        bad: dict[int, str] = {}
        for k in range(values.shape[0]):
            try:
                self.check_answer(values[k])
            except ValueError as exc:
                bad[k] = str(exc)
        return bad

    def for_user(self, row: int) -> "Query":
        """The request that the ``row``-th asked user receives (default: this query, the same for all)."""
        return self

    def user_answer(self, value: torch.Tensor) -> torch.Tensor:
        """The user's row of :attr:`Answers.values` from its answer to :meth:`for_user` (default: as is)."""
        return value

    def for_rows(self, rows: Sequence[int]) -> "Query":
        """The request for the asked users at ``rows`` of the asked list, as one block (a shard of
        :mod:`fedkl.federation.ray_shards`); default: this query, the same for all."""
        return self


def wire_number(scalars: Mapping[str, Any], key: str) -> float:
    """A finite number received on the wire (ValueError otherwise; booleans are not numbers)."""
    v = scalars.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"scalar {key!r} missing or not a number")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"scalar {key!r} is not finite")
    return v


def _check_clip(clip: float) -> None:
    if not (clip > 0 and math.isfinite(clip)):
        raise ValueError(f"clip norm must be finite and > 0, got {clip}")


def _check_clipped_answer(value: torch.Tensor, clip: float) -> None:
    norm = float(value.norm())
    if not norm <= clip * (1 + CLIP_SLACK):
        raise ValueError(f"answer norm {norm:.6g} exceeds the clip bound {clip:g}")


def _check_clipped_answers(query: "Query", owner: type, values: torch.Tensor, clip: float) -> dict[int, str]:
    """:func:`_check_clipped_answer` of every row at once (each row's l2 norm, one batched call; it may round
    differently from the row's own norm by a few ulps, far inside ``CLIP_SLACK``) -- only while ``query``'s
    ``check_answer`` is ``owner``'s l2 check: a subclass with its own rule is checked row by row by that rule."""
    if type(query).check_answer is not owner.check_answer:
        return Query.check_answers(query, values)
    norms = torch.linalg.vector_norm(values.reshape(values.shape[0], -1), dim=1)
    over = torch.nonzero(~(norms <= clip * (1 + CLIP_SLACK))).flatten().tolist()
    return {k: f"answer norm {float(norms[k]):.6g} exceeds the clip bound {clip:g}" for k in over}


@dataclass(frozen=True)
class ClippedGradient(Query):
    """``clip_C(grad f_u(w))``, ``clip_C(v) = v * min(1, C/||v||)`` (norm <= C, zero stays zero)."""

    kind: ClassVar[str] = "clipped_gradient"
    tensor_names: ClassVar[tuple[str, ...]] = ("w",)
    scalar_names: ClassVar[tuple[str, ...]] = ("clip",)

    w: torch.Tensor
    clip: float

    def __post_init__(self) -> None:
        _check_clip(self.clip)

    def wire_fields(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"clip": float(self.clip)}, {"w": self.w}

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> Query:
        return cls(**tensors, clip=wire_number(scalars, "clip"))

    def check_answer(self, value: torch.Tensor) -> None:
        _check_clipped_answer(value, self.clip)

    def check_answers(self, values: torch.Tensor) -> dict[int, str]:
        return _check_clipped_answers(self, ClippedGradient, values, self.clip)


@dataclass(frozen=True)
class ClampedGradient(Query):
    """``clamp(grad f_u(w), -bound, bound)`` coordinatewise: the per-user gradient clipped in l_inf, the
    dual norm of l1 (paper 001's noisy Frank–Wolfe over an l1 ball or a polytope). Every entry of the
    answer is in ``[-bound, bound]``, so replacing one user moves a sum of answers by at most ``2 bound``
    in l_inf, whatever the client computes."""

    kind: ClassVar[str] = "clamped_gradient"
    tensor_names: ClassVar[tuple[str, ...]] = ("w",)
    scalar_names: ClassVar[tuple[str, ...]] = ("bound",)

    w: torch.Tensor
    bound: float

    def __post_init__(self) -> None:
        _check_clip(self.bound)

    def wire_fields(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"bound": float(self.bound)}, {"w": self.w}

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> Query:
        return cls(**tensors, bound=wire_number(scalars, "bound"))

    def check_answer(self, value: torch.Tensor) -> None:
        largest = float(value.abs().max()) if value.numel() else 0.0
        if not largest <= self.bound:
            raise ValueError(f"answer entry {largest:.6g} exceeds the clamp bound {self.bound:g}")


@dataclass(frozen=True)
class DualClippedGradient(Query):
    """``grad f_u(w)`` clipped in the l_q norm, ``v * min(1, clip/||v||_q)`` (q >= 2, the dual of the
    l_p geometry, 1 < p <= 2, of paper 001's ``pg-mirror-descent``; q = 2 is :class:`ClippedGradient`'s
    clip up to rounding). Every answer has ``||v||_q <= clip``, hence ``||v||_2 <= d^(1/2-1/q) clip``
    (Hoelder): an answer above the l_q bound is invalid, whatever the client computes."""

    kind: ClassVar[str] = "dual_clipped_gradient"
    tensor_names: ClassVar[tuple[str, ...]] = ("w",)
    scalar_names: ClassVar[tuple[str, ...]] = ("clip", "q")

    w: torch.Tensor
    clip: float
    q: float

    def __post_init__(self) -> None:
        _check_clip(self.clip)
        if isinstance(self.q, bool) or not isinstance(self.q, (int, float)) or not 2.0 <= self.q < math.inf:
            raise ValueError(f"the dual exponent q must be finite and >= 2, got {self.q!r}")

    def wire_fields(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"clip": float(self.clip), "q": float(self.q)}, {"w": self.w}

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> Query:
        return cls(**tensors, clip=wire_number(scalars, "clip"), q=wire_number(scalars, "q"))

    def check_answer(self, value: torch.Tensor) -> None:
        # scaled by max|v| (the client clip's own norm, clip_rows_dual): |v_i|^q under- or overflows for q
        # large (p near 1), which torch.linalg.vector_norm(v, ord=q) does not guard against
        norm = float(row_lp_norms(value.to(torch.float64).reshape(1, -1), self.q)[0])
        if not norm <= self.clip * (1 + CLIP_SLACK):
            raise ValueError(f"answer l_{self.q:g} norm {norm:.6g} exceeds the clip bound {self.clip:g}")


@dataclass(frozen=True)
class FeatureClippedGradient(Query):
    """``grad f_u(w)`` of the user's loss on its records with every feature vector clipped to l2 norm
    ``feature_clip`` (``x -> x min(1, feature_clip/||x||)``), NOT clipped itself: the gradient of a
    convex loss stays the gradient of a convex loss (paper 001's Phased-SGD needs convex gradient maps,
    which gradient clipping breaks). The answer must have norm <= ``bound`` (the loss's Lipschitz
    constant at that feature norm): an answer above it is invalid (the user contributes zero)."""

    kind: ClassVar[str] = "feature_clipped_gradient"
    tensor_names: ClassVar[tuple[str, ...]] = ("w",)
    scalar_names: ClassVar[tuple[str, ...]] = ("feature_clip", "bound")

    w: torch.Tensor
    feature_clip: float
    bound: float

    def __post_init__(self) -> None:
        _check_clip(self.feature_clip)
        _check_clip(self.bound)

    def wire_fields(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"feature_clip": float(self.feature_clip), "bound": float(self.bound)}, {"w": self.w}

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> Query:
        return cls(**tensors, feature_clip=wire_number(scalars, "feature_clip"), bound=wire_number(scalars, "bound"))

    def check_answer(self, value: torch.Tensor) -> None:
        _check_clipped_answer(value, self.bound)

    def check_answers(self, values: torch.Tensor) -> dict[int, str]:
        return _check_clipped_answers(self, FeatureClippedGradient, values, self.bound)


@dataclass(frozen=True)
class GradientDifference(Query):
    """``clip_C(grad f_u(w_new) - grad f_u(w_old))`` (variance-reduced methods)."""

    kind: ClassVar[str] = "gradient_difference"
    tensor_names: ClassVar[tuple[str, ...]] = ("w_new", "w_old")
    scalar_names: ClassVar[tuple[str, ...]] = ("clip",)

    w_new: torch.Tensor
    w_old: torch.Tensor
    clip: float

    def __post_init__(self) -> None:
        _check_clip(self.clip)

    def wire_fields(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"clip": float(self.clip)}, {"w_new": self.w_new, "w_old": self.w_old}

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> Query:
        return cls(**tensors, clip=wire_number(scalars, "clip"))

    def check_answer(self, value: torch.Tensor) -> None:
        _check_clipped_answer(value, self.clip)

    def check_answers(self, values: torch.Tensor) -> dict[int, str]:
        return _check_clipped_answers(self, GradientDifference, values, self.clip)


@dataclass(frozen=True)
class ClampedGradientDifference(GradientDifference):
    """``clamp(grad f_u(w_new) - grad f_u(w_old), -clip, clip)`` coordinatewise: the difference clipped in
    l_inf, the dual norm of l1 (paper 001's variance-reduced Frank–Wolfe over a polytope, ``vr-fw``).
    Every entry of the answer is in ``[-clip, clip]``, whatever the client computes."""

    kind: ClassVar[str] = "clamped_gradient_difference"

    def check_answer(self, value: torch.Tensor) -> None:
        largest = float(value.abs().max()) if value.numel() else 0.0
        if not largest <= self.clip:
            raise ValueError(f"answer entry {largest:.6g} exceeds the clamp bound {self.clip:g}")


@dataclass(frozen=True)
class LocalRegularizedMinimizer(Query):
    """``argmin_v f_u(v) + (strength/2)||v - center||^2``, solved locally to gradient norm ``tol``."""

    kind: ClassVar[str] = "local_minimizer"
    tensor_names: ClassVar[tuple[str, ...]] = ("center",)
    scalar_names: ClassVar[tuple[str, ...]] = ("strength", "tol", "max_iter")

    center: torch.Tensor
    strength: float
    tol: float = 1e-10
    max_iter: int = 500

    allow_zero_strength: ClassVar[bool] = False

    def wire_fields(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return (
            {"strength": float(self.strength), "tol": float(self.tol), "max_iter": int(self.max_iter)},
            {"center": self.center},
        )

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> Query:
        strength, tol = wire_number(scalars, "strength"), wire_number(scalars, "tol")
        max_iter = scalars.get("max_iter")
        if not (strength > 0 or (cls.allow_zero_strength and strength == 0)) or not (tol > 0):
            raise ValueError("strength and tol must be > 0 (strength >= 0 for the certified kind)")
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or not 1 <= max_iter <= 100_000:
            raise ValueError("max_iter must be an integer in [1, 100000]")
        return cls(tensors["center"], strength, tol, max_iter)

    def check_request(self, num_params: int, num_users: int) -> None:
        super().check_request(num_params, num_users)
        check_local_query(self)


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

    kind: ClassVar[str] = "certified_local_minimizer"
    allow_zero_strength: ClassVar[bool] = True

    def answer_shape(self, num_params: int) -> tuple[int, ...]:
        return (num_params + 1,)


def local_strength_ok(query: LocalRegularizedMinimizer) -> bool:
    """A local-minimizer query's strength is valid: finite and > 0 (>= 0 for the certified kind).

    Strength 0 makes sense only for a strongly convex f_u (problem regularizer > 0); the query does
    not know the problem, so the caller must (DiameterSCOutputPert requires reg + strength > 0)."""
    s = query.strength
    return (
        isinstance(s, (int, float))
        and not isinstance(s, bool)
        and math.isfinite(s)
        and (s > 0 or (query.allow_zero_strength and s == 0))
    )


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
class LocalLoss(Query):
    """``f_u(w)`` (a scalar per user); also used for evaluation on held-out records."""

    kind: ClassVar[str] = "local_loss"
    tensor_names: ClassVar[tuple[str, ...]] = ("w",)
    scalar_names: ClassVar[tuple[str, ...]] = ("split",)

    w: torch.Tensor
    split: str = "train"

    def wire_fields(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"split": str(self.split)}, {"w": self.w}

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> Query:
        split = scalars.get("split")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return cls(tensors["w"], split)

    def answer_shape(self, num_params: int) -> tuple[int, ...]:
        return ()

    def check_request(self, num_params: int, num_users: int) -> None:
        super().check_request(num_params, num_users)
        if self.split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {self.split!r}")


@dataclass(frozen=True)
class GradientsAtPoints(Query):
    """``grad f_u(p_k)`` for every user and every point ``p_k`` (rows of ``points``, shape ``(k, d)``):
    the UNCLIPPED per-user mean gradients, regularizer included; answer shape ``(users, k, d)``.

    Used by the output-perturbation algorithms (paper 002) whose minimizer is computed by the
    server from exact per-user gradients (no clipping: clipped gradients are not the gradient of
    any loss, and the minimizer-stability argument needs the true loss). Privacy there comes from
    the deletion-stability test, not from a norm bound on the answer. A user whose answer is
    non-finite is reported in ``failed`` and its rows are zero. At most :data:`MAX_POINTS` points
    per request on the wire.
    """

    kind: ClassVar[str] = "gradients_at_points"
    tensor_names: ClassVar[tuple[str, ...]] = ("points",)

    points: torch.Tensor

    def __post_init__(self) -> None:
        if self.points.dim() != 2:
            raise ValueError(f"points must be (k, d), got shape {tuple(self.points.shape)}")

    @classmethod
    def wire_shapes(cls, declared: Mapping[str, tuple[int, ...]], num_params: int) -> dict[str, tuple[int, ...]]:
        shape = declared["points"]
        if len(shape) != 2 or not 1 <= shape[0] <= MAX_POINTS:
            raise ValueError(f"points: shape {shape}, expected (k, {num_params}) with 1 <= k <= {MAX_POINTS}")
        return {"points": (shape[0], num_params)}

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> Query:
        return cls(tensors["points"])

    def answer_shape(self, num_params: int) -> tuple[int, ...]:
        return (int(self.points.shape[0]), num_params)

    def check_request(self, num_params: int, num_users: int) -> None:
        points = torch.as_tensor(self.points)
        if points.dim() != 2 or points.shape[1] != num_params or not torch.isfinite(points).all():
            raise ValueError(f"points must be finite with {num_params} columns")
        if not 1 <= points.shape[0] <= MAX_POINTS:
            raise ValueError(f"between 1 and {MAX_POINTS} points per request, got {points.shape[0]}")


@dataclass(frozen=True)
class GradientsAtOwnPoints(Query):
    """``grad f_u(p_u)`` for every asked user at ITS OWN point ``p_u`` (row i of ``points`` goes to the
    i-th asked user); answer shape ``(users, d)``. The same oracle as :class:`GradientsAtPoints`
    (unclipped mean gradient, problem regularizer included): over the wire each user receives a
    one-point ``GradientsAtPoints`` request (:meth:`for_user`), so a client cannot tell the two apart;
    this type has no wire kind of its own.

    The server uses it to RECOMPUTE a quantity that a client reported and a proof needs to be true
    (paper 002's diameter test: the residual of a reported local minimizer, see
    :mod:`fedkl.algorithms.output_perturbation.diameter_output_pert`), instead of trusting the report. A user whose
    answer is non-finite is reported in ``failed`` and its row is zero.
    """

    points: torch.Tensor

    def __post_init__(self) -> None:
        if self.points.dim() != 2:
            raise ValueError(f"points must be (users, d), got shape {tuple(self.points.shape)}")

    def check_request(self, num_params: int, num_users: int) -> None:
        points = torch.as_tensor(self.points)
        if points.shape != (num_users, num_params) or not torch.isfinite(points).all():
            raise ValueError(
                f"points must be finite, one row of {num_params} per asked user "
                f"({num_users}), got shape {tuple(points.shape)}"
            )

    def for_user(self, row: int) -> Query:
        return GradientsAtPoints(torch.as_tensor(self.points)[row : row + 1])

    def user_answer(self, value: torch.Tensor) -> torch.Tensor:
        return value[0]

    def for_rows(self, rows: Sequence[int]) -> Query:
        return GradientsAtOwnPoints(torch.as_tensor(self.points)[list(rows)])


@dataclass(frozen=True)
class ClippedLocalUpdate(Query):
    """``clip_C(w_K - w)``: the user's clipped model delta after ``local_steps`` local SGD steps.

    ``w_0 = w``, ``w_{k+1} = w_k - local_lr * grad f_u^{(k)}(w_k)`` for ``k < local_steps``, where
    ``f_u^{(k)}`` is the user's objective (mean record loss + regularizer) over the records of step
    ``k``: all of the user's records when ``batch_size`` is None or at least the user's record count,
    else the ``batch_size`` records at positions ``k*batch_size, ..., k*batch_size + batch_size - 1``
    (mod the user's record count) in the user's record order — cyclic mini-batches, deterministic,
    so every backend computes the same answer. The answer has norm <= ``clip`` (``clip_rows``),
    which is what bounds the user's contribution (DP-FedAvg, McMahan et al. 2018). A user with no
    records only decays its weights by the regularizer. On the wire ``batch_size`` None is 0.

    **Local epochs** (``local_epochs = E``, not None; then ``local_steps`` is not used): the way FedAvg
    is run on networks (McMahan et al. 2017; Geyer et al. 2017). A user with ``m`` records makes ``E``
    passes over them in record order, in mini-batches of ``B = batch_size`` (all ``m`` when None): pass
    ``e`` takes positions ``0..B-1``, ``B..2B-1``, ..., the last batch holding the ``m mod B`` left over
    (never wrapping), so the user makes ``E * ceil(m / B)`` steps, each on the mean loss of its batch; a
    user with no records makes none (answer 0). Deterministic, like the cyclic steps. The number of
    steps depends on the user's record count, which only the client's own computation sees: the clip
    still bounds the answer. On the wire ``local_epochs`` None is 0.
    """

    kind: ClassVar[str] = "clipped_local_update"
    tensor_names: ClassVar[tuple[str, ...]] = ("w",)
    scalar_names: ClassVar[tuple[str, ...]] = ("clip", "local_steps", "local_lr", "batch_size", "local_epochs")

    w: torch.Tensor
    clip: float
    local_steps: int = 1
    local_lr: float = 0.1
    batch_size: int | None = None
    local_epochs: int | None = None

    def __post_init__(self) -> None:
        _check_clip(self.clip)
        if (
            isinstance(self.local_steps, bool)
            or int(self.local_steps) != self.local_steps
            or not 1 <= self.local_steps <= MAX_LOCAL_STEPS
        ):
            raise ValueError(f"local_steps must be an integer in [1, {MAX_LOCAL_STEPS}], got {self.local_steps}")
        if not (self.local_lr > 0 and math.isfinite(self.local_lr)):
            raise ValueError(f"local_lr must be finite and > 0, got {self.local_lr}")
        if self.batch_size is not None and (
            isinstance(self.batch_size, bool) or int(self.batch_size) != self.batch_size or self.batch_size < 1
        ):
            raise ValueError(f"batch_size must be None (all records) or a positive integer, got {self.batch_size}")
        if self.local_epochs is not None and (
            isinstance(self.local_epochs, bool)
            or int(self.local_epochs) != self.local_epochs
            or not 1 <= self.local_epochs <= MAX_LOCAL_EPOCHS
        ):
            raise ValueError(
                f"local_epochs must be None (use local_steps) or an integer in [1, {MAX_LOCAL_EPOCHS}], "
                f"got {self.local_epochs}"
            )

    def check_answer(self, value: torch.Tensor) -> None:
        _check_clipped_answer(value, self.clip)

    def check_answers(self, values: torch.Tensor) -> dict[int, str]:
        return _check_clipped_answers(self, ClippedLocalUpdate, values, self.clip)

    def wire_fields(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return (
            {
                "clip": float(self.clip),
                "local_steps": int(self.local_steps),
                "local_lr": float(self.local_lr),
                "batch_size": int(self.batch_size or 0),
                "local_epochs": int(self.local_epochs or 0),
            },
            {"w": self.w},
        )

    @classmethod
    def from_wire(cls, scalars: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], num_params: int) -> Query:
        steps, batch, epochs = scalars.get("local_steps"), scalars.get("batch_size"), scalars.get("local_epochs")
        for name, v in (("local_steps", steps), ("batch_size", batch), ("local_epochs", epochs)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer")
        if batch < 0 or epochs < 0:
            raise ValueError("batch_size and local_epochs must be >= 0 (0: all records, local_steps)")
        lr = wire_number(scalars, "local_lr")
        return cls(tensors["w"], wire_number(scalars, "clip"), steps, lr, batch or None, epochs or None)


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
        """The sum of the rows, in float64 (float32 rows are added in float64: the noise is added to a
        float64 sum, :mod:`fedkl.federation.clipping`)."""
        if self.values.is_floating_point() and self.values.dtype != torch.float64:
            return self.values.to(torch.float64).sum(0)
        return self.values.sum(0)

    def answered(self) -> torch.Tensor:
        """Boolean mask over the rows of :attr:`values`: False for the users in ``failed``. A failed user's
        zero row is not its answer: an algorithm whose released quantity is not a plain sum of the rows
        (a centre, a projection, a count) leaves these rows out with this mask."""
        if not self.failed:
            return torch.ones(len(self.users), dtype=torch.bool)
        return ~torch.isin(
            torch.as_tensor(self.users, dtype=torch.int64), torch.as_tensor(self.failed, dtype=torch.int64)
        )


def failure_summary(records: list[dict], kinds: Mapping[str, str]) -> dict:
    """result.json's ``failures`` from a backend's per-request records (``{"failed": {user id: "kind:
    reason"}, ...}``): counts per kind, the kinds' descriptions (from ``kinds``), the number of requests
    and every request that had failures."""
    counts: dict[str, int] = {}
    for rec in records:
        for why in rec["failed"].values():
            kind = why.split(":", 1)[0]
            counts[kind] = counts.get(kind, 0) + 1
    return {
        "counts": counts,
        "kinds": {k: kinds[k] for k in counts},
        "requests": len(records),
        "by_request": [r for r in records if r["failed"]],
    }


class Federation(ABC):
    """Per-user computation over a fixed population of users."""

    # True for a backend with secure aggregation: :meth:`sum` returns one row (the total) and
    # :meth:`compute` is refused (fedkl.flower.secagg)
    sums_only: bool = False
    # True for a backend whose users answer from their own processes (every Flower backend): a client there
    # may run code other than fedkl's, so a guarantee that assumes in-class clients needs the operator's
    # explicit opt-in (``fedkl run --clients in-class``; fedkl.privacy.clients). False: the server's own code
    # computes every answer from the records (in-process, Ray shards).
    clients_run_own_code: bool = False
    # Called (no arguments) before a transport sends anything out of this process (its messages to
    # nodes carry the model, computed from released values); the run sets it to the Releaser's flush,
    # so the release journal is durable first (fedkl.privacy.journal: the egress points). None: nothing
    # to do. A federation that computes in the server's process (in-process, Ray shards) never calls it.
    before_send: Callable[[], None] | None = None

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

    def failure_report(self) -> dict | None:
        """Why users failed, per request (result.json's ``failures``); None for a backend that keeps
        no such record (in-process: the only failure is a non-finite answer, counted in the history)."""
        return None

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
