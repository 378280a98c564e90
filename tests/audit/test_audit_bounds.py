"""The audit's statistics (fedkl/audit/bounds.py): Clopper-Pearson, the many-run bound and the one-run
bound of Steinke, Nasr and Jagielski 2023 are valid lower bounds at their stated confidence, and have
power where the truth is far above the claim."""

import math

import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from fedkl.audit.bounds import (
    clopper_pearson_upper,
    epsilon_from_rates,
    gdp_bound,
    gdp_mu_from_rates,
    one_run_epsilon,
    one_run_guesses,
    one_run_p_value,
    two_sample_bound,
)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact eps(delta) of the Gaussian mechanism with sensitivity/sigma = mu (Balle-Wang 2018)."""

    def delta_of(eps):
        return scipy.stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * scipy.stats.norm.cdf(-eps / mu - mu / 2)

    return float(scipy.optimize.brentq(lambda e: delta_of(e) - delta, 0.0, 100.0))


def test_clopper_pearson_upper_matches_the_closed_forms():
    # no success in n trials: the bound solves (1 - p)^n = alpha
    assert clopper_pearson_upper(0, 20, 0.05) == pytest.approx(1 - 0.05 ** (1 / 20), rel=1e-9)
    assert clopper_pearson_upper(20, 20, 0.05) == 1.0
    # defining property: P[Binomial(n, bound) <= k] = alpha
    for k, n in ((3, 50), (10, 40), (0, 7)):
        p = clopper_pearson_upper(k, n, 0.025)
        assert scipy.stats.binom.cdf(k, n, p) == pytest.approx(0.025, rel=1e-6)


def test_epsilon_from_rates_is_the_dp_inequality():
    assert epsilon_from_rates(0.1, 0.1, 0.0) == pytest.approx(math.log(9))
    assert epsilon_from_rates(0.1, 0.3, 0.05) == pytest.approx(math.log((1 - 0.05 - 0.3) / 0.1))
    assert epsilon_from_rates(0.5, 0.5, 0.0) == 0.0  # a coin flip needs no privacy loss
    assert epsilon_from_rates(0.0, 0.2, 0.0) == math.inf


@pytest.mark.statistical
def test_many_run_bound_is_valid_on_randomized_response():
    """200 audits of eps0-randomized response (exactly eps0-DP, eps0 = 0.5) with 1000 runs a side: the
    raw estimate sits at eps0, so a bound without its confidence correction (or choosing its test on
    the data it evaluates) would exceed eps0 about half the time. At 95% confidence at most 5% may;
    with 200 audits more than 19 has probability < 0.2% for a valid bound."""
    eps0 = 0.5
    p = math.exp(eps0) / (1 + math.exp(eps0))
    rng = np.random.default_rng(1)
    bounds = [
        two_sample_bound((rng.random(1000) > p).astype(float), (rng.random(1000) < p).astype(float), 0.0, 0.95, seed=i)[
            "epsilon_lower_bound"
        ]
        for i in range(200)
    ]
    assert sum(b > eps0 for b in bounds) <= 19
    assert np.median(bounds) > 0.5 * eps0  # and not vacuous


def test_many_run_bound_grows_with_the_gaussian_mechanisms_privacy_loss():
    rng = np.random.default_rng(1)
    medians = []
    for mu in (0.5, 1.5, 3.0):
        truth = gaussian_epsilon(mu, 1e-3)
        b = [
            two_sample_bound(rng.normal(size=100), mu + rng.normal(size=100), 1e-3, 0.95, seed=i)["epsilon_lower_bound"]
            for i in range(30)
        ]
        assert max(b) <= truth
        medians.append(np.median(b))
    assert medians[0] <= medians[1] < medians[2] and medians[2] > 1.5


def test_many_run_bound_has_power_and_flags_a_false_claim():
    rng = np.random.default_rng(0)
    s0, s1 = rng.normal(size=300), 6 + rng.normal(size=300)  # eps ~ 14 at delta 1e-5
    res = two_sample_bound(s0, s1, 1e-5, 0.95)
    assert res["epsilon_lower_bound"] > 3.0
    # the largest bound 150 error-free runs can give: the CP upper bound of 0/150 on both rates
    cap = epsilon_from_rates(*(2 * [clopper_pearson_upper(0, 150, 0.025)]), 1e-5)
    assert res["epsilon_lower_bound"] <= cap + 1e-12


def test_many_run_bound_handles_bottom_outputs():
    """⊥ (NaN) is an output like any other: a mechanism that says ⊥ on D0 and releases on D1 is caught."""
    s0 = np.full(60, np.nan)
    s1 = np.zeros(60)
    res = two_sample_bound(s0, s1, 0.0, 0.95)
    assert res["evaluation"]["false_positives"] == res["evaluation"]["false_negatives"] == 0
    assert res["epsilon_lower_bound"] > 1.5


def test_gdp_mu_from_rates_is_the_gaussian_trade_off_curve():
    """On the Gaussian pair N(0, 1) vs N(mu, 1) every threshold test's rates give back exactly mu; a coin
    flip gives 0; larger error rates give a smaller mu."""
    mu = 1.7
    for t in (-1.0, 0.3, 0.85, 2.5):
        fpr, fnr = scipy.stats.norm.sf(t), scipy.stats.norm.cdf(t - mu)
        assert gdp_mu_from_rates(fpr, fnr) == pytest.approx(mu, abs=1e-9)
    assert gdp_mu_from_rates(0.5, 0.5) == 0.0 and gdp_mu_from_rates(0.7, 0.6) == 0.0
    assert gdp_mu_from_rates(0.1, 0.2) > gdp_mu_from_rates(0.12, 0.2) > gdp_mu_from_rates(0.12, 0.25)


@pytest.mark.statistical
@pytest.mark.parametrize("true_eps", [1.0, 4.0])
def test_gdp_bound_on_the_gaussian_mechanism_is_valid_and_close(true_eps):
    """The Gaussian mechanism with eps(delta) = true_eps (delta = 1/41^1.1, the audit's), 1000 runs a side,
    20 audits: the Gaussian-DP bound never exceeds true_eps (nor its mu the true mu: 95% confidence
    each, so 20 audits all below has probability >= 0.95^20 only if it were exact; Clopper-Pearson and
    the split make it conservative), reaches 0.6 true_eps at eps = 4 in the median (0.3 at eps = 1), and beats
    the threshold bound on the same runs."""
    delta = 1 / 41**1.1
    mu = scipy.optimize.brentq(lambda m: gaussian_epsilon(m, delta) - true_eps, 0.3, 6.0)
    rng = np.random.default_rng(3)
    gdp, mus, thr = [], [], []
    for i in range(20):
        s0, s1 = rng.normal(size=1000), mu + rng.normal(size=1000)
        g = gdp_bound(s0, s1, delta, 0.95, seed=i)
        gdp.append(g["epsilon_lower_bound"])
        mus.append(g["mu_lower_bound"])
        thr.append(two_sample_bound(s0, s1, delta, 0.95, seed=i)["epsilon_lower_bound"])
    assert max(gdp) <= true_eps and max(mus) <= mu and max(thr) <= true_eps
    assert np.median(gdp) >= (0.6 if true_eps >= 4 else 0.3) * true_eps
    assert np.median(gdp) > np.median(thr)


def test_gdp_bound_flags_a_false_claim_and_reports_its_reach():
    rng = np.random.default_rng(0)
    delta = 1e-5
    res = gdp_bound(rng.normal(size=100), 4 + rng.normal(size=100), delta, 0.95)  # mu = 4: eps ~ 16.6
    assert 8.0 < res["epsilon_lower_bound"] <= res["largest_attainable_bound"] < gaussian_epsilon(4.0, delta)
    cap = float(gdp_mu_from_rates(*(2 * [clopper_pearson_upper(0, 50, 0.025)])))
    assert res["largest_attainable_mu"] == pytest.approx(cap) and res["mu_lower_bound"] <= cap
    same = gdp_bound(rng.normal(size=100), rng.normal(size=100), delta, 0.95)  # one dataset twice
    assert same["mu_lower_bound"] == 0.0 and same["epsilon_lower_bound"] == 0.0


def _reference_p_value(m, r, v, eps, delta):
    """Steinke, Nasr, Jagielski 2023, Appendix code, as printed (a loop)."""
    q = 1 / (1 + math.exp(-eps))
    beta = scipy.stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += scipy.stats.binom.pmf(v - i, r, q)
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1)


@pytest.mark.parametrize("m,r,v,eps,delta", [(1000, 100, 80, 1.0, 1e-5), (200, 40, 40, 2.0, 1e-3), (50, 10, 3, 0.5, 0)])
def test_one_run_p_value_is_the_papers(m, r, v, eps, delta):
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(_reference_p_value(m, r, v, eps, delta), rel=1e-9)


def test_one_run_epsilon_pure_dp_closed_form():
    """delta = 0 and every guess right: p-value q^r, so the bound is logit(alpha^(1/r))."""
    q = 0.05 ** (1 / 30)
    assert one_run_epsilon(100, 30, 30, 0.0, 0.95) == pytest.approx(math.log(q / (1 - q)), abs=1e-6)
    assert one_run_epsilon(100, 30, 15, 0.0, 0.95) == 0.0  # chance accuracy proves nothing
    # delta only weakens the bound
    assert one_run_epsilon(100, 30, 30, 1e-3, 0.95) < one_run_epsilon(100, 30, 30, 0.0, 0.95)


@pytest.mark.statistical
def test_one_run_bound_is_valid_on_randomized_response():
    """Each of 1000 canaries answered by eps0-randomized response (exactly eps0-DP per canary): at 95%
    confidence at most 5% of 200 audits may exceed eps0 (> 19 has probability < 0.2%)."""
    eps0, m, k = 1.0, 1000, 100
    rng = np.random.default_rng(3)
    over = 0
    for _ in range(200):
        included = rng.random(m) < 0.5
        truthful = rng.random(m) < math.exp(eps0) / (1 + math.exp(eps0))
        scores = np.where(truthful == included, 1.0, -1.0) + 1e-3 * rng.normal(size=m)
        r, v = one_run_guesses(scores, included, k, k)
        over += one_run_epsilon(m, r, v, 0.0, 0.95) > eps0
    assert over <= 19


def test_one_run_guesses_count_top_and_bottom():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = np.array([True, False, True, False, False, True])
    assert one_run_guesses(scores, included, 2, 2) == (4, 1 + 1)  # top: 5 in, 4 out; bottom: 1 out, 0 in
    with pytest.raises(ValueError):
        one_run_guesses(scores, included, 4, 3)
