"""Exact minimum vertex cover, fixed-parameter tractable in the cover size (Buss kernel + branching).

Used by :mod:`fedkl.algorithms.output_perturbation.mean_output_pert`, whose deletion-stability test IS a vertex-cover
question. Everything here is exact (no heuristics, no time-outs): a decision is always right, and the
amount of work has a data-independent upper bound (:func:`worst_case_calls`) that callers check
BEFORE reading any data.

Decision procedure ``cover_at_most(G, t)`` ("has G a vertex cover of size <= t?"), one recursive
call = reductions, then either an answer or one branching into two calls:

Reductions, applied until none applies (each is exact: G has a cover of size <= t iff the reduced
graph has one of size <= the reduced t):

* R0 a vertex of degree 0 is deleted;
* R1 a vertex of degree > t is in every cover of size <= t (else its > t neighbours are): take it, t -= 1;
* R2 a vertex v of degree 1 with neighbour u: some minimum cover contains u: take u, t -= 1;
* R3 a vertex v of degree 2 with ADJACENT neighbours a, b (a triangle): some minimum cover contains
  a and b: take both, t -= 2;
* R4 a vertex v of degree 2 with NON-adjacent neighbours a, b: fold v, a, b into one new vertex w
  with N(w) = N(a) ∪ N(b) \\ {v}; G has a cover of size <= t iff the folded graph has one of size
  <= t - 1 (Chen, Kanj & Jia 2001, Lemma 2.3; an optimal cover of the folded graph containing w
  unfolds to one containing a and b, otherwise to one containing v).

After the reductions every vertex has degree in [3, t] (or the graph is empty: answer t >= 0). If
|E| > t * maxdeg no t vertices can cover the edges: answer no. Otherwise branch on a vertex v of
maximum degree d (smallest id on ties): either v is in the cover (G - v, t - 1) or all of N(v) is
(G - N[v], t - d).

Work bound (number of calls). Let D(s) be the largest number of calls of one decision whose
parameter, after its reductions, is <= s. For s <= 2 the reductions empty the graph (every degree is
<= 2 or > s), so D(s) = 1. For s >= 3 the branching vertex has degree d >= 3 and every vertex degree
>= 3:

* d >= 4: children with parameters s - 1 and s - d <= s - 4;
* d = 3: then EVERY degree is exactly 3, so in G - v the neighbours of v have degree 2 and the
  child's reductions lower its parameter at least once more (R1-R4 all do): <= s - 2; the other
  child has s - 3.

Hence ``D(s) = 1 + max(D(s-1) + D(s-4), D(s-2) + D(s-3))`` (D is non-decreasing), D(s) = O(1.3803^s).
Every call costs O(|V| + |E|) set operations on a graph that only shrinks (a fold never adds edges),
and after the top-level kernel (R1 at the budget k, then |E| <= k * maxdeg <= k^2) that is O(k^2).

:func:`min_vertex_cover` (the size AND the canonical cover, lexicographically smallest sorted tuple
among the minimum covers) costs at most ``worst_case_calls(k) = sum_{t<=k} D(t) + sum_{t<k} D(t)``
calls: the size by iterative deepening t = 0, 1, ... (at most one decision per t <= k), the cover by
a greedy in vertex order that asks one decision per undecided non-isolated vertex, each with a
strictly smaller parameter than the previous one (see :func:`min_vertex_cover`).
"""

from __future__ import annotations

from typing import Iterable

Graph = dict  # vertex id -> set of neighbour ids (symmetric, no self loops)

# admits 2 kappa <= 40 (bound 3.75e6 calls). Measured cost per call: ~0.03 ms on small kernels, ~0.8 ms on
# the largest (k^2 = 1600 edges), so the proven worst case is minutes to ~1 h of Python; observed on
# MovieLens: < 10 calls, milliseconds.
DEFAULT_MAX_VC_CALLS = 4_000_000
# the deletion scores of a pairwise ("no two kept users conflict") test: this module's exact minimum
# cover, or the maximum-matching score of fedkl.algorithms.output_perturbation.matching (polynomial at every kappa)
TESTS = ("auto", "vertex-cover", "matching")


_D = [1, 1, 1]


def branch_calls(s: int) -> int:
    """D(s): the most calls one decision with (post-reduction) parameter <= s can make (module docstring)."""
    if s <= 2:
        return 1
    while len(_D) <= s:
        a = len(_D)
        _D.append(1 + max(_D[a - 1] + _D[a - 4] if a >= 4 else _D[a - 1] + 1, _D[a - 2] + _D[a - 3]))
    return _D[s]


