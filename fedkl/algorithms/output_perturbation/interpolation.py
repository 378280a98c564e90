"""Server-side check that a client's gradient answers within a run come from ONE (mu, L) function.

The paper-002 diameter test (and the Delta selection built on it) assumes in-class clients
(:data:`fedkl.privacy.clients.IN_CLASS_CLIENTS`): every gradient answer of client c is the gradient of one
fixed F_c that is mu-strongly convex and L-smooth. The server cannot recompute a gradient without the
records, but it can check every answer set a client gave within the run against that class.

Interpolation (Taylor, Hendrickx & Glineur 2017, "Smooth strongly convex interpolation and exact
worst-case performance of first-order methods", Math. Program. 161, Thm 4). For 0 <= mu < L, a set
{(x_i, g_i, f_i)} is F_{mu,L}-interpolable (some mu-strongly convex, L-smooth F on R^d has F(x_i) = f_i
and grad F(x_i) = g_i) iff for every ordered pair (i, j)

    f_i >= f_j + <g_j, x_i - x_j> + 1/(2(1 - mu/L)) (||g_i - g_j||^2 / L + mu ||x_i - x_j||^2
                                                      - 2 (mu/L) <g_j - g_i, x_j - x_i>)      (I_ij)

The client reports gradients only. So {(x_i, g_i)} is F_{mu,L}-interpolable iff SOME values f_i satisfy
every (I_ij): a system of difference constraints f_i - f_j >= c_ij (c_ij the right-hand side above less
f_j). Such a system is feasible iff no cycle i_1 -> i_2 -> ... -> i_m -> i_1 has a positive total
c_{i_2 i_1} + c_{i_3 i_2} + ... + c_{i_1 i_m} (Bellman-Ford / the shortest-path potential: with no such
cycle, f_i = the longest-path value from a virtual source is a solution; a positive cycle makes
f_{i_1} > f_{i_1}). So:

* the EXACT gradient-only condition (necessary and sufficient) is "no positive cycle", decided here by
  Floyd-Warshall in O(k^3) for k answers (:func:`interpolable`);
* the 2-cycles alone give the pairwise condition (add (I_ij) and (I_ji) and simplify):

      <g_i - g_j, x_i - x_j> >= ||g_i - g_j||^2 / (L + mu) + (mu L / (L + mu)) ||x_i - x_j||^2,

  the co-coercivity of F_{mu,L} (Nesterov, Thm 2.1.12). It is necessary, and sufficient for two points,
  but NOT for three or more: ``tests/algorithms/test_interpolation.py`` has three points that pass every
  pair and still admit no F_{mu,L} function (a positive 3-cycle). mu = L is the quadratic
  (mu/2)||x||^2 + <b, x>: g_i - g_j = mu (x_i - x_j) exactly.

Floating point. Honest answers are float64 sums; the constraints are relaxed by what a perturbation of
each answer by e_i (||e_i|| <= ``GRAD_REL`` (G0 + L ||x_i - c||), far above float64 rounding of any
in-class gradient) can change c_ij, so an honest client is never rejected; a client may exploit that
slack by at most that perturbation (not modelled, like the rest of fedkl's floating point).

What the check buys (the proof, for the diameter test's use; :mod:`fedkl.algorithms.output_perturbation.diameter_output_pert`,
"Clients"). Every query the server makes during a release is a deterministic function of the public
inputs, of the earlier answers and of the random draws made so far (the Delta selection's draw is the
only one made before queries; the release's R1 and noise come after the last query). Fix those draws
and any client strategy (adaptive, randomized: fix its coins too). In world x, client c's transcript
{(x_i, g_i)} passes the check iff some A in F_{mu,L} (with ||grad A(c)|| <= G0, checked separately) has
grad A(x_i) = g_i for all i; then a client that simply IS A (a fixed in-class client) is asked the same
points and gives the same answers, by induction over the queries: the two runs coincide. A client that
fails the check is handled as a failed user. Hence, conditionally on the draws, the release in world x
is the release of the in-class mechanism on (x, c := A_x), and in world x' on (x', c := A_x'). So:

1. a client whose transcripts in the two worlds are interpolated by one common in-class A (in particular
   every non-adaptive in-class client) costs nothing: the pair is (x, A) ~ (x', A), neighbours, and the
   release is (eps, delta)-DP;
2. ANY other client (lying, out of class, adaptive, failing in one world) costs at most one more replaced
   user: (x, A_x) ~ (x', A_x) ~ (x', A_x'), so k such clients leave an honest user the group guarantee
   ((1 + k) eps, (1 + k) e^{k eps} delta) (basic group privacy), where, without the check, one liar gave
   delta = 1 against a claimed 0.1 (issue 28 §2).

The argument is per release; a phased run composes its releases as before, each costing at most its own
group step. Where it is applied: the diameter test (every answer a user gives in a release: at the
centre, at its reported point, every solver round; :mod:`fedkl.algorithms.output_perturbation.diameter_output_pert`, so the
Delta selection and the phased algorithms' inner releases through it) and SCOutputPert's certificate (the
full solve's and the certificate's answers; the exact enumeration needs nothing of the answers, so a
failing check only sends the decision there: :mod:`fedkl.algorithms.output_perturbation.exact_output_pert`).

What it cannot do: close case 2. The remaining case is the ADAPTIVE in-class client, who answers with the
gradient of an in-class function it picks after seeing iterates (so A_x != A_x'). Its transcript in each
world is exactly that of an honest client with that function, so no check of the answers, however
complete, tells it from an honest client whose records are A_x (it is one, as far as the run can see);
only the requirement that F_c be fixed before the run, a function of the client's records (the in-class
trust model), excludes it. The check therefore turns "any deviation can break the guarantee" into "a
deviation costs at most a group step", and the trust opt-in (``--clients in-class``) stays.
"""

