"""Snowball-SGD (paper 003, Alg. 1 with Thm 3.5 / 3.6) and its strongly convex variant (Thm 5.4).

Projected noisy SGD over growing batches of FRESH users, last iterate out:

    batch t = 1..T: B_t users never asked before (public sizes, hashed cohorts, see fkt_common)
    g_t  = (1/B_t) sum_{u in batch t} clip_L(grad f_u(w_{t-1}))            (federation)
    w_t  = Proj_K(w_{t-1} - eta_t (g_t + xi_t)),  xi_t ~ N(0, sigma^2 I),  sigma = L / sqrt(d)
    output w_T (only)

The noise is inside the step, ``eta_t (g_t + xi_t)`` (docs/derivations/paper-003.md §6, pitfall 1:
line 2 of Alg. 1 is misprinted).

Step sizes (public): ``variant="constant"`` (Thm 3.5): eta = D/(L sqrt(2T)); ``"jnn"`` (Thm 3.6, the
Jain-Nagaraj-Netrapalli halving schedule with c = D/(sqrt 2 L), no log factor); ``"strongly-convex"``
(Thm 5.4): eta = 2 ln(T)/(lam T). Every eta_t is capped at 2/beta (the contraction condition of the
privacy proof) and, for Thm 5.4, at 1/(2 lam) (Lemma 5.2); the cap is recorded in ``details``.

**Guarantee: user-level rho-zCDP of the output w_T, by privacy amplification by iteration**
(Thm 3.1 / Cor. 2.14, Feldman-Mironov-Talwar-Thakurta 2018), for convex, beta-smooth losses whose
gradients are bounded by L on K (see fkt_common), neighbouring relation replace-one (default) or
add-remove, n public. Derivation, per user u in batch t: the two runs differ only in the step map of
batch t, by at most ``s_t = f eta_t L / B_t`` (f = 2 replace-one, 1 add-remove: one clipped term of
the batch mean changes); all step maps are contractions (projection, gradient step of a convex
beta-smooth mean with eta <= 2/beta); the noise of steps t..T is N(0, eta_r^2 sigma^2 I). Cor. 2.14
gives ``D_alpha(w_T || w'_T) <= alpha s_t^2 / (2 sum_{r>=t} eta_r^2 sigma^2)``, i.e.

    rho_t = (f eta_t L / B_t)^2 / (2 sum_{r>=t} eta_r^2 sigma^2)   for every user of batch t.

B_t is the smallest integer with rho_t <= rho (the exact formula, docs/derivations/paper-003.md §6,
pitfall 6; the theorems' ceil(2 sqrt(d/(T-t+1))/rho_p) and ceil(4 sqrt(3d/(T-t+1))/rho_p) with
rho_p = sqrt(2 rho) are sufficient values of the same condition), and T the largest horizon whose
batches fit in n users.

Ledger: batch t's users are charged their rho_t (not rho) — a user is in one batch only, and the
other batches' noise is not a release. To keep the number of ledger transactions small, rho_t is
rounded UP to the grid rho 2^(-j/8) (at most 9.1% above it) and batches of equal size and grid value
share one charge (one schedule of as many noise draws as batches). Because amplification by iteration protects only the LAST
iterate, the per-step noisy gradients are not releases accounted by ``Releaser.gaussian``; they are
drawn through ``Releaser.schedule_gaussian`` (one noise draw per batch at sigma), whose charge is in
(eps, delta): rho_t is converted at the delta the users have left (the budget's conversion, CKS by
default). Every batch is charged BEFORE the first gradient is requested; a ledger that cannot afford
a batch stops the run with BudgetExceeded before any charge (checked up front) and nothing is
released.

**What is private: w_T only.** The intermediate iterates are NOT outputs: the average iterate can be
non-private (paper §6). **What a participating client sees:** a user of batch t receives w_{t-1},
which depends on the earlier batches with far less noise than w_T: with respect to a user of batch
s < t it is only ``(f eta_s L/B_s)^2 / (2 sum_{r=s}^{t-1} eta_r^2 sigma^2)``-zCDP (up to
f^2 d/(2 B_s^2) for the next batch). ``details["iterate_exposure_rho"]`` reports the worst value.
Deploy Snowball only where clients may see such iterates (or collude with nobody); otherwise use a
phased algorithm with the one-shot phase solver (:mod:`fedkl.algorithms.localization.fkt_phased`), whose clients
see only private outputs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from fedkl.algorithms.contract import Algorithm, BuildContext, SmallAudit, param
from fedkl.algorithms.localization.fkt_common import (
    ConvexSetting,
    FKTParams,
    FKTResult,
    cohort_order,
    project,
    replace_factor,
    split_cohorts,
)
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation
from fedkl.privacy.charges import ApproxDPCharge, Need
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, ZERO_SUMS, ClientView, Guarantee, check_relation
from fedkl.privacy.release import Releaser
from fedkl.privacy.zcdp import CONVERSIONS, rho_for_eps_delta, zcdp_to_eps

VARIANTS = ("jnn", "constant", "strongly-convex")


@dataclass(frozen=True)
class SnowballParams(FKTParams):
    fkt_schedule: str = param(
        "jnn",
        "fkt-snowball step sizes: jnn (Thm 3.6, no log factor) or constant (Thm 3.5)",
        "theorem",
        choices=("jnn", "constant"),
    )


SNOWBALL_VIEW = ClientView(
    False,
    "a client of batch t receives the intermediate iterate w_{t-1}, private towards earlier batches' users only "
    "at the zCDP in algorithm_details.iterate_exposure_rho, not at the run's budget (only the last iterate is); "
    "no mode avoids it: use a phased fkt algorithm with --fkt-solver one-shot where clients may see only private "
    "values",
)


@dataclass(frozen=True)
class SnowballPlan:
    """The public schedule: batch sizes, step sizes, noise and each batch's zCDP cost."""

    batches: list[int]
    steps: list[float]
    sigma: float
    costs: list[float]
    capped: bool
    rho: float

    @property
    def horizon(self) -> int:
        return len(self.batches)

    @property
    def users(self) -> int:
        return sum(self.batches)


