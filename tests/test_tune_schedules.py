"""fedkl tune over dp-accounting schedules (issue 32): the grid-curve search bound against exact Renyi
divergences of a MIXTURE of non-zCDP base mechanisms, the schedule's RDP bound against an independent
numerical integration, the calibration's minimality, and an end-to-end search holding dp-sgd."""

import json
import math
import os

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import integrate, stats
from test_tune import BASE, _best_of_k, _exact_curve, _renyi

from fedkl.privacy import PrivacyLedger
from fedkl.privacy.selection import (
    TRIAL_GRID,
    Stopping,
    grid_curve,
    schedule_fits,
    schedule_multiplier,
    schedule_rdp,
    search_epsilon,
    search_rdp,
)
from fedkl.runner import RunConfig
from fedkl.tuning import tune

LAWS = [
    (lambda k: stats.poisson(3.0).pmf(k), Stopping("poisson", mu=3.0)),
    (lambda k: np.where(k > 0, stats.logser(1 - 0.1).pmf(np.maximum(k, 1)), 0.0), Stopping("tnb", eta=0.0, gamma=0.1)),
]  # fmt: skip


def _mixture():
    """Q: with probability 1/2 (data-independent) a 2-outcome randomized response at eps 1.2, else a
    shifted discrete Gaussian (neither is tightly zCDP-shaped), outcomes merged in one total order."""
    e0 = 1.2
    rr_p = np.array([1.0, math.exp(e0)]) / (1 + math.exp(e0))
    j = np.arange(-4, 6)
    dg_p = np.exp(-(j**2) / 1.5) / np.exp(-(j**2) / 1.5).sum()
    dg_q = np.exp(-((j - 1) ** 2) / 1.5) / np.exp(-((j - 1) ** 2) / 1.5).sum()
    size = len(j) + 2  # RR's outcomes sit at both ends of the order
    p, q = np.zeros(size), np.zeros(size)
    p[[0, -1]] += 0.5 * rr_p
    q[[0, -1]] += 0.5 * rr_p[::-1]
    p[1:-1] += 0.5 * dg_p
    q[1:-1] += 0.5 * dg_q
    parts = [_exact_curve(rr_p, rr_p[::-1].copy()), _exact_curve(dg_p, dg_q)]
    return p, q, parts


@pytest.mark.parametrize("pmf,law", LAWS, ids=["poisson", "log"])
def test_grid_bound_holds_for_a_mixture_against_exact_divergence(pmf, law):
    """Every part of the mixture has RDP <= rho g on the grid (rho: the least such); the implemented
    grid-curve bound (Theorem 2 / 6 on c = rho g+(l)) is at least the exact divergence of the best-of-K
    output of the MIXTURE, both directions, at every grid order, and so is its (eps, delta) conversion."""
    p, q, parts = _mixture()
    g = np.asarray(TRIAL_GRID)
    rho = max(float(np.max(part(g) / g)) for part in parts)
    k = np.arange(0, 300)
    pk = pmf(k)
    a, b = _best_of_k(p, pk), _best_of_k(q, pk)
    exact = np.array([max(_renyi(a, b, o), _renyi(b, a, o)) for o in g])
    bound = np.array([search_rdp(o, grid_curve(rho), law) for o in g])
    assert np.all(exact <= bound + 1e-12)
    delta = 1e-4
    exact_eps, _ = rdp_lib.compute_epsilon(list(g), list(exact), delta)
    assert exact_eps <= search_epsilon(rho, law, delta, "grid") + 1e-9
    # the mixture's own curve is at most the largest of its parts' (joint convexity), and the grid curve
    # is at least rho * l everywhere (so a rho-zCDP trial and the score fit it)
    mix = _exact_curve(p, q)(g)
    assert np.all(mix <= np.maximum(parts[0](g), parts[1](g)) + 1e-12)
    ls = np.linspace(1.01, 256, 997)
    assert np.all(grid_curve(rho)(ls) >= rho * ls) and np.all(np.isinf(grid_curve(rho)([257.0, 1e4])))


def _subsampled_gaussian_rdp(q: float, z: float, order: float) -> float:
    """max of D_l(mix || N(0, z^2)) and D_l(N(0, z^2) || mix), mix = (1 - q) N(0, z^2) + q N(1, z^2), by
    numerical integration (scipy.integrate.quad; independent of dp-accounting)."""

    def log_base(x):
        return stats.norm.logpdf(x, 0, z)

    def log_mix(x):
        return np.logaddexp(math.log(1 - q) + stats.norm.logpdf(x, 0, z), math.log(q) + stats.norm.logpdf(x, 1, z))

    lim = 1 + 30 * z

    def div(f, h):
        val, _ = integrate.quad(lambda x: math.exp(order * f(x) + (1 - order) * h(x)), -lim, lim, limit=400)
        return math.log(val) / (order - 1)

    return max(div(log_mix, log_base), div(log_base, log_mix))


