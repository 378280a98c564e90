"""Per-user clipping and the failure rule for non-finite answers, shared by every layer that bounds a
user's contribution.

:func:`clip_rows` is THE clip of fedkl: the in-process backend (hence every Flower client, which runs
the same code for its one user) clips its answers with it, and algorithms that re-clip on the server
(DP-FedAvg) call the same function, so a row already inside the ball is returned bit for bit by both.
:func:`zero_nonfinite_rows` is the rule for unclipped answers: a user whose answer is not finite
contributes zero and is reported failed. :data:`CLIP_SLACK` is the relative excess over the clip bound
that a server accepts from a client (the few ulps by which :func:`clip_rows`' result may exceed C).

It sits in the federation layer, below the algorithms, and imports only the problems' row kernels.

Float32 (and any dtype below float64): the clip is enforced in exact arithmetic, not up to the
dtype's rounding (:func:`_low_precision_clip`, proof there): every returned row's exact L2 norm is
below ``clip``, so a user's float32 answer never exceeds the bound the sensitivity was computed
from; :func:`clipped_sum` then adds the rows in float64 (:meth:`fedkl.federation.base.Answers.total`
too), where the noise is added (:mod:`fedkl.privacy.mechanisms`).
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
    zero (no division by its norm). Below float64 (float32): :func:`_low_precision_clip`, whose rows
    have exact norm < clip.
    """
    if values.dtype != torch.float64 and values.is_floating_point():
        return _low_precision_clip(values, clip)
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
    ``tests/problems/test_kernels.py``). Otherwise :func:`clip_rows`, then the sum. Below float64: the
    rows of :func:`_low_precision_clip` added in float64 (a float64 sum, as ``Answers.total``)."""
    if values.dtype != torch.float64 and values.is_floating_point():
        clipped, bad = _low_precision_clip(values, clip)
        return clipped.to(torch.float64).sum(0), bad
    if fast_kernels() and values.shape[0]:
        factors = _fast_clip_factors(values, clip)
        if factors is not None:
            return factors @ values, torch.zeros(values.shape[0], dtype=torch.bool)
    clipped, bad = clip_rows(values, clip)
    return clipped.sum(0), bad


# clip_rows below float64 refuses a clip bound under this (the proof's subnormal term: _low_precision_clip)
MIN_LOW_PRECISION_CLIP = 2.0**-100


def low_precision_margin(dtype: torch.dtype, d: int) -> float:
    """The relative margin ``m = 2 eps + (d + 4) eps64`` (``eps``: ``dtype``'s machine epsilon) of
    :func:`_low_precision_clip` for rows of ``d`` entries: rows are clipped to ``clip * (1 - m)``."""
    return 2.0 * torch.finfo(dtype).eps + (d + 4) * torch.finfo(torch.float64).eps


def _low_precision_clip(values: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clip_rows` for rows below float64 (float32, bfloat16, float16): non-finite rows become zero,
    and every returned row ``y`` has EXACT norm ``||y|| < clip`` (real arithmetic on the returned
    values), whatever the rounding; a row well inside the ball is returned bit for bit.

    Method. ``n = `` the float64 norm of the row (:func:`~fedkl.problems.rowwise.row_norms` of the
    row cast to float64), ``t = clip (1 - m)`` with ``m`` = :func:`low_precision_margin`. A row with
    ``n <= t`` is returned as is; another is multiplied by ``f = fl(t / n)`` (float64, then rounded to
    the row's dtype), each product rounded to the row's dtype.

    Proof (``u = eps / 2`` the unit roundoff of the row's dtype, ``v = 2^-53`` float64's, ``r`` the
    exact norm of the row ``x``, ``d`` entries, ``clip >=`` :data:`MIN_LOW_PRECISION_CLIP`).
    (1) The float64 norm: every ``x_i^2`` is exact in float64 (a float32 significand has 24 bits, its
    square at most 48 <= 53; float16/bfloat16 fewer) and never overflows (float32's largest square is
    ~1.2e77); a sum of d non-negative terms in any order has relative error at most
    ``(d - 1) v / (1 - (d - 1) v)`` and the square root adds ``v``, so ``n >= r (1 - (d + 1) v)`` (``d v < 0.01``).
    (2) ``t = fl(clip fl(1 - m)) <= clip (1 - m)(1 + 3v)`` (three float64 roundings). Kept rows:
    ``r <= n / (1 - (d + 1) v) <= clip (1 - m)(1 + 3v) / (1 - (d + 1) v) < clip``, as ``m >= 2 (d + 4) v``.
    (3) Scaled rows: ``f = fl(t / n) <= (t / n)(1 + v)``; the cast of ``f`` to the row's dtype and every
    product ``x_i f`` round to nearest: ``|fl(p)| <= |p| (1 + u)`` for a normal result, ``|fl(p)| <= |p| + eta``
    for a subnormal one (``eta``: half the dtype's smallest subnormal). So, by (1),
    ``||y|| <= clip (1 - m)(1 + u)^2 (1 + v)^4 / (1 - (d + 1) v) + sqrt(d) eta``. With ``m = 4u + 2 (d + 4) v``:
    ``(1 - m)(1 + u)^2 <= 1 - 2u - 2 (d + 4) v`` and ``(1 + v)^4 / (1 - (d + 1) v) <= 1 + 2 (d + 4) v`` (as
    ``(d + 1) v < 0.01``), whose product is ``<= 1 - 2u``: ``||y|| <= clip (1 - 2u) + sqrt(d) eta < clip`` whenever
    ``2u clip > sqrt(d) eta``. Float32: ``u = 2^-24``, ``eta = 2^-150``: every ``clip >= 2^-100`` with
    ``d < 2^40`` (the ``(d + 1) v < 0.01`` of (1) already needs ``d < 4e13``). Float16 (``u = 2^-11``,
    ``eta = 2^-25``): refused below ``clip = 2^-14 sqrt(d)``.
    ``tests/federation/test_float32.py`` checks ``||y||^2 < clip^2`` in exact rational arithmetic on adversarial rows.
    """
    if not clip >= MIN_LOW_PRECISION_CLIP or (
        values.dtype == torch.float16 and clip < 2.0**-14 * values.shape[1] ** 0.5
    ):
        raise ValueError(f"clip {clip} is too small to be enforced in {values.dtype} (see _low_precision_clip)")
    bad = ~torch.isfinite(values).all(dim=1)
    if bad.any():
        values = torch.where(bad.unsqueeze(1), torch.zeros_like(values), values)
    norms = row_norms(values.to(torch.float64))
    target = clip * (1.0 - low_precision_margin(values.dtype, values.shape[1]))
    factors = torch.where(norms > target, target / torch.clamp(norms, min=torch.finfo(torch.float64).tiny), 1.0)
    return values * factors.to(values.dtype).unsqueeze(1), bad


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
