"""User-level DP-SGD, DP-RMSProp and DP-Adam as server optimizers (paper 004, Zhou et al., Alg. 1).

Round t:

    sample users: Poisson with rate q (secure randomness; q = 1 means everyone)
    S_t  = sum_{sampled u} clip_C(grad f_u(w_t))               (federation)
    g~_t = (S_t + N(0, sigma^2 I)) / (q n)                       (fixed public denominator)
    m_t  = g~_t (SGD, RMSProp) or beta1 m_{t-1} + (1 - beta1) g~_t (Adam)
    psi_t = 1 (SGD) or beta2 psi_{t-1} + (1 - beta2) g~_t^2 (RMSProp, Adam);  v_t = min(psi_t, cap)
    w_{t+1} = w_t - lr * m_t / (sqrt(v_t) + nu)

**DP-AdamBC** (``dp-adambc``; Tang, Shpilevskiy, Lécuyer, AAAI 2024): Adam with both bias corrections,
whose second moment has the DP noise's per-coordinate variance Phi = (sigma / (q n))^2 subtracted:

    m^_t = m_t / (1 - beta1^t),  v^_t = psi_t / (1 - beta2^t)
    w_{t+1} = w_t - lr * m^_t / sqrt(max(v^_t - Phi, gamma'))

(E[g~^2] = E[g]^2 + Var + Phi per coordinate: without the correction the noise dominates v^ and
DP-Adam behaves like DP-SGD with a rescaled step). sigma is the schedule's public noise std and
q n the public denominator, so the correction is post-processing: dp-adambc has exactly the privacy
guarantee below, the same schedule and charge as dp-adam. gamma' (``adambc_floor``) replaces nu and
the cap.

As in the paper's corrected Algorithm 1 (../shared/notes/seed-004.md): EMAs start from zero and are
NOT bias-corrected by default (``bias_correction=True`` applies Adam's 1/(1 - beta^t) corrections,
flagged in the result); the cap on v keeps accumulated noise from freezing the step; the step has
the minus sign the paper's line 6 lost; nu is outside the square root.

Guarantee: user-level (eps, delta)-DP for the whole schedule of T releases, each a Gaussian of noise
multiplier z = sigma / Delta on the sum of clipped per-user gradients (Delta = C add-remove with
Poisson amplification, 2C replace-one with q = 1), calibrated by dp-accounting and charged to every
user before the first release: :mod:`fedkl.algorithms.gradient.poisson_schedule` states it in full. The
optimizer state and every iterate are post-processing of the released noisy sums.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fedkl.algorithms.gradient.poisson_schedule import (
    PoissonScheduledRun,
    ScheduleResult,
    calibrate,
    check_schedule_config,
    sum_sensitivity,
)
from fedkl.algorithms.registry import BuildContext, Clip, PoissonSampling, Rounds, StepSize, param, register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation
from fedkl.privacy.accounting import GaussianSchedule
from fedkl.privacy.guarantee import ZERO_SUMS, Guarantee
from fedkl.privacy.release import Releaser

OPTIMIZERS = ("sgd", "rmsprop", "adam", "adambc")


@dataclass(frozen=True)
class AdaptiveDPConfig:
    optimizer: str = "adam"
    rounds: int = 30
    lr: float = 0.05
    clip: float = 1.0
    sampling_rate: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    nu: float = 1e-3
    cap: float = math.inf
    bias_correction: bool = False
    adambc_floor: float = 1e-3
    neighbouring: str = "add-remove"
    accountant: str = "pld"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        check_schedule_config(self.rounds, self.sampling_rate, self.neighbouring, self.accountant)
        for name in ("lr", "clip", "nu", "cap", "adambc_floor"):
            v = getattr(self, name)
            if not v > 0 or math.isnan(v):
                raise ValueError(f"{name} must be > 0, got {v}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def sensitivity(self) -> float:
        return sum_sensitivity(self.clip, self.neighbouring)


AdaptiveDPResult = ScheduleResult


class AdaptiveDPOptimizer:
    """See the module docstring. ``eps``/``delta``: the user-level budget this run may charge."""

    guarantee = Guarantee("schedule")

    def __init__(self, config: AdaptiveDPConfig, eps: float, delta: float) -> None:
        if not (eps > 0 and math.isfinite(eps)) or not 0 < delta < 1:
            raise ValueError(f"need a finite eps > 0 and 0 < delta < 1, got eps={eps}, delta={delta}")
        self.config = config
        self.eps = eps
        self.delta = delta
        self.name = f"dp-{config.optimizer}"

    def schedule(self) -> GaussianSchedule:
        cfg = self.config
        z, _ = calibrate(self.eps, self.delta, cfg.sampling_rate, cfg.rounds, cfg.accountant)
        return GaussianSchedule(z, cfg.sampling_rate, cfg.rounds)

    def _direction(self, g: torch.Tensor, state: dict, t: int) -> torch.Tensor:
        """The step direction at round t from the released mean ``g``; ``state["noise_var"]`` is the
        release's public per-coordinate noise variance (sigma / (q n))^2."""
        cfg = self.config
        if cfg.optimizer == "sgd":
            return g
        if cfg.optimizer == "adambc":
            state["m"] = cfg.beta1 * state["m"] + (1 - cfg.beta1) * g
            state["psi"] = cfg.beta2 * state["psi"] + (1 - cfg.beta2) * g * g
            m_hat, v_hat = state["m"] / (1 - cfg.beta1**t), state["psi"] / (1 - cfg.beta2**t)
            return m_hat / torch.sqrt(torch.clamp(v_hat - state["noise_var"], min=cfg.adambc_floor))
        state["psi"] = cfg.beta2 * state["psi"] + (1 - cfg.beta2) * g * g
        psi = state["psi"] / (1 - cfg.beta2**t) if cfg.bias_correction else state["psi"]
        m = g
        if cfg.optimizer == "adam":
            state["m"] = cfg.beta1 * state["m"] + (1 - cfg.beta1) * g
            m = state["m"] / (1 - cfg.beta1**t) if cfg.bias_correction else state["m"]
        return m / (torch.sqrt(torch.clamp(psi, max=cfg.cap)) + cfg.nu)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> AdaptiveDPResult:
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
        )
        w = w0.clone()
        state = {"m": torch.zeros_like(w), "psi": torch.zeros_like(w), "noise_var": (run.sigma / run.denominator) ** 2}
        log = RoundLog(cfg.rounds, progress)
        for t in range(1, cfg.rounds + 1):
            start = time.perf_counter()
            users = run.sample()
            total = torch.zeros_like(w)
            failed = 0
            if users:
                answers = federation.sum(ClippedGradient(w, cfg.clip), users)
                total = answers.total().to(w.dtype)
                failed = len(answers.failed)
            g = run.release(total)
            w = w - cfg.lr * self._direction(g, state, t)
            log.round(t, start, failed, noisy_grad_norm=float(g.norm()), sampled=len(users))
        return run.result(
            w,
            log.history,
            {"optimizer": cfg.optimizer, **self._details(state)},
        )

    def _details(self, state: dict) -> dict:
        cfg = self.config
        if cfg.optimizer == "adambc":
            return {"bias_correction": True, "adambc_floor": cfg.adambc_floor, "noise_variance": state["noise_var"]}
        return {"bias_correction": cfg.bias_correction, "cap": cfg.cap, "nu": cfg.nu}


