"""The l_p mirror map of paper 001 (Bassily, Guzmán, Menart; Alg 6, via [Bec17]), 1 < p <= 2:

    psi(x)  = ||x||_p^2 / (2 (p - 1))              1-strongly convex w.r.t. ||.||_p
    grad psi(x)  = ||x||_p^(2-p) sign(x) |x|^(p-1) / (p - 1)
    psi*(t) = (p - 1) ||t||_q^2 / 2,   q = p / (p - 1)   (the convex conjugate)
    grad psi*(t) = (p - 1) ||t||_q^(2-q) sign(t) |t|^(q-1)  =  (grad psi)^(-1)(t)

p = 2 is the Euclidean case (psi = ||x||^2/2, both gradients the identity). Both gradients are
computed on the unit vector (``||x|| * sign(u)|u|^(p-1)`` with ``u = x/||x||``), so no power of a tiny
norm under- or overflows; zero maps to zero.

:func:`project_ball` is the Bregman projection of the mirror map CENTRED at ``c`` (``psi(. - c)``) onto
the ball ``{||x - c||_p <= r}``: since ``psi`` is a function of the norm, minimizing
``psi(x - c) - <t, x>`` over a sphere picks the same direction at every radius, so the projection is
radial scaling (what lets Alg 6's inner solver stay closed-form). :func:`row_lp_norms` is the
batch-invariant per-row l_q norm a client clips its answer with (dual-norm clipping).
"""

from __future__ import annotations

import numpy as np
import torch

from fedkl.problems.rowwise import row_matmul


def check_exponent(p: float) -> float:
    """``p`` as a float, refusing anything outside (1, 2] (one-line ValueError)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 1.0 < float(p) <= 2.0:
        raise ValueError(f"the l_p mirror map needs 1 < p <= 2, got p={p!r}")
    return float(p)


def dual_exponent(p: float) -> float:
    """``q = p / (p - 1)`` (2 for p = 2; grows to infinity as p -> 1)."""
    p = check_exponent(p)
    return p / (p - 1.0)


def lp_norm(x: torch.Tensor, p: float) -> float:
    """``||x||_p`` (p >= 1), scaled by max|x| (:func:`row_lp_norms`): for the dual exponent q of a p near 1
    (q = 1001 at p = 1.001) an unscaled |x_i|^q is 0 for every |x_i| < 0.5 and inf above 2."""
    return float(row_lp_norms(x.reshape(1, -1), p)[0])


def _signed_power(u: torch.Tensor, a: float) -> torch.Tensor:
    return torch.sign(u) * u.abs().pow(a)


def mirror_gradient(x: torch.Tensor, p: float) -> torch.Tensor:
    """``grad psi(x)`` (module docstring): a point of the dual space, ``||grad psi(x)||_q = ||x||_p/(p-1)``."""
    p = check_exponent(p)
    norm = lp_norm(x, p)
    if norm == 0.0:
        return torch.zeros_like(x)
    return (norm / (p - 1.0)) * _signed_power(x / norm, p - 1.0)


def mirror_inverse(theta: torch.Tensor, p: float) -> torch.Tensor:
    """``grad psi*(theta)``, the inverse of :func:`mirror_gradient`: ``||grad psi*(t)||_p = (p-1)||t||_q``."""
    p = check_exponent(p)
    q = p / (p - 1.0)
    norm = lp_norm(theta, q)
    if norm == 0.0:
        return torch.zeros_like(theta)
    return ((p - 1.0) * norm) * _signed_power(theta / norm, q - 1.0)


def mirror_value(x: torch.Tensor, p: float) -> float:
    """``psi(x) = ||x||_p^2 / (2 (p - 1))``."""
    p = check_exponent(p)
    return lp_norm(x, p) ** 2 / (2.0 * (p - 1.0))


def bregman(x: torch.Tensor, y: torch.Tensor, p: float) -> float:
    """``D_psi(x, y) = psi(x) - psi(y) - <grad psi(y), x - y>`` (>= ||x - y||_p^2 / 2)."""
    return mirror_value(x, p) - mirror_value(y, p) - float(mirror_gradient(y, p) @ (x - y))


def project_ball(x: torch.Tensor, center: torch.Tensor, radius: float, p: float) -> torch.Tensor:
    """The Bregman projection of ``psi(. - center)`` onto ``{||x - center||_p <= radius}``: radial
    scaling of ``x - center`` (module docstring)."""
    diff = x - center
    norm = lp_norm(diff, p)
    return x if norm <= radius else center + diff * (radius / norm)


def row_lp_norms(V: torch.Tensor, q: float) -> torch.Tensor:
    """``||V_i||_q`` for every row of ``(N, d)``, batch-invariant (the power in numpy, the row sums by
    :func:`~fedkl.problems.rowwise.row_matmul`): each row is scaled by its largest entry first, so no
    power under- or overflows. ``q = 2``: the same values as :func:`~fedkl.problems.rowwise.row_norms`
    up to rounding."""
    if V.shape[0] == 0:
        return V.new_zeros(0)
    scale = V.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    U = (V.abs() / safe.unsqueeze(1)).detach().cpu().numpy()
    powered = torch.from_numpy(np.power(U, q)).to(V.dtype)
    sums = row_matmul(powered, torch.ones(V.shape[1], dtype=V.dtype))
    roots = torch.from_numpy(np.power(sums.cpu().numpy(), 1.0 / q)).to(V.dtype)
    return torch.where(scale > 0, scale * roots, torch.zeros_like(scale))


__all__ = [
    "bregman",
    "check_exponent",
    "dual_exponent",
    "lp_norm",
    "mirror_gradient",
    "mirror_inverse",
    "mirror_value",
    "project_ball",
    "row_lp_norms",
]
