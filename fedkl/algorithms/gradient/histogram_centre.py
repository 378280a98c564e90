"""Levy et al. (2021)'s coarse centre: a private per-coordinate histogram of the users' mean gradients
in a randomly rotated basis, the most populated bin of every coordinate (``--conc-centre histogram``
of noisy-gd-conc).

Given the users' vectors g_u (n rows, d columns; the SERVER computes all of this from their answers):

1. rotate: ``z_u = R g_u`` with ``R = H D / sqrt(D)``, D the dimension padded to a power of two, H the
   Walsh-Hadamard matrix, D a diagonal of random signs drawn from a PUBLIC seed (data-independent,
   so R is a public orthogonal matrix: ``R^T R = I``). A row with an entry above 2^512 is rotated
   scaled down by 2^-600 and scaled back (powers of two: exact, but for its entries under 2^-474,
   which become 0), so a finite row never meets inf - inf: a coordinate whose true value exceeds the
   largest double comes out +-inf, never NaN.
2. bin every coordinate: bins of public width w over [-C, C] (B = ceil(2C/w) bins; a coordinate
   outside the range, +-inf included, goes to the nearest end bin), ``counts[j, b] = #{u present :
   z_uj in bin b}``. A user who is not present (its answer failed: a dropout, an invalid reply; the
   backend hands over a zero row and lists it in ``failed``) or whose row is not finite adds NO count.
3. release ``counts + N(0, s^2 I)`` (all D x B counts at once), take the noisy argmax bin of every
   coordinate, its midpoint ``c_j``; the centre is ``R^T c`` (post-processing).

Sensitivity (proof). A user's contribution is a function of its own row (and of whether it answered)
only, and is one of two kinds: nothing (absent, failed, or a non-finite row), or a 0/1 vector with
exactly one 1 in each of the D coordinate rows of the table (a finite row: steps 1-2 put every
coordinate of it in exactly one bin, whatever its size). Neighbouring tables differ by the difference
of two such contributions u, u': ``||u - u'||_2^2`` is 0, D (one of them nothing: D cells move by one)
or at most 2 D (two one-per-row vectors: in each row at most one -1 and one +1, in distinct cells).
Replace-one (the user's records, hence its row and whether it fails, replaced by anything):
``||counts - counts'||_2 <= sqrt(2 D)``, attained when the two versions of the user fall in different
bins on every coordinate. Add-remove (zero-out: the absent user contributes nothing, as a failed one
does): one side is nothing, ``sqrt(D)``, attained by any present user with a finite row. (Had a failed
user's zero row been counted, present vs absent would move 2 D cells: sqrt(2 D) under add-remove.) So
``s = Delta / sqrt(2 rho)`` is rho-zCDP (the Gaussian mechanism), whatever the answers are: any client,
and no answer (huge, non-finite, missing) can abort the computation. (Levy et al. account one histogram
per coordinate; composing D Gaussian histograms of sensitivity sqrt(2) at rho/D each is the same
mechanism.)

Utility (why the width; a bound at a fixed model, heuristic along the run as for the other centres).
If every ``||g_u - g_bar|| <= r`` (r = k C / sqrt(m): the concentration radius of noisy-gd-conc), then
with probability >= 1 - beta over the random signs every rotated coordinate of every ``g_u - g_bar``
is at most ``r L / sqrt(D)``, ``L = sqrt(2 ln(2 n D / beta))`` (Hoeffding: ``(R v)_j`` is a Rademacher
sum of variance proxy ||v||^2 / D). With ``w = 2 r L / sqrt(D)`` the users' j-th coordinates lie in
one interval of length w, i.e. in at most two adjacent bins, the fuller one holding >= n/2 users; when
the noise does not reverse that (n/2 well above s sqrt(2 ln(D B))) the chosen bin meets the interval,
so ``|c_j - (R g_bar)_j| <= w`` and ``||centre - g_bar|| <= sqrt(D) w = 2 r L``: a centre error that
does not grow with sqrt(d)/n like a noisy mean's, at the price of the log factor L.
"""

from __future__ import annotations

import math

import torch

from fedkl.privacy.guarantee import sum_sensitivity

ROTATION_SEED = 1_000_003  # the public seed of the random signs (round t uses ROTATION_SEED + t)


def padded_dim(dim: int) -> int:
    """The rotated dimension D: the smallest power of two >= dim."""
    return 1 << max(0, (int(dim) - 1).bit_length())