from __future__ import annotations

import torch

GRAD_REL = 1e-9  # the answer perturbation the check tolerates, relative to the in-class gradient bound
_REL = 1e-12  # relative slack on each constraint (rounding of the points' inner products)


def _constraints(X: torch.Tensor, G: torch.Tensor, mu: float, L: float, scale: torch.Tensor) -> torch.Tensor:
    """c_ij - s_ij for every client: ``(n, k, k)`` float64, entry [.., i, j] the relaxed right-hand side of
    f_i - f_j >= c_ij (module docstring), ``scale`` ``(n, k)`` the tolerated perturbation of each answer."""
    dX = X.unsqueeze(2) - X.unsqueeze(1)  # [i, j] = x_i - x_j
    dG = G.unsqueeze(2) - G.unsqueeze(1)  # [i, j] = g_i - g_j
    lin = torch.einsum("njd,nijd->nij", G, dX)  # <g_j, x_i - x_j>
    gg = (dG * dG).sum(-1)
    xx = (dX * dX).sum(-1)
    gx = (dG * dX).sum(-1)  # <g_i - g_j, x_i - x_j> = <g_j - g_i, x_j - x_i>
    q = 1.0 / (2.0 * (1.0 - mu / L))
    c = lin + q * (gg / L + mu * xx - 2.0 * (mu / L) * gx)
    # what perturbing g_i, g_j by at most e_i, e_j can change c_ij (first and second order), plus rounding
    e = scale.unsqueeze(2) + scale.unsqueeze(1)
    nx, ng = xx.sqrt(), gg.sqrt()
    slack = scale.unsqueeze(1) * nx + q * ((2.0 * ng * e + e * e) / L + 2.0 * (mu / L) * e * nx)
    slack = slack + _REL * (lin.abs() + q * (gg / L + mu * xx + 2.0 * (mu / L) * gx.abs()))
    return c - slack


def answer_scale(X: torch.Tensor, center: torch.Tensor, start_grad_bound: float, smoothness: float) -> torch.Tensor:
    """The tolerated perturbation of each answer, ``(n, k)``: GRAD_REL times the in-class gradient bound
    G0 + L ||x - c|| at that point."""
    return GRAD_REL * (start_grad_bound + smoothness * (X - center).norm(dim=-1)) + 1e-300


