"""User-level DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018; the TensorFlow Federated DP tutorial).

Round t = 1..T:

    sample users: Poisson with rate q (secure randomness; q = 1 means everyone)
    each sampled user u: h_u = clip_C(w_u^K - w_t)   after K local SGD steps from w_t on its own records
                                                      (query :class:`~fedkl.federation.base.ClippedLocalUpdate`)
    S_t     = sum_{sampled u} h_u                      (re-clipped on the server: see below)
    Delta_t = (S_t + N(0, sigma^2 I)) / (q n)          (fixed public denominator, never the realised count)
    v_t     = beta v_{t-1} + Delta_t                   (server momentum beta; 0 = plain FedAvg)
    w_{t+1} = w_t + server_lr * v_t

This is the unweighted DP-FedAvg recipe of TFF (``build_unweighted_fed_avg`` with a fixed-clip
Gaussian aggregator: every user weighs the same, which is what keeps the sensitivity at C).
**DP-FedSGD is the case K = 1**: with ``local_lr = 1`` the answer is ``-clip_C(grad f_u(w_t))``
and the step is exactly fedkl's ``dp-sgd`` (:mod:`fedkl.algorithms.gradient.dp_adaptive`, optimizer "sgd",
``lr = server_lr``; the noise is symmetric, so the two have the same distribution); with
``local_lr = eta`` it is ``dp-sgd`` with clip ``C / eta`` and ``lr = eta * server_lr``.

Guarantee: user-level (eps, delta)-DP of the whole schedule of T releases, each a Gaussian of noise
multiplier ``z = sigma / Delta`` on the sum of per-user answers of norm <= C (Delta = C add-remove
with Poisson amplification, 2C replace-one with q = 1), calibrated by dp-accounting and charged to
every enrolled user before the first release; the same accounting as
:mod:`fedkl.algorithms.gradient.dp_adaptive`, stated in full in :mod:`fedkl.algorithms.gradient.poisson_schedule`.
What is private: the released noisy sums, hence every iterate, the momentum and the
final model (post-processing). What a sampled client sees: the current model w_t (a private
output) and the local-training hyperparameters. The server sees each sampled user's clipped
delta in the clear (central DP: the server is trusted; no secure aggregation here).

Adaptive clipping (``adaptive_clip=True``, off by default): the clip follows a private
``clip_quantile``-quantile of the update norms (Andrew et al. 2021), starting from ``clip``; the
indicator count is released with the update in the same Gaussian of the same schedule, with its own
effective noise ``clip_count_noise``; :mod:`fedkl.algorithms.gradient.adaptive_clip` states the release and proves
its sensitivity. The privacy guarantee is the one above with per-user norm bound
``r = sqrt(1 + a^2/4)`` in units of the round's clip (Delta = r add-remove, 2r replace-one).
Settings where no count scale ``a`` exists (``clip_count_noise <= z/2``, ``<= z`` replace-one) are
refused before anything is read or charged. The fixed clip stays the default: on MovieLens
(logistic, eps = 2, the README's dp-fedavg settings) adaptive clipping was not better (README).

Server-side re-clip: each per-user answer is clipped to C again on the server before summing. For
an honest client this changes nothing (a row already inside the ball is returned bit for bit by
``clip_rows``); it keeps the sensitivity bound even if a transport does not check the norm of this
query type (Flower's :class:`~fedkl.flower.federation.FlowerFederation` checks it only for clipped
gradients).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fedkl.algorithms.contract import (
    BuildContext,
    Clip,
    PoissonSampling,
    Rounds,
    SmallAudit,
    StepSize,
    param,
)
from fedkl.algorithms.gradient import adaptive_clip
from fedkl.algorithms.gradient.local_updates import LocalUpdates
from fedkl.algorithms.gradient.poisson_schedule import (
    SCHEDULED,
    PoissonScheduledRun,
    ScheduledAlgorithm,
    ScheduleResult,
    check_sampling_rate,
)
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import Federation
from fedkl.federation.clipping import clip_rows
from fedkl.privacy.guarantee import ZERO_SUMS
from fedkl.privacy.release import Releaser


@dataclass(frozen=True)
class DPFedAvgParams(Rounds, StepSize, Clip, PoissonSampling, LocalUpdates):
    server_momentum: float = param(0.0, "dp-fedavg: server momentum (0 = plain FedAvg)", "heuristic")
    adaptive_clip: bool = param(
        False,
        "dp-fedavg: adapt the clip to a private quantile of the update norms (Andrew et al. 2021), "
        "starting from --clip (default: the fixed clip)",
        "heuristic",
    )
    clip_quantile: float = param(0.5, "dp-fedavg --adaptive-clip: target quantile gamma of the update norms")
    clip_lr: float = param(0.2, "dp-fedavg --adaptive-clip: geometric clip learning rate eta_C", positive=True)
    clip_count_noise: float | None = param(
        None,
        "dp-fedavg --adaptive-clip: noise std sigma_b of the count of unclipped updates "
        "(default: expected cohort q n / 20, Andrew et al.)",
        positive=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sampling_rate(self.sampling_rate)
        if not 0 <= self.server_momentum < 1:
            raise ValueError(f"--server-momentum must be in [0, 1), got {self.server_momentum}")
        if self.adaptive_clip:
            if not 0 < self.clip_quantile < 1:
                raise ValueError(f"--clip-quantile must be in (0, 1), got {self.clip_quantile}")
            # the clip moves by at most a factor exp(clip_lr) per round: keep every C_t a positive float
            span = self.clip_lr * self.rounds
            if span > 600 or self.clip * math.exp(-span) == 0 or not math.isfinite(self.clip * math.exp(span)):
                raise ValueError("--clip-lr x --rounds is too large: the adaptive clip could leave the float range")


DPFedAvgResult = ScheduleResult


@register
class DPFedAvg(ScheduledAlgorithm[DPFedAvgParams]):
    """DP-FedAvg: sampled users' clipped local updates, one (eps, delta) sampled-Gaussian schedule.

    See the module docstring. The budget is what every user can still afford, charged up front as one
    (eps, delta) schedule; ``local_lr`` None: the run's ``lr``; ``clip_count_noise`` None: the expected
    cohort q n / 20. The server step (momentum SGD on the noisy mean delta) is :meth:`server_step`, which
    a server-optimizer variant overrides (post-processing of the same releases)."""

    name = "dp-fedavg"
    Params = DPFedAvgParams
    absence = ZERO_SUMS
    step_size = 4.0
    # secure aggregation serves the fixed clip; adaptive clipping needs each user's indicator
    sums_only = staticmethod(lambda params: not params.adaptive_clip)
    float32 = True  # L2-clipped answers, float64 sums and noise (contract.Algorithm.float32)
    small = {**SCHEDULED, "local_steps": 2, "batch_size": 3}
    audit = SmallAudit()

    def __init__(self, params: DPFedAvgParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.local_lr = self.params.local_update_lr(self.params.lr)
        self.clip_count_noise = (
            params.sampling_rate * ctx.num_users / 20 if params.clip_count_noise is None else params.clip_count_noise
        )
        self.count_scale = None
        if params.adaptive_clip:  # refuse a setting without a count scale before anything is read
            z = self.schedule().noise_multiplier
            self.count_scale = adaptive_clip.count_scale(z, self.clip_count_noise, self.neighbouring)

    def server_state(self, w: torch.Tensor) -> dict:
        """The server optimizer's state before round 1 (``w``: the initial model)."""
        return {"velocity": torch.zeros_like(w)}

    def server_step(self, w: torch.Tensor, delta_t: torch.Tensor, state: dict) -> torch.Tensor:
        """The next model from the released noisy mean update ``delta_t`` (post-processing):
        ``v = beta v + delta_t``, ``w + server_lr v``."""
        state["velocity"] = self.params.server_momentum * state["velocity"] + delta_t
        return w + self.params.server_lr * state["velocity"]

    def server_details(self) -> dict:
        """The server optimizer's settings, for the result's details."""
        return {"server_lr": self.params.server_lr, "server_momentum": self.params.server_momentum}

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> DPFedAvgResult:
        cfg, local_lr = self.params, self.local_lr
        scale = self.count_scale
        adaptive = {} if scale is None else {"count_scale": scale, "clip_count_noise": self.clip_count_noise}
        run = PoissonScheduledRun(
            federation,
            releaser,
            self,
            # adaptive: each user's [h/C_t ; a c] has norm <= r (adaptive_clip's theorem), in units of C_t
            cfg.clip if scale is None else adaptive_clip.norm_bound(scale),
            {**cfg.local_details(), "local_lr": local_lr, **adaptive},
        )
        w = w0.clone()
        server = self.server_state(w)
        clip = cfg.clip
        log = RoundLog(cfg.rounds, progress)
        for t in range(1, cfg.rounds + 1):
            start = time.perf_counter()
            users = run.sample()
            total = torch.zeros(len(w) + (scale is not None), dtype=w.dtype)
            failed = 0
            query = cfg.query(w, clip, local_lr)
            if users and federation.sums_only and scale is None:
                # secure aggregation: the clients' clip bounds each user (fedkl.flower.secagg), no re-clip
                answers = federation.sum(query, users)
                total, failed = answers.total().to(w.dtype), len(answers.failed)
            elif users:
                answers = federation.compute(query, users)
                values = answers.values.to(w.dtype)
                if scale is None:
                    rows, _ = clip_rows(values, clip)  # server-side re-clip (docstring)
                else:
                    rows = adaptive_clip.contributions(values, clip, ~answers.answered(), scale)  # re-clipped there
                total = rows.sum(0)
                failed = len(answers.failed)
            released = run.release(total)
            extra = {}
            if scale is None:
                delta_t = released
            else:
                delta_t = clip * released[:-1]
                extra["clip"] = clip
                clip, extra["unclipped_fraction"] = adaptive_clip.next_clip(
                    clip, float(released[-1]), scale, cfg.clip_quantile, cfg.clip_lr
                )
            w = self.server_step(w, delta_t, server)
            log.round(t, start, failed, noisy_update_norm=float(delta_t.norm()), **extra, sampled=len(users))
        return run.result(
            w,
            log.history,
            {
                "neighbouring": self.neighbouring,
                **cfg.local_details(),
                "local_lr": local_lr,
                **self.server_details(),
                "fixed_denominator": run.denominator,
                "adaptive_clip": cfg.adaptive_clip,
                **(
                    {}
                    if scale is None
                    else {
                        **adaptive,
                        "clip_quantile": cfg.clip_quantile,
                        "clip_lr": cfg.clip_lr,
                        "final_clip": clip,
                        "sigma_unit": "the round's clip C_t (the model noise std is sigma * C_t)",
                    }
                ),
            },
        )