def test_schedule_rdp_against_numerical_integration():
    """schedule_rdp (dp-accounting's bound, its monotone envelope and the unsampled cap) is at least the
    divergence integrated numerically, at integer and fractional grid orders, and not loose at integers."""
    g = np.asarray(TRIAL_GRID)
    for q, z, steps in ((0.5, 2.0, 3), (0.1, 1.0, 10)):
        curve = schedule_rdp(q, z, steps)
        for order in (1.5, 2.0, 2.75, 3.0, 8.0):
            i = int(np.flatnonzero(g == order)[0])
            numeric = steps * _subsampled_gaussian_rdp(q, z, order)
            assert numeric <= curve[i] * (1 + 1e-6)
            if order == int(order):  # Mironov, Talwar & Zhang's bound is exact at integer orders
                assert numeric >= 0.99 * curve[i]
    # q = 1: the Gaussian's curve, T l / (2 z^2), exactly
    assert np.allclose(schedule_rdp(1.0, 2.0, 3), 3 * g / 8)


def test_schedule_multiplier_is_the_smallest_that_fits():
    for rho, q, steps in ((0.05, 0.5, 2), (0.2, 0.05, 40)):
        z = schedule_multiplier(rho, q, steps)
        assert schedule_fits(rho, q, z, steps) and not schedule_fits(rho, q, z * (1 - 1e-4), steps)
        assert z < math.sqrt(steps / (2 * rho))  # amplification: below the unsampled multiplier


def _cfg(tmp_path, **kw):
    return RunConfig.from_settings(
        **{**BASE, "noise_seed": 5, "neighbouring": "add-remove", **kw}, out=str(tmp_path / "run")
    )


SPACE = (["dp-sgd", "noisy-gd"], {"rounds": ["2"], "sampling_rate": ["0.5"]})


def test_a_search_holding_a_schedule_is_charged_on_the_grid_curve(tmp_path):
    """dp-sgd trials run (RDP accountant, noise fitted to the grid), the one SearchCharge is on the grid
    curve, its eps is the plan's, and result.json says so."""
    lines: list[str] = []
    result = tune(_cfg(tmp_path), *SPACE, trials=2.0, log=lines.append)
    assert any(line.startswith("  trial") and "dp-sgd" in line for line in lines), "pick a seed with a dp-sgd trial"
    charge = result["search"]["charge"]
    assert charge["curve"] == "grid" and "TRIAL_GRID" in result["search"]["trial_curve"]
    assert charge["eps"] <= 4.0 and search_epsilon(charge["rho_trial"], Stopping("tnb", eta=charge["eta"], gamma=charge["gamma"]), charge["delta"], "grid") <= charge["eps"] * (1 + 1e-9)  # fmt: skip
    with PrivacyLedger(result["ledger"]["path"] if "path" in result["ledger"] else os.path.join(_cfg(tmp_path).out, "ledger.sqlite")) as ledger:  # fmt: skip
        ledger.verify()
        assert [r["mechanism"] for r in ledger.releases()] == ["private-selection"]
    assert json.load(open(os.path.join(_cfg(tmp_path).out, "result.json")))["search"]["charge"]["curve"] == "grid"


def test_a_schedule_over_its_trial_curve_is_stopped(tmp_path, monkeypatch):
    """Negative control: a scheduled trial handed twice its fitted budget calibrates a smaller multiplier,
    whose curve exceeds rho g on the grid: the stand-in check stops the search, nothing released."""
    import fedkl.tuning as tuning

    original = tuning.schedule_budget
    monkeypatch.setattr(tuning, "schedule_budget", lambda plan, params, rel: 2 * original(plan, params, rel))
    with pytest.raises(RuntimeError, match="charged more than its rho"):
        tune(_cfg(tmp_path), ["dp-sgd"], SPACE[1], trials=3.0, log=lambda _: None)
    assert not os.path.exists(os.path.join(_cfg(tmp_path).out, "result.json"))


def test_approx_dp_algorithms_without_a_curve_are_refused(tmp_path):
    with pytest.raises(ValueError, match="without an RDP curve"):
        tune(_cfg(tmp_path), ["noisy-gd", "phased-erm"], {}, trials=2.0, log=lambda _: None)
    with pytest.raises(ValueError, match="--accountant rdp"):
        tune(_cfg(tmp_path), ["dp-sgd"], {"accountant": ["pld"]}, trials=2.0, log=lambda _: None)