def resolve_test(test: str, n: int, kappa: int, max_vc_calls: int = DEFAULT_MAX_VC_CALLS) -> str:
    """The concrete score ("vertex-cover" or "matching") for n users at this kappa, from public values
    only: "auto" is the exact cover when its proven work bound (2 kappa) fits ``max_vc_calls``, else
    the matching score. (n does not enter: the matching score needs MORE users, 8 kappa + 2 against
    4 kappa + 2, so a population too small for the cover is too small for both.)"""
    if test not in TESTS:
        raise ValueError(f"test must be one of {TESTS}, got {test!r}")
    if test != "auto":
        return test
    if worst_case_calls(2 * kappa) <= max_vc_calls:
        return "vertex-cover"
    return "matching"


def require_work_budget(k: int, max_calls: int) -> None:
    """Refuse (ValueError, public values only) a cover search with parameter k = 2 kappa whose proven
    worst case exceeds ``max_calls``."""
    calls = worst_case_calls(k)
    if calls > max_calls:
        raise ValueError(
            f"the exact vertex-cover test with k = 2 kappa = {k} may need up to {calls:.3g} recursive "
            f"calls > the work budget max_vc_calls={max_calls:.3g}. Refused before reading any data "
            "(use the matching score: test 'auto' or 'matching'; or raise eps per release, use fewer "
            "phases, or raise the budget)."
        )


