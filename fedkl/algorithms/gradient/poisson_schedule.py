"""What user-level DP-SGD/RMSProp/Adam (:mod:`fedkl.algorithms.gradient.dp_adaptive`) and DP-FedAvg
(:mod:`fedkl.algorithms.gradient.dp_fedavg`) share: T releases of a Poisson-subsampled Gaussian on the SUM of
per-user answers of norm <= C, calibrated and accounted by dp-accounting and charged up front.

Guarantee: user-level (eps, delta)-DP for the whole schedule of T releases, each a Gaussian of noise
multiplier z = sigma / Delta on the sum of per-user answers of norm <= C.
* add-remove (one user added or removed): Delta = C, with Poisson amplification; accounted by
  dp-accounting (PLD by default, or RDP) for ``PoissonSampled(q, Gaussian(z))`` composed T times.
* replace-one: only with q = 1 (full participation): Delta = 2C, accounted as T Gaussians.
z is the smallest multiplier whose accountant gives the (eps, delta) the ledger still allows; the
schedule's (eps, delta) is charged to every enrolled user BEFORE the first release (any of them may
be sampled), so an aborted run is over-charged, never under-charged; the handle refuses a release
beyond T. The sample is drawn from the releaser's (secure) noise source: amplification needs a
secret sample. The released sums are divided by the fixed public denominator q n, never by the
realised sample size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fedkl.algorithms.registry import AlgorithmResult
from fedkl.federation.base import Federation
from fedkl.privacy.accounting import ACCOUNTANTS, GaussianSchedule, noise_multiplier_for, schedule_epsilon
from fedkl.privacy.guarantee import sum_sensitivity
from fedkl.privacy.release import Releaser


def check_schedule_config(rounds, sampling_rate: float, neighbouring: str, accountant: str) -> None:
    """Refuse a schedule the accounting above does not cover (clear message, nothing charged)."""
    if int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds}")
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling rate must be in (0, 1], got {sampling_rate}")
    if neighbouring not in ("add-remove", "replace-one"):
        raise ValueError(f"neighbouring must be 'add-remove' or 'replace-one', got {neighbouring!r}")
    if neighbouring == "replace-one" and sampling_rate < 1:
        raise ValueError(
            "Poisson user sampling is accounted under add-remove only: use "
            "--neighbouring add-remove, or --sampling-rate 1 for replace-one"
        )
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


@functools.lru_cache(maxsize=512)
def calibrate(eps: float, delta: float, sampling_rate: float, rounds: int, accountant: str) -> tuple[float, float]:
    """``(z, eps_z)``: the smallest noise multiplier whose schedule meets (eps, delta) (dp-accounting's
    bisection, :func:`~fedkl.privacy.accounting.noise_multiplier_for`) and the accountant's eps of
    that schedule (<= eps), the value charged. Pure and deterministic, so memoized: calibrating a
    PLD schedule takes seconds and repeated runs (seeds) ask for the same one."""
    z = noise_multiplier_for(eps, delta, sampling_rate, rounds, accountant)
    return z, schedule_epsilon(GaussianSchedule(z, sampling_rate, rounds), delta, accountant)


@dataclass
class ScheduleResult(AlgorithmResult):
    """What a scheduled algorithm returns: the model (post-processing of the releases) and the
    schedule's public parameters."""

    w: torch.Tensor
    rounds: int
    sigma: float
    noise_multiplier: float
    epsilon: float
    delta: float
    history: list[dict] = field(default_factory=list)
    details: dict = field(default_factory=dict)


class PoissonScheduledRun:
    """One run's schedule over ``federation``: calibrated, charged to every enrolled user up front
    (label ``<name>/schedule``), then at most ``rounds`` releases of ``(sum + noise) / (q n)``."""

    def __init__(
        self,
        federation: Federation,
        releaser: Releaser,
        *,
        name: str,
        eps: float,
        delta: float,
        clip: float,
        sampling_rate: float,
        rounds: int,
        neighbouring: str,
        accountant: str,
        details: dict | None = None,
    ) -> None:
        if not (eps > 0 and math.isfinite(eps)) or not 0 < delta < 1:
            raise ValueError(f"need a finite eps > 0 and 0 < delta < 1, got eps={eps}, delta={delta}")
        self.num_users = n = federation.num_users
        self.releaser = releaser
        self.rounds, self.delta, self.accountant = rounds, delta, accountant
        self.sampling_rate = sampling_rate
        self.noise_multiplier, self.epsilon = calibrate(eps, delta, sampling_rate, rounds, accountant)
        self.sensitivity = sum_sensitivity(clip, neighbouring)
        self.sigma = self.noise_multiplier * self.sensitivity
        self.denominator = sampling_rate * n
        self._handle = releaser.schedule_gaussian(
            eps=self.epsilon,
            delta=delta,
            sigma=self.sigma,
            sensitivity=self.sensitivity,
            releases=rounds,
            user_ids=federation.ids_of(list(range(n))),
            label=f"{name}/schedule",
            details={
                "noise_multiplier": self.noise_multiplier,
                "sampling_rate": sampling_rate,
                "accountant": accountant,
                "neighbouring": neighbouring,
                **(details or {}),
            },
        )

    def sample(self) -> list[int]:
        """This round's users: Poisson with rate q from the secure noise source (everyone if q = 1)."""
        n = self.num_users
        if self.sampling_rate >= 1:
            return list(range(n))
        draws = self.releaser.noise.uniform(n)
        return np.flatnonzero(draws < self.sampling_rate).tolist()

    def release(self, total: torch.Tensor) -> torch.Tensor:
        """``(total + N(0, sigma^2 I)) / (q n)``; refused beyond the charged number of releases."""
        return self._handle.release(total) / self.denominator

    def result(self, w: torch.Tensor, history: list[dict], details: dict) -> ScheduleResult:
        """The run's result: the model and the schedule's public parameters (plus ``details``)."""
        return ScheduleResult(
            w=w,
            rounds=self.rounds,
            sigma=self.sigma,
            noise_multiplier=self.noise_multiplier,
            epsilon=self.epsilon,
            delta=self.delta,
            history=history,
            details={
                "sampling_rate": self.sampling_rate,
                "noise_multiplier": self.noise_multiplier,
                "accountant": self.accountant,
                **details,
            },
        )
