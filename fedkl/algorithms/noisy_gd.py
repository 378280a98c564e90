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
from dataclasses import dataclass, field
from typing import Callable

import torch

from fedkl.algorithms.registry import AlgorithmResult, BuildContext, Clip, Rounds, StepSize, register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation
from fedkl.privacy.guarantee import ZERO_SUMS, Guarantee
from fedkl.privacy.release import Releaser

RELATIONS = ("replace-one", "add-remove")


@dataclass(frozen=True)
class NoisyGDConfig:
    rounds: int = 30
    lr: float = 1.0
    clip: float = 1.0
    neighbouring: str = "replace-one"
    radius: float | None = None
    output: str = "last"

    def __post_init__(self) -> None:
        if int(self.rounds) != self.rounds or self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be finite and > 0, got {self.lr}")
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ValueError(f"clip must be finite and > 0, got {self.clip}")
        if self.neighbouring not in RELATIONS:
            raise ValueError(f"neighbouring must be one of {RELATIONS}, got {self.neighbouring!r}")
        if self.radius is not None and not (self.radius > 0):
            raise ValueError(f"radius must be > 0, got {self.radius}")
        if self.output not in ("last", "average"):
            raise ValueError(f"output must be 'last' or 'average', got {self.output!r}")

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the round sum S_t under the chosen relation."""
        return 2.0 * self.clip if self.neighbouring == "replace-one" else self.clip


@dataclass
class NoisyGDResult(AlgorithmResult):
    w: torch.Tensor
    rho_spent: float
    rounds: int
    sigma: float
    history: list[dict] = field(default_factory=list)


def _project(w: torch.Tensor, radius: float | None) -> torch.Tensor:
    if radius is None:
        return w
    norm = float(w.norm())
    return w if norm <= radius else w * (radius / norm)


class NoisyGradientDescent:
    """See the module docstring. ``rho_total`` is split evenly over the rounds."""

    name = "noisy-gd"
    # every release's number, order, label, typed charge and cohort follow from public values only (the
    # config, n, the user ids, a public seed), never from the data or an earlier release: a plan made before
    # the data is this run's, so `fedkl run` prepays it (fedkl.runner, PREPAID_NOTE)
    plan_is_public = True
    guarantee = Guarantee("zcdp")

    def __init__(self, config: NoisyGDConfig, rho_total: float) -> None:
        if not (rho_total > 0 and math.isfinite(rho_total)):
            raise ValueError(f"rho_total must be finite and > 0, got {rho_total}")
        self.config = config
        self.rho_total = float(rho_total)

    def plan_schedule(self) -> tuple[int, Callable[[int], str]]:
        """The plan as a schedule (fedkl.runner._ScheduleCut): one release a round, each with the first's
        charge and cohort (every user, rho_total / rounds), labelled by its round."""
        return self.config.rounds, lambda k: f"{self.name}/round-{k}"

    @property
    def rho_per_round(self) -> float:
        return self.rho_total / self.config.rounds

    @property
    def sigma(self) -> float:
        return self.config.sensitivity / math.sqrt(2.0 * self.rho_per_round)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> NoisyGDResult:
        cfg = self.config
        n = federation.num_users
        users = list(range(n))
        user_ids = federation.ids_of(users)
        w = w0.clone()
        avg = torch.zeros_like(w)
        log = RoundLog(cfg.rounds, progress)
        spent = 0.0
        for t in range(cfg.rounds):
            start = time.perf_counter()
            answers = federation.sum(ClippedGradient(w, cfg.clip), users)
            noisy_sum = releaser.gaussian(
                answers.total(),
                sensitivity=cfg.sensitivity,
                rho=self.rho_per_round,
                user_ids=user_ids,
                label=f"{self.name}/round-{t}",
                details={"round": t, "clip": cfg.clip, "neighbouring": cfg.neighbouring, "failed": len(answers.failed)},
            )
            spent += self.rho_per_round
            w = _project(w - cfg.lr * noisy_sum.to(w.dtype) / n, cfg.radius)
            avg += (w - avg) / (t + 1)
            log.round(t + 1, start, len(answers.failed), noisy_grad_norm=float(noisy_sum.norm()) / n, rho_spent=spent)
        out = w if cfg.output == "last" else avg
        return NoisyGDResult(w=out, rho_spent=spent, rounds=cfg.rounds, sigma=self.sigma, history=log.history)


@dataclass(frozen=True)
class NoisyGDParams(Rounds, StepSize, Clip):
    """noisy-gd: every user every round; the run's zCDP budget split evenly over the rounds."""


@register("noisy-gd", NoisyGDParams, step_size=4.0, secagg=True, absence=ZERO_SUMS)
def build_noisy_gd(params: NoisyGDParams, ctx: BuildContext) -> NoisyGradientDescent:
    """Noisy full-batch gradient descent over users with per-user clipping (zCDP)."""
    return NoisyGradientDescent(
        NoisyGDConfig(rounds=params.rounds, lr=params.lr, clip=params.clip, neighbouring=ctx.neighbouring), ctx.rho_left
    )
