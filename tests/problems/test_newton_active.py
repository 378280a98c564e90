"""The certified Newton solver (GeneralizedLinear.newton_local_minimizers) works on the users still iterating
only (issue 34: it rebuilt every user's margins, Hessian and line-search objective until the last user
stopped), and a user's row stays bit for bit what that user computes alone."""

from __future__ import annotations

import pytest
import torch

from fedkl.data.base import UserData
from fedkl.problems.logistic import BinaryLogistic
from fedkl.problems.rowwise import kernels


def _data() -> UserData:
    """40 users of small features (Newton is done in a couple of steps) and one user, the last, of huge ones
    (the logistic loss is nearly piecewise linear there: many damped steps); unequal counts, records shuffled."""
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(3, 9, (41,), generator=g)
    idx = torch.repeat_interleave(torch.arange(41), counts)
    idx = idx[torch.randperm(len(idx), generator=g)]
    X = torch.randn(len(idx), 6, generator=g, dtype=torch.float64) * 0.1
    X[idx == 40] *= 500.0
    y = torch.where(torch.rand(len(idx), generator=g) < 0.5, -1.0, 1.0).double()
    return UserData(X, y, idx, tuple(f"u{i}" for i in range(41)))


@pytest.mark.parametrize("mode", ["reproducible", "fast"])
def test_newton_iterates_on_the_active_users_records_only(mode):
    data = _data()
    problem = BinaryLogistic(6, reg=0.0)
    sizes: list[int] = []  # records in every Hessian the solver builds (score_curvature is called once for each)
    curvature = problem.score_curvature

    def counting(z, y):
        sizes.append(z.shape[0])
        return curvature(z, y)

    problem.score_curvature = counting
    center = torch.full((6,), 0.05, dtype=torch.float64)
    with kernels(mode):
        out = problem.newton_local_minimizers(center, 1e-6, data, tol=1e-12, max_iter=100)
    slow = int((data.user_index == 40).sum())
    assert sizes[0] == data.X.shape[0]  # the first step is everyone's
    assert sizes == sorted(sizes, reverse=True)  # users leave, none comes back
    assert sizes.count(slow) >= 3  # the slow user's last steps: its records alone enter its Hessians
    assert float(out[:, -1].max()) <= 1e-12  # every user converged
    if mode == "reproducible":  # each row bit for bit the user alone
        for u in (0, 17, 40):
            alone = data.subset([u])
            with kernels(mode):
                row = BinaryLogistic(6, reg=0.0).newton_local_minimizers(center, 1e-6, alone, tol=1e-12, max_iter=100)
            assert torch.equal(row[0], out[u])


@pytest.mark.parametrize("mode", ["reproducible", "fast"])
@pytest.mark.parametrize("strength", [1.1e8, 1e10])
def test_newton_users_at_the_rounding_floor_stop_with_the_rows_of_running_to_the_cap(mode, strength):
    """At a huge strength (phased-erm's last phases at 100,000 users: s = 1.1e8, centre ~0.01) no float64
    point has a gradient below tol = 1e-10: every user's full Newton step rounds away after the first step.
    Such a user stops there (issue 34: all of them ran the 100-step cap, each step rebuilding their
    Hessians), with the row a run to the cap gives: bit for bit the row of max_iter = the steps taken before
    the one that rounded away, whose last iterate is that point and whose residual the cap's recomputation.
    Fails on the old solver (100 Hessians)."""
    g = torch.Generator().manual_seed(1)
    U, m, d = 60, 16, 10
    idx = torch.arange(U).repeat_interleave(m)
    idx = idx[torch.randperm(len(idx), generator=g)]
    X = torch.randn(len(idx), d, generator=g, dtype=torch.float64) * 0.3
    y = torch.where(torch.rand(len(idx), generator=g) < 0.5, -1.0, 1.0).double()
    data = UserData(X, y, idx, tuple(f"u{i}" for i in range(U)))
    center = torch.randn(d, generator=g, dtype=torch.float64) * 0.02
    problem = BinaryLogistic(d, reg=0.0)
    sizes: list[int] = []
    curvature = problem.score_curvature
    problem.score_curvature = lambda z, y: (sizes.append(z.shape[0]), curvature(z, y))[1]
    with kernels(mode):
        out = problem.newton_local_minimizers(center, strength, data, tol=1e-10, max_iter=100)
        steps = len(sizes) - 1  # here 1: one step, then every user's second step rounds away
        capped = BinaryLogistic(d, reg=0.0).newton_local_minimizers(center, strength, data, tol=1e-10, max_iter=steps)
    assert 1 <= steps <= 2 and sizes == [U * m] * (steps + 1)  # every user still iterating until it stops
    residual = out[:, -1]
    assert bool((residual > 1e-10).all())  # the floor is above tol: none converged by the gradient test
    assert torch.equal(out, capped)
    # the stated floor r_u <= (L_u + s) 2^-53 ||v_u|| (L_u <= max ||x||^2 / 4), with a factor 2 for the solve's
    # rounding
    L = float((X * X).sum(1).max()) / 4
    assert bool((residual <= 2 * (L + strength) * 2.0**-53 * out[:, :d].norm(dim=1)).all())
