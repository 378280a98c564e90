"""The l_p mirror map psi(x) = ||x||_p^2/(2(p-1)) of paper 001's Alg 6 (fedkl.problems.mirror): grad psi
and grad psi* are inverse maps, match autograd and the conjugate's identities; the Bregman projection
onto a ball centred at the map's centre is radial scaling; the per-row l_q norm is batch-invariant."""

from __future__ import annotations

import math

import pytest
import torch

from fedkl.problems.mirror import (
    bregman,
    check_exponent,
    dual_exponent,
    lp_norm,
    mirror_gradient,
    mirror_inverse,
    mirror_value,
    project_ball,
    row_lp_norms,
)
from fedkl.problems.rowwise import kernels

PS = (1.1, 1.5, 1.8, 2.0)


def _x(seed: int, d: int = 7, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("p", PS)
def test_the_two_gradients_are_inverse_maps(p):
    for seed, scale in ((0, 1.0), (1, 1e-8), (2, 1e6)):
        x = _x(seed, scale=scale)
        theta = mirror_gradient(x, p)
        assert torch.allclose(mirror_inverse(theta, p), x, rtol=1e-12, atol=0)
        assert torch.allclose(mirror_gradient(mirror_inverse(x, p), p), x, rtol=1e-12, atol=0)
        # ||grad psi(x)||_q = ||x||_p/(p-1), and Fenchel-Young holds with equality
        q = dual_exponent(p)
        assert lp_norm(theta, q) == pytest.approx(lp_norm(x, p) / (p - 1), rel=1e-12)
        conj = (p - 1) * lp_norm(theta, q) ** 2 / 2
        assert mirror_value(x, p) + conj == pytest.approx(float(theta @ x), rel=1e-12)
    zero = torch.zeros(4, dtype=torch.float64)
    assert torch.equal(mirror_gradient(zero, p), zero) and torch.equal(mirror_inverse(zero, p), zero)


@pytest.mark.parametrize("scale", (1e-3, 1.0, 1e3))
def test_the_maps_hold_near_p_1_where_unscaled_lq_norms_under_and_overflow(scale):
    """p = 1.001 (q = 1001): lp_norm is scaled by max|x| (row_lp_norms), so ||theta||_q of a dual point with
    entries under 0.5 is not 0 (torch.linalg.vector_norm(theta, ord=q) was, and grad psi* returned the zero
    vector: pg-mirror-descent's inner step went nowhere) nor inf above 2 (NaN iterates)."""
    p = 1.001
    q = dual_exponent(p)
    theta = _x(9, scale=scale)
    x = mirror_inverse(theta, p)
    assert torch.isfinite(x).all() and lp_norm(x, p) == pytest.approx((p - 1) * float(theta.abs().max()), rel=1e-2)
    assert lp_norm(theta, q) == pytest.approx(float(theta.abs().max()) * 7 ** (1 / q), rel=1e-2)
    assert lp_norm(theta, q) == pytest.approx(float(row_lp_norms(theta.unsqueeze(0), q)[0]), rel=1e-15)
    kept = x != 0  # |theta_i / ||theta||_q|^1000 underflows for the smaller entries: float64 cannot invert there
    assert kept.sum() >= 2 and torch.allclose(mirror_gradient(x, p)[kept], theta[kept], rtol=1e-9, atol=0)


@pytest.mark.parametrize("p", PS)
def test_mirror_gradient_is_the_gradient_of_psi_and_psi_is_1_strongly_convex(p):
    x = _x(3).requires_grad_(True)
    (torch.linalg.vector_norm(x, ord=p) ** 2 / (2 * (p - 1))).backward()
    assert torch.allclose(mirror_gradient(x.detach(), p), x.grad, rtol=1e-10, atol=1e-14)
    for seed in range(5):
        a, b = _x(10 + seed), _x(20 + seed)
        assert bregman(a, b, p) >= 0.5 * lp_norm(a - b, p) ** 2 * (1 - 1e-12)
    if p == 2.0:
        assert torch.equal(mirror_gradient(x.detach(), p), x.detach())


@pytest.mark.parametrize("p", (1.3, 2.0))
def test_the_bregman_projection_onto_a_centred_ball_is_radial(p):
    c, r = _x(4, scale=0.5), 0.7
    y = c + 3.0 * _x(5)  # outside the ball
    proj = project_ball(y, c, r, p)
    assert lp_norm(proj - c, p) == pytest.approx(r, rel=1e-12)
    # the projection minimizes D(., y) of psi(. - c) over the ball: no feasible point does better
    best = bregman(proj - c, y - c, p)
    g = torch.Generator().manual_seed(6)
    for _ in range(300):
        z = torch.randn(7, dtype=torch.float64, generator=g)
        z = z * (r * float(torch.rand(1, generator=g, dtype=torch.float64)) ** 0.3 / lp_norm(z, p))
        assert bregman(z, y - c, p) >= best - 1e-12
    inside = c + 0.1 * _x(7) / lp_norm(_x(7), p)
    assert torch.equal(project_ball(inside, c, r, p), inside)


def test_row_norms_are_exact_and_batch_invariant():
    V = torch.randn(9, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    V[3] = 0.0
    V[4] *= 1e200  # powers of it would overflow without the scaling
    for q in (2.0, 3.0, 7.5):
        with kernels("reproducible"):  # batch invariance is the reproducible kernels' (an explicit opt-in)
            rows = row_lp_norms(V, q)
            alone = torch.cat([row_lp_norms(V[i : i + 1], q) for i in range(9)])
        assert torch.isfinite(rows).all()
        # the reference on the row scaled by its largest entry (torch's own norm overflows on row 4)
        big = [max(float(v.abs().max()), 1e-300) for v in V]
        ref = torch.tensor(
            [s * float(torch.linalg.vector_norm(v / s, ord=q)) for v, s in zip(V, big)], dtype=torch.float64
        )
        assert torch.allclose(rows, ref, rtol=1e-13) and rows[3] == 0.0
        assert torch.equal(rows, alone)


@pytest.mark.parametrize("p", (1.0, 0.5, 2.5, math.inf, float("nan"), True))
def test_bad_exponents_are_refused(p):
    with pytest.raises(ValueError, match="1 < p <= 2"):
        check_exponent(p)
