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

from fedkl.algorithms.gradient import adaptive_clip
from fedkl.algorithms.gradient.poisson_schedule import (
    PoissonScheduledRun,
    ScheduleResult,
    calibrate,
    check_schedule_config,
    sum_sensitivity,
)
from fedkl.algorithms.registry import (
    AlgorithmParams,
    BuildContext,
    Clip,
    PoissonSampling,
    Rounds,
    StepSize,
    param,
    register,
)
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedLocalUpdate, Federation
from fedkl.federation.clipping import clip_rows
from fedkl.privacy.accounting import GaussianSchedule
from fedkl.privacy.guarantee import ZERO_SUMS, Guarantee
from fedkl.privacy.release import Releaser


@dataclass(frozen=True)
class DPFedAvgConfig:
    """Hyperparameters. ``batch_size=None``: each local step uses all of the user's records."""

    rounds: int = 30
    clip: float = 1.0
    sampling_rate: float = 1.0
    local_steps: int = 5
    local_lr: float = 0.5
    batch_size: int | None = None
    server_lr: float = 1.0
    server_momentum: float = 0.0
    neighbouring: str = "add-remove"
    accountant: str = "pld"
    adaptive_clip: bool = False
    clip_quantile: float = 0.5
    clip_lr: float = 0.2
    clip_count_noise: float | None = None  # required with adaptive_clip (the builder: q n / 20)

    def __post_init__(self) -> None:
        check_schedule_config(self.rounds, self.sampling_rate, self.neighbouring, self.accountant)
        if self.adaptive_clip:
            if not 0 < self.clip_quantile < 1:
                raise ValueError(f"clip_quantile must be in (0, 1), got {self.clip_quantile}")
            if not (self.clip_lr > 0 and math.isfinite(self.clip_lr)):
                raise ValueError(f"clip_lr must be finite and > 0, got {self.clip_lr}")
            if self.clip_count_noise is None or not (
                self.clip_count_noise > 0 and math.isfinite(self.clip_count_noise)
            ):
                raise ValueError(f"clip_count_noise must be finite and > 0, got {self.clip_count_noise}")
            # the clip moves by at most a factor exp(clip_lr) per round: keep every C_t a positive float
            span = self.clip_lr * self.rounds
            if span > 600 or self.clip * math.exp(-span) == 0 or not math.isfinite(self.clip * math.exp(span)):
                raise ValueError("clip_lr * rounds is too large: the adaptive clip could leave the float range")
        for name in ("clip", "local_lr", "server_lr"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        if not 0 <= self.server_momentum < 1:
            raise ValueError(f"server_momentum must be in [0, 1), got {self.server_momentum}")
        # the query validates local_steps and batch_size with the same rules the clients apply
        ClippedLocalUpdate(torch.zeros(1), self.clip, self.local_steps, self.local_lr, self.batch_size)

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the released sum under the configured relation, with the fixed clip
        (adaptive clipping releases a normalised vector: :mod:`fedkl.algorithms.gradient.adaptive_clip`)."""
        return sum_sensitivity(self.clip, self.neighbouring)


DPFedAvgResult = ScheduleResult


class DPFedAvg:
    """See the module docstring. ``eps``/``delta``: the user-level budget this run may charge."""

    name = "dp-fedavg"
    # every release's number, order, label, typed charge and cohort follow from public values only (the
    # config, n, the user ids, a public seed), never from the data or an earlier release: a plan made before
    # the data is this run's, so `fedkl run` prepays it (fedkl.runner, PREPAID_NOTE)
    plan_is_public = True
    guarantee = Guarantee("schedule")

    def __init__(self, config: DPFedAvgConfig, eps: float, delta: float) -> None:
        if not (eps > 0 and math.isfinite(eps)) or not 0 < delta < 1:
            raise ValueError(f"need a finite eps > 0 and 0 < delta < 1, got eps={eps}, delta={delta}")
        self.config = config
        self.eps = eps
        self.delta = delta
        self.count_scale = None
        if config.adaptive_clip:  # refuse a setting without a count scale before anything is read
            z = self.schedule().noise_multiplier
            self.count_scale = adaptive_clip.count_scale(z, config.clip_count_noise, config.neighbouring)

    def schedule(self) -> GaussianSchedule:
        """The T-fold (subsampled) Gaussian schedule calibrated to (eps, delta) by dp-accounting."""
        cfg = self.config
        z, _ = calibrate(self.eps, self.delta, cfg.sampling_rate, cfg.rounds, cfg.accountant)
        return GaussianSchedule(z, cfg.sampling_rate, cfg.rounds)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> DPFedAvgResult:
        cfg = self.config
        scale = self.count_scale
        adaptive = {} if scale is None else {"count_scale": scale, "clip_count_noise": cfg.clip_count_noise}
        run = PoissonScheduledRun(
            federation,
            releaser,
            name=self.name,
            eps=self.eps,
            delta=self.delta,
            # adaptive: each user's [h/C_t ; a c] has norm <= r (adaptive_clip's theorem), in units of C_t
            clip=cfg.clip if scale is None else adaptive_clip.norm_bound(scale),
            sampling_rate=cfg.sampling_rate,
            rounds=cfg.rounds,
            neighbouring=cfg.neighbouring,
            accountant=cfg.accountant,
            details={"local_steps": cfg.local_steps, "local_lr": cfg.local_lr, **adaptive},
        )
        w = w0.clone()
        velocity = torch.zeros_like(w)
        clip = cfg.clip
        log = RoundLog(cfg.rounds, progress)
        for t in range(1, cfg.rounds + 1):
            start = time.perf_counter()
            users = run.sample()
            total = torch.zeros(len(w) + (scale is not None), dtype=w.dtype)
            failed = 0
            query = ClippedLocalUpdate(w, clip, cfg.local_steps, cfg.local_lr, cfg.batch_size)
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
            velocity = cfg.server_momentum * velocity + delta_t
            w = w + cfg.server_lr * velocity
            log.round(t, start, failed, noisy_update_norm=float(delta_t.norm()), **extra, sampled=len(users))
        return run.result(
            w,
            log.history,
            {
                "neighbouring": cfg.neighbouring,
                "local_steps": cfg.local_steps,
                "local_lr": cfg.local_lr,
                "batch_size": cfg.batch_size,
                "server_lr": cfg.server_lr,
                "server_momentum": cfg.server_momentum,
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


@dataclass(frozen=True)
class LocalUpdates(AlgorithmParams):
    """The clipped local-update query's settings (DP-FedAvg and DP-FTRL ask the same query)."""

    local_steps: int = param(
        5, "dp-fedavg, dp-ftrl: local SGD steps K per asked user (K = 1 with local lr 1 is DP-FedSGD)", "heuristic"
    )
    local_lr: float | None = param(None, "dp-fedavg, dp-ftrl: local step size (default --lr)", "heuristic")
    batch_size: int | None = param(
        None, "dp-fedavg, dp-ftrl: records per local step, cyclic mini-batches (default all records)", "heuristic"
    )
    server_lr: float = param(1.0, "dp-fedavg, dp-ftrl: server step size on the noisy mean delta", "heuristic")


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


@register("dp-fedavg", DPFedAvgParams, step_size=4.0, secagg=lambda p: not p.adaptive_clip, absence=ZERO_SUMS)
def build_dp_fedavg(params: DPFedAvgParams, ctx: BuildContext) -> DPFedAvg:
    """DP-FedAvg: sampled users' clipped local updates, one (eps, delta) sampled-Gaussian schedule.

    The budget is what every user can still afford, charged up front as one (eps, delta) schedule;
    ``local_lr`` None: the run's ``lr``; ``clip_count_noise`` None: the expected cohort q n / 20."""
    eps, delta_left = ctx.approx_budget()
    config = DPFedAvgConfig(
        rounds=params.rounds,
        clip=params.clip,
        sampling_rate=params.sampling_rate,
        local_steps=params.local_steps,
        local_lr=params.lr if params.local_lr is None else params.local_lr,
        batch_size=params.batch_size,
        server_lr=params.server_lr,
        server_momentum=params.server_momentum,
        neighbouring=ctx.neighbouring,
        accountant=params.accountant,
        adaptive_clip=params.adaptive_clip,
        clip_quantile=params.clip_quantile,
        clip_lr=params.clip_lr,
        clip_count_noise=(
            params.sampling_rate * ctx.num_users / 20 if params.clip_count_noise is None else params.clip_count_noise
        ),
    )
    return DPFedAvg(config, eps, delta_left)
