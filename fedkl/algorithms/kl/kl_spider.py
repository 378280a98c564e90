"""KL-Spider over users (paper 000, Algorithm 1): variance-reduced noisy normalized GD for the
(gamma, kappa)-KL* condition with kappa in [1, 2].

K phases; phase k has a data-independent excess-risk target ``Phi_k = max(Phi_{k-1}/c, floor)``
(``Phi_0 = F0``), a step length ``s_k = Phi_k^(1/kappa) / (4 gamma L1)`` and at most
``M_k = ceil(T_k)`` difference releases, ``T_k = (F0/Phi_k)^((2-kappa)/kappa)``:

    anchor:     g = (sum_u clip_C(grad f_u(w)) + N(0, sigma_a^2 I)) / n                  (1 release)
    while t <= M_k and ||g|| >= 7/(8 gamma) Phi_k^(1/kappa):     (the test reads released values only)
        w_new = w - s_k g/||g||                                   (normalized step)
        t += 1
        if t <= M_k:  g += (sum_u clip_{C_k}(grad f_u(w_new) - grad f_u(w)) + N(0, sigma_k^2 I)) / n
        w = w_new
    (the next phase starts from the iterate at exit: docs/derivations/paper-000.md §6, pitfall 5, the paper's proof)

``C_k = L1 s_k = Phi_k^(1/kappa)/(4 gamma)`` is fixed before the round and does not depend on the
data, so clipping the per-user differences at C_k (done where the data lives, the
``GradientDifference`` query; clients get both points and stay stateless) enforces the
sensitivity even when L1 is wrong. No difference is released after a phase's last step (it could
not be used): a phase makes at most M_k + 1 steps and M_k difference releases, the paper's count.

Constants (paper, Algorithm 1): ``c = 1 + F0^((2-kappa)/kappa) / (a gamma^2 L1)``,
``K = ceil((1 + a F0^(-(2-kappa)/kappa) gamma^2 L1) * max(1, log F0 + kappa log(n sqrt(rho)/(gamma L0 sqrt d))))``,
``beta' = (beta/K) (gamma L0 sqrt(K d)/(n sqrt(rho) F0^(1/kappa)))^(2-kappa)`` (capped at beta/K),
``floor = min((b gamma L0 sqrt(K d log(1/beta'))/(n sqrt(rho)))^kappa, F0)``, with the theorem's
a = 64, b = 32 (``kl_contraction_constant``, ``kl_floor_constant``: smaller values are heuristics that
make the schedule usable at moderate n; privacy does not depend on them).

Guarantee: user-level rho-zCDP (rho = ``rho_total``), by the zCDP composition of Gaussian releases
(checked by the run's filter, charged to every user before the noise is drawn).
* Anchor: sum of per-user gradients clipped to C: sensitivity ``Delta_a = 2C`` (replace-one) or C
  (add-remove). Difference in phase k: sum of differences clipped to C_k: ``Delta_k = 2 C_k`` or C_k.
* Budget split (exact, not the paper's 2 rho of Lemma 8): the paper's sigmas (``sigma_hat ∝ L0
  sqrt(K)``, ``sigma_k ∝ Phi_k^(1/kappa) sqrt(T_k K)/gamma`` on the mean) put per-release costs in
  the ratio ``1/(2K) : 1/(32 T_k K)``, i.e. weight 16 per anchor and ``1/T_k`` per difference. fedkl
  keeps that ratio and scales it so the WORST CASE (every phase using its M_k differences) costs
  exactly rho: ``rho_anchor = 16 rho / Z``, ``rho_diff,k = rho / (T_k Z)``, ``Z = sum_k (16 + M_k/T_k)``;
  ``sigma = Delta / sqrt(2 rho_release)`` on the sum. The schedule does not depend on the data, and
  the adaptive stop only removes releases.
* Private: the released noisy sums and all that is computed from them (iterates, output). A
  participating client sees the points it is sent (private outputs).

Rate (Theorem 1): ``F(w) - F* = O~((gamma L0 sqrt(d K)/(n sqrt(rho)))^kappa)``, near-optimal for
kappa in [1 + Omega(1), 2] (Corollary 1); PL: ``O~(d/(n^2 rho))``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fedkl.algorithms.contract import param
from fedkl.algorithms.kl.kl_common import (
    KLAlgorithm,
    KLConstants,
    KLConstantsParams,
    KLResult,
    MaxRounds,
    log_bracket,
    or_default,
)
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation, GradientDifference
from fedkl.privacy.guarantee import sum_sensitivity
from fedkl.privacy.release import Releaser

ANCHOR_WEIGHT = 16.0  # paper's per-release costs, anchor : difference = 1/(2K) : 1/(32 T_k K) = 16 : 1/T_k


@dataclass(frozen=True)
class KLSpiderParams(KLConstantsParams, MaxRounds):
    """kl-spider (see the module docstring for the formulas): the KL* constants (kappa in [1, 2]),
    ``kl_smoothness`` L1 (sets the step length; the difference clip C_k does not depend on it), ``clip``
    (the anchor clip C, the theorem's L0), ``kl_contraction_constant`` a in c and K (theorem: 64),
    ``kl_floor_constant`` b in the Phi floor (theorem: 32), ``kl_phases`` K (None: the theorem's) and
    ``kl_max_rounds`` (a cap on the releases; the schedule is still calibrated for all of them)."""

    kl_smoothness: float | None = param(None, "kl-spider: L1 (default 1/(2 lr))", "theorem", positive=True)
    kl_floor_constant: float | None = param(
        None, "kl-spider: the 32 in the Phi floor; smaller values are heuristic", "theorem", positive=True
    )
    kl_phases: int | None = param(
        None, "kl-spider: number of phases K (default the theorem's)", "heuristic", positive=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1.0 <= self.kl_kappa <= 2.0:
            raise ValueError(
                f"--kl-kappa: KL-Spider is for kappa in [1, 2], got {self.kl_kappa} (use kl-prox-point for kappa >= 2)"
            )


@dataclass(frozen=True)
class SpiderSchedule:
    """The data-independent schedule of one run (everything the noise depends on)."""

    f0: float
    c: float
    K: int
    beta_prime: float
    floor: float
    targets: tuple[float, ...]  # Phi_k, k = 1..K
    T: tuple[float, ...]  # T_k (real)
    M: tuple[int, ...]  # ceil(T_k): difference releases allowed in phase k
    step: tuple[float, ...]  # s_k
    diff_clip: tuple[float, ...]  # C_k = L1 s_k
    rho_anchor: float
    rho_diff: tuple[float, ...]
    sensitivity_anchor: float
    sensitivity_diff: tuple[float, ...]

    @property
    def worst_case_rho(self) -> float:
        return self.K * self.rho_anchor + sum(m * r for m, r in zip(self.M, self.rho_diff))

    @property
    def sigma_anchor(self) -> float:
        return self.sensitivity_anchor / math.sqrt(2.0 * self.rho_anchor)

    def sigma_diff(self, k: int) -> float:
        return self.sensitivity_diff[k] / math.sqrt(2.0 * self.rho_diff[k])


@register
class KLSpider(KLAlgorithm[KLSpiderParams]):
    """Algorithm 1: private SPIDER under the KL* condition (kappa in [1, 2]; needs gamma).

    Paper 000, Algorithm 1 over users; see the module docstring. ``ctx.rho_left``: this run's zCDP budget;
    gamma defaults to the PL constant of a convex problem with ``reg`` > 0
    (:meth:`~fedkl.algorithms.kl.kl_common.KLConstantsParams.constants`)."""

    name = "kl-spider"
    Params = KLSpiderParams
    step_size = 4.0  # not tuned (no run without --kl-gamma): the previous default
    small = {"reg": 0.1, "kl_max_rounds": 4, "kl_contraction_constant": 1.0, "kl_floor_constant": 1.0}

    def kl_constants(self, ctx) -> KLConstants:
        return self.params.constants(ctx.problem, self.name)

    @property
    def smoothness(self) -> float:
        """L1: ``kl_smoothness``, else 1/(2 lr)."""
        return float(or_default(self.params.kl_smoothness, 1.0 / (2.0 * self.params.lr)))

    @property
    def contraction_constant(self) -> float:
        return float(or_default(self.params.kl_contraction_constant, 64.0))

    @property
    def floor_constant(self) -> float:
        return float(or_default(self.params.kl_floor_constant, 32.0))

    def schedule(self, n: int, d: int) -> SpiderSchedule:
        cfg, kl, neighbouring = self.params, self.kl, self.ctx.neighbouring
        if n < 1 or d < 1:
            raise ValueError(f"need n >= 1 users and d >= 1 parameters, got {n}, {d}")
        rho, L0, L1, g, kappa = self.rho_total, cfg.clip, self.smoothness, kl.gamma, kl.kappa
        f0 = kl.initial_gap(L0)
        e = (2.0 - kappa) / kappa
        a, b = self.contraction_constant, self.floor_constant
        c = 1.0 + f0**e / (a * g * g * L1)
        K = cfg.kl_phases or math.ceil((1.0 + a * f0 ** (-e) * g * g * L1) * log_bracket(f0, kappa, n, rho, g, L0, d))
        root = n * math.sqrt(rho)
        ratio = g * L0 * math.sqrt(K * d) / (root * f0 ** (1 / kappa))
        beta_prime = (kl.beta / K) * min(1.0, ratio ** (2 - kappa))  # capped at beta/K (see the docstring)
        floor = min((b * g * L0 * math.sqrt(K * d * math.log(1.0 / beta_prime)) / root) ** kappa, f0)
        targets, phi = [], f0
        for _ in range(K):
            phi = max(phi / c, floor)
            targets.append(phi)
        T = tuple((f0 / p) ** e for p in targets)
        M = tuple(max(1, math.ceil(t - 1e-9)) for t in T)
        step = tuple(p ** (1 / kappa) / (4.0 * g * L1) for p in targets)
        diff_clip = tuple(L1 * s for s in step)
        Z = sum(ANCHOR_WEIGHT + m / t for m, t in zip(M, T))
        return SpiderSchedule(
            f0=f0,
            c=c,
            K=K,
            beta_prime=beta_prime,
            floor=floor,
            targets=tuple(targets),
            T=T,
            M=M,
            step=step,
            diff_clip=diff_clip,
            rho_anchor=ANCHOR_WEIGHT * rho / Z,
            rho_diff=tuple(rho / (t * Z) for t in T),
            sensitivity_anchor=self.sensitivity,
            sensitivity_diff=tuple(sum_sensitivity(cc, neighbouring) for cc in diff_clip),
        )

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> KLResult:
        cfg, kl, neighbouring, max_rounds = self.params, self.kl, self.ctx.neighbouring, self.params.kl_max_rounds
        n, d = federation.num_users, federation.num_params
        users = list(range(n))
        user_ids = federation.ids_of(users)
        sched = self.schedule(n, d)
        w = w0.clone()
        rounds, spent, steps = 0, 0.0, 0
        stopped = "phases"
        bound = sched.K + sum(sched.M)
        log = RoundLog(bound if max_rounds is None else min(bound, max_rounds), progress)
        info, start = {}, 0.0  # the last release's details and start (its record is made once est is known)

        def release(value: torch.Tensor, sensitivity: float, rho: float, label: str, details: dict) -> torch.Tensor:
            nonlocal rounds, spent, info, start
            info, start = details, time.perf_counter()
            out = releaser.gaussian(
                value,
                sensitivity=sensitivity,
                rho=rho,
                user_ids=user_ids,
                label=f"{self.name}/{label}",
                details={**info, "neighbouring": neighbouring},
            )
            rounds += 1
            spent += rho
            return out

        def report(estimate: torch.Tensor) -> None:  # the last release's record, with the estimate it gave
            log.round(rounds, start, extra=info, noisy_grad_norm=float(estimate.norm()), rho_spent=spent)

        for k in range(sched.K):
            if max_rounds is not None and rounds >= max_rounds:
                stopped = "max_rounds"
                break
            phi_root = sched.targets[k] ** (1 / kl.kappa)
            threshold = 7.0 / (8.0 * kl.gamma) * phi_root
            anchor = federation.sum(ClippedGradient(w, cfg.clip), users).total()
            est = (
                release(
                    anchor,
                    sched.sensitivity_anchor,
                    sched.rho_anchor,
                    f"phase-{k}/anchor",
                    {"phase": k, "query": "anchor", "clip": cfg.clip},
                ).to(w.dtype)
                / n
            )
            report(est)
            t = 0
            while t <= sched.M[k] and float(est.norm()) >= threshold:
                w_new = w - sched.step[k] * est / est.norm()
                steps += 1
                t += 1
                if t <= sched.M[k]:
                    if max_rounds is not None and rounds >= max_rounds:
                        w = w_new
                        stopped = "max_rounds"
                        break
                    diff = federation.sum(GradientDifference(w_new, w, sched.diff_clip[k]), users).total()
                    est = (
                        est
                        + release(
                            diff,
                            sched.sensitivity_diff[k],
                            sched.rho_diff[k],
                            f"phase-{k}/diff-{t}",
                            {"phase": k, "query": "difference", "clip": sched.diff_clip[k]},
                        ).to(w.dtype)
                        / n
                    )
                    report(est)
                w = w_new
            if stopped == "max_rounds":
                break
        details = {
            "K": sched.K,
            "c": sched.c,
            "F0": sched.f0,
            "floor": sched.floor,
            "beta_prime": sched.beta_prime,
            "final_target": sched.targets[-1],
            "rho_anchor": sched.rho_anchor,
            "sigma_anchor_sum": sched.sigma_anchor,
            "worst_case_rho": sched.worst_case_rho,
            "steps": steps,
            "stopped": stopped,
            "neighbouring": neighbouring,
            "gamma": kl.gamma,
            "kappa": kl.kappa,
            "smoothness": self.smoothness,
        }
        return KLResult(
            w=w, rounds=rounds, sigma=sched.sigma_anchor, rho_spent=spent, history=log.history, details=details
        )
