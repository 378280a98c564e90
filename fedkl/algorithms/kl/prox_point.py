"""Private proximal point method over users (paper 000, Algorithm 2 with Algorithm 4 as its solver).

For kappa >= 2 (KL*), F Lipschitz and L~1-weakly convex (no smoothness needed). Outer step t = 1..T,
centre ``c = w_{t-1}``; the prox objective ``F_t(w) = F(w) + L~1 ||w - c||^2 = F(w) + ||w - c||^2/(2 eta)``
(``eta = 1/(2 L~1)``; the paper's box writes L~1, its proof L~1/2: fedkl takes L~1 so that F_t is
L~1-strongly convex, the note's pitfall 7) is minimized by noisy projected GD (Algorithm 4):

    v_1 = c;  for s = 1..T_in:
        S_s     = sum_u clip_C(grad f_u(v_s))                                  (federation)
        g_s     = (S_s + N(0, sigma^2 I)) / n + 2 L~1 (v_s - c)     (the prox term is data-free)
        v_{s+1} = Proj_{B(c, C/(2 L~1))}(v_s - g_s / (L~1 s))
    w_t = 2/(T_in (T_in + 1)) sum_s s v_{s+1}                       (the weighted average)

The ball contains the prox minimizer: ``2 L~1 ||w* - c|| = ||grad F(w*)|| <= L0`` (here the clipped
mean gradient, of norm <= C). Clients only return clipped gradients: they never solve local prox
problems (FedProx-style local work is outside the analysis).

Constants (theorem): ``T = ceil((1 + a F0^((kappa-2)/kappa) gamma^2 L~1) * max(1, log F0 + kappa
log(n sqrt(rho)/(gamma L0 sqrt d))))`` with a = 32 (``contraction_constant``), ``beta' = beta/T``,
``rho' = rho/T``, ``T_in = ceil(n^2 rho' log^2(2/beta')/d)`` (Theorem 9; typically 10^4 or more, so
``max_inner_rounds`` caps it in practice: a heuristic that costs utility, never privacy).

Guarantee: user-level rho-zCDP (rho = ``rho_total``). Every inner round releases a sum of
per-user gradients clipped to C: L2 sensitivity ``Delta = 2C`` (replace-one; the paper's 2L0/n on
the mean, Theorem 9) or C (add-remove, divided by the public n). The schedule is fixed (T T_in
releases at ``rho / (T T_in)`` each, ``sigma = Delta / sqrt(2 rho/(T T_in))`` on the sum; the paper's
sigma^2 = 4 L0^2 T_in/(n^2 rho') charges only half of rho' in exact zCDP): zCDP composition, each
release checked by the run's filter and charged to every user before the noise is drawn. Private:
the released sums and everything computed from them (centres, iterates, output); a client sees the
points it is sent.

Rate (Theorem 2, kappa >= 2): ``O~((gamma L0 sqrt(d (1 + F0^((kappa-2)/kappa) gamma^2 L~1))/(n
sqrt(rho)))^kappa)``, optimal for d = 1 (Theorem 8); PL: ``O~(d/(n^2 rho))``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fedkl.algorithms.kl.kl_common import (
    KLConstants,
    KLResult,
    check_count,
    check_positive,
    log_bracket,
    project_ball,
)
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation
from fedkl.privacy.guarantee import Guarantee, check_relation, sum_sensitivity
from fedkl.privacy.release import Releaser


@dataclass(frozen=True)
class ProxPointConfig:
    """Hyperparameters of :class:`PrivateProxPoint`.

    Attributes:
        weak_convexity: L~1 > 0 (any positive value for a convex F); the prox step is 1/(2 L~1).
        kl: the KL* constants (kappa >= 2); needed only for the theorem's T.
        clip: per-user clip C (the theorem's L0).
        neighbouring: ``replace-one`` or ``add-remove``.
        contraction_constant: a in T (theorem: 32).
        prox_steps: T; None: the theorem's.
        inner_rounds: T_in; None: the theorem's, capped by ``max_inner_rounds``.
        max_inner_rounds: cap on the theorem's T_in (None: no cap).
    """

    weak_convexity: float
    kl: KLConstants | None = None
    clip: float = 1.0
    neighbouring: str = "replace-one"
    contraction_constant: float = 32.0
    prox_steps: int | None = None
    inner_rounds: int | None = None
    max_inner_rounds: int | None = None

    def __post_init__(self) -> None:
        check_positive("weak_convexity", self.weak_convexity)
        check_positive("clip", self.clip)
        check_relation(self.neighbouring)
        check_positive("contraction_constant", self.contraction_constant)
        for name in ("prox_steps", "inner_rounds", "max_inner_rounds"):
            check_count(name, getattr(self, name))
        if self.kl is not None and self.kl.kappa < 2:
            raise ValueError(
                f"the proximal point method is for kappa >= 2, got {self.kl.kappa} "
                "(use kl-spider or kl-adaptive-gd for kappa in [1, 2])"
            )
        if self.kl is None and (self.prox_steps is None or self.inner_rounds is None and self.max_inner_rounds is None):
            raise ValueError(
                "the theorem's prox steps T and inner rounds T_in need the KL constants: give kl "
                "(gamma, kappa) or both prox_steps and inner_rounds / max_inner_rounds"
            )

    @property
    def sensitivity(self) -> float:
        return sum_sensitivity(self.clip, self.neighbouring)

    @property
    def radius(self) -> float:
        """Radius of the ball around each centre that holds the prox minimizer: C/(2 L~1)."""
        return self.clip / (2.0 * self.weak_convexity)


@dataclass(frozen=True)
class ProxSchedule:
    T: int
    T_in: int
    T_in_theorem: int | None
    beta_prime: float | None
    rho_release: float
    sigma: float  # noise std on the sum


class PrivateProxPoint:
    """Paper 000, Algorithm 2 (+ Algorithm 4) over users; see the module docstring."""

    name = "kl-prox-point"
    guarantee = Guarantee("zcdp")

    def __init__(self, config: ProxPointConfig, rho_total: float) -> None:
        check_positive("rho_total", rho_total)
        self.config = config
        self.rho_total = float(rho_total)

    def schedule(self, n: int, d: int) -> ProxSchedule:
        cfg, kl, rho = self.config, self.config.kl, self.rho_total
        if n < 1 or d < 1:
            raise ValueError(f"need n >= 1 users and d >= 1 parameters, got {n}, {d}")
        if cfg.prox_steps is not None:
            T = cfg.prox_steps
        else:
            f0 = kl.initial_gap(cfg.clip)
            T = math.ceil(
                (
                    1.0
                    + cfg.contraction_constant * f0 ** ((kl.kappa - 2.0) / kl.kappa) * kl.gamma**2 * cfg.weak_convexity
                )
                * log_bracket(f0, kl.kappa, n, rho, kl.gamma, cfg.clip, d)
            )
        beta_prime = kl.beta / T if kl is not None else None
        theorem = None
        if beta_prime is not None:
            theorem = max(1, math.ceil(n * n * (rho / T) * math.log(2.0 / beta_prime) ** 2 / d))
        if cfg.inner_rounds is not None:
            T_in = cfg.inner_rounds
        elif theorem is None:
            T_in = cfg.max_inner_rounds
        else:
            T_in = theorem if cfg.max_inner_rounds is None else min(theorem, cfg.max_inner_rounds)
        rho_release = rho / (T * T_in)
        return ProxSchedule(
            T=T,
            T_in=T_in,
            T_in_theorem=theorem,
            beta_prime=beta_prime,
            rho_release=rho_release,
            sigma=cfg.sensitivity / math.sqrt(2.0 * rho_release),
        )

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> KLResult:
        cfg = self.config
        n, d = federation.num_users, federation.num_params
        users = list(range(n))
        user_ids = federation.ids_of(users)
        sched = self.schedule(n, d)
        L = cfg.weak_convexity
        total_rounds = sched.T * sched.T_in
        w = w0.clone()
        log = RoundLog(total_rounds, progress)
        rounds, spent = 0, 0.0
        for t in range(sched.T):
            center = w
            v = center.clone()
            avg = torch.zeros_like(w)
            for s in range(1, sched.T_in + 1):
                start = time.perf_counter()
                total = federation.sum(ClippedGradient(v, cfg.clip), users).total()
                noisy = releaser.gaussian(
                    total,
                    sensitivity=cfg.sensitivity,
                    rho=sched.rho_release,
                    user_ids=user_ids,
                    label=f"{self.name}/prox-{t}/round-{s}",
                    details={"prox_step": t, "inner_round": s, "clip": cfg.clip, "neighbouring": cfg.neighbouring},
                )
                rounds += 1
                spent += sched.rho_release
                grad = noisy.to(w.dtype) / n + 2.0 * L * (v - center)
                v = project_ball(v - grad / (L * s), center, cfg.radius)
                avg += s * v
                norm = float(noisy.norm()) / n
                log.round(rounds, start, noisy_grad_norm=norm, rho_spent=spent, prox_step=t + 1)
            w = avg * (2.0 / (sched.T_in * (sched.T_in + 1)))
        details = {
            "prox_steps": sched.T,
            "inner_rounds": sched.T_in,
            "inner_rounds_theorem": sched.T_in_theorem,
            "beta_prime": sched.beta_prime,
            "rho_release": sched.rho_release,
            "weak_convexity": L,
            "prox_eta": 1.0 / (2.0 * L),
            "radius": cfg.radius,
            "neighbouring": cfg.neighbouring,
            "sensitivity": cfg.sensitivity,
        }
        return KLResult(w=w, rounds=rounds, sigma=sched.sigma, rho_spent=spent, history=log.history, details=details)
