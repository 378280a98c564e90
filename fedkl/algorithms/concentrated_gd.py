"""Noisy GD with a user-level winsorized mean of the gradients (Levy et al. 2021): users with m records
each pay a clip radius ~ C/sqrt(m) instead of C (zCDP, user level).

Round t, all n users, per-user mean gradients ``g_u = grad f_u(w_t)`` (one ``GradientsAtPoints``
request; the server computes everything below from the answers):

    stage 1 (private centre)  S1 = sum_u clip_C(g_u),     c_t = (S1 + N(0, s1^2 I)) / n
    stage 2 (winsorized mean) S2 = sum_u clip_tau(g_u - c_t),  g~_t = c_t + (S2 + N(0, s2^2 I)) / n
    w_t+1 = w_t - lr * g~_t

``clip_r(v) = v min(1, r/||v||)``, so ``c_t + clip_tau(g_u - c_t)`` is the projection of ``g_u`` onto
the ball B(c_t, tau) (Levy, Sun, Amin, Kale, Kulesza, Mohri, Suresh 2021, "Learning with user-level
privacy": a private centre, then every user's mean projected onto a ball around it, then Gaussian
noise). Stage 1's centre is the noisy-gd release (:mod:`fedkl.algorithms.noisy_gd`) at a share of the
round's budget; Levy et al. use a coordinatewise private histogram instead (see "Missing" below).

Privacy (user level, rho-zCDP with ``rho = sum_t (rho1_t + rho2_t)``; ``--conc-centre-share`` s splits
each round's rho_t = rho/T into rho1 = s rho_t and rho2 = (1 - s) rho_t):

* Stage 1 is noisy-gd's round: every term has norm <= C, so replacing one user's records moves S1 by
  at most ``Delta1 = 2C`` (add-remove: C); ``s1 = Delta1 / sqrt(2 rho1)``: rho1-zCDP.
* Stage 2, given c_t. c_t is a function of stage 1's release only (post-processing), so for the
  analysis of stage 2 it is a fixed public vector. Every term ``clip_tau(g_u - c_t)`` has norm <= tau
  whatever g_u is, so replacing one user moves S2 by at most ``Delta2 = 2 tau`` (add-remove: tau; the
  estimate divides by the public enrolled n, never by a count); ``s2 = Delta2 / sqrt(2 rho2)``:
  rho2-zCDP. Adaptive composition of zCDP: the round is (rho1 + rho2)-zCDP; over T rounds rho. Both
  releases are charged to the ledger before they are made (two ``GaussianCharge``, labels
  ``noisy-gd-conc/round-t/centre`` and ``.../winsorized``).
* tau is a public function of public values only (C, the declared m, beta, n, d, rho1): never of the
  records, nor of any client's report. A missing or non-finite answer contributes 0 to S1 and the
  zero displacement (the centre itself) to S2: both inside their balls.
* Any client behaviour: the clipping and the projection are done on the SERVER from the per-user
  answers, so a client that lies about its gradient can only choose its own point inside the ball;
  the sensitivities above hold for arbitrary answers (tests: adversarial replace-one neighbours
  attain 2 tau exactly and never exceed it).
* What clients see: the current model w_t, computed from earlier releases (private, as noisy-gd).
  The server sees every user's unclipped mean gradient (central DP, trusted server; no secure
  aggregation of the per-user answers is possible here).

Utility (why tau ~ 1/sqrt(m)). If every record gradient has norm <= G (take G = C: a G-Lipschitz
loss with the clip set at G, so clip_C changes nothing) and user u's m records are i.i.d. with mean
mu, then E||g_u - mu|| <= G/sqrt(m) and, by McDiarmid (one record moves ||g_u - mu|| by <= 2G/m),
``||g_u - mu|| <= r = G (1 + sqrt(2 ln(n/beta))) / sqrt(m)`` for all n users with probability >= 1 - beta
at a fixed w. The centre's noise satisfies ``||N(0, s1^2 I_d)|| / n <= e = s1 (sqrt(d) + sqrt(2 ln(1/beta))) / n``
with probability >= 1 - beta (Gaussian norm concentration). Then
``||g_u - c_t|| <= ||g_u - mu|| + ||mu - mean_u g_u|| + e <= 2r + e``: with

    tau = k C / sqrt(m) + e,   k = 2 (1 + sqrt(2 ln(n/beta)))   (``--conc-scale`` overrides k)

no user is projected, the estimate is unbiased, and its noise is ``s2 sqrt(d)/n ~ tau sqrt(d)/(n sqrt(rho2))``,
a factor ~ tau/C below noisy-gd's whenever the centre's error e is small against k C/sqrt(m) (many users).
The bound is at a fixed w; the iterates depend on the data, so along the run it is a heuristic (the
default k is the fixed-w theorem's constant; a smaller k is a tuning choice: tau never enters the
privacy proof beyond being public).

When concentration fails (non-IID users, fewer than m records, heavy-tailed gradients), users outside
B(c_t, tau) are projected onto it: their pull is shortened, which BIASES the gradient estimate towards
the centre; it never costs privacy (the sensitivity is 2 tau for any data). m is declared, public
(``--conc-records``): a user with fewer records is not refused, it is just less concentrated.

Missing: Levy et al.'s centre is a private coordinatewise histogram in a randomly rotated basis,
whose error does not grow like sqrt(d)/n; the noisy-mean centre here needs n large enough that e is
below the concentration radius (the regime where noisy-gd is already accurate), and then buys a
further factor ~ sqrt(m) in noise.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from fedkl.algorithms.noisy_gd import RELATIONS
from fedkl.algorithms.registry import (
    AlgorithmResult,
    BuildContext,
    Clip,
    Rounds,
    StepSize,
    param,
    register,
)
from fedkl.federation.base import Federation, GradientsAtPoints
from fedkl.federation.clipping import clip_rows
from fedkl.privacy.guarantee import Guarantee
from fedkl.privacy.release import Releaser

NAME = "noisy-gd-conc"


def user_sum_sensitivity(bound: float, neighbouring: str) -> float:
    """L2 sensitivity of a sum of per-user terms of norm <= ``bound``: 2 bound (replace-one), bound
    (add-remove)."""
    if neighbouring not in RELATIONS:
        raise ValueError(f"neighbouring must be one of {RELATIONS}, got {neighbouring!r}")
    return 2.0 * bound if neighbouring == "replace-one" else bound


def winsorized_sum(grads: torch.Tensor, centre: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_u clip_tau(g_u - centre), mask of non-finite rows)``: the users' displacements from the
    centre, each projected onto the ball of radius tau (a non-finite row contributes zero, i.e. sits
    at the centre). Each term has norm <= tau whatever the row is."""
    displacements, bad = clip_rows(grads - centre.unsqueeze(0), tau)
    return displacements.sum(0), bad


