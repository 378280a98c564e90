"""The noise of a deletion-stability release from the exact privacy profile of the WHOLE release.

Paper 002's Algorithm 1 (:mod:`fedkl.algorithms.output_perturbation.del_output_pert`) splits (eps, delta) between its two
steps: the noisy deletion budget ``R1 ~ TDLap(eps/2, delta_bar)`` and the Gaussian at (eps/2,
delta_bar), delta_bar = delta/(e^{eps/2} + 2). This module calibrates the same mechanism from its
exact output law instead: no split, so sigma/Delta is about half of the "tight" calibration's.

The mechanism on a dataset x with score d(x) (the fewest deletions to a stable set, or the matching
number nu(x)) and chosen value v(x) = f(x_{-S(x)}) outputs ⊥ with probability Pr[R1 < d(x)] and
else v(x) + N(0, sigma^2 I) (d(x) > 2 kappa: always ⊥; write d = 2 kappa + 1 for it).

Theorem. Let R1 ~ TDLap(eps_r, delta_r) with kappa = 1 + ceil(ln(1/delta_r)/eps_r), ``c`` = 1 for
the exact score (depth 4 kappa) and 2 for the matching score (depth 8 kappa), and

    H(d, d') = HS_eps(P_{d, gap} || P_{d', 0}),  P_{d, .} = Pr[R1 < d] ⊥ + Pr[R1 >= d] N(., sigma^2 I),
    gap(d, d') = (c d + c d' + 2) Delta if c (d + d') <= depth, else infinity,

where HS_eps(P || Q) = sup_E P(E) - e^eps Q(E). If max over d in {0, ..., 2 kappa + 1} and
d' in {d - 1, d, d + 1} (in range) of H(d, d') is <= delta, the mechanism is (eps, delta)-DP, user
level, replace-one, for every test whose score moves by at most 1 between neighbours and whose
stable sets bound every deletion step within the depth by Delta (the exact test and the diameter
tests of :mod:`fedkl.algorithms.output_perturbation.diameter_output_pert` are).

Proof. Let x, x' be neighbours (user i replaced), d = d(x), d' = d(x'); |d - d'| <= 1 (the score's
sensitivity). The output laws are P_{d, v(x)} and P_{d', v(x')}, so HS_eps(M(x) || M(x')) is the
hockey-stick divergence of two "atom + Gaussian" laws whose Gaussian means are
D = ||v(x) - v(x')|| apart; it is non-decreasing in D (Gaussian shifts are ordered: N(0, s) vs N(D, s)
is a garbling of N(0, s) vs N(D', s) for D <= D'). Bound D: with U = S ∪ S' ∪ {i}, x_{-U} = x'_{-U}.
From x_{-S} it is reached by |U \\ S| <= (number of users of S') + 1 single deletions, each from
a set inside the test's depth (for the exact score: after |S| = d deletions, the test bounds every
further step up to depth 4 kappa, and d + (d' + 1) <= 4 kappa + 1 steps in all when d + d' <= 4 kappa;
for the matching score every step starts from a set of >= n - |U| + 1 >= n - 8 kappa users inside
a kept set when |U| <= 2 nu + 2 nu' + 1 <= 8 kappa + 1), so each moves f by <= Delta; likewise from
x'_{-S'}. Hence D <= (|S| + |S'| + 2) Delta <= gap(d, d'); outside the depth no bound is claimed
(gap = infinity: the Gaussian parts are then counted as fully distinguishable). Both directions
are covered because the pair set is symmetric. ∎

:func:`calibrate` searches a public grid of (eps_r, delta_r) for the smallest sigma/Delta meeting
the theorem, by bisection on sigma (H decreases in sigma), and returns it with kappa.

Budget-split rule. Every split (eps_r, delta_r) that meets the theorem gives (eps, delta) for the
whole release (it is the theorem's hypothesis, not a composition of two budgets), so the split is
free to be chosen for utility: the rule is "the grid split of least sigma/Delta". Every error bound
of the algorithms built on this release grows with sigma at fixed Delta (the single release's error
is sigma sqrt(d); the phased algorithms' noise constant is c = (sigma/Delta) f_i, phased_common), so
this is the split that minimises the final error bound on the grid, ties and all (a larger kappa
only deepens the test, which the noise already pays for). At the chosen sigma the worst case equals
delta to the bisection's tolerance: the whole budget is spent, nothing more
(tests/algorithms/test_output_pert.py::test_profile_split_is_the_grid_split_of_least_noise_and_spends_the_whole_budget).
The split between Phased-ERM's phases minimises its error bound too (fedkl/algorithms/output_perturbation/phased_erm.py,
"The split between phases"), and the AboveThreshold share of a privately chosen Delta minimises the
expected noise (fedkl/algorithms/output_perturbation/delta_share.py; eps_sel + eps_release = eps, basic composition). Everything is
a function of (eps, delta, score) only: public. The audits in tests/algorithms/test_output_pert.py and
tests/algorithms/test_diameter_output_pert.py compute the released law on real neighbouring datasets and check
HS <= delta in both directions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from fedkl.privacy.mechanisms import TruncatedDiscreteLaplace

EPS_FRACTIONS = tuple(np.round(np.arange(0.30, 0.701, 0.025), 3))  # eps_r / eps
DELTA_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # delta_r / delta


def chain_factor(score: str) -> int:
    return 2 if score == "matching" else 1


@functools.lru_cache(maxsize=4096)  # a calibration visits ~100 kappas
def _pairs(kappa: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d, d', gap/Delta) of every reachable score pair (gap inf outside the depth), d ascending and
    d' in (d - 1, d, d + 1) within {0, ..., 2 kappa + 1}. Cached: read-only arrays."""
    depth = 4 * c * kappa
    top = 2 * kappa + 1
    a = np.repeat(np.arange(top + 1), 3)
    b = a + np.tile(np.array([-1, 0, 1]), top + 1)
    keep = (b >= 0) & (b <= top)
    d, dp = a[keep], b[keep]
    gap = np.where(c * (d + dp) <= depth, c * d + c * dp + 2.0, np.inf)
    for arr in (d, dp, gap):
        arr.flags.writeable = False
    return d, dp, gap