def jnn_steps(T: int, c: float) -> list[float]:
    """Definition 3.3: l = ceil(log2 T), T_i = T - ceil(T 2^-i) (0 <= i <= l), T_{l+1} = T,
    eta_t = c 2^-i / sqrt(T) for T_i < t <= T_{i+1}."""
    ell = math.ceil(math.log2(T)) if T > 1 else 0
    bounds = [T - math.ceil(T * 2.0**-i) for i in range(ell + 1)] + [T]
    out: list[float] = []
    for i in range(ell + 1):
        out += [c * 2.0**-i / math.sqrt(T)] * (bounds[i + 1] - bounds[i])
    return out


def amplification_costs(
    batches: list[int], steps: list[float], sigma: float, lipschitz: float, factor: float
) -> list[float]:
    """rho_t = (factor eta_t L / B_t)^2 / (2 sum_{r>=t} eta_r^2 sigma^2) (Cor. 2.14 in zCDP units)."""
    suffix, out = 0.0, []
    for b, eta in zip(reversed(batches), reversed(steps)):
        suffix += (eta * sigma) ** 2
        out.append((factor * eta * lipschitz / b) ** 2 / (2.0 * suffix))
    return out[::-1]


def _steps(variant: str, T: int, L: float, D: float, beta: float, lam: float) -> tuple[list[float], bool]:
    if variant == "constant":
        raw = [D / (L * math.sqrt(2.0 * T))] * T
    elif variant == "jnn":
        raw = jnn_steps(T, D / (math.sqrt(2.0) * L))
    else:
        raw = [2.0 * math.log(T) / (lam * T)] * T
    cap = 2.0 / beta if variant != "strongly-convex" else min(2.0 / beta, 1.0 / (2.0 * lam))
    return [min(e, cap) for e in raw], any(e > cap for e in raw)


def _batches_for(steps: list[float], sigma: float, L: float, rho: float, factor: float) -> list[int]:
    suffix, out = 0.0, []
    for eta in reversed(steps):
        suffix += (eta * sigma) ** 2
        b = max(1, math.ceil(factor * eta * L / math.sqrt(2.0 * rho * suffix)))
        while (factor * eta * L / b) ** 2 / (2.0 * suffix) > rho:  # float rounding of the ceil
            b += 1
        out.append(b)
    return out[::-1]


def plan_snowball(
    n: int, setting: ConvexSetting, rho: float, variant: str, neighbouring: str, distance: float
) -> SnowballPlan:
    """The largest horizon T whose batches fit in n users, with its schedule (public values only)."""
    beta = setting.require_smooth("Snowball-SGD")
    lam = setting.require_strongly_convex("Snowball-SGD (strongly convex)") if variant == "strongly-convex" else 0.0
    L, d = setting.lipschitz, setting.dim
    sigma = L / math.sqrt(d)
    factor = replace_factor(neighbouring)
    t_min = 2 if variant == "strongly-convex" else 1

    def build(T: int) -> SnowballPlan:
        steps, capped = _steps(variant, T, L, distance, beta, lam)
        batches = _batches_for(steps, sigma, L, rho, factor)
        return SnowballPlan(batches, steps, sigma, amplification_costs(batches, steps, sigma, L, factor), capped, rho)

    best = build(t_min)
    if best.users > n:
        raise ValueError(
            f"Snowball-SGD needs at least {best.users} users at rho={rho:.4g} in d={d} "
            f"(the last batch alone needs ceil({factor:g} sqrt(d)/sqrt(2 rho))); got n={n}"
        )
    lo, hi = t_min, n  # every batch has >= 1 user, so T <= n
    while lo < hi:  # largest T with users(T) <= n (users(T) is nondecreasing up to ceil effects)
        mid = (lo + hi + 1) // 2
        p = build(mid)
        if p.users <= n:
            lo, best = mid, p
        else:
            hi = mid - 1
    return best


