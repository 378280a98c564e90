"""SCOutputPert in polynomial time at any n: Algorithm 2 of paper 002 with a local-minimizer DIAMETER test.

:class:`~fedkl.algorithms.output_perturbation.exact_output_pert.SCOutputPert` releases ``f~(x) = theta~`` (the minimizer of
the strongly convex objective, by a fixed-iteration solver) through DelOutputPert with the paper's
exact test, ``Dbar_{4 kappa - |S|} f~(x_{-S}) <= Delta``. Deciding that test exactly enumerates ~2^n
user sets; the Appendix C certificate only settles it when it passes. So SCOutputPert refuses
n > 20, and with it every phased algorithm on a real dataset. This module releases THE SAME f~ (the
ERM minimizer that the paper's utility theorems are about) through a test that is exact and
polynomial time, derived below. The paper does not have it; docs/derivations/paper-002.md §2A ("what the
proof uses") and §5(c) give the ingredients.

Guarantee
---------
**(eps, delta)-DP, user level, relation replace-one, n public**, for every dataset. It holds for the
released ``f~(x_{-S}) + N(0, sigma^2 I)`` or ⊥. The server-side diagnostics and the wall-clock time
are not covered. The public inputs are eps, delta, Delta, the centre c, lam, and the constants
mu, beta, G0; none may depend on the data.

The objective and the per-user vectors
--------------------------------------
As in SCOutputPert: ``F_u(theta) = f_u(theta) + (lam/2)||theta - c||^2``, f_u user u's mean record
loss plus the problem's regularizer, every F_u mu-strongly convex and L-smooth (mu = mu_f + lam,
L = beta_f + lam, from the loader-enforced feature bound). ``theta*(y) = argmin sum_{u in y} F_u``, and
f~ is the fixed-iteration gradient descent of SCOutputPert with ``sup_y ||f~(y) - theta*(y)|| <= tau``.

Every user also returns ``v~_u``, its local minimizer of F_u
(:class:`~fedkl.federation.base.CertifiedLocalMinimizer`), with the residual ``r_u = ||grad F_u(v~_u)||``.
Then ``e_u = r_u / mu >= ||v~_u - v_u||``, where ``v_u = argmin F_u``. Both are functions of user u's
records and public values only.

Lemma (deletion jump from the diameter). Let z be a user set of size k >= 2 with ``||v_u - v_w|| <= D``
for all u, w in z, let i be in z and c = L/mu. Then ``||theta*(z) - theta*(z - i)|| <= j(c, k) D`` with

    j(c, k) = (c / k) min(c, 1 + sqrt((c - 1) k / (2 (k - 1))))      (:func:`jump_factor`).

Proof. ``sum_{u in z - i} F_u`` is (k-1)mu-strongly convex. At theta = theta*(z) its gradient is
-grad F_i(theta), so by strong monotonicity ``||theta - theta*(z - i)|| <= ||grad F_i(theta)|| / ((k-1) mu)``,
and ``||grad F_i(theta)|| <= L ||theta - v_i||`` (grad F_i(v_i) = 0, F_i L-smooth). It remains to bound
``||theta - v_i||`` in two ways.
(a) Psi = sum_{u in z} F_u is k mu-strongly convex and minimised at theta, so
``||theta - v_i|| <= ||grad Psi(v_i)|| / (k mu)``, with ``grad Psi(v_i) = sum_{u != i} (grad F_u(v_i) - grad F_u(v_u))``,
whose norm is <= (k-1) L D: ``||theta - v_i|| <= c (k-1) D / k``.
(b) Function values. With vbar the mean of the v_u, ``F_u(theta) >= F_u(v_u) + (mu/2)||theta - v_u||^2``
(strong convexity at the minimizer) and ``F_u(vbar) <= F_u(v_u) + (L/2)||vbar - v_u||^2`` (smoothness, zero
gradient), and Psi(theta) <= Psi(vbar); summing, ``mu sum_u ||theta - v_u||^2 <= L sum_u ||vbar - v_u||^2``.
As ``sum_u ||theta - v_u||^2 = k ||theta - vbar||^2 + V`` with ``V = sum_u ||v_u - vbar||^2
= (1/(2k)) sum_{u,w} ||v_u - v_w||^2 <= (k-1) D^2 / 2``, this gives ``||theta - vbar||^2 <= (c - 1) V / k``; and
``||vbar - v_i|| <= (k-1) D / k``. So ``||theta - v_i|| <= (k-1) D / k + D sqrt((c-1)(k-1)/(2k))``.
Multiplying the smaller of (a) and (b) by L / ((k-1) mu) gives j(c, k) D. ∎ For f~, add 2 tau per step.
(a) alone is the earlier (L/mu)^2 D / k; (b) is smaller once c > 1.5 (for large k; at c = 3.5, 2.12 c D/k against
3.5 c D/k). j is decreasing in k. No test that sees only the local minimizers can do better than
c D / (k - 1 + c) in the worst case, so the factor c = L/mu itself stays: 1-D quadratics, k - 1 users with
curvature mu at 0 and one with curvature L at D, have the jump c D / (k - 1 + c)
(``tests/algorithms/test_diameter_output_pert.py::test_no_local_minimizer_test_beats_the_condition_number``).

The conflict graph
------------------
There is an edge u -- w iff ``||v~_u - v~_w|| + e_u + e_w > rho``. A missing edge therefore
PROVES ``||v_u - v_w|| <= rho``. An edge depends only on its two users, so replacing one user changes
only that user's edges. A kept set (the complement of a vertex cover) has diameter <= rho, and so
does every subset of it.

The test and the release: two scores, one proof pattern (DeletionRelease)
-----------------------------------------------------------------------------
``depth`` is 4 kappa for the exact score and 8 kappa for the matching score. The threshold is the one
public number ``rho = (Delta - 2 tau) / j(L/mu, n - depth)``. It needs n >= depth + 2, because
every deletion step then starts from >= 2 users, as the lemma requires. It also needs Delta > 2 tau.

* ``vertex-cover`` (exact). This is Algorithm 1 with the predicate
  ``P(y, b) := diam{v_u : u in y} <= (Delta - 2 tau) / j(L/mu, |y| - b)`` (false when |y| - b < 2).
  (H) holds: deleting a user shrinks the diameter, and |y| - b is unchanged along a chain.
  (S) holds: every step z -> z - i within b deletions of y has |z| >= |y| - b, so by the lemma it
  moves f~ by <= j(L/mu, |z|) diam + 2 tau <= Delta (j decreases in k).
  In the algorithm |y| - b = n - 4 kappa for every S, so "exists S, |S| <= R1, with P" is exactly
  "the conflict graph has a vertex cover of size <= R1". The search is exact and FPT
  (:mod:`fedkl.algorithms.output_perturbation.vertex_cover`), and its worst-case work (~1.38^{2 kappa} calls) is checked
  against a budget BEFORE any data is read. Sensitivity and sigma are DelOutputPert's: 8 kappa Delta
  ("paper") or (4 kappa + 1) Delta ("tight").
* ``matching`` (polynomial at every kappa). The score is the maximum matching nu of the conflict
  graph, and the deletion set is a vertex cover with at most 2 nu users (:mod:`fedkl.algorithms.output_perturbation.matching`).
  The proof is in :class:`~fedkl.algorithms.output_perturbation.del_output_pert.DeletionRelease` ("The matching
  score"). It needs every deletion step of its chains, which start from kept sets and from sets of
  >= n - 8 kappa users, to move f~ by <= Delta. That is the lemma with k >= n - depth, plus 2 tau.
  Sensitivity is (8 kappa + 2) Delta, and it costs at most O(n^2 d) distances (blocked and pruned,
  never an n x n matrix: O(n d) when no two users are far apart, :mod:`fedkl.algorithms.output_perturbation.conflict_graph`)
  plus one blossom matching on the conflict edges.
* ``auto``: ``vertex-cover`` when its proven work bound fits ``max_vc_calls``, else
  ``matching``. The choice is made from public (eps, delta) only.

Clients (what the guarantee assumes of them)
--------------------------------------------
The guarantee of an honest user holds whatever any other client REPORTS as its local minimizer or
residual: the server takes v~_u only as a point and recomputes the residual r_u from user u's
gradient at v~_u, asked through the same oracle the solver f~ uses (:class:`GradientsAtOwnPoints`:
over Flower it is a one-point ``GradientsAtPoints`` request). A missing edge then proves
``||v_u - v_w|| <= rho`` for the minimizers of the functions whose gradients the solver sums, which
is all the lemma needs. (Before this, the reported residual was used: one client reporting a
typical v~ with residual 0 while answering gradients honestly broke an honest user's guarantee;
``tests/algorithms/test_untrusted_clients.py`` reproduces that attack and checks the fix holds delta.)

The solver's accuracy tau needs the public G0 >= ||grad f_u(c)|| of every user of a set (then
||c - theta*(y)|| <= G0/mu for every y). The server checks it too, from each user's gradient at c:
a user whose answer breaks it gets an infinite certified error, so it conflicts with every user
and is deleted (or the test outputs ⊥); an edge still depends on its two users only.

What remains assumed, and is checked where it can be: every client's GRADIENT answers are those of
ONE F_u in the declared class (mu-strongly convex, L-smooth: the loss of records within the
loaders' bounds, which :class:`~fedkl.data.base.FederatedDataset` checks wherever data enters,
the ClientApp included), fixed for the whole run. The server cannot recompute a gradient without the
records, but it checks every answer set a user gives within the release (the two local-stage
answers, at the centre and at its reported point, then every round of every solve) against the
interpolation conditions of mu_f-strongly convex, beta_f-smooth functions
(:mod:`fedkl.algorithms.output_perturbation.interpolation`: exact, no positive cycle, up to ``interpolation.EXACT_MAX``
answers per user; the pairwise co-coercivity condition, necessary only, above). A user that fails is
handled as a failed user (below; positions in the diagnostics' ``interpolation_failed``). What this
proves (interpolation.py's docstring): in each world the run is exactly a run with a fixed in-class
client, so any deviating client (a liar mimicking a typical user at its own point, an inconsistent or
too steep field, a NaN-in-one-world client) costs an honest user at most one group step; the
remaining gap is the adaptive in-class client who picks its function after seeing the iterates,
which no check of answers can tell from an honest one: the opt-in ``--clients in-class`` stays. The server is trusted: it sees v~, e, theta~ and
the test's outcome.

Failures (issue 28 §2): no answer aborts the run, so whether it completes never depends on the data.
A user whose answer is missing, malformed or non-finite at the public centre or at its own reported
point (:meth:`DiameterSCOutputPert.checked_local_vectors`), or fails in ANY round of the solve of the
kept set (missing, non-finite, or above the bound no in-class loss exceeds:
:meth:`~fedkl.algorithms.output_perturbation.exact_output_pert.SCOutputPert.solve`), gets an infinite local error: it conflicts
with every user, the test is redone and the new kept set solved again, until a solve sees no new
failure (each pass adds a user: at most n passes). The release is charged once, as without failures.
Why this keeps the guarantee:

* Failures independent of the data (a dropout): condition on the whole failure pattern, i.e. for every
  (pass, round, user) whether that answer is lost. Every user is asked in every round and the number
  of rounds per solve is public, so the set F of users given an infinite error is a function of the
  pattern alone. Given the pattern, the mechanism is exactly the diameter test run on the data in which
  the users of F have an infinite error; an edge still depends on its two users only, and for
  neighbours x, x' (user i replaced) the two modified datasets are neighbours again. So the release is
  (eps, delta)-DP conditionally on every pattern, hence for their mixture.
* A client that fails at the centre or at its own reported point fails as a function of its own data:
  it is simply a user with an infinite error.
* A client that fails (or answers NaN, or out of class) only at SOME iterates, i.e. depending on the
  other users' data (the NaN-in-one-world client), is outside the in-class assumption. The run still
  completes on both sides with the same charges; the client counts as a second changed user (its
  "data" is a failure on one side, its in-class loss on the other), so an honest user keeps the
  group-of-(1 + k) guarantee against k such clients, ((1 + k) eps, (1 + k) e^{k eps} delta), instead
  of the certain one-bit leak an abort gave.

Utility is not the paper's theorem. Under the paper's random-permutation model, the local
minimizers lie within about 2 gamma/mu of each other (gamma ~ 5 (2G) sqrt(ln(n/beta)/m), Lemma 3.8),
so with Delta_uc the graph is empty and the release is theta~ + N(0, sigma^2 I), as in Thm 3.1.
With heterogeneous users (real data) the test deletes users or outputs ⊥. Every result reports
this (``dist``, ``deleted_users``, ``conflict_edges``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from fedkl.algorithms.output_perturbation.del_output_pert import (
    DeletionRelease,
    DelOutputPert,
    DelOutputPertResult,
    StabilityPlan,
    check_release_start,
)
from fedkl.algorithms.output_perturbation.delta_share import release_share
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert, release_forecast
from fedkl.algorithms.output_perturbation.interpolation import in_class
from fedkl.algorithms.output_perturbation.matching import deletion_set
from fedkl.algorithms.output_perturbation.mean_output_pert import conflict_edges
from fedkl.algorithms.output_perturbation.vertex_cover import (
    DEFAULT_MAX_VC_CALLS,
    TESTS,
    require_work_budget,
    resolve_test,
)
from fedkl.federation.base import CertifiedLocalMinimizer, Federation, GradientsAtOwnPoints, GradientsAtPoints
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, PAPER_002_RELATIONS, Guarantee
from fedkl.privacy.release import Releaser

_G0_PAD = 1e-9  # float slack on the public bound G0 (an honest user's gradient norm is computed in float64)
# sc-output-pert's public grid for the private Delta: Delta_max / sqrt(2)^k, k = 10..0 (a span of 32). On IID
# users the diameter test certifies down to ~Delta_uc/6-9 (fertility-partition, L/mu = 3.5); the old grid
# (ratio 2, span 2^11) put 8-9 capped scores ahead of that floor, each a chance for AboveThreshold to stop
# on a Delta whose release is ⊥ (exactly 14-30 % at a 1/4 share), and rounded the floor up by up to 2x.
GRID_RATIO = 2.0**0.5
GRID_SIZE = 11


class LocalVectors(tuple):
    """(v~, e, understated) of :meth:`DiameterSCOutputPert.checked_local_vectors`, carrying ``answers``: every
    user's gradient answers of the local stage, ``(points (n, 2, d), gradients (n, 2, d))`` at the centre and
    at its own reported point (what the interpolation check of the solve adds to)."""

    answers: tuple[torch.Tensor, torch.Tensor] | None = None
    out_of_class: tuple[int, ...] = ()  # the users whose two answers no in-class function gives


def _rows(ans, shape: tuple[int, ...]) -> torch.Tensor:
    """An answer's values in float64 with the expected shape (a malformed answer: every row NaN, i.e. failed)."""
    values = ans.values.to(torch.float64)
    return values if tuple(values.shape) == shape else torch.full(shape, math.nan, dtype=torch.float64)


