"""Per-user clipping and the failure rule for non-finite answers, shared by every layer that bounds a
user's contribution.

:func:`clip_rows` is THE clip of fedkl: the in-process backend (hence every Flower client, which runs
the same code for its one user) clips its answers with it, and algorithms that re-clip on the server
(DP-FedAvg) call the same function, so a row already inside the ball is returned bit for bit by both.
:func:`zero_nonfinite_rows` is the rule for unclipped answers: a user whose answer is not finite
contributes zero and is reported failed. :data:`CLIP_SLACK` is the relative excess over the clip bound
that a server accepts from a client (the few ulps by which :func:`clip_rows`' result may exceed C).

It sits in the federation layer, below the algorithms, and imports only the problems' row kernels.
"""

from __future__ import annotations

import torch

from fedkl.problems.mirror import row_lp_norms
from fedkl.problems.rowwise import fast_kernels, row_norms

# Relative slack on the clip bound accepted from a client: clip_rows' result can exceed C by a few
# ulps (the in-process backend has the same excess); anything larger is an invalid answer.
CLIP_SLACK = 1e-12


def clip_rows(values: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip every row to L2 norm <= clip; non-finite rows become zero.

    Returns the clipped rows and a boolean mask of the rows that were non-finite. A zero row stays
    zero (no division by its norm).
    """
    if fast_kernels() and values.shape[0]:
        factors = _fast_clip_factors(values, clip)
        if factors is not None:  # one pass; a row inside the ball is multiplied by 1.0: the same bits
            return values * factors.unsqueeze(1), torch.zeros(values.shape[0], dtype=torch.bool)
    bad = ~torch.isfinite(values).all(dim=1)
    values = torch.where(bad.unsqueeze(1), torch.zeros_like(values), values)
    norms = row_norms(values).unsqueeze(1)
    # rows already inside the ball are returned bit-for-bit; the others are scaled onto it
    scaled = values * (clip / torch.clamp(norms, min=torch.finfo(values.dtype).tiny))
    return torch.where(norms > clip, scaled, values), bad


def _fast_clip_factors(values: torch.Tensor, clip: float) -> torch.Tensor | None:
    """Fast kernels: every row's clip factor ``min(1, clip/||row||)`` (exactly 1.0 inside the ball, the
    scaling of :func:`clip_rows` outside), from ONE pass over ``values`` (the norms); None when a norm is
    not finite. A finite norm implies that every entry of its row is finite, so when all norms are finite
    there is no row to zero and no overflow to rescue; otherwise (a non-finite row, or a finite one whose
    squared norm overflows) the caller takes the general path, which zeroes and rescues."""
    norms = torch.linalg.vector_norm(values, dim=1)
    if not bool(torch.isfinite(norms).all()):
        return None
    scaled = clip / torch.clamp(norms, min=torch.finfo(values.dtype).tiny)
    return torch.where(norms > clip, scaled, torch.ones_like(norms))


def clipped_sum(values: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of clip_rows(values, clip)'s rows, its non-finite mask)``. Fast kernels, every row finite:
    the norms and ONE matrix-vector product (the factors of :func:`_fast_clip_factors` times the rows), no
    clipped ``(users, d)`` copy; each row still enters with norm <= clip (same factor as
    :func:`clip_rows`), only the order of the additions differs (fast mode's tolerance,
    ``tests/problems/test_kernels.py``). Otherwise :func:`clip_rows`, then the sum."""
    if fast_kernels() and values.shape[0]:
        factors = _fast_clip_factors(values, clip)
        if factors is not None:
            return factors @ values, torch.zeros(values.shape[0], dtype=torch.bool)
    clipped, bad = clip_rows(values, clip)
    return clipped.sum(0), bad


def clamp_rows(values: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clamp every entry to ``[-bound, bound]`` (l_inf clipping, the dual-norm clip of an l1 geometry);
    non-finite rows become zero. Returns the clamped rows and the mask of the non-finite rows."""
    bad = ~torch.isfinite(values).all(dim=1)
    values = torch.where(bad.unsqueeze(1), torch.zeros_like(values), values)
    return values.clamp(-bound, bound), bad


def clip_rows_dual(values: torch.Tensor, clip: float, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip every row to l_q norm <= clip (q >= 2: the dual-norm clip of an l_p geometry, 1 < p <= 2;
    norms by the batch-invariant :func:`~fedkl.problems.mirror.row_lp_norms`); non-finite rows become
    zero. Rows already inside the ball are returned bit for bit. Returns the rows and the non-finite mask."""
    bad = ~torch.isfinite(values).all(dim=1)
    values = torch.where(bad.unsqueeze(1), torch.zeros_like(values), values)
    norms = row_lp_norms(values, q).unsqueeze(1)
    scaled = values * (clip / torch.clamp(norms, min=torch.finfo(values.dtype).tiny))
    return torch.where(norms > clip, scaled, values), bad


def reject_rows_above(values: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that are non-finite or have L2 norm above ``bound`` (with :data:`CLIP_SLACK`) become zero and
    are reported: the rule for UNCLIPPED answers whose norm a proof bounds (a larger one is invalid)."""
    bad = ~torch.isfinite(values).all(dim=1)
    values = torch.where(bad.unsqueeze(1), torch.zeros_like(values), values)
    bad = bad | (row_norms(values) > bound * (1 + CLIP_SLACK))
    return torch.where(bad.unsqueeze(1), torch.zeros_like(values), values), bad


def zero_nonfinite_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values with every non-finite row set to zero, mask of those rows)``: row ``i`` is
    ``values[i]``, of any shape (a scalar per user, a vector, a ``(k, d)`` block)."""
    finite = torch.isfinite(values)
    bad = ~finite.flatten(1).all(dim=1) if values.dim() > 1 else ~finite
    mask = bad.view((-1,) + (1,) * (values.dim() - 1))
    return torch.where(mask, torch.zeros_like(values), values), bad
