"""Noisy Frank–Wolfe over an l1 ball or a polytope (paper 001, Bassily–Guzmán–Menart, Alg 3 / Thm 9),
at user level: every user takes part in every round.

Round t = 1..T, with W = conv(V) (:mod:`fedkl.problems.polytope`) and centre c:

    S_t  = sum_u clamp_G(grad f_u(w_t))                      (federation; l_inf clip at the public G)
    j_t  = exponential mechanism on the utilities -<v_j - c, S_t>, j in V     (Releaser.exponential)
    w_t+1 = (1 - mu_t) w_t + mu_t v_{j_t},   mu_t = min(1, 3/(t + 2))   (mu_1 = 1: w_2 is a vertex)

The exponential mechanism is report-noisy-min with Gumbel noise (the same distribution): it replaces
the paper's Laplace report-noisy-max, whose pure-DP cost eps0 composes as eps0^2/2 zCDP, by a
bounded-range selection costing eps0^2/8 (docs/derivations/paper-001.md §5.2 and §6, pitfall 7).

**Guarantee: user-level rho-zCDP** (rho = the run's budget, every user charged every round), hence
(eps, delta)-DP by the ledger's conversion. Derivation:

* each answer is clamped coordinatewise to [-G, G] where the data lives, and a Flower client's
  answer outside the box is rejected by the server (the user then contributes zero): so replacing
  ALL records of one user moves ``S_t`` by at most ``2G`` in l_inf (``G`` under add-remove; the
  step divides by nothing data-dependent), whatever the clients compute (any clients);
* the utility of vertex j moves by at most ``|<v_j - c, S_t - S'_t>| <= ||v_j - c||_1 * 2G``, so
  ``Delta = 2 G max_j ||v_j - c||_1`` (the paper's 3 L0 R D / n is one record's contribution of a
  mean and uses the diameter D: docs/derivations/paper-001.md §6, pitfalls 6 and 11);
* the exponential mechanism with ``eps0`` and sensitivity Delta is eps0-DP and eps0^2/8-zCDP
  (Cesar & Rogers 2021); the candidates are public, and w_t is post-processing of earlier
  selections; T selections compose to ``T eps0^2/8 = rho``: ``eps0 = sqrt(8 rho / T)``.

**Private outputs:** the selected vertices, hence every iterate and the model. The exact sums S_t
stay on the server (a trusted aggregator: SecAgg would hide the users but not S_t, which is not
private). A client sees only iterates (private outputs).

Parameters (Thm 9, paper's natural logs): ``T = floor(n eps / (ln J ln n sqrt(ln(1/delta))))`` (at
least 1; ``ln n`` and ``ln J`` taken >= 1), with (eps, delta) the users' budget; the clamp
``G`` = the problem's Lipschitz bound L0 R (an l2 bound, hence an l_inf one) on W. The paper smooths
a non-smooth GLL by its Moreau envelope; fedkl's GLLs are smooth already (``logistic``, and
``smoothed-hinge``: the Moreau envelope of the hinge with ``beta = 1/smoothing``; ``huber``; ``absolute``
trains on its envelope, :mod:`fedkl.problems.robust_regression`), so the oracle is
the exact gradient (alpha = 0). The model is the last iterate ``w_{T+1}`` (the paper returns w_T,
leaving the last selection unused; both are post-processing). Rate (Thm 9, convex GLL, W an l1
ball): ``O~(L0 R D sqrt(log d / (n eps)))``, with no polynomial dependence on d.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fedkl.algorithms.contract import Algorithm, AlgorithmParams, BuildContext, ModelResult, SmallAudit, param
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClampedGradient, Federation
from fedkl.privacy.charges import ExponentialCharge
from fedkl.privacy.guarantee import ZERO_SUMS, Guarantee, sum_sensitivity
from fedkl.privacy.release import Releaser
from fedkl.problems.polytope import DOMAINS, PolytopeDomain, make_domain


def theorem_rounds(n: int, eps: float, delta: float, num_vertices: int) -> int:
    """Thm 9's ``T = n eps / (ln J ln n sqrt(ln 1/delta))``, floored, at least 1 (``ln n``, ``ln J``
    clamped to >= 1 so that tiny populations do not divide by ~0)."""
    if n < 1 or not (eps > 0) or not 0 < delta < 1 or num_vertices < 1:
        raise ValueError(f"need n >= 1, eps > 0, 0 < delta < 1 and J >= 1; got {n}, {eps}, {delta}, {num_vertices}")
    denom = max(1.0, math.log(num_vertices)) * max(1.0, math.log(n)) * math.sqrt(math.log(1.0 / delta))
    return max(1, int(n * eps / denom))


def step_size(t: int) -> float:
    """``mu_t = 3/(t + 2)`` for t = 1, 2, ... (Alg 3), capped at 1."""
    return min(1.0, 3.0 / (t + 2))


NoisyFWResult = ModelResult  # no sigma


@dataclass(frozen=True)
class NoisyFWParams(AlgorithmParams):
    """noisy-fw: Frank–Wolfe over an l1 ball / simplex with exponential-mechanism vertex selection."""

    fw_domain: str = param("l1-ball", "noisy-fw: the constraint set W", "heuristic", choices=DOMAINS)
    fw_radius: float = param(
        1.0, "noisy-fw: the radius r of the l1 ball {||w||_1 <= r} (simplex: its sum r)", "heuristic", positive=True
    )
    fw_rounds: int | None = param(
        None, "noisy-fw: Frank-Wolfe rounds T (default: Thm 9's n eps / (ln J ln n sqrt(ln 1/delta)))", "theorem"
    )
    fw_clamp: float | None = param(
        None,
        "noisy-fw: the l_inf clamp G of every user's gradient (default: the problem's L0 on the domain)",
        "theorem",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fw_rounds is not None and self.fw_rounds < 1:
            raise ValueError(f"--fw-rounds must be >= 1, got {self.fw_rounds}")
        if self.fw_clamp is not None and not (self.fw_clamp > 0 and math.isfinite(self.fw_clamp)):
            raise ValueError(f"--fw-clamp must be finite and > 0, got {self.fw_clamp}")


@register
class NoisyFrankWolfe(Algorithm[NoisyFWParams]):
    """Noisy Frank-Wolfe over an l1 ball or simplex, exponential-mechanism vertex selection (paper 001, Alg 3; zCDP).

    See the module docstring. Built from the params and the budget: ``domain`` (``fw_domain`` of the
    problem's dimension and ``fw_radius``; research code may put any
    :class:`~fedkl.problems.polytope.PolytopeDomain` of that dimension in its place before ``run``, e.g. a
    :class:`~fedkl.problems.polytope.VertexPolytope`), ``rounds`` T (``fw_rounds``, else Thm 9's from the
    users' (eps, delta)), ``bound`` the clamp G (``fw_clamp``, else the problem's L0 on the domain) and
    ``rho_total`` (the run's zCDP, ``ctx.rho_left``)."""

    name = "noisy-fw"
    Params = NoisyFWParams
    guarantee = Guarantee("zcdp")
    absence = ZERO_SUMS
    gaussian_releases_only = False  # exponential-mechanism charges: the exact Gaussian conversion does not apply
    small = {"fw_rounds": 4}
    audit = SmallAudit()

    def __init__(self, params: NoisyFWParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.domain: PolytopeDomain = make_domain(params.fw_domain, ctx.problem.num_params, params.fw_radius)
        eps, delta = ctx.approx_budget()
        if not (ctx.rho_left > 0 and math.isfinite(ctx.rho_left)):
            raise ValueError(f"noisy-fw: the zCDP budget must be finite and > 0, got rho={ctx.rho_left}")
        rounds = params.fw_rounds
        if rounds is None:
            rounds = theorem_rounds(ctx.num_users, eps, delta, self.domain.num_vertices)
        bound = params.fw_clamp
        if bound is None:
            bound = ctx.problem.constants(ctx.feature_bound, param_bound=self.domain.l2_bound).lipschitz
            if bound is None or not (bound > 0 and math.isfinite(bound)):
                raise ValueError(f"noisy-fw: the problem's Lipschitz bound on the domain is {bound}: give --fw-clamp")
        self.rounds = int(rounds)
        self.bound = float(bound)
        self.rho_total = float(ctx.rho_left)
        self.neighbouring = ctx.neighbouring

    @property
    def sensitivity(self) -> float:
        """Of every utility ``-<v_j - c, S_t>``: ``max_j ||v_j - c||_1`` times the l_inf sensitivity of S_t."""
        return self.domain.l1_radius * sum_sensitivity(self.bound, self.neighbouring)

    def plan_schedule(self) -> tuple[int, Callable[[int], str]]:
        """The plan as a schedule (fedkl.runner._ScheduleCut): one release a round, each with the first's
        charge and cohort (every user, eps_per_round), labelled by its round (from 1)."""
        return self.rounds, lambda k: f"{self.name}/round-{k + 1}"

    @property
    def eps_per_round(self) -> float:
        """``eps0`` with ``T eps0^2 / 8 = rho_total``."""
        return math.sqrt(8.0 * self.rho_total / self.rounds)

    def charge(self) -> ExponentialCharge:
        """The typed charge of one selection (what every user pays per round)."""
        return ExponentialCharge(self.eps_per_round, self.sensitivity)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> NoisyFWResult:
        if federation.num_params != self.domain.dim:
            raise ValueError(
                f"{self.name}: the domain has {self.domain.dim} coordinates, the problem {federation.num_params} "
                "(nothing was read or charged)"
            )
        n = federation.num_users
        users = list(range(n))
        user_ids = federation.ids_of(users)
        eps0, sens = self.eps_per_round, self.sensitivity
        w = self.domain.center.to(w0.dtype)  # public start in W (Alg 3: w_1 arbitrary in W)
        log = RoundLog(self.rounds, progress)
        spent = 0.0
        for t in range(1, self.rounds + 1):
            start = time.perf_counter()
            answers = federation.sum(ClampedGradient(w, self.bound), users)
            utilities = -self.domain.scores(answers.total())
            j = releaser.exponential(
                utilities,
                eps=eps0,
                sensitivity=sens,
                user_ids=user_ids,
                label=f"{self.name}/round-{t}",
                details={"round": t, "bound": self.bound, "neighbouring": self.neighbouring},
            )
            spent += self.charge().rho
            mu = step_size(t)
            w = (1.0 - mu) * w + mu * self.domain.vertex(j).to(w.dtype)
            log.round(t, start, len(answers.failed), vertex=j, rho_spent=spent)
        details = {
            **self.domain.describe(),
            "bound": self.bound,
            "eps_per_round": eps0,
            "sensitivity": sens,
            "neighbouring": self.neighbouring,
        }
        return NoisyFWResult(w=w, rounds=self.rounds, rho_spent=spent, details=details, history=log.history)
