"""Batch invariance: a record's (and a user's) result does not depend on the other rows of the call.

This is what makes the in-process backend and a Flower client (one user alone) release the same
model bit for bit (tests/flower/test_flower.py checks the transports end to end)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fedkl.data import load_dataset
from fedkl.federation.base import ClippedGradient, GradientsAtOwnPoints, GradientsAtPoints, LocalLoss
from fedkl.federation.inprocess import InProcessFederation, clip_rows
from fedkl.problems import make_problem
from fedkl.problems.rowwise import (
    cross_entropy_rows,
    kernels,
    row_matmul,
    row_norms,
    sigmoid,
    softmax_rows,
    softplus,
)

GEN = torch.Generator().manual_seed(0)
# sizes chosen to cross SIMD widths, the ATen naive-kernel threshold (400 multiply-adds) and the
# 32,768-element parallel grain
N = 40_003
CASES = [(37, None), (5, 3), (784, 10), (401, 1)]


@pytest.fixture(autouse=True)
def _reproducible():
    """This file tests the reproducible kernels (batch invariance); the default is fast, so they are opted in."""
    with kernels("reproducible"):
        yield


def _slices():
    for start in (0, 1, 7, 64, 1000, N - 40, N - 9):
        for length in (1, 2, 5, 17, 33):
            if start + length <= N:
                yield slice(start, start + length)


@pytest.mark.parametrize("d,k", CASES)
def test_row_matmul_is_batch_invariant_and_correct(d, k):
    X = torch.randn(N if d < 500 else 5_000, d, dtype=torch.float64, generator=GEN)
    W = (
        torch.randn(d, dtype=torch.float64, generator=GEN)
        if k is None
        else torch.randn(d, k, dtype=torch.float64, generator=GEN)
    )
    full = row_matmul(X, W)
    assert full.shape == (X.shape[0],) if k is None else (X.shape[0], k)
    assert torch.allclose(full, X @ W, rtol=1e-12, atol=1e-12)
    for sl in _slices():
        if sl.stop <= X.shape[0]:
            assert torch.equal(row_matmul(X[sl], W), full[sl])
    assert row_matmul(X[:0], W).shape[0] == 0


def test_elementwise_kernels_are_position_invariant_and_correct():
    t = torch.randn(N, dtype=torch.float64, generator=GEN) * 8
    t[:5] = torch.tensor([0.0, -800.0, 800.0, 1e-300, -1e-300], dtype=torch.float64)

    def stable_softplus(x):  # F.softplus returns x itself above its threshold 20
        return torch.log1p(torch.exp(-x.abs())) + x.clamp_min(0)

    for fn, ref in ((sigmoid, torch.sigmoid), (softplus, stable_softplus)):
        full = fn(t)
        assert torch.isfinite(full).all()
        assert torch.allclose(full, ref(t), rtol=1e-14, atol=1e-300)
        for sl in _slices():
            assert torch.equal(fn(t[sl]), full[sl])


def test_softmax_and_cross_entropy_rows():
    Z = torch.randn(N, 10, dtype=torch.float64, generator=GEN) * 6
    y = torch.randint(0, 10, (N,), generator=GEN)
    P, L = softmax_rows(Z), cross_entropy_rows(Z, y)
    assert torch.allclose(P, torch.softmax(Z, 1), rtol=1e-13, atol=1e-300)
    assert torch.allclose(L, F.cross_entropy(Z, y, reduction="none"), rtol=1e-12, atol=1e-14)
    for sl in _slices():
        assert torch.equal(softmax_rows(Z[sl]), P[sl]) and torch.equal(cross_entropy_rows(Z[sl], y[sl]), L[sl])


def test_row_norms_invariant_and_safe_for_huge_rows():
    V = torch.randn(N, 37, dtype=torch.float64, generator=GEN)
    full = row_norms(V)
    assert torch.allclose(full, V.norm(dim=1), rtol=1e-14)
    for sl in _slices():
        assert torch.equal(row_norms(V[sl]), full[sl])
    big = torch.full((2, 3), 1e200, dtype=torch.float64)
    assert torch.allclose(row_norms(big), torch.full((2,), 3**0.5 * 1e200, dtype=torch.float64))  # torch: inf
    clipped, bad = clip_rows(big, 1.0)  # a huge finite answer is scaled onto the ball, not zeroed
    assert not bad.any() and torch.allclose(row_norms(clipped), torch.ones(2, dtype=torch.float64))


def test_kernels_differentiate_exactly():
    t = torch.randn(6, dtype=torch.float64, generator=GEN, requires_grad=True)
    Z = torch.randn(4, 3, dtype=torch.float64, generator=GEN, requires_grad=True)
    y = torch.tensor([0, 2, 1, 2])
    assert torch.autograd.gradcheck(sigmoid, (t,))
    assert torch.autograd.gradcheck(softplus, (t,))
    assert torch.autograd.gradcheck(lambda z: cross_entropy_rows(z, y), (Z,))
    W = torch.randn(3, 2, dtype=torch.float64, generator=GEN, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: row_matmul(Z.detach(), w), (W,))


@pytest.mark.parametrize(
    "problem,dataset,extra",
    [
        ("logistic", "synthetic-logistic", {}),
        ("least-squares", "synthetic-least-squares", {}),
        ("smoothed-hinge", "synthetic-logistic", {}),
        ("softmax", "synthetic-logistic", {}),
    ],
)
def test_batched_federation_equals_each_user_alone(problem, dataset, extra):
    """Every query of the batched backend equals, bit for bit, the same user's answer computed on a
    one-user dataset (what a Flower client holds)."""
    ds = load_dataset(dataset, seed=5, n_users=23)
    prob = make_problem(problem, ds, reg=0.05)
    fed = InProcessFederation(prob, ds)
    w = torch.randn(prob.num_params, dtype=torch.float64, generator=GEN)
    queries = [
        ClippedGradient(w, 0.05),
        ClippedGradient(w, 1e3),
        LocalLoss(w),
        LocalLoss(w, "test"),
        GradientsAtPoints(torch.randn(11, prob.num_params, dtype=torch.float64, generator=GEN)),
    ]
    own = torch.randn(ds.train.num_users, prob.num_params, dtype=torch.float64, generator=GEN)
    for q in queries + [GradientsAtOwnPoints(own)]:
        batched = fed.compute(q).values
        for u in range(ds.train.num_users):
            # a user alone answers its own point as a one-point GradientsAtPoints (what Flower sends it)
            alone_q = GradientsAtPoints(own[u : u + 1]) if isinstance(q, GradientsAtOwnPoints) else q
            alone = (
                InProcessFederation(prob, dataclasses.replace(ds, train=ds.train.subset([u]), test=ds.test.subset([u])))
                .compute(alone_q)
                .values[0]
            )
            if isinstance(q, GradientsAtOwnPoints):
                alone = alone[0]
            assert torch.equal(batched[u], alone), (type(q).__name__, u)


@pytest.mark.parametrize(
    "problem,dataset",
    [
        ("logistic", "synthetic-logistic"),
        ("least-squares", "synthetic-least-squares"),
        ("huber", "synthetic-least-squares"),
    ],
)
@pytest.mark.parametrize("d", [3, 450])  # 450 > the naive-kernel block of 399: two blocks per margin
def test_glm_gradients_at_own_points_equal_the_per_user_loop(problem, dataset, d):
    """The GLMs' batched gradients_at_own_points equal, bit for bit, the generic loop (one one-point
    gradients_at_points call per user on its records alone)."""
    from fedkl.problems.base import Problem
    from fedkl.problems.glm import GeneralizedLinear

    ds = load_dataset(dataset, seed=3, n_users=9, m=6, d=d)
    prob = make_problem(problem, ds, reg=0.05)
    assert isinstance(prob, GeneralizedLinear)
    data = ds.train
    P = torch.randn(data.num_users, prob.num_params, dtype=torch.float64, generator=GEN)
    batched = prob.gradients_at_own_points(P, data)
    assert torch.equal(batched, Problem.gradients_at_own_points(prob, P, data))


@pytest.mark.parametrize("d", [1, 3, 10, 50])
def test_batched_solve_equals_one_solve_per_matrix(d):
    """The certified Newton solver (GeneralizedLinear.newton_local_minimizers) solves every active user's
    system in one batched call: each solution must be bit for bit the one-matrix solve (what a client
    alone computes), whichever users share the batch."""
    U = 200
    A = torch.randn(U, d, d, dtype=torch.float64, generator=GEN)
    H = A @ A.transpose(1, 2) / d + 0.1 * torch.eye(d, dtype=torch.float64)
    g = torch.randn(U, d, dtype=torch.float64, generator=GEN)
    active = torch.rand(U, generator=GEN) < 0.6
    batched = torch.linalg.solve(H[active], g[active].unsqueeze(-1)).squeeze(-1)
    alone = torch.stack([torch.linalg.solve(H[u], g[u]) for u in torch.nonzero(active).flatten().tolist()])
    assert torch.equal(batched, alone)
