"""DelOutputPert: user-level output perturbation for functions of low LOCAL DELETION sensitivity.

Paper 002 (Ghazi, Kamath, Kumar, Meka, Manurangsi, Zhang, "On User-Level Private Convex
Optimization"), Algorithm 1 and Theorem 3.3; constants re-derived in docs/derivations/paper-002.md.

Guarantee
---------
**(eps, delta)-DP (approximate DP, not zCDP), user level, relation replace-one**: two datasets are
neighbours if they differ in ALL records of ONE user; the number of users n is public (a constant
fixed before the run), as are eps, delta and the target deletion sensitivity ``Delta``. It holds for
EVERY deterministic function ``f`` of the SET of remaining users (convexity, Lipschitzness or the
accuracy of a solver are never used by the privacy proof; they only make the test pass). The
relation add-remove is NOT covered (the test budget would have to be defined by size, docs/derivations/paper-002.md §1).

Mechanism (natural log throughout; the paper's constants are the default)::

    eps_bar = eps/2;  delta_bar = delta/(e^eps_bar + 2);  kappa = 1 + ceil(ln(1/delta_bar)/eps_bar)
    R1 ~ TDLap(eps_bar, delta_bar)                               # support {0..2 kappa}
    dist(x) = min{|S| : Dbar_{4 kappa - |S|} f(x_{-S}) <= Delta}  # "how many users to delete"
    if dist(x) > R1: output ⊥ (None)
    else: S = the deletion set of size dist(x) with the lexicographically smallest sorted list of
          user positions;  output f(x_{-S}) + N(0, sigma^2 I)

with ``Dbar f(y) = max_{i in y} ||f(y) - f(y - i)||`` (local deletion sensitivity, Def 3.2) and
``Dbar_r f(y) = max_{|T| <= r} Dbar f(y_{-T})``. "Choose the smallest |S|" of Algorithm 1 is exactly
``dist``: ``X_stable^{R1}`` is non-empty iff ``dist <= R1``, and the chosen set does not depend on R1.

Sensitivity of the output step and the noise (proof of Thm 3.3): for neighbours x, x' (user i
replaced) and R1 = r1 on x, r1 + 1 on x' (r1 <= 2 kappa - 1), the chosen sets x_{-S}, x'_{-S'} both
reach x* = x_{-U} = x'_{-U}, U = S ∪ S' ∪ {i}, by single deletions each of which the test bounds by
Delta. The paper counts <= 4 kappa steps per chain: ``sensitivity = 8 kappa Delta`` ("paper"). A
recount gives |U\\S| + |U\\S'| <= (r1 + 2) + (r1 + 1) <= 4 kappa + 1 steps, every one inside the
depth the test covers (|S| + r1 + 1 <= 4 kappa): ``sensitivity = (4 kappa + 1) Delta`` ("tight").

* ``calibration="paper"`` (default): sensitivity 8 kappa Delta, ``sigma = 2 sqrt(ln(2/delta_bar))
  sensitivity / eps_bar`` as printed. The classic formula is stated for eps < 1; we do not rely on
  it: the constructor checks with the exact analytic Gaussian characterisation (Balle & Wang 2018)
  that this sigma gives (eps_bar, delta_bar) and refuses otherwise.
* ``calibration="tight"``: sensitivity (4 kappa + 1) Delta, sigma the analytic Gaussian at
  (eps_bar, delta_bar).
* ``calibration="profile"``: no split of (eps, delta) between the steps: R1's law and sigma come from
  the exact privacy profile of the whole release (:mod:`fedkl.algorithms.output_perturbation.stability_profile`, with its
  theorem and proof); ``eps_bar``/``delta_bar`` are then TDLap's parameters, and sigma/Delta is
  about half the tight calibration's (e.g. 482 against 1109 at eps = 1, delta = 1e-6).

Composition (paper eq. 2-4): Pr[⊥ | x] <= e^eps_bar Pr[⊥ | x'] + delta_bar (TDLap ratio, Obs 3.5:
dist(x) <= dist(x') + 1); the value part gives (e^eps_bar + 1) delta_bar + e^{2 eps_bar}; together
(e^eps_bar + 2) delta_bar + e^{eps} = delta + e^eps. ⊥ is an output: it is charged like a value.

The existence decision (dist <= R1) must be EXACT: any cheaper test that is not of this form
(certificate-or-⊥, greedy deletion, a timeout) is not the analysed mechanism (docs/derivations/paper-002.md §6.2). The exact
reference here enumerates every set within 4 kappa + 1 deletions of x with a bitmask dynamic
programme: time and memory ~2^n, so it refuses n > ``max_exact_users`` (default 20, at most 24)
before touching any data.

``f`` is given as a batched function of user sets: ``f(masks)`` with ``masks`` a ``(k, n)`` bool
tensor (row = which users remain, users in the federation's order) returning ``(k, d)`` float64. It
must be deterministic and defined on every set the test reaches (the empty set too when
n <= 4 kappa + 1), and finite (a non-finite value is refused before anything is charged, like
:meth:`Releaser.gaussian`).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from fedkl.algorithms.output_perturbation.stability_profile import (
    ProfileCalibration,
    calibrate,
    chain_factor,
    worst_case_divergence,
)
from fedkl.algorithms.registry import AlgorithmResult
from fedkl.privacy.mechanisms import GaussianMechanism, TruncatedDiscreteLaplace
from fedkl.privacy.release import Releaser

SubsetFunction = Callable[[torch.Tensor], torch.Tensor]
CALIBRATIONS = ("paper", "tight", "profile")
SCORES = ("exact", "matching")
HARD_MAX_EXACT_USERS = 24
_CHUNK = 4096


def deletion_depth(score: str, kappa: int) -> int:
    """How deep the proof's deletion chains go: 4 kappa for the exact score (paper's Algorithm 1),
    8 kappa for the matching score (see :class:`DeletionRelease`); ``score`` may also be a pairwise
    test's name ("vertex-cover" is exact)."""
    return (8 if score == "matching" else 4) * kappa


