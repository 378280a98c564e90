"""Empirical lower bounds on epsilon from an attack's guesses, valid at a stated one-sided confidence.

Three estimators, all pure statistics (no training here):

* :func:`two_sample_bound` — the many-run audit (Jagielski et al. 2020; Nasr et al. 2021): samples of
  a scalar statistic of the released model on two neighbouring datasets D0 and D1. A threshold test
  "guess D1 when the statistic is above t" has false-positive rate FPR = P0[s > t] and false-negative
  rate FNR = P1[s <= t]; an (eps, delta)-DP mechanism forces
  ``FPR + e^eps FNR >= 1 - delta`` and ``FNR + e^eps FPR >= 1 - delta``, so

      eps >= max( log((1 - delta - FNR) / FPR), log((1 - delta - FPR) / FNR) ).

  Both are decreasing in FPR and FNR: replacing them by one-sided Clopper-Pearson UPPER bounds (each at
  level ``alpha / 2``, a union bound) gives an eps lower bound that holds with probability at least
  ``1 - alpha``. The threshold (and the test's direction and where a ⊥ output goes) is CHOSEN on one
  half of the runs and the bound is COMPUTED on the other half, so the choice cannot inflate it.
* :func:`gdp_bound` — the same runs and split read through the Gaussian trade-off curve (Nasr et al.
  2023; Dong, Roth and Su 2022): a lower bound on mu (mu-GDP) for any mechanism, and on eps for a
  mechanism whose trade-off curve is Gaussian; it reaches a larger eps from the same runs.
* :func:`one_run_epsilon` — the one-run audit (Steinke, Nasr, Jagielski 2023, "Privacy auditing with
  one (1) training run", Theorem 5.2 and their Appendix code): m canaries each included with
  probability 1/2, r guesses of which v are correct; for an (eps, delta)-DP mechanism
  ``P[v correct or more] <= P[Binomial(r, e^eps/(1+e^eps)) >= v] + 2 m delta alpha_v``, with
  ``alpha_v = max_{1<=i<=v} P[v > Binomial(r, q) >= v - i] / i``. The reported eps is the largest at
  which that p-value is below ``alpha``: with probability >= 1 - alpha a correct mechanism's
  guesses give a value below its eps. The number of guesses is fixed before the run (k_plus, k_minus).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import scipy.optimize
import scipy.stats


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """One-sided Clopper-Pearson upper bound: P[p <= bound] >= 1 - alpha for k successes in n trials."""
    if not 0 <= k <= n or n <= 0:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")
    if k == n:
        return 1.0
    return float(scipy.stats.beta.ppf(1 - alpha, k + 1, n - k))


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """The eps that (eps, delta)-DP needs for a test with these error rates (0 when none is needed)."""
    best = 0.0
    for a, b in ((fpr, fnr), (fnr, fpr)):
        if 1 - delta - b > 0 and a < 1 - delta - b:
            best = max(best, math.inf if a <= 0 else math.log((1 - delta - b) / a))
    return best


@dataclass(frozen=True)
class ThresholdTest:
    """ "Guess D1 when the oriented statistic is above ``threshold``": ``sign`` orients the statistic
    (+1: large values point to D1), ``bottom`` is the value a ⊥ output takes (-inf or +inf)."""

    threshold: float
    sign: int
    bottom: float

    def says_d1(self, stats: np.ndarray) -> np.ndarray:
        s = np.where(np.isnan(stats), self.bottom, self.sign * stats)
        return s > self.threshold


def _cp_upper(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """:func:`clopper_pearson_upper` over an array of counts."""
    k = np.asarray(k)
    return np.where(k < n, scipy.stats.beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)), 1.0)


def _epsilon_score(delta: float) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """Per threshold, e^eps of :func:`epsilon_from_rates` of the error-rate bounds where eps > 0 (vectorized)."""

    def score(fpr: np.ndarray, fnr: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.nan_to_num(np.maximum((1 - delta - fnr) / fpr, (1 - delta - fpr) / fnr), nan=-np.inf)

    return score


def gdp_mu_from_rates(fpr, fnr):
    """The least mu for which mu-GDP allows a test with these error rates (0 when every mu does):
    mu-GDP means FNR >= Phi(Phi^-1(1 - FPR) - mu) for every test (Dong, Roth and Su 2022), i.e.
    ``mu >= Phi^-1(1 - FPR) + Phi^-1(1 - FNR)``; decreasing in both rates. Vectorized."""
    return np.maximum(scipy.stats.norm.isf(fpr) + scipy.stats.norm.isf(fnr), 0.0)


def _best_test(s0: np.ndarray, s1: np.ndarray, score, alpha: float) -> ThresholdTest:
    """The threshold test whose bound ``score(fpr_upper, fnr_upper)``, computed on THESE samples, is
    largest: every orientation, both places for ⊥ and every threshold between observed values."""
    best, best_eps = ThresholdTest(-math.inf, 1, -math.inf), -1.0
    for sign in (1, -1):
        for bottom in (-math.inf, math.inf):
            a0 = np.sort(np.where(np.isnan(s0), bottom, sign * s0))
            a1 = np.sort(np.where(np.isnan(s1), bottom, sign * s1))
            thresholds = np.concatenate([[-math.inf], np.unique(np.concatenate([a0, a1]))])
            fp = len(a0) - np.searchsorted(a0, thresholds, side="right")  # D0 runs above t
            fn = np.searchsorted(a1, thresholds, side="right")  # D1 runs at or below t
            fpr, fnr = _cp_upper(fp, len(a0), alpha / 2), _cp_upper(fn, len(a1), alpha / 2)
            values = score(fpr, fnr)
            i = int(np.argmax(values))
            if values[i] > best_eps:
                best, best_eps = ThresholdTest(float(thresholds[i]), sign, bottom), float(values[i])
    return best


def _split(s0, s1, confidence: float, seed: int) -> tuple[np.ndarray, ...]:
    """(selection D0, selection D1, evaluation D0, evaluation D1): a random half of each sample."""
    s0, s1 = np.asarray(s0, dtype=np.float64), np.asarray(s1, dtype=np.float64)
    if len(s0) < 4 or len(s1) < 4:
        raise ValueError(f"need at least 4 runs on each dataset, got {len(s0)} and {len(s1)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    p0, p1 = rng.permutation(len(s0)), rng.permutation(len(s1))
    return s0[p0[: len(s0) // 2]], s1[p1[: len(s1) // 2]], s0[p0[len(s0) // 2 :]], s1[p1[len(s1) // 2 :]]


def two_sample_bound(s0, s1, delta: float, confidence: float = 0.95, seed: int = 0) -> dict:
    """The many-run eps lower bound (module docstring) from statistics ``s0`` (runs on D0) and ``s1``
    (runs on D1); NaN marks a ⊥ output. A random half of each sample (``seed``) selects the test, the
    other half bounds its error rates. Returns the bound, the chosen test and its counts."""
    sel0, sel1, ev0, ev1 = _split(s0, s1, confidence, seed)
    alpha = 1 - confidence
    test = _best_test(sel0, sel1, _epsilon_score(delta), alpha)
    fp, fn = int(test.says_d1(ev0).sum()), int((~test.says_d1(ev1)).sum())
    fpr_up = clopper_pearson_upper(fp, len(ev0), alpha / 2)
    fnr_up = clopper_pearson_upper(fn, len(ev1), alpha / 2)
    return {
        "epsilon_lower_bound": epsilon_from_rates(fpr_up, fnr_up, delta),
        "confidence": confidence,
        "test": {"threshold": test.threshold, "sign": test.sign, "bottom_as": test.bottom},
        "evaluation": {
            "false_positives": fp,
            "runs_d0": len(ev0),
            "false_negatives": fn,
            "runs_d1": len(ev1),
            "fpr_upper": fpr_up,
            "fnr_upper": fnr_up,
        },
        "selection_runs": [len(sel0), len(sel1)],
    }


def gdp_bound(s0, s1, delta: float, confidence: float = 0.95, seed: int = 0) -> dict:
    """The Gaussian-DP (f-DP) reading of the many-run audit (Nasr et al. 2023, "Tight auditing of
    differentially private machine learning"; Dong, Roth and Su 2022): the same split as
    :func:`two_sample_bound` (the test chosen on one half, its error rates bounded by Clopper-Pearson
    at ``alpha / 2`` each on the other), read through the Gaussian trade-off curve:

    * ``mu_lower_bound``: with probability >= ``confidence``, the mechanism is NOT mu-GDP for any mu
      below it (:func:`gdp_mu_from_rates`). This holds for ANY mechanism.
    * ``epsilon_lower_bound``: :func:`gaussian_epsilon` of that mu at ``delta``. A lower bound on the
      eps at ``delta`` of a mechanism whose trade-off curve IS Gaussian (the Gaussian mechanism, and
      adaptive compositions of Gaussian releases such as full-batch noisy gradient descent, whose
      zCDP claim rho makes it sqrt(2 rho)-GDP): for those, a value above the claimed eps refutes the
      claim. For other mechanisms (subsampling, ⊥ tests, thresholds) it is a statement about mu only.

    One curve fitted to BOTH error rates at a moderate threshold, rather than one tiny false-positive
    rate, is why it certifies a larger eps from the same runs (tests/audit/test_audit_bounds.py): 50
    error-free evaluation runs a side allow mu up to 2.9 (eps 9.8 at delta = 1/41^1.1), the threshold
    bound eps up to 2.6."""
    sel0, sel1, ev0, ev1 = _split(s0, s1, confidence, seed)
    alpha = 1 - confidence
    test = _best_test(sel0, sel1, gdp_mu_from_rates, alpha)
    fp, fn = int(test.says_d1(ev0).sum()), int((~test.says_d1(ev1)).sum())
    fpr_up = clopper_pearson_upper(fp, len(ev0), alpha / 2)
    fnr_up = clopper_pearson_upper(fn, len(ev1), alpha / 2)
    mu = float(gdp_mu_from_rates(fpr_up, fnr_up))
    most = float(gdp_mu_from_rates(*(clopper_pearson_upper(0, n, alpha / 2) for n in (len(ev0), len(ev1)))))
    return {
        "mu_lower_bound": mu,
        "epsilon_lower_bound": gaussian_epsilon(mu, delta),
        "largest_attainable_mu": most,
        "largest_attainable_bound": gaussian_epsilon(most, delta),
        "confidence": confidence,
        "test": {"threshold": test.threshold, "sign": test.sign, "bottom_as": test.bottom},
        "evaluation": {"false_positives": fp, "runs_d0": len(ev0), "false_negatives": fn, "runs_d1": len(ev1)},
    }


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[>= v correct of r guesses] for an (eps, delta)-DP mechanism on m canaries (Steinke et al. 2023,
    Theorem 5.2)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    q = 1.0 / (1.0 + math.exp(-eps))
    beta = float(scipy.stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(beta, 1.0)
    i = np.arange(1, v + 1)
    window = scipy.stats.binom.sf(v - i - 1, r, q) - beta  # P[v > Binomial(r, q) >= v - i]
    alpha = float(np.max(window / i))
    return min(beta + alpha * delta * 2 * m, 1.0)


def one_run_epsilon(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest eps whose null hypothesis "(eps, delta)-DP" the guesses reject at level
    ``1 - confidence`` (0 when even eps = 0 is not rejected)."""
    p = 1 - confidence
    if r == 0 or one_run_p_value(m, r, v, 0.0, delta) >= p:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) < p:
        lo, hi = hi, 2 * hi
        if hi > 1e3:
            return math.inf
    for _ in range(50):  # bisection: p-value(lo) < p <= p-value(hi)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if one_run_p_value(m, r, v, mid, delta) < p else (lo, mid)
    return lo


def one_run_guesses(scores, included, k_plus: int, k_minus: int) -> tuple[int, int]:
    """(guesses, correct): guess "included" for the ``k_plus`` highest scores and "excluded" for the
    ``k_minus`` lowest (ties broken by index), abstain on the rest."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    if k_plus + k_minus > len(scores):
        raise ValueError(f"k_plus + k_minus = {k_plus + k_minus} exceeds the {len(scores)} canaries")
    order = np.argsort(-np.nan_to_num(scores, nan=-np.inf), kind="stable")
    top, bottom = order[:k_plus], order[len(order) - k_minus :] if k_minus else order[:0]
    return k_plus + k_minus, int(included[top].sum() + (~included[bottom]).sum())


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact eps at ``delta`` of the Gaussian mechanism whose shift over its noise is ``mu``
    (mu-GDP; Balle and Wang 2018): ``delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``."""
    if math.isnan(mu):
        raise ValueError("mu is NaN")
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return math.inf

    def excess(eps: float) -> float:
        return (
            float(
                scipy.stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps + scipy.stats.norm.logcdf(-eps / mu - mu / 2))
            )
            - delta
        )

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
        if hi > 1e4:
            return math.inf
    return float(scipy.optimize.brentq(excess, 0.0, hi))
