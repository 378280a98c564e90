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
and the step is exactly fedkl's ``dp-sgd`` (:mod:`fedkl.algorithms.dp_adaptive`, optimizer "sgd",
``lr = server_lr``; the noise is symmetric, so the two have the same distribution); with
``local_lr = eta`` it is ``dp-sgd`` with clip ``C / eta`` and ``lr = eta * server_lr``.

Guarantee: user-level (eps, delta)-DP of the whole schedule of T releases, each a Gaussian of noise
multiplier ``z = sigma / Delta`` on the sum of per-user answers of norm <= C (Delta = C add-remove
with Poisson amplification, 2C replace-one with q = 1), calibrated by dp-accounting and charged to
every enrolled user before the first release; the same accounting as
:mod:`fedkl.algorithms.dp_adaptive`, stated in full in :mod:`fedkl.algorithms.poisson_schedule`.
What is private: the released noisy sums, hence every iterate, the momentum and the
final model (post-processing). What a sampled client sees: the current model w_t (a private
output) and the local-training hyperparameters. The server sees each sampled user's clipped
delta in the clear (central DP: the server is trusted; no secure aggregation here).

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

from fedkl.algorithms.poisson_schedule import (
    PoissonScheduledRun,
    ScheduleResult,
    calibrate,
    check_schedule_config,
    sum_sensitivity,
)
from fedkl.algorithms.registry import BuildContext, Clip, PoissonSampling, Rounds, StepSize, param, register
from fedkl.federation.base import ClippedLocalUpdate, Federation
from fedkl.federation.clipping import clip_rows
from fedkl.privacy.accounting import GaussianSchedule
from fedkl.privacy.guarantee import Guarantee
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

    def __post_init__(self) -> None:
        check_schedule_config(self.rounds, self.sampling_rate, self.neighbouring, self.accountant)
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
        """L2 sensitivity of the released sum under the configured relation."""
        return sum_sensitivity(self.clip, self.neighbouring)


DPFedAvgResult = ScheduleResult


class DPFedAvg:
    """See the module docstring. ``eps``/``delta``: the user-level budget this run may charge."""

    name = "dp-fedavg"
    guarantee = Guarantee("schedule")

    def __init__(self, config: DPFedAvgConfig, eps: float, delta: float) -> None:
        if not (eps > 0 and math.isfinite(eps)) or not 0 < delta < 1:
            raise ValueError(f"need a finite eps > 0 and 0 < delta < 1, got eps={eps}, delta={delta}")
        self.config = config
        self.eps = eps
        self.delta = delta

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
        run = PoissonScheduledRun(
            federation,
            releaser,
            name=self.name,
            eps=self.eps,
            delta=self.delta,
            clip=cfg.clip,
            sampling_rate=cfg.sampling_rate,
            rounds=cfg.rounds,
            neighbouring=cfg.neighbouring,
            accountant=cfg.accountant,
            details={"local_steps": cfg.local_steps, "local_lr": cfg.local_lr},
        )
        w = w0.clone()
        velocity = torch.zeros_like(w)
        history: list[dict] = []
        for t in range(1, cfg.rounds + 1):
            start = time.perf_counter()
            users = run.sample()
            total = torch.zeros_like(w)
            failed = 0
            if users:
                answers = federation.compute(
                    ClippedLocalUpdate(w, cfg.clip, cfg.local_steps, cfg.local_lr, cfg.batch_size), users
                )
                rows, _ = clip_rows(answers.values.to(w.dtype), cfg.clip)  # server-side re-clip (docstring)
                total = rows.sum(0)
                failed = len(answers.failed)
            delta_t = run.release(total)
            velocity = cfg.server_momentum * velocity + delta_t
            w = w + cfg.server_lr * velocity
            record = run.record(t, users, failed, start, noisy_update_norm=float(delta_t.norm()))
            history.append(record)
            if progress is not None:
                progress(record)
        return run.result(
            w,
            history,
            {
                "neighbouring": cfg.neighbouring,
                "local_steps": cfg.local_steps,
                "local_lr": cfg.local_lr,
                "batch_size": cfg.batch_size,
                "server_lr": cfg.server_lr,
                "server_momentum": cfg.server_momentum,
                "fixed_denominator": run.denominator,
            },
        )


@dataclass(frozen=True)
class DPFedAvgParams(Rounds, StepSize, Clip, PoissonSampling):
    local_steps: int = param(
        5, "dp-fedavg: local SGD steps K per sampled user (K = 1 with local lr 1 is DP-FedSGD)", "heuristic"
    )
    local_lr: float | None = param(None, "dp-fedavg: local step size (default --lr)", "heuristic")
    batch_size: int | None = param(
        None, "dp-fedavg: records per local step, cyclic mini-batches (default all records)", "heuristic"
    )
    server_lr: float = param(1.0, "dp-fedavg: server step size on the noisy mean delta", "heuristic")
    server_momentum: float = param(0.0, "dp-fedavg: server momentum (0 = plain FedAvg)", "heuristic")


@register("dp-fedavg", DPFedAvgParams, step_size=4.0)
def build_dp_fedavg(params: DPFedAvgParams, ctx: BuildContext) -> DPFedAvg:
    """DP-FedAvg: sampled users' clipped local updates, one (eps, delta) sampled-Gaussian schedule.

    The budget is what every user can still afford, charged up front as one (eps, delta) schedule;
    ``local_lr`` None: the run's ``lr``."""
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
    )
    return DPFedAvg(config, eps, delta_left)
