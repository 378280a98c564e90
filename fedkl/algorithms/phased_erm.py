"""Phased-ERM (paper 002, Algorithm 3, Thm 4.1): localization with T calls of SCOutputPert.

Phase i = 1..T (T public):

    lam_i = lam * 4^i;  l_i(theta; x) = l(theta; x) + (lam_i/2)||theta - theta^_{i-1}||^2
    theta^_i = SCOutputPert_{eps/T, delta/T, Delta_i}(l_i; x)        Delta_i = Delta_1 / 4^(i-1)
    if the call outputs ⊥: theta^_i = theta^_{i-1} (post-processing; counted in ``bottoms``)

Guarantee: **(eps, delta)-DP, user level, replace-one, n public**, by basic composition of T
(eps/T, delta/T)-DP calls (each charged to the ledger before its release; the ledger adds eps and
delta). Every call's center theta^_{i-1} is an earlier private output (or the public w0), and all
of lam, T, Delta_1 are public; the constants of phase i (mu_i = reg + lam_i, beta_i, G0 at the
center) are computed from public values only.

Differences from the paper, on purpose:
* The paper minimizes over K_i = K ∩ B(theta^_{i-1}, R_i) (printed with theta_{i-1}: a typo, note
  §6.5). We minimize over R^d: privacy holds for any f; for a loss that is G-Lipschitz on all of R^d
  the ball is inactive anyway (||theta*_i - theta^_{i-1}|| <= G/lam_i = R_i, note §2B).
* ⊥ is unspecified in the paper; we keep the previous center (note §2E) and report how often.
* Delta_i ∝ 1/lam_i follows the Delta_uc scaling; Delta_1 is the caller's public choice (note §6.1:
  the printed Delta of Alg 2 omits the union bound).

Practical limits are those of SCOutputPert: every phase runs at kappa' = kappa(eps/(2T), ...), which
is about T times larger, so the certificate needs n >= 4 kappa' + 2 and the exact fallback n <= 20:
at T >= 2 essentially every phase is decided by enumeration (see ``details``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from fedkl.algorithms.sc_output_pert import SCOutputPert, SCOutputPertConfig
from fedkl.federation.base import Federation
from fedkl.privacy.release import Releaser
from fedkl.problems.base import Problem


@dataclass(frozen=True)
class PhasedERMConfig:
    """Public parameters. ``lam``: the base regularization (lam_i = lam 4^i); ``phases``: T;
    ``Delta_1``: the phase-1 deletion threshold; the rest as :class:`SCOutputPertConfig`."""

    eps: float
    delta: float
    lam: float
    Delta_1: float
    phases: int
    calibration: str = "paper"
    max_exact_users: int = 20
    use_certificate: bool = True

    def __post_init__(self) -> None:
        if int(self.phases) != self.phases or self.phases < 1:
            raise ValueError(f"phases must be a positive integer, got {self.phases}")
        if not (self.lam > 0 and math.isfinite(self.lam)):
            raise ValueError(f"lam must be finite and > 0, got {self.lam}")
        if not (self.Delta_1 > 0 and math.isfinite(self.Delta_1)):
            raise ValueError(f"Delta_1 must be finite and > 0, got {self.Delta_1}")
        if not (self.eps > 0 and 0 < self.delta < 1):
            raise ValueError("need eps > 0 and 0 < delta < 1")

    def lam_i(self, i: int) -> float:
        return self.lam * 4.0**i

    def Delta_i(self, i: int) -> float:
        return self.Delta_1 / 4.0 ** (i - 1)


@dataclass
class PhasedERMResult:
    w: torch.Tensor
    phases: int
    bottoms: int
    sigmas: list[float]
    details: dict = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        return self.phases


class PhasedERM:
    """See the module docstring. ``feature_bound`` is the loader-enforced record bound R."""

    name = "phased-erm"

    def __init__(self, config: PhasedERMConfig, problem: Problem, feature_bound: float) -> None:
        self.config = config
        self.problem = problem
        self.feature_bound = float(feature_bound)

    def phase_config(self, i: int, center: torch.Tensor) -> SCOutputPertConfig:
        cfg = self.config
        return SCOutputPertConfig.for_problem(
            self.problem, self.feature_bound, center, eps=cfg.eps / cfg.phases, delta=cfg.delta / cfg.phases,
            Delta=cfg.Delta_i(i), extra_reg=cfg.lam_i(i), calibration=cfg.calibration,
            max_exact_users=cfg.max_exact_users, use_certificate=cfg.use_certificate)

    def run(self, federation: Federation, releaser: Releaser, w0: torch.Tensor,
            progress: Callable[[dict], None] | None = None) -> PhasedERMResult:
        cfg = self.config
        if federation.num_users > cfg.max_exact_users:  # public n: refuse before any data access
            raise ValueError(f"Phased-ERM: n={federation.num_users} exceeds max_exact_users={cfg.max_exact_users} "
                             "(see SCOutputPert)")
        center = torch.as_tensor(w0).to(torch.float64)
        bottoms, sigmas, decided = 0, [], {"certificate": 0, "exact": 0}
        for i in range(1, cfg.phases + 1):
            alg = SCOutputPert(self.phase_config(i, center))
            res = alg.run(federation, releaser, center, label=f"{self.name}/phase-{i}")
            sigmas.append(res.sigma)
            decided[res.diagnostics["decided_by"]] += 1
            if res.theta is None:
                bottoms += 1
            else:
                center = res.theta.to(torch.float64)
            if progress is not None:
                progress({"round": i, "rounds": cfg.phases, "released": res.theta is not None,
                          "sigma": res.sigma, "decided_by": res.diagnostics["decided_by"]})
        details = {"dp": "approximate (eps, delta)-DP, user level, replace-one, n public; basic composition "
                         f"of {cfg.phases} x (eps/T, delta/T)", "eps": cfg.eps, "delta": cfg.delta,
                   "lam": cfg.lam, "Delta_1": cfg.Delta_1, "bottoms": bottoms, "sigmas": sigmas,
                   "nonprivate_diagnostics": {"decided_by": decided}}
        return PhasedERMResult(center.to(torch.as_tensor(w0).dtype), cfg.phases, bottoms, sigmas, details)
