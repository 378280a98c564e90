"""The blocked conflict graph (fedkl.algorithms.output_perturbation.conflict_graph) is the dense construction's graph."""

import math

import numpy as np
import pytest
import torch

from fedkl.algorithms.output_perturbation import conflict_graph
from fedkl.algorithms.output_perturbation.mean_output_pert import _FP_PAD, conflict_edges, pairwise_distances


def dense_edges(V: torch.Tensor, rho: float, err: torch.Tensor | None) -> list[tuple[int, int]]:
    """The n x n construction that conflict_edges replaced (kept here as the reference)."""
    D = pairwise_distances(V)
    if err is not None:
        e = err.to(torch.float64).numpy()
        D = D + e[:, None] + e[None, :]
    a, b = np.nonzero(np.triu(D > rho * (1 - _FP_PAD), k=1))
    return list(zip(a.tolist(), b.tolist()))


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(conflict_graph, "BLOCK", 7)  # many blocks, ragged last block, on small inputs


@pytest.mark.parametrize("seed", range(6))
def test_blocked_edges_equal_dense_on_random_inputs(small_blocks, seed):
    g = torch.Generator().manual_seed(seed)
    n, d = 5 + 11 * seed, 1 + 3 * seed
    # clustered users: some block pairs are pruned, some computed
    V = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.05
    V[torch.randperm(n, generator=g)[: n // 4]] += 3.0
    err = torch.rand(n, generator=g, dtype=torch.float64) * 0.01
    if seed % 2:
        err[int(torch.randint(0, n, (1,), generator=g))] = math.inf  # a user that conflicts with everyone
    for rho in (0.0, 0.1, 0.5, 2.0, 10.0):
        for e in (None, err):
            assert conflict_edges(V, rho, e) == dense_edges(V, rho, e)


def test_blocked_edges_equal_dense_at_ties(small_blocks):
    # integer points: many distances exactly 5 (3-4-5) and the threshold rho (1 - pad) exactly 5.0
    g = torch.Generator().manual_seed(1)
    V = torch.randint(0, 2, (40, 2), generator=g).to(torch.float64) * torch.tensor([3.0, 4.0])
    rho = 5.0 / (1 - _FP_PAD)
    while rho * (1 - _FP_PAD) > 5.0:
        rho = math.nextafter(rho, 0.0)
    while rho * (1 - _FP_PAD) < 5.0:
        rho = math.nextafter(rho, math.inf)
    assert rho * (1 - _FP_PAD) == 5.0
    for r in (math.nextafter(rho, 0.0), rho, math.nextafter(rho, math.inf)):
        got = conflict_edges(V, r)
        assert got == dense_edges(V, r, None)
    # at the tie no pair is an edge (5.0 > 5.0 is false); just below it every 3-4-5 pair is
    assert conflict_edges(V, rho) == []
    assert len(conflict_edges(V, math.nextafter(rho, 0.0))) > 0


def test_far_apart_clusters_are_pruned_without_losing_edges(small_blocks, monkeypatch):
    """Two tight clusters far apart: only cross pairs are edges, and the within-cluster blocks are skipped."""
    n = 28
    V = torch.zeros(n, 3, dtype=torch.float64)
    V[:, 0] = torch.linspace(0, 1e-3, n)
    V[14:, 1] = 10.0
    computed = []
    real_norm = torch.Tensor.norm

    def counting_norm(self, *args, **kwargs):
        if self.dim() == 3:
            computed.append(self.shape[:2])
        return real_norm(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "norm", counting_norm)
    edges = conflict_edges(V, 5.0)
    assert edges == [(a, b) for a in range(14) for b in range(14, n)]
    assert len(computed) == 1 + 4  # the block centres, then only the 4 cross-cluster of the 10 block pairs
