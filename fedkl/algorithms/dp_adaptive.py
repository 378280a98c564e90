"""User-level DP-SGD, DP-RMSProp and DP-Adam as server optimizers (paper 004, Zhou et al., Alg. 1).

Round t:

    sample users: Poisson with rate q (secure randomness; q = 1 means everyone)
    S_t  = sum_{sampled u} clip_C(grad f_u(w_t))               (federation)
    g~_t = (S_t + N(0, sigma^2 I)) / (q n)                       (fixed public denominator)
    m_t  = g~_t (SGD, RMSProp) or beta1 m_{t-1} + (1 - beta1) g~_t (Adam)
    psi_t = 1 (SGD) or beta2 psi_{t-1} + (1 - beta2) g~_t^2 (RMSProp, Adam);  v_t = min(psi_t, cap)
    w_{t+1} = w_t - lr * m_t / (sqrt(v_t) + nu)

As in the paper's corrected Algorithm 1 (../shared/notes/seed-004.md): EMAs start from zero and are
NOT bias-corrected by default (``bias_correction=True`` applies Adam's 1/(1 - beta^t) corrections,
flagged in the result); the cap on v keeps accumulated noise from freezing the step; the step has
the minus sign the paper's line 6 lost; nu is outside the square root.

Guarantee: user-level (eps, delta)-DP for the whole schedule of T releases, each a Gaussian of noise
multiplier z = sigma / Delta on the sum of clipped per-user gradients.
* add-remove (one user added or removed): Delta = C, with Poisson amplification; accounted by
  dp-accounting (PLD by default, or RDP) for ``PoissonSampled(q, Gaussian(z))`` composed T times.
* replace-one: only with q = 1 (full participation): Delta = 2C, accounted as T Gaussians.
z is the smallest multiplier whose accountant gives the (eps, delta) the ledger still allows; the
schedule's (eps, delta) is charged to every user BEFORE the first release (all users: any of them
may be sampled), so an aborted run is over-charged, never under-charged. The optimizer state and
every iterate are post-processing of the released noisy sums.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from fedkl.federation.base import ClippedGradient, Federation
from fedkl.privacy.accounting import ACCOUNTANTS, GaussianSchedule, noise_multiplier_for, schedule_epsilon
from fedkl.privacy.release import Releaser

OPTIMIZERS = ("sgd", "rmsprop", "adam")


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
    neighbouring: str = "add-remove"
    accountant: str = "pld"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if int(self.rounds) != self.rounds or self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds}")
        for name in ("lr", "clip", "nu", "cap"):
            v = getattr(self, name)
            if not v > 0 or math.isnan(v):
                raise ValueError(f"{name} must be > 0, got {v}")
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"sampling rate must be in (0, 1], got {self.sampling_rate}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.neighbouring not in ("add-remove", "replace-one"):
            raise ValueError(f"neighbouring must be 'add-remove' or 'replace-one', got {self.neighbouring!r}")
        if self.neighbouring == "replace-one" and self.sampling_rate < 1:
            raise ValueError("Poisson user sampling is accounted under add-remove only: use "
                             "--neighbouring add-remove, or --sampling-rate 1 for replace-one")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}")

    @property
    def sensitivity(self) -> float:
        return 2.0 * self.clip if self.neighbouring == "replace-one" else self.clip


@dataclass
class AdaptiveDPResult:
    w: torch.Tensor
    rounds: int
    sigma: float
    noise_multiplier: float
    epsilon: float
    delta: float
    history: list[dict] = field(default_factory=list)
    details: dict = field(default_factory=dict)


class AdaptiveDPOptimizer:
    """See the module docstring. ``eps``/``delta``: the user-level budget this run may charge."""

    def __init__(self, config: AdaptiveDPConfig, eps: float, delta: float) -> None:
        if not (eps > 0 and math.isfinite(eps)) or not 0 < delta < 1:
            raise ValueError(f"need a finite eps > 0 and 0 < delta < 1, got eps={eps}, delta={delta}")
        self.config = config
        self.eps = eps
        self.delta = delta
        self.name = f"dp-{config.optimizer}"

    def schedule(self) -> GaussianSchedule:
        cfg = self.config
        z = noise_multiplier_for(self.eps, self.delta, cfg.sampling_rate, cfg.rounds, cfg.accountant)
        return GaussianSchedule(z, cfg.sampling_rate, cfg.rounds)

    def _direction(self, g: torch.Tensor, state: dict, t: int) -> torch.Tensor:
        cfg = self.config
        if cfg.optimizer == "sgd":
            return g
        state["psi"] = cfg.beta2 * state["psi"] + (1 - cfg.beta2) * g * g
        psi = state["psi"] / (1 - cfg.beta2**t) if cfg.bias_correction else state["psi"]
        m = g
        if cfg.optimizer == "adam":
            state["m"] = cfg.beta1 * state["m"] + (1 - cfg.beta1) * g
            m = state["m"] / (1 - cfg.beta1**t) if cfg.bias_correction else state["m"]
        return m / (torch.sqrt(torch.clamp(psi, max=cfg.cap)) + cfg.nu)

    def run(self, federation: Federation, releaser: Releaser, w0: torch.Tensor,
            progress: Callable[[dict], None] | None = None) -> AdaptiveDPResult:
        cfg = self.config
        n = federation.num_users
        user_ids = federation.ids_of(list(range(n)))
        schedule = self.schedule()
        eps = schedule_epsilon(schedule, self.delta, cfg.accountant)
        sigma = schedule.noise_multiplier * cfg.sensitivity
        handle = releaser.schedule_gaussian(
            eps=eps, delta=self.delta, sigma=sigma, sensitivity=cfg.sensitivity, releases=cfg.rounds,
            user_ids=user_ids, label=f"{self.name}/schedule",
            details={"noise_multiplier": schedule.noise_multiplier, "sampling_rate": cfg.sampling_rate,
                     "accountant": cfg.accountant, "neighbouring": cfg.neighbouring})
        w = w0.clone()
        state = {"m": torch.zeros_like(w), "psi": torch.zeros_like(w)}
        denominator = cfg.sampling_rate * n
        history: list[dict] = []
        for t in range(1, cfg.rounds + 1):
            start = time.perf_counter()
            if cfg.sampling_rate < 1:
                draws = releaser.noise.uniform(n)  # secure: amplification needs a secret sample
                users = [u for u in range(n) if draws[u] < cfg.sampling_rate]
            else:
                users = list(range(n))
            total = torch.zeros_like(w)
            failed = 0
            if users:
                answers = federation.sum(ClippedGradient(w, cfg.clip), users)
                total = answers.total().to(w.dtype)
                failed = len(answers.failed)
            g = handle.release(total) / denominator
            w = w - cfg.lr * self._direction(g, state, t)
            record = {"round": t, "rounds": cfg.rounds, "noisy_grad_norm": float(g.norm()), "sampled": len(users),
                      "failed_users": failed, "seconds": time.perf_counter() - start}
            history.append(record)
            if progress is not None:
                progress(record)
        return AdaptiveDPResult(
            w=w, rounds=cfg.rounds, sigma=sigma, noise_multiplier=schedule.noise_multiplier, epsilon=eps,
            delta=self.delta, history=history,
            details={"optimizer": cfg.optimizer, "bias_correction": cfg.bias_correction,
                     "sampling_rate": cfg.sampling_rate, "noise_multiplier": schedule.noise_multiplier,
                     "accountant": cfg.accountant, "cap": cfg.cap, "nu": cfg.nu})
