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
