"""Noisy GD with a user-level outlier-removal mean of the gradients, after Asi & Liu (2023, arXiv
2311.03797: DP-SGD whose gradient is a private mean estimate for concentrated data that first removes
the users far from the others, then adds noise ~ the concentration radius): no centre is needed.

Round t, all n users, per-user mean gradients clipped to C on the server (``g_u = clip_C(grad f_u(w_t))``;
C bounds the record gradients, as in noisy-gd; a non-finite answer becomes 0). Public values: the
radius ``R = k C / sqrt(m)`` (noisy-gd-conc's: two users' means of m IID records are within R whp),
``a = (n + 1)/2``, ``h = (n - 1)/2``:

    s_u = #{v : ||g_u - g_v|| <= R}          (u itself included: the concentration score)
    x_u = clamp((s_u - a) / h, 0, 1)         (1 iff u is close to every user; 0 if to at most half)
    W   = sum_u x_u,   mean = sum_u x_u g_u / W           (the outliers, x_u = 0, are removed)
    test: W~ = W + N(0, s_q^2);  pass iff W~ > W_min + 3 + s_q z(delta_ptr)   (z: standard normal quantile)
    pass: g~ = mean + N(0, s^2 I),  w <- w - lr g~;     fail: the step is skipped (⊥)

Privacy (user level; replace-one, and add-remove as its special case: an absent user is one whose
answer was replaced by the 0 row; so is a failed one, a dropout or an invalid or non-finite answer, which
every backend hands over as a zero row in ``answers.failed``: unlike noisy-gd-conc's sensitivities, the
bounds below hold for ANY row of u, so present vs absent/failed is covered by them under both relations,
tests/algorithms/test_conc_absent_users.py). Let X, X' differ in user u's records, so in g_u only.

* For v != u, s_v changes by at most 1 (only the pair (v, u) changes), so |x_v - x'_v| <= 1/h, and
  |x_u - x'_u| <= 1: ``|W - W'| <= (n - 1)/h + 1 = 3`` (the test's sensitivity; s_q = 3/sqrt(2 rho_q):
  the Gaussian mechanism, rho_q-zCDP).
* A user with x > 0 has s > (n + 1)/2, i.e. >= n/2 neighbours among the n - 1 users other than u (whose
  points are the same in X and X'); two such users, one of X and one of X', share one: every two
  weighted points of X and X' are within Dm = 2R. Centre all points at one of them (x0): weighted
  points have ||y|| <= Dm. Then ``||S - S'|| <= sum_(v != u) |x_v - x'_v| Dm + 2 Dm <= 4 Dm``
  (S = sum x y), ``||S'|| <= W' Dm``, and ``mean - mean' = (S - S')/W + S' (W' - W)/(W W')``:

      ||mean(X) - mean(X')|| <= (4 + 3) Dm / W = 14 R / W <= B = 14 R / W_min   when W, W' >= W_min.

  The mean is released with ``s = B / sqrt(2 rho_w)``.
* PTR, per round (Bun & Steinke 2016, approximate zCDP, Def. 8.1). If W(X) >= W_min + 3 or W(X') >=
  W_min + 3, both are >= W_min and the round is the composition of two Gaussian mechanisms on this
  pair: (rho_q + rho_w)-zCDP. Otherwise each passes with probability <= P(N(0, s_q^2) > s_q z(delta_ptr))
  = delta_ptr: writing each output law as (1 - delta_ptr) ⊥ + delta_ptr (rest), the round is
  delta_ptr-approximately (rho_q + rho_w)-zCDP. Over T rounds (composition of approximate zCDP) the
  run is (T delta_ptr)-approximately rho-zCDP, rho the sum, so (eps, delta)-DP with eps =
  zcdp_to_eps(rho, delta - T delta_ptr): what the ledger computes from the charges, every round
  ``ApproxDPCharge(0, delta_ptr, "propose-test-release")`` (label ``.../ptr``), the test
  ``GaussianCharge(rho_q, 3)`` (``.../test``) and the mean ``GaussianCharge(rho_w, B)`` (``.../mean``),
  all three charged whether or not the test passes (a failed test is over-charged, never under-charged;
  the plan is fixed before any data: ``fedkl plan --charges``). The CKS/Bun-Steinke conversions hold
  for approximate zCDP; the exact Gaussian conversion does not (refused).
* Every value above (R, a, h, W_min, B, the shares) is a public function of public values (C, m, k,
  beta, n, the budget, the rounds). The server computes everything from the answers: any client (a
  lying client only moves its own point, which the analysis allows to be anything).

Budget: the (eps, delta) left; ``--outlier-delta-share`` of the delta pays the T PTR failures, the zCDP
part is ``rho = rho_for_eps_delta(eps, delta (1 - share))``, split evenly over the rounds and, in a
round, ``--outlier-test-share`` to the test. ``W_min = n - 3 - s_q (z(delta_ptr) + z(beta))``: a fully
concentrated round (W = n) passes with probability >= 1 - beta; refused before any data when W_min < 1
(more users, budget, or fewer rounds).

Utility: with no outlier every x_u = 1 and the release is the plain mean plus noise of sensitivity
14 R / W_min ~ 14 k C / (sqrt(m) n): like noisy-gd's 2C/n times 7 k/sqrt(m), or noisy-gd-conc's 2 tau/n
times ~7 (what it pays for needing no centre); nothing in it grows with d.

Simplified against the paper (said, not hidden): Asi & Liu test concentration with AboveThreshold
(the sparse vector technique) across the SGD steps, paying once; here each round runs its own
Gaussian PTR test (simpler to prove; costs T tests). Their outlier removal is a hard keep/remove by the
score; here the removal is smoothed (the weights x_u, as in FriendlyCore, Tsfadia et al. 2022): a hard
threshold's sensitivity carries the PTR margin (~ s_q z(delta_ptr) users may flip at the boundary),
the smooth one's does not.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, Sequence

import torch

from fedkl.algorithms.contract import (
    Algorithm,
    BuildContext,
    Clip,
    Rounds,
    SmallAudit,
    StepSize,
    param,
)
from fedkl.algorithms.gradient.concentrated_gd import (
    ConcentratedGDResult,
    Concentration,
    check_built_for,
    concentration_scale,
    population,
    records_warning,
)
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import Federation, GradientsAtPoints
from fedkl.federation.clipping import clip_rows
from fedkl.privacy.charges import APPROX_ZCDP_DELTA, ApproxDPCharge, GaussianCharge, Need
from fedkl.privacy.guarantee import ZERO_SUMS, Guarantee, check_relation
from fedkl.privacy.release import Releaser
from fedkl.privacy.zcdp import rho_for_eps_delta

NAME = "noisy-gd-outlier"


def neighbour_scores(points: torch.Tensor, radius: float, block: int = 1024) -> torch.Tensor:
    """s_u = #{v : ||g_u - g_v|| <= radius} (u included), in row blocks (n x block distances at a time)."""
    n = points.shape[0]
    scores = torch.empty(n, dtype=torch.float64)
    for start in range(0, n, block):
        # the direct difference norms (no |x|^2 + |y|^2 - 2xy shortcut): each pair's distance to the ulp, and
        # a function of that pair's two points only, as the proof's "only the pairs (v, u) change" needs
        d = torch.cdist(points[start : start + block], points, compute_mode="donot_use_mm_for_euclid_dist")
        scores[start : start + block] = (d <= radius).sum(1).to(torch.float64)
    return scores


