"""Phased-SGD for convex generalized linear losses over an l2 ball (paper 001, Bassily–Guzmán–Menart,
Alg 1 + Alg 2 / Thm 6), at user level: ``gll-phased-sgd``.

It is FKT20's Phased-SGD (:class:`fedkl.algorithms.localization.fkt_phased.PhasedSGD`, whose phase driver it
reuses) with paper 001's oracle and schedule:

* **Oracle (Alg 1).** Each user answers the gradient of its mean GLL loss computed on its records
  with every feature vector clipped to ``||x|| <= R`` (:class:`~fedkl.federation.base.FeatureClippedGradient`),
  and the gradient itself is NOT clipped: the loss on clipped features is still a convex, L-Lipschitz
  (L = L0 R), beta-smooth function, so every SGD step stays non-expansive, which the sensitivity
  proof needs (gradient clipping would break it; docs/derivations/paper-001.md §6, pitfall 15). The
  Moreau smoothing of a non-smooth GLL is the problem's: ``smoothed-hinge`` IS the hinge's Moreau envelope
  ``l_beta`` with ``beta = 1/smoothing`` (its closed-form prox, no bisection: alpha = 0), ``absolute``
  (regression, ``|<w, x> - y|``) answers the gradient of its envelope (the Huber loss, closed-form prox,
  ``beta = moreau_beta``: :mod:`fedkl.problems.robust_regression`), ``huber`` is smooth, and
  ``logistic`` needs none. An answer above the norm bound L is invalid (the user contributes zero,
  an identity step).
* **Schedule (Thm 6, docs/derivations/paper-001.md §6, pitfalls 3, 5, 6).** ``rho_p = sqrt(2 rho)`` (the
  paper's/FKT's rho);
  ``eta = (D / (3 L)) min{rho_p / sqrt(d), 1/sqrt(n)}`` with D the domain's diameter; phases
  k = 1..floor(log2 n) on disjoint cohorts of ``T_k = floor(n / 2^k)`` users (hashed order), one user
  per step, step ``eta_k = eta 4^-k`` (capped at 2/beta: the contraction condition); the phase output
  is the average of the evaluation points plus ``N(0, sigma_k^2 I)`` with ``sigma_k = Delta_k / rho_p``
  and ``Delta_k = 2 L eta_k`` (replace-one: the differing user's step moves by at most 2 L eta_k and
  every other step is non-expansive; L eta_k under add-remove). With the exact oracle alpha = 0, so the
  derivation's ``Delta_k = 2 G eta_k + 2 eta_k T_k alpha`` is ``2 L eta_k``; the paper's box
  ``sigma_k = 4 L0 R eta_k / rho`` is not used (pitfall 5).

**Guarantee: user-level rho-zCDP** (each user is in one phase and is charged rho once, by that phase's
Gaussian release; parallel composition), for in-class clients (convex smooth gradient answers:
the non-expansiveness of the other users' steps is a property no server check can establish).
**Private outputs:** the phase outputs only; a user sees the within-phase iterate, a noiseless
function of the earlier users of its phase (pitfall 14). Rate (Thm 6): ``O(L0 R D (1/sqrt(n) +
sqrt(d)/(rho_p n)))``. The average is over the points where gradients were taken (u_0..u_{T-1}; the
paper averages u_1..u_T: the same sensitivity bound holds for both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedkl.algorithms.contract import Algorithm, BuildContext, Domain, SmallAudit, param
from fedkl.algorithms.localization.fkt_common import ConvexSetting, convex_setting, paper_rho
from fedkl.algorithms.localization.fkt_phased import PhaseDriver
from fedkl.algorithms.registry import register
from fedkl.federation.base import FeatureClippedGradient, Query
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, SOLVER_ITERATES, ZERO_SUMS, Guarantee

DEFAULT_RADIUS = 10.0  # the Domain default for a loss Lipschitz on all of R^d (logistic, hinge)


def paper001_schedule(n: int, rho: float, setting: ConvexSetting, diameter: float) -> list[tuple[int, float]]:
    """``[(T_k, eta_k)]`` of Thm 6 for n users and zCDP budget rho (module docstring)."""
    if n < 2:
        return []
    L, beta = setting.lipschitz, setting.require_smooth("gll-phased-sgd")
    eta = (diameter / (3.0 * L)) * min(paper_rho(rho) / math.sqrt(setting.dim), 1.0 / math.sqrt(n))
    return [(n // 2**k, min(eta * 4.0**-k, 2.0 / beta)) for k in range(1, int(math.log2(n)) + 1) if n // 2**k >= 1]


@dataclass(frozen=True)
class GLLPhasedParams(Domain):
    """gll-phased-sgd: the l2 ball (radius; default 10) and the clients' feature clip."""

    gll_feature_clip: float | None = param(
        None,
        "gll-phased-sgd: every client clips its feature vectors to this l2 norm R (default: the data's feature bound)",
        "theorem",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        clip = self.gll_feature_clip
        if clip is not None and not (clip > 0 and math.isfinite(clip)):
            raise ValueError(f"--gll-feature-clip must be finite and > 0, got {clip}")


@register
class GLLPhasedSGD(PhaseDriver, Algorithm[GLLPhasedParams]):
    """Phased-SGD for convex GLLs, feature clipping, no gradient clipping (paper 001, Alg 2 / Thm 6; zCDP).

    See the module docstring. Built from the params and the budget: ``feature_clip`` R (``gll_feature_clip``,
    else the data's feature bound), the l2 ball of ``radius`` (default 10) and ``distance``, the run's zCDP
    (``ctx.rho_left``), relation and cohort-hashing seed. The phase driver (plan, run) is
    :class:`~fedkl.algorithms.localization.fkt_phased.PhaseDriver`'s with the psgd solver."""

    name = "gll-phased-sgd"
    Params = GLLPhasedParams
    guarantee = Guarantee("zcdp", "parallel", IN_CLASS_CLIENTS)
    absence = ZERO_SUMS
    clients_see = SOLVER_ITERATES
    small = {"radius": 2.0}
    audit = SmallAudit()
    solvers = ("psgd",)

    def __init__(self, params: GLLPhasedParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        feature_clip = ctx.feature_bound if params.gll_feature_clip is None else params.gll_feature_clip
        if not (feature_clip > 0 and math.isfinite(feature_clip)):
            raise ValueError(f"{self.name}: the data's feature bound is {feature_clip}: give --gll-feature-clip")
        radius = DEFAULT_RADIUS if params.radius is None else params.radius
        setting = convex_setting(ctx.problem, feature_clip, radius=radius, distance=params.distance)
        self.setup(setting, ctx.rho_left, solver="psgd", neighbouring=ctx.neighbouring, seed=ctx.seed)
        self.feature_clip = float(feature_clip)

    def schedule(self, n: int, distance: float) -> list[tuple[int, float]]:
        diameter = self.setting.distance if self.setting.distance is not None else self.setting.diameter
        return paper001_schedule(n, self.rho_total, self.setting, diameter)

    def gradient_query(self, w: torch.Tensor) -> Query:
        return FeatureClippedGradient(w, self.feature_clip, self.setting.lipschitz)
