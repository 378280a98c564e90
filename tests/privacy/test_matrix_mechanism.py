"""The matrix mechanism's math (fedkl/privacy/matrix_mechanism.py): factorizations A = B C, the exact
sensitivity under (b, k)-participation against enumeration of every pattern, the vector-valued
worst case, the streaming noise against the dense B Z, and the accounting anchors (dp-accounting's
tree test; the published production rho's)."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant

from fedkl.privacy import matrix_mechanism as mm
from fedkl.privacy.zcdp import eps_gaussian

FACTS = {
    "tree": lambda T: mm.Tree(T),
    "banded-3": lambda T: mm.BandedToeplitz(T, 3),
    "banded-full": lambda T: mm.BandedToeplitz(T, T),
    "banded-1": lambda T: mm.BandedToeplitz(T, 1),
    "blt-2": lambda T: mm.BLT(T, 2),
    "blt-5": lambda T: mm.BLT(T, 5),
    "blt-opt": lambda T: mm.OptimizedBLT(T, 3, 2, 3),  # optimised for (b, k) = (2, 3), checked at every (b, k)
}


@pytest.mark.parametrize("name", sorted(FACTS))
@pytest.mark.parametrize("T", [1, 2, 5, 8, 11, 13])
def test_factorization_reproduces_prefix_sums_with_nonnegative_gram(name, T):
    C = FACTS[name](T).matrix()
    assert np.allclose(np.tril(C), C) and np.all(np.diag(C) > 0)  # lower-triangular, invertible: streaming
    B = mm.prefix_matrix(T) @ np.linalg.inv(C)
    assert np.allclose(B @ C, mm.prefix_matrix(T))
    assert (C.T @ C >= 0).all()  # what makes the scalar pattern maximum the vector-valued sensitivity


@pytest.mark.parametrize("name", sorted(FACTS))
def test_sensitivity_equals_brute_force_over_every_pattern(name):
    """Delta_j^2 (at most j participations, gaps >= b) equals the max over every pattern, enumerated:
    the Toeplitz closed form's proof and the tree's dynamic program, on every small (T, b, k)."""
    for T in range(1, 14):
        for b in range(1, 6):
            for k in range(1, 5):
                fact = FACTS[name](T)
                brute = mm.brute_force_max(fact.matrix(), b, k)
                expected = [max(brute[: j + 1]) for j in range(len(brute))]
                assert fact.sensitivity_squares(b, k) == pytest.approx(expected, rel=1e-12, abs=1e-12), (T, b, k)
                assert math.sqrt(expected[-1]) == pytest.approx(mm.max_participation_sensitivity(fact, b, k))


def test_tree_sensitivity_against_enumeration_at_a_larger_size():
    """T = 24 (patterns with up to 3 participations): the programs, not a coincidence of tiny trees."""
    fact = mm.Tree(24)
    for b in (1, 3, 5, 7):
        brute = mm.brute_force_max(fact.matrix(), b, 3)
        assert fact.sensitivity_squares(b, 3) == pytest.approx([max(brute[: j + 1]) for j in range(3)])
    # b = 1, every count (the unseparated program): all T leaves is the whole of 1^T G 1
    G = fact.matrix().T @ fact.matrix()
    assert fact.sensitivity_squares(1, 24)[-1] == pytest.approx(G.sum())


def test_vector_valued_contributions_never_exceed_the_pattern_maximum():
    """Any g_t with ||g_t|| <= 1 on any (b, k) pattern: ||C sum_t e_t g_t^T||_F <= Delta; equal g_t on
    the worst pattern attain it (so the sensitivity is exact, not an upper bound)."""
    rng = np.random.default_rng(0)
    T, b, k, d = 12, 3, 3, 4
    for fact in (mm.Tree(T), mm.BandedToeplitz(T, 4)):
        C = fact.matrix()
        delta = mm.max_participation_sensitivity(fact, b, k)
        for _ in range(300):
            start = rng.integers(0, T)
            pi = [p for p in range(start, T, b + int(rng.integers(0, 3)))][:k]
            D = np.zeros((T, d))
            for p in pi:
                g = rng.normal(size=d)
                D[p] = g / np.linalg.norm(g) * rng.uniform(0.5, 1.0)
            assert np.linalg.norm(C @ D) <= delta * (1 + 1e-12)
        G = C.T @ C
        best = max(
            (pi for pi in _patterns(T, b, k)), key=lambda pi: G[np.ix_(pi, pi)].sum()
        )  # the enumerated worst pattern
        D = np.zeros((T, d))
        D[best, 0] = 1.0
        assert np.linalg.norm(C @ D) == pytest.approx(delta, rel=1e-12)


def _patterns(T, b, k):
    import itertools

    for j in range(1, k + 1):
        for pi in itertools.combinations(range(T), j):
            if all(q - p >= b for p, q in zip(pi, pi[1:])):
                yield list(pi)


@pytest.mark.parametrize("T", [1, 2, 3, 7, 8, 100, 1600, 2047, 2048])
def test_single_participation_tree_is_dp_accountings_depth(T):
    """k = 1: Delta^2 = the most rows of C containing one leaf = ceil(log2(T + 1)), the depth
    dp-accounting's SingleEpochTreeAggregationDpEvent charges."""
    assert mm.Tree(T).sensitivity_squares(1, 1) == [math.ceil(math.log2(T + 1))]


