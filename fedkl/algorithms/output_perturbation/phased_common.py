"""Shared machinery of paper 002's phased algorithms (Ghazi et al., "On User-Level Private Convex
Optimization", Algorithms 3-6): schedules, the inner-release interface, cohorts, budget checks.

Every algorithm built on this module (:mod:`fedkl.algorithms.output_perturbation.phased_erm`,
:mod:`fedkl.algorithms.output_perturbation.phased_sco`, :mod:`fedkl.algorithms.output_perturbation.sc_phased`) is a sequence of
*inner releases*: calls of an SCOutputPert-like mechanism (paper 002, Alg 2: DelOutputPert of the
minimizer of a strongly convex objective), each (eps_i, delta_i)-DP, user level, replace-one, n
public. The phased algorithms only decide WHICH users a call sees, its (eps_i, delta_i), its public
threshold Delta_i, its extra regularizer lam_i and its centre; everything they do with an output is
post-processing. The inner release is a parameter (:data:`InnerRelease`), by default
:class:`SCInnerRelease`: fedkl's :class:`~fedkl.algorithms.output_perturbation.exact_output_pert.SCOutputPert` (the paper's
test) up to 20 users per call, else the same minimizer through the polynomial-time diameter test of
:mod:`fedkl.algorithms.output_perturbation.diameter_output_pert` (``test`` / ``--p002-test``). So another private release
can be swapped in without touching the phased code. An inner release may also state ``check(n, eps,
delta)`` (its public refusal: every call is checked before the first one reads data),
``noise_ratio(n, eps, delta)`` (sigma/Delta, used in lambda*) and ``min_users(eps, delta)`` (Phased-SCO's
smallest cohort).

Public schedule (re-derived in docs/derivations/paper-002.md, "the note"; natural log throughout)
------------------------------------------------------------------------------------------
* Noise constant. With ``ratio(eps_i, delta_i) = sigma_i / Delta_i`` of the inner release and a
  threshold rule ``Delta_i = f_i G_i / (mu_i n_i sqrt(m))`` (``G_i`` the Lipschitz constant of the
  call's loss, 2G in the phases; ``mu_i = mu + lam_i``; ``f_i`` the rule's dimensionless factor), the
  phase noise is ``sigma_i = c_i 2G / (lam_i n_i sqrt(m))`` with
  ``c_i = ratio f_i lam_i / mu_i <= ratio f_i =: c`` (c of docs/derivations/paper-002.md §2E).
* Phased-ERM (Alg 3, Thm 4.1). Telescoping Lemma 4.2 with the ideal noisy iterates gives
  ``E[excess] <= 2 lam D^2 + (8/3) c^2 d G^2 / (lam n^2 m) + G sqrt(d) sigma_T`` (D >= ||w0 - theta*||).
  The paper's ``lam = G sqrt(d)/(D n sqrt(m))`` leaves ``c^2`` in the bound; minimising the first two
  terms gives ``lam* = (2/sqrt(3)) c G sqrt(d) / (D n sqrt(m))`` and ``(8/sqrt(3)) c D G sqrt(d)/(n sqrt m)``
  (pitfall 7). T = ceil(ln(n m)).
* Phased-SCO (Alg 4, Thm 5.1). Lemma 5.2 counts USERS in ``16 G^2/(lam_i n_i)``; Shalev-Shwartz et
  al. 2009 Thm 7 applies to the n_i m iid SAMPLES of cohort i, so the term is ``16 G^2/(lam_i n_i m)``
  (pitfall 6). With n_i = n / 2^i and lam_i = lam 4^i every phase's noise term is the same
  ``8 d G^2 c^2 / (lam n^2 m)``, hence
  ``E[excess] <= 2 lam D^2 + (G^2/(lam n m)) (16 + 8 (T - 1) d c^2 / n)`` and
  ``lam_SCO = (G/D) sqrt((8 + 4 (T - 1) d c^2 / n) / (n m))``
  (the max{c sqrt(d)/(n sqrt m), 1/sqrt(nm)} shape of pitfall 6, with its constants).
  N0 = 8 kappa(eps, delta) (Cor 3.7 needs 4 kappa <= n_i / 2), T = floor(log2(n / N0)) (pitfall 5: the
  printed ceil would leave the last cohort below N0), cohorts half-open
  ``[floor(n/2^i), floor(n/2^(i-1)))`` of a hash order of the user ids (data-independent); the
  ``floor(n/2^T)`` users first in that order are never used and never charged.
* Localisation ball. ``K_i = K ∩ B(theta^_{i-1}, R_i)``, ``R_i = G/lam_i`` (the paper prints
  theta_{i-1}: a typo, pitfall 5). The inner release minimises over R^d (the case the stability
  lemmas Thm 3.6 / Lemma C.1 cover, pitfall 4). The ball is then inactive: the objective is
  (mu + lam_i)-strongly convex, so ``||theta*_i - c|| <= ||grad L(c)|| / (mu + lam_i) <= G_c / lam_i``
  with ``G_c`` the public bound on every user's gradient at the centre c (``G_c <= G`` on K). We use
  ``R_i = G_c / lam_i`` (the tighter of the two valid radii). A released centre is post-processed
  by ``clip to B(c, R_i)`` (contains theta*_i, so the distance to theta*_i never grows) then
  ``project onto K`` (pitfall 3); both are functions of the private output and public constants.
* ⊥ (unspecified in the paper, pitfall 3): the phase keeps the previous centre (post-processing of
  the output ⊥) and records the phase in ``bottoms``. Under the random-permutation model a ⊥ has
  probability <= beta' per phase.
* Thresholds. ``uc`` (theorem): Delta_uc of docs/derivations/paper-002.md §2B (Cor 3.7 with the union bound the printed Alg 2
  omits, pitfall 1) with ``G -> G_i``, ``mu -> mu_i``, r = 4 kappa; needs n_i >= 4 kappa + 2.
  ``scaled`` (heuristic): ``A G_i/(mu_i n_i sqrt m)``. ``fixed`` (Phased-ERM/SCO only, legacy):
  ``Delta_1 / 4^(i-1)``. Any public threshold is private; the rule only decides whether tests pass.

Budget. Each algorithm declares what it charges each user (``needs()``); ``fedkl.runner`` checks it
against the ledger before anything is read (BudgetExceeded; nothing charged, read or released). A run
started directly (``alg.run``) is not pre-checked: the ledger still refuses any over-budget charge when it is
made, so such a run may stop half-way.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence, Union

import torch

from fedkl.algorithms.output_perturbation.del_output_pert import DeletionRelease, deletion_depth
from fedkl.algorithms.output_perturbation.delta_share import release_share
from fedkl.algorithms.output_perturbation.diameter_output_pert import (
    DiameterSCOutputPert,
    DiameterTest,
    SelectedDeltaSCOutputPert,
    resolve_test,
)
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert, delta_union_bound
from fedkl.algorithms.output_perturbation.vertex_cover import require_work_budget
from fedkl.algorithms.registry import AlgorithmResult
from fedkl.federation.base import Answers, Federation
from fedkl.privacy.release import Releaser
from fedkl.problems.base import Problem

INNER_TESTS = ("auto", "exact", "vertex-cover", "matching")

DELTA_RULES = ("uc", "scaled", "fixed")

# Delta(G_call, mu, n_call, m, kappa, beta): must be proportional to 1/mu (see rule_factor)
DeltaRule = Union[str, Callable[[float, float, int, int, int, float], float]]


# --- the inner release ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseCall:
    """One inner release; every field is public (a data-independent constant or an earlier
    private output). ``lam`` is the extra regularizer (lam/2)||theta - center||^2 (0: none)."""

    label: str
    index: int
    eps: float
    delta: float
    Delta: float
    lam: float
    center: torch.Tensor


@dataclass
class InnerOutcome:
    """``theta``: the private output (None for ⊥); ``sigma``: its public noise scale;
    ``diagnostics``: server-side, NOT private."""

    theta: torch.Tensor | None
    sigma: float
    diagnostics: dict = field(default_factory=dict)


# (federation restricted to the call's users, releaser, call) -> outcome. Contract: an
# (call.eps, call.delta)-DP release, user level, replace-one, charged to every user of the federation
# through the releaser BEFORE it is made; it must not release anything else.
InnerRelease = Callable[[Federation, Releaser, PhaseCall], InnerOutcome]


class SCInnerRelease:
    """The default inner release: SCOutputPert (paper 002, Alg 2) of the phase objective, with the
    deletion test chosen by ``test`` from PUBLIC values (the call's n, eps, delta) only:

    * ``exact``: :class:`~fedkl.algorithms.output_perturbation.exact_output_pert.SCOutputPert`, the paper's test (the Lemma
      C.1 certificate, else enumeration of ~2^n user sets): n <= ``max_exact_users``;
    * ``vertex-cover`` / ``matching``: :class:`~fedkl.algorithms.output_perturbation.diameter_output_pert.DiameterSCOutputPert`,
      the same f~ through the local-minimizer diameter test, polynomial time (matching) or FPT with a
      checked work bound (vertex cover), at any n above 4 kappa / 8 kappa;
    * ``auto`` (default): ``exact`` when n <= max_exact_users, else the diameter test with its own
      ``auto`` score.

    Every choice is an (eps, delta)-DP release, user level, replace-one, n public (each module's
    docstring has the proof), charged to every user of the federation before it is made.
    :meth:`check` refuses a call from public values only; the phased algorithms call it for EVERY
    call before the first one reads data.
    """

    def __init__(
        self,
        problem: Problem,
        feature_bound: float,
        *,
        calibration: str = "paper",
        max_exact_users: int = 20,
        use_certificate: bool = True,
        test: str = "auto",
        diameter: DiameterTest | None = None,
    ) -> None:
        if test not in INNER_TESTS:
            raise ValueError(f"test must be one of {INNER_TESTS}, got {test!r}")
        self.problem, self.feature_bound = problem, float(feature_bound)
        self.calibration, self.max_exact_users, self.use_certificate = calibration, max_exact_users, use_certificate
        self.test = test
        self.diameter = diameter or DiameterTest()

    def kind(self, n: int, eps: float, delta: float) -> str:
        """ "exact", "vertex-cover" or "matching" for a call over n users at (eps, delta)."""
        if self.test == "exact" or (self.test == "auto" and n <= self.max_exact_users):
            return "exact"
        sub = "auto" if self.test == "auto" else self.test
        return resolve_test(sub, n, kappa(eps, delta, self.calibration), self.diameter.max_vc_calls)

    def dop(self, n: int, eps: float, delta: float, Delta: float = 1.0) -> DeletionRelease:
        kind = self.kind(n, eps, delta)
        return DeletionRelease(eps, delta, Delta, self.calibration, score="matching" if kind == "matching" else "exact")

    def noise_ratio(self, n: int, eps: float, delta: float) -> float:
        """sigma / Delta of the call (public)."""
        return self.dop(n, eps, delta).sigma

    def min_users(self, eps: float, delta: float) -> int:
        """The fewest users a diameter-test call accepts at (eps, delta) (public)."""
        k = kappa(eps, delta, self.calibration)
        score = resolve_test("auto" if self.test == "exact" else self.test, 0, k, self.diameter.max_vc_calls)
        return deletion_depth(score, k) + 2

    def check(self, n: int, eps: float, delta: float) -> None:
        """Refuse (ValueError) a call this release cannot run exactly; public values only."""
        kind = self.kind(n, eps, delta)
        if kind == "exact":
            if n > self.max_exact_users:
                raise ValueError(
                    f"the exact test (enumeration) refuses n={n} > max_exact_users={self.max_exact_users}; "
                    "use test auto, vertex-cover or matching. Nothing was read or charged."
                )
            return
        depth = self.dop(n, eps, delta).depth
        if n < depth + 2:
            raise ValueError(
                f"the {kind} diameter test needs at least {depth + 2} users per call at (eps={eps:.4g}, "
                f"delta={delta:.3g}) (kappa={kappa(eps, delta, self.calibration)}); a call has {n}. Nothing was read or "
                "charged (raise eps or delta, use fewer phases, or more users)."
            )
        if kind == "vertex-cover":
            require_work_budget(2 * kappa(eps, delta, self.calibration), self.diameter.max_vc_calls)

    def config(self, call: "PhaseCall") -> SCOutputPert:
        """The call's exact-test release (its fields: the call's public parameters)."""
        return SCOutputPert.for_problem(
            self.problem,
            self.feature_bound,
            call.center,
            eps=call.eps,
            delta=call.delta,
            Delta=call.Delta,
            extra_reg=call.lam,
            calibration=self.calibration,
            max_exact_users=self.max_exact_users,
            use_certificate=self.use_certificate,
        )

    def __call__(self, federation: Federation, releaser: Releaser, call: "PhaseCall") -> InnerOutcome:
        kind = self.kind(federation.num_users, call.eps, call.delta)
        config = self.config(call)
        if kind == "exact":
            alg = config
        else:
            alg = DiameterSCOutputPert(config, replace(self.diameter, test=kind))
        res = alg.run(federation, releaser, call.center, label=call.label)
        return InnerOutcome(res.theta, float(res.sigma), dict(getattr(res, "diagnostics", {}) or {}))


DELTA_SELECTIONS = ("fixed", "sparse-vector")


class SelectedDeltaInnerRelease(SCInnerRelease):
    """:class:`SCInnerRelease` whose every call chooses its Delta privately (issue 13 §2): the call
    (eps_i, delta_i, Delta_i) runs :class:`~fedkl.algorithms.output_perturbation.diameter_output_pert.SelectedDeltaSCOutputPert`
    over the public grid Delta_i / ratio^k, k = size-1..0 (ending at the rule's Delta_i): AboveThreshold
    at eps_sel = ``select_fraction`` eps_i (None: :meth:`share`'s rule, fedkl/algorithms/output_perturbation/delta_share.py) on
    the capped deletion scores, then the diameter-test release of
    the chosen Delta at (eps_i - eps_sel, delta_i).

    Guarantee of one call: **(eps_i, delta_i)-DP, user level, replace-one, n public** (proof in
    SelectedDeltaSCOutputPert: the selection is eps_sel-DP, the release (eps_i - eps_sel, delta_i)-DP for
    every fixed grid value, adaptive basic composition). So the phased algorithms' composition is
    unchanged: every call is an (eps_i, delta_i)-DP inner release charged to its users before it is made
    (here as two ledger entries, ``<label>/select-Delta`` (eps_sel, 0) then ``<label>`` (eps_i - eps_sel,
    delta_i)), and Phased-ERM's T calls compose to (sum eps_i, sum delta_i) = (eps, delta), Phased-SCO's
    disjoint cohorts in parallel, the SC variants' localisation + phases to (eps, delta). The grid, its
    order, the threshold and eps_sel are functions of the call's public (eps_i, delta_i, Delta_i) only.

    Always the diameter test (the enumeration test has no capped score): ``test`` "exact" is refused;
    "auto" is the diameter test's own auto score at every n. The public helpers (:meth:`check`,
    :meth:`noise_ratio`, :meth:`min_users`) take the call's TOTAL eps and answer for the release at
    eps_i - eps_sel (noise_ratio at the largest grid Delta: the chosen one scales it by Delta_j / Delta_i).
    """

    def __init__(
        self,
        problem: Problem,
        feature_bound: float,
        *,
        select_fraction: float | None = 0.25,
        grid_ratio: float = 2.0,
        grid_size: int = 12,
        **kw,
    ) -> None:
        super().__init__(problem, feature_bound, **kw)
        if self.test == "exact":
            raise ValueError(
                "the private Delta selection uses the diameter test: give test auto, vertex-cover or matching"
            )
        if select_fraction is not None and not 0 < select_fraction < 1:
            raise ValueError(f"select_fraction must be in (0, 1), got {select_fraction}")
        self.select_fraction = None if select_fraction is None else float(select_fraction)
        self.grid_ratio, self.grid_size = grid_ratio, grid_size

    def share(self, eps: float, delta: float, n: int | None = None) -> float:
        """The selection's share of a call's eps: the given fraction, else the rule of
        :func:`fedkl.algorithms.output_perturbation.delta_share.release_share` at (eps, delta), its best share whose release
        the diameter test accepts at n users (public)."""
        if self.select_fraction is not None:
            return self.select_fraction

        def accepts(f: float) -> bool:
            try:
                SCInnerRelease.check(self, n, eps - eps * f, delta)
            except ValueError:
                return False
            return True

        return release_share(
            eps,
            delta,
            self.calibration,
            self.test,
            float(self.grid_ratio),
            int(self.grid_size),
            None if n is None else accepts,
        )

    def release_eps(self, eps: float, delta: float, n: int | None = None) -> float:
        """eps_i - eps_sel, computed as SelectedDeltaSCOutputPert does."""
        return eps - eps * self.share(eps, delta, n)

    def kind(self, n: int, eps: float, delta: float) -> str:
        """The diameter score of a release at (eps, delta) (eps: the RELEASE's)."""
        return resolve_test(self.test, n, kappa(eps, delta, self.calibration), self.diameter.max_vc_calls)

    def noise_ratio(self, n: int, eps: float, delta: float) -> float:
        return super().noise_ratio(n, self.release_eps(eps, delta, n), delta)

    def min_users(self, eps: float, delta: float) -> int:
        return super().min_users(self.release_eps(eps, delta), delta)

    def check(self, n: int, eps: float, delta: float) -> None:
        super().check(n, self.release_eps(eps, delta, n), delta)

    def mechanism(self, n: int, call: "PhaseCall") -> SelectedDeltaSCOutputPert:
        """The call's whole mechanism (selection + release) over n users (public values only)."""
        kind = self.kind(n, self.release_eps(call.eps, call.delta, n), call.delta)
        share = self.share(call.eps, call.delta, n)
        return SelectedDeltaSCOutputPert(
            self.config(call), replace(self.diameter, test=kind), share, self.grid_ratio, self.grid_size
        )

    def __call__(self, federation: Federation, releaser: Releaser, call: "PhaseCall") -> InnerOutcome:
        res = self.mechanism(federation.num_users, call).run(federation, releaser, call.center, label=call.label)
        return InnerOutcome(res.theta, float(res.sigma), dict(res.diagnostics))


def sc_output_pert_inner(
    problem: Problem,
    feature_bound: float,
    *,
    delta_select: str = "fixed",
    select_fraction: float | None = 0.25,
    **kw,
) -> SCInnerRelease:
    """The default inner release: :class:`SCInnerRelease` (``delta_select="fixed"``: Delta = the rule's) or
    :class:`SelectedDeltaInnerRelease` (``"sparse-vector"``); other keyword arguments as SCInnerRelease's."""
    if delta_select not in DELTA_SELECTIONS:
        raise ValueError(f"delta_select must be one of {DELTA_SELECTIONS}, got {delta_select!r}")
    if delta_select == "sparse-vector":
        return SelectedDeltaInnerRelease(problem, feature_bound, select_fraction=select_fraction, **kw)
    return SCInnerRelease(problem, feature_bound, **kw)


def inner_noise_ratio(inner: InnerRelease, n: int, eps: float, delta: float, calibration: str) -> float:
    """sigma / Delta of an inner call: the inner's own when it states one, else DelOutputPert's."""
    own = getattr(inner, "noise_ratio", None)
    return float(own(n, eps, delta)) if own is not None else noise_ratio(eps, delta, calibration)


def precheck_calls(inner: InnerRelease, calls: Sequence[tuple[int, float, float]]) -> None:
    """Ask the inner release to refuse, BEFORE any call reads data, every (n, eps, delta) call it
    cannot run (inner releases without a ``check`` are asked nothing)."""
    check = getattr(inner, "check", None)
    if check is None:
        return
    for n, eps, delta in calls:
        check(n, eps, delta)


@functools.lru_cache(maxsize=1024)
def noise_ratio(eps: float, delta: float, calibration: str = "paper") -> float:
    """sigma / Delta of one DelOutputPert release at (eps, delta) (public; both calibrations are
    linear in Delta)."""
    return DeletionRelease(eps, delta, 1.0, calibration).sigma


@functools.lru_cache(maxsize=1024)
def kappa(eps: float, delta: float, calibration: str = "tight") -> int:
    """kappa of DelOutputPert at (eps, delta): the TDLap centre, 4 kappa = the test depth ("paper" and
    "tight" share it; the whole-release "profile" calibration chooses its own TDLap)."""
    return DeletionRelease(eps, delta, 1.0, calibration).kappa


# --- cohorts -------------------------------------------------------------------------------------
class CohortFederation(Federation):
    """The users ``users`` (positions in ``parent``) seen as a federation of their own: an inner
    release run on it reads and charges only them. Answers are mapped back to cohort positions."""

    def __init__(self, parent: Federation, users: Sequence[int]) -> None:
        users = [int(u) for u in users]
        if len(set(users)) != len(users) or not users:
            raise ValueError("a cohort is a non-empty list of distinct user positions")
        if min(users) < 0 or max(users) >= parent.num_users:
            raise ValueError("cohort positions out of range")
        self.parent = parent
        self.users = users
        self._ids = tuple(parent.ids_of(users))

    @property
    def user_ids(self) -> tuple[str, ...]:
        return self._ids

    @property
    def num_params(self) -> int:
        return self.parent.num_params

    def compute(self, query, users: Sequence[int] | None = None) -> Answers:
        local = self._users(users)
        back = {p: i for i, p in enumerate(self.users)}
        ans = self.parent.compute(query, [self.users[i] for i in local])
        return Answers(users=local, values=ans.values, failed=[back[p] for p in ans.failed])


def hash_order(user_ids: Sequence[str], seed: int) -> list[int]:
    """Positions ordered by ``sha256(seed, user_id)``: public, data-independent, the same on every
    backend (a user keeps its place whatever the other users' data are)."""

    def key(pos: int) -> bytes:
        return hashlib.sha256(f"p002-phased-sco\x1f{int(seed)}\x1f{user_ids[pos]}".encode()).digest()

    return sorted(range(len(user_ids)), key=key)


def sco_cohort_bounds(n: int, phases: int) -> list[tuple[int, int]]:
    """Half-open rank ranges ``[floor(n/2^i), floor(n/2^(i-1)))``, i = 1..T (disjoint; pitfall 5)."""
    return [(n >> i, n >> (i - 1)) for i in range(1, phases + 1)]


def sco_cohorts(user_ids: Sequence[str], phases: int, seed: int) -> list[list[int]]:
    """Cohort i (positions) = the users whose hash rank lies in :func:`sco_cohort_bounds`'s range i."""
    order = hash_order(user_ids, seed)
    return [sorted(order[lo:hi]) for lo, hi in sco_cohort_bounds(len(user_ids), phases)]


# --- schedules -----------------------------------------------------------------------------------
def erm_phases(n: int, m: int) -> int:
    """T = ceil(ln(n m)) (Alg 3, line 3), at least 1."""
    return max(1, math.ceil(math.log(n * m)))


def sco_min_cohort(eps: float, delta: float, calibration: str = "tight") -> int:
    """N0 = 8 kappa(eps, delta): Cor 3.7's regime (4 kappa <= n_i / 2) for every cohort."""
    return 8 * kappa(eps, delta, calibration)


def sco_phases(n: int, n0: int) -> int:
    """T = floor(log2(n / N0)) (pitfall 5): the last cohort has >= N0 users; 0 if n < 2 N0."""
    if n < 2 * n0:
        return 0
    T = int(math.floor(math.log2(n / n0)))
    while (n >> T) < n0:  # guard against rounding of log2
        T -= 1
    while (n >> (T + 1)) >= n0:
        T += 1
    return T


# --- the split of (eps, delta) between Phased-ERM's phases ----------------------------------------
PHASE_SPLITS = ("auto", "optimal", "equal")  # auto: optimal, equal with the paper's constants (phased_erm)


def phase_weights(T: int) -> tuple[float, ...]:
    """w_j of the split bound S = sum_j w_j c_j^2 (:func:`split_bound`): 4^-j, and 4^-T 4/3 for the last
    phase (the tail sum_{j >= T} 4^-j, so that an equal split gives S = c^2/3, the (8/3) c^2 of lambda*)."""
    if T < 1:
        raise ValueError(f"need T >= 1 phases, got {T}")
    return tuple(4.0**-j * (4.0 / 3.0 if j == T else 1.0) for j in range(1, T + 1))


def split_bound(weights: Sequence[float], cs: Sequence[float]) -> float:
    """S = sum_j w_j c_j^2: Phased-ERM's bound is 2 lam D^2 + 8 d G^2 S/(lam n^2 m) (phased_erm docstring)."""
    return math.fsum(w * c * c for w, c in zip(weights, cs, strict=True))


def geometric_split(total: float, weights: Sequence[float], a: float) -> tuple[float, ...]:
    """total x w_j^a / sum_k w_k^a (a = 0: the equal split; a = 1/(2p+1): the optimum when c ~ eps^-p).
    The parts sum to ``total`` (the last absorbs the rounding)."""
    raw = [w**a for w in weights]
    s = math.fsum(raw)
    parts = [total * r / s for r in raw]
    parts[-1] = total - math.fsum(parts[:-1])
    return tuple(parts)


def lam_star_erm(c: float, G: float, D: float, d: int, n: int, m: int) -> float:
    """lambda* = (2/sqrt 3) c G sqrt(d) / (D n sqrt m): minimiser of 2 lam D^2 + (8/3) c^2 d G^2/(lam n^2 m)."""
    return (2.0 / math.sqrt(3.0)) * c * G * math.sqrt(d) / (D * n * math.sqrt(m))


def lam_sco(c: float, G: float, D: float, d: int, n: int, m: int, T: int) -> float:
    """lambda_SCO = (G/D) sqrt((8 + 4 (T-1) d c^2 / n)/(n m)): minimiser of
    2 lam D^2 + (G^2/(lam n m)) (16 + 8 (T-1) d c^2 / n) (module docstring)."""
    return (G / D) * math.sqrt((8.0 + 4.0 * max(T - 1, 0) * d * c * c / n) / (n * m))


def rule_delta(
    rule: DeltaRule, *, G_call: float, mu: float, n_call: int, m: int, kappa_: int, beta: float, scale: float = 1.0
) -> float:
    """The public threshold of one call under ``rule`` (module docstring); ``fixed`` is resolved by
    the caller."""
    if callable(rule):
        value = float(rule(G_call, mu, n_call, m, kappa_, beta))
    elif rule == "uc":
        if n_call - 4 * kappa_ - 1 < 1:
            raise ValueError(
                f"the uc threshold (Delta_uc, Cor 3.7) needs at least 4 kappa + 2 = {4 * kappa_ + 2} "
                f"users per call at this per-call budget, the call has {n_call} (kappa = {kappa_}); "
                "use more users, a larger eps, or the heuristic rule p002_delta_rule=scaled"
            )
        value = delta_union_bound(G_call, mu, n_call, m, kappa_, beta)
    elif rule == "scaled":
        value = scale * G_call / (mu * n_call * math.sqrt(m))
    else:
        raise ValueError(f"unknown threshold rule {rule!r}; valid: uc, scaled, fixed (or a function)")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"the threshold rule gave Delta = {value}; it must be finite and > 0")
    return value


def rule_factor(
    rule: DeltaRule, *, G_call: float, n_call: int, m: int, kappa_: int, beta: float, scale: float = 1.0
) -> float:
    """f such that Delta = f G_call / (mu n_call sqrt m) for the rule (evaluated at mu = 1; every rule
    must be proportional to 1/mu)."""
    return (
        rule_delta(rule, G_call=G_call, mu=1.0, n_call=n_call, m=m, kappa_=kappa_, beta=beta, scale=scale)
        * n_call
        * math.sqrt(m)
        / G_call
    )


# --- public constants ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PhasedSetting:
    """Public constants of every user's objective f_u (mean record loss + the problem's regularizer).

    Attributes:
        lipschitz: G, bound on every ||grad f_u|| on K.
        strong_convexity: mu >= 0 of every f_u (the problem's reg).
        radius: K = {||w|| <= radius}; None: K = R^d.
        distance: D >= ||w0 - theta*||; None: radius + ||w0|| at run time.
        dim: d.
        grad_bound: public bound on every user's gradient norm at a centre c (default: G); it sets
            R_i = grad_bound(c) / lam_i.
        domain: how the constants were obtained, in words.
    """

    lipschitz: float
    strong_convexity: float
    radius: float | None
    distance: float | None
    dim: int
    grad_bound: Callable[[torch.Tensor], float] | None = None
    domain: str = ""

    def __post_init__(self) -> None:
        if not self.lipschitz > 0:
            raise ValueError(f"lipschitz must be > 0 (inf: unknown), got {self.lipschitz}")
        if not (self.strong_convexity >= 0 and math.isfinite(self.strong_convexity)):
            raise ValueError(f"strong_convexity must be finite and >= 0, got {self.strong_convexity}")
        for name in ("radius", "distance"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be None or finite and > 0, got {v}")

    def require_lipschitz(self, what: str) -> float:
        if not math.isfinite(self.lipschitz):
            raise ValueError(
                f"{what} needs the Lipschitz constant G of the loss on K, which this problem states only "
                "on a bounded domain: give the domain radius (--radius)"
            )
        return self.lipschitz

    def resolve_distance(self, w0: torch.Tensor) -> float:
        if self.distance is not None:
            return float(self.distance)
        if self.radius is None:
            raise ValueError("lambda* needs a public bound D on ||w0 - w*||: give distance=D (or a domain radius)")
        return float(self.radius) + float(torch.as_tensor(w0).double().norm())

    def gradient_bound(self, center: torch.Tensor) -> float:
        return float(self.grad_bound(center)) if self.grad_bound is not None else self.lipschitz

    def project(self, w: torch.Tensor) -> torch.Tensor:
        return project_ball(w, None, self.radius)


DEFAULT_RADIUS = 10.0  # public default domain of a globally Lipschitz loss without --reg or --radius


def setting_from_run_config(
    problem: Problem, feature_bound: float, radius: float | None, distance: float | None
) -> PhasedSetting:
    """The runner builders' :class:`PhasedSetting` (``--radius``, ``--distance``). Without
    ``radius`` and ``reg``, a loss that is Lipschitz on all of R^d (logistic) gets the public default
    domain ``K = B(0, DEFAULT_RADIUS)`` (it sets D in lambda*; a modelling choice fixed before any
    data, not a property of the data; ``--radius`` overrides it)."""
    if radius is None and not problem.reg > 0:
        try:
            problem.constants(feature_bound, param_bound=None)
            radius = DEFAULT_RADIUS
        except ValueError:  # Lipschitz only on a bounded domain: setting_for_problem explains what to give
            pass
    return setting_for_problem(problem, feature_bound, radius=radius, distance=distance)


def setting_for_problem(
    problem: Problem, feature_bound: float, *, radius: float | None = None, distance: float | None = None
) -> PhasedSetting:
    """The :class:`PhasedSetting` of ``problem`` from public values only.

    Without ``radius`` and with reg > 0, K = B(0, G0/reg) with G0 = the gradient bound at 0: it holds
    every minimizer of F and, when the centre is in it, of every phase objective
    F + (lam/2)||theta - c||^2 (strong monotonicity: ||theta*_i|| <= (G0 + lam ||c||)/(reg + lam))."""
    if not getattr(problem, "convex", False):
        raise ValueError(f"{problem.name}: paper 002's algorithms need a convex loss")
    R = float(feature_bound)
    reg = float(problem.reg)
    implied = ""
    if radius is None and reg > 0:
        g0 = problem.constants(R, param_bound=1e-12).lipschitz
        radius = g0 / reg
        implied = f" (implied domain: G0/reg = {radius:.4g})"
    try:
        c = problem.constants(R, param_bound=radius)
        lipschitz, domain = float(c.lipschitz), c.domain + implied
    except ValueError:  # Lipschitz only on a bounded domain and no radius: G unknown (lambda*, uc refuse)
        c = problem.constants(R, param_bound=1.0)
        lipschitz, domain = math.inf, "K = R^d; G unknown (no radius)"
    if c.strong_convexity is None:
        raise ValueError(f"{problem.name}: the constants do not state convexity")

    def grad_bound(center: torch.Tensor) -> float:
        """Every user's gradient norm at ``center`` (the problem's bound on ||w|| <= ||center||)."""
        b = max(float(torch.as_tensor(center).double().norm()), 1e-12)
        return float(problem.constants(R, param_bound=b).lipschitz)

    return PhasedSetting(lipschitz, float(c.strong_convexity), radius, distance, problem.num_params, grad_bound, domain)


# --- post-processing -----------------------------------------------------------------------------
def project_ball(w: torch.Tensor, center: torch.Tensor | None, radius: float | None) -> torch.Tensor:
    """Euclidean projection onto B(center, radius) (center None: 0; radius None: identity)."""
    if radius is None:
        return w
    c = torch.zeros_like(w) if center is None else center.to(w.dtype)
    diff = w - c
    norm = float(diff.norm())
    return w if norm <= radius else c + diff * (radius / norm)


# --- the phase loop ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseSpec:
    """One phase of a phased algorithm (public): the call's budget, threshold, regularizer and users
    (positions; None: every user)."""

    index: int
    eps: float
    delta: float
    lam: float
    Delta: float
    users: tuple[int, ...] | None = None


@dataclass
class PhasedResult(AlgorithmResult):
    """``w``: the private output (None when the algorithm released "no output");
    ``bottoms``: phases that output ⊥ (the centre was kept); ``history``: per-phase public record
    (lam_i, R_i, Delta_i, sigma_i, users, clipped); ``details``: public parameters and the
    NON-private server diagnostics, labelled as such."""

    w: torch.Tensor | None
    phases: int
    bottoms: int
    sigmas: list[float]
    details: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return self.phases


def run_phases(
    federation: Federation,
    releaser: Releaser,
    specs: Sequence[PhaseSpec],
    center: torch.Tensor,
    *,
    inner: InnerRelease,
    setting: PhasedSetting,
    name: str,
    progress: Callable[[dict], None] | None = None,
    index_offset: int = 0,
    total_rounds: int | None = None,
) -> tuple[torch.Tensor, list[dict], dict]:
    """Run the phases in order (module docstring): inner release on the phase's users with
    (eps_i, delta_i, Delta_i, lam_i) around the current centre; ⊥ keeps the centre; a released value
    is clipped to B(centre, R_i), R_i = grad_bound(centre)/lam_i, then projected onto K.
    Returns (final centre, history, non-private diagnostics)."""
    center = torch.as_tensor(center).to(torch.float64)
    precheck_calls(inner, [(federation.num_users if s.users is None else len(s.users), s.eps, s.delta) for s in specs])
    history: list[dict] = []
    decided: dict[str, int] = {}
    total = total_rounds if total_rounds is not None else len(specs) + index_offset
    for spec in specs:
        view = federation if spec.users is None else CohortFederation(federation, spec.users)
        radius_i = setting.gradient_bound(center) / spec.lam if spec.lam > 0 else math.inf
        call = PhaseCall(f"{name}/phase-{spec.index}", spec.index, spec.eps, spec.delta, spec.Delta, spec.lam, center)
        out = inner(view, releaser, call)
        how = str(out.diagnostics.get("decided_by", "unknown"))
        decided[how] = decided.get(how, 0) + 1
        rec = {
            "phase": spec.index,
            "users": view.num_users,
            "eps": spec.eps,
            "delta": spec.delta,
            "lam": spec.lam,
            "R": radius_i,
            "Delta": spec.Delta,
            "sigma": out.sigma,
            "bottom": out.theta is None,
            "clipped": False,
            "projected": False,
        }
        if "Delta_selected" in out.diagnostics:  # a privately chosen Delta (released, charged: public)
            rec["Delta_selected"] = out.diagnostics["Delta_selected"]
        if out.theta is not None:
            theta = out.theta.to(torch.float64)
            clipped = project_ball(theta, center, radius_i if math.isfinite(radius_i) else None)
            projected = setting.project(clipped)
            rec["clipped"] = not torch.equal(clipped, theta)
            rec["projected"] = not torch.equal(projected, clipped)
            center = projected
        history.append(rec)
        if progress is not None:
            progress(
                {
                    "round": index_offset + len(history),
                    "rounds": total,
                    "released": out.theta is not None,
                    "sigma": out.sigma,
                    "phase": spec.index,
                }
            )
    return center, history, decided


def check_approx_releaser(releaser: Releaser, name: str) -> None:
    """(eps, delta) releases cannot be accounted by a zCDP filter (refused before reading data)."""
    releaser.require("approx-dp", name)


__all__ = [
    "CohortFederation",
    "DEFAULT_RADIUS",
    "DELTA_RULES",
    "INNER_TESTS",
    "InnerOutcome",
    "InnerRelease",
    "SCInnerRelease",
    "inner_noise_ratio",
    "precheck_calls",
    "setting_from_run_config",
    "PHASE_SPLITS",
    "PhaseCall",
    "PhaseSpec",
    "PhasedResult",
    "PhasedSetting",
    "check_approx_releaser",
    "erm_phases",
    "geometric_split",
    "hash_order",
    "kappa",
    "lam_sco",
    "lam_star_erm",
    "noise_ratio",
    "phase_weights",
    "project_ball",
    "rule_delta",
    "rule_factor",
    "run_phases",
    "sc_output_pert_inner",
    "sco_cohort_bounds",
    "sco_cohorts",
    "sco_min_cohort",
    "sco_phases",
    "setting_for_problem",
    "split_bound",
]