@dataclass(frozen=True)
class ConcentratedGDConfig:
    rounds: int = 30
    lr: float = 1.0
    clip: float = 1.0
    records: int = 1
    scale: float | None = None
    beta: float = 0.05
    centre_share: float = 0.5
    neighbouring: str = "replace-one"

    def __post_init__(self) -> None:
        if int(self.rounds) != self.rounds or self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds}")
        for name in ("lr", "clip"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        if int(self.records) != self.records or self.records < 1:
            raise ValueError(f"--conc-records must be a positive integer, got {self.records}")
        if self.scale is not None and not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"--conc-scale must be finite and > 0, got {self.scale}")
        if not 0 < self.beta < 1:
            raise ValueError(f"--conc-beta must be in (0, 1), got {self.beta}")
        if not 0 < self.centre_share < 1:
            raise ValueError(f"--conc-centre-share must be in (0, 1), got {self.centre_share}")
        user_sum_sensitivity(1.0, self.neighbouring)


@dataclass
class ConcentratedGDResult(AlgorithmResult):
    w: torch.Tensor
    rho_spent: float
    rounds: int
    sigma: list[float]
    details: dict
    history: list[dict] = field(default_factory=list)


class ConcentratedGD:
    """See the module docstring. ``rho_total`` is split evenly over the rounds, each round's share
    between the centre (``centre_share``) and the winsorized mean."""

    name = NAME
    guarantee = Guarantee("zcdp")

    def __init__(self, config: ConcentratedGDConfig, rho_total: float, num_users: int, dim: int) -> None:
        if not (rho_total > 0 and math.isfinite(rho_total)):
            raise ValueError(f"rho_total must be finite and > 0, got {rho_total}")
        if num_users < 1 or dim < 1:
            raise ValueError(f"need at least one user and one parameter, got n={num_users}, d={dim}")
        self.config = config
        self.rho_total = float(rho_total)
        self.num_users = int(num_users)
        self.dim = int(dim)

    @property
    def rho_centre(self) -> float:
        return self.config.centre_share * self.rho_total / self.config.rounds

    @property
    def rho_winsorized(self) -> float:
        return (1.0 - self.config.centre_share) * self.rho_total / self.config.rounds

    @property
    def sensitivity_centre(self) -> float:
        return user_sum_sensitivity(self.config.clip, self.config.neighbouring)

    @property
    def sigma_centre(self) -> float:
        return self.sensitivity_centre / math.sqrt(2.0 * self.rho_centre)

    @property
    def scale(self) -> float:
        """k in tau = k C / sqrt(m) + e: ``--conc-scale``, else the fixed-w theorem's 2 (1 + sqrt(2 ln(n/beta)))."""
        cfg = self.config
        if cfg.scale is not None:
            return cfg.scale
        return 2.0 * (1.0 + math.sqrt(2.0 * math.log(self.num_users / cfg.beta)))

    @property
    def centre_error(self) -> float:
        """e: a bound on the centre's noise norm / n, holding with probability >= 1 - beta."""
        return (
            self.sigma_centre
            * (math.sqrt(self.dim) + math.sqrt(2.0 * math.log(1.0 / self.config.beta)))
            / self.num_users
        )

    @property
    def tau(self) -> float:
        """The projection radius: public (C, m, beta, n, d, rho only)."""
        cfg = self.config
        return self.scale * cfg.clip / math.sqrt(cfg.records) + self.centre_error

    @property
    def sensitivity_winsorized(self) -> float:
        return user_sum_sensitivity(self.tau, self.config.neighbouring)

    @property
    def sigma_winsorized(self) -> float:
        return self.sensitivity_winsorized / math.sqrt(2.0 * self.rho_winsorized)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> ConcentratedGDResult:
        cfg = self.config
        n = federation.num_users
        if n != self.num_users or federation.num_params != self.dim:
            raise ValueError(
                f"{self.name} was built for n={self.num_users}, d={self.dim}; the federation has "
                f"n={n}, d={federation.num_params} (nothing was read or charged)"
            )
        users = list(range(n))
        user_ids = federation.ids_of(users)
        tau = self.tau
        w = w0.clone()
        history: list[dict] = []
        spent = 0.0
        for t in range(cfg.rounds):
            start = time.perf_counter()
            answers = federation.compute(GradientsAtPoints(w.unsqueeze(0)), users)
            grads = answers.values[:, 0, :].to(w.dtype)
            clipped, _ = clip_rows(grads, cfg.clip)
            common = {"round": t, "neighbouring": cfg.neighbouring, "failed": len(answers.failed)}
            noisy_centre_sum = releaser.gaussian(
                clipped.sum(0),
                sensitivity=self.sensitivity_centre,
                rho=self.rho_centre,
                user_ids=user_ids,
                label=f"{self.name}/round-{t}/centre",
                details={**common, "clip": cfg.clip},
            )
            centre = noisy_centre_sum.to(w.dtype) / n  # a function of stage 1's release only
            displacement, _ = winsorized_sum(grads, centre, tau)
            noisy_displacement = releaser.gaussian(
                displacement,
                sensitivity=self.sensitivity_winsorized,
                rho=self.rho_winsorized,
                user_ids=user_ids,
                label=f"{self.name}/round-{t}/winsorized",
                details={**common, "tau": tau},
            )
            spent += self.rho_centre + self.rho_winsorized
            grad = centre + noisy_displacement.to(w.dtype) / n
            w = w - cfg.lr * grad
            record = {
                "round": t + 1,
                "rounds": cfg.rounds,
                "noisy_grad_norm": float(grad.norm()),
                "rho_spent": spent,
                "failed_users": len(answers.failed),
                "seconds": time.perf_counter() - start,
            }
            history.append(record)
            if progress is not None:
                progress(record)
        details = {"tau": tau, "scale": self.scale, "centre_error_bound": self.centre_error, "records": cfg.records}
        return ConcentratedGDResult(
            w=w,
            rho_spent=spent,
            rounds=cfg.rounds,
            sigma=[self.sigma_centre, self.sigma_winsorized],
            details=details,
            history=history,
        )


