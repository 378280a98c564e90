"""Paper 003 (Feldman, Koren, Talwar 2020) in fedkl: names, builders and one-line summaries.

| name | problem class | guarantee | rate (excess population loss; rho_p = sqrt(2 rho)) |
|---|---|---|---|
| ``fkt-snowball`` | convex, L-Lipschitz, beta-smooth (eta <= 2/beta) | user-level rho-zCDP of the LAST iterate (amplification by iteration), charged per batch as (eps, delta) | O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))) (Thm 3.6; ``constant``: x log n, Thm 3.5) |
| ``fkt-snowball-sc`` | each f_u lam-strongly convex, smooth | same | O((L^2 log^2 n/lam)(1/n + d/(rho_p^2 n^2))) (Thm 5.4) |
| ``fkt-phased-sgd`` | convex, Lipschitz, smooth | user-level rho-zCDP of every phase output; each user in one phase | O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))), < n gradients (Thm 4.4) |
| ``fkt-phased-erm`` | convex, Lipschitz (smooth: gd solver; any: subgradient) | same (pure zCDP: the solver's accuracy is proven, no delta) | O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))) (Thm 4.8) |
| ``fkt-sc-reduction`` | F lam-strongly convex (+ the inner algorithm's) | same | O((L^2/lam)(1/n + d/(rho_p^2 n^2))) (Thm 5.1) |
| ``fkt-sc-localization`` | F lam-strongly convex, smooth, beta/lam <= n/(k ln n) | same | O((L^2 ln n lnln n/lam)(1/n + d lnln n/(rho_p^2 n^2))) (Thm 5.3) |

Every algorithm is registered (:mod:`fedkl.algorithms.registry`) with its Params (below) and reads
the run's ``neighbouring`` and ``seed`` (cohort hashing) and ``reg`` (through the problem); the
schedules, steps and the clip (= the problem's Lipschitz constant L) are set by the theorems from
public constants: no ``rounds``, ``lr`` or ``clip``. Each algorithm class declares
``composition="parallel"`` in its ``guarantee``: the runner gives it a Releaser without the run-wide
zCDP filter; the per-user ledger enforces each user's budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedkl.algorithms.localization.fkt_common import ConvexSetting, convex_setting
from fedkl.algorithms.localization.fkt_phased import FKTPhasedERM, LocalizationConfig, PhasedSGD, SCLocalization
from fedkl.algorithms.localization.fkt_reduction import SCReduction, SCReductionConfig
from fedkl.algorithms.localization.fkt_snowball import SnowballConfig, SnowballSGD
from fedkl.algorithms.registry import BuildContext, Domain, param, register
from fedkl.privacy.guarantee import SOLVER_ITERATES, ZERO_SUMS, ClientView
from fedkl.privacy.zcdp import rho_for_eps_delta


@dataclass(frozen=True)
class FKTParams(Domain):
    """What every paper-003 algorithm reads: the domain and the strong convexity used in steps."""

    strong_convexity: float | None = param(
        None,
        "paper-003 strongly convex variants: lam (default: the problem's, = --reg); used only in step sizes "
        "and averaging weights, never in a sensitivity",
        "theorem",
    )


@dataclass(frozen=True)
class SnowballParams(FKTParams):
    fkt_schedule: str = param(
        "jnn",
        "fkt-snowball step sizes: jnn (Thm 3.6, no log factor) or constant (Thm 3.5)",
        "theorem",
        choices=("jnn", "constant"),
    )


@dataclass(frozen=True)
class LocalizationParams(FKTParams):
    fkt_solver: str | None = param(
        None,
        "phase solver: psgd (fkt-phased-sgd, fkt-sc-localization), gd or subgradient (fkt-phased-erm), or "
        "one-shot (any phased algorithm: clients see only private outputs)",
        "theorem (one-shot: heuristic utility, private for any loss)",
        choices=("psgd", "gd", "subgradient", "one-shot"),
    )
    fkt_batch: int = param(
        1,
        "users per SGD step in the psgd phase solver (1 = the paper; b > 1 divides the "
        "sensitivity by b but is not analysed)",
        "heuristic for b > 1",
    )
    fkt_min_cohort: int = param(1, "the smallest phase cohort; later phases are dropped", "heuristic")
    fkt_erm_tol: float = param(
        1.0,
        "fkt-phased-erm solver accuracy r_i = TOL * L * eta_i (1 = the paper's Delta_i); smaller values shrink "
        "the sensitivity 1 + 2 TOL (x L eta_i) at the cost of more solver rounds",
        "theorem at 1",
    )
    fkt_max_solver_rounds: int = param(
        100_000, "refuse fkt-phased-erm plans needing more solver rounds than this", "safety limit"
    )
    fkt_sc_c: float = param(2.0, "fkt-sc-localization: c >= 2 of Thm 5.3 (eta = 4 c k ln n/(lam n))", "theorem")


@dataclass(frozen=True)
class ReductionParams(LocalizationParams):
    fkt_inner: str = param(
        "phased-sgd",
        "fkt-sc-reduction inner algorithm: phased-sgd or phased-erm",
        "theorem",
        choices=("phased-sgd", "phased-erm"),
    )
    fkt_reduction_c: float = param(
        20.0,
        "fkt-sc-reduction: the inner algorithm's constant c in c L D (1/sqrt n + sqrt d/(rho_p n)) that sets "
        "the next run's distance bound (20: Thm 4.4's proof with the exact noise)",
        "theorem (a constant derived from its proof)",
    )


def _setting(params: FKTParams, ctx: BuildContext) -> ConvexSetting:
    return convex_setting(
        ctx.problem,
        ctx.feature_bound,
        radius=params.radius,
        distance=params.distance,
        strong_convexity=params.strong_convexity,
    )


def _localization(params: LocalizationParams, ctx: BuildContext) -> LocalizationConfig:
    return LocalizationConfig(
        solver=params.fkt_solver,
        neighbouring=ctx.neighbouring,
        seed=ctx.seed,
        batch=params.fkt_batch,
        min_cohort=params.fkt_min_cohort,
        erm_tol=params.fkt_erm_tol,
        max_solver_rounds=params.fkt_max_solver_rounds,
        sc_c=params.fkt_sc_c,
    )


def _snowball(params: FKTParams, ctx: BuildContext, schedule: str) -> SnowballSGD:
    # the per-batch charges are (eps, delta) (see fkt_snowball): convert at what the users can afford
    eps_left, delta_left = ctx.approx_budget()
    rho = min(ctx.rho_left, rho_for_eps_delta(eps_left, delta_left, ctx.conversion))
    config = SnowballConfig(variant=schedule, neighbouring=ctx.neighbouring, seed=ctx.seed)
    return SnowballSGD(config, _setting(params, ctx), rho, delta=delta_left, conversion=ctx.conversion)


SNOWBALL_VIEW = ClientView(
    False,
    "a client of batch t receives the intermediate iterate w_{t-1}, private towards earlier batches' users only "
    "at the zCDP in algorithm_details.iterate_exposure_rho, not at the run's budget (only the last iterate is); "
    "no mode avoids it: use a phased fkt algorithm with --fkt-solver one-shot where clients may see only private "
    "values",
)
ONE_SHOT_VIEW = ClientView(True, "the previous phase's private output (or the public w0) and lam_i only (one-shot)")


def _localization_view(params: LocalizationParams) -> ClientView:
    """Phased fkt algorithms: clients see the phase solver's iterates unless the solver is one-shot."""
    return ONE_SHOT_VIEW if params.fkt_solver == "one-shot" else SOLVER_ITERATES


