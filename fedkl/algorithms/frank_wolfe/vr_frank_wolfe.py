"""Variance-reduced stochastic Frank–Wolfe for smooth (non-convex) losses (paper 001, Bassily–Guzmán–
Menart): ``vr-fw`` (Alg 4, A_polySFW: an l1 ball or a simplex, Thm 10/11) and ``vr-fw-lp`` (Alg 5, A_nSFW:
an l_p ball, 1 < p <= 2, l2 included, Thm 13/14), at user level (one user = one client = the unit).

**Slots (docs/derivations/paper-001.md §5; "pitfall N" below is item N of its §6).** Rounds r = 0..R-1
of 2^r steps t = 0..2^r - 1; slot (r, t) is a disjoint cohort of ``m_t = floor(b/(t+1))`` users, taken
in the order of ``sha256(seed, user id)`` (public, data-free; surplus users are never asked nor charged).
``eta_t = 1/sqrt(t+1)`` (eta_0 = 1).

    t = 0 (anchor):  grad_0 = (1/b) sum_u clip_C0(grad f_u(w_0))
    t >= 1 (pair):   g_t = (1/m_t) sum_u clip_C0(grad f_u(w_t)),
                     D_t = (1/m_t) sum_u clip_{L1 ||w_t - w_{t-1}||}(grad f_u(w_t) - grad f_u(w_{t-1})),
                     grad_t = (1 - eta_t)(grad_{t-1} + D_t) + eta_t g_t          (STORM recursion)
    v_t = a private argmin of <v, grad_t> over W;  w_{t+1} = (1 - eta_t) w_t + eta_t v_t

The denominators are the nominal ``b`` and ``m_t`` (a user who fails contributes zero). The difference
clip ``L1 ||w_t - w_{t-1}||`` is public (w's are private outputs) and is what L1-smoothness promises, so it
binds only for a client whose loss is not L1-smooth. Its sensitivity is accounted at the data-free bound
``L1 D eta_{t-1}`` >= it (``||w_t - w_{t-1}|| = eta_{t-1} ||v_{t-1} - w_{t-1}|| <= eta_{t-1} D``: the step
of the PREVIOUS slot, pitfall 9; the paper's ``eta_t`` under-noises Alg 5 by sqrt((t+1)/t)), so every
charge is fixed before any data is read. Replace-one: a user moves a sum of answers bounded by C by 2C
(add-remove: C, with the same nominal denominators).

``vr-fw`` (Alg 4, l1 geometry: the dual norm is l_inf, answers clamped coordinatewise at C0 and at the
difference bound; ``L1``: ``||grad f(w) - grad f(v)||_inf <= L1 ||w - v||_1``, which the problems' l2
smoothness constant satisfies). The estimates grad_t carry NO noise: they stay on the server (trusted,
never logged or sent; pitfall 14), and only the vertex selections are released, by the exponential
mechanism (Gumbel report-noisy-min, bounded range: eps^2/8 zCDP, instead of the paper's Laplace RNM with
advanced composition, which is off by ~sqrt 2: pitfall 7). **Exact per-slot ledger
(docs/derivations/paper-001.md §5.2).** A user of slot (r, k) moves grad_t, t >= k, by at most (l_inf)

    e_t(k) = prod_{j=k+1..t}(1 - eta_j) * [(1 - eta_k) 2 L1 D eta_{k-1} + eta_k 2 C0] / m_k   (k = 0: 2 C0/b)

so the utility ``-<v_j - c, grad_t>`` by ``Delta_{t,k} = max_j ||v_j - c||_1 e_t(k)`` (pitfall 11). With
one Gumbel scale s_r per round, selection t costs that user ``Delta_{t,k}^2 / (2 s_r^2)`` zCDP (the
exponential mechanism at eps = 2 Delta_{t,k}/s_r), and s_r is the smallest scale at which the most
charged slot of the round pays the budget: ``s_r^2 = max_k sum_{t>=k} Delta_{t,k}^2 / (2 rho)``. Each
selection is charged to every slot it depends on, each at its own cost, before it is drawn.

``vr-fw-lp`` (Alg 5, l_p ball): the anchor is released with Gaussian noise at rho, and the pair (g_t, D_t),
computed on the SAME cohort, as two Gaussian releases at rho/2 each (pitfall 8: the paper's "parallel
composition" drops this sum), sensitivities ``2 C0/m_t`` and ``2 L1 D eta_{t-1}/m_t`` in l2; the LMO and
the recursion are post-processing. Clipping is in l2 at C0 (the problems' constants are l2 bounds): the
Gaussian noise needs only an l2 bound, and the l2 clip keeps every gradient the dual-norm clip
``||g||_q <= L0`` would keep (``||g||_2 <= d^(1/p - 1/2) ||g||_q``), so it is the derivation's
``C0 = L0 d^(1/p-1/2)`` l2 clip without the loss of the conversion; D = 2r (the l2 diameter of the l_p
ball for p <= 2).

**Guarantee: user-level rho-zCDP** (each user in at most one slot: parallel composition; its charges
are those of the releases its slot influences, summing to <= rho), hence (eps, delta)-DP by the
ledger's conversion, for replace-one or add-remove, for ANY clients (every bound is enforced by the
clip where the data lives, and a Flower answer outside it is rejected: the user contributes zero).
**Private outputs:** the selections (vr-fw) / the noisy releases (vr-fw-lp), hence every iterate and
the model; clients receive only iterates. Output (Thm 11/14): an iterate drawn uniformly from the
2^R - 1 iterates ``w_r^t`` (t < 2^r; w_0^0 included, the last one excluded), by a public seeded draw
(post-processing): ``--vrfw-output uniform``. The default returns the last iterate instead (post-processing
too, so private alike; not what the rate theorems analyse, but at their small R the uniform draw is often
the data-free start).

Parameters (theorems, natural logs clamped to >= 1; R by log2 and floored, pitfall 12): ``b =
floor(n/ln^2 n)``; Thm 11 ``R = floor((2/3) log2(n eps/(ln^2 J ln^2 n sqrt(ln 1/delta))))``; Thm 14 ``R =
floor((4/5) log2(n eps/(sqrt(X) kappa^(5/3) ln^2 n)))`` with ``X = max(d kappa~ ln(1/delta), n^(1/3)
eps^2/ln^(2/3) n)`` (the paper's small-d embedding), ``kappa = min(1/(p-1), 2 ln d)``, ``kappa~ = 1 + ln d
1(p<2)``; R >= 1, lowered until every slot has a user (``b >= 2^(R-1)``) and the slots fit in n (given
values that do not fit are refused). Rates: Thm 11 ``E Gap = O~(D(L0 + L1 D) log^(2/3) J/(n eps)^(1/3))``;
Thm 14 ``O~(D(L0 + L1 D) kappa^(2/3)(1/n^(1/3) + (d kappa~)^(1/5)/(n eps)^(2/5)))``.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from fedkl.algorithms.contract import Algorithm, AlgorithmParams, BuildContext, SmallAudit, param
from fedkl.algorithms.frank_wolfe.noisy_fw import NoisyFWResult
from fedkl.algorithms.localization.fkt_common import cohort_order, split_cohorts
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import (
    ClampedGradient,
    ClampedGradientDifference,
    ClippedGradient,
    Federation,
    GradientDifference,
    Query,
)
from fedkl.privacy.charges import ExponentialCharge, GaussianCharge, Need
from fedkl.privacy.guarantee import RELEASED_MODELS, ZERO_SUMS, Guarantee, sum_sensitivity
from fedkl.privacy.release import Releaser
from fedkl.problems.lp_ball import LpBall
from fedkl.problems.polytope import DOMAINS, PolytopeDomain, make_domain

OUTPUTS = ("uniform", "last")


# --------------------------------------------------------------------------------------------------
# the schedule (public, data-free)
# --------------------------------------------------------------------------------------------------
def step_size(t: int) -> float:
    """``eta_t = 1/sqrt(t + 1)`` (eta_0 = 1: every round starts with a jump to the selected point)."""
    return 1.0 / math.sqrt(t + 1)


def slot_sizes(rounds: int, batch: int) -> list[list[int]]:
    """``[[floor(b/(t+1)) for t < 2^r] for r < R]``: the nominal cohort size of every slot."""
    return [[batch // (t + 1) for t in range(2**r)] for r in range(rounds)]


def users_needed(rounds: int, batch: int) -> int:
    return sum(sum(round_) for round_ in slot_sizes(rounds, batch))


def _ln(x: float) -> float:
    return max(1.0, math.log(x))


def theorem_batch(n: int) -> int:
    """``b = floor(n / ln^2 n)`` (Thm 11 / 14), at least 1."""
    return max(1, int(n / _ln(n) ** 2))


def polytope_rounds(n: int, eps: float, delta: float, num_vertices: int) -> int:
    """Thm 11's ``R = floor((2/3) log2(n eps / (ln^2 J ln^2 n sqrt(ln 1/delta))))``, at least 1."""
    denom = _ln(num_vertices) ** 2 * _ln(n) ** 2 * math.sqrt(math.log(1.0 / delta))
    return max(1, int((2.0 / 3.0) * math.log2(max(n * eps / denom, 1.0))))


