"""Proximally guided private stochastic mirror descent for rho-weakly convex, non-smooth losses in an
l_p geometry, 1 < p <= 2 (paper 001, Bassily–Guzmán–Menart, Alg 6 / Thm 20), at user level:
``pg-mirror-descent``. p = 2 is the Euclidean case.

Outer loop (Alg 6). Users are ordered by the public hash of their ids
(:func:`fedkl.algorithms.localization.fkt_common.cohort_order`) and cut into R disjoint cohorts of
``m = floor(n/R)`` users (surplus users are not used, never charged). Prox round r = 1..R, on cohort
C_r only, approximately solves the proximal subproblem

    F_r(w) = (1/m) sum_{u in C_r} f_u(w) + (beta/2) ||w - w_r||_p^2,     beta = 2 rho kappa,

and its output is the next prox centre w_{r+1}. Rounds 1..R-1 run: the paper's round R computes
w_{R+1}, which its output never uses, so cohort C_R is neither read nor charged. The released model
is ONE prox centre w_{r*}, r* uniform on {1..R}, drawn by the server from a seeded public RNG
(``random.Random`` of the run's seed) before any data is read: the model is w_1 = w0 with probability
1/R, as the theorem's output (docs/derivations/paper-001.md §6, pitfall 13: the centres, not the prox
points).

Inner solver (fedkl's; the paper uses [AFKT21]'s A_SC, Thm 19, as a black box and gives no
pseudocode). With kappa = 1/(p-1) (the strong convexity of ||.||_p^2/2 in ||.||_p), the regularizer
is ``(beta/2)||w - w_r||_p^2 = 2 rho psi_r(w)``, ``psi_r = psi(. - w_r)`` the l_p mirror map centred at
w_r (:mod:`fedkl.problems.mirror`), and F_r is mu = rho RELATIVELY strongly convex w.r.t. psi_r
(weak convexity costs rho ||.||_p^2/2 <= rho D_psi). T rounds of noisy stochastic mirror descent on
the ball X_r = {||w - w_r||_p <= 2 L0/beta}, which holds the prox point when every user's loss is
L0-Lipschitz in ||.||_p (from F_r(w^) <= F_r(w_r)):

    g_t     = Releaser.gaussian( (1/m) sum_{u in C_r} clip_q(grad f_u(w_t)) ) + 2 rho grad psi(w_t - w_r)
    w_{t+1} = w_r + radial projection onto X_r of  grad psi*( grad psi(w_t - w_r) - eta_t g_t ),
    eta_t   = 2 / (mu (t + 1)),   w_{r+1} = sum_t t w_t / (T(T+1)/2)

(the Bregman projection of psi_r onto a ball centred at w_r is radial scaling). With G^2 >= E||g_t||_q^2
the standard argument (Lacoste-Julien, Schmidt & Bach 2012, with D_psi for the squared distance and the
1-strong convexity of psi for ||g||_q^2) gives E F_r(w_{r+1}) - min F_r <= 2 G^2 / (mu (T + 1)). The
default T = m balances it with the cohort's statistical error L0^2/(mu m) (heuristic).

Parameters (Thm 20, natural logs): kappa = 1/(p-1) (= the paper's min{1/(p-1), ln d} for
p >= 1 + 1/ln d; below that the paper runs in l_pbar, pbar = 1 + 1/ln d: give that p), kappa~ = 1 +
ln d [p < 2], ``R = floor(min{ sqrt(n D rho/(kappa L0)), (kappa~ kappa^2)^(-1/3) (D (n eps)^2 rho /
(L0 d ln(1/delta)))^(1/3) })``, at least 1 and at most n, with ``eps^2/ln(1/delta) = 8 rho_zcdp`` (paper
001's Alg 2 convention rho_p = eps/(2 sqrt(ln 1/delta)), rho_p = sqrt(2 rho_zcdp)); D a public bound
on ||w0 - w*||_p (the domain is R^d; the proof uses F(w_1) - inf F <= L0 D).

**Guarantee: user-level rho-zCDP** (replace-one or add-remove, n public), any clients. Each answer is
clipped where the data lives to ``||a||_q <= L0`` (q = p/(p-1), the dual norm; a Flower answer above
it is rejected and contributes zero), so ``||a||_2 <= d^(1/p - 1/2) L0`` (Hoelder, q >= 2) and the mean
over the FIXED nominal m moves by at most ``Delta = f d^(1/p-1/2) L0 / m`` in l2 (f = 2 replace-one,
1 add-remove). Each of the T releases of prox round r is a Gaussian of sensitivity Delta at rho/T,
charged to the users of C_r only before it is drawn; a user is read in its cohort's round only, and
everything later is post-processing of private releases plus other users' data (parallel
composition): rho per user. **Private outputs:** every release, hence every inner iterate, every prox
centre and the model; a client receives only iterates computed from earlier releases. The public
Lipschitz bound enters only through the clip: a wrong L0 or rho hurts utility, never privacy.
Rate (Thm 20, with Thm 19's solver): proximal near-stationarity
``O(kappa^{5/4}/n^{1/4} + kappa^{4/3}(d kappa~/(n eps)^2)^{1/6})``; fedkl's inner solver is not A_SC, so
this rate is the paper's, measured (not proven) here.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from fedkl.algorithms.contract import Algorithm, AlgorithmParams, BuildContext, ModelResult, SmallAudit, param
from fedkl.algorithms.localization.fkt_common import (
    check_parallel_releaser,
    cohort_order,
    replace_factor,
    split_cohorts,
)
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import DualClippedGradient, Federation
from fedkl.privacy.charges import GaussianCharge, Need
from fedkl.privacy.clients import ANY_CLIENTS
from fedkl.privacy.guarantee import ZERO_SUMS, Guarantee, check_relation
from fedkl.privacy.release import Releaser
from fedkl.problems.mirror import check_exponent, dual_exponent, mirror_gradient, mirror_inverse, project_ball

NAME = "pg-mirror-descent"


def _positive(name: str, v: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{NAME}: {name} must be finite and > 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class PGMDSetting:
    """Public constants: ``lipschitz`` L0 (the dual-norm clip), ``weak_convexity`` rho, ``distance``
    D >= ||w0 - w*||_p, ``p``, ``dim`` d and the relation."""

    lipschitz: float
    weak_convexity: float
    distance: float
    p: float
    dim: int
    neighbouring: str = "replace-one"

    def __post_init__(self) -> None:
        check_exponent(self.p)
        for name in ("lipschitz", "weak_convexity", "distance"):
            _positive(name, getattr(self, name))
        if int(self.dim) != self.dim or self.dim < 1:
            raise ValueError(f"{NAME}: dim must be a positive integer, got {self.dim}")
        check_relation(self.neighbouring)

    @property
    def q(self) -> float:
        return dual_exponent(self.p)

    @property
    def kappa(self) -> float:
        return 1.0 / (self.p - 1.0)

    @property
    def kappa_tilde(self) -> float:
        return 1.0 + (math.log(self.dim) if self.p < 2.0 else 0.0)

    @property
    def beta(self) -> float:
        """Alg 6's prox weight ``2 rho kappa``."""
        return 2.0 * self.weak_convexity * self.kappa

    @property
    def inner_radius(self) -> float:
        """``2 L0 / beta``: ``||prox point - w_r||_p`` is at most this (module docstring)."""
        return 2.0 * self.lipschitz / self.beta