class DeletionBudget:
    """The budget split of Algorithm 1 shared by every DelOutputPert-style config (fields ``eps``,
    ``delta``): eps_bar = eps/2 and delta_bar = delta/(e^{eps_bar} + 2) for each of its two steps, and
    the deletion budget R1 ~ TDLap(eps_bar, delta_bar) with its kappa."""

    @property
    def eps_bar(self) -> float:
        return self.eps / 2.0

    @property
    def delta_bar(self) -> float:
        return self.delta / (math.exp(self.eps_bar) + 2.0)

    @property
    def deletion_budget(self) -> TruncatedDiscreteLaplace:
        """The law of R1: TDLap(eps_bar, delta_bar), support {0, ..., 2 kappa}."""
        return TruncatedDiscreteLaplace(self.eps_bar, self.delta_bar)

    @property
    def kappa(self) -> int:
        return self.deletion_budget.kappa


@dataclass(frozen=True)
class DeletionRelease(DeletionBudget):
    """Public parameters of one DelOutputPert release (none may depend on the data).

    Args:
        eps, delta: the (eps, delta)-DP guarantee of the release; the paper assumes eps <= 1 and
            delta <= 1/2, the proof (and this code) works for any eps > 0, 0 < delta < 1.
        Delta: the target local deletion sensitivity (the test threshold).
        calibration: "paper" (8 kappa Delta, classic sigma), "tight" or "profile" (see the module docstring).
        max_exact_users: the largest n the exact enumeration accepts (<= 24).
        score: "exact" (dist = the fewest deletions, Algorithm 1) or "matching" (the polynomial-time
            variant for a pairwise test: score = maximum matching of the conflict graph, deletion set
            = a cover of at most twice that size; see "The matching score" below).

    The matching score (derived here; not in the paper). For a test of the form "no two kept users
    conflict" (a graph G(x) on the users, an edge depending only on its two users' data), let
    nu(x) = the maximum matching of G(x) and S(x) a vertex cover with |S(x)| <= 2 nu(x)
    (:mod:`fedkl.algorithms.output_perturbation.matching`). The mechanism: R1 ~ TDLap as above; ⊥ if nu(x) > R1, else
    f(x_{-S(x)}) + N(0, sigma^2 I). Proof of (eps, delta)-DP for replace-one neighbours x, x'
    (user i replaced): (a) G(x) - i = G(x') - i, so |nu(x) - nu(x')| <= 1 and the ⊥ step is the
    TDLap ratio argument of Obs 3.5 verbatim: Pr[⊥|x] <= e^eps_bar Pr[⊥|x'] + delta_bar. (b) The
    kept set does not depend on R1; a value is output on both sides only if nu(x), nu(x') <= 2 kappa,
    so |S|, |S'| <= 4 kappa; with U = S ∪ S' ∪ {i}, x_{-U} = x'_{-U} is reached from x_{-S} and from
    x'_{-S'} by |U \\ S| + |U \\ S'| <= |S| + |S'| + 2 <= 8 kappa + 2 single deletions, each from a
    set of >= n - 8 kappa users that is a subset of a kept (conflict-free) set. The caller's test
    must guarantee that every such step moves f by <= Delta (``depth`` = 8 kappa: steps from sets
    of >= n - depth users), so ``sensitivity = (8 kappa + 2) Delta`` for both calibrations (paper:
    the classic sigma formula, checked by the analytic Gaussian; tight: the analytic Gaussian).
    (c) Pr[value in E | x] = Pr[R1 >= nu(x)] Pr[f(x_{-S}) + N in E]
    <= (e^eps_bar Pr[R1 >= nu(x')] + delta_bar)(e^eps_bar Pr[f(x'_{-S'}) + N in E] + delta_bar)
    <= e^eps Pr[value in E | x'] + (e^eps_bar + 1) delta_bar (and <= delta_bar when nu(x') > 2 kappa,
    since then nu(x) = 2 kappa and Pr[R1 = 2 kappa] <= delta_bar); with (a): delta in total.
    """

    eps: float
    delta: float
    Delta: float
    calibration: str = "paper"
    max_exact_users: int = 20
    score: str = "exact"

    def __post_init__(self) -> None:
        for name in ("eps", "Delta"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        if not 1 <= self.max_exact_users <= HARD_MAX_EXACT_USERS:
            raise ValueError(f"max_exact_users must be in [1, {HARD_MAX_EXACT_USERS}]")
        if self.calibration == "profile":  # the theorem's condition, re-checked on the chosen noise
            if worst_case_divergence(
                self.eps, self.sigma / self.Delta, self.deletion_budget, self.score
            ) > self.delta * (1 + 1e-9):
                raise ValueError("the profile calibration does not meet (eps, delta)")  # unreachable
            return
        # the noise must give (eps_bar, delta_bar) by the exact analytic Gaussian characterisation
        if self.gaussian.epsilon(self.delta_bar) > self.eps_bar * (1 + 1e-9):
            raise ValueError(
                f"sigma={self.sigma:g} does not give ({self.eps_bar:g}, {self.delta_bar:g})-DP "
                "for the output step; use calibration='tight'"
            )

    @property
    def profile(self) -> ProfileCalibration | None:
        """The whole-release calibration (``calibration="profile"``), else None."""
        return calibrate(self.eps, self.delta, self.score) if self.calibration == "profile" else None

    @property
    def eps_bar(self) -> float:
        p = self.profile
        return self.eps / 2.0 if p is None else p.eps_r

    @property
    def delta_bar(self) -> float:
        p = self.profile
        return self.delta / (math.exp(self.eps / 2.0) + 2.0) if p is None else p.delta_r

    @property
    def depth(self) -> int:
        """Exact score: 4 kappa (the test at x bounds Dbar_{4 kappa} f(x), i.e. chains of 4 kappa + 1
        deletions). Matching score: 8 kappa (every step of the proof's chains starts from a set of
        >= n - 8 kappa users)."""
        return deletion_depth(self.score, self.kappa)

    @property
    def sensitivity(self) -> float:
        """L2 distance bound between the two chosen values in the proof (module docstring)."""
        k = self.kappa
        if self.calibration == "profile":  # the largest finite chain gap of the profile's theorem
            return (4 * chain_factor(self.score) * k + 2) * self.Delta
        if self.score == "matching":
            return (8 * k + 2) * self.Delta
        return (8 * k if self.calibration == "paper" else 4 * k + 1) * self.Delta

    @functools.cached_property
    def gaussian(self) -> GaussianMechanism:
        sens = self.sensitivity
        if self.calibration == "profile":
            return GaussianMechanism(sens, self.profile.sigma_over_Delta * self.Delta)
        if self.calibration == "paper":
            return GaussianMechanism(sens, 2.0 * math.sqrt(math.log(2.0 / self.delta_bar)) * sens / self.eps_bar)
        return GaussianMechanism.analytic(sens, self.eps_bar, self.delta_bar)

    @property
    def sigma(self) -> float:
        return self.gaussian.sigma


@dataclass
class StabilityPlan:
    """The data-dependent, NON-private outcome of the stability test, computed before the release.

    ``dist`` is min |S| over stable deletion sets (None if it exceeds 2 kappa, i.e. always ⊥);
    ``deleted`` the chosen set (positions); ``value = f(x_{-deleted})``. Never release these: only
    :meth:`choose` through :meth:`Releaser.stability_gaussian` turns them into a private output.
    """

    n: int
    dist: int | None
    deleted: tuple[int, ...] | None
    value: torch.Tensor | None
    decided_by: str
    dbar_full: float | None = None  # Dbar_{4 kappa} f(x) when the enumeration computed it

    def choose(self, r1: int) -> torch.Tensor | None:
        if self.dist is None or self.dist > r1:
            return None
        return self.value


@dataclass
class DelOutputPertResult(AlgorithmResult):
    """``theta`` is the private output (None for ⊥). ``diagnostics`` are NOT private (server-side
    bookkeeping: how the test was decided, dist, time); never release them."""

    theta: torch.Tensor | None
    eps: float
    delta: float
    Delta: float
    kappa: int
    sensitivity: float
    sigma: float
    diagnostics: dict = field(default_factory=dict)

    @property
    def bottom(self) -> bool:
        return self.theta is None

    # --- what `fedkl run` reads (same names as the other algorithms' results) ---------------------
    @property
    def w(self) -> torch.Tensor | None:
        return self.theta

    @property
    def rounds(self) -> int:
        return 1

    @property
    def details(self) -> dict:
        """Public parameters and the (private) ⊥ flag; the non-private diagnostics labelled as such."""
        return {
            "dp": "approximate (eps, delta)-DP, user level, replace-one, n public",
            "eps": self.eps,
            "delta": self.delta,
            "Delta": self.Delta,
            "kappa": self.kappa,
            "sensitivity": self.sensitivity,
            "sigma": self.sigma,
            "bottom": self.bottom,
            "nonprivate_diagnostics": dict(self.diagnostics),
        }


def masks_tensor(codes: np.ndarray, n: int) -> torch.Tensor:
    """Integer bitmasks (bit u = user u remains) -> ``(k, n)`` bool rows."""
    codes = np.asarray(codes, dtype=np.int64)
    return torch.from_numpy(((codes[:, None] >> np.arange(n, dtype=np.int64)) & 1).astype(bool))


def mean_of_user_vectors(vectors: torch.Tensor, empty: torch.Tensor | None = None) -> SubsetFunction:
    """``f(y) = mean_{u in y} v_u`` (``f(∅) = empty``, default 0): a simple f for tests and audits."""
    v = vectors.to(torch.float64)
    e = torch.zeros(v.shape[1], dtype=torch.float64) if empty is None else empty.to(torch.float64)

    def f(masks: torch.Tensor) -> torch.Tensor:
        w = masks.to(torch.float64)
        cnt = w.sum(1, keepdim=True)
        out = (w @ v) / cnt.clamp_min(1.0)
        return torch.where(cnt > 0, out, e.expand_as(out))

    return f


def exact_stability(f: SubsetFunction, n: int, config: DeletionRelease) -> StabilityPlan:
    """The exact test of Algorithm 1 by enumeration (reference implementation; n <= max_exact_users).

    Computes ``A(y) = Dbar_{4 kappa - k(y)} f(y)`` for every y = x_{-S} with k(y) = |S| deletions by
    ``A(y) = c(y)`` at k = 4 kappa and ``A(y) = max(c(y), max_{i in y} A(y - i))`` above, where
    ``c(y) = Dbar f(y)``; then ``dist = min{k <= 2 kappa : some y at level k has A(y) <= Delta}``.
    """
    if not 1 <= n <= config.max_exact_users:
        raise ValueError(
            f"the exact stability test enumerates ~2^n user sets: n={n} is above the documented "
            f"limit max_exact_users={config.max_exact_users} (public n; no data was read)"
        )
    depth = min(config.depth, n)  # levels at which A is needed
    reach = min(config.depth + 1, n)  # levels at which f is needed
    codes = np.arange(1 << n, dtype=np.int64)
    pop = np.zeros(1 << n, dtype=np.int64)
    for i in range(n):
        pop += (codes >> i) & 1
    level = n - pop
    valid = np.nonzero(level <= reach)[0]
    F = None
    for start in range(0, len(valid), _CHUNK):
        idx = valid[start : start + _CHUNK]
        vals = f(masks_tensor(idx, n)).to(torch.float64)
        if vals.dim() != 2 or vals.shape[0] != len(idx):
            raise ValueError(f"f must return (k, d) values, got shape {tuple(vals.shape)}")
        if not torch.isfinite(vals).all():
            raise ValueError("f returned NaN or inf: refusing (nothing was charged)")
        if F is None:
            if (1 << n) * vals.shape[1] > (1 << 26):
                raise ValueError(f"exact test: 2^{n} sets x d={vals.shape[1]} values exceed the memory limit")
            F = np.full((1 << n, vals.shape[1]), np.nan)
        F[idx] = vals.numpy()
    c = np.full(1 << n, np.nan)
    inner = level <= depth
    c[inner] = 0.0
    for i in range(n):
        sel = np.nonzero(inner & (((codes >> i) & 1) == 1))[0]
        if sel.size:
            c[sel] = np.maximum(c[sel], np.linalg.norm(F[sel] - F[sel ^ (1 << i)], axis=1))
    A = c.copy()
    by_level = [np.nonzero(level == k)[0] for k in range(n + 1)]
    for k in range(depth - 1, -1, -1):
        ys = by_level[k]
        for i in range(n):
            sel = ys[((ys >> i) & 1) == 1]
            if sel.size:
                A[sel] = np.maximum(A[sel], A[sel ^ (1 << i)])
    full = (1 << n) - 1
    dbar_full = float(A[full])
    for s in range(0, min(2 * config.kappa, n) + 1):
        ys = by_level[s]
        cand = ys[A[ys] <= config.Delta]
        if cand.size:
            deleted = min(tuple(u for u in range(n) if not (int(y) >> u) & 1) for y in cand)
            mask = full
            for u in deleted:
                mask ^= 1 << u
            value = f(masks_tensor(np.array([mask]), n))[0].to(torch.float64)
            return StabilityPlan(n, s, deleted, value, "exact", dbar_full)
    return StabilityPlan(n, None, None, None, "exact", dbar_full)


StablePredicate = Callable[[torch.Tensor], torch.Tensor]


def exact_stability_predicate(
    f: SubsetFunction, stable: StablePredicate, n: int, config: DeletionRelease
) -> StabilityPlan:
    """Algorithm 1 with a user-supplied stability predicate, by enumeration (reference; n <= max_exact_users).

    The proof of Thm 3.3 uses the test ``Dbar_{4 kappa - |S|} f(x_{-S}) <= Delta`` only through two
    properties of a predicate ``P(y, b)`` (docs/derivations/paper-002.md §2A, "what the proof uses"):

    * (H) heredity: ``P(y, b) => P(y - i, b - 1)`` for every user i of y (gives Obs 3.5,
      ``dist(x) <= dist(x') + 1``: delete the replaced user too);
    * (S) soundness: ``P(y, b) => Dbar_b f(y) <= Delta`` (gives the chain bound of the output step,
      hence the same sensitivity and sigma as :class:`DeletionRelease`).

    Here ``stable(masks)`` must return, for every row y = x_{-S} of the ``(k, n)`` bool ``masks``,
    ``P(y, 4 kappa - |S|)`` (a ``(k,)`` bool tensor); it is the CALLER's job that this P has (H)
    and (S) (e.g. :mod:`fedkl.algorithms.output_perturbation.mean_output_pert`). The choice rule is the one of
    :func:`exact_stability`: the smallest |S| <= 2 kappa with P, lexicographically smallest sorted
    list of positions among those. Time ~ sum_{s <= 2 kappa} C(n, s) predicate evaluations.
    """
    if not 1 <= n <= config.max_exact_users:
        raise ValueError(
            f"the exact stability test enumerates user sets: n={n} is above the documented "
            f"limit max_exact_users={config.max_exact_users} (public n; no data was read)"
        )
    full = (1 << n) - 1
    for s in range(0, min(2 * config.kappa, n) + 1):
        sets = list(itertools.combinations(range(n), s))  # lexicographic order
        for start in range(0, len(sets), _CHUNK):
            chunk = sets[start : start + _CHUNK]
            codes = np.array([full ^ sum(1 << u for u in S) for S in chunk], dtype=np.int64)
            ok = torch.as_tensor(stable(masks_tensor(codes, n))).to(torch.bool)
            if ok.shape != (len(chunk),):
                raise ValueError(f"stable must return one bool per row, got shape {tuple(ok.shape)}")
            hits = torch.nonzero(ok).flatten()
            if hits.numel():
                j = int(hits[0])
                value = f(masks_tensor(codes[j : j + 1], n))[0].to(torch.float64)
                if not torch.isfinite(value).all():
                    raise ValueError("f returned NaN or inf: refusing (nothing was charged)")
                return StabilityPlan(n, s, tuple(chunk[j]), value, "exact-predicate")
    return StabilityPlan(n, None, None, None, "exact-predicate")


def noise_forecast(sigma: float, Delta: float, signal_radius: float, dim: int) -> dict:
    """A release's public forecast: its noise of norm about ``sigma sqrt(d)`` against
    ``signal_radius``, the farthest the data could move its value from the public centre;
    ``noise_over_signal > 1``: the output is expected farther from the optimum than any data could
    move it (the runner refuses unless forced)."""
    noise = sigma * math.sqrt(dim)
    return {
        "sigma_over_Delta": sigma / Delta,
        "sigma": sigma,
        "noise_norm": noise,
        "signal_radius": signal_radius,
        "noise_over_signal": noise / signal_radius,
    }


def check_release_start(name: str, releaser: Releaser, federation, w0: torch.Tensor) -> torch.Tensor:
    """Refuse, before anything is read or charged, a Releaser with a zCDP filter (an (eps, delta)
    release cannot be accounted by it) and a centre that is not a finite parameter vector; returns the
    centre in float64."""
    releaser.require("approx-dp", name)
    center = torch.as_tensor(w0).to(torch.float64)
    if center.shape != (federation.num_params,) or not torch.isfinite(center).all():
        raise ValueError(f"w0 must be a finite vector of {federation.num_params} parameters")
    return center


class DelOutputPert:
    """Algorithm 1 of paper 002 for a generic batched ``f`` (see the module docstring)."""

    name = "del-output-pert"

    def __init__(self, config: DeletionRelease) -> None:
        self.config = config

    def release(
        self, plan: StabilityPlan, releaser: Releaser, user_ids: Sequence[str], label: str, details: dict | None = None
    ) -> torch.Tensor | None:
        """Charge (eps, delta) to every user, draw R1, output ⊥ or the noisy value (Releaser order)."""
        cfg = self.config
        if len(user_ids) != plan.n:
            raise ValueError(f"{len(user_ids)} user ids for a plan over {plan.n} users")
        info = {
            "kappa": cfg.kappa,
            "Delta": cfg.Delta,
            "calibration": cfg.calibration,
            "neighbouring": "replace-one",
            **(details or {}),
        }
        return releaser.stability_gaussian(
            plan.choose,
            eps=cfg.eps,
            delta=cfg.delta,
            deletion_budget=cfg.deletion_budget,
            sensitivity=cfg.sensitivity,
            sigma=cfg.sigma,
            user_ids=list(user_ids),
            label=label,
            details=info,
        )

    def result(self, theta: torch.Tensor | None, plan: StabilityPlan, seconds: float) -> DelOutputPertResult:
        cfg = self.config
        return DelOutputPertResult(
            theta,
            cfg.eps,
            cfg.delta,
            cfg.Delta,
            cfg.kappa,
            cfg.sensitivity,
            cfg.sigma,
            {
                "decided_by": plan.decided_by,
                "dist": plan.dist,
                "deleted_users": None if plan.deleted is None else len(plan.deleted),
                "seconds": seconds,
                "private": False,
            },
        )

    def run(
        self,
        f: SubsetFunction,
        releaser: Releaser,
        user_ids: Sequence[str],
        progress: Callable[[dict], None] | None = None,
        label: str | None = None,
    ) -> DelOutputPertResult:
        """Exact test over the ``len(user_ids)`` users (public n), then one charged release."""
        releaser.require("approx-dp", self.name)
        start = time.perf_counter()
        plan = exact_stability(f, len(user_ids), self.config)
        theta = self.release(plan, releaser, user_ids, label or self.name)
        res = self.result(theta, plan, time.perf_counter() - start)
        if progress is not None:
            progress({"round": 1, "rounds": 1, "released": theta is not None, **res.diagnostics})
        return res