@dataclass(frozen=True)
class ConcentratedGDParams(Rounds, StepSize, Clip):
    """noisy-gd-conc: every user every round; two Gaussian releases per round (centre, winsorized mean)."""

    conc_records: int = param(
        1,
        "noisy-gd-conc: the public number m of records every user holds (declared, never read from the data; "
        "a user with fewer is less concentrated: bias, not privacy loss); the projection radius is ~ C/sqrt(m)",
        "heuristic",
        positive=True,
    )
    conc_scale: float | None = param(
        None,
        "noisy-gd-conc: k in the projection radius tau = k C/sqrt(m) + (centre noise bound) (default: the "
        "concentration theorem's 2 (1 + sqrt(2 ln(n/beta))) at a fixed model)",
        "theorem",
    )
    conc_beta: float = param(
        0.05, "noisy-gd-conc: failure probability beta of the concentration and centre-noise bounds in tau", "theorem"
    )
    conc_centre_share: float = param(
        0.5, "noisy-gd-conc: share of each round's zCDP budget spent on the private centre", "heuristic"
    )


@register(NAME, ConcentratedGDParams, step_size=4.0)
def build_concentrated_gd(params: ConcentratedGDParams, ctx: BuildContext) -> ConcentratedGD:
    """Noisy GD over users with a winsorized mean: gradients projected onto a ball of radius ~C/sqrt(m) around a private centre (zCDP)."""
    config = ConcentratedGDConfig(
        rounds=params.rounds,
        lr=params.lr,
        clip=params.clip,
        records=params.conc_records,
        scale=params.conc_scale,
        beta=params.conc_beta,
        centre_share=params.conc_centre_share,
        neighbouring=ctx.neighbouring,
    )
    return ConcentratedGD(config, ctx.rho_left, ctx.num_users, ctx.problem.num_params)


__all__ = [
    "ConcentratedGD",
    "ConcentratedGDConfig",
    "ConcentratedGDParams",
    "ConcentratedGDResult",
    "user_sum_sensitivity",
    "winsorized_sum",
]
