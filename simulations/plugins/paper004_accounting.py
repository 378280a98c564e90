"""External sweep runner ``paper004-accounting`` (privacy accounting only, no training), for
simulations/studies/paper004_eps.toml: one point = one Poisson-subsampled Gaussian schedule (n users or
records, expected batch B, q = B/n, T steps, noise multiplier sigma, delta) and its epsilon under every
accountant, to show where paper 004's labels 1.22 / 0.57 / 0.28 come from.

Its own settings (sweep keys beyond ``fedkl run``'s; ``users`` = n, ``rounds`` = T and ``delta`` are
fedkl run's): ``sigma`` (noise multiplier), ``expected_batch`` (B), ``paper_label`` (the paper's epsilon
label, 0 = none), ``replace_one`` (also PLD under replace-one), ``calibrate`` (the sigma PLD needs for the
label), ``check_cli`` (run ``fedkl account --json`` and require the same RDP and PLD to 1e-9).

Per point (table columns):

* ``classic_rdp_pyvacy``: pyvacy's ``analysis.epsilon`` recipe, i.e. RDP of the Poisson-subsampled Gaussian
  (Mironov-Talwar-Zhang 2019, dp-accounting's own ``_compute_rdp_poisson_subsampled_gaussian``) with the
  CLASSIC conversion ``eps = T rdp(a) + ln(1/delta)/(a - 1)`` minimised over a continuous order a in
  [1, 512] by pyvacy's 72-iteration ternary search; ``classic_rdp_int``: over the integer orders 2..512
  (both in :mod:`fedkl.privacy.rdp_conversion`, with the conversion's proof);
* ``rdp``: dp-accounting's ``RdpAccountant`` (default orders, the improved conversion of Balle et al.
  2020 / Asoodeh et al.), exactly ``fedkl account --accountant rdp``; ``rdp_dense``: the same conversion
  over the orders 1.1..10.9 and every integer 11..512 (how much the default order grid costs);
* ``pld``: dp-accounting's ``PLDAccountant`` (fedkl's discretisation 1e-4), exactly ``fedkl account
  --accountant pld`` (also the row's ``epsilon``); ``pld_replace_one``: PLD of the same run under the
  replace-one relation the paper's Definition 1 states (sensitivity 2C, so fedkl's multiplier is sigma/2);
* ``gdp_clt``: Bu et al.'s CLT approximation mu = q sqrt(T (e^{1/sigma^2} - 1)) (reference [6], "MA [6]");
  an approximation, not an upper bound;
* ``sigma_pld_for_label``: the noise multiplier PLD needs to certify the paper's label.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from scipy.optimize import brentq
from scipy.stats import norm

from fedkl.experiments import register_runner, runner_result
from fedkl.privacy.accounting import GaussianSchedule, noise_multiplier_for, schedule_epsilon
from fedkl.privacy.rdp_conversion import classic_eps, improved_eps, pyvacy_eps

NAME = "paper004-accounting"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSE_ORDERS = [1 + x / 10 for x in range(1, 100)] + list(range(11, 513))
COLUMNS = (
    "expected_batch",
    "q",
    "epochs",
    "classic_rdp_pyvacy",
    "classic_rdp_pyvacy_order",
    "classic_rdp_int",
    "classic_rdp_int_order",
    "rdp",
    "rdp_dense",
    "rdp_dense_order",
    "pld",
    "pld_replace_one",
    "gdp_clt",
    "gdp_clt_mu",
    "fedkl_account_rdp",
    "fedkl_account_pld",
    "sigma_pld_for_label",
)


def gdp_clt_eps(q: float, z: float, steps: int, delta: float) -> tuple[float, float]:
    """Bu et al. (2020) CLT: mu = q sqrt(T (exp(1/z^2) - 1)); eps solving delta(eps) = delta for mu-GDP."""
    mu = q * math.sqrt(steps * math.expm1(1 / z**2))
    d = lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta  # noqa: E731
    return float(brentq(d, 0.0, 100.0, xtol=1e-12)), mu


def fedkl_account_cli(z: float, q: float, steps: int, delta: float) -> dict:
    """``fedkl account --json`` (this interpreter's fedkl) for this schedule."""
    cmd = [sys.executable, "-m", "fedkl.cli", "account", "--noise-multiplier", repr(z), "--sampling-rate", repr(q)]
    cmd += ["--steps", str(steps), "--delta", repr(delta), "--accountant", "all", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout)["epsilon"]


def run(settings, log) -> dict:
    n, steps, z, delta = int(settings.users), int(settings.rounds), float(settings.sigma), float(settings.delta)
    q = settings.expected_batch / n
    label = settings.paper_label or None
    c_eps, c_order = pyvacy_eps(q, z, steps, delta)
    ci_eps, ci_order = classic_eps(q, z, steps, delta, range(2, 513))
    r_eps = schedule_epsilon(GaussianSchedule(z, q, steps), delta, "rdp")
    rd_eps, rd_order = improved_eps(q, z, steps, delta, DENSE_ORDERS)
    p_eps = schedule_epsilon(GaussianSchedule(z, q, steps), delta, "pld")
    g_eps, mu = gdp_clt_eps(q, z, steps, delta)
    extra = {
        "expected_batch": settings.expected_batch,
        "q": q,
        "epochs": steps * q,
        "classic_rdp_pyvacy": c_eps,
        "classic_rdp_pyvacy_order": c_order,
        "classic_rdp_int": ci_eps,
        "classic_rdp_int_order": ci_order,
        "rdp": r_eps,
        "rdp_dense": rd_eps,
        "rdp_dense_order": rd_order,
        "pld": p_eps,
        "pld_replace_one": (
            # the same run (noise sigma C) under replace-one: its sensitivity is 2C, so its z is sigma / 2
            schedule_epsilon(GaussianSchedule(z / 2, q, steps, "replace-one"), delta, "pld")
            if settings.replace_one
            else None
        ),
        "gdp_clt": g_eps,
        "gdp_clt_mu": mu,
        "fedkl_account_rdp": None,
        "fedkl_account_pld": None,
        "sigma_pld_for_label": noise_multiplier_for(label, delta, q, steps, "pld")
        if settings.calibrate and label
        else None,
    }
    if settings.check_cli:
        acc = fedkl_account_cli(z, q, steps, delta)
        extra["fedkl_account_rdp"], extra["fedkl_account_pld"] = acc["rdp"], acc["pld"]
        if not (math.isclose(acc["rdp"], r_eps, rel_tol=1e-9) and math.isclose(acc["pld"], p_eps, rel_tol=1e-9)):
            raise AssertionError(f"fedkl account disagrees with dp-accounting: {acc} vs rdp {r_eps}, pld {p_eps}")
    log(json.dumps({"users": n, "sigma": z, "steps": steps, **extra}))
    return runner_result(NAME, settings.dataset, n, p_eps, delta, settings.seed, steps, extra)


register_runner(
    NAME,
    run,
    columns=COLUMNS,
    description=__doc__.splitlines()[0],
    settings={
        "sigma": 1.0,
        "expected_batch": 128,
        "paper_label": 0.0,
        "replace_one": False,
        "calibrate": False,
        "check_cli": False,
    },
)