def worst_case_calls(k: int) -> int:
    """Upper bound on the calls of :func:`min_vertex_cover` with budget k (data-independent)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return sum(branch_calls(t) for t in range(k + 1)) + sum(branch_calls(t) for t in range(k))


class CallCounter:
    """Counts the recursive calls (the unit of :func:`worst_case_calls`)."""

    def __init__(self) -> None:
        self.calls = 0


def graph_from_edges(n: int, edges: Iterable[tuple[int, int]], *, isolated: bool = True) -> Graph:
    """The graph on vertices 0..n-1 (isolated vertices included; ``isolated=False``: only the vertices of
    some edge, O(edges) instead of O(n)) with the given undirected edges."""
    g: Graph = {v: set() for v in range(n)} if isolated else {}
    for a, b in edges:
        a, b = int(a), int(b)
        if a == b:
            raise ValueError("self loops are not allowed")
        if not (0 <= a < n and 0 <= b < n):
            raise ValueError(f"edge ({a}, {b}) outside 0..{n - 1}")
        g.setdefault(a, set()).add(b)
        g.setdefault(b, set()).add(a)
    return g


def _copy(g: Graph) -> Graph:
    return {v: set(nb) for v, nb in g.items()}


def _remove(g: Graph, v: int) -> set:
    """Delete v (it goes into the cover, or it is isolated); return its former neighbours."""
    nb = g.pop(v)
    for w in nb:
        g[w].discard(v)
    return nb


def _reduce(g: Graph, t: int, next_id: int) -> tuple[int, int]:
    """Apply R0-R4 until none applies (module docstring). Mutates g; returns (t, next_id); t < 0
    means "no cover of size <= the original t"."""
    queue = list(g)
    while True:
        while queue:
            if t < 0:
                return t, next_id
            v = queue.pop()
            if v not in g:
                continue
            nb = g[v]
            d = len(nb)
            if d == 0:  # R0
                del g[v]
            elif d > t:  # R1
                queue.extend(_remove(g, v))
                t -= 1
            elif d == 1:  # R2
                (u,) = nb
                queue.extend(_remove(g, u))
                t -= 1
            elif d == 2:
                a, b = sorted(nb)
                if b in g[a]:  # R3
                    queue.extend(_remove(g, a))
                    queue.extend(_remove(g, b))
                    t -= 2
                else:  # R4: fold v, a, b into w
                    _remove(g, v)
                    na, nbb = _remove(g, a), _remove(g, b)
                    w = next_id
                    next_id += 1
                    nw = na | nbb
                    g[w] = nw
                    for x in nw:
                        g[x].add(w)
                    queue.append(w)
                    queue.extend(nw)
                    t -= 1
        if t < 0:
            return t, next_id
        # t only decreases: a vertex checked earlier may now have degree > t
        queue = [v for v, nb in g.items() if len(nb) > t or len(nb) <= 2]
        if not queue:
            return t, next_id


def _decide(g: Graph, t: int, next_id: int, counter: CallCounter) -> bool:
    counter.calls += 1
    t, next_id = _reduce(g, t, next_id)
    if t < 0:
        return False
    if not g:
        return True
    degs = {v: len(nb) for v, nb in g.items()}
    maxdeg = max(degs.values())
    if sum(degs.values()) // 2 > t * maxdeg:
        return False
    v = min((u for u, d in degs.items() if d == maxdeg))
    left = _copy(g)
    _remove(left, v)
    if _decide(left, t - 1, next_id, counter):
        return True
    right = g  # not used after this: reuse
    nb = set(right[v])
    for u in nb:
        _remove(right, u)
    right.pop(v, None)
    return _decide(right, t - len(nb), next_id, counter)


def cover_at_most(g: Graph, t: int, counter: CallCounter | None = None) -> bool:
    """Exact: does g have a vertex cover of size <= t? (g is not modified.)"""
    counter = counter or CallCounter()
    if t < 0:
        counter.calls += 1
        return False
    work = _copy(g)
    return _decide(work, t, max(work, default=-1) + 1, counter)


def _matching_lower_bound(g: Graph) -> int:
    """Size of a greedy maximal matching: a lower bound on the minimum cover."""
    used: set = set()
    m = 0
    for v in sorted(g):
        if v in used:
            continue
        for w in sorted(g[v]):
            if w not in used:
                used.update((v, w))
                m += 1
                break
    return m


def min_vertex_cover(g: Graph, k: int, counter: CallCounter | None = None) -> tuple[int, tuple[int, ...]] | None:
    """The minimum vertex cover of g if its size is <= k, else None. Exact.

    Returns ``(size, cover)`` with ``cover`` the lexicographically smallest sorted tuple of vertex ids
    among ALL minimum covers (a canonical choice: a function of the graph alone).

    Steps (calls bounded by :func:`worst_case_calls`):

    1. top-level kernel: a vertex of degree > t (t = k - #taken) is in every cover of size <= k,
       hence in every minimum cover when the minimum is <= k: take it (``forced``); if more than k
       are taken, or |E| > t * maxdeg afterwards, the minimum is > k: None.
    2. size: t = lower bound, lower bound + 1, ... <= k, one decision each, first "yes" is tau.
    3. canonical cover of the kernel H (budget t = tau - |forced|, invariant: min cover of H = t):
       for each vertex u in increasing order that is still in H with degree >= 1, ask whether
       H - u has a cover of size t - 1 (one decision). If yes, u is in the canonical cover (for two
       covers of equal size, the sorted tuples first differ where one contains the smaller vertex):
       take u, t -= 1. If no, every minimum cover of H avoids u, so contains N(u): take N(u),
       t -= |N(u)| >= 1. A vertex of degree 0 is in no minimum cover. Every decision thus uses a
       parameter strictly below the previous one: at most sum_{t<k} D(t) calls.
    """
    counter = counter or CallCounter()
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    h = _copy(g)
    forced: list[int] = []
    t = k
    changed = True
    while changed:
        changed = False
        for v in sorted(h):
            if v in h and len(h[v]) > t:
                _remove(h, v)
                forced.append(v)
                t -= 1
                changed = True
                if t < 0:
                    return None
    for v in [v for v, nb in h.items() if not nb]:
        del h[v]
    if h:
        edges = sum(len(nb) for nb in h.values()) // 2
        if edges > t * max(len(nb) for nb in h.values()):
            return None
    tau = None
    for s in range(_matching_lower_bound(h), t + 1):
        if cover_at_most(h, s, counter):
            tau = s
            break
    if tau is None:
        return None
    cover = list(forced)
    t = tau
    for u in sorted(h):
        if t == 0:
            break
        if u not in h:
            continue
        if not h[u]:
            del h[u]
            continue
        trial = _copy(h)
        _remove(trial, u)
        if cover_at_most(trial, t - 1, counter):
            _remove(h, u)
            cover.append(u)
            t -= 1
        else:
            nb = set(h[u])
            for w in nb:
                _remove(h, w)
            del h[u]
            cover.extend(nb)
            t -= len(nb)
    if t != 0 or any(h.values()):  # invariant violated: a bug, never a data-dependent outcome
        raise AssertionError("min_vertex_cover: canonical cover does not have the minimum size")
    return len(forced) + tau, tuple(sorted(cover))
