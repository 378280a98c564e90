"""Iterative localization (paper 003, §4 and §5.2.2): Phased-SGD (Alg. 2, Thm 4.4), Phased-ERM
(Alg. 3, Thm 4.8; fedkl name ``fkt-phased-erm``) and the strongly convex localization (Thm 5.3).

Every algorithm here runs phases i = 1..k on DISJOINT cohorts C_i of fresh users (hashed order, see
:mod:`fedkl.algorithms.localization.fkt_common`). Phase i starts from the previous private output w_{i-1} (w_0 is
public), computes a point whose user-level L2 sensitivity is at most gamma_i, and releases

    w_i = Proj_K( value_i + N(0, sigma_i^2 I) ),   sigma_i = gamma_i / sqrt(2 rho)   (Releaser.gaussian)

charged to the users of C_i only. **Guarantee: user-level rho-zCDP** (replace-one default, add-remove;
n public), hence (eps, delta)-DP by the ledger's conversion: a user of C_i is read by phase i only,
whose output is a Gaussian mechanism of sensitivity gamma_i given the earlier (private) outputs, and
every later phase is post-processing plus other users' data (parallel composition: each user's cost
is rho once, not k rho). The exact Gaussian formula replaces the paper's constants
(docs/derivations/paper-003.md §6, pitfall 6: sigma_i = 4 L eta_i/rho_p in Alg. 2 is twice what
Lemma 4.3 needs). **Private outputs: the phase outputs w_1..w_k** (the model is w_k).

Schedules (public), with rho_p = sqrt(2 rho) the paper's parameter and f = 2 (replace-one) or 1
(add-remove):

* Phased-SGD / Phased-ERM: eta = (D/L) min{4/sqrt(n), rho_p/sqrt(d)} (Thm 4.8's eps/sqrt(d ln 1/delta)
  is rho_p for a Gaussian); n_i = floor(n/2^i) (times the batch), eta_i = eta 4^-i; phases stop
  when n_i < min_cohort (docs/derivations/paper-003.md §6, pitfall 5: k = ceil(log2 n) would make
  the last n_i < 1).
* Strongly convex localization: k = ceil(ln ln n) phases of equal size floor(n/k), eta_i =
  eta 2^(-2^i) with eta = 4 c k ln(n)/(lam n), c >= 2, exponentially weighted averages (Lemma 5.2,
  weights (1 - eta_i lam)^-t); eta_i capped at 1/(2 lam) (Lemma 5.2's condition).

Phase solvers and their sensitivities (derivations in each function):

* ``psgd`` (Phased-SGD, SC localization): one-pass projected SGD over the cohort, one user (or a
  batch of b users, not analysed in the paper) per step, constant step eta_i <= 2/beta (capped: the
  condition of Lemma 4.3), average of the points where gradients were taken. gamma_i = f L eta_i / b.
  Needs convex, beta-smooth user losses. **Client view:** a user receives the within-phase iterate,
  a noiseless function of the earlier users of its phase: NOT private with respect to them.
* ``gd`` (Phased-ERM, smooth losses): the phase objective F_i(w) = (1/n_i) sum_{C_i} f_u(w) +
  (lam_i/2)||w - w_{i-1}||^2, lam_i = 2/(eta_i n_i) (Alg. 3's 1/(eta_i n_i)||.||^2), minimized over K by
  projected full-cohort gradient descent for a round count PROVEN to reach ||w~ - w*_i|| <= r_i =
  tol L eta_i (tol = 1 is the paper's Delta_i = L^2 eta_i/n_i accuracy). The count is fixed from public
  constants, so no stopping time leaks and no failure probability is left: the release is pure
  zCDP instead of the paper's (eps, 2 delta) (Lemma 4.6 needs the delta only for its randomized
  solver). gamma_i = f L/(lam_i n_i) + 2 r_i (= 3 L eta_i at tol = 1, replace-one; the paper's
  4 L eta_i uses the loose minimizer bound 4L/(lam n), docs/derivations/paper-003.md §2C). **Client
  view:** every solver iterate of its phase (not private with respect to the other users of the phase).
* ``subgradient`` (Phased-ERM, any convex Lipschitz loss, the paper's non-smooth case): projected
  subgradient method on F_i over K ∩ B(w_{i-1}, L/lam_i) with steps 2/(lam_i (t+1)) and the t-weighted
  average (Lacoste-Julien, Schmidt & Bach 2012: F_i(avg) - F_i* <= 2 G^2/(lam_i (T+1)), G = 2L), for
  the T that proves ||w~ - w*_i|| <= r_i; same gamma_i. O(n_i^2) rounds of the whole cohort.
* ``one-shot`` (the variant of docs/derivations/paper-003.md §5 for deployments where intermediate
  iterates must not leave the server): each user of C_i receives ONLY w_{i-1} and lam_i and returns
  its local proximal point v_u = argmin_v f_u(v) + (lam_i/2)||v - w_{i-1}||^2; the server releases
  w_{i-1} + (1/n_i) sum_u clip_C(v_u - w_{i-1}), C = L/lam_i (inactive for L-Lipschitz losses).
  gamma_i = f C / n_i (= L eta_i replace-one). Private for ANY loss (the clip bounds each user's
  term: no convexity needed); the paper's utility analysis does not cover it. **Client view:** only
  the released w_{i-1}.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from fedkl.algorithms.contract import Algorithm, BuildContext, SmallAudit, param
from fedkl.algorithms.localization.fkt_common import (
    ConvexSetting,
    FKTParams,
    FKTResult,
    check_parallel_releaser,
    cohort_order,
    paper_rho,
    project,
    replace_factor,
)
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation, LocalRegularizedMinimizer, Query
from fedkl.privacy.charges import GaussianCharge, Need
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, SOLVER_ITERATES, ZERO_SUMS, ClientView, Guarantee, check_relation
from fedkl.privacy.release import Releaser

CLIENT_VIEW = {
    "psgd": "a user receives the within-phase SGD iterate: a noiseless function of the earlier users of "
    "its phase (NOT private w.r.t. them); only phase outputs are private",
    "gd": "a user receives every solver iterate of its phase (NOT private w.r.t. the other users of its "
    "phase); only phase outputs are private",
    "subgradient": "a user receives every solver iterate of its phase (NOT private w.r.t. the other users "
    "of its phase); only phase outputs are private",
    "one-shot": "a user receives only the previous private output w_{i-1} (or the public w0) and lam_i",
}


@dataclass(frozen=True)
class LocalizationParams(FKTParams):
    """The phased algorithms' hyperparameters (module docstring)."""

    fkt_solver: str | None = param(
        None,
        "phase solver: psgd (fkt-phased-sgd, fkt-sc-localization), gd or subgradient (fkt-phased-erm), or "
        "one-shot (any phased algorithm: clients see only private outputs)",
        "theorem (one-shot: heuristic utility, private for any loss)",
        choices=("psgd", "gd", "subgradient", "one-shot"),
    )
    fkt_batch: int = param(
        1,
        "users per SGD step in the psgd phase solver (1 = the paper; b > 1 divides the "
        "sensitivity by b but is not analysed)",
        "heuristic for b > 1",
    )
    fkt_min_cohort: int = param(1, "the smallest phase cohort; later phases are dropped", "heuristic")
    fkt_erm_tol: float = param(
        1.0,
        "fkt-phased-erm solver accuracy r_i = TOL * L * eta_i (1 = the paper's Delta_i); smaller values shrink "
        "the sensitivity 1 + 2 TOL (x L eta_i) at the cost of more solver rounds",
        "theorem at 1",
    )
    fkt_max_solver_rounds: int = param(
        100_000, "refuse fkt-phased-erm plans needing more solver rounds than this", "safety limit"
    )
    fkt_sc_c: float = param(2.0, "fkt-sc-localization: c >= 2 of Thm 5.3 (eta = 4 c k ln n/(lam n))", "theorem")

    def __post_init__(self) -> None:
        super().__post_init__()
        for flag, value in (
            ("--fkt-batch", self.fkt_batch),
            ("--fkt-min-cohort", self.fkt_min_cohort),
            ("--fkt-max-solver-rounds", self.fkt_max_solver_rounds),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not (self.fkt_erm_tol > 0 and math.isfinite(self.fkt_erm_tol)):
            raise ValueError(f"--fkt-erm-tol must be finite and > 0, got {self.fkt_erm_tol}")
        if not (self.fkt_sc_c >= 2 and math.isfinite(self.fkt_sc_c)):
            raise ValueError(f"--fkt-sc-c must be finite and >= 2 (Thm 5.3), got {self.fkt_sc_c}")


ONE_SHOT_VIEW = ClientView(True, "the previous phase's private output (or the public w0) and lam_i only (one-shot)")


def localization_view(params: LocalizationParams) -> ClientView:
    """Phased fkt algorithms: clients see the phase solver's iterates unless the solver is one-shot."""
    return ONE_SHOT_VIEW if params.fkt_solver == "one-shot" else SOLVER_ITERATES


@dataclass
class Phase:
    """One phase's public plan."""

    index: int
    users: list[int]
    step: float
    reg: float  # lam_i = 2/(eta_i n_i): ERM regularization / one-shot prox strength
    sensitivity: float = 0.0
    solver_rounds: int = 0
    info: dict = field(default_factory=dict)


def project_two_balls(p: torch.Tensor, radius: float | None, center: torch.Tensor, r2: float) -> torch.Tensor:
    """Euclidean projection onto {||x|| <= radius} ∩ {||x - center|| <= r2} (center inside the first ball).

    If neither single projection lands in the other ball, both constraints are active at the
    solution (KKT), which then lies on the intersection of the two spheres: the (d-2)-sphere in the
    hyperplane at distance h from 0 along e = center/||center||, of radius sqrt(radius^2 - h^2)."""
    in1 = radius is None or float(p.norm()) <= radius
    in2 = float((p - center).norm()) <= r2
    if in1 and in2:
        return p
    q = project(p, radius)
    if float((q - center).norm()) <= r2 * (1 + 1e-12):
        return q
    q = center + project(p - center, r2)
    if radius is None or float(q.norm()) <= radius * (1 + 1e-12):
        return q
    dist = float(center.norm())
    e = center / dist
    h = (dist**2 + radius**2 - r2**2) / (2 * dist)
    m = h * e
    ring = math.sqrt(max(radius**2 - h**2, 0.0))
    perp = (p - m) - float((p - m) @ e) * e
    norm = float(perp.norm())
    if norm == 0.0:  # p on the axis: every point of the ring is closest; take one
        perp = torch.zeros_like(p)
        perp[int(torch.argmin(e.abs()))] = 1.0
        perp = perp - float(perp @ e) * e
        norm = float(perp.norm())
    return m + ring * perp / norm


class PhaseDriver:
    """The phase driver (module docstring) shared by the phased paper-003 algorithms and
    ``gll-phased-sgd`` (:mod:`fedkl.algorithms.frank_wolfe.gll_phased`): an unregistered mixin.
    Subclasses set ``name``, ``solvers``, ``weighted`` and :meth:`schedule` (and may change
    :meth:`gradient_query`), and call :meth:`setup` once, from their constructor."""

    name = "fkt-localization"
    guarantee = Guarantee("zcdp", "parallel", IN_CLASS_CLIENTS)
    solvers: tuple[str, ...] = ()
    weighted = False  # exponentially weighted PSGD averages (Lemma 5.2)

    def setup(
        self,
        setting: ConvexSetting,
        rho_total: float,
        *,
        solver: str | None,
        neighbouring: str,
        seed: int,
        batch: int = 1,
        min_cohort: int = 1,
        erm_tol: float = 1.0,
        max_solver_rounds: int = 100_000,
    ) -> None:
        """Fix the public inputs of every plan: ``setting`` (see :func:`fkt_common.convex_setting`), each
        participating user's zCDP budget ``rho_total``, the phase ``solver`` (None: the first of
        ``solvers``), the relation, the cohort-hashing ``seed``, ``batch`` users per SGD step (1 = the
        paper), the smallest phase ``min_cohort``, ``erm_tol`` = r_i / (L eta_i) for the ERM solvers (1 =
        the paper's accuracy) and ``max_solver_rounds`` (plans above it are refused)."""
        check_relation(neighbouring)
        if not (rho_total > 0 and math.isfinite(rho_total)):
            raise ValueError(f"rho_total must be finite and > 0, got {rho_total}")
        solver = solver or self.solvers[0]
        if solver not in self.solvers:
            raise ValueError(f"{self.name}: solver must be one of {self.solvers}, got {solver!r}")
        if solver in ("psgd", "gd"):
            setting.require_smooth(f"{self.name} with the {solver} solver")
        self.setting, self.solver, self.rho_total = setting, solver, float(rho_total)
        self.neighbouring, self.seed, self.factor = neighbouring, seed, replace_factor(neighbouring)
        self.batch, self.min_cohort = batch, min_cohort
        self.erm_tol, self.max_solver_rounds = erm_tol, max_solver_rounds

    # --- the public plan -----------------------------------------------------------------------
    def used(self, pool: list[int]) -> list[int]:
        """The positions of ``pool`` its phases use, in order (every schedule's sizes depend on the pool's size
        only, not on the distance)."""
        return pool[: sum(size for size, _ in self.schedule(len(pool), 1.0))]

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Each user of a phase: ``rho_total`` once (parallel composition); the others nothing."""
        used = self.used(cohort_order(user_ids, self.seed))
        return (Need(tuple(user_ids[u] for u in used), GaussianCharge(self.rho_total)),)

    def schedule(self, n: int, distance: float) -> list[tuple[int, float]]:
        """[(n_i, eta_i)] for a pool of n users (subclasses)."""
        raise NotImplementedError

    def plan(self, pool: list[int], distance: float) -> list[Phase]:
        """The phases of a run on ``pool`` (positions in hashed order): sizes, steps, regularization,
        sensitivity and solver rounds, from public values only (refuses bad plans before any data)."""
        s = self.setting
        sched = self.schedule(len(pool), distance)
        if not sched:
            raise ValueError(
                f"{self.name}: {len(pool)} users are too few for one phase "
                f"(min_cohort={self.min_cohort}, batch={self.batch})"
            )
        phases, start = [], 0
        for i, (size, eta) in enumerate(sched, start=1):
            lam_i = 2.0 / (eta * size)
            ph = Phase(i, list(pool[start : start + size]), eta, lam_i)
            start += size
            L = s.lipschitz
            if self.solver == "psgd":
                ph.sensitivity = self.factor * L * eta / self.batch
                ph.solver_rounds = size // self.batch
            elif self.solver == "one-shot":
                ph.sensitivity = self.factor * (L / lam_i) / size
                ph.solver_rounds = 1
            else:
                r = self.erm_tol * L * eta
                ph.sensitivity = self.factor * L / (lam_i * size) + 2.0 * r
                ph.solver_rounds = (
                    _gd_rounds(L, s.smoothness, lam_i, r) if self.solver == "gd" else _subgradient_rounds(L, lam_i, r)
                )
                ph.info["accuracy"] = r
                if ph.solver_rounds > self.max_solver_rounds:
                    raise ValueError(
                        f"{self.name}: phase {i} needs {ph.solver_rounds} {self.solver} rounds to "
                        f"prove its accuracy (max_solver_rounds={self.max_solver_rounds}); use fewer "
                        "users, the gd solver (smooth losses) or a larger erm_tol"
                    )
            phases.append(ph)
        return phases

    # --- running -------------------------------------------------------------------------------
    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> FKTResult:
        check_parallel_releaser(releaser, self.name)
        w = project(torch.as_tensor(w0).to(torch.float64).clone(), self.setting.radius)
        order = cohort_order(federation.user_ids, self.seed)
        phases = self.plan(order, self.setting.resolve_distance(w))
        w, records = self.run_phases(federation, releaser, w, phases, self.name, progress)
        return FKTResult(
            w=w.to(torch.as_tensor(w0).dtype),
            rounds=len(phases),
            sigma=[r["sigma"] for r in records],
            details=self.describe(federation, records),
            history=records,
        )

    def run_phases(
        self,
        federation: Federation,
        releaser: Releaser,
        w: torch.Tensor,
        phases: list[Phase],
        label: str,
        progress: Callable[[dict], None] | None = None,
        offset: int = 0,
        total: int | None = None,
    ) -> tuple[torch.Tensor, list[dict]]:
        """Run ``phases`` from the public/private point ``w``; each phase's release is charged to its
        cohort only. Returns the last output and one record per phase."""
        log = RoundLog(total or len(phases), progress)
        for ph in phases:
            start = time.perf_counter()
            value, failed = self.solve(federation, ph, w)
            ids = federation.ids_of(ph.users)
            noisy = releaser.gaussian(
                value,
                sensitivity=ph.sensitivity,
                rho=self.rho_total,
                user_ids=ids,
                label=f"{label}/phase-{ph.index}",
                details={
                    "phase": ph.index,
                    "users": len(ids),
                    "step": ph.step,
                    "reg": ph.reg,
                    "solver": self.solver,
                    "solver_rounds": ph.solver_rounds,
                    "neighbouring": self.neighbouring,
                },
            )
            w = project(noisy.to(torch.float64), self.setting.radius)
            log.round(
                offset + len(log.history) + 1,
                start,
                failed,
                extra=ph.info,
                phase=ph.index,
                users=len(ids),
                step=ph.step,
                reg=ph.reg,
                sensitivity=ph.sensitivity,
                sigma=ph.sensitivity / math.sqrt(2.0 * self.rho_total),
                solver_rounds=ph.solver_rounds,
            )
        return w, log.history

    def describe(self, federation: Federation, records: list[dict]) -> dict:
        used = sum(r["users"] for r in records)
        return {
            "dp": f"user-level rho-zCDP ({self.neighbouring}, n public): each user is in one phase and "
            f"is charged rho={self.rho_total:.4g} once, by that phase's Gaussian release",
            "private_outputs": "the phase outputs w_1..w_k (the model is w_k)",
            "client_view": CLIENT_VIEW[self.solver],
            "solver": self.solver,
            "phases": records,
            "users_used": used,
            "users_unused": federation.num_users - used,
            "federation_rounds": sum(r["solver_rounds"] for r in records),
            "lipschitz": self.setting.lipschitz,
            "smoothness": self.setting.smoothness,
        }

    # --- phase solvers -------------------------------------------------------------------------
    def solve(self, federation: Federation, ph: Phase, center: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.solver == "psgd":
            return self._psgd(federation, ph, center)
        if self.solver == "one-shot":
            return self._one_shot(federation, ph, center)
        if self.solver == "gd":
            return self._erm_gd(federation, ph, center)
        return self._erm_subgradient(federation, ph, center)

    def _psgd(self, federation: Federation, ph: Phase, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One-pass projected SGD at constant step eta_i <= 2/beta from w_{i-1}.

        Sensitivity (Lemma 4.3, Hardt-Recht-Singer 2016): with eta <= 2/beta every projected gradient
        step of a convex beta-smooth (mean) loss is non-expansive, so the two runs' iterates separate
        only at the step that reads the differing user, by at most eta f L/b (its clipped term of the
        batch mean changes by <= f L/b); every iterate and any fixed convex combination of iterates
        (uniform or exponential weights) stays within f L eta/b."""
        b, eta = self.batch, ph.step
        lam = self.setting.strong_convexity
        avg, failed = torch.zeros_like(w), 0
        for j in range(ph.solver_rounds):
            users = ph.users[j * b : (j + 1) * b]
            # weight of the j-th evaluation point in the running average: uniform 1/(j+1), or
            # gamma_t/Gamma_t = eta lam / (1 - (1 - eta lam)^t) for Lemma 5.2's gamma_t = (1 - eta lam)^-t
            weight = eta * lam / -math.expm1((j + 1) * math.log1p(-eta * lam)) if self.weighted else 1.0 / (j + 1)
            avg += weight * (w - avg)
            answers = federation.sum(self.gradient_query(w), users)
            failed += len(answers.failed)
            w = project(w - eta * answers.total().to(torch.float64) / b, self.setting.radius)
        return avg, failed

    def gradient_query(self, w: torch.Tensor) -> Query:
        """The psgd solver's per-user gradient query: ``clip_L(grad f_u(w))`` (inactive for an L-Lipschitz
        loss; a subclass may ask for another oracle with the same norm bound L)."""
        return ClippedGradient(w, self.setting.lipschitz)

    def _one_shot(self, federation: Federation, ph: Phase, center: torch.Tensor) -> tuple[torch.Tensor, int]:
        """w_{i-1} + (1/n_i) sum_u clip_C(prox_u - w_{i-1}), C = L/lam_i: one user's term changes by at
        most 2C (replace-one) or C (add-remove); a failed user contributes zero."""
        clip = self.setting.lipschitz / ph.reg
        answers = federation.compute(LocalRegularizedMinimizer(center, ph.reg), ph.users)
        deltas = answers.values.to(torch.float64) - center
        bad = ~answers.answered() | ~torch.isfinite(deltas).all(dim=1)
        deltas = torch.where(bad.unsqueeze(1), torch.zeros_like(deltas), deltas)
        norms = deltas.norm(dim=1, keepdim=True)
        deltas = torch.where(norms > clip, deltas * (clip / norms.clamp_min(1e-300)), deltas)
        return center + deltas.sum(0) / len(ph.users), int(bad.sum())

    def _phase_gradient(self, federation: Federation, ph: Phase, x: torch.Tensor, center: torch.Tensor):
        answers = federation.sum(ClippedGradient(x, self.setting.lipschitz), ph.users)
        return answers.total().to(torch.float64) / len(ph.users) + ph.reg * (x - center), len(answers.failed)

    def _erm_gd(self, federation: Federation, ph: Phase, center: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Projected GD on F_i over K, step 2/(lam_i + beta + lam_i), for ph.solver_rounds rounds
        (:func:`_gd_rounds`): ||x_k - w*_i|| <= q^k ||w_{i-1} - w*_i|| <= q^k L/lam_i <= r_i."""
        step = 2.0 / (2.0 * ph.reg + self.setting.smoothness)
        x, failed = center.clone(), 0
        for _ in range(ph.solver_rounds):
            g, f = self._phase_gradient(federation, ph, x, center)
            failed += f
            x = project(x - step * g, self.setting.radius)
        return x, failed

    def _erm_subgradient(self, federation: Federation, ph: Phase, center: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Projected subgradient on F_i over X = K ∩ B(w_{i-1}, L/lam_i) (contains w*_i), steps
        2/(lam_i (t+1)), average with weights 2t/(T(T+1)) (:func:`_subgradient_rounds`)."""
        T, lam = ph.solver_rounds, ph.reg
        r_ball = self.setting.lipschitz / lam
        x, avg, failed = center.clone(), torch.zeros_like(center), 0
        for t in range(1, T + 1):
            avg += (2.0 * t / (T * (T + 1))) * x
            g, f = self._phase_gradient(federation, ph, x, center)
            failed += f
            x = project_two_balls(x - (2.0 / (lam * (t + 1))) * g, self.setting.radius, center, r_ball)
        return avg, failed


def _gd_rounds(L: float, beta: float, lam: float, r: float) -> int:
    """Rounds of projected GD with step 2/(mu + L_f) on F_i (mu = lam, L_f = beta + lam) that prove
    ||x_k - w*_i|| <= r. The step map is a q-contraction, q = (L_f - mu)/(L_f + mu) (Nesterov 2004,
    Thm 2.1.15; the projection is non-expansive and w*_i is its fixed point), and
    ||w_{i-1} - w*_i|| <= L/lam (from F_i(w*) <= F_i(w_{i-1}) and lam-strong convexity:
    lam ||w* - w_{i-1}||^2 <= f(w_{i-1}) - f(w*) <= L ||w* - w_{i-1}||).

    At least one round even where the start already proves the accuracy (L/lam <= r, i.e. n_i <= 2
    at tol = 1): any k >= the proven count keeps ||x_k - w*_i|| <= q^k L/lam <= r, and zero rounds would
    release w_{i-1} + noise, charging the phase's users for a value that never read their data."""
    start = L / lam
    if start <= r:
        return 1
    q = beta / (beta + 2.0 * lam)
    if q <= 0.0:
        return 1
    return max(1, math.ceil(math.log(start / r) / -math.log(q)))


def _subgradient_rounds(L: float, lam: float, r: float) -> int:
    """T with 4 G^2/(lam^2 (T+1)) <= r^2, G = 2L: then F_i(avg) - F_i* <= 2G^2/(lam (T+1)) and strong
    convexity give ||avg - w*_i||^2 <= 2 (F_i(avg) - F_i*)/lam <= r^2."""
    return max(1, math.ceil(16.0 * L**2 / (lam**2 * r**2)) - 1)


class _Localization(PhaseDriver, Algorithm[LocalizationParams]):
    """A registered phased algorithm: its plan's inputs come from its Params and the BuildContext
    (:meth:`PhaseDriver.setup`); each participating user's zCDP budget is the run's zCDP left."""

    Params = LocalizationParams
    absence = ZERO_SUMS
    clients_see = staticmethod(localization_view)
    audit = SmallAudit()

    def __init__(self, params: LocalizationParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.setup(
            params.setting(ctx),
            ctx.rho_left,
            solver=params.fkt_solver,
            neighbouring=ctx.neighbouring,
            seed=ctx.seed,
            batch=params.fkt_batch,
            min_cohort=params.fkt_min_cohort,
            erm_tol=params.fkt_erm_tol,
            max_solver_rounds=params.fkt_max_solver_rounds,
        )


@register
class PhasedSGD(_Localization):
    """Phased SGD (Alg 2, Thm 4.4): each user in one phase, < n gradients.

    E F(w_k) - F* = O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))) for convex, L-Lipschitz, beta-smooth losses with
    eta <= 2/beta. With the exact noise sigma_i = 2 L eta_i/rho_p the proof of Thm 4.4 gives the constant
    ~ 1.7 on 1/sqrt(n) and ~ 20 on sqrt(d)/(rho_p n) (the paper's 10 assumes sigma_i = L eta_i/rho_p)."""

    name = "fkt-phased-sgd"
    small = {"radius": 2.0}
    solvers = ("psgd", "one-shot")

    def schedule(self, n: int, distance: float) -> list[tuple[int, float]]:
        return _halving_schedule(self, n, distance, cap=self.solver == "psgd")


@register
class FKTPhasedERM(_Localization):
    """Phased ERM (Alg 3, Thm 4.8): each phase solves a regularized ERM to a proven accuracy.

    O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))) for convex L-Lipschitz losses (smooth: ``gd`` solver,
    O(n log n) gradients; non-smooth: ``subgradient``, O(n^3)); pure zCDP here (module docstring), where
    the paper has (eps, 2 delta)."""

    name = "fkt-phased-erm"
    small = {"radius": 2.0}
    solvers = ("gd", "subgradient", "one-shot")

    def schedule(self, n: int, distance: float) -> list[tuple[int, float]]:
        return _halving_schedule(self, n, distance, cap=False)


@register
class SCLocalization(_Localization):
    """Strongly convex localization (Alg 5, Thm 5.3).

    O((L^2 ln n lnln n/lam)(1/n + d lnln n/(rho_p^2 n^2))) for lam-strongly convex F, provided
    beta/lam <= n/(k ln n)."""

    name = "fkt-sc-localization"
    small = {"radius": 2.0, "reg": 0.1}
    solvers = ("psgd", "one-shot")
    weighted = True

    def setup(self, setting: ConvexSetting, rho_total: float, **public) -> None:
        setting.require_strongly_convex(self.name)
        super().setup(setting, rho_total, **public)

    def schedule(self, n: int, distance: float) -> list[tuple[int, float]]:
        s, b = self.setting, self.batch
        lam = s.strong_convexity
        k = max(1, math.ceil(math.log(math.log(n)))) if n >= 3 else 1
        size = b * (n // (k * b))
        if size < max(self.min_cohort, b):
            return []
        eta = 4.0 * self.params.fkt_sc_c * k * math.log(n) / (lam * n)
        cap = 1.0 / (2.0 * lam)
        if self.solver == "psgd":
            cap = min(cap, 2.0 / s.smoothness)
        return [(size, min(eta * 2.0 ** -(2**i), cap)) for i in range(1, k + 1)]


def _halving_schedule(alg: PhaseDriver, n: int, distance: float, cap: bool) -> list[tuple[int, float]]:
    """n_i = b floor(n / (2^i b)) while n_i >= max(min_cohort, b); eta_i = eta 4^-i with
    eta = (D/L) min{4/sqrt(n), rho_p/sqrt(d)} (capped at 2/beta when the solver needs it)."""
    s, b = alg.setting, alg.batch
    eta = (distance / s.lipschitz) * min(4.0 / math.sqrt(n), paper_rho(alg.rho_total) / math.sqrt(s.dim))
    out, i = [], 1
    while True:
        size = b * (n // (2**i * b))
        if size < max(alg.min_cohort, b):
            return out
        eta_i = eta * 4.0**-i
        out.append((size, min(eta_i, 2.0 / s.smoothness) if cap else eta_i))
        i += 1