def interpolable(X: torch.Tensor, G: torch.Tensor, mu: float, L: float, scale: torch.Tensor) -> torch.Tensor:
    """``(n,)`` bool: whether client u's answers ``G[u, i]`` at ``X[u, i]`` (``(n, k, d)`` each) are the
    gradients of one mu-strongly convex, L-smooth function (no positive cycle: exact, O(n k^3))."""
    X, G = X.to(torch.float64), G.to(torch.float64)
    if not 0 <= mu <= L:
        raise ValueError(f"need 0 <= mu <= L, got mu={mu}, L={L}")
    if X.shape != G.shape or X.dim() != 3:
        raise ValueError(f"points and gradients must both be (n, k, d), got {tuple(X.shape)} and {tuple(G.shape)}")
    finite = torch.isfinite(X).flatten(1).all(1) & torch.isfinite(G).flatten(1).all(1) & torch.isfinite(scale).all(1)
    X, G, scale = torch.nan_to_num(X), torch.nan_to_num(G), torch.nan_to_num(scale)
    if mu >= L * (1 - 1e-12):  # a quadratic: g_i - g_j = mu (x_i - x_j) exactly (within the tolerance)
        dev = ((G.unsqueeze(2) - G.unsqueeze(1)) - mu * (X.unsqueeze(2) - X.unsqueeze(1))).norm(dim=-1)
        tol = scale.unsqueeze(2) + scale.unsqueeze(1)
        return finite & (dev <= tol).flatten(1).all(1)
    w = _constraints(X, G, mu, L, scale)  # f_i - f_j >= w[i, j]: longest paths must have no positive cycle
    k = w.shape[1]
    eye = torch.eye(k, dtype=torch.bool)
    # best[i, j] = the largest total of a path j -> ... -> i (edge j -> i weighs w[i, j]); a positive cycle
    # shows as best[i, i] > 0
    best = w.masked_fill(eye, 0.0)
    for m in range(k):
        best = torch.maximum(best, best[:, :, m : m + 1] + best[:, m : m + 1, :])
    diag = best.diagonal(dim1=1, dim2=2)
    return finite & ~((diag > 0) | torch.isnan(diag)).any(dim=1) & ~torch.isnan(w).flatten(1).any(1)


def pairwise_interpolable(X: torch.Tensor, G: torch.Tensor, mu: float, L: float, scale: torch.Tensor) -> torch.Tensor:
    """``(n,)`` bool: the 2-cycle (co-coercivity) condition on every pair; necessary, and sufficient for k <= 2."""
    X, G = X.to(torch.float64), G.to(torch.float64)
    finite = torch.isfinite(X).flatten(1).all(1) & torch.isfinite(G).flatten(1).all(1) & torch.isfinite(scale).all(1)
    X, G, scale = torch.nan_to_num(X), torch.nan_to_num(G), torch.nan_to_num(scale)
    if mu >= L * (1 - 1e-12):
        return interpolable(X, G, mu, L, scale) & finite
    w = _constraints(X, G, mu, L, scale)
    two = w + w.transpose(1, 2)
    return finite & ~((two > 0) | torch.isnan(two)).flatten(1).any(dim=1)


# exact (no positive cycle, O(k^3) per user) up to this many answers per user, the pairwise co-coercivity
# condition (necessary, not sufficient) above it; users checked in chunks of about CHUNK (k * k * d) entries
EXACT_MAX = 160
CHUNK = 1 << 21


def in_class(
    points: torch.Tensor, grads: torch.Tensor, center: torch.Tensor, mu: float, L: float, start_grad_bound: float
) -> torch.Tensor:
    """``(n,)`` bool: whether each user's answers ``grads[u, i]`` at ``points[u, i]`` (``(n, k, d)``) are the
    gradients of one mu-strongly convex, L-smooth function (:func:`interpolable` up to :data:`EXACT_MAX`
    answers per user, :func:`pairwise_interpolable` above), with the float tolerance of :func:`answer_scale`
    (``start_grad_bound``: G0 >= the gradient norm at ``center``)."""
    n, k, d = points.shape
    out = torch.empty(n, dtype=torch.bool)
    check = interpolable if k <= EXACT_MAX else pairwise_interpolable
    step = max(1, CHUNK // max(1, k * k * d))
    for a in range(0, n, step):
        X, G = points[a : a + step], grads[a : a + step]
        out[a : a + step] = check(X, G, mu, L, answer_scale(X, center, start_grad_bound, L))
    return out


__all__ = ["CHUNK", "EXACT_MAX", "GRAD_REL", "answer_scale", "in_class", "interpolable", "pairwise_interpolable"]
