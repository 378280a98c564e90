"""Paper 003 (Feldman, Koren, Talwar 2020) in fedkl: names, builders and one-line summaries.

| name | problem class | guarantee | rate (excess population loss; rho_p = sqrt(2 rho)) |
|---|---|---|---|
| ``fkt-snowball`` | convex, L-Lipschitz, beta-smooth (eta <= 2/beta) | user-level rho-zCDP of the LAST iterate (amplification by iteration), charged per batch as (eps, delta) | O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))) (Thm 3.6; ``constant``: x log n, Thm 3.5) |
| ``fkt-snowball-sc`` | each f_u lam-strongly convex, smooth | same | O((L^2 log^2 n/lam)(1/n + d/(rho_p^2 n^2))) (Thm 5.4) |
| ``fkt-phased-sgd`` | convex, Lipschitz, smooth | user-level rho-zCDP of every phase output; each user in one phase | O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))), < n gradients (Thm 4.4) |
| ``fkt-phased-erm`` | convex, Lipschitz (smooth: gd solver; any: subgradient) | same (pure zCDP: the solver's accuracy is proven, no delta) | O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))) (Thm 4.8) |
| ``fkt-sc-reduction`` | F lam-strongly convex (+ the inner algorithm's) | same | O((L^2/lam)(1/n + d/(rho_p^2 n^2))) (Thm 5.1) |
| ``fkt-sc-localization`` | F lam-strongly convex, smooth, beta/lam <= n/(k ln n) | same | O((L^2 ln n lnln n/lam)(1/n + d lnln n/(rho_p^2 n^2))) (Thm 5.3) |

Every builder has the runner's signature ``build(cfg, rho_total, *, problem, dataset, delta, ledger,
user_ids)`` and reads the existing ``RunConfig`` fields ``reg`` (through ``problem``),
``neighbouring``, ``seed`` (cohort hashing); ``rounds``, ``lr`` and ``clip`` are NOT used: the
schedules, steps and the clip (= the problem's Lipschitz constant L) are set by the theorems from
public constants. New hyperparameters are read with ``getattr(cfg, name, default)`` (see
:data:`HYPERPARAMETERS`). Each algorithm class declares ``composition="parallel"`` in its ``guarantee``: the runner gives
it a Releaser without the run-wide zCDP filter; the per-user ledger enforces each user's budget.
"""
from __future__ import annotations

from fedkl.algorithms.fkt_common import ConvexSetting, convex_setting
from fedkl.algorithms.fkt_phased import FKTPhasedERM, LocalizationConfig, PhasedSGD, SCLocalization
from fedkl.algorithms.fkt_reduction import SCReduction, SCReductionConfig
from fedkl.algorithms.fkt_snowball import SnowballConfig, SnowballSGD
from fedkl.privacy.ledger import BudgetExceeded
from fedkl.privacy.zcdp import rho_for_eps_delta

# name: (default, --help sentence, "theorem" or "heuristic")
HYPERPARAMETERS = {
    "radius": (None, "paper-003 algorithms: the domain K = {||w|| <= RADIUS} (needed where the loss is Lipschitz "
                     "only on a bounded domain, e.g. least squares or --reg > 0); iterates are projected onto K",
               "theorem"),
    "distance": (None, "paper-003 algorithms: a public bound D >= ||w0 - w*|| that sets the step sizes "
                       "(default RADIUS + ||w0||)", "theorem"),
    "strong_convexity": (None, "paper-003 strongly convex variants: lam (default: the problem's, = --reg); used "
                               "only in step sizes and averaging weights, never in a sensitivity", "theorem"),
    "fkt_schedule": ("jnn", "fkt-snowball step sizes: jnn (Thm 3.6, no log factor) or constant (Thm 3.5)", "theorem"),
    "fkt_solver": (None, "phase solver: psgd (fkt-phased-sgd, fkt-sc-localization), gd or subgradient "
                         "(fkt-phased-erm), or one-shot (any phased algorithm: clients see only private outputs)",
                   "theorem (one-shot: heuristic utility, private for any loss)"),
    "fkt_batch": (1, "users per SGD step in the psgd phase solver (1 = the paper; b > 1 divides the "
                     "sensitivity by b but is not analysed)", "heuristic for b > 1"),
    "fkt_min_cohort": (1, "the smallest phase cohort; later phases are dropped", "heuristic"),
    "fkt_erm_tol": (1.0, "fkt-phased-erm solver accuracy r_i = TOL * L * eta_i (1 = the paper's Delta_i); smaller "
                         "values shrink the sensitivity 1 + 2 TOL (x L eta_i) at the cost of more solver rounds",
                    "theorem at 1"),
    "fkt_max_solver_rounds": (100_000, "refuse fkt-phased-erm plans needing more solver rounds than this",
                              "safety limit"),
    "fkt_sc_c": (2.0, "fkt-sc-localization: c >= 2 of Thm 5.3 (eta = 4 c k ln n/(lam n))", "theorem"),
    "fkt_inner": ("phased-sgd", "fkt-sc-reduction inner algorithm: phased-sgd or phased-erm", "theorem"),
    "fkt_reduction_c": (20.0, "fkt-sc-reduction: the inner algorithm's constant c in c L D (1/sqrt n + sqrt d/(rho_p n)) "
                              "that sets the next run's distance bound (20: Thm 4.4's proof with the exact noise)",
                        "theorem-derived constant"),
}


