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

As in the paper's corrected Algorithm 1 (docs/derivations/paper-004.md): EMAs start from zero and are
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
from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, TypeVar

import torch

from fedkl.algorithms.contract import (
    Clip,
    PoissonSampling,
    Rounds,
    SmallAudit,
    StepSize,
    param,
)
from fedkl.algorithms.gradient.poisson_schedule import (
    SCHEDULED,
    PoissonScheduledRun,
    ScheduledAlgorithm,
    ScheduleResult,
    check_sampling_rate,
)
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation
from fedkl.privacy.guarantee import ZERO_SUMS
from fedkl.privacy.release import Releaser


@dataclass(frozen=True)
class AdamMoments(Rounds, StepSize, Clip, PoissonSampling):
    beta1: float = param(0.9, "dp-adam/adambc: first-moment decay", "heuristic")
    beta2: float = param(0.999, "dp-rmsprop/adam/adambc: second-moment decay", "heuristic")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sampling_rate(self.sampling_rate)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name} must be in [0, 1), got {getattr(self, name)}")


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


AdaptiveDPResult = ScheduleResult
P = TypeVar("P", bound=AdamMoments)


class AdaptiveDP(ScheduledAlgorithm[P]):
    """The schedule every optimizer of this module runs (module docstring); not registered: each
    subclass is one algorithm and says how it turns the released mean into a step (:meth:`direction`).
    The budget is the (eps, delta) every user can still afford, charged up front as one schedule."""

    optimizer: ClassVar[str]  # its result's "optimizer" detail
    absence = ZERO_SUMS
    sums_only = True
    float32 = True  # L2-clipped answers, float64 sums and noise (contract.Algorithm.float32)
    audit = SmallAudit()

    @abstractmethod
    def direction(self, g: torch.Tensor, state: dict, t: int) -> torch.Tensor:
        """The step direction at round t (1-based) from the released mean ``g``; ``state`` holds the
        moments (``"m"``, ``"psi"``, zeros at the start) and ``"noise_var"``, the release's public
        per-coordinate noise variance (sigma / (q n))^2."""

    def details(self, state: dict) -> dict:
        """The result's optimizer details."""
        p = self.params
        return {"bias_correction": p.bias_correction, "cap": p.cap, "nu": p.nu}

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> AdaptiveDPResult:
        cfg = self.params
        run = PoissonScheduledRun(federation, releaser, self, cfg.clip)
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
            w = w - cfg.lr * self.direction(g, state, t)
            log.round(t, start, failed, noisy_grad_norm=float(g.norm()), sampled=len(users))
        return run.result(w, log.history, {"optimizer": self.optimizer, **self.details(state)})


# default step sizes: simulations/studies/tune_step_sizes.toml (public tuning data; README "Default step sizes")


@register
class DPSGD(AdaptiveDP[AdaptiveDPParams]):
    """DP-SGD (paper 004): Poisson-sampled users, one (eps, delta) Gaussian schedule."""

    name = "dp-sgd"
    Params = AdaptiveDPParams
    optimizer = "sgd"
    step_size = 4.0
    small = SCHEDULED

    def direction(self, g: torch.Tensor, state: dict, t: int) -> torch.Tensor:
        return g


@register
class DPRMSProp(AdaptiveDP[AdaptiveDPParams]):
    """DP-RMSPROP (paper 004): Poisson-sampled users, one (eps, delta) Gaussian schedule."""

    name = "dp-rmsprop"
    Params = AdaptiveDPParams
    optimizer = "rmsprop"
    step_size = 0.01
    small = {**SCHEDULED, "lr": 0.05}

    def first_moment(self, g: torch.Tensor, state: dict, t: int) -> torch.Tensor:
        """The numerator: the released mean itself (RMSProp)."""
        return g

    def direction(self, g: torch.Tensor, state: dict, t: int) -> torch.Tensor:
        cfg = self.params
        state["psi"] = cfg.beta2 * state["psi"] + (1 - cfg.beta2) * g * g
        psi = state["psi"] / (1 - cfg.beta2**t) if cfg.bias_correction else state["psi"]
        return self.first_moment(g, state, t) / (torch.sqrt(torch.clamp(psi, max=cfg.cap)) + cfg.nu)


@register
class DPAdam(DPRMSProp):
    """DP-ADAM (paper 004): Poisson-sampled users, one (eps, delta) Gaussian schedule."""

    name = "dp-adam"
    optimizer = "adam"
    step_size = 0.03
    small = {**SCHEDULED, "lr": 0.05}

    def first_moment(self, g: torch.Tensor, state: dict, t: int) -> torch.Tensor:
        """The numerator: the EMA m of the released means (Adam), bias-corrected with --bias-correction."""
        cfg = self.params
        state["m"] = cfg.beta1 * state["m"] + (1 - cfg.beta1) * g
        return state["m"] / (1 - cfg.beta1**t) if cfg.bias_correction else state["m"]


@register
class DPAdamBC(AdaptiveDP[DPAdamBCParams]):
    """DP-AdamBC (Tang et al. 2024): DP-Adam minus the noise variance in v; the same schedule as dp-adam."""

    name = "dp-adambc"
    Params = DPAdamBCParams
    optimizer = "adambc"
    step_size = 0.03  # dp-adam's tuned value (dp-adambc was not tuned separately)
    small = {**SCHEDULED, "lr": 0.05}

    def direction(self, g: torch.Tensor, state: dict, t: int) -> torch.Tensor:
        cfg = self.params
        state["m"] = cfg.beta1 * state["m"] + (1 - cfg.beta1) * g
        state["psi"] = cfg.beta2 * state["psi"] + (1 - cfg.beta2) * g * g
        m_hat, v_hat = state["m"] / (1 - cfg.beta1**t), state["psi"] / (1 - cfg.beta2**t)
        return m_hat / torch.sqrt(torch.clamp(v_hat - state["noise_var"], min=cfg.adambc_floor))

    def details(self, state: dict) -> dict:
        return {"bias_correction": True, "adambc_floor": self.params.adambc_floor, "noise_variance": state["noise_var"]}


OPTIMIZERS = {cls.optimizer: cls for cls in (DPSGD, DPRMSProp, DPAdam, DPAdamBC)}
