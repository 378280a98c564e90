"""Private proximal point method over users (paper 000, Algorithm 2 with Algorithm 4 as its solver).

For kappa >= 2 (KL*), F Lipschitz and L~1-weakly convex (no smoothness needed). Outer step t = 1..T,
centre ``c = w_{t-1}``; the prox objective ``F_t(w) = F(w) + L~1 ||w - c||^2 = F(w) + ||w - c||^2/(2 eta)``
(``eta = 1/(2 L~1)``; the paper's box writes L~1, its proof L~1/2: fedkl takes L~1 so that F_t is
L~1-strongly convex, docs/derivations/paper-000.md §6, pitfall 7) is minimized by noisy projected GD (Algorithm 4):

    v_1 = c;  for s = 1..T_in:
        S_s     = sum_u clip_C(grad f_u(v_s))                                  (federation)
        g_s     = (S_s + N(0, sigma^2 I)) / n + 2 L~1 (v_s - c)     (the prox term is data-free)
        v_{s+1} = Proj_{B(c, C/(2 L~1))}(v_s - g_s / (L~1 s))
    w_t = 2/(T_in (T_in + 1)) sum_s s v_{s+1}                       (the weighted average)

The ball contains the prox minimizer: ``2 L~1 ||w* - c|| = ||grad F(w*)|| <= L0`` (here the clipped
mean gradient, of norm <= C). Clients only return clipped gradients: they never solve local prox
problems (FedProx-style local work is outside the analysis).

Constants (theorem): ``T = ceil((1 + a F0^((kappa-2)/kappa) gamma^2 L~1) * max(1, log F0 + kappa
log(n sqrt(rho)/(gamma L0 sqrt d))))`` with a = 32 (``kl_contraction_constant``), ``beta' = beta/T``,
``rho' = rho/T``, ``T_in = ceil(n^2 rho' log^2(2/beta')/d)`` (Theorem 9; typically 10^4 or more, so
``rounds`` caps it in practice: a heuristic that costs utility, never privacy).

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

from fedkl.algorithms.contract import Rounds, param
from fedkl.algorithms.kl.kl_common import (
    KLAlgorithm,
    KLConstants,
    KLConstantsParams,
    KLResult,
    log_bracket,
    or_default,
    project_ball,
)
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation
from fedkl.privacy.release import Releaser


@dataclass(frozen=True)
class ProxPointParams(KLConstantsParams, Rounds):
    """kl-prox-point: ``kl_weak_convexity`` L~1 > 0 (any positive value for a convex F; the prox step is
    1/(2 L~1)), the KL* constants (kappa >= 2; needed only for the theorem's T and T_in), ``clip`` C (the
    theorem's L0), ``kl_contraction_constant`` a in T (theorem: 32), ``kl_prox_steps`` T and
    ``kl_inner_rounds`` T_in (None: the theorem's; T_in capped at ``rounds``)."""

    kl_weak_convexity: float | None = param(
        None, "kl-prox-point: L~1 (default 1/(2 lr), i.e. the prox step is lr)", "theorem", positive=True
    )
    kl_prox_steps: int | None = param(
        None, "kl-prox-point: outer steps T (default the theorem's)", "heuristic", positive=True
    )
    kl_inner_rounds: int | None = param(
        None, "kl-prox-point: inner rounds T_in (default the theorem's, capped at --rounds)", "heuristic", positive=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kl_kappa < 2:
            raise ValueError(
                f"--kl-kappa: the proximal point method is for kappa >= 2, got {self.kl_kappa} "
                "(use kl-spider or kl-adaptive-gd for kappa in [1, 2])"
            )


@dataclass(frozen=True)
class ProxSchedule:
    T: int
    T_in: int
    T_in_theorem: int | None
    beta_prime: float | None
    rho_release: float
    sigma: float  # noise std on the sum


@register
class PrivateProxPoint(KLAlgorithm[ProxPointParams]):
    """Algorithms 2 + 4: private proximal point (kappa >= 2); inner rounds capped at ``rounds``.

    Paper 000, Algorithm 2 (+ Algorithm 4) over users; see the module docstring. ``ctx.rho_left``: this
    run's zCDP budget. The KL* constants (``self.kl``) are needed only for the theorem's T (without
    ``kl_prox_steps``) and T_in; None when T is given and gamma is neither given nor derivable."""

    name = "kl-prox-point"
    Params = ProxPointParams
    step_size = 4.0  # not tuned (no run without --kl-gamma): the previous default
    small = {"reg": 0.1, "kl_prox_steps": 2, "rounds": 2}

    def kl_constants(self, ctx) -> KLConstants | None:
        return self.params.constants(ctx.problem, self.name, required=self.params.kl_prox_steps is None)

    @property
    def weak_convexity(self) -> float:
        """L~1: ``kl_weak_convexity``, else 1/(2 lr) (the prox step is then lr)."""
        return float(or_default(self.params.kl_weak_convexity, 1.0 / (2.0 * self.params.lr)))

    @property
    def contraction_constant(self) -> float:
        return float(or_default(self.params.kl_contraction_constant, 32.0))

    @property
    def radius(self) -> float:
        """Radius of the ball around each centre that holds the prox minimizer: C/(2 L~1)."""
        return self.params.clip / (2.0 * self.weak_convexity)

    def schedule(self, n: int, d: int) -> ProxSchedule:
        cfg, kl, rho = self.params, self.kl, self.rho_total
        if n < 1 or d < 1:
            raise ValueError(f"need n >= 1 users and d >= 1 parameters, got {n}, {d}")
        if cfg.kl_prox_steps is not None:
            T = cfg.kl_prox_steps
        else:
            f0 = kl.initial_gap(cfg.clip)
            T = math.ceil(
                (
                    1.0
                    + self.contraction_constant
                    * f0 ** ((kl.kappa - 2.0) / kl.kappa)
                    * kl.gamma**2
                    * self.weak_convexity
                )
                * log_bracket(f0, kl.kappa, n, rho, kl.gamma, cfg.clip, d)
            )
        beta_prime = kl.beta / T if kl is not None else None
        theorem = None
        if beta_prime is not None:
            theorem = max(1, math.ceil(n * n * (rho / T) * math.log(2.0 / beta_prime) ** 2 / d))
        if cfg.kl_inner_rounds is not None:
            T_in = cfg.kl_inner_rounds
        elif theorem is None:
            T_in = cfg.rounds
        else:
            T_in = min(theorem, cfg.rounds)
        rho_release = rho / (T * T_in)
        return ProxSchedule(
            T=T,
            T_in=T_in,
            T_in_theorem=theorem,
            beta_prime=beta_prime,
            rho_release=rho_release,
            sigma=self.sensitivity / math.sqrt(2.0 * rho_release),
        )

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> KLResult:
        cfg, neighbouring = self.params, self.ctx.neighbouring
        n, d = federation.num_users, federation.num_params
        users = list(range(n))
        user_ids = federation.ids_of(users)
        sched = self.schedule(n, d)
        L = self.weak_convexity
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
                    sensitivity=self.sensitivity,
                    rho=sched.rho_release,
                    user_ids=user_ids,
                    label=f"{self.name}/prox-{t}/round-{s}",
                    details={"prox_step": t, "inner_round": s, "clip": cfg.clip, "neighbouring": neighbouring},
                )
                rounds += 1
                spent += sched.rho_release
                grad = noisy.to(w.dtype) / n + 2.0 * L * (v - center)
                v = project_ball(v - grad / (L * s), center, self.radius)
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
            "radius": self.radius,
            "neighbouring": neighbouring,
            "sensitivity": self.sensitivity,
        }
        return KLResult(w=w, rounds=rounds, sigma=sched.sigma, rho_spent=spent, history=log.history, details=details)