def theorem_outer_rounds(n: int, rho_zcdp: float, s: PGMDSetting) -> int:
    """Thm 20's R (module docstring), floored, in [1, n]."""
    if n < 1:
        raise ValueError(f"{NAME}: needs at least one user")
    _positive("rho", rho_zcdp)
    statistical = math.sqrt(n * s.distance * s.weak_convexity / (s.kappa * s.lipschitz))
    privacy = (s.kappa_tilde * s.kappa**2) ** (-1.0 / 3.0) * (
        s.distance * n**2 * 8.0 * rho_zcdp * s.weak_convexity / (s.lipschitz * s.dim)
    ) ** (1.0 / 3.0)
    return max(1, min(n, int(min(statistical, privacy))))


@dataclass(frozen=True)
class PGMDPlan:
    """The public plan of a run: cohorts (positions), inner rounds, noise, output index."""

    cohorts: list[list[int]]  # R - 1 cohorts of m users: the rounds that compute w_2..w_R
    inner_rounds: int
    sensitivity: float
    rho_step: float
    output_index: int  # r* - 1: the released centre is centres[output_index]

    @property
    def outer_rounds(self) -> int:
        """R: the number of prox centres w_1..w_R (one more than the rounds run)."""
        return len(self.cohorts) + 1

    @property
    def sigma(self) -> float:
        return self.sensitivity / math.sqrt(2.0 * self.rho_step)


@dataclass
class PGMDResult(ModelResult):
    centres: list[torch.Tensor] = field(default_factory=list)  # w_1..w_R, all private outputs