def rotation_signs(dim: int, seed: int) -> torch.Tensor:
    """The public diagonal D (+-1, float64) of the rotation, of length padded_dim(dim)."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (padded_dim(dim),), generator=g).to(torch.float64) * 2.0 - 1.0


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x H / sqrt(D)`` over the last axis (size D, a power of two): orthogonal and its own inverse."""
    D = x.shape[-1]
    y = x.clone()
    h = 1
    while h < D:
        y = y.reshape(*x.shape[:-1], D // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], D)
        h *= 2
    return y / math.sqrt(D)


# a row with an entry above 2^BIG_EXPONENT is rotated scaled by 2^-SHIFT (module docstring, step 1): its
# Hadamard sums stay below 2^(1024 - SHIFT + log2 D), finite for any D, and scaling back is exact
BIG_EXPONENT, SHIFT = 512, 600


def rotate(rows: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``R g`` for every row g (zero-padded to D): ``H (D g) / sqrt(D)``. A finite row never gives NaN: a
    row with an entry above 2^512 is rotated at 2^-600 its size and scaled back (exact), so a coordinate
    beyond the largest double is +-inf; every other row is rotated as is (the same bits)."""
    padded = torch.zeros(rows.shape[0], signs.numel(), dtype=torch.float64)
    padded[:, : rows.shape[1]] = rows.to(torch.float64)
    big = padded.abs().amax(1, keepdim=True) > 2.0**BIG_EXPONENT
    if not bool(big.any()):
        return _hadamard(padded * signs)
    one = torch.ones((), dtype=torch.float64)
    down = torch.where(big, one * 2.0**-SHIFT, one)
    return _hadamard(padded * down * signs) * torch.where(big, one * 2.0**SHIFT, one)


def unrotate(z: torch.Tensor, signs: torch.Tensor, dim: int) -> torch.Tensor:
    """``R^T z`` truncated to the first ``dim`` coordinates."""
    return (_hadamard(z.to(torch.float64)) * signs)[..., :dim]


def num_bins(clip: float, width: float) -> int:
    return max(1, math.ceil(2.0 * clip / width))


def histogram_counts(
    rows: torch.Tensor, signs: torch.Tensor, clip: float, width: float, present: torch.Tensor | None = None
) -> torch.Tensor:
    """The (D, B) table of counts: every present user with a finite row adds one to one bin of every
    rotated coordinate; a user not ``present`` (a boolean mask over the rows, False for a failed answer;
    None: all present) or with a non-finite row adds nothing (module docstring)."""
    counted = torch.isfinite(rows).all(1)
    if present is not None:
        counted = counted & present
    rows = torch.where(counted.unsqueeze(1), rows, torch.zeros_like(rows))
    z = rotate(rows, signs)  # finite rows: +-inf at worst, never NaN
    bins = num_bins(clip, width)
    index = torch.clamp(torch.floor((z + clip) / width), 0, bins - 1).to(torch.int64)  # (n, D)
    counts = torch.zeros(signs.numel(), bins, dtype=torch.float64)
    weights = counted.to(torch.float64).expand(signs.numel(), -1)  # (D, n): 0 for a user left out
    counts.scatter_add_(1, index.T.contiguous(), weights.contiguous())
    return counts


def histogram_sensitivity(dim: int, neighbouring: str) -> float:
    """L2 sensitivity of the count table: sqrt(2 D) replace-one, sqrt(D) add-remove (absent and failed users
    add no count; module docstring)."""
    return math.sqrt(padded_dim(dim) * sum_sensitivity(1.0, neighbouring))  # factor 2 or 1 (checks the relation)


def centre_from_counts(
    noisy_counts: torch.Tensor, signs: torch.Tensor, clip: float, width: float, dim: int
) -> torch.Tensor:
    """Post-processing of the released table: every coordinate's fullest bin's midpoint, rotated back."""
    mids = -clip + (torch.argmax(noisy_counts, dim=1).to(torch.float64) + 0.5) * width
    return unrotate(mids.unsqueeze(0), signs, dim)[0]


def bin_width(radius: float, n: int, dim: int, beta: float) -> float:
    """w = 2 r L / sqrt(D), L = sqrt(2 ln(2 n D / beta)) (module docstring)."""
    D = padded_dim(dim)
    return 2.0 * radius * math.sqrt(2.0 * math.log(2.0 * n * D / beta)) / math.sqrt(D)


__all__ = [
    "ROTATION_SEED",
    "bin_width",
    "centre_from_counts",
    "histogram_counts",
    "histogram_sensitivity",
    "num_bins",
    "padded_dim",
    "rotate",
    "rotation_signs",
    "unrotate",
]
