"""Paper 002 (Ghazi et al., "On User-Level Private Convex Optimization") phased algorithms in fedkl:
names, builders, hyperparameters.

| name | paper | problem class | guarantee (user level, replace-one, n public) | ledger per user | rate |
|---|---|---|---|---|---|
| ``phased-erm`` | Alg 3, Thm 4.1 | convex, G-Lipschitz | (eps, delta)-DP, basic composition | T releases (eps_i, delta_i) summing to (eps, delta) (the bound-minimising split; equal: eps/T), T = ceil(ln nm) | O~(R G sqrt(d)/(n sqrt m)) empirical |
| ``phased-sco`` | Alg 4, Thm 5.1 | convex, G-Lipschitz | (eps, delta)-DP, parallel composition over hashed cohorts | (eps, delta) once, own cohort only | O~(R G (sqrt(d)/(n sqrt m) + 1/sqrt(nm))) population |
| ``sc-phased-erm`` | Alg 5, Thm 4.3 | mu-strongly convex, G-Lipschitz | (eps, delta)-DP | (eps/2, delta/2) + Phased-ERM's split of (eps/2, delta/2) | O~(G^2 d/(mu n^2 m)) empirical |
| ``sc-phased-sco`` | Alg 6, Thm 5.3 | mu-strongly convex, G-Lipschitz | (eps, delta)-DP | (eps/2, delta/2) + (eps/2, delta/2) if in a cohort | O~((G^2/mu)(d/(n^2 m) + 1/(nm))) population |

The phased four are registered classes (:mod:`fedkl.algorithms.output_perturbation.phased_erm`,
``phased_sco``, ``sc_phased``) whose Params are
:class:`~fedkl.algorithms.output_perturbation.phased_erm.PhasedParams` (:class:`P002Release` below, the
``p002_*`` phase fields, ``radius``/``distance`` shared with paper 003); the single release is registered
here with :class:`SCOutputPertParams`; ``seed`` (Phased-SCO's cohort hash) comes from the run. Each takes its (eps, delta) from the budget the users can still afford (the whole budget on
a fresh ledger). All make (eps, delta) releases (their classes declare ``Guarantee("approx-dp",
...)``), so the runner gives them a Releaser WITHOUT the zCDP filter; they refuse a filtered
Releaser before reading data.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedkl.algorithms.output_perturbation.diameter_output_pert import (
    DiameterSCOutputPert,
    DiameterTest,
    SelectedDeltaSCOutputPert,
)
from fedkl.algorithms.output_perturbation.phased_common import DELTA_SELECTIONS, INNER_TESTS, SCInnerRelease
from fedkl.algorithms.output_perturbation.sc_output_pert import SCOutputPert, SCOutputPertConfig
from fedkl.algorithms.registry import BuildContext, StabilityDelta, param, register
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
class SCOutputPertParams(P002Release):
    """sc-output-pert: Delta = ``stability_delta``, or chosen privately below it."""


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


@register("sc-output-pert", SCOutputPertParams, SOLVER_ITERATES, absence=P002_ABSENCE)
def build_sc_output_pert(
    params: SCOutputPertParams, ctx: BuildContext
) -> SCOutputPert | DiameterSCOutputPert | SelectedDeltaSCOutputPert:
    """One SCOutputPert release (Alg 2) with the deletion test ``--p002-test`` (auto: the paper's exact
    test up to 20 users, else the polynomial-time diameter test), Delta = ``--stability-delta``."""
    problem = ctx.problem
    if problem.reg <= 0:
        raise ValueError("sc-output-pert needs a strongly convex objective: give --reg > 0")
    eps, delta = ctx.approx_budget()  # what every user can still afford (all of it on a fresh ledger)
    config = SCOutputPertConfig.for_problem(
        problem,
        ctx.feature_bound,
        problem.init_params(),
        eps=eps,
        delta=delta,
        Delta=params.stability_delta,
        calibration=params.p002_calibration,
    )
    n = ctx.num_users
    if params.p002_delta_select == "sparse-vector":
        if params.p002_test == "exact":
            raise ValueError(
                "--p002-delta-select sparse-vector uses the diameter test: give --p002-test auto, "
                "vertex-cover or matching"
            )
        test = "auto" if params.p002_test == "auto" else params.p002_test
        alg = SelectedDeltaSCOutputPert(config, DiameterTest(test=test), params.p002_select_fraction, users=n)
        alg.check(n)  # public refusal at build time
        return alg
    chooser = SCInnerRelease(problem, ctx.feature_bound, calibration=params.p002_calibration, test=params.p002_test)
    kind = chooser.kind(n, config.eps, config.delta)
    chooser.check(n, config.eps, config.delta)  # public refusal at build time
    if kind == "exact":
        return SCOutputPert(config)
    return DiameterSCOutputPert(config, DiameterTest(test=kind))


__all__ = ["P002_ABSENCE", "P002Release", "SCOutputPertParams", "build_sc_output_pert"]
