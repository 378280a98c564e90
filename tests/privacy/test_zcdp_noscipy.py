"""The eps <-> rho conversions and the ledger summary need no scipy (issue 34), and give what the scipy
routines they replace give, to 1e-12 relative."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from fedkl.privacy import zcdp

scipy_optimize = pytest.importorskip("scipy.optimize")
scipy_stats = pytest.importorskip("scipy.stats")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RHOS = (1e-6, 1e-3, 0.05, 0.17348, 1.0, 20.0)
DELTAS = (1e-12, 1e-6, 5.01e-4, 0.1)


@pytest.fixture
def with_scipy(monkeypatch):
    """Run the conversions on scipy's routines (the code before issue 34)."""

    def fminbound(f, lo, hi, xatol=1e-10):
        res = scipy_optimize.minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": xatol})
        return res.x, res.fun

    def apply():
        monkeypatch.setattr(zcdp, "_fminbound", fminbound)
        monkeypatch.setattr(zcdp, "_brentq", scipy_optimize.brentq)
        monkeypatch.setattr(zcdp, "_ndtr", lambda a: float(scipy_stats.norm.cdf(a)))
        monkeypatch.setattr(zcdp, "_log_ndtr", lambda a: float(scipy_stats.norm.logcdf(a)))

    return apply


def _all_conversions() -> dict:
    out = {}
    for rho in RHOS:
        for delta in DELTAS:
            out[("eps_cks", rho, delta)] = zcdp.eps_cks(rho, delta)
            out[("eps_gaussian", rho, delta)] = zcdp.eps_gaussian(rho, delta)
            out[("delta_cks", rho, delta)] = zcdp.delta_cks(rho, 10 * rho + 0.5)
    for eps in (0.01, 0.5, 2.0, 8.0):
        for delta in DELTAS:
            for conv in zcdp.CONVERSIONS:
                out[("rho", eps, delta, conv)] = zcdp.rho_for_eps_delta(eps, delta, conv)
    return out


def test_conversions_equal_the_scipy_ones(with_scipy):
    """CKS and Bun-Steinke: equal to 1e-12 relative. The exact Gaussian conversion evaluates the normal
    cdf, whose math.erf/erfc value differs from scipy's ndtr by an ulp or two (test below); its root
    finder stops within rtol=1e-13 and its conservative loop steps mu by 1e-10, so an ulp in the profile can
    move the answer by up to one such step (2e-10 relative in rho): that is its tolerance here, and with the
    same profile the solvers give scipy's answers bit for bit (test_solvers_alone_are_scipy_bit_for_bit)."""
    mine = _all_conversions()
    with_scipy()
    theirs = _all_conversions()
    for key, value in mine.items():
        gaussian = key[0] == "eps_gaussian" or key[-1] == "gaussian"
        assert value == pytest.approx(theirs[key], rel=2.5e-10 if gaussian else 1e-12, abs=1e-300), key


def test_solvers_alone_are_scipy_bit_for_bit(monkeypatch):
    """Only the minimiser and the root finder swapped for scipy's: every conversion is identical."""
    mine = _all_conversions()

    def fminbound(f, lo, hi, xatol=1e-10):
        res = scipy_optimize.minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": xatol})
        return res.x, res.fun

    monkeypatch.setattr(zcdp, "_fminbound", fminbound)
    monkeypatch.setattr(zcdp, "_brentq", scipy_optimize.brentq)
    assert _all_conversions() == mine


@pytest.mark.parametrize("a", [-40.0, -25.0, -20.5, -19.5, -8.0, -1.0, -0.3, 0.0, 0.7, 3.0, 6.5, 12.0])
def test_normal_cdf_equals_scipy(a):
    # in the far tail both are ~1e-13 from the true value (the rounding of a / sqrt(2), times a^2)
    assert zcdp._ndtr(a) == pytest.approx(float(scipy_stats.norm.cdf(a)), rel=3e-13, abs=0)
    assert zcdp._log_ndtr(a) == pytest.approx(float(scipy_stats.norm.logcdf(a)), rel=1e-13, abs=1e-300)


def test_root_finder_and_minimiser_equal_scipy():
    f = lambda x: math.exp(x) - 3.0 * x - 0.5  # noqa: E731 (two roots; one in [1, 3])
    assert zcdp._brentq(f, 1.0, 3.0, xtol=1e-14, rtol=1e-12) == scipy_optimize.brentq(
        f, 1.0, 3.0, xtol=1e-14, rtol=1e-12
    )
    g = lambda x: (x - 0.3) ** 4 + math.cos(3 * x)  # noqa: E731
    res = scipy_optimize.minimize_scalar(g, bounds=(-1.0, 2.0), method="bounded", options={"xatol": 1e-10})
    assert zcdp._fminbound(g, -1.0, 2.0, xatol=1e-10) == (res.x, res.fun)


def test_ledger_summary_and_conversions_import_no_scipy(tmp_path):
    """A run's privacy path (eps -> rho, a ledger charge, its summary) in a fresh interpreter leaves
    scipy out of sys.modules."""
    code = f"""
import sys, json
from fedkl.privacy.zcdp import rho_for_eps_delta, zcdp_to_eps, delta_cks
from fedkl.privacy.ledger import Budget, PrivacyLedger
for conv in ("cks", "bun_steinke", "gaussian"):
    r = rho_for_eps_delta(2.0, 1e-5, conv); zcdp_to_eps(r, 1e-5, conv)
delta_cks(0.1, 1.0)
led = PrivacyLedger({str(tmp_path / "l.sqlite")!r}, Budget(epsilon=2.0, delta=1e-5))
led.rho_left(["a", "b"])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "scipy")))
"""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