def _get(cfg, name: str):
    return getattr(cfg, name, HYPERPARAMETERS[name][0])


def _setting(cfg, problem, dataset) -> ConvexSetting:
    return convex_setting(problem, dataset.feature_bound, radius=_get(cfg, "radius"), distance=_get(cfg, "distance"),
                          strong_convexity=_get(cfg, "strong_convexity"))


def _localization(cfg) -> LocalizationConfig:
    return LocalizationConfig(solver=_get(cfg, "fkt_solver"), neighbouring=cfg.neighbouring, seed=cfg.seed,
                              batch=_get(cfg, "fkt_batch"), min_cohort=_get(cfg, "fkt_min_cohort"),
                              erm_tol=_get(cfg, "fkt_erm_tol"), max_solver_rounds=_get(cfg, "fkt_max_solver_rounds"),
                              sc_c=_get(cfg, "fkt_sc_c"))


def _snowball(variant: str | None):
    def build(cfg, rho_total: float, *, problem, dataset, delta, ledger, user_ids, **_) -> SnowballSGD:
        # the per-batch charges are (eps, delta) (see fkt_snowball): convert at what the users can afford
        eps_left, delta_left = ledger.approx_left(user_ids)
        if eps_left <= 0:
            raise BudgetExceeded(f"ledger {ledger.path}: the users' budget is spent; nothing to train with")
        rho = min(rho_total, rho_for_eps_delta(eps_left, delta_left, ledger.budget.conversion))
        schedule = variant or _get(cfg, "fkt_schedule")
        if variant is None and schedule == "strongly-convex":
            raise ValueError("fkt-snowball: the strongly convex schedule (Thm 5.4) is the algorithm fkt-snowball-sc")
        config = SnowballConfig(variant=schedule, neighbouring=cfg.neighbouring, seed=cfg.seed)
        return SnowballSGD(config, _setting(cfg, problem, dataset), rho, delta=delta_left,
                           conversion=ledger.budget.conversion)
    return build


build_snowball = _snowball(None)
build_snowball_sc = _snowball("strongly-convex")


def build_phased_sgd(cfg, rho_total: float, *, problem, dataset, delta, ledger, user_ids, **_) -> PhasedSGD:
    return PhasedSGD(_localization(cfg), _setting(cfg, problem, dataset), rho_total)


def build_fkt_phased_erm(cfg, rho_total: float, *, problem, dataset, delta, ledger, user_ids, **_) -> FKTPhasedERM:
    return FKTPhasedERM(_localization(cfg), _setting(cfg, problem, dataset), rho_total)


def build_sc_localization(cfg, rho_total: float, *, problem, dataset, delta, ledger, user_ids,
                          **_) -> SCLocalization:
    return SCLocalization(_localization(cfg), _setting(cfg, problem, dataset), rho_total)


def build_sc_reduction(cfg, rho_total: float, *, problem, dataset, delta, ledger, user_ids, **_) -> SCReduction:
    config = SCReductionConfig(inner=_get(cfg, "fkt_inner"), c=_get(cfg, "fkt_reduction_c"),
                               localization=_localization(cfg))
    return SCReduction(config, _setting(cfg, problem, dataset), rho_total)


FKT_BUILDERS = {
    "fkt-snowball": build_snowball,
    "fkt-snowball-sc": build_snowball_sc,
    "fkt-phased-sgd": build_phased_sgd,
    "fkt-phased-erm": build_fkt_phased_erm,
    "fkt-sc-reduction": build_sc_reduction,
    "fkt-sc-localization": build_sc_localization,
}

__all__ = ["FKT_BUILDERS", "FKTPhasedERM", "HYPERPARAMETERS", "LocalizationConfig", "PhasedSGD", "SCLocalization",
           "SCReduction", "SCReductionConfig", "SnowballConfig", "SnowballSGD", "build_fkt_phased_erm",
           "build_phased_sgd", "build_sc_localization", "build_sc_reduction", "build_snowball", "build_snowball_sc",
           "convex_setting"]