def lp_kappa(d: int, p: float) -> tuple[float, float]:
    """``(kappa, kappa~) = (min(1/(p-1), 2 ln d), 1 + ln d 1(p < 2))`` (Sec 4 / Thm 14; kappa >= 1)."""
    kappa = max(1.0, min(1.0 / (p - 1.0), 2.0 * math.log(d))) if d > 1 else 1.0
    return kappa, 1.0 + (math.log(d) if p < 2 else 0.0)


def lp_rounds(n: int, eps: float, delta: float, d: int, p: float) -> int:
    """Thm 14's ``R = floor((4/5) log2(n eps / (sqrt(X) kappa^(5/3) ln^2 n)))``, X with the small-d cap."""
    kappa, kappa_t = lp_kappa(d, p)
    x = max(d * kappa_t * math.log(1.0 / delta), n ** (1.0 / 3.0) * eps**2 / _ln(n) ** (2.0 / 3.0))
    denom = math.sqrt(x) * kappa ** (5.0 / 3.0) * _ln(n) ** 2
    return max(1, int(0.8 * math.log2(max(n * eps / denom, 1.0))))


def schedule_fits(rounds: int, batch: int, n: int) -> bool:
    """Every slot has at least one user (``b >= 2^(R-1)``) and all slots fit in n users."""
    return rounds >= 1 and batch >= 2 ** (rounds - 1) and users_needed(rounds, batch) <= n


