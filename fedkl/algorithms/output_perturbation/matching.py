"""Maximum matchings of conflict graphs: a polynomial-time, 1-Lipschitz deletion score for DelOutputPert.

Paper 002's Algorithm 1 asks for dist(x) = the fewest users whose deletion leaves a stable dataset.
With a pairwise stability predicate ("no two kept users conflict") that is the minimum vertex cover
of the conflict graph: NP-hard, and the exact FPT search of :mod:`fedkl.algorithms.output_perturbation.vertex_cover`
has a worst case of ~1.38^{2 kappa} calls, infeasible at the kappa of Phased-ERM's phases. This
module gives the polynomial-time replacement used by the ``matching`` score of
:class:`fedkl.algorithms.output_perturbation.del_output_pert.DeletionRelease`:

* the score is nu(G), the size of a MAXIMUM matching (Edmonds' blossom algorithm, networkx);
* the deletion set is a vertex cover C of G with |C| <= 2 nu(G): the endpoints of a maximum matching
  (every edge has a matched endpoint, else the matching could grow), then pruned in a fixed order
  (a matched vertex whose neighbours are all in the cover is dropped).

The two facts the privacy proof uses (tested in tests/algorithms/test_diameter_output_pert.py against brute force):

1. |nu(G) - nu(G')| <= 1 when G' is G with ONE vertex's edges replaced (a replaced user): both
   contain H = G - v, and nu(H) <= nu(G) <= nu(H) + 1 (a matching of G loses at most the one edge at v).
2. C covers every edge and |C| <= 2 nu(G) (nu(G) <= tau(G) <= 2 nu(G): a 2-approximation).

Everything is deterministic: the graph is built with sorted vertices and edges, and networkx's
matching is a deterministic function of that input.
"""

from __future__ import annotations

from typing import Iterable

import networkx as nx

from fedkl.algorithms.output_perturbation.vertex_cover import CallCounter, graph_from_edges, min_vertex_cover


def _graph(n: int, edges: Iterable[tuple[int, int]]) -> nx.Graph:
    """networkx graph of the non-isolated vertices (sorted insertion: deterministic); the edges are
    validated by :func:`~fedkl.algorithms.output_perturbation.vertex_cover.graph_from_edges` (without the
    isolated ones: a dict of all n users per call was 6% of a 100,000-user phased-erm run, issue 34)."""
    adj = graph_from_edges(n, edges, isolated=False)
    g = nx.Graph()
    g.add_nodes_from(v for v in sorted(adj) if adj[v])  # isolated vertices: in no matching and no cover
    g.add_edges_from((a, b) for a in sorted(adj) for b in sorted(adj[a]) if a < b)
    return g


def maximum_matching(n: int, edges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """A maximum-cardinality matching of the graph on 0..n-1 (sorted pairs (a, b), a < b)."""
    g = _graph(n, edges)
    if g.number_of_edges() == 0:
        return []
    m = nx.max_weight_matching(g, maxcardinality=True)
    return sorted((min(a, b), max(a, b)) for a, b in m)


def matching_cover(n: int, edges: Iterable[tuple[int, int]]) -> tuple[int, tuple[int, ...]]:
    """``(nu, cover)``: the maximum-matching size and a vertex cover with ``len(cover) <= 2 nu``.

    The cover starts as all matched vertices; then each matched vertex, in increasing order, is
    dropped if all its neighbours are still in the cover (it stays a cover at every step).
    """
    edges = list(edges)
    g = _graph(n, edges)
    matching = maximum_matching(n, edges)
    cover = {v for e in matching for v in e}
    for v in sorted(cover):
        if all(w in cover for w in g.adj[v]):
            cover.discard(v)
    for a, b in g.edges():  # invariant (a bug if violated, never a data-dependent outcome)
        if a not in cover and b not in cover:
            raise AssertionError("matching_cover: the result is not a vertex cover")
    return len(matching), tuple(sorted(cover))


def deletion_set(
    n: int, edges: list[tuple[int, int]], score: str, k: int
) -> tuple[tuple[int, tuple[int, ...]] | None, dict]:
    """``((score value, deletion set) or None when the score exceeds k, diagnostics)`` for a conflict
    graph: ``score`` "matching" (nu and a cover of <= 2 nu users) or "vertex-cover" (the exact,
    canonical minimum cover, :func:`~fedkl.algorithms.output_perturbation.vertex_cover.min_vertex_cover`). k = 2 kappa."""
    if score == "matching":
        nu, cover = matching_cover(n, edges)
        return ((nu, cover) if nu <= k else None), {"matching": nu}
    if score == "vertex-cover":
        counter = CallCounter()
        found = min_vertex_cover(graph_from_edges(n, edges), k, counter)
        return found, {"vc_calls": counter.calls}
    raise ValueError(f"unknown score {score!r}")


__all__ = ["deletion_set", "matching_cover", "maximum_matching"]