@dataclass(frozen=True)
class PGMDParams(AlgorithmParams):
    """pg-mirror-descent: the geometry p and the public constants of Thm 20."""

    pgmd_p: float = param(2.0, "pg-mirror-descent: the l_p geometry, 1 < p <= 2 (2: Euclidean)", "heuristic")
    pgmd_lipschitz: float | None = param(
        None,
        "pg-mirror-descent: L0, the public bound on ||grad f_u||_q that clients clip to (q = p/(p-1); default: "
        "the problem's l2 Lipschitz constant, a valid l_q bound)",
        "theorem",
    )
    pgmd_weak_convexity: float | None = param(
        None,
        "pg-mirror-descent: rho, the weak-convexity modulus of the loss (default: the problem's; a smooth "
        "loss is L1-weakly convex)",
        "theorem",
    )
    pgmd_distance: float = param(
        1.0, "pg-mirror-descent: D, a public bound on ||w0 - w*||_p (enters Thm 20's R)", "heuristic", positive=True
    )
    pgmd_outer_rounds: int | None = param(
        None, "pg-mirror-descent: R prox rounds on disjoint cohorts (default: Thm 20's R)", "theorem"
    )
    pgmd_inner_rounds: int | None = param(
        None, "pg-mirror-descent: mirror-descent rounds per prox round (default: the cohort size n/R)", "heuristic"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1.0 < self.pgmd_p <= 2.0:
            raise ValueError(f"--pgmd-p must satisfy 1 < p <= 2, got {self.pgmd_p}")
        for flag, v in (("--pgmd-lipschitz", self.pgmd_lipschitz), ("--pgmd-weak-convexity", self.pgmd_weak_convexity)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be finite and > 0, got {v}")
        for flag, v in (
            ("--pgmd-outer-rounds", self.pgmd_outer_rounds),
            ("--pgmd-inner-rounds", self.pgmd_inner_rounds),
        ):
            if v is not None and v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")


def weak_convexity_of(problem, feature_bound: float) -> float:
    """The problem's stated weak-convexity modulus, else its smoothness L1 (L1-smooth implies
    L1-weakly convex, paper 001 Cor 26); ValueError if it states neither."""
    if hasattr(problem, "weak_convexity"):
        return float(problem.weak_convexity(feature_bound))
    c = problem.constants(feature_bound, None)
    if c.smoothness is None:
        raise ValueError(
            f"{NAME}: {problem.name} states no weak-convexity modulus or smoothness: give --pgmd-weak-convexity"
        )
    return float(c.smoothness)


@register
class PGMirrorDescent(Algorithm[PGMDParams]):
    """Proximally guided private mirror descent, rho-weakly convex non-smooth losses over l_p (paper 001, Alg 6; zCDP).

    See the module docstring. Built from the params and the budget: ``setting`` (the given constants, else
    the problem's: its l2 Lipschitz constant, a valid l_q bound, and its weak-convexity modulus or
    smoothness), ``rho_total`` (``ctx.rho_left``), ``seed`` (the run's), ``outer_rounds`` /
    ``inner_rounds`` (None: Thm 20's R / the cohort size)."""

    name = NAME
    Params = PGMDParams
    guarantee = Guarantee("zcdp", "parallel", ANY_CLIENTS)
    absence = ZERO_SUMS
    small = {"pgmd_outer_rounds": 3, "pgmd_inner_rounds": 2}
    audit = SmallAudit(settings={"reg": 0.0})  # Alg 6 needs a globally Lipschitz loss (no ridge term)

    def __init__(self, params: PGMDParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        lipschitz, rho_wc = params.pgmd_lipschitz, params.pgmd_weak_convexity
        try:
            if lipschitz is None:
                lipschitz = ctx.problem.constants(ctx.feature_bound, None).lipschitz
            if rho_wc is None:
                rho_wc = weak_convexity_of(ctx.problem, ctx.feature_bound)
        except ValueError as exc:
            raise ValueError(f"{NAME} runs on R^d and needs a globally Lipschitz loss: {exc}") from exc
        self.setting = PGMDSetting(
            lipschitz, rho_wc, params.pgmd_distance, params.pgmd_p, ctx.problem.num_params, ctx.neighbouring
        )
        self.rho_total = _positive("rho_total", ctx.rho_left)
        self.seed = int(ctx.seed)
        self.outer_rounds, self.inner_rounds = params.pgmd_outer_rounds, params.pgmd_inner_rounds

    def plan(self, user_ids: tuple[str, ...] | list[str]) -> PGMDPlan:
        """Cohorts, rounds, sensitivity and output index from public values only (refuses before data)."""
        n, s = len(user_ids), self.setting
        R = self.outer_rounds if self.outer_rounds is not None else theorem_outer_rounds(n, self.rho_total, s)
        if R > n or R < 2:
            raise ValueError(
                f"{NAME}: R={R} prox rounds for {n} users; need 2 <= R <= n (R = 1 would release the public w0: "
                "more users, a larger budget or --pgmd-outer-rounds)"
            )
        m = n // R
        T = self.inner_rounds if self.inner_rounds is not None else m
        # cohorts 1..R-1 compute w_2..w_R; the paper's last round (w_{R+1}) is never output: not run
        cohorts = split_cohorts(cohort_order(user_ids, self.seed), [m] * (R - 1))
        sensitivity = replace_factor(s.neighbouring) * s.dim ** (1.0 / s.p - 0.5) * s.lipschitz / m
        output = random.Random(f"{NAME}\x1f{self.seed}").randrange(R)
        return PGMDPlan(cohorts, T, sensitivity, self.rho_total / T, output)

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Each user of a cohort: ``rho_total`` once (parallel composition); the surplus users nothing."""
        used = [u for c in self.plan(user_ids).cohorts for u in c]
        return (Need(tuple(user_ids[u] for u in used), GaussianCharge(self.rho_total)),)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> PGMDResult:
        check_parallel_releaser(releaser, self.name)
        if federation.num_params != self.setting.dim:
            raise ValueError(f"{NAME}: the setting has d={self.setting.dim}, the federation {federation.num_params}")
        plan = self.plan(federation.user_ids)
        w = torch.as_tensor(w0).to(torch.float64).clone()
        centres, log = [w.clone()], RoundLog(len(plan.cohorts), progress)
        for r, cohort in enumerate(plan.cohorts, start=1):
            start = time.perf_counter()
            w, failed = self._prox_round(federation, releaser, plan, r, cohort, w)
            centres.append(w.clone())
            log.round(r, start, failed, users=len(cohort), inner_rounds=plan.inner_rounds, sigma=plan.sigma)
        dtype = torch.as_tensor(w0).dtype
        return PGMDResult(
            w=centres[plan.output_index].to(dtype),
            rounds=len(plan.cohorts) * plan.inner_rounds,
            sigma=plan.sigma,
            rho_spent=self.rho_total,
            centres=[c.to(dtype) for c in centres],
            details=self.describe(plan),
            history=log.history,
        )

    def _prox_round(
        self,
        federation: Federation,
        releaser: Releaser,
        plan: PGMDPlan,
        r: int,
        cohort: list[int],
        center: torch.Tensor,
    ) -> tuple[torch.Tensor, int]:
        """T rounds of noisy mirror descent on F_r over X_r (module docstring); returns the t-weighted
        average of the evaluation points and the number of failed answers."""
        s, T, m = self.setting, plan.inner_rounds, len(cohort)
        ids = federation.ids_of(cohort)
        mu = s.weak_convexity  # relative strong convexity of F_r w.r.t. psi_r: 2 rho - rho
        reg = 2.0 * s.weak_convexity  # (beta/2)||. - w_r||_p^2 = 2 rho psi_r
        w, avg, failed = center.clone(), torch.zeros_like(center), 0
        for t in range(1, T + 1):
            avg += (2.0 * t / (T * (T + 1))) * w
            answers = federation.sum(DualClippedGradient(w, s.lipschitz, s.q), cohort)
            failed += len(answers.failed)
            noisy = releaser.gaussian(
                answers.total().to(torch.float64) / m,
                sensitivity=plan.sensitivity,
                rho=plan.rho_step,
                user_ids=ids,
                label=f"{NAME}/prox-{r}/round-{t}",
                details={"prox_round": r, "inner_round": t, "users": m, "p": s.p, "clip": s.lipschitz},
            )
            dual = mirror_gradient(w - center, s.p)
            g = noisy.to(torch.float64) + reg * dual
            step = 2.0 / (mu * (t + 1))
            w = project_ball(center + mirror_inverse(dual - step * g, s.p), center, s.inner_radius, s.p)
        return avg, failed

    def describe(self, plan: PGMDPlan) -> dict:
        s = self.setting
        return {
            "dp": f"user-level rho-zCDP ({s.neighbouring}, n public): each user is in one cohort and is charged "
            f"rho={self.rho_total:.4g} over its cohort's {plan.inner_rounds} Gaussian releases",
            "p": s.p,
            "q": s.q,
            "lipschitz": s.lipschitz,
            "weak_convexity": s.weak_convexity,
            "beta": s.beta,
            "inner_radius": s.inner_radius,
            "outer_rounds": plan.outer_rounds,
            "cohort_size": len(plan.cohorts[0]),
            "inner_rounds": plan.inner_rounds,
            "sensitivity": plan.sensitivity,
            "sigma": plan.sigma,
            "output_centre": plan.output_index + 1,
            "output_rule": "uniform prox centre w_{r*}, r* drawn from a public RNG seeded by the run's seed",
        }
