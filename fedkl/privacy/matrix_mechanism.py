"""The matrix mechanism for prefix sums (DP-FTRL's correlated noise): factorizations, their exact
sensitivity under (b, k)-participation, and streaming noise generators. Pure math.

**Mechanism.** A stream x_0, ..., x_{T-1} (each x_t in R^d: a round's sum of clipped user answers)
and its prefix sums S = A x, A the T x T lower-triangular all-ones matrix. A factorization A = B C
with C lower-triangular (T x T, invertible) releases ``C x + Z`` (Z: T x d i.i.d. N(0, sigma^2)) and
post-processes it into ``S^ = B (C x + Z) = A x + B Z``. Row t of S^ needs only x_0..x_t, so S^_t is
released at round t. It is ONE Gaussian mechanism on ``C x``: with L2 (Frobenius) sensitivity
``Delta`` of ``x -> C x`` it is ``Delta/sigma``-GDP, i.e. ``rho = Delta^2 / (2 sigma^2)``-zCDP
(Bun & Steinke 2016, Prop. 1.6), and its exact (eps, delta) is the mu-GDP profile,
``mu = Delta/sigma`` (:func:`fedkl.privacy.zcdp.eps_gaussian`).

**Sensitivity under (b, k)-participation.** A user takes part in rounds pi (a subset of 0..T-1 with
pairwise gaps >= b, |pi| <= k) and adds g_t (||g_t|| <= c) at each t in pi; neighbouring streams
differ by ``sum_{t in pi} e_t g_t^T``. Then
``||C sum_t e_t g_t^T||_F^2 = sum_{s,t in pi} G_st <g_s, g_t>``, G = C^T C. **If G >= 0 entrywise**
each term is at most ``G_st c^2`` (Cauchy-Schwarz), attained by g_t all equal, so

    Delta = c * max_pi sqrt(1_pi^T G 1_pi)        (Choquette-Choo et al. 2023, Thm 2 of arXiv 2211.06530)

and adding a participation never lowers it (G >= 0). Every factorization here has G >= 0 (its
entries are >= 0); :func:`max_participation_sensitivity` computes the max over patterns exactly:

* :class:`Toeplitz` (:class:`BandedToeplitz`, the BLTs :class:`BLT` and :class:`OptimizedBLT`: C
  lower-triangular Toeplitz with coefficients c_0 >= c_1 >= ... >= 0, checked on construction; a
  BLT keeps them so by its constraints theta in [0, 1), omega >= 0, sum omega <= 1):
  the max is at pi* = {0, b, 2b, ..., (K-1) b}, K = min(k, ceil(T/b)). Proof: G_st (s <= t) =
  h(t - s, T - 1 - t) with h(D, L) = sum_{j=0}^{L} c_j c_{j+D}, non-decreasing in L (terms >= 0)
  and non-increasing in D (h(D,L) - h(D+1,L) = sum_j c_j (c_{j+D} - c_{j+D+1}) >= 0). For any valid
  pi = {p_1 < ... < p_m}, m <= K, p_i >= (i-1) b =: p*_i, and |p*_i - p*_j| = |i-j| b <= |p_i - p_j|,
  max(p*_i, p*_j) <= max(p_i, p_j): so G_{p*_i p*_j} >= G_{p_i p_j} term by term, and pi* has K >= m
  terms, all >= 0. Hence 1_pi^T G 1_pi <= 1_pi*^T G 1_pi*.
* :class:`Tree` (binary-tree aggregation, Kairouz et al. 2021): no such order holds, so an exact
  dynamic program over the tree (:func:`_tree_max`): a subtree's best value for each participation
  count and the empty leaves before its first / after its last participation (capped at b - 1,
  all the separation constraint between two subtrees looks at); ``1_pi^T G 1_pi`` is the sum over
  the tree nodes that are rows of C of (participations inside)^2, which adds up over the tree.

All are checked against :func:`brute_force_max` (every pattern) in tests/privacy/test_matrix_mechanism.py.

**Noise in small memory.** :class:`TreeNoise` keeps one noise vector per node of the current
prefix's dyadic decomposition (at most floor(log2 T) + 1); :class:`ToeplitzNoise` keeps a ring
buffer of the last band - 1 draws of ``C^{-1} Z`` and their running sum; :class:`BLTNoise` m geometric
buffers (both BLTs). All return row t of
``B Z`` for the Z rows fed in order (tests: equal to the dense ``B Z``).

**Optimised BLT.** :class:`OptimizedBLT` chooses its m buffers' (theta, omega) for the run's public
(T, b, k) by minimising the mean squared error of the prefix sums at unit noise multiplier,
``Delta_K^2 ||A C^{-1}||_F^2 / T`` (:func:`prefix_sum_error`), deterministically
(:func:`optimized_blt_parameters`), inside the constraints above, so its sensitivity is the same exact
closed form.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import numpy as np
import torch

# work cap of the exact tree program: about 2 P k^2 b^2 elementary operations (P = 2^ceil(log2 T))
TREE_WORK_LIMIT = 4e9


def _check_pattern_args(T: int, b: int, k: int) -> None:
    for name, v in (("rounds T", T), ("min separation b", b), ("max participations k", k)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v}")


def max_participations(T: int, b: int, k: int) -> int:
    """The most rounds a user can take part in: min(k, ceil(T / b))."""
    _check_pattern_args(T, b, k)
    return min(k, -(-T // b))


def prefix_matrix(T: int) -> np.ndarray:
    """A: the T x T lower-triangular all-ones matrix (prefix sums)."""
    return np.tril(np.ones((T, T)))


class Toeplitz:
    """C = lower-triangular Toeplitz with coefficients ``coeffs`` (c_0 > 0, then non-negative and
    non-increasing: what the closed-form sensitivity's proof needs, checked), zero beyond them."""

    name = "toeplitz"

    def __init__(self, T: int, coeffs: np.ndarray) -> None:
        _check_pattern_args(T, 1, 1)
        c = np.asarray(coeffs, dtype=float)[: int(T)]
        if not (c[0] > 0 and (c >= 0).all() and (np.diff(c) <= 0).all()):
            raise ValueError("a Toeplitz factor here needs coefficients c_0 > 0, then >= 0 and non-increasing")
        self.T, self.coeffs, self.band = int(T), c, len(c)

    def matrix(self) -> np.ndarray:
        C = np.zeros((self.T, self.T))
        for j, cj in enumerate(self.coeffs):
            C += cj * np.eye(self.T, k=-j)
        return C

    def sensitivity_squares(self, b: int, k: int) -> list[float]:
        """``[Delta_1^2, ..., Delta_K^2]`` per unit of c: the max over patterns with at most j
        participations, attained at {0, b, ..., (j-1) b} (module docstring's proof)."""
        K = max_participations(self.T, b, k)
        v = np.zeros(self.T)
        out = []
        for i in range(K):
            start = i * b
            span = min(self.band, self.T - start)
            v[start : start + span] += self.coeffs[:span]
            out.append(float(v @ v))
        return out


def sqrt_coefficients(n: int) -> np.ndarray:
    """The first n coefficients of (1 - x)^(-1/2): ``binom(2j, j) / 4^j`` = 1, 1/2, 3/8, 5/16, ..."""
    c = np.ones(n)
    for j in range(1, n):
        c[j] = c[j - 1] * (2 * j - 1) / (2 * j)
    return c


class BandedToeplitz(Toeplitz):
    """The first ``band`` coefficients of (1 - x)^(-1/2) (positive and decreasing), zero beyond the
    band. ``band = T`` is the square-root factorization A = C^2 (Fichtenberger et al. 2023); ``band = 1``
    is C = I (independent noise on every round's sum). B = A C^{-1}; noise in O(band) memory."""

    name = "banded"

    def __init__(self, T: int, band: int) -> None:
        if int(band) != band or not 1 <= band:
            raise ValueError(f"band must be a positive integer, got {band}")
        super().__init__(T, sqrt_coefficients(int(min(band, T))))

    def noise(self) -> "ToeplitzNoise":
        return ToeplitzNoise(self.coeffs)

    @property
    def memory(self) -> int:
        return self.band - 1


class BufferedToeplitz(Toeplitz):
    """A BLT factor (buffered linear Toeplitz; McMahan, Xu, Zhang 2024; Dvijotham et al. 2024) from its
    m buffer parameters: ``c_0 = 1``, ``c_j = sum_i omega_i theta_i^(j - 1)`` (j >= 1), with
    ``theta_i in [0, 1)``, ``omega_i >= 0`` and ``sum_i omega_i <= 1``. These constraints make c
    non-negative and non-increasing (c_1 = sum omega <= 1 = c_0; every term decays after), which the
    Toeplitz sensitivity's proof (worst pattern {0, b, ..., (K-1) b}) needs: asserted here, and c is
    built by running products so that rounding keeps it monotone. Noise in O(m) memory:
    :class:`BLTNoise`, m geometric buffers of y = C^{-1} Z."""

    def __init__(self, T: int, omegas: np.ndarray, decays: np.ndarray) -> None:
        _check_pattern_args(T, 1, 1)
        self.omegas = np.asarray(omegas, dtype=float)
        self.decays = np.asarray(decays, dtype=float)
        if not (
            self.omegas.shape == self.decays.shape
            and (self.decays >= 0).all()
            and (self.decays < 1).all()
            and (self.omegas >= 0).all()
            and self.omegas.sum() <= 1
        ):
            raise ValueError("BLT parameters need theta in [0, 1), omega >= 0 and sum(omega) <= 1")
        super().__init__(T, blt_coefficients(int(T), self.omegas, self.decays))

    def noise(self) -> "BLTNoise":
        return BLTNoise(self.omegas, self.decays)

    @property
    def memory(self) -> int:
        return len(self.decays)


def blt_coefficients(T: int, omegas: np.ndarray, decays: np.ndarray) -> np.ndarray:
    """c_0 = 1, c_j = sum_i omega_i theta_i^(j - 1): powers as running products and every row summed in the
    same order, so that rounding keeps c non-increasing."""
    c = np.ones(T)
    if T > 1:
        powers = np.vstack([np.ones(len(decays)), np.cumprod(np.tile(decays, (T - 2, 1)), axis=0)])
        c[1:] = (powers * omegas).sum(axis=1)
    return c


def _check_buffers(buffers: int) -> int:
    if int(buffers) != buffers or buffers < 1:
        raise ValueError(f"buffers must be a positive integer, got {buffers}")
    return int(buffers)


def chebyshev_blt_parameters(m: int) -> tuple[np.ndarray, np.ndarray]:
    """(omega, theta) of the m-point Gauss-Chebyshev quadrature of ``binom(2n, n)/4^n = (1/pi)
    int_0^1 t^n (t (1 - t))^(-1/2) dt``: theta_j = cos^2((2j - 1) pi / (4m)), c_n = sum_j theta_j^n / m,
    i.e. omega_j = theta_j / m."""
    decays = np.cos((2 * np.arange(1, m + 1) - 1) * np.pi / (4 * m)) ** 2
    return decays / m, decays


class BLT(BufferedToeplitz):
    """The square-root factor's m-buffer Gauss-Chebyshev approximation (:func:`chebyshev_blt_parameters`):
    equal to the square-root factor's coefficients for n < 2m, geometric decay after (a smooth band).
    Not optimised for the participation pattern (:class:`OptimizedBLT` is)."""

    name = "blt"

    def __init__(self, T: int, buffers: int) -> None:
        super().__init__(T, *chebyshev_blt_parameters(_check_buffers(buffers)))


# L-BFGS-B iteration cap of the BLT optimisation (the loss is smooth and 2m + 1-dimensional)
BLT_OPT_MAXITER = 200
_LOGIT_BOUND = 30.0  # sigmoid(30) = 1 - 9e-14 < 1: theta and sum(omega) stay strictly below 1


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _blt_from_free(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The smooth reparameterisation: theta = sigmoid(a), omega = sigmoid(s) * softmax(u)."""
    m = (len(x) - 1) // 2
    a, u, s = x[:m], x[m : 2 * m], x[2 * m]
    soft = np.exp(u - u.max())
    soft = soft / soft.sum()
    omegas = _sigmoid(s) * soft
    total = omegas.sum()
    if total > 1.0:  # rounding guard (sigmoid(s) < 1)
        omegas = omegas / total
    return omegas, _sigmoid(a)


def _blt_loss_fast(omegas: np.ndarray, decays: np.ndarray, T: int, b: int, K: int) -> float:
    """``Delta_K^2 * ||A C^{-1}||_F^2 / T`` in O(T m): C(x) = P(x) / Q(x), Q = prod (1 - theta_i x),
    P = Q + x sum_i omega_i prod_{j != i} (1 - theta_j x); C^{-1}'s coefficients are the impulse
    response of Q / P, the worst pattern's column C 1_pi* the comb {0, b, .., (K-1) b} filtered by P / Q."""
    from scipy.signal import lfilter

    q = _series(decays)
    p = q.copy()
    for i in range(len(decays)):
        others = _series(np.delete(decays, i))
        p[1 : 1 + len(others)] += omegas[i] * others
    impulse = np.zeros(T)
    impulse[0] = 1.0
    with np.errstate(all="ignore"):
        d = lfilter(q, p, impulse)
        comb = np.zeros(T)
        comb[: (K - 1) * b + 1 : b] = 1.0
        column = lfilter(p, q, comb)
        e = np.cumsum(d)
        loss = float(column @ column) * float((T - np.arange(T)) @ (e * e)) / T
    return loss if math.isfinite(loss) else 1e300


def _series(roots: np.ndarray) -> np.ndarray:
    """Coefficients (ascending powers of x) of prod_i (1 - r_i x)."""
    out = np.ones(1)
    for r in roots:
        out = np.append(out, 0.0) - r * np.insert(out, 0, 0.0)
    return out


_BLT_CACHE: dict[tuple[int, int, int, int], tuple[np.ndarray, np.ndarray]] = {}


def optimized_blt_parameters(T: int, b: int, k: int, buffers: int) -> tuple[np.ndarray, np.ndarray]:
    """(omega, theta) minimising :func:`prefix_sum_error` of the m-buffer BLT for (T, b, k): L-BFGS-B over
    the smooth reparameterisation (:func:`_blt_from_free`, logits bounded by +-30) from the
    Gauss-Chebyshev start, at most ``BLT_OPT_MAXITER`` iterations; never worse than the start.
    Deterministic (fixed start, no randomness): anyone gets the same C from the public (T, b, k, m) on the
    same numpy/scipy build. Privacy never rests on the optimiser: the sensitivity is computed from the C
    it returns. Cached by (T, b, k, m)."""
    from scipy.optimize import minimize

    _check_pattern_args(T, b, k)
    m = _check_buffers(buffers)
    key = (int(T), int(b), int(k), m)
    if key not in _BLT_CACHE:
        K = max_participations(T, b, k)
        omega0, theta0 = chebyshev_blt_parameters(m)
        total0 = omega0.sum()
        x0 = np.concatenate([np.log(theta0 / (1 - theta0)), np.log(omega0 / total0), [np.log(total0 / (1 - total0))]])
        x0 = np.clip(x0, -_LOGIT_BOUND, _LOGIT_BOUND)

        def loss(x: np.ndarray) -> float:
            return _blt_loss_fast(*_blt_from_free(x), key[0], key[1], K)

        res = minimize(
            loss,
            x0,
            method="L-BFGS-B",
            bounds=[(-_LOGIT_BOUND, _LOGIT_BOUND)] * len(x0),
            options={"maxiter": BLT_OPT_MAXITER},
        )
        best = res.x if res.fun <= loss(x0) else x0
        _BLT_CACHE[key] = _blt_from_free(best)
    omegas, decays = _BLT_CACHE[key]
    return omegas.copy(), decays.copy()


class OptimizedBLT(BufferedToeplitz):
    """An m-buffer BLT optimised for the run's participation pattern (T, b, k) as in McMahan, Xu, Zhang
    2024 / Dvijotham et al. 2024: (omega, theta) from :func:`optimized_blt_parameters` (mean squared
    error of the noisy prefix sums, ``Delta_K^2 ||A C^{-1}||_F^2 / T``), within the constraints that keep
    the closed-form Toeplitz sensitivity exact (the papers' BLTs are not constrained so)."""

    name = "blt-opt"

    def __init__(self, T: int, buffers: int, b: int, k: int) -> None:
        super().__init__(T, *optimized_blt_parameters(T, b, k, buffers))


def prefix_sum_error(fact: "Toeplitz | Tree", b: int, k: int) -> float:
    """The mean squared error of the noisy prefix sums per unit of c and of the noise multiplier
    sigma / Delta: ``Delta_K^2 * ||A C^{-1}||_F^2 / T`` (dense, for tests and reports)."""
    B = prefix_matrix(fact.T) @ np.linalg.inv(fact.matrix())
    return fact.sensitivity_squares(b, k)[-1] * float((B * B).sum()) / fact.T


class Tree:
    """Binary-tree aggregation as a T x T factorization: row r of C is the dyadic interval that the
    prefix of length r + 1 adds, ``[r + 1 - 2^j, r + 1)`` with 2^j the lowest set bit of r + 1 (every
    other node of the full tree is never used by a prefix; these are the left children and roots
    within [0, T), one per round). B = A C^{-1} sums the nodes of a prefix's dyadic decomposition.
    A single participation (k = 1) has ``Delta^2 = max_t #rows containing t = ceil(log2(T + 1))``,
    dp-accounting's tree depth."""

    name = "tree"

    def __init__(self, T: int) -> None:
        _check_pattern_args(T, 1, 1)
        self.T = int(T)

    @staticmethod
    def node_of_row(r: int) -> tuple[int, int]:
        end = r + 1
        return end - (end & -end), end

    def matrix(self) -> np.ndarray:
        C = np.zeros((self.T, self.T))
        for r in range(self.T):
            s, e = self.node_of_row(r)
            C[r, s:e] = 1.0
        return C

    def noise(self) -> "TreeNoise":
        return TreeNoise()

    @property
    def memory(self) -> int:
        return int(math.log2(self.T)) + 1

    def sensitivity_squares(self, b: int, k: int) -> list[float]:
        """``[Delta_1^2, ..., Delta_K^2]`` per unit of c, by the exact tree program."""
        K = max_participations(self.T, b, k)
        best = _tree_max(self.T, 1 if K == 1 else min(b, self.T), K)
        return [max(best[: j + 1]) for j in range(K)]


FACTORIZATIONS = ("tree", "banded", "blt", "blt-opt")


def make_factorization(
    name: str, T: int, band: int | None = None, buffers: int = 4, b: int = 1, k: int | None = None
) -> Toeplitz | Tree:
    """``tree``, ``banded`` (``band``), ``blt`` (``buffers``) or ``blt-opt`` (``buffers``, optimised for
    the pattern (T, b, k); k None: every round)."""
    if name == "tree":
        return Tree(T)
    if name == "banded":
        if band is None:
            raise ValueError("the banded factorization needs a band")
        return BandedToeplitz(T, band)
    if name == "blt":
        return BLT(T, buffers)
    if name == "blt-opt":
        return OptimizedBLT(T, buffers, b, T if k is None else k)
    raise ValueError(f"factorization must be one of {FACTORIZATIONS}, got {name!r}")


def max_participation_sensitivity(fact: Toeplitz | Tree, b: int, k: int) -> float:
    """Delta per unit of the per-round norm bound c: max over (b, k) patterns of ||C 1_pi||."""
    return math.sqrt(fact.sensitivity_squares(b, k)[-1])


def brute_force_max(C: np.ndarray, b: int, k: int) -> list[float]:
    """Reference for tests (small T): ``[max_{pi, |pi| = j} 1_pi^T C^T C 1_pi for j = 1..K]`` over
    every pattern with gaps >= b, enumerated (non-decreasing in j only when C^T C >= 0)."""
    T = C.shape[1]
    G = C.T @ C
    K = max_participations(T, b, k)
    out = []
    for j in range(1, K + 1):
        best = -math.inf
        for pi in itertools.combinations(range(T), j):
            if all(q - p >= b for p, q in zip(pi, pi[1:])):
                idx = list(pi)
                best = max(best, float(G[np.ix_(idx, idx)].sum()))
        out.append(best)
    return out


def _shift(F: np.ndarray, by: int, axis: int, cap: int) -> np.ndarray:
    """Offsets (along ``axis``) moved by ``by`` empty leaves, capped at ``cap`` (max-merge)."""
    out = np.full_like(F, -np.inf)
    src = np.moveaxis(F, axis, 0)
    dst = np.moveaxis(out, axis, 0)
    if by < cap:
        dst[by:cap] = src[: cap - by]
        dst[cap] = src[cap - by :].max(0)
    else:
        dst[cap] = src.max(0)
    return out


def _max_plus(L: np.ndarray, R: np.ndarray, cap: int) -> np.ndarray:
    """``out[aL, zR] = max over zL + aR >= cap of L[aL, zL] + R[aR, zR]`` (the gap between the left
    subtree's last participation and the right one's first is zL + aR + 1 >= b)."""
    suffix = np.maximum.accumulate(L[:, ::-1], axis=1)[:, ::-1]  # suffix[a, t] = max_{z >= t} L[a, z]
    M = suffix[:, cap - np.arange(cap + 1)]  # M[aL, aR] = max_{zL >= cap - aR} L[aL, zL]
    out = np.empty_like(L)
    step = max(1, int(2e7 // (cap + 1) ** 2))
    for i in range(0, cap + 1, step):
        out[i : i + step] = (M[i : i + step, :, None] + R[None, :, :]).max(1)
    return out


def _tree_max(T: int, b: int, K: int) -> list[float]:
    """``[max over patterns with exactly j participations of sum over rows of C of (count)^2, j = 1..K]``
    for :class:`Tree`, by dynamic programming over the complete binary tree on 2^ceil(log2 T) leaves
    (leaves >= T cannot take part). A subtree's table F[c][a, z]: the best value inside it with c
    participations, a (z) empty leaves before the first (after the last), capped at b - 1."""
    P = 1 << max(0, (T - 1).bit_length())
    if b == 1:
        return _tree_max_unseparated(T, P, K)
    cap = b - 1
    if 2.0 * P * K * K * (cap + 1) ** 2 > TREE_WORK_LIMIT:
        raise ValueError(
            f"the exact tree sensitivity for T={T}, b={b}, k={K} is too costly to compute here; use the banded "
            "factorization (closed form) or smaller b"
        )

    def leaf(t: int) -> dict:
        if t >= T:
            return {}
        F = np.full((cap + 1, cap + 1), -np.inf)
        F[0, 0] = 1.0 if t % 2 == 0 else 0.0  # a leaf is a row of C when it is a left child (t even)
        return {1: F}

    level = [leaf(t) for t in range(P)]
    size = 1
    while len(level) > 1:
        nxt = []
        for m in range(len(level) // 2):
            FL, FR = level[2 * m], level[2 * m + 1]
            out: dict[int, np.ndarray] = {}

            def put(c: int, F: np.ndarray) -> None:
                out[c] = F if c not in out else np.maximum(out[c], F)

            for c, F in FL.items():
                put(c, _shift(F, size, 1, cap))
            for c, F in FR.items():
                put(c, _shift(F, size, 0, cap))
            for cl, Fl in FL.items():
                for cr, Fr in FR.items():
                    if cl + cr <= K:
                        put(cl + cr, _max_plus(Fl, Fr, cap))
            end = (2 * m + 2) * size
            if m % 2 == 0 and end <= T:  # this node is a row of C (a left child or the root, inside [0, T))
                out = {c: F + c * c for c, F in out.items()}
            nxt.append({c: F for c, F in out.items() if np.isfinite(F).any()})
        level = nxt
        size *= 2
    root = level[0]
    return [float(root[j].max()) if j in root else -math.inf for j in range(1, K + 1)]


def _tree_max_unseparated(T: int, P: int, K: int) -> list[float]:
    """:func:`_tree_max` for b = 1 (no separation to track): a subtree's table is one vector over the
    participation count, combined by a max-plus convolution."""
    level = []
    for t in range(P):
        F = np.full(K + 1, -np.inf)
        F[0] = 0.0
        if t < T:
            F[1] = 1.0 if t % 2 == 0 else 0.0
        level.append(F)
    size = 1
    while len(level) > 1:
        nxt = []
        for m in range(len(level) // 2):
            FL, FR = level[2 * m], level[2 * m + 1]
            out = np.full(K + 1, -np.inf)
            for cl in np.flatnonzero(np.isfinite(FL)):
                out[cl:] = np.maximum(out[cl:], FL[cl] + FR[: K + 1 - cl])
            if m % 2 == 0 and (2 * m + 2) * size <= T:
                out = out + np.arange(K + 1) ** 2
            nxt.append(out)
        level = nxt
        size *= 2
    return [float(v) for v in level[0][1:]]


class TreeNoise:
    """Row t of B Z for :class:`Tree`, fed Z's rows in order: the sum of the noises of the nodes in
    the dyadic decomposition of [0, t + 1). Keeps at most floor(log2 T) + 1 vectors (one per set bit)."""

    def __init__(self) -> None:
        self.t = 0
        self.stack: list[tuple[int, torch.Tensor]] = []

    def step(self, z: torch.Tensor) -> torch.Tensor:
        end = self.t + 1
        level = (end & -end).bit_length() - 1  # the new node [end - 2^level, end) merges the lower ones
        while self.stack and self.stack[-1][0] < level:
            self.stack.pop()
        self.stack.append((level, z))
        self.t += 1
        total = torch.zeros_like(z)
        for _, v in self.stack:
            total = total + v
        return total


class ToeplitzNoise:
    """Row t of B Z = A C^{-1} Z for a lower-triangular Toeplitz C (coefficients ``coeffs``, c_0 > 0):
    y_t = (z_t - sum_{j=1}^{band-1} c_j y_{t-j}) / c_0 (a ring buffer of the last band - 1 values of
    y = C^{-1} Z) and the running sum of y."""

    def __init__(self, coeffs: np.ndarray) -> None:
        self.coeffs = [float(c) for c in coeffs]
        self.recent: deque = deque(maxlen=max(len(self.coeffs) - 1, 0))
        self.total: torch.Tensor | None = None

    def step(self, z: torch.Tensor) -> torch.Tensor:
        y = z
        for j, prev in enumerate(reversed(self.recent), start=1):  # prev = y_{t-j}
            y = y - self.coeffs[j] * prev
        y = y / self.coeffs[0]
        if self.recent.maxlen:
            self.recent.append(y)
        self.total = y.clone() if self.total is None else self.total + y
        return self.total.clone()


class BLTNoise:
    """Row t of B Z for a :class:`BufferedToeplitz` C (c_0 = 1, c_j = sum_i omega_i theta_i^(j-1)):
    z_t = (C y)_t = y_t + sum_i omega_i b_i with buffers b_i = sum_{s < t} theta_i^(t - 1 - s) y_s, so
    y_t = z_t - sum_i omega_i b_i, then b_i <- theta_i b_i + y_t; returns the running sum of y. Keeps
    the m buffers and the sum."""

    def __init__(self, omegas: np.ndarray, decays: np.ndarray) -> None:
        self.omegas = [float(w) for w in omegas]
        self.decays = [float(t) for t in decays]
        self.buffers: list[torch.Tensor] | None = None
        self.total: torch.Tensor | None = None

    def step(self, z: torch.Tensor) -> torch.Tensor:
        if self.buffers is None:
            self.buffers = [torch.zeros_like(z) for _ in self.decays]
            self.total = torch.zeros_like(z)
        y = z
        for w, buf in zip(self.omegas, self.buffers):
            y = y - w * buf
        self.buffers = [t * buf + y for t, buf in zip(self.decays, self.buffers)]
        self.total = self.total + y
        return self.total.clone()


__all__ = [
    "BLT",
    "BLTNoise",
    "BandedToeplitz",
    "BufferedToeplitz",
    "OptimizedBLT",
    "Toeplitz",
    "FACTORIZATIONS",
    "Tree",
    "TreeNoise",
    "ToeplitzNoise",
    "brute_force_max",
    "make_factorization",
    "max_participation_sensitivity",
    "max_participations",
    "optimized_blt_parameters",
    "prefix_matrix",
    "prefix_sum_error",
]
