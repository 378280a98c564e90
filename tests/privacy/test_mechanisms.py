"""Noise sources and mechanisms: calibration, distributions and DP ratio bounds.

Statistical tests use fixed seeds (``NoiseSource(seed=...)``), so they are deterministic; every
tolerance is derived from the sample size (a k-standard-error bound, k = 6 unless stated), never a
hard-coded output. Where it matters we also show the tolerance is tight enough to catch a wrong
noise scale.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld
from scipy import stats

from fedkl.privacy import (
    ExponentialMechanism,
    GaussianMechanism,
    LaplaceMechanism,
    NoiseSource,
    ReportNoisyMax,
    TruncatedDiscreteLaplace,
)

K_SE = 6.0  # standard errors allowed in every moment check below


# --------------------------------------------------------------------------------------------------
# helpers: tolerances derived from the sample size
# --------------------------------------------------------------------------------------------------
def gaussian_std_ok(sample: np.ndarray, sigma: float) -> bool:
    """Is the sample std of an i.i.d. N(0, sigma^2) sample within K_SE standard errors of sigma?

    For i.i.d. normals, Var(s^2) = 2 sigma^4 / (N - 1) and, by the delta method (s = sqrt(s^2),
    ds/d(s^2) = 1/(2 sigma)), Var(s) ~ sigma^2 / (2N): SE(s) = sigma / sqrt(2N).
    With N = 200k the allowed relative error is 6 / sqrt(400k) ~ 0.95%.
    """
    n = sample.size
    return abs(sample.std() - sigma) <= K_SE * sigma / math.sqrt(2 * n)


def mean_ok(sample: np.ndarray, std: float) -> bool:
    """Sample mean of a zero-mean sample with known std is within K_SE * std / sqrt(N) of 0."""
    return abs(sample.mean()) <= K_SE * std / math.sqrt(sample.size)


def laplace_std_ok(sample: np.ndarray, scale: float) -> bool:
    """Sample std of Laplace(0, b) against sqrt(2) b.

    Laplace moments: sigma^2 = 2 b^2, mu4 = 24 b^4. Var(s^2) ~ (mu4 - sigma^4)/N = 20 b^4 / N and
    Var(s) ~ Var(s^2) / (4 sigma^2) = 20 b^4 / (8 b^2 N) = 2.5 b^2 / N: SE(s) = b sqrt(2.5 / N).
    """
    n = sample.size
    return abs(sample.std() - math.sqrt(2.0) * scale) <= K_SE * scale * math.sqrt(2.5 / n)


def balle_wang_delta(sens: float, sigma: float, eps: float) -> float:
    """delta(eps) of the Gaussian mechanism, Balle & Wang (2018) Thm. 8, computed independently."""
    a = sens / (2 * sigma)
    b = eps * sigma / sens
    return float(stats.norm.cdf(a - b) - math.exp(eps) * stats.norm.cdf(-a - b))


# --------------------------------------------------------------------------------------------------
# NoiseSource
# --------------------------------------------------------------------------------------------------
class TestNoiseSource:
    def test_seeded_is_reproducible(self):
        a, b = NoiseSource(seed=1234), NoiseSource(seed=1234)
        assert a.mode == b.mode == "seeded"
        assert a.describe() == {"noise_rng": "seeded", "noise_seed": 1234}
        np.testing.assert_array_equal(a.uniform(1000), b.uniform(1000))
        assert torch.equal(a.gaussian((10, 7), 2.0), b.gaussian((10, 7), 2.0))
        assert torch.equal(a.laplace(33, 0.5), b.laplace(33, 0.5))
        assert a.categorical(np.zeros(9)) == b.categorical(np.zeros(9))
        # a different seed gives a different stream
        assert not np.array_equal(NoiseSource(seed=1).uniform(64), NoiseSource(seed=2).uniform(64))

    def test_secure_mode(self):
        s = NoiseSource()
        assert s.mode == "secure" and s.seed is None
        assert s.describe()["noise_rng"] == "secure"
        x, y = s.gaussian(16, 1.0), s.gaussian(16, 1.0)
        assert x.dtype == torch.float64 and x.shape == (16,)
        assert not torch.equal(x, y)
        # two independent secure sources do not agree either (nothing is seeded from the clock)
        assert not torch.equal(NoiseSource().gaussian(16, 1.0), NoiseSource().gaussian(16, 1.0))
        u = s.uniform(100_000)
        assert np.all(u > 0) and np.all(u < 1)

    def test_uniform_open_interval_and_moments(self):
        n = 400_000
        u = NoiseSource(seed=5).uniform(n)
        assert u.dtype == np.float64 and u.shape == (n,)
        assert np.all(u > 0.0) and np.all(u < 1.0)
        # U(0,1): mean 1/2, var 1/12; SE(mean) = sqrt(1/12 / N).
        assert abs(u.mean() - 0.5) <= K_SE * math.sqrt(1 / 12 / n)
        # Var(s^2) for U(0,1) = (mu4 - sigma^4)/N with mu4 = 1/80, sigma^4 = 1/144.
        assert abs(u.var() - 1 / 12) <= K_SE * math.sqrt((1 / 80 - 1 / 144) / n)

    def test_uniform_extreme_bits_stay_strictly_inside(self, monkeypatch):
        """The extreme raw words (all zeros / all ones) must map strictly inside (0, 1), and
        therefore Laplace / Gaussian noise must stay finite. (All-ones bits used to give exactly
        1.0 through float rounding of 2^53 - 1/2, hence infinite Laplace noise.)"""
        s = NoiseSource(seed=0)
        words = np.array([0, 1, 2**11, 2**63 - 1, 2**63, 2**64 - 2**11, 2**64 - 1], dtype=np.uint64)
        monkeypatch.setattr(s, "_raw_uint64", lambda n: np.resize(words, n))
        u = s.uniform(words.size)
        assert np.all(u > 0.0) and np.all(u < 1.0), u
        assert torch.isfinite(s.laplace(words.size, 1.0)).all()
        assert torch.isfinite(s.gaussian(2 * words.size, 1.0)).all()

    def test_gaussian_moments(self):
        n, sigma = 200_000, 3.7
        z = NoiseSource(seed=11).gaussian(n, sigma).numpy()
        assert z.dtype == np.float64
        assert mean_ok(z, sigma)
        assert gaussian_std_ok(z, sigma)
        # the same tolerance rejects a scale 5% off (5% >> 0.95%)
        assert not gaussian_std_ok(z, 1.05 * sigma) and not gaussian_std_ok(z, 0.95 * sigma)

    def test_gaussian_odd_sizes_and_shapes(self):
        s = NoiseSource(seed=3)
        assert s.gaussian(1, 1.0).shape == (1,)
        assert s.gaussian((3, 5, 7), 1.0).shape == (3, 5, 7)
        assert s.gaussian((), 1.0).shape == ()
        assert torch.equal(s.gaussian(4, 0.0), torch.zeros(4, dtype=torch.float64))
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError):
                s.gaussian(3, bad)
            with pytest.raises(ValueError):
                s.laplace(3, bad)

    def test_ks_gaussian_and_laplace(self):
        n = 50_000
        z = NoiseSource(seed=21).gaussian(n, 2.0).numpy()
        assert stats.kstest(z, "norm", args=(0.0, 2.0)).pvalue > 1e-3
        lap = NoiseSource(seed=22).laplace(n, 0.7).numpy()
        assert stats.kstest(lap, "laplace", args=(0.0, 0.7)).pvalue > 1e-3
        # power check: the KS test at this N does notice a 5% wrong scale
        assert stats.kstest(z, "norm", args=(0.0, 2.1)).pvalue < 1e-3
        assert stats.kstest(lap, "laplace", args=(0.0, 0.735)).pvalue < 1e-3

    def test_laplace_moments(self):
        n, b = 200_000, 1.3
        x = NoiseSource(seed=31).laplace(n, b).numpy()
        assert mean_ok(x, math.sqrt(2) * b)
        assert laplace_std_ok(x, b)
        assert not laplace_std_ok(x, 1.05 * b)

    def test_categorical(self):
        s = NoiseSource(seed=4)
        assert s.categorical(np.array([-np.inf, 0.0, -np.inf])) == 1
        for bad in (np.array([]), np.array([np.nan, 0.0]), np.array([-np.inf, -np.inf]), np.zeros((2, 2))):
            with pytest.raises(ValueError):
                s.categorical(bad)


# --------------------------------------------------------------------------------------------------
# Gaussian mechanism
# --------------------------------------------------------------------------------------------------
class TestGaussian:
    @pytest.mark.parametrize("sens,rho", [(1.0, 0.5), (2.5, 0.01), (0.3, 3.0), (7.0, 1e-4)])
    def test_from_zcdp(self, sens, rho):
        m = GaussianMechanism.from_zcdp(sens, rho)
        assert math.isclose(m.sigma, sens / math.sqrt(2 * rho), rel_tol=1e-14)
        assert math.isclose(m.rho, rho, rel_tol=1e-12)
        assert math.isclose(m.noise_multiplier, 1 / math.sqrt(2 * rho), rel_tol=1e-14)

    def test_privatize_noise_scale(self):
        n = 200_000
        m = GaussianMechanism.from_zcdp(2.0, 0.05)  # sigma = 2 / sqrt(0.1) ~ 6.32
        value = torch.linspace(-5, 5, n, dtype=torch.float64)
        out = m.privatize(value, NoiseSource(seed=41))
        assert out.shape == value.shape and out.dtype == value.dtype
        noise = (out - value).numpy()
        assert mean_ok(noise, m.sigma)
        assert gaussian_std_ok(noise, m.sigma)

    def test_std_check_detects_sigma_ten_percent_too_small(self):
        """The tolerance used above is tight enough: a mechanism that CLAIMS sigma but adds noise
        with 0.9 sigma (i.e. a 1.23x larger rho than claimed) fails the same check."""

        class TooLittleNoise(GaussianMechanism):
            def privatize(self, value, noise):
                return value + noise.gaussian(tuple(value.shape), 0.9 * self.sigma)

        n = 200_000
        m = TooLittleNoise(2.0, 2.0 / math.sqrt(0.1))
        value = torch.zeros(n, dtype=torch.float64)
        noise = (m.privatize(value, NoiseSource(seed=41)) - value).numpy()
        assert not gaussian_std_ok(noise, m.sigma)
        # and the honest mechanism with the same seed passes
        honest = GaussianMechanism(2.0, m.sigma)
        assert gaussian_std_ok((honest.privatize(value, NoiseSource(seed=41)) - value).numpy(), m.sigma)

    def test_privatize_is_postprocessing_for_other_dtypes(self):
        """Noise is added in float64 and only the RESULT is cast: for integer queries
        ``v + trunc(Z)`` (casting the noise first) is not a function of ``v + Z`` and breaks the
        stated rho-zCDP guarantee."""
        m = GaussianMechanism(1.0, 1.0)
        v = torch.ones(4000, dtype=torch.int64)
        out = m.privatize(v, NoiseSource(seed=7))
        ref = v.to(torch.float64) + NoiseSource(seed=7).gaussian(4000, 1.0)
        assert out.dtype == torch.int64
        assert torch.equal(out, ref.to(torch.int64))
        v32 = torch.full((1000,), 0.1, dtype=torch.float32)
        out32 = m.privatize(v32, NoiseSource(seed=8))
        ref32 = (v32.to(torch.float64) + NoiseSource(seed=8).gaussian(1000, 1.0)).to(torch.float32)
        assert out32.dtype == torch.float32 and torch.equal(out32, ref32)

    @pytest.mark.parametrize(
        "sens,eps,delta", [(1.0, 1.0, 1e-5), (3.0, 0.1, 1e-6), (0.5, 3.0, 1e-5), (1.0, 0.5, 1e-3), (2.0, 8.0, 1e-4)]
    )
    def test_analytic_is_minimal_balle_wang(self, sens, eps, delta):
        m = GaussianMechanism.analytic(sens, eps, delta)
        d = balle_wang_delta(sens, m.sigma, eps)
        # satisfies the condition (up to the root finder's 1e-12 tolerance on sigma)...
        assert d <= delta * (1 + 1e-6)
        # ...with near equality...
        assert d >= delta * (1 - 1e-6)
        # ...and is minimal: 1% less noise violates it
        assert balle_wang_delta(sens, 0.99 * m.sigma, eps) > delta
        # the view from the other side: epsilon(delta) of this sigma is eps again
        assert math.isclose(m.epsilon(delta), eps, rel_tol=1e-6)

    @pytest.mark.parametrize("z", [0.6, 1.0, 2.5, 10.0])
    @pytest.mark.parametrize("delta", [1e-5, 1e-8])
    def test_epsilon_matches_pld(self, z, delta):
        m = GaussianMechanism(1.7, 1.7 * z)
        ours = m.epsilon(delta)
        acc = pld.PLDAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(z))
        ref = acc.get_epsilon(delta)
        assert math.isclose(ours, ref, rel_tol=1e-2)
        # the exact value cannot be above the pessimistic PLD estimate
        assert ours <= ref * (1 + 1e-9)
        # independent check of the exact characterisation
        assert math.isclose(balle_wang_delta(1.7, m.sigma, ours), delta, rel_tol=1e-4)

    def test_refuses_bad_queries_and_parameters(self):
        m = GaussianMechanism.from_zcdp(1.0, 0.1)
        s = NoiseSource(seed=0)
        for bad in (
            torch.tensor([1.0, float("nan")]),
            torch.tensor([float("inf")]),
            torch.tensor([[0.0], [-float("inf")]]),
        ):
            with pytest.raises(ValueError):
                m.privatize(bad, s)
        with pytest.raises(TypeError):
            m.privatize(np.zeros(3), s)
        for sens, rho in ((0.0, 0.1), (-1.0, 0.1), (1.0, 0.0), (1.0, -0.1), (float("nan"), 1.0), (1.0, float("inf"))):
            with pytest.raises(ValueError):
                GaussianMechanism.from_zcdp(sens, rho)
        for eps, delta in ((0.0, 1e-5), (1.0, 0.0), (1.0, 1.0), (-1.0, 1e-5)):
            with pytest.raises(ValueError):
                GaussianMechanism.analytic(1.0, eps, delta)
        with pytest.raises(ValueError):
            GaussianMechanism(1.0, 0.0)


# --------------------------------------------------------------------------------------------------
# Laplace mechanism
# --------------------------------------------------------------------------------------------------
class TestLaplace:
    @pytest.mark.parametrize("sens,eps", [(1.0, 1.0), (2.0, 0.25), (0.1, 4.0)])
    def test_scale_and_rho(self, sens, eps):
        m = LaplaceMechanism(sens, eps)
        assert math.isclose(m.scale, sens / eps, rel_tol=1e-15)
        assert math.isclose(m.rho, eps**2 / 2, rel_tol=1e-15)

    def test_empirical_std(self):
        n = 200_000
        m = LaplaceMechanism(2.0, 0.5)  # b = 4
        value = torch.full((n,), 3.0, dtype=torch.float64)
        noise = (m.privatize(value, NoiseSource(seed=51)) - value).numpy()
        assert mean_ok(noise, math.sqrt(2) * m.scale)
        assert laplace_std_ok(noise, m.scale)
        # sensitivity/(2 eps) or sensitivity*eps would be far outside
        assert not laplace_std_ok(noise, 0.9 * m.scale)

    def test_refuses_nan(self):
        with pytest.raises(ValueError):
            LaplaceMechanism(1.0, 1.0).privatize(torch.tensor([float("nan")]), NoiseSource(seed=0))
        with pytest.raises(ValueError):
            LaplaceMechanism(1.0, 0.0)


# --------------------------------------------------------------------------------------------------
# Truncated discrete Laplace
# --------------------------------------------------------------------------------------------------
# (eps, delta, kappa worked by hand: 1 + ceil(ln(1/delta)/eps))
TDLAP_TABLE = [
    (1.0, 1e-3, 8),  # ln(1000) = 6.908  -> 7   -> 8
    (0.1, 1e-5, 117),  # ln(1e5)/0.1 = 115.13 -> 116 -> 117
    (0.5, 1e-6, 29),  # ln(1e6)/0.5 = 27.63  -> 28  -> 29
    (2.0, 1e-9, 12),  # ln(1e9)/2 = 10.36    -> 11  -> 12
    (0.3, 0.2, 7),  # ln(5)/0.3 = 5.365    -> 6   -> 7
]


class TestTruncatedDiscreteLaplace:
    @pytest.mark.parametrize("eps,delta,kappa", TDLAP_TABLE)
    def test_kappa(self, eps, delta, kappa):
        m = TruncatedDiscreteLaplace(eps, delta)
        assert m.kappa == 1 + math.ceil(math.log(1 / delta) / eps) == kappa

    @pytest.mark.parametrize("eps,delta,kappa", TDLAP_TABLE)
    def test_pmf_facts(self, eps, delta, kappa):
        m = TruncatedDiscreteLaplace(eps, delta)
        p = m.pmf()
        np.testing.assert_array_equal(m.support(), np.arange(2 * kappa + 1))
        assert p.shape == (2 * kappa + 1,)
        assert math.isclose(p.sum(), 1.0, rel_tol=1e-12)
        assert np.all(p > 0)
        assert int(np.argmax(p)) == kappa
        np.testing.assert_allclose(p, p[::-1], rtol=1e-12)  # symmetric around kappa
        assert p[0] == p[-1]
        assert p[0] <= delta and p[0] <= math.exp(-eps) * delta
        # shape: Pr[x] proportional to exp(-eps |x - kappa|)
        np.testing.assert_allclose(p / p[kappa], np.exp(-eps * np.abs(np.arange(2 * kappa + 1) - kappa)), rtol=1e-12)
        # neighbouring ratios bounded by e^eps in both directions
        r = p[1:] / p[:-1]
        assert np.all(r <= math.exp(eps) + 1e-12) and np.all(1 / r <= math.exp(eps) + 1e-12)

    def test_sampler_chi_square(self):
        m = TruncatedDiscreteLaplace(1.0, 1e-3)  # support {0..16}
        n = 200_000
        s = NoiseSource(seed=61)
        draws = np.array([m.sample(s) for _ in range(n)])
        assert draws.min() >= 0 and draws.max() <= 2 * m.kappa
        p = m.pmf()
        counts = np.bincount(draws, minlength=p.size).astype(float)
        expected = n * p
        # pool the two tails into single cells so that every expected count is >= 5
        keep = expected >= 5
        lo_tail = ~keep & (np.arange(p.size) < m.kappa)
        hi_tail = ~keep & (np.arange(p.size) > m.kappa)
        obs = np.concatenate([counts[keep], [counts[lo_tail].sum(), counts[hi_tail].sum()]])
        exp = np.concatenate([expected[keep], [expected[lo_tail].sum(), expected[hi_tail].sum()]])
        obs, exp = obs[exp > 0], exp[exp > 0]
        assert stats.chisquare(obs, exp).pvalue > 1e-3
        # power: the pmf of a 10% different eps is rejected by the same test on the same draws
        wrong = TruncatedDiscreteLaplace(1.1, 1e-3).pmf() * n
        assert wrong.size == p.size  # same kappa (8)
        assert stats.chisquare(counts[keep], wrong[keep] * counts[keep].sum() / wrong[keep].sum()).pvalue < 1e-3

    def test_invalid(self):
        for eps, delta in ((0.0, 1e-3), (1.0, 0.0), (1.0, 1.0), (-1.0, 0.5)):
            with pytest.raises(ValueError):
                TruncatedDiscreteLaplace(eps, delta)


# --------------------------------------------------------------------------------------------------
# Exponential mechanism
# --------------------------------------------------------------------------------------------------
class TestExponential:
    def test_probability_ratios(self):
        u = np.array([0.0, 1.0, -2.5, 3.25, 3.25, 10.0])
        for eps, sens in ((1.0, 1.0), (0.3, 2.0), (5.0, 0.5)):
            for monotone, factor in ((False, 2.0), (True, 1.0)):
                m = ExponentialMechanism(eps, sens, monotone)
                p = m.probabilities(u)
                assert math.isclose(p.sum(), 1.0, rel_tol=1e-12)
                # log p_i - log p_j = eps (u_i - u_j) / (factor * sens)
                lhs = np.log(p)[:, None] - np.log(p)[None, :]
                rhs = eps * (u[:, None] - u[None, :]) / (factor * sens)
                np.testing.assert_allclose(lhs, rhs, atol=1e-9)

    def test_rho(self):
        assert math.isclose(ExponentialMechanism(0.8, 1.0).rho, 0.8**2 / 8, rel_tol=1e-15)
        assert math.isclose(ExponentialMechanism(0.8, 1.0, monotone=True).rho, 0.8**2 / 2, rel_tol=1e-15)

    def test_dp_ratio_random_neighbours(self):
        """Pr[i | u] <= e^eps Pr[i | u'] whenever |u - u'| <= sensitivity elementwise."""
        rng = np.random.default_rng(0)
        worst = 0.0
        for _ in range(300):
            k = int(rng.integers(2, 12))
            eps, sens = float(rng.uniform(0.05, 5.0)), float(rng.uniform(0.1, 3.0))
            u = rng.normal(0, 5 * sens, size=k)
            # mix of interior and extreme (|u-u'| = sens, opposite directions) perturbations
            d = rng.uniform(-sens, sens, size=k)
            if rng.random() < 0.5:
                d = sens * rng.choice([-1.0, 1.0], size=k)
            m = ExponentialMechanism(eps, sens)
            lr = np.abs(np.log(m.probabilities(u)) - np.log(m.probabilities(u + d)))
            assert lr.max() <= eps + 1e-9
            worst = max(worst, lr.max() / eps)
            # monotone version: all utilities move the same way
            mm = ExponentialMechanism(eps, sens, monotone=True)
            dm = np.abs(d)
            lrm = np.abs(np.log(mm.probabilities(u)) - np.log(mm.probabilities(u + dm)))
            assert lrm.max() <= eps + 1e-9
        # the factor 2 is needed: the worst case (+sens on one candidate, -sens on all k-1 others)
        # has log-ratio eps/2 + log(k / (e^{eps/2} + (k-1) e^{-eps/2})) -> eps as k grows, so
        # dropping the factor would give ~2 eps
        eps, sens = 1.0, 1.0
        u = np.zeros(10_000)
        d = -np.ones(u.size)
        d[0] = 1.0
        m = ExponentialMechanism(eps, sens)
        lr = np.log(m.probabilities(u + d)[0]) - np.log(m.probabilities(u)[0])
        assert lr > 0.9 * eps and lr <= eps + 1e-12
        assert worst <= 1 + 1e-9

    def test_selection_frequencies(self):
        m = ExponentialMechanism(1.0, 0.5)
        u = np.array([0.0, 0.2, 0.5, 1.0, -0.5])
        p = m.probabilities(u)
        n = 50_000
        s = NoiseSource(seed=71)
        counts = np.bincount([m.select(u, s) for _ in range(n)], minlength=u.size)
        assert stats.chisquare(counts, n * p).pvalue > 1e-3
        # power: frequencies from a mechanism without the factor 2 would be rejected
        p_wrong = ExponentialMechanism(1.0, 0.5, monotone=True).probabilities(u)
        assert stats.chisquare(counts, n * p_wrong).pvalue < 1e-3

    def test_invalid(self):
        m = ExponentialMechanism(1.0, 1.0)
        for bad in (np.array([]), np.array([0.0, np.nan]), np.array([np.inf, 0.0]), np.zeros((2, 2))):
            with pytest.raises(ValueError):
                m.probabilities(bad)
        with pytest.raises(ValueError):
            ExponentialMechanism(0.0, 1.0)


# --------------------------------------------------------------------------------------------------
# Report noisy max (Laplace)
# --------------------------------------------------------------------------------------------------
def _diff_laplace_survival(t: float, b: float) -> float:
    """Pr[L0 - L1 > t] for i.i.d. Laplace(0, b), t >= 0.

    The difference has density (1/(4b)) (1 + |x|/b) e^{-|x|/b}; integrating from t to infinity gives
    (1/4)(2 + t/b) e^{-t/b} (which is 1/2 at t = 0)."""
    return 0.25 * (2 + t / b) * math.exp(-t / b)


class TestReportNoisyMax:
    def test_scale_and_rho(self):
        assert math.isclose(ReportNoisyMax(0.5, 3.0).scale, 2 * 3.0 / 0.5, rel_tol=1e-15)
        assert math.isclose(ReportNoisyMax(0.5, 3.0, monotone=True).scale, 3.0 / 0.5, rel_tol=1e-15)
        assert math.isclose(ReportNoisyMax(0.5, 3.0).rho, 0.125, rel_tol=1e-15)

    def test_clear_max_wins(self):
        m = ReportNoisyMax(1.0, 1.0)  # b = 2
        u = np.array([0.0, 1.0, 40.0, 2.0])  # gap 38 = 19 b
        s = NoiseSource(seed=81)
        n = 2000
        wins = sum(m.select(u, s) == 2 for _ in range(n))
        # Pr[lose] <= sum_j Pr[L_j - L_2 > 38] <= 3 * (1/4)(2 + 19) e^{-19} ~ 9e-8: all wins expected
        assert wins >= n - 1

    def test_two_candidate_frequencies_and_dp_ratio(self):
        """Neighbours u = (0, s), u' = (s, 0) (each utility moves by the sensitivity s).

        Exactly, Pr[select 0 | u] = S(s) and Pr[select 0 | u'] = 1 - S(s) with S the survival
        function of the difference of two Laplace(b), b = 2s/eps. We check (1) the empirical
        frequencies match these (binomial SE sqrt(p(1-p)/N), 6 SE) — a wrong scale is caught — and
        (2) the e^eps ratio bound holds for the estimated ratio: by the delta method
        SE(log p_hat) = sqrt((1-p)/(N p)), so the estimated log-ratio minus 6 combined SEs must be
        <= eps."""
        eps, sens = 1.0, 1.0
        m = ReportNoisyMax(eps, sens)
        n = 20_000
        s = NoiseSource(seed=91)
        u, u2 = np.array([0.0, sens]), np.array([sens, 0.0])
        p_hat = sum(m.select(u, s) == 0 for _ in range(n)) / n
        p2_hat = sum(m.select(u2, s) == 0 for _ in range(n)) / n
        p = _diff_laplace_survival(sens, m.scale)
        se = math.sqrt(p * (1 - p) / n)
        assert abs(p_hat - p) <= K_SE * se and abs(p2_hat - (1 - p)) <= K_SE * se
        # a mechanism using b = sens/eps (no factor 2) would select 0 with this probability: caught
        assert abs(p_hat - _diff_laplace_survival(sens, sens / eps)) > K_SE * se
        # exact ratio is within e^eps, and so is the estimate
        assert (1 - p) / p <= math.exp(eps)
        se_log = math.sqrt((1 - p_hat) / (n * p_hat) + (1 - p2_hat) / (n * p2_hat))
        for a, b in ((p2_hat, p_hat), (p_hat, p2_hat)):
            assert math.log(a / b) - K_SE * se_log <= eps

    def test_invalid(self):
        with pytest.raises(ValueError):
            ReportNoisyMax(1.0, 1.0).select(np.array([0.0, np.nan]), NoiseSource(seed=0))
        with pytest.raises(ValueError):
            ReportNoisyMax(1.0, -1.0)
