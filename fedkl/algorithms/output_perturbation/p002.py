"""Paper 002 (Ghazi et al., "On User-Level Private Convex Optimization") phased algorithms in fedkl:
names, builders, hyperparameters.

| name | paper | problem class | guarantee (user level, replace-one, n public) | ledger per user | rate |
|---|---|---|---|---|---|
| ``phased-erm`` | Alg 3, Thm 4.1 | convex, G-Lipschitz | (eps, delta)-DP, basic composition | T releases (eps_i, delta_i) summing to (eps, delta) (the bound-minimising split; equal: eps/T), T = ceil(ln nm) | O~(R G sqrt(d)/(n sqrt m)) empirical |
| ``phased-sco`` | Alg 4, Thm 5.1 | convex, G-Lipschitz | (eps, delta)-DP, parallel composition over hashed cohorts | (eps, delta) once, own cohort only | O~(R G (sqrt(d)/(n sqrt m) + 1/sqrt(nm))) population |
| ``sc-phased-erm`` | Alg 5, Thm 4.3 | mu-strongly convex, G-Lipschitz | (eps, delta)-DP | (eps/2, delta/2) + Phased-ERM's split of (eps/2, delta/2) | O~(G^2 d/(mu n^2 m)) empirical |
| ``sc-phased-sco`` | Alg 6, Thm 5.3 | mu-strongly convex, G-Lipschitz | (eps, delta)-DP | (eps/2, delta/2) + (eps/2, delta/2) if in a cohort | O~((G^2/mu)(d/(n^2 m) + 1/(nm))) population |

Every algorithm here is registered (:mod:`fedkl.algorithms.registry`) with its Params:
:class:`PhasedParams` for the phased four (``radius``/``distance`` shared with paper 003, the
``p002_*`` fields, ``stability_delta`` only with ``p002_delta_rule = "fixed"``); the single release
``sc-output-pert`` is :mod:`fedkl.algorithms.output_perturbation.sc_output_pert` (its Params derive from
:class:`P002Release`, here); ``seed`` (Phased-SCO's cohort hash) comes from
the run. Each takes its (eps, delta) from the budget the users can still afford (the whole budget on
a fresh ledger). All make (eps, delta) releases (their classes declare ``Guarantee("approx-dp",
...)``), so the runner gives them a Releaser WITHOUT the zCDP filter; they refuse a filtered
Releaser before reading data.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedkl.algorithms.output_perturbation.phased_common import (
    DELTA_RULES,
    DELTA_SELECTIONS,
    INNER_TESTS,
    PHASE_SPLITS,
    setting_from_run_config,
)
from fedkl.algorithms.output_perturbation.phased_erm import PhasedConfig, PhasedERM
from fedkl.algorithms.output_perturbation.phased_sco import PhasedSCO
from fedkl.algorithms.output_perturbation.sc_phased import SCPhasedERM, SCPhasedSCO
from fedkl.algorithms.registry import BuildContext, Domain, StabilityDelta, param, register
from fedkl.privacy.guarantee import SOLVER_ITERATES, Absence


@dataclass(frozen=True)
class P002Release(StabilityDelta):
    """How every paper-002 release tests and calibrates (single and phased alike)."""

    p002_test: str = param(
        "auto",
        "paper-002 algorithms: the deletion test of every release: exact (the paper's: certificate, else "
        "enumeration; n <= 20), vertex-cover or matching (the same minimizer through the local-minimizer "
        "diameter test, polynomial time; fedkl's derivation), or auto (exact up to 20 users, else the "
        "diameter test)",
        "theorem",
        choices=INNER_TESTS,
    )
    p002_calibration: str = param(
        "profile",
        "paper-002 algorithms: noise of every release: profile (R1's law and sigma from the exact privacy "
        "profile of the whole release, no split of (eps, delta): fedkl/algorithms/output_perturbation/stability_profile.py), "
        "tight (the paper's split, sensitivity (4 kappa + 1) Delta by the chain recount, the analytic "
        "Gaussian) or paper (8 kappa Delta and the classic sigma, as printed: for reproducing the paper); "
        "exact audits of all three in tests/algorithms/test_output_pert.py and tests/algorithms/test_diameter_output_pert.py",
        "theorem",
        choices=("profile", "tight", "paper"),
    )
    p002_delta_select: str = param(
        "fixed",
        "paper-002 algorithms: Delta of every release = its threshold (fixed: STABILITY_DELTA for sc-output-pert, "
        "the rule's Delta_i in each phase), or chosen by the sparse vector technique from the public grid "
        "Delta / 2^k, k = 11..0 (sparse-vector: the smallest Delta whose deletion score is at most about "
        "kappa/2; costs P002_SELECT_FRACTION of each release's eps; the diameter test)",
        "heuristic",
        choices=DELTA_SELECTIONS,
    )
    p002_select_fraction: float | None = param(
        None,
        "paper-002 algorithms with --p002-delta-select sparse-vector: the share of each release's eps spent "
        "choosing its Delta (default: the share of least predicted noise, fedkl/algorithms/output_perturbation/delta_share.py, "
        "among those whose release runs at the public n; 0.25 reproduces the earlier fixed share)",
        "heuristic",
        positive=True,
    )


@dataclass(frozen=True)
class PhasedParams(Domain, P002Release):
    p002_records: int = param(
        1,
        "paper-002 phased algorithms: m, the PUBLIC number of records per user in the thresholds "
        "Delta ~ 1/(n sqrt m) and in T = ceil(ln(nm)) (1 claims no sqrt(m) gain; any public value is private)",
        "theorem",
    )
    p002_phases: int | None = param(
        None,
        "paper-002 phased algorithms: T (default ceil(ln(n m)) for Phased-ERM, floor(log2(n/N0)) for Phased-SCO)",
        "theorem",
    )
    p002_lam: float | None = param(
        None,
        "paper-002 phased algorithms: base regularization lam, lam_i = lam 4^i (default: lambda* of the "
        "re-derived bound, note pitfalls 6/7)",
        "theorem",
    )
    p002_delta_rule: str = param(
        "uc",
        "paper-002 phased algorithms: the per-call deletion threshold: uc (Delta_uc, Cor 3.7 with its union "
        "bound), scaled (P002_DELTA_SCALE G_i/(mu_i n_i sqrt m)) or fixed (STABILITY_DELTA / 4^(i-1); "
        "phased-erm/phased-sco only)",
        "theorem (uc) / heuristic (scaled, fixed)",
        choices=DELTA_RULES,
    )
    p002_delta_scale: float = param(1.0, "paper-002 phased algorithms: A of the scaled threshold rule", "heuristic")
    p002_beta: float | None = param(
        None,
        "paper-002 phased algorithms: utility failure probability beta inside Delta_uc (default 1/(nm); "
        "1/(2 n^2 m) for the strongly convex variants)",
        "theorem",
    )
    p002_phase_split: str = param(
        "auto",
        "phased-erm / sc-phased-erm: the split of (eps, delta) between the T phases: optimal (eps_i, delta_i ~ "
        "4^(-i a), a = 1/(2p+1) from the noise's slope p, the split that minimises the error bound; "
        "fedkl/algorithms/output_perturbation/phased_erm.py), equal ((eps/T, delta/T), the paper's) or auto (optimal, but equal "
        "with --p002-calibration paper)",
        "theorem",
        choices=PHASE_SPLITS,
    )
    p002_min_cohort: int | None = param(
        None, "phased-sco / sc-phased-sco: N0, the smallest cohort (default 8 kappa(eps, delta))", "theorem"
    )


# the above-threshold selection of Delta counts users (a failed user is replaced by the public centre, far
# from no one: a sensitivity-1 count); the deletion-stability releases are a PTR theorem, not a sensitivity bound
P002_ABSENCE = (
    Absence(
        "replaced",
        "the sparse-vector Delta selection's queries are counts over the users' local vectors, a failed user's "
        "vector replaced by the public centre",
        releases="*/select-Delta",
    ),
    Absence(
        "replaced",
        "the deletion-stability release: a failed user's local vector is to be replaced by the public centre (the "
        "mean family does; the diameter tests still abort the run before any charge when a user fails: issue 28 "
        "§2); its (eps, delta) is the stability theorem's, not a sensitivity bound",
        measure="not-sensitivity",
    ),
)


def phased_config(params: PhasedParams, eps: float, delta: float, seed: int) -> PhasedConfig:
    """The algorithms' :class:`PhasedConfig` from their Params, the budget and the run's seed."""
    rule = params.p002_delta_rule
    return PhasedConfig(
        eps=eps,
        delta=delta,
        lam=params.p002_lam,
        Delta_1=float(params.stability_delta) if rule == "fixed" else None,
        phases=params.p002_phases,
        calibration=params.p002_calibration,
        delta_rule=rule,
        delta_scale=float(params.p002_delta_scale),
        records=int(params.p002_records),
        beta=params.p002_beta,
        min_cohort=params.p002_min_cohort,
        seed=int(seed),
        test=params.p002_test,
        delta_select=params.p002_delta_select,
        select_fraction=params.p002_select_fraction,
        phase_split=params.p002_phase_split,
    )


def _phased(cls):
    def build(params: PhasedParams, ctx: BuildContext):
        eps, dlt = ctx.approx_budget()
        setting = setting_from_run_config(ctx.problem, ctx.feature_bound, params.radius, params.distance)
        return cls(phased_config(params, eps, dlt, ctx.seed), ctx.problem, ctx.feature_bound, setting=setting)

    build.__name__ = f"build_{cls.name.replace('-', '_')}"
    build.__doc__ = (cls.__doc__ or cls.name).strip().splitlines()[0]
    return register(cls.name, PhasedParams, SOLVER_ITERATES, absence=P002_ABSENCE)(build)


build_phased_erm = _phased(PhasedERM)
build_phased_sco = _phased(PhasedSCO)
build_sc_phased_erm = _phased(SCPhasedERM)
build_sc_phased_sco = _phased(SCPhasedSCO)


__all__ = [
    "P002Release",
    "PhasedConfig",
    "PhasedERM",
    "PhasedParams",
    "PhasedSCO",
    "SCPhasedERM",
    "SCPhasedSCO",
    "build_phased_erm",
    "build_phased_sco",
    "build_sc_phased_erm",
    "build_sc_phased_sco",
    "phased_config",
]
