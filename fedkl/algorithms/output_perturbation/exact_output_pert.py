"""SCOutputPert: user-level output perturbation of a strongly convex minimizer (paper 002, Alg 2, Thm 3.1)
with the paper's exact deletion test: an internal engine (not registered) of ``sc-output-pert``
(:mod:`fedkl.algorithms.output_perturbation.sc_output_pert`) and of the phased algorithms' inner releases.

Releases ``DelOutputPert(f)`` (:mod:`fedkl.algorithms.output_perturbation.del_output_pert`) with ``f(y) = f~(y)``, a
deterministic solver for the minimizer of

    L(theta; y) = (1/|y|) sum_{u in y} l_u(theta),   l_u(theta) = f_u(theta) + (lam/2)||theta - c||^2

over R^d (f_u: user u's mean record loss + the problem's regularizer; lam = ``extra_reg``; the
center c is the public ``w0`` given to :meth:`SCOutputPert.run`; ``f~(∅) = c``).

Guarantee: **(eps, delta)-DP, user level, replace-one, n public** — exactly that of DelOutputPert,
for ANY deterministic f (so for f~ whatever its accuracy). Users' answers come unclipped from the
federation (:class:`GradientsAtPoints`); privacy does not need a norm bound on them.

The solver (docs/derivations/paper-002.md §2H). Gradient descent with step 1/beta from c for a FIXED number of iterations
T = ceil(ln(R0/tau) / -ln(1 - mu/beta)), R0 = G0/mu, computed from public constants only:

* mu = strong convexity of every l_u (problem regularizer + lam), beta = smoothness of every l_u,
  G0 >= max_u ||grad f_u(c)|| (see :meth:`SCOutputPert.for_problem`);
* ||c - theta*(y)|| <= ||grad L(c; y)||/mu <= G0/mu = R0 for EVERY user set y (strong monotonicity),
  and the GD map contracts distances by (1 - mu/beta), so ``sup_y ||f~(y) - theta*(y)|| <= tau``.

The certified fast path (Appendix C, Lemma C.1, constants re-derived). With gamma >= max_u
||grad l_u(theta*(x))|| and r = 4 kappa <= n - 2:

* ||theta*(x) - theta*(x_{-S})|| <= s gamma / ((n - s) mu)   (sum_u grad l_u(theta*) = 0 and
  strong monotonicity; the paper's function-value argument loses a factor 2);
* hence Dbar_r theta*(x) <= (2r + 1) gamma / ((n - r - 1) mu)   (triangle inequality through theta*);
* smooth version: ||theta*_S - theta*_{S+i}|| <= ||grad l_i(theta*_S)|| / ((n - s - 1) mu) and
  ||grad l_i(theta*_S)|| <= gamma + beta s gamma/((n - s) mu), so
  Dbar_r theta*(x) <= gamma (1 + (beta/mu) r/(n - r)) / ((n - r - 1) mu).

U = the minimum of the two. From theta~ = f~(x) the server asks every user for
its gradient at theta~ (:class:`GradientsAtPoints`, the solver's own oracle), computes
||grad l_u(theta~)|| itself and uses gamma^ = max_u + beta tau (each l_u is beta-smooth,
||theta~ - theta*|| <= tau). Since Dbar_{4kappa} f~(x) <= Dbar_{4kappa} theta*(x) + 2 tau,
``U(gamma^) + 2 tau <= Delta`` PROVES that the exact test finds dist(x) = 0, so for every R1 the
exact mechanism outputs f~(x) + N(0, sigma^2 I): the fast path returns that, i.e. it is the SAME
mechanism, not an approximation of it. When the certificate does not settle the test, the exact
enumeration decides (its privacy needs nothing). "Certificate or ⊥" would NOT be private (one
outlier user flips it; docs/derivations/paper-002.md §6.2) and is not offered.

Assumptions the fast path's soundness rests on (privacy of the exact path needs none of them): mu,
beta, G0 are true for every l_u (they follow from the feature bound the loaders enforce, the
problem's regularizer and lam), and no answer of the full-set solve failed (else the exact enumeration
decides).

Failures (issue 28 §2: whether a run completes must never depend on the data). The solver asks every
user at iterates that depend on the other users' data, so a client may fail (drop out, answer NaN or a
value no in-class loss has) at some iterates and not at others. Aborting would then release, with
certainty, one bit about an honest user's data. Instead :meth:`SCOutputPert.solve` counts such an answer
as the zero gradient at that point (and projects every iterate onto the ball ``||theta - c|| <= 2 G0/mu``,
where in-class iterates always lie, so f~ stays finite whatever the answers). Proof that the exact path
stays (eps, delta)-DP: DelOutputPert is private for EVERY deterministic f of the set of remaining users;
if each client's answer is a fixed function of the point it is asked (a "failure" included, as a
NaN-in-one-world client is), the substituted answer is a fixed function of that client and the point too,
so f~ is a deterministic function of the set. A client whose answers depend on more than the point (its
history, the iterates it saw before) is not a fixed function of its data: that is the adaptive client the
in-class assumption excludes (:mod:`fedkl.privacy.clients`). The certificate is only tried when no answer
of the full-set solve or of the certificate's own query failed. On in-class answers none of this applies
(no answer is ever above the bound, no iterate outside the ball): f~ is bit for bit the plain solver.

Clients (:data:`~fedkl.privacy.clients.IN_CLASS_CLIENTS`): the exact path is private for any
deterministic f~, i.e. whatever fixed functions the other clients' gradient answers are; the
certificate needs every other client's gradients to be those of a loss in the class (mu, beta).
No client reports a norm: the server computes every ||grad l_u(theta~)|| itself from the gradient
answers the solver uses, so a client cannot make the certificate pass by under-reporting. The certificate
is believed only when the full solve's and the certificate's answers are, user by user, the gradients of
one in-class function (:mod:`fedkl.algorithms.output_perturbation.interpolation`, which proves what that buys); else the exact
enumeration decides. Floating point: the certificate is
compared with ``Delta (1 - 1e-9)``; f~ is always evaluated on the released set alone (batch of one),
the enumeration evaluates it in batches (values may differ in the last bits; not modelled).

Limits: the fallback enumerates ~2^n user sets, so the run refuses n > ``max_exact_users`` (public n,
before reading any data). The fast path applies only for n >= 4 kappa + 2. Diagnostics (which path
decided, ``fast_path_rate``) are server-side and NOT private: the path taken (and its timing) depends
on the data. The guarantee covers the released output, not the wall-clock time of the run: a
deployment that lets the adversary time the server must pad the fast path (docs/derivations/paper-002.md §2D).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from fedkl.algorithms.output_perturbation.del_output_pert import (
    CALIBRATIONS,
    DeletionRelease,
    DelOutputPert,
    DelOutputPertResult,
    StabilityPlan,
    exact_stability,
    noise_forecast,
)
from fedkl.algorithms.output_perturbation.interpolation import in_class
from fedkl.federation.base import Federation, GradientsAtPoints
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, PAPER_002_RELATIONS, Guarantee
from fedkl.privacy.release import Releaser
from fedkl.problems.base import Problem

_SOLVE_CHUNK = 4096
_FP_PAD = 1e-9
_ANSWER_PAD = 1e-9  # relative (and absolute) slack on the in-class answer bound, for float64 rounding
_REACH_PAD = 1e-6  # relative slack on the ball the in-class iterates stay in


def lemma_c1_bound(n: int, r: int, gamma: float, mu: float, beta: float | None = None) -> float:
    """Upper bound on Dbar_r theta*(x) when every user's gradient at theta*(x) has norm <= gamma, the
    objective is mu-strongly convex and (optionally) each user's objective beta-smooth (module
    docstring); inf when n < r + 2."""
    if n - r - 1 < 1:
        return math.inf
    plain = (2 * r + 1) * gamma / ((n - r - 1) * mu)
    if beta is None:
        return plain
    return min(plain, gamma * (1 + (beta / mu) * r / (n - r)) / ((n - r - 1) * mu))


def release_forecast(sigma: float, Delta: float, release: SCOutputPert, dim: int) -> dict:
    """:func:`~fedkl.algorithms.output_perturbation.del_output_pert.noise_forecast` with ``signal_radius = G0/mu``: the
    minimizer of the (mu-strongly convex) objective lies that close to the centre for every user set
    (strong monotonicity; see PhasedERM.forecast)."""
    signal = release.start_grad_bound / release.mu if release.start_grad_bound > 0 else math.inf
    return noise_forecast(sigma, Delta, signal, dim)


@functools.lru_cache(maxsize=4096)
def _log_subset_count(n: int, r: int) -> float:
    """ln(n sum_{s<=r} C(n, s)), exact big-integer sum (cached: Phased-ERM's split evaluates many phases).
    Each term from the last, C(n, s + 1) = C(n, s) (n - s) / (s + 1) (an exact integer division), the same
    integers as ``math.comb`` (issue 34: a ``math.comb`` per term was 10% of a 100,000-user phased-erm run)."""
    if r < 0:
        raise ValueError(f"r must be >= 0, got {r}")
    term = total = 1
    for s in range(min(r, n)):
        term = term * (n - s) // (s + 1)
        total += term
    return math.log(n) + math.log(total)


def delta_union_bound(G: float, mu: float, n: int, m: int, kappa: int, beta: float) -> float:
    """Delta_uc (docs/derivations/paper-002.md §2B, explicit Cor 3.7): w.p. >= 1 - beta over a random allocation of items to
    users, Dbar_{4 kappa} theta* <= 5 G sqrt(ln(n sum_{s<=r} C(n,s)) + ln(1/beta)) / (mu (n-r-1) sqrt(m)),
    r = 4 kappa. A UTILITY choice only: any public Delta is private."""
    r = 4 * kappa
    if n - r - 1 < 1:
        raise ValueError(f"Delta_uc needs n >= 4 kappa + 2 = {r + 2}")
    log_count = _log_subset_count(n, r)
    return 5 * G * math.sqrt(log_count + math.log(1 / beta)) / (mu * (n - r - 1) * math.sqrt(m))


@dataclass(frozen=True, eq=False)
class SCOutputPert:
    """Algorithm 2 of paper 002 with the Appendix C fast path (see the module docstring): the exact-test
    engine of ``sc-output-pert`` (:mod:`fedkl.algorithms.output_perturbation.sc_output_pert` picks it) and
    of the phased algorithms' inner releases; the diameter-test engines
    (:mod:`fedkl.algorithms.output_perturbation.diameter_output_pert`) reuse its solver f~ and constants.

    Its fields are the release's public parameters (none may depend on the data); ``dataclasses.replace``
    gives the same release at another (eps, Delta).

    Args:
        eps, delta, Delta, calibration, max_exact_users: as :class:`DeletionRelease` (``calibration`` has
            no default here: ``--p002-calibration`` is its one default).
        strong_convexity: mu_f, strong convexity of every f_u (e.g. the problem's ``reg``).
        smoothness: beta_f, smoothness of every f_u.
        start_grad_bound: G0 >= max_u ||grad f_u(c)|| at the center c = w0.
        extra_reg: lam >= 0, the server-side regularizer (lam/2)||theta - c||^2 (Phased-ERM).
        tol: tau, the certified solver accuracy (default Delta / 1000).
        use_certificate: try the Lemma C.1 fast path before the exact enumeration.
    """

    name: ClassVar[str] = "sc-output-pert"
    guarantee: ClassVar[Guarantee] = Guarantee("approx-dp", clients=IN_CLASS_CLIENTS, relations=PAPER_002_RELATIONS)

    eps: float
    delta: float
    Delta: float
    strong_convexity: float
    smoothness: float
    start_grad_bound: float
    calibration: str
    extra_reg: float = 0.0
    tol: float | None = None
    max_exact_users: int = 20
    use_certificate: bool = True
    # NOT private: which path decided, per run (a fresh count for every engine, replace() included)
    stats: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stats", {"certificate": 0, "exact": 0})
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}")
        for name in ("strong_convexity", "extra_reg"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
        if not self.mu > 0:
            raise ValueError("SCOutputPert needs a strongly convex objective: strong_convexity + extra_reg > 0")
        if not (self.smoothness >= self.strong_convexity and math.isfinite(self.smoothness)):
            raise ValueError(f"smoothness must be finite and >= strong_convexity, got {self.smoothness}")
        if not (self.start_grad_bound >= 0 and math.isfinite(self.start_grad_bound)):
            raise ValueError(f"start_grad_bound must be finite and >= 0, got {self.start_grad_bound}")
        if not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"tol must be finite and > 0, got {self.tol}")
        self.dop  # validates eps, delta, Delta and the noise calibration

    @classmethod
    def for_problem(cls, problem: Problem, feature_bound: float, w0: torch.Tensor, **kw) -> SCOutputPert:
        """The release with mu, beta, G0 from ``problem.constants`` on the ball ``||w|| <= ||w0||`` (which
        holds w0); ``kw``: the other fields.

        ``feature_bound`` must be the bound the data loader enforces (``dataset.feature_bound``).
        """
        radius = max(float(torch.as_tensor(w0).double().norm()), 1e-12)
        c = problem.constants(feature_bound, param_bound=radius)
        if c.smoothness is None or c.strong_convexity is None:
            raise ValueError(f"{problem.name}: SCOutputPert needs a convex, smooth loss")
        return cls(strong_convexity=c.strong_convexity, smoothness=c.smoothness, start_grad_bound=c.lipschitz, **kw)

    # --- public quantities (no data) ------------------------------------------------------------
    @property
    def dop(self) -> DeletionRelease:
        return DeletionRelease(self.eps, self.delta, self.Delta, self.calibration, self.max_exact_users)

    @property
    def mu(self) -> float:
        return self.strong_convexity + self.extra_reg

    @property
    def beta(self) -> float:
        return self.smoothness + self.extra_reg

    @property
    def tau(self) -> float:
        return self.Delta / 1000.0 if self.tol is None else float(self.tol)

    @property
    def iterations(self) -> int:
        """Fixed GD iteration count giving ||f~(y) - theta*(y)|| <= tau for every y (module docstring)."""
        r0 = self.start_grad_bound / self.mu
        q = 1.0 - self.mu / self.beta
        if r0 <= self.tau or q <= 0.0:
            return 1
        return max(1, math.ceil(math.log(r0 / self.tau) / -math.log(q)))

    def certificate_bound(self, n: int, gamma: float) -> float:
        """U: an upper bound on Dbar_{4 kappa} theta*(x) from gamma >= max_u ||grad l_u(theta*)||
        (inf when n < 4 kappa + 2, where Lemma C.1 does not apply)."""
        return lemma_c1_bound(n, self.dop.depth, gamma, self.mu, self.beta)

    def forecast(self, n: int, w0: torch.Tensor, user_ids=None) -> dict:
        """:func:`release_forecast` of this release (public values only)."""
        return release_forecast(self.dop.sigma, self.Delta, self, torch.as_tensor(w0).numel())

    @property
    def fast_path_rate(self) -> float:
        total = self.stats["certificate"] + self.stats["exact"]
        return self.stats["certificate"] / total if total else math.nan

    # --- f~: the deterministic solver ----------------------------------------------------------
    def answer_bound(self, theta: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
        """The largest ``||grad f_u(theta)||`` of ANY loss in the declared class, per row of ``theta``:
        ``G0 + beta_f ||theta - c||`` (``||grad f_u(c)|| <= G0`` and grad f_u is beta_f-Lipschitz), padded
        for rounding. An answer above it is no in-class client's: the solver treats it as failed."""
        reach = (theta - center).norm(dim=-1)
        return (self.start_grad_bound + self.smoothness * reach) * (1 + _ANSWER_PAD) + _ANSWER_PAD

    @property
    def reach(self) -> float:
        """Every iterate of f~ on in-class answers lies within ``2 G0 / mu`` of the centre (GD with step
        1/beta on a mu-strongly convex, beta-smooth objective never moves away from theta*(y), and
        ``||c - theta*(y)|| <= G0/mu``); the solver projects onto this ball (padded), which never moves
        an in-class iterate and keeps every iterate finite whatever the answers."""
        return 2.0 * self.start_grad_bound / self.mu * (1 + _REACH_PAD) + _ANSWER_PAD

    def solve(
        self,
        federation: Federation,
        masks: torch.Tensor,
        center: torch.Tensor,
        failed: set[int] | None = None,
        record: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """f~ on every row of ``masks`` ((k, n) bool, users that remain): ``(k, d)`` float64.

        A user's answer at a row that is missing, non-finite or above :meth:`answer_bound` counts as the
        zero gradient there (the user's position is added to ``failed`` when given); the iterates are
        projected onto the ball of :meth:`reach`. So f~ is finite and the run never aborts on an answer,
        and for clients whose answers are fixed functions of the point asked (failing or not), f~ is a
        deterministic function of the set of remaining users: all the exact test's privacy needs
        (module docstring, "Failures"). On in-class answers neither rule ever applies: f~ is unchanged.
        ``record``: when given, every round appends (its points ``(k, d)``, every user's answers ``(n, k, d)``
        as received), what the diameter test's interpolation check reads."""
        reach = self.reach
        out = []
        for start in range(0, masks.shape[0], _SOLVE_CHUNK):
            w = masks[start : start + _SOLVE_CHUNK].to(torch.float64)
            cnt = w.sum(1, keepdim=True)
            theta = center.to(torch.float64).expand(w.shape[0], -1).clone()
            for _ in range(self.iterations):
                ans = federation.compute(GradientsAtPoints(theta))
                vals = ans.values.to(torch.float64)
                if record is not None:
                    record.append((theta.clone(), vals.clone()))
                bad = ~(torch.isfinite(vals).all(dim=2) & (vals.norm(dim=2) <= self.answer_bound(theta, center)))
                for u in ans.failed:
                    bad[ans.users.index(u)] = True
                if bool(bad.any()):
                    vals = torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=vals.dtype), vals)
                    if failed is not None:
                        failed.update(ans.users[i] for i in torch.nonzero(bad.any(dim=1)).flatten().tolist())
                grad = torch.einsum("kn,nkd->kd", w, vals) / cnt.clamp_min(1.0)
                grad = grad + self.extra_reg * (theta - center)
                theta = torch.where(cnt > 0, theta - grad / self.beta, theta)
                step = (theta - center).norm(dim=1, keepdim=True)
                if bool((step > reach).any()):  # never for in-class answers: f~ unchanged bit for bit
                    theta = torch.where(step > reach, center + (theta - center) * (reach / step), theta)
            out.append(theta)
        return torch.cat(out)

    # --- the test ------------------------------------------------------------------------------
    def answers_in_class(self, record: list[tuple[torch.Tensor, torch.Tensor]], center: torch.Tensor) -> bool:
        """Whether every user's recorded answers are the gradients of one in-class function."""
        grads = torch.cat([vals for _, vals in record], dim=1)
        points = torch.cat([theta for theta, _ in record]).unsqueeze(0).expand(grads.shape[0], -1, -1)
        return bool(
            in_class(points, grads, center, self.strong_convexity, self.smoothness, self.start_grad_bound).all()
        )

    def certify(
        self,
        federation: Federation,
        theta: torch.Tensor,
        center: torch.Tensor,
        record: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[bool, float]:
        """(passed, U + 2 tau): passed proves Dbar_{4 kappa} f~(x) <= Delta (module docstring) for in-class
        answers; ``record``: its answers are appended there (as :meth:`solve`'s)."""
        n = federation.num_users
        # the norms are computed HERE from the users' gradients (the solver's own oracle), never taken
        # from a client's report: a client that under-reports could make the certificate pass
        ans = federation.compute(GradientsAtPoints(theta.unsqueeze(0)))
        values = ans.values.to(torch.float64)
        if record is not None:
            record.append((theta.unsqueeze(0).clone(), values.clone()))
        if ans.failed or not torch.isfinite(values).all():  # no certificate: the exact enumeration decides
            return False, math.inf
        grads = values[:, 0] + self.extra_reg * (theta - center)
        gamma = float(grads.norm(dim=1).max()) + self.beta * self.tau
        bound = self.certificate_bound(n, gamma) + 2 * self.tau
        return bound <= self.Delta * (1 - _FP_PAD), bound

    def plan(self, federation: Federation, center: torch.Tensor) -> StabilityPlan:
        """The exact test's outcome, via the certificate when it settles it, else by enumeration."""
        n = federation.num_users
        full = torch.ones(1, n, dtype=torch.bool)
        failed: set[int] = set()
        record: list[tuple[torch.Tensor, torch.Tensor]] = []
        theta = self.solve(federation, full, center, failed, record)[0]
        # the certificate bounds the deletion jumps of in-class answers only: a failed answer (zeroed in f~)
        # or answers no one in-class function gives (fedkl.algorithms.output_perturbation.interpolation, on the full solve's and
        # the certificate's answers) leave the decision to the exact enumeration, which needs nothing of them
        if self.use_certificate and not failed:
            passed, _ = self.certify(federation, theta, center, record)
            if passed and self.answers_in_class(record, center):
                self.stats["certificate"] += 1
                return StabilityPlan(n, 0, (), theta, "certificate")
        self.stats["exact"] += 1
        return exact_stability(lambda m: self.solve(federation, m, center), n, self.dop)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
        label: str | None = None,
    ) -> DelOutputPertResult:
        """One (eps, delta) release charged to every user; ``theta`` is None for ⊥.

        ``w0`` is the center c (start point and extra regularizer's center): it must be public
        (data-independent or an earlier private output).
        """
        n = federation.num_users
        releaser.require("approx-dp", self.name)
        if n > self.max_exact_users:
            raise ValueError(
                f"SCOutputPert: n={n} users exceeds max_exact_users={self.max_exact_users}; the exact "
                "fallback (needed whenever the certificate fails) would enumerate ~2^n sets, and "
                "'certificate or ⊥' is not DP. Refused before reading any data."
            )
        center = torch.as_tensor(w0).to(torch.float64)
        if center.shape != (federation.num_params,) or not torch.isfinite(center).all():
            raise ValueError(f"w0 must be a finite vector of {federation.num_params} parameters")
        start = time.perf_counter()
        plan = self.plan(federation, center)
        dop = DelOutputPert(self.dop)
        users = list(range(n))
        theta = dop.release(
            plan,
            releaser,
            federation.ids_of(users),
            label or self.name,
            {"mu": self.mu, "beta": self.beta, "tau": self.tau, "iterations": self.iterations},
        )
        res = dop.result(None if theta is None else theta.to(center.dtype), plan, time.perf_counter() - start)
        res.diagnostics["fast_path_rate"] = self.fast_path_rate
        if progress is not None:
            progress({"round": 1, "rounds": 1, "released": theta is not None, **res.diagnostics})
        return res