GRID = 2.0 ** (1.0 / 8.0)  # charges are rounded UP to rho * GRID^-j: at most 9.1% above the exact cost


def grid_index(rho: float, cost: float) -> int:
    """The largest j >= 0 with rho GRID^-j >= cost (so the charge is >= the exact cost, < GRID x it)."""
    j = max(0, math.floor(math.log(rho / cost) / math.log(GRID)))
    while j > 0 and charge_cost(rho, j) < cost:
        j -= 1
    return j


def charge_cost(rho: float, j: int) -> float:
    return rho * GRID**-j


def charge_groups(plan: SnowballPlan) -> dict[tuple[int, int], list[int]]:
    """Batches grouped by (batch size, cost grid index): one ledger charge per group. The grid keeps
    the number of distinct (eps, delta) charges small (each distinct eps costs the ledger a numerical
    conversion) while charging every user at most 9.1% above its batch's exact rho_t."""
    out: dict[tuple[int, int], list[int]] = {}
    for t, (b, c) in enumerate(zip(plan.batches, plan.costs)):
        out.setdefault((b, grid_index(plan.rho, c)), []).append(t)
    return out


class _Snowball(Algorithm[FKTParams]):
    """The body of both Snowball algorithms (module docstring); each registered subclass fixes the
    step schedule (:attr:`variant`).

    Built from ``ctx``: each participating user's zCDP budget ``rho_total`` (the largest rho_t allowed)
    is the run's zCDP left, capped at the zCDP of the (eps, delta) every user can still afford (the
    per-batch charges are (eps, delta)); ``delta``: the delta left, at which each batch's rho_t is
    converted into its (eps, delta) charge; ``conversion``: the budget's, "cks" or "bun_steinke"."""

    guarantee = Guarantee("approx-dp", "parallel", IN_CLASS_CLIENTS)
    absence = ZERO_SUMS
    clients_see = SNOWBALL_VIEW
    audit = SmallAudit()

    def __init__(self, params: FKTParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        # the per-batch charges are (eps, delta): convert at what the users can afford
        eps_left, delta_left = ctx.approx_budget()
        rho_total = min(ctx.rho_left, rho_for_eps_delta(eps_left, delta_left, ctx.conversion))
        check_relation(ctx.neighbouring)
        setting = params.setting(ctx)
        delta, conversion = delta_left, ctx.conversion
        if not (rho_total > 0 and math.isfinite(rho_total)):
            raise ValueError(f"rho_total must be finite and > 0, got {rho_total}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if conversion not in CONVERSIONS:
            raise ValueError(f"conversion must be one of {CONVERSIONS}, got {conversion!r}")
        if conversion == "gaussian":  # exact only for a Gaussian mechanism's own profile
            raise ValueError(
                "Snowball's per-batch zCDP cost is a Renyi bound from amplification by iteration, not a "
                "Gaussian mechanism's: the exact Gaussian conversion does not apply; use cks or bun_steinke"
            )
        setting.require_smooth("Snowball-SGD")
        if self.variant == "strongly-convex":
            setting.require_strongly_convex("Snowball-SGD (strongly convex)")
        self.setting = setting
        self.rho_total, self.delta, self.conversion = float(rho_total), float(delta), conversion

    @property
    def variant(self) -> str:
        """The step schedule (module docstring): one of :data:`VARIANTS`."""
        raise NotImplementedError

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Each batch's users: its group's (eps, delta) once (parallel composition), from the plan at the
        problem's initial parameters (the runner's w0; a --resume start moves the steps, so a run from another
        w0 is checked by the ledger at its up-front charges)."""
        plan = self.plan(len(user_ids), self.ctx.problem.init_params())
        batches = split_cohorts(cohort_order(user_ids, self.ctx.seed), plan.batches)
        return tuple(
            Need(
                tuple(user_ids[u] for t in members for u in batches[t]),
                ApproxDPCharge(
                    zcdp_to_eps(charge_cost(plan.rho, j), self.delta, self.conversion), self.delta, "declared-needs"
                ),
            )
            for (_, j), members in charge_groups(plan).items()
        )

    def plan(self, n: int, w0: torch.Tensor) -> SnowballPlan:
        """The public schedule :meth:`run` uses for n users from ``w0`` (projected onto K first)."""
        w = project(torch.as_tensor(w0).to(torch.float64), self.setting.radius)
        return plan_snowball(
            n,
            self.setting,
            self.rho_total,
            self.variant,
            self.ctx.neighbouring,
            self.setting.resolve_distance(w),
        )

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> FKTResult:
        s, neighbouring = self.setting, self.ctx.neighbouring
        w = project(torch.as_tensor(w0).to(torch.float64).clone(), s.radius)
        distance = s.resolve_distance(w)
        plan = plan_snowball(federation.num_users, s, self.rho_total, self.variant, neighbouring, distance)
        batches = split_cohorts(cohort_order(federation.user_ids, self.ctx.seed), plan.batches)
        ids = [federation.ids_of(b) for b in batches]
        factor = replace_factor(neighbouring)
        groups = charge_groups(plan)
        eps_of = {
            j: zcdp_to_eps(charge_cost(plan.rho, j), self.delta, self.conversion)  # one conversion per grid
            for j in sorted({j for _, j in groups})
        }  # value, not per group
        handles: dict[tuple[int, int], object] = {}
        for key, members in groups.items():  # every charge before any data is read
            users = [u for t in members for u in ids[t]]
            cost = charge_cost(plan.rho, key[1])
            handles[key] = releaser.schedule_gaussian(
                eps=eps_of[key[1]],
                delta=self.delta,
                sigma=plan.sigma,
                sensitivity=factor * s.lipschitz / key[0],
                releases=len(members),
                user_ids=users,
                label=f"{self.name}/batches-of-{key[0]}-cost-{key[1]}",
                details={
                    "batches": members,
                    "batch_size": key[0],
                    "rho_zcdp": cost,
                    "max_exact_rho": max(plan.costs[t] for t in members),
                    "conversion": self.conversion,
                    "accountant": "amplification by iteration (FKT Thm 3.1), last iterate only",
                },
            )
        batch_handle = {t: handles[key] for key, members in groups.items() for t in members}
        log = RoundLog(plan.horizon, progress)
        for t, (users, eta) in enumerate(zip(batches, plan.steps)):
            start = time.perf_counter()
            answers = federation.sum(ClippedGradient(w, s.lipschitz), users)
            noisy = batch_handle[t].release(answers.total().to(torch.float64) / len(users))
            w = project(w - eta * noisy, s.radius)
            log.round(t + 1, start, len(answers.failed), batch=len(users), step=eta)
        exposure = max(factor**2 * s.lipschitz**2 / (2 * b**2 * plan.sigma**2) for b in plan.batches)
        details = {
            "dp": f"user-level rho-zCDP of the last iterate ({neighbouring}, n public) by amplification by "
            f"iteration; batch t charged its rho_t rounded up to the grid rho 2^(-j/8) (max "
            f"{max(plan.costs):.4g} <= rho {self.rho_total:.4g}), converted to (eps, delta) at delta={self.delta:.3g} ({self.conversion})",
            "private_outputs": "the last iterate only",
            "variant": self.variant,
            "horizon": plan.horizon,
            "users_used": plan.users,
            "users_unused": federation.num_users - plan.users,
            "batches": plan.batches,
            "steps": plan.steps,
            "sigma_gradient": plan.sigma,
            "rho_per_batch": plan.costs,
            "charge_groups": len(groups),
            "steps_capped_at_2_over_beta": plan.capped,
            "iterate_exposure_rho": exposure,
            "distance": distance,
            "lipschitz": s.lipschitz,
            "smoothness": s.smoothness,
        }
        return FKTResult(
            w=w.to(torch.as_tensor(w0).dtype),
            rounds=plan.horizon,
            sigma=[plan.sigma],
            details=details,
            history=log.history,
        )


@register
class SnowballSGD(_Snowball):
    """Snowball SGD (Alg 1): one pass, privacy of the last iterate by amplification by iteration.

    Step sizes ``--fkt-schedule``: jnn (Thm 3.6) or constant (Thm 3.5); see the module docstring."""

    name = "fkt-snowball"
    Params = SnowballParams
    small = {"radius": 2.0}

    @property
    def variant(self) -> str:
        return self.params.fkt_schedule


@register
class SCSnowballSGD(_Snowball):
    """Snowball SGD with the strongly convex schedule (Thm 5.4)."""

    name = "fkt-snowball-sc"
    Params = FKTParams
    small = {"radius": 2.0, "reg": 0.1}
    variant = "strongly-convex"