def outlier_weights(scores: torch.Tensor) -> torch.Tensor:
    """x_u = clamp((s_u - (n + 1)/2) / ((n - 1)/2), 0, 1) (module docstring)."""
    n = scores.numel()
    return torch.clamp((scores - (n + 1) / 2) / max((n - 1) / 2, 1.0), 0.0, 1.0)


def weighted_mean(points: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum x_u g_u / W (0 when W = 0: only reached in the PTR's delta event, where any value is private)."""
    total = weights.sum()
    return (weights @ points) / total if total > 0 else torch.zeros_like(points[0])


WEIGHT_SENSITIVITY = 3.0  # |W - W'| <= (n - 1)/h + 1 with h = (n - 1)/2
MEAN_FACTOR = 7.0  # ||mean - mean'|| <= 7 Dm / W_min


@dataclass(frozen=True)
class OutlierGDParams(Rounds, StepSize, Clip, Concentration):
    """noisy-gd-outlier: every user every round; per round a PTR test and the weighted (outliers removed) noisy mean."""

    outlier_test_share: float = param(
        0.2, "noisy-gd-outlier: share of each round's zCDP budget spent on the PTR test", "heuristic"
    )
    outlier_delta_share: float = param(
        0.5, "noisy-gd-outlier: share of the run's delta paid by the PTR tests' failure probability", "heuristic"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.outlier_test_share < 1:
            raise ValueError(f"--outlier-test-share must be in (0, 1), got {self.outlier_test_share}")
        if not 0 < self.outlier_delta_share < 1:
            raise ValueError(f"--outlier-delta-share must be in (0, 1), got {self.outlier_delta_share}")


# the PTR test's (0, delta) charge releases nothing; a failed user's point is the zero vector (inside the
# clip ball) in the weights, the kept weight and the weighted mean
OUTLIER_ABSENCE = ZERO_SUMS


OutlierGDResult = ConcentratedGDResult  # sigma: [the test's, the mean's]


@register
class OutlierGD(Algorithm[OutlierGDParams]):
    """Noisy GD over users with an outlier-removal mean (Asi & Liu 2023): the users close to most others, their weighted mean with PTR-tested noise ~C/sqrt(m) (approximate zCDP).

    See the module docstring. The (eps, delta) left is split: ``--outlier-delta-share`` of delta pays the
    PTR failures (``delta_ptr_total``), the zCDP part ``rho_total`` is the rest's; every public quantity is
    fixed here, before any data."""

    name = NAME
    Params = OutlierGDParams
    guarantee = Guarantee("approx-zcdp")  # Gaussian charges plus (0, delta_ptr) per round (module docstring)
    absence = OUTLIER_ABSENCE
    step_size = 4.0
    gaussian_releases_only = False  # the PTR's delta: the exact Gaussian conversion does not apply
    small = {"users": 300, "conc_records": 10, "outlier_test_share": 0.5}  # its PTR test needs n >> noise
    # its PTR test needs the kept weight's noise well below n (module docstring): one round, 300 users, eps 2
    audit = SmallAudit(
        epsilon=2.0,
        runs=70,
        users=300,
        records=2,
        settings={"rounds": 1, "outlier_test_share": 0.5, "conc_records": 2},
    )

    def __init__(self, params: OutlierGDParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        check_relation(ctx.neighbouring)
        self.neighbouring = ctx.neighbouring
        eps, delta = ctx.approx_budget()
        self.delta_ptr_total = params.outlier_delta_share * delta
        self.rho_total = rho_for_eps_delta(eps, delta - self.delta_ptr_total, ctx.conversion)
        if not (self.rho_total > 0 and math.isfinite(self.rho_total)):
            raise ValueError(f"the zCDP budget must be finite and > 0, got rho={self.rho_total}")
        if not 0 < self.delta_ptr_total < 1:
            raise ValueError(f"the PTR delta must be in (0, 1), got {self.delta_ptr_total}")
        self.num_users, self.dim = population(ctx)
        if self.min_weight < 1:
            raise ValueError(
                f"{NAME}: at this budget the PTR test's noise ({self.sigma_test:.3g} on the kept weight) leaves "
                f"W_min = {self.min_weight:.3g} < 1 of n = {self.num_users} users: more users, "
                "budget or fewer rounds (nothing was read or charged)"
            )

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Every user: the rounds' Gaussian charges and their PTR tests' deltas (module docstring)."""
        ids = tuple(user_ids)
        return Need(ids, GaussianCharge(self.rho_total)), Need(
            ids, ApproxDPCharge(0.0, self.delta_ptr_total, APPROX_ZCDP_DELTA)
        )

    def warnings(self) -> list[str]:
        """Public settings that make this run a worse noisy-gd, said by ``fedkl run`` before any budget is spent."""
        return records_warning(self.name, self.params.conc_records, self.radius, self.params.clip)

    @property
    def rho_round(self) -> float:
        return self.rho_total / self.params.rounds

    @property
    def rho_test(self) -> float:
        return self.params.outlier_test_share * self.rho_round

    @property
    def rho_mean(self) -> float:
        return (1.0 - self.params.outlier_test_share) * self.rho_round

    @property
    def delta_ptr(self) -> float:
        return self.delta_ptr_total / self.params.rounds

    @property
    def sigma_test(self) -> float:
        return WEIGHT_SENSITIVITY / math.sqrt(2.0 * self.rho_test)

    @property
    def min_weight(self) -> float:
        """W_min = n - 3 - s_q (z(delta_ptr) + z(beta))."""
        z = NormalDist().inv_cdf
        return (
            self.num_users
            - WEIGHT_SENSITIVITY
            - self.sigma_test * (z(1 - self.delta_ptr) + z(1 - self.params.conc_beta))
        )

    @property
    def threshold(self) -> float:
        """W_min + 3 + s_q z(delta_ptr): a round with W < W_min + 3 passes with probability <= delta_ptr."""
        return self.min_weight + WEIGHT_SENSITIVITY + self.sigma_test * NormalDist().inv_cdf(1 - self.delta_ptr)

    @property
    def radius(self) -> float:
        p = self.params
        return concentration_scale(p.conc_scale, self.num_users, p.conc_beta) * p.clip / math.sqrt(p.conc_records)

    @property
    def sensitivity(self) -> float:
        """B = 7 Dm / W_min = 14 R / W_min: the weighted mean's sensitivity where the test is passed."""
        return MEAN_FACTOR * 2.0 * self.radius / self.min_weight

    # (not ``sigma``: fedkl/algorithms/forecast.py reads that as the noise on a SUM of clipped gradients)
    @property
    def sigma_mean(self) -> float:
        return self.sensitivity / math.sqrt(2.0 * self.rho_mean)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> OutlierGDResult:
        cfg = self.params
        n = federation.num_users
        check_built_for(self, federation)
        releaser.require(self.guarantee.charges, self.name)
        users = list(range(n))
        user_ids = federation.ids_of(users)
        B = self.sensitivity
        w = w0.clone()
        log = RoundLog(cfg.rounds, progress)
        spent, passed = 0.0, 0
        for t in range(cfg.rounds):
            start = time.perf_counter()
            answers = federation.compute(GradientsAtPoints(w.unsqueeze(0)), users)
            points = clip_rows(answers.values[:, 0, :].to(torch.float64), cfg.clip)[0]
            weights = outlier_weights(neighbour_scores(points, self.radius))
            common = {"round": t, "neighbouring": self.neighbouring, "failed": len(answers.failed)}
            label = f"{self.name}/round-{t}"
            releaser.release(
                ApproxDPCharge(0.0, self.delta_ptr, APPROX_ZCDP_DELTA),
                lambda: None,
                user_ids=user_ids,
                label=f"{label}/ptr",
                details={**common, "threshold": self.threshold, "min_weight": self.min_weight},
            )
            noisy_weight = float(
                releaser.gaussian(
                    weights.sum().reshape(1),
                    sensitivity=WEIGHT_SENSITIVITY,
                    rho=self.rho_test,
                    user_ids=user_ids,
                    label=f"{label}/test",
                    details=common,
                )[0]
            )
            details = {**common, "passed": noisy_weight > self.threshold}
            if details["passed"]:
                noisy = releaser.gaussian(
                    weighted_mean(points, weights),
                    sensitivity=B,
                    rho=self.rho_mean,
                    user_ids=user_ids,
                    label=f"{label}/mean",
                    details=details,
                )
            else:  # ⊥: the mean's charge is made all the same (the plan is fixed before any data)
                noisy = releaser.release(
                    GaussianCharge(self.rho_mean, B), lambda: None, user_ids=user_ids, label=f"{label}/mean",
                    details=details,
                )  # fmt: skip
            spent += self.rho_test + self.rho_mean
            if noisy is not None:
                passed += 1
                w = w - cfg.lr * noisy.to(w.dtype)
            norm = float(noisy.norm()) if noisy is not None else 0.0
            log.round(t + 1, start, len(answers.failed), noisy_grad_norm=norm, rho_spent=spent)
        details = {
            "radius": self.radius,
            "min_weight": self.min_weight,
            "threshold": self.threshold,
            "sensitivity": B,
            "passed_rounds": passed,
            "delta_ptr_total": self.delta_ptr_total,
            "records": cfg.conc_records,
        }
        return OutlierGDResult(
            w=w,
            rho_spent=spent,
            rounds=cfg.rounds,
            sigma=[self.sigma_test, self.sigma_mean],
            details=details,
            history=log.history,
        )


__all__ = [
    "OUTLIER_ABSENCE",
    "OutlierGD",
    "OutlierGDParams",
    "OutlierGDResult",
    "neighbour_scores",
    "outlier_weights",
    "weighted_mean",
]