@dataclass(frozen=True)
class AdamMoments(Rounds, StepSize, Clip, PoissonSampling):
    beta1: float = param(0.9, "dp-adam/adambc: first-moment decay", "heuristic")
    beta2: float = param(0.999, "dp-rmsprop/adam/adambc: second-moment decay", "heuristic")


@dataclass(frozen=True)
class AdaptiveDPParams(AdamMoments):
    nu: float = param(1e-3, "dp-rmsprop/adam: denominator offset", "heuristic", positive=True)
    cap: float = param(
        math.inf,
        "dp-rmsprop/adam: cap on the second moment v (paper 004's lambda; default none)",
        "heuristic",
        positive=True,
    )
    bias_correction: bool = param(False, "dp-adam/rmsprop: Adam's bias correction (paper 004: off)", "heuristic")


@dataclass(frozen=True)
class DPAdamBCParams(AdamMoments):
    adambc_floor: float = param(
        1e-3,
        "dp-adambc: floor gamma' on the noise-corrected second moment max(v - Phi, gamma'); a coordinate's "
        "step is at most lr |m| / sqrt(gamma'), so choose it with --lr (1e-3 suits lr 0.05 at clip 1)",
        "heuristic",
        positive=True,
    )


def _config(optimizer: str, params: AdamMoments, ctx: BuildContext, **extra) -> AdaptiveDPConfig:
    return AdaptiveDPConfig(
        optimizer=optimizer,
        rounds=params.rounds,
        lr=params.lr,
        clip=params.clip,
        sampling_rate=params.sampling_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        neighbouring=ctx.neighbouring,
        accountant=params.accountant,
        **extra,
    )


def _adaptive(optimizer: str, step_size: float):
    def build(params: AdaptiveDPParams, ctx: BuildContext) -> AdaptiveDPOptimizer:
        eps, delta = ctx.approx_budget()
        config = _config(optimizer, params, ctx, nu=params.nu, cap=params.cap, bias_correction=params.bias_correction)
        return AdaptiveDPOptimizer(config, eps, delta)

    build.__name__ = f"build_dp_{optimizer}"
    build.__doc__ = f"DP-{optimizer.upper()} (paper 004): Poisson-sampled users, one (eps, delta) Gaussian schedule."
    return register(f"dp-{optimizer}", AdaptiveDPParams, step_size=step_size, secagg=True, absence=ZERO_SUMS)(build)


# default step sizes: simulations/studies/tune_step_sizes.toml (public tuning data; README "Default step sizes")
build_dp_sgd = _adaptive("sgd", 4.0)
build_dp_rmsprop = _adaptive("rmsprop", 0.01)
build_dp_adam = _adaptive("adam", 0.03)


# step size: dp-adam's tuned value (dp-adambc was not tuned separately)
@register("dp-adambc", DPAdamBCParams, step_size=0.03, secagg=True, absence=ZERO_SUMS)
def build_dp_adambc(params: DPAdamBCParams, ctx: BuildContext) -> AdaptiveDPOptimizer:
    """DP-AdamBC (Tang et al. 2024): DP-Adam minus the noise variance in v; the same schedule as dp-adam."""
    eps, delta = ctx.approx_budget()
    return AdaptiveDPOptimizer(_config("adambc", params, ctx, adambc_floor=params.adambc_floor), eps, delta)
