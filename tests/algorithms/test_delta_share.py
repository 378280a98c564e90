"""The share of eps spent choosing Delta privately (fedkl/algorithms/output_perturbation/delta_share.py): the expected
noise of the idealised IID score profile, checked against sampled AboveThreshold runs, and the rule
that picks the share of least expected noise from public values."""

import math

import numpy as np
import pytest

from fedkl.algorithms.output_perturbation.del_output_pert import DeletionRelease
from fedkl.algorithms.output_perturbation.delta_share import (
    SHARES,
    expected_overshoot,
    ranked_shares,
    release_share,
    release_shares,
)
from fedkl.privacy.rng import NoiseSource
from fedkl.privacy.sparse_vector import AboveThreshold


@pytest.mark.parametrize("eps_sel,kappa", [(0.5, 6), (2.0, 5), (0.25, 32)])
def test_expected_overshoot_matches_sampled_selections(eps_sel, kappa):
    """E[r^K] on the profile (capped scores 2 kappa + 1 at the 6 grid values below Delta*, 0 from it
    on; early stop or none = the largest value) against 20000 runs of AboveThreshold.select on the same
    queries: within 5 standard errors of the sample."""
    size, L, r = 12, 6, 2.0
    queries = [-(2.0 * kappa + 1)] * L + [0.0] * (size - L)
    mech = AboveThreshold(eps_sel, -kappa / 2.0)
    noise = NoiseSource(11)
    worst = r ** (size - L - 1)
    draws = []
    for _ in range(20000):
        i = mech.select(queries, noise)
        draws.append(worst if i is None or i < L else r ** (i - L))
    draws = np.asarray(draws)
    se = draws.std() / math.sqrt(draws.size)
    assert abs(draws.mean() - expected_overshoot(eps_sel, kappa, r, size, L)) <= 5 * se


def test_more_selection_budget_lands_closer_to_the_jump():
    """E[r^K] falls towards 1 as eps_sel grows (at fixed kappa) and rises towards the largest grid
    value as it vanishes: the trade-off the rule balances against the release's noise."""
    values = [expected_overshoot(e, 10, 2.0, 12, 6) for e in (0.05, 0.2, 0.5, 1.0, 3.0)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert values[0] > 20 and values[-1] < 1.05


def test_the_best_ranked_share_is_the_grid_minimiser_of_the_expected_noise():
    """With sigma/Delta = 40 e^-2 and kappa = 12/e (power laws), the rule's share minimises
    ratio(eps (1 - f)) E[r^K] over every share of the grid, is interior, and beats the old 1/4 by more
    than 10% at delta-typical kappa."""
    eps = 2.0

    def ratio(e):
        return 40.0 * e**-2

    def kappa(e):
        return 12.0 / e

    f = ranked_shares(eps, ratio, kappa)[0]

    def cost(g):
        return ratio(eps * (1 - g)) * expected_overshoot(g * eps, kappa(eps * (1 - g)), 2.0, 12, 6)

    costs = {g: cost(g) for g in SHARES}
    assert costs[f] == min(costs.values())
    assert SHARES[0] < f < SHARES[-1]
    assert costs[f] < 0.9 * costs[0.25]


def test_release_share_with_the_real_calibrations():
    """The default rule for the tight calibration at delta = 1e-6: a share between 0.3 and 0.45 at
    eps = 1..8 (the margin kappa eps_sel / 8 ~ ln(1/delta) f / (4 (1 - f)) barely depends on eps), of
    lower expected noise than 1/4 by the exact release constants at both shares."""
    delta = 1e-6
    for eps in (1.0, 8.0):
        f = release_share(eps, delta, "tight", "matching")
        assert 0.3 <= f <= 0.45
        exact = {g: DeletionRelease(eps * (1 - g), delta, 1.0, "tight", score="matching") for g in (f, 0.25)}
        cost = {g: d.sigma * expected_overshoot(g * eps, d.kappa, 2.0, 12, 6) for g, d in exact.items()}
        assert cost[f] < cost[0.25]


def test_the_share_rule_skips_shares_whose_release_the_test_refuses_at_n():
    """select_fraction=None in a phased call: the best-ranked share at n users large enough for it, else
    the first share of the ranking whose release the diameter test accepts at n (public: n, eps, delta)."""
    from fedkl.algorithms.output_perturbation.delta_share import release_shares
    from fedkl.algorithms.output_perturbation.phased_common import SCInnerRelease, SelectedDeltaInnerRelease
    from fedkl.problems.quadratic_mean import QuadraticMean

    eps, delta = 2.0, 1e-3
    inner = SelectedDeltaInnerRelease(QuadraticMean(4), 3.0, select_fraction=None, calibration="tight", test="matching")
    ranked = release_shares(eps, delta, "tight", "matching")
    need = SCInnerRelease.min_users(inner, eps * (1 - ranked[0]), delta)
    assert inner.share(eps, delta, need) == ranked[0] == inner.share(eps, delta)

    def accepted(f, n):
        try:
            SCInnerRelease.check(inner, n, eps - eps * f, delta)
        except ValueError:
            return False
        return True

    f = inner.share(eps, delta, need - 1)
    assert f != ranked[0] and accepted(f, need - 1)
    assert not any(accepted(g, need - 1) for g in ranked[: ranked.index(f)])


def test_the_rule_is_the_default_share_of_sc_output_pert_and_the_phased_algorithms():
    """--p002-select-fraction defaults to the rule (None); sc-output-pert's selection then spends the
    best-ranked share of least predicted noise on its own grid (ratio sqrt 2, 11 values), which at
    fertility-partition's n = 1000 (delta = 1/n^1.1) is larger than the old 1/4: the capped scores ahead of
    the floor then rarely stop AboveThreshold (tests/algorithms/test_delta_selection.py measures it)."""
    from fedkl.algorithms.output_perturbation.diameter_output_pert import (
        GRID_RATIO,
        GRID_SIZE,
        SelectedDeltaSCOutputPert,
    )
    from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert
    from fedkl.algorithms.output_perturbation.phased_erm import PhasedParams
    from fedkl.algorithms.output_perturbation.sc_output_pert import SCOutputPertParams

    assert SCOutputPertParams().p002_select_fraction is None and PhasedParams().p002_select_fraction is None
    n, delta = 1000, 1000**-1.1
    for eps in (2.0, 8.0):
        solver = SCOutputPert(eps, delta, 0.05, 0.1, 0.35, 1.0, calibration="profile")
        mech = SelectedDeltaSCOutputPert(solver, users=n)
        ranked = release_shares(eps, delta, "profile", "auto", GRID_RATIO, GRID_SIZE)
        assert mech.select_fraction == ranked[0] > 0.25
        assert len(mech.grid) == GRID_SIZE and mech.grid[-1] / mech.grid[0] == pytest.approx(
            GRID_RATIO ** (GRID_SIZE - 1)
        )
        assert SelectedDeltaSCOutputPert(solver, select_fraction=0.25, users=n).select_fraction == 0.25  # reproduction
