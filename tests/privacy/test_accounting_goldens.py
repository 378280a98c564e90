"""Accounting goldens (issue 15 §5): published values that fedkl's accounting must reproduce or beat,
beside the dp-accounting comparisons of test_accounting.py.

* dp-accounting's own RDP regression values for a Poisson-sampled Gaussian, through the event fedkl
  builds for a schedule (so a change in fedkl's event construction fails here);
* the analytic anchor: a Gaussian of multiplier 4.530877117 is exactly (1, 1e-6)-DP by RDP;
* the DP-FTRL tree-aggregation anchors (Kairouz et al. 2021, StackOverflow: 1,600 steps, delta 1e-6;
  noise 8.83 -> eps < 2.04, noise 1.13 -> eps < 19.74), through fedkl's own zCDP ledger arithmetic:
  a user's leaf touches ceil(log2 1600) + 1 = 12 tree nodes, each a Gaussian of sensitivity 1;
* round trips eps -> sigma -> eps over a grid, and the degenerate ends (no noise, infinite noise,
  a zero sampling rate)."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from fedkl.privacy import zcdp
from fedkl.privacy.accounting import GaussianSchedule, noise_multiplier_for, schedule_epsilon
from fedkl.privacy.charges import GaussianCharge


def test_dp_accountings_rdp_regression_values_through_fedkls_event():
    orders = [1.5, 2.5, 5, 50, 100]
    acc = rdp_privacy_accountant.RdpAccountant(orders=orders)
    acc.compose(GaussianSchedule(2.5, 0.01, 50).event())
    expected = [6.70579741e-04, 1.08548710e-03, 2.18075656e-03, 2.38460375e-02, 1.67416308e02]
    np.testing.assert_allclose(acc._rdp, expected, rtol=1e-4)


def test_the_analytic_gaussian_anchor():
    """z = 4.530877117 gives exactly (1, 1e-6) by RDP over a dense order grid; fedkl's default
    orders are coarser (never below), and its exact Gaussian conversion is tighter (below 1)."""
    z = 4.530877117
    eps_rdp = schedule_epsilon(GaussianSchedule(z, 1.0, 1), 1e-6, "rdp")
    assert 1.0 <= eps_rdp <= 1.01
    assert zcdp.eps_gaussian(1 / (2 * z**2), 1e-6) < 1.0


@pytest.mark.parametrize("noise, published", [(8.83, 2.04), (1.13, 19.74)])
def test_tree_aggregation_anchors(noise, published):
    steps, delta = 1600, 1e-6
    nodes = math.ceil(math.log2(steps)) + 1  # the levels a leaf's value reaches
    rho = sum(GaussianCharge(1.0 / (2 * noise**2), 1.0).rho for _ in range(nodes))
    ours = zcdp.eps_gaussian(rho, delta)
    assert ours < published
    acc = rdp_privacy_accountant.RdpAccountant(
        [1 + x / 10 for x in range(1, 100)] + list(range(12, 64)), dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    )
    acc.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(noise, steps))
    assert ours <= acc.get_epsilon(delta)  # the exact Gaussian conversion is at least as tight as RDP
    assert ours >= 0.95 * acc.get_epsilon(delta)  # and the same mechanism: not far below it


@pytest.mark.parametrize("eps", [0.5, 1.0, 4.0])
@pytest.mark.parametrize("q, steps", [(1.0, 1), (1.0, 50), (0.1, 100)])
def test_eps_sigma_round_trip_over_a_grid(eps, q, steps):
    z = noise_multiplier_for(eps, 1e-6, q, steps, accountant="rdp")
    got = schedule_epsilon(GaussianSchedule(z, q, steps), 1e-6, "rdp")
    assert eps * (1 - 1e-3) <= got <= eps * (1 + 1e-6)
    assert schedule_epsilon(GaussianSchedule(z * 0.99, q, steps), 1e-6, "rdp") > eps  # minimal


def test_degenerate_ends():
    assert schedule_epsilon(GaussianSchedule(1e6, 1.0, 10), 1e-6, "pld") < 1e-4  # infinite noise: ~0
    # RDP's floor at infinite noise is log(1/delta) / (max order - 1), from its finite order grid
    assert schedule_epsilon(GaussianSchedule(1e6, 0.5, 10), 1e-6, "rdp") < 0.01
    assert zcdp.eps_gaussian(0.0, 1e-6) == 0.0 and zcdp.eps_cks(0.0, 1e-6) == 0.0  # nothing released
    with pytest.raises(ValueError, match="sampling rate must be in"):
        GaussianSchedule(1.0, 0.0, 10)  # q = 0 releases nothing about anyone: refused, not eps = 0
    with pytest.raises(ValueError, match="noise multiplier must be finite and > 0"):
        GaussianSchedule(0.0, 1.0, 10)  # no noise: refused, not eps = inf
