"""MeanOutputPert: DelOutputPert (paper 002, Alg 1) for the MEAN of per-user vectors, in polynomial time.

The mechanism of docs/derivations/paper-002.md §5(c) ("the note"). It runs on real datasets (hundreds of
users), where the exact reference search of :mod:`fedkl.algorithms.output_perturbation.del_output_pert` (~2^n sets) and
hence ``sc-output-pert`` / ``phased-erm`` cannot.

Guarantee
---------
**(eps, delta)-DP (approximate DP, not zCDP), user level, relation replace-one, n public**: exactly
the guarantee of DelOutputPert (Thm 3.3), because the mechanism below IS Algorithm 1 run with a
stability predicate that has the two properties its proof uses. Add/remove-one-user is NOT covered
(n enters the thresholds; the note §1). eps, delta, rho (the diameter threshold), the local
regularization and the centre must be public (data-independent or earlier private outputs).

The function
------------
Every user u computes, from its own records and public inputs only, one vector ``v_u`` (here: its
local minimizer ``argmin_v f_u(v) + (lam/2)||v - c||^2`` around the public centre c, the federation
query :class:`~fedkl.federation.base.LocalRegularizedMinimizer`: L-BFGS from c, gradient tolerance
``tol`` and ``max_iter`` fixed in the query, so v_u is a deterministic function of user u's data and
the public query). The released function of a user set y is

    f(y) = mean_{u in y} v_u          (summed in the fixed user order; y is never empty below)

so f is a deterministic function of the SET of remaining users (pitfall 12): deleting users never
changes another user's v_u. A user whose answer is missing or non-finite gets ``v_u = c`` (a function
of that user's data, or of its independent dropout: the proof below holds conditionally on every
dropout pattern, hence for the mixture).

The test
--------
Algorithm 1 asks whether some x_{-S}, |S| <= R1, passes ``Dbar_{4 kappa - |S|} f(x_{-S}) <= Delta``.
Here it uses instead the predicate (the note §2A "what the proof uses", §5(c))

    P(y, b)  :=  diam{v_u : u in y} <= Delta (|y| - b - 1)

(P false when |y| - b - 1 < 1), with the two properties the proof of Thm 3.3 needs:

* (H) heredity, ``P(y, b) => P(y - i, b - 1)``: removing a point cannot increase the diameter, and
  the threshold Delta(|y - i| - (b - 1) - 1) = Delta(|y| - b - 1) is unchanged.
* (S) soundness, ``P(y, b) => Dbar_b f(y) <= Delta``: Dbar_b f(y) is the largest single-deletion
  jump ||f(z) - f(z - i)|| over z = y minus at most b users, i in z. For a mean,
  f(z) - f(z - i) = (v_i - f(z)) / (|z| - 1); f(z) lies in the convex hull of z, so
  ||v_i - f(z)|| <= diam(z) <= diam(y), and |z| - 1 >= |y| - b - 1 >= 1. Hence the jump is
  <= diam(y) / (|y| - b - 1) <= Delta.

The proof of Thm 3.3 uses the test only through (H) (Obs 3.5: dist(x) <= dist(x') + 1, deleting the
replaced user as well) and (S) (every single-deletion step on the chains x_{-S} -> x_{-U} <- x'_{-S'},
U = S ∪ S' ∪ {i}, moves f by <= Delta; the steps stay within the depth the test covers, see
:mod:`fedkl.algorithms.output_perturbation.del_output_pert`). So with P in place of "Dbar <= Delta" the output law and
its privacy proof are unchanged: same R1 ~ TDLap(eps/2, delta/(e^{eps/2} + 2)), same sensitivity, same
sigma. (P is stronger than the Dbar test: every P-stable set is Dbar-stable, so this mechanism
outputs ⊥ or deletes at least as often as the Dbar version would; it is NOT the same distribution as
the Dbar test, it is Algorithm 1 with a different, sound and hereditary, test. The tests check both
facts against the enumeration references.)

Inside the algorithm y = x_{-S} and b = 4 kappa - |S|, so |y| - b - 1 = n - 4 kappa - 1 for EVERY S:
the threshold is one public number ``rho = Delta (n - 4 kappa - 1)``, and

    P(x_{-S}, 4 kappa - |S|)  <=>  no two kept users are farther apart than rho
                              <=>  S is a vertex cover of the CONFLICT GRAPH
                                   C = ({users}, {uw : ||v_u - v_w|| > rho}).

Hence dist(x) = min{|S| : P} = the minimum vertex cover size tau(C), X_stable^{R1} is non-empty iff
tau(C) <= R1, and the chosen set ("smallest |S|", ties broken by the lexicographically smallest
sorted list of user positions, the rule of :func:`~fedkl.algorithms.output_perturbation.del_output_pert.exact_stability`)
is the lexicographically smallest minimum vertex cover. It does not depend on R1 (so the mechanism
is: R1 ~ TDLap; ⊥ if tau > R1, else f(x_{-S*}) + N(0, sigma^2 I) with the canonical S*). Any other
choice among the stable sets would be private too (the proof bounds every pair of stable sets), but
this one makes the output identical to the enumeration reference on small n.

We parameterize by rho (the diameter the kept users may have) and use Delta = rho / (n - 4 kappa - 1);
this needs ``n >= 4 kappa + 2`` (public; refused otherwise before any data is read).

Sensitivity and noise (the released value is f(x_{-S*}) + N(0, sigma^2 I_d))
----------------------------------------------------------------------------
For "paper" and "tight": eps_bar = eps/2, delta_bar = delta/(e^{eps_bar} + 2), kappa = 1 + ceil(ln(1/delta_bar)/eps_bar),
Delta = rho/(n - 4 kappa - 1):

* ``calibration="profile"`` (default here): no split of (eps, delta) between the two steps. R1's law
  TDLap(eps_r, delta_r), its kappa and sigma/Delta come from :func:`fedkl.algorithms.output_perturbation.stability_profile.calibrate`
  at (eps, delta) with chain factor c = 1 (vertex-cover score, depth 4 kappa) or c = 2 (matching score,
  depth 8 kappa), and Delta = rho/(n - depth - 1) with THAT kappa (see the theorem below);
* ``calibration="tight"``: sensitivity (4 kappa + 1) Delta (the chains have at most
  2 r1 + 3 <= 4 kappa + 1 steps, re-counted in del_output_pert.py), sigma = the analytic Gaussian
  (Balle & Wang 2018) at (eps_bar, delta_bar) for that sensitivity;
* ``calibration="paper"``: sensitivity 8 kappa Delta, sigma = 2 sqrt(ln(2/delta_bar)) 8 kappa Delta / eps_bar.

Theorem (profile calibration of this mechanism). With (eps_r, delta_r, sigma/Delta) =
``calibrate(eps, delta, "exact" | "matching")``, kappa = 1 + ceil(ln(1/delta_r)/eps_r), depth =
4 kappa (vertex cover) or 8 kappa (matching), Delta = rho/(n - depth - 1) and n >= depth + 2, the
release is (eps, delta)-DP, user level, replace-one. Proof: the stability_profile theorem holds for
every test whose score moves by <= 1 between neighbours and whose chains (the single deletions from
x_{-S} and from x'_{-S'} down to x_{-U}, U = S ∪ S' ∪ {i}, when c (d + d') <= depth) each move f by
<= Delta; its proof uses nothing else. Both facts hold here with kappa the PROFILE's kappa:
(score) tau(C) (vertex cover; (H) above, Obs 3.5) and nu(C) (matching: C(x) - i = C(x') - i) move by
<= 1; (chain, c = 1) a step from z = x_{-S} minus j <= d' users, d + d' <= 4 kappa, is bounded by
P(x_{-S}, 4 kappa - d) and (S): ||f(z) - f(z - u)|| <= diam(x_{-S}) / (|z| - 1) <= rho/(n - 4 kappa - 1)
= Delta; (chain, c = 2) |S| <= 2 d, |S'| <= 2 d', so every step starts from a subset z of the
conflict-free kept set x_{-S} with |z| >= n - |U| + 1 >= n - 2 (d + d'), and 2 (d + d') <= 8 kappa
gives ||f(z) - f(z - u)|| <= rho/(|z| - 1) <= rho/(n - 8 kappa - 1) = Delta. The kept sets do not
depend on R1. So the output law on x, x' is the theorem's P_{d, .} vs P_{d', .} with Gaussian means at
most gap(d, d') apart, and calibrate() chose sigma with max H <= delta. ∎ The exact audits in
tests/algorithms/test_mean_output_pert.py (both scores) compute the released law on neighbours.

(For a mean one can also bound ||f(x_{-S}) - f(x'_{-S'})|| directly by
((r1+2)/(n-r1) + (r1+1)/(n-r1-1)) rho <= (4 kappa + 1) rho / (n - 2 kappa): 3-7% smaller at the sizes
we run. Not used: the mechanism stays literally Algorithm 1.)

Exactness and cost
------------------
The vertex cover is solved EXACTLY by :func:`fedkl.algorithms.output_perturbation.vertex_cover.min_vertex_cover` (Buss
kernel + folding + branching), fixed-parameter in k = 2 kappa: at most
``vertex_cover.worst_case_calls(2 kappa)`` recursive calls (~1.38^{2 kappa}; each O(k^2) on the
kernel), a data-independent number. A configuration whose bound exceeds ``max_vc_calls`` is refused
before any data is read (no time-out, no "certificate or ⊥": an inexact existence decision is not
the analysed mechanism, the note §6.2), unless ``test`` allows the matching score instead (``auto``,
the default, switches to it exactly when the cover's bound exceeds the budget, a public decision).

The matching score (``test="matching"``; proof in :class:`~fedkl.algorithms.output_perturbation.del_output_pert.DeletionRelease`).
The score is the maximum matching nu of the conflict graph (Edmonds' blossom algorithm: polynomial
at every kappa), and the deletion set is a cover of at most 2 nu users (:mod:`fedkl.algorithms.output_perturbation.matching`).
nu moves by <= 1 when one user is replaced, so the ⊥ step is unchanged. The proof's chains start
every deletion from a subset of a kept set with >= n - 8 kappa users, so Delta = rho/(n - 8 kappa - 1),
the sensitivity is (8 kappa + 2) Delta, and it needs n >= 8 kappa + 2. This is what lets
``phased-mean-output-pert`` run many phases (kappa' grows with T) on real populations.

The pairwise distances cost O(n^2 d). Floating point: an edge is
``||v_u - v_w|| > rho (1 - 1e-9)`` with the distance computed from the coordinate differences, so a
missing edge certifies the real distance is <= rho; the mean is a fixed-order float sum (rounding
not modelled, as elsewhere). The wall-clock time depends on the data (how hard the instance is): the
guarantee covers the released output, not the server's timing.

Utility is NOT covered by the paper's theorems (the note §5(c)): the test passes (few deletions, no ⊥)
when all but a few users' v_u lie within rho of each other, i.e. for IID-ish users.

Algorithms here
---------------
* :class:`MeanOutputPert`: the mechanism on given per-user vectors (tests, audits).
* :class:`LocalMeanOutputPert` (``mean-output-pert``): one release of the mean local minimizer.
* :class:`PhasedMeanOutputPert` (``phased-mean-output-pert``): Phased-ERM's localization (paper 002,
  Alg 3) with this mechanism in place of SCOutputPert: T phases at (eps/T, delta/T) (basic
  composition), centre = previous release, ⊥ keeps the centre; lam_i by the rule below (``fixed``:
  lam_i = lam 4^i).

The local regularization lam (``lam_rule``)
-------------------------------------------
The mean of the v_u estimates theta_lam = argmin F + (lam/2)||. - c||^2, shrunk toward c by a factor up to
lam/(mu + lam); the a-priori radius G0/(mu + lam), hence rho, Delta and sigma, grows as lam falls. The
``predicted-error`` rule (opt-in; why ``fixed`` is the default: :data:`LAM_RULES`) takes lam* = d K^2/(mu R^2), the minimiser of the predicted excess
(:func:`optimal_lam`, derivation there), from public values only: d, mu, G0 at the public centre,
sigma(rho = 1) (eps, delta, n, calibration), rho_fraction and R, a public prediction of ||c - theta*||
(G0/mu for the first release; in the phased variant the previous phase's predicted bias and noise,
functions of its public lam, sigma and ⊥). So lam, like rho and c, is public and the privacy proof above
is unchanged. ``fixed`` keeps ``lam`` (1 in the studies before the rule: on fertility-partition that
shrinkage was the mean family's whole constant gap to the non-private optimum), the default.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar, Sequence

import numpy as np
import torch

from fedkl.algorithms.contract import Algorithm, AlgorithmParams, AlgorithmResult, BuildContext, SmallAudit, param
from fedkl.algorithms.output_perturbation.conflict_graph import conflict_edges as blocked_conflict_edges
from fedkl.algorithms.output_perturbation.del_output_pert import (
    DeletionBudget,
    DeletionRelease,
    DelOutputPert,
    DelOutputPertResult,
    StabilityPlan,
    check_release_start,
    deletion_depth,
    mean_of_user_vectors,
    noise_forecast,
)
from fedkl.algorithms.output_perturbation.matching import deletion_set
from fedkl.algorithms.output_perturbation.stability_profile import ProfileCalibration, calibrate
from fedkl.algorithms.output_perturbation.vertex_cover import (
    DEFAULT_MAX_VC_CALLS,
    TESTS,
    require_work_budget,
    resolve_test,
    worst_case_calls,
)
from fedkl.algorithms.registry import register
from fedkl.federation.base import CertifiedLocalMinimizer, Federation, LocalRegularizedMinimizer
from fedkl.privacy.guarantee import PAPER_002_RELATIONS, PUBLIC_CENTRES, STABILITY_TEST, Guarantee
from fedkl.privacy.release import Releaser
from fedkl.problems.base import Problem

_FP_PAD = 1e-9
# how users solve for their local minimizer (--mean-local-solver)
LOCAL_SOLVERS = ("lbfgs", "newton")
_DIST_CHUNK = 256


MEAN_CALIBRATIONS = ("profile", "tight", "paper")  # the first is the default
# how the local regularization lam is chosen (--mean-lam-rule); the first is the default
LAM_RULES = ("fixed", "predicted-error")
# Why "fixed" stays the default (measured, fedkl run --dataset fertility-partition --reg 0.1, n = 1,000,
# m = 80): the rule must assume the worst case R = G0/mu = 9.8 for ||c - theta*||, where the data's is
# 0.39; at eps = 2 it takes lam* = 0.002 and pays 11x the noise: test accuracy 0.41 against the majority
# class's 0.62 (lam = 1: 0.62). At eps = 8 it removes the shrinkage gap (test loss 0.6902 -> 0.6817,
# simulations/results/paper002_mean_fix.md). Opt in with --mean-lam-rule predicted-error.


@functools.lru_cache(maxsize=256)
def _dop(eps: float, delta: float, Delta: float, calibration: str, score: str = "exact") -> DeletionRelease:
    # cached: the analytic-Gaussian calibration is a root search (an immutable result)
    return DeletionRelease(eps, delta, Delta, calibration, score=score)


def _positive(name: str, v: float) -> None:
    if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be finite and > 0, got {v!r}")


@dataclass(frozen=True)
class MeanOutputPert(DeletionBudget):
    """The mechanism on given per-user vectors (module docstring): its public parameters (none may depend
    on the data), then :func:`mean_stability_plan` and one charged release (:meth:`release`).

    Args:
        eps, delta: the release is (eps, delta)-DP (any eps > 0, 0 < delta < 1).
        rho: the diameter threshold: users whose v_u are pairwise within rho pass the test.
        calibration: "profile" (the whole release's exact profile: R1's law, kappa and sigma from
            :mod:`fedkl.algorithms.output_perturbation.stability_profile`), "tight" ((4 kappa + 1) Delta, analytic
            Gaussian) or "paper" (8 kappa Delta).
        max_vc_calls: the work budget; configurations whose worst case exceeds it are refused.
    """

    name: ClassVar[str] = "mean-output-pert"
    guarantee: ClassVar[Guarantee] = Guarantee("approx-dp", relations=PAPER_002_RELATIONS)

    eps: float
    delta: float
    rho: float
    calibration: str = MEAN_CALIBRATIONS[0]
    max_vc_calls: int = DEFAULT_MAX_VC_CALLS
    test: str = "auto"

    def __post_init__(self) -> None:
        _positive("eps", self.eps)
        _positive("rho", self.rho)
        if self.test not in TESTS:
            raise ValueError(f"test must be one of {TESTS}, got {self.test!r}")
        if not (isinstance(self.delta, (int, float)) and 0 < self.delta < 1):
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        if self.calibration not in MEAN_CALIBRATIONS:
            raise ValueError(f"calibration must be one of {MEAN_CALIBRATIONS}, got {self.calibration!r}")
        if isinstance(self.max_vc_calls, bool) or int(self.max_vc_calls) != self.max_vc_calls or self.max_vc_calls < 1:
            raise ValueError(f"max_vc_calls must be a positive integer, got {self.max_vc_calls!r}")

    def _profile(self, score: str) -> ProfileCalibration:
        return calibrate(self.eps, self.delta, "matching" if score == "matching" else "exact")

    @property
    def eps_bar(self) -> float:
        """TDLap's eps: eps/2 (paper, tight) or the profile's eps_r for the resolved score."""
        if self.calibration == "profile":
            return self._profile(self._resolved_test).eps_r
        return self.eps / 2.0

    @property
    def delta_bar(self) -> float:
        if self.calibration == "profile":
            return self._profile(self._resolved_test).delta_r
        return self.delta / (math.exp(self.eps / 2.0) + 2.0)

    @property
    def _resolved_test(self) -> str:
        """The concrete score; "auto" decides with the exact score's kappa (public; n does not enter,
        see :func:`~fedkl.algorithms.output_perturbation.vertex_cover.resolve_test`)."""
        if self.test != "auto":
            return self.test
        k_cover = self._profile("vertex-cover").kappa if self.calibration == "profile" else self.kappa
        return resolve_test(self.test, 0, k_cover, self.max_vc_calls)

    @property
    def max_deletions(self) -> int:
        """2 kappa: the largest R1, hence the vertex-cover parameter k."""
        return 2 * self.kappa

    def score(self, n: int) -> str:
        """ "vertex-cover" (exact minimum cover) or "matching" at n users (public; see ``test``)."""
        return self._resolved_test

    def depth(self, n: int) -> int:
        """4 kappa (vertex cover) or 8 kappa (matching): every deletion step of the proof starts from a
        set of >= n - depth users (DeletionRelease)."""
        return deletion_depth(self.score(n), self.kappa)

    @property
    def worst_case_calls(self) -> int:
        return worst_case_calls(self.max_deletions)

    def check(self, n: int) -> None:
        """Refuse, from public values only, a configuration this mechanism cannot run exactly."""
        need = self.depth(n) + 2
        if n < need:
            which = "8 kappa + 2 (matching score)" if self.score(n) == "matching" else "4 kappa + 2"
            raise ValueError(
                f"mean output perturbation needs n >= {which} = {need} users at "
                f"(eps={self.eps:g}, delta={self.delta:g}) (kappa={self.kappa}); got n={n}. "
                "Refused before reading any data (raise eps or delta, or use more users)."
            )
        if self.score(n) == "vertex-cover":
            require_work_budget(self.max_deletions, self.max_vc_calls)

    def Delta(self, n: int) -> float:
        """The deletion-sensitivity threshold this rho stands for: rho / (n - depth - 1)."""
        self.check(n)
        return self.rho / (n - self.depth(n) - 1)

    def dop(self, n: int) -> DeletionRelease:
        """The Algorithm-1 parameters (noise, sensitivity, R1 law) of a release over n users."""
        return _dop(
            self.eps,
            self.delta,
            self.Delta(n),
            self.calibration,
            "matching" if self.score(n) == "matching" else "exact",
        )

    def sensitivity(self, n: int) -> float:
        return self.dop(n).sensitivity

    def sigma(self, n: int) -> float:
        return self.dop(n).sigma

    def release(
        self, plan: StabilityPlan, releaser: Releaser, user_ids: Sequence[str], label: str, details: dict | None = None
    ) -> torch.Tensor | None:
        """Charge (eps, delta) to every user, draw R1, output ⊥ (None) or the noisy mean."""
        n = len(user_ids)
        score = self.score(n)
        info = {"rho": self.rho, "test": f"diameter <= rho ({score} score)", **(details or {})}
        return DelOutputPert(self.dop(n)).release(plan, releaser, user_ids, label, info)

    def result(
        self, theta: torch.Tensor | None, plan: StabilityPlan, n: int, seconds: float, diag: dict
    ) -> DelOutputPertResult:
        res = DelOutputPert(self.dop(n)).result(theta, plan, seconds)
        res.diagnostics.update(diag)
        return res

    def run_vectors(
        self, V: torch.Tensor, releaser: Releaser, user_ids: Sequence[str], label: str | None = None
    ) -> DelOutputPertResult:
        releaser.require("approx-dp", self.name)
        if len(user_ids) != torch.as_tensor(V).shape[0]:
            raise ValueError(f"{len(user_ids)} user ids for {torch.as_tensor(V).shape[0]} vectors")
        start = time.perf_counter()
        plan, diag = mean_stability_plan(V, self)
        theta = self.release(plan, releaser, user_ids, label or self.name)
        return self.result(theta, plan, len(user_ids), time.perf_counter() - start, diag)


def pairwise_distances(V: torch.Tensor) -> np.ndarray:
    """||v_u - v_w|| from the coordinate differences (no Gram-matrix cancellation), float64 (n, n)."""
    V = torch.as_tensor(V).to(torch.float64)
    n = V.shape[0]
    out = torch.empty(n, n, dtype=torch.float64)
    for a in range(0, n, _DIST_CHUNK):
        out[a : a + _DIST_CHUNK] = (V[a : a + _DIST_CHUNK, None, :] - V[None, :, :]).norm(dim=2)
    return out.numpy()


def conflict_edges(V: torch.Tensor, rho: float, err: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """Pairs u < w with ||v_u - v_w|| + e_u + e_w > rho (1 - 1e-9) (``err`` = per-user certified errors
    e, default 0): a missing edge certifies that the exact vectors are within rho. Blocked and pruned
    (:mod:`fedkl.algorithms.output_perturbation.conflict_graph`): the edges of the dense matrix, without the matrix."""
    return blocked_conflict_edges(V, rho * (1 - _FP_PAD), err)


def diameter_predicate(V: torch.Tensor, rho: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``stable(masks)``: P(x_{-S}, 4 kappa - |S|) for every row (kept users), the same float rule
    as :func:`conflict_edges`; for :func:`~fedkl.algorithms.output_perturbation.del_output_pert.exact_stability_predicate`."""
    far = torch.from_numpy(pairwise_distances(V) > rho * (1 - _FP_PAD))

    def stable(masks: torch.Tensor) -> torch.Tensor:
        m = masks.to(torch.bool)
        bad = (m.unsqueeze(2) & m.unsqueeze(1) & far.unsqueeze(0)).flatten(1).any(1)
        return ~bad

    return stable