def _failed_rows(ans, values: torch.Tensor) -> torch.Tensor:
    """(n,) bool: the users whose answer is missing or not finite."""
    bad = ~torch.isfinite(values.reshape(values.shape[0], -1)).all(dim=1)
    for u in ans.failed:
        bad[ans.users.index(u)] = True
    return bad


def jump_factor(condition: float, k: int) -> float:
    """j(c, k) of the module docstring's lemma: a deletion from a set of k >= 2 users whose local minimizers
    lie within D of each other moves the minimizer by at most j(c, k) D (c = L/mu >= 1)."""
    if not (condition >= 1 and math.isfinite(condition)) or int(k) != k or k < 2:
        raise ValueError(f"need a finite condition number >= 1 and k >= 2 users, got {condition}, {k}")
    return condition / k * min(condition, 1.0 + math.sqrt((condition - 1.0) * k / (2.0 * (k - 1))))


@dataclass(frozen=True)
class DiameterTest:
    """The diameter test's own public parameters (the release's are its :class:`SCOutputPert`'s fields).

    Args:
        test: "auto", "vertex-cover" (exact minimum cover, work-bounded) or "matching".
        max_vc_calls: the vertex-cover work budget (configurations above it are refused or, with
            "auto", use the matching score).
        local_tol, local_max_iter: the users' local solver (the residual certifies the result
            whatever these are; they only make it accurate).
    """

    test: str = "auto"
    max_vc_calls: int = DEFAULT_MAX_VC_CALLS
    local_tol: float = 1e-10
    local_max_iter: int = 500

    def __post_init__(self) -> None:
        if self.test not in TESTS:
            raise ValueError(f"test must be one of {TESTS}, got {self.test!r}")
        if isinstance(self.max_vc_calls, bool) or int(self.max_vc_calls) != self.max_vc_calls or self.max_vc_calls < 1:
            raise ValueError(f"max_vc_calls must be a positive integer, got {self.max_vc_calls!r}")
        if not (self.local_tol > 0 and math.isfinite(self.local_tol)):
            raise ValueError(f"local_tol must be finite and > 0, got {self.local_tol}")
        if int(self.local_max_iter) != self.local_max_iter or not 1 <= self.local_max_iter <= 100_000:
            raise ValueError(f"local_max_iter must be an integer in [1, 100000], got {self.local_max_iter}")