class _Profile:
    """The sigma-independent parts of :func:`worst_case_divergence` at (eps, R1's law, score), so that
    the search evaluates H at many sigma without recomputing them; :meth:`at` is the same arithmetic,
    operation for operation, as one call of worst_case_divergence (bit-identical values)."""

    def __init__(self, eps: float, deletion_budget: TruncatedDiscreteLaplace, score: str) -> None:
        k = deletion_budget.kappa
        pmf = deletion_budget.pmf()
        tail = np.r_[np.cumsum(pmf[::-1])[::-1], 0.0]  # Pr[R1 >= d], d = 0 .. 2 kappa + 1
        d, dp, gap = _pairs(k, chain_factor(score))
        a, b = tail[d], tail[dp]
        atom = np.maximum(0.0, (1 - a) - math.exp(eps) * (1 - b))
        finite = np.isfinite(gap) & (a > 0) & (b > 0)
        self.gap, self.a, self.eb, self.atom = gap[finite], a[finite], math.exp(eps) * b[finite], atom[finite]
        self.e2 = eps + np.log(b[finite] / a[finite])
        # unbounded gap, or nothing released on the other side: gauss = a, whatever sigma
        rest = atom[~finite] + np.maximum(a[~finite], 0.0)
        self.rest = float(np.max(rest)) if rest.size else -math.inf

    def at(self, sigma_over_Delta: float) -> float:
        from scipy.special import ndtr  # stats.norm.cdf's kernel; here, not at import (`fedkl --help`)

        x = self.gap / sigma_over_Delta
        gauss = self.a * ndtr(x / 2 - self.e2 / x) - self.eb * ndtr(-x / 2 - self.e2 / x)
        bounded = float(np.max(self.atom + np.maximum(gauss, 0.0))) if x.size else -math.inf
        return max(bounded, self.rest)


