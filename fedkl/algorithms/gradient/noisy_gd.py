"""Noisy full-batch gradient descent over users with per-user clipping (user-level DP, zCDP).

Round t, with all n users taking part:

    S_t   = sum_u clip_C(grad f_u(w_t))                 (computed by the federation)
    S~_t  = S_t + N(0, sigma^2 I),  sigma = Delta / sqrt(2 rho_t)   (released through the Releaser)
    w_t+1 = Proj_{||w|| <= radius}(w_t - lr * S~_t / n)

Guarantee: user-level rho-zCDP with ``rho = sum_t rho_t``, hence (eps, delta)-DP by the CKS conversion.

* Neighbouring relation ``replace-one`` (default; the papers' relation): two datasets differ in ALL
  records of one user; n is public. Every clipped term has norm <= C, so replacing one user moves
  S_t by at most ``Delta = 2C``.
* ``add-remove``: one user's records are added or removed. S_t moves by at most ``Delta = C``; the
  update divides by the fixed public number n of enrolled users (never by a data-dependent count),
  so the step is post-processing of S~_t.

Users whose answer is missing or invalid contribute zero (see :mod:`fedkl.federation.base`), which
keeps every term's norm <= C: the noise is never below what the sensitivity requires, and the
ledger charges every user that was asked (they could have answered).

Only the released sums and what is computed from them (the iterates) are private outputs; a
participating client sees the iterate it is sent, which is itself private.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fedkl.algorithms.contract import Algorithm, BuildContext, Clip, ModelResult, Rounds, SmallAudit, StepSize
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation
from fedkl.privacy.guarantee import ZERO_SUMS, Guarantee
from fedkl.privacy.release import Releaser


@dataclass(frozen=True)
class NoisyGDParams(Rounds, StepSize, Clip):
    """noisy-gd: every user every round; the run's zCDP budget split evenly over the rounds."""


NoisyGDResult = ModelResult  # no details


@register
class NoisyGradientDescent(Algorithm[NoisyGDParams]):
    """Noisy full-batch gradient descent over users with per-user clipping (zCDP).

    See the module docstring; the run's zCDP budget (``ctx.rho_left``) is split evenly over the rounds."""

    name = "noisy-gd"
    Params = NoisyGDParams
    guarantee = Guarantee("zcdp")
    absence = ZERO_SUMS
    step_size = 4.0
    sums_only = True
    float32 = True  # L2-clipped answers, float64 sums and noise (contract.Algorithm.float32)
    small: dict = {}
    audit = SmallAudit()

    def __init__(self, params: NoisyGDParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        if not (ctx.rho_left > 0 and math.isfinite(ctx.rho_left)):
            raise ValueError(f"the zCDP budget must be finite and > 0, got rho={ctx.rho_left}")
        self.rho_total = float(ctx.rho_left)
        # L2 sensitivity of the round sum S_t: replacing one user moves it by 2C, adding/removing one by C
        self.sensitivity = 2.0 * params.clip if ctx.neighbouring == "replace-one" else params.clip

    def plan_schedule(self) -> tuple[int, Callable[[int], str]]:
        """The plan as a schedule (fedkl.runner._ScheduleCut): one release a round, each with the first's
        charge and cohort (every user, rho_total / rounds), labelled by its round."""
        return self.params.rounds, lambda k: f"{self.name}/round-{k}"

    @property
    def rho_per_round(self) -> float:
        return self.rho_total / self.params.rounds

    @property
    def sigma(self) -> float:
        return self.sensitivity / math.sqrt(2.0 * self.rho_per_round)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> NoisyGDResult:
        cfg, neighbouring = self.params, self.ctx.neighbouring
        n = federation.num_users
        users = list(range(n))
        user_ids = federation.ids_of(users)
        w = w0.clone()
        log = RoundLog(cfg.rounds, progress)
        spent = 0.0
        for t in range(cfg.rounds):
            start = time.perf_counter()
            answers = federation.sum(ClippedGradient(w, cfg.clip), users)
            noisy_sum = releaser.gaussian(
                answers.total(),
                sensitivity=self.sensitivity,
                rho=self.rho_per_round,
                user_ids=user_ids,
                label=f"{self.name}/round-{t}",
                details={"round": t, "clip": cfg.clip, "neighbouring": neighbouring, "failed": len(answers.failed)},
            )
            spent += self.rho_per_round
            w = w - cfg.lr * noisy_sum.to(w.dtype) / n
            log.round(t + 1, start, len(answers.failed), noisy_grad_norm=float(noisy_sum.norm()) / n, rho_spent=spent)
        return NoisyGDResult(w=w, rho_spent=spent, rounds=cfg.rounds, sigma=self.sigma, history=log.history)