class DiameterSCOutputPert:
    """Algorithm 2 of paper 002 with the diameter test (module docstring). Same ``run`` as SCOutputPert."""

    name = "sc-output-pert"
    guarantee = Guarantee("approx-dp", clients=IN_CLASS_CLIENTS, relations=PAPER_002_RELATIONS)

    def __init__(self, solver: SCOutputPert, test: DiameterTest | None = None) -> None:
        self.solver = solver  # f~ (the fixed-iteration solver) and the release's public parameters
        self.test = test or DiameterTest()

    # --- public quantities (no data) ------------------------------------------------------------
    @property
    def kappa(self) -> int:
        return self.solver.dop.kappa

    def release_kappa(self, n: int) -> int:
        """kappa of the release's OWN deletion budget R1 ~ TDLap (support {0, ..., 2 kappa}) at n users: the
        cap of the score (issue 28 §2).

        Why the cap must be this kappa. The analysed mechanism (DeletionRelease, "The matching
        score", and the profile theorem of :mod:`fedkl.algorithms.output_perturbation.stability_profile`) outputs ⊥ iff
        score > R1. Deciding only whether the score exceeds 2 kappa_r (kappa_r: R1's) and reporting
        "above" (always ⊥) then is exactly that mechanism: a score above 2 kappa_r exceeds every R1.
        A cap at 2 kappa' with kappa' >= kappa_r is implied (scores in (2 kappa_r, 2 kappa'] are ⊥
        surely either way); kappa' < kappa_r would NOT be the analysed mechanism: a score of
        2 kappa' + 1 would be ⊥ surely while its neighbour's score 2 kappa' releases with probability
        Pr[R1 >= 2 kappa'], not <= delta when R1's mode kappa_r lies above. Under the "profile"
        calibration the matching score's R1 has its own kappa (the exact score's differs, e.g. 3 against 4
        at eps = 16, delta = 1e-6); this used to cap at the exact score's kappa, which was safe only
        because it happened to be >= the matching one wherever they differ (eps in [0.25, 16],
        delta in [1e-10, 1e-2]). Under "paper" and "tight" both scores share one kappa."""
        return self.dop(n).kappa

    def score(self, n: int) -> str:
        """ "vertex-cover" or "matching" at n users."""
        return resolve_test(self.test.test, n, self.kappa, self.test.max_vc_calls)

    def dop(self, n: int) -> DeletionRelease:
        """The release's DelOutputPert parameters (R1 law, sensitivity, sigma) at n users."""
        s = self.solver
        return DeletionRelease(
            s.eps,
            s.delta,
            s.Delta,
            s.calibration,
            s.max_exact_users,
            score="matching" if self.score(n) == "matching" else "exact",
        )

    @property
    def condition(self) -> float:
        """L / mu of every F_u."""
        return self.solver.beta / self.solver.mu

    def check(self, n: int) -> None:
        """Refuse, from public values only, a configuration this test cannot run exactly."""
        score = self.score(n)
        depth = self.dop(n).depth
        if n < depth + 2:
            raise ValueError(
                f"the {score} diameter test needs n >= {'8' if score == 'matching' else '4'} kappa + 2 = {depth + 2} users "
                f"at (eps={self.solver.eps:g}, delta={self.solver.delta:g}) (kappa={self.kappa}); got n={n}. Refused before "
                "reading any data (raise eps or delta, use fewer phases, or use more users)."
            )
        Delta, tau = self.solver.Delta, self.solver.tau
        if not Delta > 2 * tau:
            raise ValueError(f"Delta={Delta:g} must exceed 2 tau={2 * tau:g} (the solver accuracy)")
        if score == "vertex-cover":
            require_work_budget(2 * self.release_kappa(n), self.test.max_vc_calls)

    def rho(self, n: int) -> float:
        """The conflict threshold (Delta - 2 tau) / j(L/mu, n - depth) (module docstring)."""
        self.check(n)
        return (self.solver.Delta - 2 * self.solver.tau) / jump_factor(self.condition, n - self.dop(n).depth)

    def sigma(self, n: int) -> float:
        return self.dop(n).sigma

    def forecast(self, n: int, w0: torch.Tensor, user_ids=None) -> dict:
        """:func:`~fedkl.algorithms.output_perturbation.exact_output_pert.release_forecast` at n users (public values only)."""
        return release_forecast(self.sigma(n), self.solver.Delta, self.solver, torch.as_tensor(w0).numel())

    # --- the test (NOT private; only its release is) ---------------------------------------------
    def local_vectors(self, federation: Federation, center: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(v~, e) of :meth:`checked_local_vectors`."""
        return self.checked_local_vectors(federation, center)[:2]

    def checked_local_vectors(
        self, federation: Federation, center: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(v~, e, understated): every user's reported local minimizer and the certified error bound r_u / mu, with
        the residual r_u = ||grad F_u(v~_u)|| RECOMPUTED by the server from the users' gradients at
        v~_u (the solver's oracle, :class:`GradientsAtOwnPoints`). The residual a client reports is
        never used: a client that reports a typical v~ with residual 0 while its gradients say
        otherwise gets the edges its gradients imply (module docstring, "Clients"). ``understated``
        (NOT private, a server-side diagnostic) counts the users whose reported residual is below
        the recomputed one: lying or broken clients (honest ones agree to rounding)."""
        sol, t = self.solver, self.test
        n, d = federation.num_users, federation.num_params
        center = center.to(torch.float64)
        ans = federation.compute(CertifiedLocalMinimizer(center, sol.extra_reg, t.local_tol, t.local_max_iter))
        values = _rows(ans, (n, d + 1))
        failed = _failed_rows(ans, values)
        V = torch.where(failed.unsqueeze(1), center, values[:, :d])
        grads = federation.compute(GradientsAtOwnPoints(V))
        g = _rows(grads, (n, d))
        failed |= _failed_rows(grads, g)
        residual = (g + sol.extra_reg * (V - center)).norm(dim=1)
        understated = int(((values[:, d] < residual * (1 - 1e-6) - 1e-12) & ~failed).sum())
        # the public G0 >= ||grad f_u(c)|| that fixes f~'s iteration count: a user whose gradient at the centre
        # breaks it (no honest client can) gets an infinite error, i.e. conflicts with everyone
        start = federation.compute(GradientsAtPoints(center.unsqueeze(0)))
        g0 = _rows(start, (n, 1, d)).reshape(n, d)
        failed |= _failed_rows(start, g0)
        err = residual / sol.mu
        err[~(g0.norm(dim=1) <= sol.start_grad_bound * (1 + _G0_PAD))] = math.inf
        # a failed or non-finite answer (module docstring, "Failures"): the user conflicts with everyone
        err[failed] = math.inf
        # the two answers must be gradients of one (mu_f, beta_f) function (exact for two points:
        # fedkl.algorithms.output_perturbation.interpolation); a user whose pair is not conflicts with everyone too
        points = torch.stack([center.expand(n, d), V], dim=1)
        grads_2 = torch.stack([g0, g], dim=1)
        inconsistent = ~self.in_class(points, grads_2, center) & torch.isfinite(err)
        err[inconsistent] = math.inf
        out = LocalVectors((V, err, understated))
        out.answers = (points, grads_2)
        out.out_of_class = tuple(torch.nonzero(inconsistent).flatten().tolist())
        return out

    def in_class(self, points: torch.Tensor, grads: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
        """``(n,)`` bool: whether each user's gradient answers ``grads[u, i]`` at ``points[u, i]`` are those of
        one mu_f-strongly convex, beta_f-smooth function (:mod:`fedkl.algorithms.output_perturbation.interpolation`: exact up to
        ``interpolation.EXACT_MAX`` answers per user, the pairwise co-coercivity condition above)."""
        return in_class(
            points, grads, center, self.solver.strong_convexity, self.solver.smoothness, self.solver.start_grad_bound
        )

    def conflict_edges(self, V: torch.Tensor, err: torch.Tensor, rho: float) -> list[tuple[int, int]]:
        """u < w with ||v~_u - v~_w|| + e_u + e_w > rho (1 - 1e-9): a missing edge proves ||v_u - v_w|| <= rho."""
        return conflict_edges(V, rho, err)

    def plan(
        self,
        federation: Federation,
        center: torch.Tensor,
        vectors: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> tuple[StabilityPlan, dict]:
        """The test's outcome (NOT private). ``vectors``: :meth:`checked_local_vectors`' result when
        the caller has it already (they do not depend on Delta or eps)."""
        n = federation.num_users
        score, rho = self.score(n), self.rho(n)
        vectors = vectors if vectors is not None else self.checked_local_vectors(federation, center)
        V, err, understated = vectors
        local = getattr(vectors, "answers", None)  # the local stage's answers, when the caller kept them
        edges = self.conflict_edges(V, err, rho)
        diag = {
            "test": score,
            "rho": rho,
            "condition_L_over_mu": self.condition,
            "conflict_edges": len(edges),
            "conflict_users": len({u for e in edges for u in e}),
            "max_local_error": float(err.max()),
            "understated_residuals": understated,
        }
        found, more = deletion_set(n, edges, score, 2 * self.release_kappa(n))
        diag.update(more)
        failed_in_solve: set[int] = set()
        out_of_class: set[int] = set()
        record: list[tuple[torch.Tensor, torch.Tensor]] = []
        already = set(torch.nonzero(torch.isinf(err)).flatten().tolist())  # deleted for a reason found before
        while found is not None:
            dist, deleted = found
            mask = torch.ones(1, n, dtype=torch.bool)
            mask[0, list(deleted)] = False
            failed: set[int] = set()
            value = self.solver.solve(federation, mask, center, failed, record)[0]
            # every answer a user gave in this release, local stage included, must come from one in-class
            # function (fedkl.algorithms.output_perturbation.interpolation); one that cannot is handled as failed
            inconsistent = self.inconsistent_users(local, record, center) - failed - failed_in_solve - already
            out_of_class |= inconsistent
            new = (failed | inconsistent) - failed_in_solve
            if not new:
                break
            # a user that failed in the solve (at an iterate, i.e. possibly depending on others' data) is
            # treated as one whose local error is infinite: the test is redone and the kept set re-solved
            # (module docstring, "Failures"); each pass adds a user, so at most n passes
            failed_in_solve |= new
            err = err.clone()
            err[sorted(failed_in_solve)] = math.inf
            edges = self.conflict_edges(V, err, rho)
            found, more = deletion_set(n, edges, score, 2 * self.release_kappa(n))
            diag.update(more)
        diag["failed_in_solve"] = len(failed_in_solve)
        # positions of the users found out of class, the reason saved (server-side, not private)
        diag["interpolation_failed"] = sorted(out_of_class | set(getattr(vectors, "out_of_class", ())))
        diag["users_conflicting_with_all"] = int(torch.isinf(err).sum())
        diag["conflict_edges"] = len(edges)
        diag["conflict_users"] = len({u for e in edges for u in e})
        if found is None:
            return StabilityPlan(n, None, None, None, f"diameter-{score}"), diag
        return StabilityPlan(n, int(dist), tuple(deleted), value, f"diameter-{score}"), diag

    def inconsistent_users(
        self,
        local: tuple[torch.Tensor, torch.Tensor] | None,
        record: list[tuple[torch.Tensor, torch.Tensor]],
        center: torch.Tensor,
    ) -> set[int]:
        """The users whose answers in this release (the local stage's ``local``, then every solver round
        in ``record``) are not the gradients of one in-class function (:meth:`in_class`)."""
        if not record:
            return set()
        grads = torch.cat([vals for _, vals in record], dim=1)  # (n, T, d)
        n = grads.shape[0]
        points = torch.cat([theta for theta, _ in record]).unsqueeze(0).expand(n, -1, -1)
        if local is not None:
            points, grads = torch.cat([local[0], points], dim=1), torch.cat([local[1], grads], dim=1)
        return set(torch.nonzero(~self.in_class(points, grads, center)).flatten().tolist())

    def deletion_score(self, n: int, V: torch.Tensor, err: torch.Tensor) -> int:
        """The test's score, capped: the deletions the test needs (minimum cover, or matching number),
        ``2 kappa + 1`` when above ``2 kappa``. Changes by at most 1 when one user is replaced: an edge
        depends on its two users only, and a cover of one graph plus the replaced user covers the
        other (a matching loses at most the replaced user's edge); capping keeps that."""
        cap = 2 * self.release_kappa(n)
        found, _ = deletion_set(n, self.conflict_edges(V, err, self.rho(n)), self.score(n), cap)
        return cap + 1 if found is None else int(found[0])

    # --- the release ------------------------------------------------------------------------------
    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
        label: str | None = None,
    ) -> DelOutputPertResult:
        """One (eps, delta) release charged to every user; ``theta`` is None for ⊥. ``w0``: the public centre."""
        n = federation.num_users
        center = check_release_start(self.name, releaser, federation, w0)
        self.check(n)  # before any data is read
        return self.release(federation, releaser, center, w0, progress, label, time.perf_counter())

    def release(
        self,
        federation: Federation,
        releaser: Releaser,
        center: torch.Tensor,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None,
        label: str | None,
        start: float,
        vectors: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> DelOutputPertResult:
        """The test and the (eps, delta) release (after :meth:`check`)."""
        n = federation.num_users
        plan, diag = self.plan(federation, center, vectors)
        dop = DelOutputPert(self.dop(n))
        theta = dop.release(
            plan,
            releaser,
            federation.ids_of(range(n)),
            label or self.name,
            {
                "mu": self.solver.mu,
                "beta": self.solver.beta,
                "tau": self.solver.tau,
                "iterations": self.solver.iterations,
                "test": f"diameter ({diag['test']})",
                "rho": diag["rho"],
            },
        )
        res = dop.result(
            None if theta is None else theta.to(torch.as_tensor(w0).dtype), plan, time.perf_counter() - start
        )
        res.diagnostics.update(diag)
        if progress is not None:
            progress({"round": 1, "rounds": 1, "released": theta is not None, **res.diagnostics})
        return res


class SelectedDeltaSCOutputPert:
    """sc-output-pert with Delta chosen privately from a public grid (issue 13 §2).

    Public inputs: the total (eps, delta), the grid ``Delta_max / ratio^k`` (k = size-1, ..., 0:
    ascending, ending at the configured Delta), the selection's share of eps (None: the share that
    minimises the expected noise, :func:`fedkl.algorithms.output_perturbation.delta_share.release_share`, among those whose
    release runs at the public n = ``users`` when given), and the threshold T
    on the deletion score. The run:

    1. every candidate ``DiameterSCOutputPert`` at (eps_release = eps - eps_select, delta, Delta_j)
       is checked from public values before any data is read;
    2. the users' local vectors (v~, e) are computed once (they do not depend on Delta or eps);
    3. AboveThreshold (:class:`~fedkl.privacy.sparse_vector.AboveThreshold`, eps_select-DP, pure)
       over the ascending grid with queries ``-score_j`` and threshold ``-T`` picks the first Delta_j
       whose capped deletion score (:meth:`DiameterSCOutputPert.deletion_score`, sensitivity 1 under
       replace-one) is at most about T; none: the largest, the configured Delta;
    4. the chosen candidate's diameter test and release at (eps_release, delta).

    Guarantee: **(eps, delta)-DP, user level, replace-one, n public**, clients as
    :class:`DiameterSCOutputPert`. Proof: step 3 is eps_select-DP (each query has sensitivity 1; the
    grid, its order and T are public); step 4 is (eps_release, delta)-DP for EVERY fixed Delta_j
    (DiameterSCOutputPert's theorem); adaptive basic composition gives (eps_select + eps_release,
    delta) = (eps, delta). The ledger is charged both releases separately, before each is drawn.
    ``tests/algorithms/test_delta_selection.py`` audits the composed output law exactly on neighbouring
    federations. Utility: with IID users the largest deletion jump is far below the union-bound
    Delta_uc (simulations/results/paper002_crossover.md measures ~1/80), and the noise is
    proportional to the Delta used.

    Where the chosen Delta lands (issue 13 §2). The score at Delta_j is 0 once
    ``Delta_j >= j(L/mu, n - depth) (diam + 2 e_max) + 2 tau`` (the floor: no conflict edge is left) and
    capped soon below it, so the selection lands within one grid step above the floor, NOT at the
    largest deletion jump J: on IID users the floor is ~c (1 + sqrt((c-1)/2)) diam/n with c = L/mu,
    while J ~ ||grad F_i(theta*)|| / (n mu_eff) ~ diam / (2n); 12-15 J on fertility-partition
    (c = 3.5), where the earlier lemma's c^2 made it 20-24 J. What forbids a Delta near J:
    (i) any test that sees only the local minimizers must pay c (the lemma's step
    ``||grad F_i(theta)|| <= L ||theta - v_i||`` is attained by 1-D quadratics of curvature mu and L,
    ``tests/algorithms/test_diameter_output_pert.py::test_no_local_minimizer_test_beats_the_condition_number``);
    (ii) the predicate that tracks J IS hereditary and sound: with gamma(y) = max_{u in y} ||grad F_u(theta*(y))||,
    k = |y| and g(k, b) = prod_{j=1..b} (1 + L/((k - j) mu)), let P(y, b) := gamma(y) g(k, b) / ((k - b - 1) mu) <= Delta.
    A deletion moves theta* by <= gamma(y)/((k-1) mu) (strong monotonicity, sum_u grad F_u(theta*(y)) = 0) and
    every gradient by <= L times that, so gamma(y - i) <= gamma(y)(1 + L/((k-1) mu)); hence
    (S) every step within b deletions moves theta* by <= gamma(y) g(k, b)/((k - b - 1) mu), and (H)
    P(y, b) => P(y - i, b - 1), since (1 + L/((k-1) mu)) g(k-1, b-1) = g(k, b). On fertility-partition its
    bound at the full data is 1.5-2.0 J (a one-off measurement). But the release needs the score
    min |S| with P(x_{-S}, depth - |S|) EXACTLY (the sensitivity-1 step, Obs 3.5: an approximate score can
    move by more than 1 between neighbours, "certificate or ⊥" is the extreme case), and when P fails at
    S = ∅ that is a search over deletion sets, not polynomial. The grid (ratio sqrt 2, span 32: ``GRID_*``)
    and the share (the rule of :mod:`fedkl.algorithms.output_perturbation.delta_share`) are chosen so that AboveThreshold
    rarely stops on a capped score ahead of the floor (a sure ⊥).
    """

    name = "sc-output-pert"
    guarantee = Guarantee("approx-dp", clients=IN_CLASS_CLIENTS, relations=PAPER_002_RELATIONS)

    def __init__(
        self,
        solver: SCOutputPert,
        test: DiameterTest | None = None,
        select_fraction: float | None = None,
        grid_ratio: float = GRID_RATIO,
        grid_size: int = GRID_SIZE,
        threshold: float | None = None,
        users: int | None = None,
    ) -> None:
        test = test or DiameterTest()
        if select_fraction is None:  # the public rule of fedkl/algorithms/output_perturbation/delta_share.py

            def accepts(f: float) -> bool:  # the release at eps (1 - f) runs at the public n = users
                try:
                    DiameterSCOutputPert(replace(solver, eps=solver.eps * (1 - f)), test).check(users)
                except ValueError:
                    return False
                return True

            select_fraction = release_share(
                solver.eps,
                solver.delta,
                solver.calibration,
                test.test,
                float(grid_ratio),
                int(grid_size),
                None if users is None else accepts,
            )
        if not 0 < select_fraction < 1:
            raise ValueError(f"select_fraction must be in (0, 1), got {select_fraction}")
        if not (grid_ratio > 1 and math.isfinite(grid_ratio)):
            raise ValueError(f"grid_ratio must be finite and > 1, got {grid_ratio}")
        if int(grid_size) != grid_size or grid_size < 2:
            raise ValueError(f"grid_size must be an integer >= 2, got {grid_size}")
        self.solver = solver
        self.select_fraction = float(select_fraction)
        self.eps_select = solver.eps * select_fraction
        release = replace(solver, eps=solver.eps - self.eps_select)
        self.grid = tuple(solver.Delta / grid_ratio**k for k in range(int(grid_size) - 1, -1, -1))
        self.candidates = tuple(DiameterSCOutputPert(replace(release, Delta=D), test) for D in self.grid)
        kappa = self.candidates[0].kappa
        self.threshold = float(kappa / 2 if threshold is None else threshold)

    def check(self, n: int) -> None:
        for c in self.candidates:
            c.check(n)

    def sigma(self, n: int) -> float:
        """The noise at the configured (largest) Delta; the chosen Delta_j scales it by Delta_j / Delta."""
        return self.candidates[-1].sigma(n)

    def forecast(self, n: int, w0: torch.Tensor, user_ids=None) -> dict:
        """The smallest grid Delta's forecast (the best the selection can reach; the runner refuses a
        run whose best case swamps the model), with the largest's noise ratio beside it."""
        out = self.candidates[0].forecast(n, w0, user_ids)
        out["noise_over_signal_at_largest_Delta"] = self.candidates[-1].forecast(n, w0, user_ids)["noise_over_signal"]
        return out

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
        label: str | None = None,
    ) -> DelOutputPertResult:
        n = federation.num_users
        center = check_release_start(self.name, releaser, federation, w0)
        self.check(n)  # every candidate, before any data is read
        start = time.perf_counter()
        first = self.candidates[0]
        vectors = first.checked_local_vectors(federation, center)
        scores = [c.deletion_score(n, vectors[0], vectors[1]) for c in self.candidates]
        name = label or self.name
        chosen = releaser.above_threshold(
            [-s for s in scores],
            eps=self.eps_select,
            threshold=-self.threshold,
            sensitivity=1.0,
            user_ids=federation.ids_of(range(n)),
            label=f"{name}/select-Delta",
            details={"grid": list(self.grid), "threshold": self.threshold},
        )
        index = len(self.grid) - 1 if chosen is None else chosen
        res = self.candidates[index].release(federation, releaser, center, w0, progress, name, start, vectors)
        res.diagnostics.update(
            {
                "Delta_selected": self.grid[index],
                "Delta_grid": list(self.grid),
                "selection_eps": self.eps_select,
                "selection_threshold": self.threshold,
                "selection_fell_back": chosen is None,
                "nonprivate_scores": scores,
            }
        )
        return res


__all__ = [
    "DiameterSCOutputPert",
    "DiameterTest",
    "SelectedDeltaSCOutputPert",
    "TESTS",
    "jump_factor",
    "resolve_test",
]