def mean_stability_plan(V: torch.Tensor, config: MeanOutputPert) -> tuple[StabilityPlan, dict]:
    """The exact test's outcome (NOT private) and non-private diagnostics, in polynomial time for fixed kappa.

    ``V``: (n, d) finite float64 user vectors in the federation's user order.
    """
    V = torch.as_tensor(V).to(torch.float64)
    if V.dim() != 2:
        raise ValueError(f"V must be (n, d), got shape {tuple(V.shape)}")
    n = V.shape[0]
    config.check(n)
    if not torch.isfinite(V).all():
        raise ValueError("user vectors must be finite (substitute the public centre for failed users)")
    edges = conflict_edges(V, config.rho)
    score = config.score(n)
    diag = {"test": score, "conflict_edges": len(edges), "conflict_users": len({u for e in edges for u in e})}
    found, more = deletion_set(n, edges, score, config.max_deletions)
    diag.update(more)
    if score == "vertex-cover":
        diag["vc_worst_case_calls"] = config.worst_case_calls
    if found is None:
        return StabilityPlan(n, None, None, None, score), diag
    tau, deleted = found
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, list(deleted)] = False
    value = mean_of_user_vectors(V)(mask)[0]
    return StabilityPlan(n, tau, deleted, value, score), diag


# --- the federated algorithms ------------------------------------------------------------------
# the users' local solver: a fixed gradient tolerance and iteration cap (part of the public query)
LOCAL_TOL = 1e-10
LOCAL_MAX_ITER = 500


