"""Conflict graphs of paper 002's diameter tests without an n x n matrix.

The edge rule is the one of :func:`fedkl.algorithms.output_perturbation.mean_output_pert.conflict_edges`: u < w conflict iff
``(||v_u - v_w|| + e_u) + e_w > threshold``, with the distance computed from the coordinate
differences in float64 (no Gram-matrix cancellation). The dense construction stores all n^2 distances
(~7 GB at 30,000 users); this one visits the pairs in blocks of :data:`BLOCK` users and never holds more
than one block pair of differences.

Pruning (exact): for each block A of consecutive users, its centre c_A (the mean) and radius
r_A = max ||v_u - c_A|| and its largest error e_A. By the triangle inequality every pair u in A, w in B
has ``||v_u - v_w|| + e_u + e_w <= ||c_A - c_B|| + r_A + r_B + e_A + e_B`` (exactly, for whatever
floating-point centres). The computed distances carry a relative rounding error of about (d + 3) 2^-53
against the exact ones (one rounded subtraction per coordinate, the sum of squares, the square root,
the two additions), far below the factor ``1 + SLACK``, so a block pair whose bound times
``1 + SLACK`` is below the threshold cannot hold an edge of the dense rule and is skipped. Every other
block pair is computed with the dense rule's own expression, element for element. With users whose
vectors are close (the IID case of paper 002's utility theorems: an empty graph) the whole graph costs
O(n d) plus O((n / BLOCK)^2) bounds; with far-apart users it is the dense rule's O(n^2 d) work in
O(BLOCK^2 d) memory.

``tests/algorithms/test_conflict_graph.py`` checks that the edges equal the dense construction's on
random inputs, including distances exactly at the threshold.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 256  # users per block
SLACK = 1e-8  # relative safety factor of the pruning bound (rounding error is ~(d + 3) 1.1e-16)


def _block_bounds(V: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centres, radii, largest errors) of the consecutive blocks of :data:`BLOCK` users."""
    n, d = V.shape
    nb = -(-n // BLOCK)
    pad = nb * BLOCK - n
    counts = torch.full((nb,), float(BLOCK), dtype=torch.float64)
    counts[-1] = BLOCK - pad
    block = torch.arange(n) // BLOCK
    centres = torch.zeros(nb, d, dtype=torch.float64).index_add_(0, block, V) / counts[:, None]
    dist = (V - centres[block]).norm(dim=1)
    radii = torch.zeros(nb, dtype=torch.float64).scatter_reduce_(0, block, dist, "amax")
    emax = torch.zeros(nb, dtype=torch.float64).scatter_reduce_(0, block, e, "amax")
    return centres, radii, emax


def conflict_edges(V: torch.Tensor, threshold: float, err: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """Pairs u < w (sorted) with ``(||v_u - v_w|| + e_u) + e_w > threshold`` (``err`` = e, default 0):
    the same edges, bit for bit, as the dense rule (module docstring), in O(BLOCK^2 d) memory."""
    V = torch.as_tensor(V).to(torch.float64)
    n = V.shape[0]
    if n < 2:
        return []
    e = torch.zeros(n, dtype=torch.float64) if err is None else torch.as_tensor(err).to(torch.float64)
    centres, radii, emax = _block_bounds(V, e)
    spread = radii + emax
    bound = torch.empty(len(centres), len(centres), dtype=torch.float64)
    for a in range(0, len(centres), 64):  # coordinate differences, not cdist's Gram shortcut (cancellation)
        bound[a : a + 64] = (centres[a : a + 64, None, :] - centres[None, :, :]).norm(dim=2)
    bound += spread[:, None] + spread[None, :]
    candidates = torch.triu(~(bound * (1 + SLACK) < threshold))  # NaN/inf bounds stay candidates
    rows, cols = [], []
    for A, B in torch.nonzero(candidates).tolist():
        a0, b0 = A * BLOCK, B * BLOCK
        Va, Vb = V[a0 : a0 + BLOCK], V[b0 : b0 + BLOCK]
        D = (Va[:, None, :] - Vb[None, :, :]).norm(dim=2).numpy()
        D = D + e[a0 : a0 + BLOCK].numpy()[:, None] + e[b0 : b0 + BLOCK].numpy()[None, :]
        far = D > threshold
        if A == B:
            far = np.triu(far, k=1)
        a, b = np.nonzero(far)
        rows.append(a + a0)
        cols.append(b + b0)
    if not rows:
        return []
    a, b = np.concatenate(rows), np.concatenate(cols)
    order = np.lexsort((b, a))
    return list(zip(a[order].tolist(), b[order].tolist()))


__all__ = ["BLOCK", "conflict_edges"]