def test_banded_within_the_separation_has_no_cross_terms():
    """band <= b: two participations' columns never overlap, so Delta_k^2 = k * sum c_j^2."""
    fact = mm.BandedToeplitz(40, 5)
    sq = fact.sensitivity_squares(5, 4)
    assert sq == pytest.approx([j * float(fact.coeffs @ fact.coeffs) for j in (1, 2, 3, 4)])
    assert fact.coeffs[:4] == pytest.approx([1, 1 / 2, 3 / 8, 5 / 16])


@pytest.mark.parametrize("name", sorted(FACTS))
@pytest.mark.parametrize("T", [1, 6, 37])
def test_streamed_noise_is_B_Z_exactly(name, T):
    """Fed the rows of Z in order, the generator returns row t of B Z (B = A C^{-1}), keeping at most
    floor(log2 T) + 1 vectors (tree), band - 1 (banded) or m (BLT) besides the running sum."""
    fact = FACTS[name](T)
    C = fact.matrix()
    B = mm.prefix_matrix(T) @ np.linalg.inv(C)
    Z = np.random.default_rng(T).normal(size=(T, 3))
    gen = fact.noise()
    rows = []
    for z in Z:
        rows.append(gen.step(torch.tensor(z)).numpy())
        held = {mm.TreeNoise: "stack", mm.ToeplitzNoise: "recent", mm.BLTNoise: "buffers"}[type(gen)]
        assert len(getattr(gen, held)) <= fact.memory
    np.testing.assert_allclose(np.stack(rows), B @ Z, rtol=0, atol=1e-12)


def test_blt_is_the_square_root_factor_up_to_2m_and_decays_after():
    """Gauss-Chebyshev with m nodes integrates t^n exactly for n < 2m: the BLT's first 2m coefficients
    are binom(2n, n)/4^n; later ones fall below them (geometric decay), so its prefix noise is smaller."""
    for m in (1, 3, 6):
        blt = mm.BLT(50, m)
        exact = mm.sqrt_coefficients(50)
        np.testing.assert_allclose(blt.coeffs[: 2 * m], exact[: 2 * m], rtol=1e-12)
        assert (blt.coeffs[2 * m :] < exact[2 * m :]).all()


@pytest.mark.parametrize("T, b, k, m", [(60, 3, 20, 3), (100, 10, 10, 4), (256, 1, 1, 4), (30, 1, 30, 2)])
def test_optimized_blt_beats_its_chebyshev_start_the_tree_and_keeps_the_sensitivity_constraints(T, b, k, m):
    """The optimised m-buffer BLT's mean squared prefix-sum error (dense Delta_K^2 ||A C^{-1}||_F^2 / T) is at
    most the Gauss-Chebyshev start's and the tree's; its parameters keep c_0 = 1 >= c_1 >= ... >= 0
    (theta in [0, 1), omega >= 0, sum omega <= 1); the optimiser's O(T m) loss equals the dense one."""
    opt = mm.OptimizedBLT(T, m, b, k)
    loss = mm.prefix_sum_error(opt, b, k)
    assert loss < mm.prefix_sum_error(mm.BLT(T, m), b, k)
    assert loss < mm.prefix_sum_error(mm.Tree(T), b, k)
    assert ((opt.decays >= 0) & (opt.decays < 1)).all() and (opt.omegas >= 0).all() and opt.omegas.sum() <= 1
    c = opt.coeffs
    assert c[0] == 1 and (c >= 0).all() and (np.diff(c) <= 0).all()
    fast = mm._blt_loss_fast(opt.omegas, opt.decays, T, b, mm.max_participations(T, b, k))
    assert fast == pytest.approx(loss, rel=1e-9)


