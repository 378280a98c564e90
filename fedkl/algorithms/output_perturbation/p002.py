"""Paper 002 (Ghazi et al., "On User-Level Private Convex Optimization"): what its algorithms share.

| name | paper | problem class | guarantee (user level, replace-one, n public) | ledger per user | rate |
|---|---|---|---|---|---|
| ``phased-erm`` | Alg 3, Thm 4.1 | convex, G-Lipschitz | (eps, delta)-DP, basic composition | T releases (eps_i, delta_i) summing to (eps, delta) (the bound-minimising split; equal: eps/T), T = ceil(ln nm) | O~(R G sqrt(d)/(n sqrt m)) empirical |
| ``phased-sco`` | Alg 4, Thm 5.1 | convex, G-Lipschitz | (eps, delta)-DP, parallel composition over hashed cohorts | (eps, delta) once, own cohort only | O~(R G (sqrt(d)/(n sqrt m) + 1/sqrt(nm))) population |
| ``sc-phased-erm`` | Alg 5, Thm 4.3 | mu-strongly convex, G-Lipschitz | (eps, delta)-DP | (eps/2, delta/2) + Phased-ERM's split of (eps/2, delta/2) | O~(G^2 d/(mu n^2 m)) empirical |
| ``sc-phased-sco`` | Alg 6, Thm 5.3 | mu-strongly convex, G-Lipschitz | (eps, delta)-DP | (eps/2, delta/2) + (eps/2, delta/2) if in a cohort | O~((G^2/mu)(d/(n^2 m) + 1/(nm))) population |

The phased four are registered classes (:mod:`fedkl.algorithms.output_perturbation.phased_erm`,
``phased_sco``, ``sc_phased``) whose Params are
:class:`~fedkl.algorithms.output_perturbation.phased_erm.PhasedParams`; the single release ``sc-output-pert``
is :mod:`fedkl.algorithms.output_perturbation.sc_output_pert`. Their Params derive from :class:`P002Release`
(here): the deletion test, the calibration and the choice of Delta. ``seed`` (Phased-SCO's cohort hash) comes
from the run. Each takes its (eps, delta) from the budget the users can still afford (the whole budget on
a fresh ledger). All make (eps, delta) releases (their classes declare ``Guarantee("approx-dp",
...)``), so the runner gives them a Releaser WITHOUT the zCDP filter; they refuse a filtered
Releaser before reading data.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedkl.algorithms.output_perturbation.phased_common import DELTA_SELECTIONS, INNER_TESTS
from fedkl.algorithms.registry import StabilityDelta, param
from fedkl.privacy.guarantee import Absence


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


__all__ = ["P002_ABSENCE", "P002Release"]