@dataclass(frozen=True)
class MeanOutputPertParams(AlgorithmParams):
    """mean-output-pert's (and phased-mean-output-pert's) hyperparameters. The users' local solver runs at
    the fixed tolerance :data:`LOCAL_TOL` and cap :data:`LOCAL_MAX_ITER` (part of the public query)."""

    mean_lam: float = param(
        1.0,
        "mean-output-pert: local regularization lam of every user's minimizer around the "
        "centre, used with --mean-lam-rule fixed or when the rule needs mu > 0 and reg = 0 (phased: lam_i = lam 4^i)",
        "heuristic",
    )
    mean_lam_rule: str = param(
        LAM_RULES[0],
        "mean-output-pert: how lam is chosen: fixed (--mean-lam) or predicted-error (lam* = d K^2/(mu R^2), the "
        "minimiser of the predicted shrinkage bias + noise from public values with the worst-case ||c - theta*|| = "
        "G0/mu; needs reg > 0; better at large eps, worse at small eps where the worst case is far off)",
        "theorem",
        choices=LAM_RULES,
    )
    mean_rho_fraction: float = param(
        0.25,
        "mean-output-pert: the diameter threshold rho as a fraction of the a-priori diameter 2 G0/(mu + lam) "
        "(too small: ⊥ or many deletions; too large: more noise)",
        "heuristic",
    )
    mean_calibration: str = param(
        MEAN_CALIBRATIONS[0],
        "mean-output-pert noise: profile (the whole release's exact privacy profile, no (eps, delta) split), "
        "tight (analytic Gaussian, sensitivity (4 kappa + 1) Delta) or paper (Alg 1's 2 sqrt(ln(2/delta)) "
        "8 kappa Delta/eps)",
        "theorem",
        choices=MEAN_CALIBRATIONS,
    )
    mean_test: str = param(
        "auto",
        "mean-output-pert: the deletion score: vertex-cover (exact minimum cover, refused above its work "
        "budget), matching (maximum matching: polynomial at every kappa, sensitivity (8 kappa + 2) Delta, "
        "needs n >= 8 kappa + 2) or auto (the cover while it fits)",
        "theorem",
        choices=TESTS,
    )
    mean_local_solver: str = param(
        "newton",
        "mean-output-pert: every user's local solver: newton (batched damped Newton over all users for the GLMs; "
        "per-user L-BFGS for other problems) or lbfgs (per-user scipy L-BFGS for every problem)",
        "heuristic",
        choices=LOCAL_SOLVERS,
    )
    mean_max_vc_calls: int = param(
        DEFAULT_MAX_VC_CALLS,
        "mean-output-pert: refuse (before reading data) plans whose proven worst-case "
        "vertex-cover work exceeds this many calls",
        "safety limit",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for flag, v in (("--mean-lam", self.mean_lam), ("--mean-rho-fraction", self.mean_rho_fraction)):
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be finite and > 0, got {v}")
        if self.mean_max_vc_calls < 1:
            raise ValueError(f"--mean-max-vc-calls must be >= 1, got {self.mean_max_vc_calls}")


@dataclass(frozen=True)
class PhasedMeanOutputPertParams(MeanOutputPertParams):
    mean_phases: int = param(2, "phased-mean-output-pert: phases T, each at (eps/T, delta/T)", "heuristic")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mean_phases < 1:
            raise ValueError(f"--mean-phases must be >= 1, got {self.mean_phases}")


def local_radius(problem: Problem, feature_bound: float, center: torch.Tensor, lam: float) -> float:
    """G0 / (mu + lam): every exact local minimizer lies within this distance of the centre."""
    radius = max(float(torch.as_tensor(center).double().norm()), 1e-12)
    c = problem.constants(feature_bound, param_bound=radius)
    return c.lipschitz / ((c.strong_convexity or 0.0) + lam)


def predicted_excess(lam: float, mu: float, R: float, K: float, d: int, beta: float = 1.0) -> float:
    """The predicted excess objective E F(theta^) - F(theta*) of one release at local regularization lam.

    ``(beta/2) [ (lam/(mu + lam))^2 R^2 + d K^2/(mu + lam)^2 ]``: the shrinkage bias plus the noise
    (derivation in :func:`optimal_lam`); R bounds ||c - theta*||, sigma(lam) = K/(mu + lam)."""
    t = mu + lam
    return 0.5 * beta * ((lam / t) ** 2 * R**2 + d * K**2 / t**2)


def optimal_lam(mu: float, R: float, K: float, d: int) -> float:
    """The local regularization that minimises :func:`predicted_excess`: ``lam* = d K^2 / (mu R^2)``.

    Why lam matters (issue 13 §4, the constant gap on IID data): every user's v_u minimises
    f_u(v) + (lam/2)||v - c||^2, so the mean of the v_u estimates theta_lam = argmin F + (lam/2)||. - c||^2,
    not theta* = argmin F. On fertility-partition (reg 0.1, lam 1, c = 0) that shrinkage alone cost
    0.0092 of the 0.0094 gap to the non-private optimum at m = 254, eps = 8 (the noise 0.00014, the mean of
    local minimizers vs theta_lam < 1e-5). Smaller lam removes the bias but widens the a-priori radius
    G0/(mu + lam) that rho, hence Delta and sigma, scale with: a trade-off, decided here from public values.

    Derivation. F is mu-strongly convex (mu > 0) and beta-smooth. (1) Bias: theta_lam satisfies
    grad F(theta_lam) = -lam (theta_lam - c); strong monotonicity against grad F(theta*) = 0 gives
    (mu + lam) ||e||^2 <= lam <theta* - c, e> for e = theta_lam - theta*, so ||theta_lam - theta*|| <=
    lam/(mu + lam) ||c - theta*|| <= lam R/(mu + lam). (2) Noise: rho = rho_fraction 2 G0/(mu + lam) and
    sigma is linear in rho (every calibration: sigma = (sigma/Delta) rho/(n - depth - 1)), so
    sigma(lam) = K/(mu + lam) with K = sigma(rho = 1) rho_fraction 2 G0, public. (3) With theta^ = theta_lam +
    N(0, sigma^2 I_d), smoothness gives F(theta^) <= F(theta_lam) + <grad F(theta_lam), N> + (beta/2)||N||^2,
    whose mean is F(theta_lam) + (beta/2) sigma^2 d, and F(theta_lam) - F(theta*) <= (beta/2)||theta_lam -
    theta*||^2 (grad F(theta*) = 0); together :func:`predicted_excess`. (4) With t = mu + lam, E is proportional to
    (lam^2 R^2 + d K^2)/t^2, whose derivative in lam is 2 (lam mu R^2 - d K^2)/t^3: negative below
    lam* = d K^2/(mu R^2), positive above, so lam* is the unique minimiser over lam > 0.
    Not modelled: the mean of local minimizers differs from theta_lam (one-shot averaging; O(1/m) for
    IID users, measured < 1e-3 in norm on fertility-partition) and deletions by the test.
    """
    if not (mu > 0 and R > 0 and K > 0 and d >= 1):
        raise ValueError(f"optimal_lam needs mu, R, K > 0 and d >= 1, got mu={mu!r}, R={R!r}, K={K!r}, d={d!r}")
    return d * K**2 / (mu * R**2)


# the mean family: a failed user's local vector is replaced by the public centre (user_vectors); every release
# is a deletion-stability (PTR) theorem, not a sensitivity bound: left to the sampling audits
MEAN_ABSENCE = STABILITY_TEST


@register
class LocalMeanOutputPert(Algorithm[MeanOutputPertParams]):
    """One (eps, delta)-DP release of mean_u v_u, v_u = user u's local regularized minimizer (one
    diameter-tested output perturbation, polynomial time), at the (eps, delta) every user can still afford.

    The centre c is the public start w0. ``--mean-lam`` is the local regularization lam > 0 around c (or
    :func:`optimal_lam` with ``--mean-lam-rule predicted-error``, :meth:`chosen_lam`); ``--mean-rho-fraction``
    sets rho as a fraction of the a-priori diameter bound 2 G0 / (mu + lam), where G0 >= ||grad f_u(c)|| for
    every user (the problem's Lipschitz constant on the ball of radius ||c||, from the loader-enforced feature
    bound) and mu the problem's strong convexity: every exact local minimizer is within G0 / (mu + lam) of c.
    rho_fraction >= 1 makes the test pass always (then the release is a Gaussian of sensitivity
    (4 kappa + 1) rho / (n - 4 kappa - 1), worse than averaging with replace-one noise). ``--mean-test`` is
    the deletion score (:class:`MeanOutputPert`). ``--mean-local-solver`` (:data:`LOCAL_SOLVERS`): "lbfgs"
    (the plain :class:`LocalRegularizedMinimizer` query: per-user L-BFGS) or "newton" (the
    :class:`CertifiedLocalMinimizer` query, residual dropped: batched damped Newton over all users for the
    GLMs, 100x faster at scale; the default since issue 34: the per-user scipy loop was 21-24x slower at 10k
    users, same accuracy). Either is a deterministic function of the user's records and the public query,
    which is all the proof needs; they agree to the solver tolerance
    (tests/algorithms/test_mean_output_pert.py::test_newton_local_solver_matches_lbfgs_and_is_per_user)."""

    name = "mean-output-pert"
    Params = MeanOutputPertParams
    guarantee = Guarantee("approx-dp", relations=PAPER_002_RELATIONS)
    absence = MEAN_ABSENCE
    clients_see = PUBLIC_CENTRES
    small: dict = {"users": 40, "mean_rho_fraction": 0.5}
    audit = SmallAudit(epsilon=2.0, runs=70, users=100, records=10, settings={"mean_test": "matching"})

    def __init__(self, params: MeanOutputPertParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.eps, self.delta = ctx.approx_budget()  # what every user can still afford (all of it when fresh)
        self.lam = params.mean_lam
        self.problem, self.feature_bound = ctx.problem, float(ctx.feature_bound)
        self.mechanism(1.0)  # validates eps, delta
        if ctx.user_ids:  # the public refusal (n too small, work over budget), before any data
            self.check(ctx.num_users)

    def mechanism(self, rho: float) -> MeanOutputPert:
        """The release at diameter threshold ``rho`` (public)."""
        p = self.params
        return MeanOutputPert(self.eps, self.delta, rho, p.mean_calibration, p.mean_max_vc_calls, p.mean_test)

    def chosen_lam(self, n: int, center: torch.Tensor, centre_error: float | None = None) -> tuple[float, dict]:
        """The lam this release uses and how it was chosen (public values only: n, d, eps, delta, the
        problem's constants at the public centre, ``centre_error``).

        ``lam_rule="predicted-error"``: :func:`optimal_lam` with mu the problem's strong convexity, R =
        ``centre_error`` (a public prediction of ||c - theta*||, e.g. the previous phase's) or, by
        default, G0/mu (F is mu-strongly convex and ||grad F(c)|| <= G0, so ||c - theta*|| <= G0/mu),
        and K = sigma(rho = 1) rho_fraction 2 G0. With mu = 0 (no regularizer) no R bounds the bias and
        the bound has no minimiser: the given ``lam`` is used and the details say so."""
        if self.params.mean_lam_rule == "fixed":
            return self.lam, {"lam_rule": "fixed"}
        center = torch.as_tensor(center).to(torch.float64)
        c = self.problem.constants(self.feature_bound, param_bound=max(float(center.norm()), 1e-12))
        mu, G0 = float(c.strong_convexity or 0.0), float(c.lipschitz)
        if mu <= 0:
            return self.lam, {"lam_rule": "fixed (predicted-error needs mu > 0: set reg > 0)"}
        R = G0 / mu if centre_error is None else float(centre_error)
        K = self.mechanism(1.0).sigma(n) * self.params.mean_rho_fraction * 2.0 * G0
        d = center.numel()
        lam = optimal_lam(mu, R, K, d)
        return lam, {
            "lam_rule": "predicted-error",
            "mu": mu,
            "centre_error": R,
            # beta = the smoothness of F (regularizer included); None for a non-smooth loss
            "predicted_excess": None if c.smoothness is None else predicted_excess(lam, mu, R, K, d, c.smoothness),
        }

    def resolved(
        self, n: int, center: torch.Tensor, centre_error: float | None = None
    ) -> tuple[LocalMeanOutputPert, dict]:
        """This release with its lam fixed by :meth:`chosen_lam` (and the rule's details)."""
        lam, info = self.chosen_lam(n, center, centre_error)
        params = replace(self.params, mean_lam=lam, mean_lam_rule="fixed")
        return LocalMeanOutputPert(params, self.ctx), {"lam": lam, **info}

    def rho(self, center: torch.Tensor) -> float:
        return self.params.mean_rho_fraction * 2.0 * local_radius(self.problem, self.feature_bound, center, self.lam)

    def check(self, n: int) -> None:
        """The public refusal (n too small, worst-case work over budget): no data needed."""
        self.mechanism(1.0).check(n)

    def forecast(self, n: int, w0: torch.Tensor, user_ids=None) -> dict:
        """Public values only: every local minimizer, hence their mean, lies within
        ``signal_radius = G0/(mu + lam)`` of the centre w0; the release adds noise of norm about
        ``sigma sqrt(d)``. ``noise_over_signal > 1``: the output is expected farther from the mean
        than any data could move it (the runner refuses unless forced)."""
        center = torch.as_tensor(w0).to(torch.float64)
        alg, info = self.resolved(n, center)
        mech = alg.mechanism(alg.rho(center))
        signal = local_radius(self.problem, self.feature_bound, center, alg.lam)
        return {**noise_forecast(mech.sigma(n), mech.Delta(n), signal, center.numel()), "lam": info["lam"]}

    def user_vectors(self, federation: Federation, center: torch.Tensor) -> tuple[torch.Tensor, int]:
        query = {"lbfgs": LocalRegularizedMinimizer, "newton": CertifiedLocalMinimizer}[self.params.mean_local_solver]
        ans = federation.compute(query(center, self.lam, LOCAL_TOL, LOCAL_MAX_ITER))
        V = ans.values[:, : federation.num_params].to(torch.float64).clone()
        bad = ~torch.isfinite(V).all(dim=1)
        for u in ans.failed:
            bad[ans.users.index(u)] = True
        V[bad] = center.to(torch.float64)
        return V, int(bad.sum())

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
        label: str | None = None,
        centre_error: float | None = None,
    ) -> DelOutputPertResult:
        """One charged release; ``theta`` is None for ⊥. ``w0`` is the public centre c;
        ``centre_error`` a public prediction of ||c - theta*|| for the lam rule (:meth:`chosen_lam`)."""
        n = federation.num_users
        center = check_release_start(self.name, releaser, federation, w0)
        self.check(n)  # before any data is read
        if self.params.mean_lam_rule != "fixed":
            alg, info = self.resolved(n, center, centre_error)
            res = alg.run(federation, releaser, w0, progress, label)
            res.diagnostics["lam_choice"] = info
            return res
        mech = self.mechanism(self.rho(center))
        start = time.perf_counter()
        V, substituted = self.user_vectors(federation, center)
        plan, diag = mean_stability_plan(V, mech)
        diag["failed_users_set_to_centre"] = substituted
        theta = mech.release(
            plan,
            releaser,
            federation.ids_of(range(n)),
            label or self.name,
            {"lam": self.lam, "rho_fraction": self.params.mean_rho_fraction},
        )
        res = mech.result(
            None if theta is None else theta.to(torch.as_tensor(w0).dtype), plan, n, time.perf_counter() - start, diag
        )
        if progress is not None:
            progress({"round": 1, "rounds": 1, "released": theta is not None, **res.diagnostics})
        return res


@dataclass
class PhasedMeanOutputPertResult(AlgorithmResult):
    w: torch.Tensor
    phases: int
    bottoms: int
    sigmas: list[float]
    details: dict = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        return self.phases


@register
class PhasedMeanOutputPert(Algorithm[PhasedMeanOutputPertParams]):
    """Phased-ERM localization (paper 002, Alg 3) with :class:`LocalMeanOutputPert` in each phase: T =
    ``--mean-phases`` releases at (eps/T, delta/T) of the (eps, delta) every user can still afford. Phase i's
    lam: ``--mean-lam-rule fixed`` (default) lam_i = lam 4^i; ``predicted-error`` :func:`optimal_lam` with
    the previous phase's predicted centre error (:meth:`run`).

    Guarantee: (eps, delta)-DP, user level, replace-one, n public, by basic composition of T
    (eps/T, delta/T)-DP releases (each charged to every user before it is made). Every phase's
    centre is the previous release (or the public w0), its rho a public function of that centre.
    A ⊥ keeps the previous centre (post-processing). The paper's utility theorem does NOT cover this
    f (mean of local minimizers instead of the ERM minimizer; the note §5(c)).
    """

    name = "phased-mean-output-pert"
    Params = PhasedMeanOutputPertParams
    guarantee = Guarantee("approx-dp", relations=PAPER_002_RELATIONS)
    absence = MEAN_ABSENCE
    clients_see = PUBLIC_CENTRES
    small: dict = {"users": 60, "mean_rho_fraction": 0.5}
    audit = SmallAudit(epsilon=2.0, runs=70, users=150, records=2, settings={"mean_test": "matching"})

    def __init__(self, params: PhasedMeanOutputPertParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.eps, self.delta = ctx.approx_budget()  # what every user can still afford (all of it when fresh)
        T = params.mean_phases
        self._phase_ctx = replace(ctx, approx_left=(self.eps / T, self.delta / T))  # each phase's budget
        self.phase(1)  # validates the phases' (eps/T, delta/T) and, given the users, refuses too few of them

    def phase(self, i: int) -> LocalMeanOutputPert:
        """Phase i's release: (eps/T, delta/T), lam_i = lam 4^i (before ``--mean-lam-rule``)."""
        return LocalMeanOutputPert(replace(self.params, mean_lam=self.params.mean_lam * 4.0**i), self._phase_ctx)

    def check(self, n: int) -> None:
        # all phases run at (eps/T, delta/T): one kappa, one refusal check
        self.phase(1).check(n)

    def forecast(self, n: int, w0: torch.Tensor, user_ids=None) -> dict:
        """The first phase's :meth:`LocalMeanOutputPert.forecast` (it moves the model the most)."""
        return self.phase(1).forecast(n, w0)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> PhasedMeanOutputPertResult:
        p, T = self.params, self.params.mean_phases
        releaser.require("approx-dp", self.name)
        self.check(federation.num_users)  # before any data is read
        center = torch.as_tensor(w0).to(torch.float64)
        bottoms, sigmas, per_phase = 0, [], []
        centre_error = None  # phase 1: the rule's a-priori G0/mu
        for i in range(1, T + 1):
            alg, lam_info = self.phase(i).resolved(federation.num_users, center, centre_error)
            lam_i, rho_i = alg.lam, alg.rho(center)  # public: functions of the public centre
            res = alg.run(federation, releaser, center, label=f"{self.name}/phase-{i}")
            sigmas.append(res.sigma)
            released = res.theta is not None
            if lam_info.get("lam_rule") == "predicted-error":
                # the next centre's predicted distance to theta*: the shrinkage bias plus the noise (a ⊥
                # keeps the centre, hence its prediction); public: lam, mu, sigma and the ⊥ are
                mu, R = lam_info["mu"], lam_info["centre_error"]
                if released:
                    centre_error = math.sqrt((lam_i / (mu + lam_i) * R) ** 2 + res.sigma**2 * center.numel())
            if released:
                center = res.theta.to(torch.float64)
            else:
                bottoms += 1
            d = res.diagnostics
            per_phase.append(
                {
                    "phase": i,
                    "lam": lam_i,
                    "lam_choice": lam_info,
                    "bottom": not released,
                    "sigma": res.sigma,
                    "rho": rho_i,
                    "nonprivate": {
                        "dist": d["dist"],
                        "deleted_users": d["deleted_users"],
                        "conflict_edges": d["conflict_edges"],
                        "vc_calls": d.get("vc_calls"),  # the matching score makes no vertex-cover calls
                        "seconds": d["seconds"],
                    },
                }
            )
            if progress is not None:
                progress({"round": i, "rounds": T, "released": released, "sigma": res.sigma})
        kappa = self.phase(1).mechanism(1.0).kappa
        details = {
            "dp": "approximate (eps, delta)-DP, user level, replace-one, n public; basic composition of "
            f"{T} x (eps/T, delta/T) releases (each: DelOutputPert with the diameter test)",
            "eps": self.eps,
            "delta": self.delta,
            "lam": p.mean_lam,
            "lam_rule": p.mean_lam_rule,
            "rho_fraction": p.mean_rho_fraction,
            "calibration": p.mean_calibration,
            "kappa_per_phase": kappa,
            "bottoms": bottoms,
            "bottom_rate": bottoms / T,
            "sigmas": sigmas,
            "phases": per_phase,
            "nonprivate_diagnostics": {
                "deleted_users": [p["nonprivate"]["deleted_users"] for p in per_phase],
                "dist": [p["nonprivate"]["dist"] for p in per_phase],
            },
        }
        return PhasedMeanOutputPertResult(center.to(torch.as_tensor(w0).dtype), T, bottoms, sigmas, details)