def test_optimized_blt_beats_the_square_root_factor_in_a_single_epoch():
    """k = 1 (each user once): the 4-buffer optimised BLT has lower error than the full square-root
    factor (band T) and than the banded factor at band b."""
    for T, b in ((256, 1), (200, 8)):
        loss = mm.prefix_sum_error(mm.OptimizedBLT(T, 4, b, 1), b, 1)
        assert loss < mm.prefix_sum_error(mm.BandedToeplitz(T, T), b, 1)
        assert loss < mm.prefix_sum_error(mm.BandedToeplitz(T, b), b, 1)


def test_optimized_blt_is_deterministic_and_cached():
    """The same public (T, b, k, m) gives bit-for-bit the same C, recomputed from scratch (no randomness)."""
    first = mm.OptimizedBLT(80, 3, 4, 20)
    mm._BLT_CACHE.clear()
    again = mm.OptimizedBLT(80, 3, 4, 20)
    assert np.array_equal(first.omegas, again.omegas) and np.array_equal(first.decays, again.decays)
    assert (80, 4, 20, 3) in mm._BLT_CACHE
    assert not np.array_equal(mm.OptimizedBLT(80, 3, 8, 10).coeffs, first.coeffs)  # another pattern, another C


def test_the_dp_accounting_tree_anchor_through_the_factorization():
    """dp-accounting's tree test (StackOverflow, 1,600 steps, delta 1e-6): noise 8.83 -> eps < 2.04.
    The factorization's own sensitivity (one participation) and the exact mu-GDP profile of
    ``Delta / sigma`` reproduce it, at most dp-accounting's RDP value for the same mechanism."""
    delta_sq = mm.Tree(1600).sensitivity_squares(1, 1)[0]
    rho = delta_sq / (2 * 8.83**2)  # sigma = 8.83 Delta
    ours = eps_gaussian(rho, 1e-6)
    acc = rdp_privacy_accountant.RdpAccountant(
        [1 + x / 10 for x in range(1, 100)] + list(range(12, 64)), dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    )
    acc.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(8.83, 1600))
    assert ours < 2.04 and ours <= acc.get_epsilon(1e-6)
    assert ours >= 0.8 * acc.get_epsilon(1e-6)  # the same mechanism, not a different one


def test_production_rho_anchor():
    """Gboard's MF-DP-FTRL (google-research/federated mf_dpftrl_matrices): rho = 0.0144 -> eps = 0.994 at
    delta = 1e-10 (rho = 0.15 -> 3.42 is in test_accounting.py). The exact conversion gives 0.9956:
    the published value is rounded from its own accountant, within 0.2%."""
    assert eps_gaussian(0.0144, 1e-10) == pytest.approx(0.994, abs=2e-3)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="factorization must be one of"):
        mm.make_factorization("optimal", 10, 2)
    with pytest.raises(ValueError, match="non-increasing"):
        mm.Toeplitz(5, [1.0, 0.5, 0.7])
    with pytest.raises(ValueError, match="buffers must be a positive integer"):
        mm.BLT(10, 0)
    with pytest.raises(ValueError, match="buffers must be a positive integer"):
        mm.OptimizedBLT(10, 0, 1, 1)
    for omegas, decays in (([0.5], [1.0]), ([0.6, 0.6], [0.5, 0.5]), ([-0.1], [0.5]), ([0.5], [-0.1])):
        with pytest.raises(ValueError, match="BLT parameters need"):
            mm.BufferedToeplitz(10, omegas, decays)
    with pytest.raises(ValueError, match="band must be a positive integer"):
        mm.BandedToeplitz(10, 0)
    with pytest.raises(ValueError, match="min separation b must be a positive integer"):
        mm.Tree(10).sensitivity_squares(0, 2)
    with pytest.raises(ValueError, match="too costly"):
        mm.Tree(1 << 16).sensitivity_squares(2000, 4)
    assert mm.max_participations(10, 3, 9) == 4 and mm.max_participations(10, 3, 2) == 2
