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
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from fedkl.algorithms.contract import Algorithm, AlgorithmResult, BuildContext, PoissonSampling
from fedkl.federation.base import Federation
from fedkl.privacy.accounting import GaussianSchedule, noise_multiplier_for, schedule_epsilon
from fedkl.privacy.charges import ApproxDPCharge, Need
from fedkl.privacy.guarantee import Guarantee, check_relation, sum_sensitivity
from fedkl.privacy.release import Releaser

# the small test setting of the scheduled algorithms (their ``small``): the dp-accounting schedules use RDP
# there (PLD calibration at the tiny populations of the tests takes a minute per run)
SCHEDULED = {"neighbouring": "add-remove", "sampling_rate": 0.5, "accountant": "rdp"}


def check_sampling_rate(sampling_rate: float) -> None:
    """Refuse a rate the Poisson sampling cannot have (one line naming the flag)."""
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"--sampling-rate must be in (0, 1], got {sampling_rate}")


def check_schedule_relation(neighbouring: str, sampling_rate: float) -> None:
    """Refuse a relation the accounting above does not cover (clear message, before anything is read
    or charged): Poisson amplification is accounted under add-remove only."""
    check_relation(neighbouring)
    if neighbouring == "replace-one" and sampling_rate < 1:
        raise ValueError(
            "Poisson user sampling is accounted under add-remove only: use "
            "--neighbouring add-remove, or --sampling-rate 1 for replace-one"
        )


@functools.lru_cache(maxsize=512)
def calibrate(eps: float, delta: float, sampling_rate: float, rounds: int, accountant: str) -> tuple[float, float]:
    """``(z, eps_z)``: the smallest noise multiplier whose schedule meets (eps, delta) (dp-accounting's
    bisection, :func:`~fedkl.privacy.accounting.noise_multiplier_for`) and the accountant's eps of
    that schedule (<= eps), the value charged. Pure and deterministic, so memoized: calibrating a
    PLD schedule takes seconds and repeated runs (seeds) ask for the same one."""
    z = noise_multiplier_for(eps, delta, sampling_rate, rounds, accountant)
    return z, schedule_epsilon(GaussianSchedule(z, sampling_rate, rounds), delta, accountant)


P = TypeVar("P", bound=PoissonSampling)


class ScheduledAlgorithm(Algorithm[P]):
    """Base of the algorithms that run one schedule (not registered): the relation and the (eps, delta)
    every user can still afford, refused before anything is read where the accounting above does not
    cover them, and the calibrated :meth:`schedule`. Its Params have ``rounds`` and
    :class:`~fedkl.algorithms.contract.PoissonSampling`'s settings."""

    guarantee = Guarantee("schedule")

    def __init__(self, params: P, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        check_schedule_relation(ctx.neighbouring, params.sampling_rate)
        self.neighbouring = ctx.neighbouring
        eps, delta = ctx.approx_budget()
        if not (eps > 0 and math.isfinite(eps)) or not 0 < delta < 1:
            raise ValueError(f"need a finite eps > 0 and 0 < delta < 1, got eps={eps}, delta={delta}")
        self.eps, self.delta = eps, delta

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Every enrolled user: the calibrated schedule's (eps, delta), charged up front (at most the budget)."""
        p = self.params
        _, eps = calibrate(self.eps, self.delta, p.sampling_rate, p.rounds, p.accountant)
        return (Need(tuple(user_ids), ApproxDPCharge(eps, self.delta, "declared-needs")),)

    def plan_schedule(self) -> tuple[int, Callable[[int], str]]:
        """The plan (fedkl.runner._ScheduleCut): one release, the whole schedule charged before its first
        step (:class:`PoissonScheduledRun`); its T steps charge nothing more, so the plan's dry run stops at
        the first step instead of training T rounds on the stand-in (dp-fedavg, 20,000 rounds, 12 users: 20 s -> 12 s,
        the rest being dp-accounting's calibration, which the run needs too)."""
        return 1, lambda k: f"{self.name}/schedule"

    def schedule(self) -> GaussianSchedule:
        """The T-fold (subsampled) Gaussian schedule calibrated to (eps, delta) by dp-accounting."""
        p = self.params
        z, _ = calibrate(self.eps, self.delta, p.sampling_rate, p.rounds, p.accountant)
        return GaussianSchedule(z, p.sampling_rate, p.rounds)


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
        alg: ScheduledAlgorithm,
        clip: float,
        details: dict | None = None,
    ) -> None:
        """``alg``'s schedule (its name, checked (eps, delta) and relation; its Params' sampling rate, rounds
        and accountant) at per-user norm bound ``clip``."""
        p, neighbouring = alg.params, alg.neighbouring
        name, delta, sampling_rate, rounds, accountant = alg.name, alg.delta, p.sampling_rate, p.rounds, p.accountant
        self.num_users = n = federation.num_users
        self.releaser = releaser
        self.rounds, self.delta, self.accountant = rounds, delta, accountant
        self.sampling_rate = sampling_rate
        self.noise_multiplier, self.epsilon = calibrate(alg.eps, delta, sampling_rate, rounds, accountant)
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