def fit_rounds(rounds: int, batch: int, n: int) -> int:
    """The theorem's R lowered until the schedule fits (at least 1)."""
    while rounds > 1 and not schedule_fits(rounds, batch, n):
        rounds -= 1
    return rounds


# --------------------------------------------------------------------------------------------------
# the hyperparameters
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VRFWCommon(AlgorithmParams):
    """Hyperparameters shared by vr-fw and vr-fw-lp."""

    vrfw_radius: float = param(
        1.0, "vr-fw, vr-fw-lp: the radius of the constraint set (l1 / l_p ball; simplex: its sum)", "heuristic",
        positive=True,
    )  # fmt: skip
    vrfw_rounds: int | None = param(
        None, "vr-fw, vr-fw-lp: restarts R (2^R - 1 slots; default: Thm 11 / Thm 14's, lowered to fit n)", "theorem"
    )
    vrfw_batch: int | None = param(
        None, "vr-fw, vr-fw-lp: anchor cohort b; slot t has floor(b/(t+1)) users (default: n / ln^2 n)", "theorem"
    )
    vrfw_clip: float | None = param(
        None,
        "vr-fw, vr-fw-lp: the gradient clip C0 (vr-fw: l_inf clamp; vr-fw-lp: l2) (default: the problem's L0 on W)",
        "theorem",
    )
    vrfw_smoothness: float | None = param(
        None,
        "vr-fw, vr-fw-lp: L1; differences are clipped at L1 * ||w_t - w_{t-1}|| (default: the problem's smoothness)",
        "theorem",
    )
    vrfw_output: str = param(
        "last",
        "vr-fw, vr-fw-lp: the model: the last iterate, or `uniform`, an iterate drawn uniformly from the 2^R - 1 "
        "(Thm 11/14's output, w_0^0 included: at the theorems' small R often the start)",
        "heuristic",
        choices=OUTPUTS,
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        for flag, v in (("--vrfw-rounds", self.vrfw_rounds), ("--vrfw-batch", self.vrfw_batch)):
            if v is not None and v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        for flag, v in (("--vrfw-clip", self.vrfw_clip), ("--vrfw-smoothness", self.vrfw_smoothness)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be finite and > 0, got {v}")


@dataclass(frozen=True)
class VRFWParams(VRFWCommon):
    """vr-fw: variance-reduced Frank–Wolfe over an l1 ball / simplex (paper 001, Alg 4)."""

    vrfw_domain: str = param("l1-ball", "vr-fw: the constraint set W", "heuristic", choices=DOMAINS)


@dataclass(frozen=True)
class VRFWLpParams(VRFWCommon):
    """vr-fw-lp: variance-reduced Frank–Wolfe over an l_p ball (paper 001, Alg 5)."""

    vrfw_p: float = param(2.0, "vr-fw-lp: p of the l_p ball, 1 < p <= 2", "heuristic")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1.0 < self.vrfw_p <= 2.0:
            raise ValueError(f"--vrfw-p must satisfy 1 < p <= 2, got {self.vrfw_p}")


P = TypeVar("P", bound=VRFWCommon)


# --------------------------------------------------------------------------------------------------
# the shared driver
# --------------------------------------------------------------------------------------------------
VRFWResult = NoisyFWResult  # the same fields: model, rounds, rho spent, details, history


class _VarianceReducedFW(Algorithm[P]):
    """The slot loop of Alg 4 and Alg 5, built from the params and the budget as `fedkl run` builds it; a
    subclass says how the estimate is released and the point chosen (``build_domain``, ``theorem_rounds``,
    ``estimate``, ``direction``, ...). Attributes: ``domain``; ``rounds`` R (``vrfw_rounds``, else the
    theorem's, lowered to fit n); ``batch`` b (``vrfw_batch``, else n/ln^2 n); ``clip`` C0 and ``smoothness``
    L1 (given, else the problem's on the domain); ``rho_total`` every user's zCDP (``ctx.rho_left``)."""

    guarantee = Guarantee("zcdp", composition="parallel")
    absence = ZERO_SUMS
    clients_see = RELEASED_MODELS  # clients get w_t, w_{t-1}: post-processing of releases
    audit = SmallAudit()

    def __init__(self, params: P, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.domain = self.build_domain(params, ctx.problem.num_params)
        eps, delta = ctx.approx_budget()
        if not (ctx.rho_left > 0 and math.isfinite(ctx.rho_left)):
            raise ValueError(f"{self.name}: the zCDP budget must be finite and > 0, got rho={ctx.rho_left}")
        n = ctx.num_users
        batch = theorem_batch(n) if params.vrfw_batch is None else params.vrfw_batch
        if params.vrfw_rounds is None:
            rounds = fit_rounds(self.theorem_rounds(n, eps, delta), batch, n)
        else:
            rounds = params.vrfw_rounds
        if not schedule_fits(rounds, batch, n):
            raise ValueError(
                f"--vrfw-rounds {rounds} with --vrfw-batch {batch} need b >= 2^(R-1) and "
                f"{users_needed(rounds, batch)} users; there are {n}"
            )
        constants = ctx.problem.constants(ctx.feature_bound, param_bound=self.domain.l2_bound)
        clip = constants.lipschitz if params.vrfw_clip is None else params.vrfw_clip
        smooth = constants.smoothness if params.vrfw_smoothness is None else params.vrfw_smoothness
        for flag, v in (("--vrfw-clip", clip), ("--vrfw-smoothness", smooth)):
            if v is None or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be finite and > 0 (the problem has no such constant: give it), got {v}")
        self.rounds, self.batch = int(rounds), int(batch)
        self.clip, self.smoothness, self.rho_total = float(clip), float(smooth), float(ctx.rho_left)
        self.neighbouring, self.seed, self.output = ctx.neighbouring, int(ctx.seed), params.vrfw_output

    # --- subclass hooks --------------------------------------------------------------------------
    def build_domain(self, params: P, dim: int):
        """The constraint set W of ``dim`` coordinates named by ``params``."""
        raise NotImplementedError

    def theorem_rounds(self, n: int, eps: float, delta: float) -> int:
        """The theorem's R for n users and the users' (eps, delta) (before fitting it to n)."""
        raise NotImplementedError

    @property
    def dim(self) -> int:
        return self.domain.dim

    @property
    def diameter(self) -> float:
        """Bounds ``||w_t - w_{t-1}|| / eta_{t-1}`` in the norm of ``step_norm``."""
        raise NotImplementedError

    def start(self) -> torch.Tensor:
        return self.domain.center

    def step_norm(self, step: torch.Tensor) -> float:
        raise NotImplementedError

    def gradient_query(self, w: torch.Tensor) -> Query:
        raise NotImplementedError

    def difference_query(self, w_new: torch.Tensor, w_old: torch.Tensor, clip: float) -> Query:
        raise NotImplementedError

    def estimate(self, releaser: Releaser, r: int, t: int, sums: tuple, cohort: list[str], label: str):
        raise NotImplementedError

    def direction(self, releaser: Releaser, r: int, t: int, grad, slots: list[list[str]], label: str):
        raise NotImplementedError

    def slot_needs(self, r: int, t: int, slots: list[tuple[str, ...]]) -> list[Need]:
        """What step (r, t) charges the users of round r's slots (``slots``: their ids)."""
        raise NotImplementedError

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Every step's charges to its slots (the public plan: :meth:`cohorts`); unused users nothing."""
        ids = [[tuple(user_ids[u] for u in slot) for slot in round_] for round_ in self.cohorts(user_ids)]
        return tuple(need for r in range(self.rounds) for t in range(2**r) for need in self.slot_needs(r, t, ids[r]))

    # --- public, data-free values ----------------------------------------------------------------
    def difference_bound(self, t: int) -> float:
        """``L1 D eta_{t-1}``: the data-free bound on slot t's difference clip (pitfall 9)."""
        return self.smoothness * self.diameter * step_size(t - 1)

    def cohorts(self, user_ids) -> list[list[list[int]]]:
        """Positions of the users of every slot (r, t): consecutive runs of the hashed order."""
        sizes = slot_sizes(self.rounds, self.batch)
        flat = split_cohorts(cohort_order(user_ids, self.seed), [m for round_ in sizes for m in round_])
        out, i = [], 0
        for round_ in sizes:
            out.append(flat[i : i + len(round_)])
            i += len(round_)
        return out

    def output_index(self) -> int:
        """The uniformly drawn iterate (public seeded draw: post-processing)."""
        digest = hashlib.sha256(f"{self.name}\x1f{self.seed}\x1foutput".encode()).digest()
        return random.Random(digest).randrange(2**self.rounds - 1)

    # --- the run ---------------------------------------------------------------------------------
    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> VRFWResult:
        if federation.num_params != self.dim:
            raise ValueError(
                f"{self.name}: the domain has {self.dim} coordinates, the problem {federation.num_params} "
                "(nothing was read or charged)"
            )
        n = federation.num_users
        if not schedule_fits(self.rounds, self.batch, n):
            raise ValueError(
                f"{self.name}: R={self.rounds} rounds of batch b={self.batch} need b >= 2^(R-1) and "
                f"{users_needed(self.rounds, self.batch)} users, there are {n} (nothing was read or charged)"
            )
        cohorts = self.cohorts(federation.user_ids)
        ids = [[federation.ids_of(slot) for slot in round_] for round_ in cohorts]
        w = self.start().to(w0.dtype)
        points: list[torch.Tensor] = []  # w_r^t, t < 2^r: the iterates Thm 11/14 draw the output from
        log = RoundLog(2**self.rounds - 1, progress)
        for r in range(self.rounds):
            grad, w_prev = None, None
            for t in range(2**r):
                begin = time.perf_counter()
                points.append(w)
                users, label = cohorts[r][t], f"{self.name}/r{r}/t{t}"
                g_sum = federation.sum(self.gradient_query(w), users)
                failed = len(g_sum.failed)
                if t == 0:
                    grad = self.estimate(releaser, r, t, (g_sum.total(),), ids[r][t], label)
                else:
                    clip = min(self.smoothness * self.step_norm(w - w_prev), self.difference_bound(t))
                    d_total = torch.zeros_like(w)
                    if clip > 0:  # w_t == w_{t-1}: every difference is 0, nothing to ask
                        d_sum = federation.sum(self.difference_query(w, w_prev, clip), users)
                        d_total, failed = d_sum.total(), failed + len(d_sum.failed)
                    g, diff = self.estimate(releaser, r, t, (g_sum.total(), d_total), ids[r][t], label)
                    eta = step_size(t)
                    grad = (1.0 - eta) * (grad + diff) + eta * g
                v = self.direction(releaser, r, t, grad, ids[r][: t + 1], label).to(w.dtype)
                eta = step_size(t)
                w_prev, w = w, (1.0 - eta) * w + eta * v
                log.round(len(log.history) + 1, begin, failed, r=r, t=t, users=len(users))
        index = self.output_index() if self.output == "uniform" else None
        details = {**self.describe(), "output": self.output, "output_index": index}
        return VRFWResult(
            w=points[index] if index is not None else w,
            rounds=len(log.history),
            rho_spent=self.rho_total,
            details=details,
            history=log.history,
        )

    def describe(self) -> dict:
        return {
            "R": self.rounds,
            "b": self.batch,
            "users_used": users_needed(self.rounds, self.batch),
            "clip": self.clip,
            "smoothness": self.smoothness,
            "neighbouring": self.neighbouring,
        }


# --------------------------------------------------------------------------------------------------
# Alg 4: polytope / l1 ball, exact server state, private vertex selections with the per-slot ledger
# --------------------------------------------------------------------------------------------------
@register
class VRFrankWolfe(_VarianceReducedFW[VRFWParams]):
    """Variance-reduced Frank-Wolfe, smooth non-convex, l1 ball / simplex, exact per-slot ledger (paper 001, Alg 4; zCDP).

    See the module docstring; ``domain`` is a :class:`~fedkl.problems.polytope.PolytopeDomain`."""

    name = "vr-fw"
    Params = VRFWParams
    gaussian_releases_only = False  # exponential-mechanism charges
    small = {"users": 20, "vrfw_rounds": 3, "vrfw_batch": 4}  # 18 users in 7 slots: anchors and (g, diff) pairs

    def build_domain(self, params: VRFWParams, dim: int) -> PolytopeDomain:
        return make_domain(params.vrfw_domain, dim, params.vrfw_radius)

    def theorem_rounds(self, n: int, eps: float, delta: float) -> int:
        return polytope_rounds(n, eps, delta, self.domain.num_vertices)

    @property
    def diameter(self) -> float:
        return 2.0 * self.domain.l1_radius  # >= the l1 diameter of W (triangle inequality through c)

    def step_norm(self, step: torch.Tensor) -> float:
        return float(step.abs().sum())

    def gradient_query(self, w: torch.Tensor) -> Query:
        return ClampedGradient(w, self.clip)

    def difference_query(self, w_new: torch.Tensor, w_old: torch.Tensor, clip: float) -> Query:
        return ClampedGradientDifference(w_new, w_old, clip)

    def selection_sensitivities(self, r: int) -> list[list[float]]:
        """``Delta[t][k]``, k <= t < 2^r: the sensitivity of selection t's utilities to a user of slot k."""
        steps = 2**r
        eta = [step_size(t) for t in range(steps)]
        c0 = sum_sensitivity(self.clip, self.neighbouring)
        moved = []  # l_inf move of grad_k by one user of slot k
        for k, m in enumerate(slot_sizes(r + 1, self.batch)[r]):
            c1 = sum_sensitivity(self.difference_bound(k), self.neighbouring) if k > 0 else 0.0
            moved.append(((1.0 - eta[k]) * c1 + eta[k] * c0) / m)
        out = []
        for t in range(steps):
            row, decay = [0.0] * (t + 1), 1.0
            for k in range(t, -1, -1):
                row[k] = self.domain.l1_radius * moved[k] * decay
                decay *= 1.0 - eta[k]
            out.append(row)
        return out

    def gumbel_scale(self, r: int) -> float:
        """``s_r`` with ``max_k sum_{t>=k} Delta[t][k]^2 / (2 s_r^2) = rho``."""
        sens = self.selection_sensitivities(r)
        worst = max(sum(sens[t][k] ** 2 for t in range(k, len(sens))) for k in range(len(sens)))
        return math.sqrt(worst / (2.0 * self.rho_total))

    def slot_charges(self, r: int, t: int) -> list[ExponentialCharge]:
        """What selection t of round r costs a user of each slot k <= t (eps = 2 Delta/s_r, same scale)."""
        s = self.gumbel_scale(r)
        return [ExponentialCharge(2.0 * d / s, d) for d in self.selection_sensitivities(r)[t]]

    def estimate(self, releaser, r, t, sums, cohort, label):
        if t == 0:
            return sums[0] / self.batch
        m = self.batch // (t + 1)
        return sums[0] / m, sums[1] / m

    def slot_needs(self, r, t, slots):
        return [Need(slots[k], charge) for k, charge in enumerate(self.slot_charges(r, t))]

    def direction(self, releaser, r, t, grad, slots, label):
        charges = self.slot_charges(r, t)
        for k in range(t):  # every earlier slot this selection depends on, each at its own cost
            releaser.release(charges[k], lambda: None, user_ids=slots[k], label=f"{label}/slot-{k}",
                             details={"r": r, "t": t, "slot": k})  # fmt: skip
        j = releaser.exponential(
            -self.domain.scores(grad),
            eps=charges[t].eps,
            sensitivity=charges[t].sensitivity,
            user_ids=slots[t],
            label=f"{label}/slot-{t}",
            details={"r": r, "t": t, "slot": t, "neighbouring": self.neighbouring},
        )
        return self.domain.vertex(j)

    def describe(self) -> dict:
        return {**self.domain.describe(), **super().describe(),
                "gumbel_scales": [self.gumbel_scale(r) for r in range(self.rounds)]}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Alg 5: l_p ball, Gaussian releases of the anchor and of the (g, D) pair
# --------------------------------------------------------------------------------------------------
@register
class VRFrankWolfeLp(_VarianceReducedFW[VRFWLpParams]):
    """Variance-reduced Frank-Wolfe, smooth non-convex, l_p ball (1 < p <= 2), Gaussian pair releases (paper 001, Alg 5; zCDP).

    See the module docstring; ``domain`` is an :class:`~fedkl.problems.lp_ball.LpBall`."""

    name = "vr-fw-lp"
    Params = VRFWLpParams
    small = {"users": 20, "vrfw_rounds": 3, "vrfw_batch": 4}

    def build_domain(self, params: VRFWLpParams, dim: int) -> LpBall:
        return LpBall(dim, params.vrfw_p, params.vrfw_radius)

    def theorem_rounds(self, n: int, eps: float, delta: float) -> int:
        return lp_rounds(n, eps, delta, self.domain.dim, self.domain.p)

    @property
    def diameter(self) -> float:
        return self.domain.l2_diameter

    def step_norm(self, step: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(step))

    def gradient_query(self, w: torch.Tensor) -> Query:
        return ClippedGradient(w, self.clip)

    def difference_query(self, w_new: torch.Tensor, w_old: torch.Tensor, clip: float) -> Query:
        return GradientDifference(w_new, w_old, clip)

    def sensitivities(self, t: int) -> tuple[float, ...]:
        """l2 sensitivities of slot t's releases: ``(2 C0/b,)`` for the anchor, else of (g_t, D_t)."""
        c0 = sum_sensitivity(self.clip, self.neighbouring)
        if t == 0:
            return (c0 / self.batch,)
        m = self.batch // (t + 1)
        return c0 / m, sum_sensitivity(self.difference_bound(t), self.neighbouring) / m

    def estimate(self, releaser, r, t, sums, cohort, label):
        sens = self.sensitivities(t)
        m = self.batch // (t + 1)
        rho = self.rho_total / len(sens)  # the pair shares one cohort: rho/2 each, summed (pitfall 8)
        out = tuple(
            releaser.gaussian(
                total / m,
                sensitivity=s,
                rho=rho,
                user_ids=cohort,
                label=f"{label}/{part}",
                details={"r": r, "t": t, "neighbouring": self.neighbouring},
            )  # fmt: skip
            for total, s, part in zip(sums, sens, ("g", "diff"))
        )
        return out[0] if t == 0 else out

    def slot_needs(self, r, t, slots):
        sens = self.sensitivities(t)
        return [Need(slots[t], GaussianCharge(self.rho_total / len(sens), s)) for s in sens]

    def direction(self, releaser, r, t, grad, slots, label):
        return self.domain.lmo(grad)

    def describe(self) -> dict:
        return {**self.domain.describe(), **super().describe()}


__all__ = [
    "VRFWLpParams",
    "VRFWParams",
    "VRFWResult",
    "VRFrankWolfe",
    "VRFrankWolfeLp",
    "fit_rounds",
    "lp_kappa",
    "lp_rounds",
    "polytope_rounds",
    "schedule_fits",
    "slot_sizes",
    "step_size",
    "theorem_batch",
    "users_needed",
]