@register("fkt-snowball", SnowballParams, SNOWBALL_VIEW, absence=ZERO_SUMS)
def build_snowball(params: SnowballParams, ctx: BuildContext) -> SnowballSGD:
    """Snowball SGD (Alg 1): one pass, privacy of the last iterate by amplification by iteration."""
    return _snowball(params, ctx, params.fkt_schedule)


@register("fkt-snowball-sc", FKTParams, SNOWBALL_VIEW, absence=ZERO_SUMS)
def build_snowball_sc(params: FKTParams, ctx: BuildContext) -> SnowballSGD:
    """Snowball SGD with the strongly convex schedule (Thm 5.4)."""
    return _snowball(params, ctx, "strongly-convex")


@register("fkt-phased-sgd", LocalizationParams, _localization_view, absence=ZERO_SUMS)
def build_phased_sgd(params: LocalizationParams, ctx: BuildContext) -> PhasedSGD:
    """Phased SGD (Alg 2, Thm 4.4): each user in one phase, < n gradients."""
    return PhasedSGD(_localization(params, ctx), _setting(params, ctx), ctx.rho_left)


@register("fkt-phased-erm", LocalizationParams, _localization_view, absence=ZERO_SUMS)
def build_fkt_phased_erm(params: LocalizationParams, ctx: BuildContext) -> FKTPhasedERM:
    """Phased ERM (Alg 3, Thm 4.8): each phase solves a regularized ERM to a proven accuracy."""
    return FKTPhasedERM(_localization(params, ctx), _setting(params, ctx), ctx.rho_left)


@register("fkt-sc-localization", LocalizationParams, _localization_view, absence=ZERO_SUMS)
def build_sc_localization(params: LocalizationParams, ctx: BuildContext) -> SCLocalization:
    """Strongly convex localization (Alg 5, Thm 5.3)."""
    return SCLocalization(_localization(params, ctx), _setting(params, ctx), ctx.rho_left)


@register("fkt-sc-reduction", ReductionParams, _localization_view, absence=ZERO_SUMS)
def build_sc_reduction(params: ReductionParams, ctx: BuildContext) -> SCReduction:
    """The strongly convex reduction (Thm 5.1) around a convex phased algorithm."""
    config = SCReductionConfig(
        inner=params.fkt_inner, c=params.fkt_reduction_c, localization=_localization(params, ctx)
    )
    return SCReduction(config, _setting(params, ctx), ctx.rho_left)


__all__ = [
    "FKTPhasedERM",
    "FKTParams",
    "LocalizationParams",
    "ReductionParams",
    "SnowballParams",
    "LocalizationConfig",
    "PhasedSGD",
    "SCLocalization",
    "SCReduction",
    "SCReductionConfig",
    "SnowballConfig",
    "SnowballSGD",
    "build_fkt_phased_erm",
    "build_phased_sgd",
    "build_sc_localization",
    "build_sc_reduction",
    "build_snowball",
    "build_snowball_sc",
    "convex_setting",
]
