"""Shared pieces of the paper-003 algorithms (Feldman, Koren, Talwar 2020, "Private Stochastic Convex
Optimization: Optimal Rates in Linear Time"): public constants, cohorts, projection, budget checks, and
:class:`FKTParams`, the hyperparameters every paper-003 algorithm reads.

User-level mapping (docs/derivations/paper-003.md §5). One user = one sample of the paper: user u's loss is
``f_u(w)`` = the mean of its records' losses (plus the problem's ``(reg/2)||w||^2``), so every user
weighs ``1/n_i`` in its cohort whatever its record count. The constants of ``f_u`` are those of the
record loss, read from ``problem.constants(feature_bound, radius)``:

* ``L`` bounds ``||grad f_u(w)||`` on the domain ``K = {||w|| <= radius}`` (R^d if no radius). It is
  also the clip norm of every gradient query; on K the clip is then inactive for every user whose
  records satisfy the loaders' feature (and label) bounds, so the server steps along true gradients.
* ``beta`` bounds the smoothness of ``f_u``; ``lam`` its strong convexity (the regularizer).

**The sensitivity arguments of the paper need convexity and smoothness** (contraction of gradient
steps, stability of regularized minimizers): they hold for every user whose records lie in the data
domain the constants are stated for, which the data loaders enforce. The problem must be convex
(``problem.convex``); non-convex problems are refused. Only the "one-shot" phase solver
(:mod:`fedkl.algorithms.localization.fkt_phased`) is private without these assumptions (its bound comes from a clip).

Cohorts. Users are ordered by ``sha256(seed, user_id)`` — a public function of the public user ids,
independent of every record — and cut into consecutive, disjoint cohorts/batches of public sizes.
A user is in at most one cohort, so it takes part in one phase (batch) only; its privacy cost is the
cost of the one release computed from its data (parallel composition: later releases are
post-processing of earlier ones plus other users' data). The ledger is charged per cohort.
Denominators are the fixed cohort sizes (a failed answer contributes zero), so the add-remove
relation (one user's data present or absent, n public) is handled with the same cohorts.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fedkl.algorithms.contract import BuildContext, Domain, ModelResult, param
from fedkl.privacy.guarantee import sum_sensitivity
from fedkl.privacy.release import Releaser
from fedkl.problems.base import Problem


def replace_factor(neighbouring: str) -> float:
    """2 for replace-one (one user's bounded term changes to another: difference <= 2x the bound),
    1 for add-remove (the term is present or absent): :func:`sum_sensitivity` of a unit bound."""
    return sum_sensitivity(1.0, neighbouring)


def paper_rho(rho_zcdp: float) -> float:
    """The paper's privacy parameter: its guarantee (alpha, alpha rho_p^2/2)-RDP is (rho_p^2/2)-zCDP,
    so rho_p = sqrt(2 rho) for a zCDP budget rho (docs/derivations/paper-003.md §1: the paper's rho is
    not Bun-Steinke's)."""
    return math.sqrt(2.0 * rho_zcdp)


def _positive(name: str, v: float | None, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if v is None or not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be finite and > 0, got {v}")


@dataclass(frozen=True)
class ConvexSetting:
    """Public constants of every user's loss ``f_u`` on the domain K (see the module docstring).

    Attributes:
        lipschitz: L, bound on ``||grad f_u||`` on K; also the clip of every gradient query.
        smoothness: beta (None: not known to be smooth).
        strong_convexity: lam >= 0 (strong convexity of each ``f_u``, e.g. the regularizer).
        radius: K = {||w|| <= radius}; None: K = R^d.
        distance: D >= ||w0 - w*||; None: ``radius + ||w0||`` at run time.
        dim: d, the number of parameters.
    """

    lipschitz: float
    smoothness: float | None
    strong_convexity: float
    radius: float | None
    distance: float | None
    dim: int

    def __post_init__(self) -> None:
        _positive("lipschitz", self.lipschitz)
        _positive("smoothness", self.smoothness, allow_none=True)
        if not (self.strong_convexity >= 0 and math.isfinite(self.strong_convexity)):
            raise ValueError(f"strong_convexity must be finite and >= 0, got {self.strong_convexity}")
        _positive("radius", self.radius, allow_none=True)
        _positive("distance", self.distance, allow_none=True)
        if int(self.dim) != self.dim or self.dim < 1:
            raise ValueError(f"dim must be a positive integer, got {self.dim}")

    def require_smooth(self, what: str) -> float:
        if self.smoothness is None:
            raise ValueError(
                f"{what} needs a smooth loss (its privacy proof needs eta <= 2/beta); "
                "this problem states no smoothness constant"
            )
        return self.smoothness

    def require_strongly_convex(self, what: str) -> float:
        if not self.strong_convexity > 0:
            raise ValueError(f"{what} needs a strongly convex loss: give --reg > 0 (or strong_convexity)")
        return self.strong_convexity

    def resolve_distance(self, w0: torch.Tensor) -> float:
        """D: the given bound, else ``radius + ||w0||`` (>= ||w0 - w*|| for every w* in K)."""
        if self.distance is not None:
            return self.distance
        if self.radius is None:
            raise ValueError("need a bound D on ||w0 - w*||: give distance=D (or a domain radius)")
        return self.radius + float(torch.as_tensor(w0).double().norm())

    @property
    def diameter(self) -> float:
        return math.inf if self.radius is None else 2.0 * self.radius


def convex_setting(
    problem: Problem,
    feature_bound: float,
    *,
    radius: float | None = None,
    distance: float | None = None,
    strong_convexity: float | None = None,
) -> ConvexSetting:
    """The :class:`ConvexSetting` of ``problem`` on ``K = {||w|| <= radius}`` (public values only).

    ``strong_convexity`` overrides the problem's (a public assumption about F; the algorithms use it
    only in step sizes and averaging weights, never in a sensitivity).
    """
    if not getattr(problem, "convex", False):
        raise ValueError(
            f"{problem.name}: the paper-003 algorithms need a convex loss (their sensitivity "
            "bounds use convexity); this problem is not convex"
        )
    _positive("radius", radius, allow_none=True)
    try:
        c = problem.constants(feature_bound, radius)
    except ValueError as exc:
        raise ValueError(f"{exc} (give the domain radius: --radius)") from exc
    if c.strong_convexity is None:
        raise ValueError(f"{problem.name}: constants do not state convexity")
    lam = c.strong_convexity if strong_convexity is None else float(strong_convexity)
    return ConvexSetting(
        float(c.lipschitz),
        None if c.smoothness is None else float(c.smoothness),
        float(lam),
        radius,
        distance,
        problem.num_params,
    )


@dataclass(frozen=True)
class FKTParams(Domain):
    """What every paper-003 algorithm reads: the domain and the strong convexity used in steps."""

    strong_convexity: float | None = param(
        None,
        "paper-003 strongly convex variants: lam (default: the problem's, = --reg); used only in step sizes "
        "and averaging weights, never in a sensitivity",
        "theorem",
    )

    def setting(self, ctx: BuildContext) -> ConvexSetting:
        """The run's :class:`ConvexSetting`: ``ctx``'s problem and feature bound on this domain."""
        return convex_setting(
            ctx.problem,
            ctx.feature_bound,
            radius=self.radius,
            distance=self.distance,
            strong_convexity=self.strong_convexity,
        )


def cohort_order(user_ids: Sequence[str], seed: int) -> list[int]:
    """Positions of all users ordered by ``sha256(seed, user_id)``: public, data-independent, and the
    same on every backend (a user keeps its place whatever the others' records are)."""

    def key(pos: int) -> bytes:
        return hashlib.sha256(f"fkt\x1f{int(seed)}\x1f{user_ids[pos]}".encode()).digest()

    return sorted(range(len(user_ids)), key=key)


def split_cohorts(order: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Consecutive disjoint slices of ``order`` with the given sizes."""
    if sum(sizes) > len(order):
        raise ValueError(f"cohorts of {sum(sizes)} users do not fit in {len(order)} users")
    out, start = [], 0
    for s in sizes:
        out.append(list(order[start : start + s]))
        start += s
    return out


def project(w: torch.Tensor, radius: float | None) -> torch.Tensor:
    """Euclidean projection onto K = {||w|| <= radius} (identity if radius is None)."""
    if radius is None:
        return w
    norm = float(w.norm())
    return w if norm <= radius else w * (radius / norm)


def check_parallel_releaser(releaser: Releaser, label: str) -> None:
    """Refuse (ValueError, nothing read or charged) a Releaser with a run-wide zCDP filter.

    These algorithms rely on parallel composition: each user is in one cohort and the per-user ledger
    enforces each user's budget. A run-wide filter of rho adds up the releases of DIFFERENT users'
    cohorts, so it would refuse the second phase after the first phase's users were already charged
    (charged for a run that then stops). The runner gives these algorithms (``composition="parallel"``)
    a Releaser without a filter; a caller that passes one is refused up front.
    """
    if releaser.filter is not None:
        raise ValueError(
            f"{label}: each user takes part in one cohort only (parallel composition) and the "
            "per-user ledger enforces the budget; give a Releaser without a run-wide zCDP filter "
            "(a filter would stop the run after the first cohort). Nothing was read or charged"
        )


FKTResult = ModelResult  # what a paper-003 algorithm returns: ``w`` is the only private output (see each module)