def worst_case_divergence(
    eps: float, sigma_over_Delta: float, deletion_budget: TruncatedDiscreteLaplace, score: str = "exact"
) -> float:
    """max over reachable (d, d') of H(d, d') (module docstring) at ``sigma = sigma_over_Delta Delta``."""
    return _Profile(eps, deletion_budget, score).at(sigma_over_Delta)


@dataclass(frozen=True)
class ProfileCalibration:
    eps_r: float  # TDLap's eps
    delta_r: float  # TDLap's delta
    sigma_over_Delta: float
    kappa: int

    @property
    def deletion_budget(self) -> TruncatedDiscreteLaplace:
        return TruncatedDiscreteLaplace(self.eps_r, self.delta_r)


def _smallest_ratio(
    eps: float, delta: float, budget: TruncatedDiscreteLaplace, score: str, below: float = math.inf
) -> float:
    """The bisection's smallest sigma/Delta meeting delta at R1 ~ ``budget`` (inf where the ⊥ atom alone
    breaks delta). ``below``: the caller only wants a ratio <= below; where H(below) > delta, every ratio
    meeting delta is > below (H decreases in sigma) and inf is returned after that one evaluation."""
    h = _Profile(eps, budget, score).at
    if below < 1e12 and h(below) > delta:  # cannot reach ``below``: skip the bisection
        return math.inf
    if h(1e12) > delta:  # the ⊥ atom alone breaks delta
        return math.inf
    lo, hi = 1e-6, 1e12
    while hi / lo > 1 + 1e-9:
        mid = math.sqrt(lo * hi)
        if h(mid) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


# the grid point searched first (the usual winner): a good bound early lets _smallest_ratio skip most points
_FIRST = (EPS_FRACTIONS.index(0.5), DELTA_FRACTIONS.index(0.9))


@functools.lru_cache(maxsize=1024)
def calibrate(eps: float, delta: float, score: str = "exact") -> ProfileCalibration:
    """The smallest sigma/Delta over the public grid of (eps_r, delta_r) that meets the theorem; among equal
    ratios the first grid point in (EPS_FRACTIONS, DELTA_FRACTIONS) order. The search starts at ``_FIRST``
    and bisects a grid point only if it can match the best so far (one evaluation of H at the best ratio
    decides: H decreases in sigma), so it returns what bisecting every grid point in order returns
    (tests/algorithms/test_phase_split.py), about 10x faster. Public: (eps, delta, score) only."""
    if not (eps > 0 and math.isfinite(eps)) or not 0 < delta < 1:
        raise ValueError(f"need eps > 0 and 0 < delta < 1, got eps={eps}, delta={delta}")
    grid = [(i, j) for i in range(len(EPS_FRACTIONS)) for j in range(len(DELTA_FRACTIONS))]
    grid.remove(_FIRST)
    best, best_at = None, None
    for i, j in [_FIRST, *grid]:
        budget = TruncatedDiscreteLaplace(float(EPS_FRACTIONS[i]) * eps, DELTA_FRACTIONS[j] * delta)
        ratio = _smallest_ratio(eps, delta, budget, score, math.inf if best is None else best.sigma_over_Delta)
        if best is None or ratio < best.sigma_over_Delta or (ratio == best.sigma_over_Delta and (i, j) < best_at):
            best, best_at = ProfileCalibration(budget.eps, budget.delta, ratio, budget.kappa), (i, j)
    if not math.isfinite(best.sigma_over_Delta):
        raise ValueError(f"no calibration on the grid meets (eps={eps}, delta={delta})")
    return best


__all__ = [
    "DELTA_FRACTIONS",
    "EPS_FRACTIONS",
    "ProfileCalibration",
    "calibrate",
    "chain_factor",
    "worst_case_divergence",
]
