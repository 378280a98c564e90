"""Paper 000 (Menart et al.) algorithms for `fedkl run`: builders from a :class:`fedkl.runner.RunConfig`.

* ``kl-adaptive-gd`` — :class:`~fedkl.algorithms.kl.kl_adaptive_gd.AdaptiveKLGD` (Algorithm 3; needs no
  KL constants; rounds run until the run's zCDP filter would be exhausted);
* ``kl-spider`` — :class:`~fedkl.algorithms.kl.kl_spider.KLSpider` (Algorithm 1; kappa in [1, 2]);
* ``kl-prox-point`` — :class:`~fedkl.algorithms.kl.prox_point.PrivateProxPoint` (Algorithms 2 + 4; kappa >= 2).

All three are user-level rho-zCDP (replace-one by default, add-remove available) with every
release charged through :meth:`fedkl.privacy.release.Releaser.gaussian` (and, for the optional
selection of Algorithm 3, :meth:`~fedkl.privacy.release.Releaser.exponential`); see each module.

Configuration: each algorithm's Params (below) is the table of its hyperparameters (T = the
theorem's value by default, H = a heuristic); ``reg`` (through the problem) and ``neighbouring`` come
from the run. ``None`` means the theorem's value: ``kl_gamma`` 1/sqrt(2 reg) (a convex loss +
(reg/2)||w||^2 is PL), ``kl_f0`` (clip gamma)^kappa, ``kl_smoothness`` and ``kl_weak_convexity``
1/(2 lr), ``kl_contraction_constant`` 64 (spider) / 32 (prox point), ``kl_floor_constant`` 32,
``kl_norm_rho`` sqrt(rho)/n.

``rounds`` is used only by the prox point method (cap on its inner rounds per prox step): adaptive
GD runs until the budget is spent, spider runs its K phases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedkl.algorithms.kl.kl_adaptive_gd import AdaptiveKLGD, AdaptiveKLGDConfig
from fedkl.algorithms.kl.kl_common import KLConstants, KLResult
from fedkl.algorithms.kl.kl_spider import KLSpider, KLSpiderConfig
from fedkl.algorithms.kl.prox_point import PrivateProxPoint, ProxPointConfig
from fedkl.algorithms.registry import AlgorithmParams, BuildContext, Clip, Rounds, StepSize, param, register
from fedkl.privacy.guarantee import ZERO_SUMS


@dataclass(frozen=True)
class KLBase(StepSize, Clip):
    kl_beta: float = param(0.1, "failure probability beta of the rates", "theorem")


@dataclass(frozen=True)
class KLConstantsParams(KLBase):
    kl_gamma: float | None = param(
        None,
        "gamma of the (gamma, kappa)-KL* condition (default 1/sqrt(2 reg) for a convex problem with --reg > 0, "
        "which makes F PL)",
        "theorem",
    )
    kl_kappa: float = param(2.0, "kappa of the KL* condition (2 = PL)", "theorem")
    kl_f0: float | None = param(None, "F0 >= F(w0) - F* (default (clip gamma)^kappa)", "theorem")
    kl_contraction_constant: float | None = param(
        None, "the 64 (spider) / 32 (prox point) in c, K, T; smaller values are heuristic", "theorem"
    )


@dataclass(frozen=True)
class MaxRounds(AlgorithmParams):
    kl_max_rounds: int | None = param(None, "kl-adaptive-gd / kl-spider: cap on federated rounds", "heuristic")


@dataclass(frozen=True)
class AdaptiveKLGDParams(KLBase, MaxRounds):
    kl_select: str = param(
        "last",
        "kl-adaptive-gd output: last (Thm 4) or exponential (Thm 5, exponential-mechanism selection of an iterate)",
        "theorem",
        choices=("last", "exponential"),
    )
    kl_select_fraction: float = param(
        1.0 / 9.0,
        "kl-adaptive-gd: budget share of the exponential selection (1/9: the paper's eps = sqrt(rho))",
        "theorem",
    )
    kl_norm_rho: float | None = param(
        None, "kl-adaptive-gd: zCDP cost of each gradient-norm release (default sqrt(rho)/n)", "theorem"
    )


@dataclass(frozen=True)
class KLSpiderParams(KLConstantsParams, MaxRounds):
    kl_smoothness: float | None = param(None, "kl-spider: L1 (default 1/(2 lr))", "theorem")
    kl_floor_constant: float | None = param(
        None, "kl-spider: the 32 in the Phi floor; smaller values are heuristic", "theorem"
    )
    kl_phases: int | None = param(None, "kl-spider: number of phases K (default the theorem's)", "heuristic")


@dataclass(frozen=True)
class ProxPointParams(KLConstantsParams, Rounds):
    kl_weak_convexity: float | None = param(
        None, "kl-prox-point: L~1 (default 1/(2 lr), i.e. the prox step is lr)", "theorem"
    )
    kl_prox_steps: int | None = param(None, "kl-prox-point: outer steps T (default the theorem's)", "heuristic")
    kl_inner_rounds: int | None = param(
        None, "kl-prox-point: inner rounds T_in (default the theorem's, capped at --rounds)", "heuristic"
    )


def _or(value, default):
    return default if value is None else value


def _kl(params: KLConstantsParams, problem, who: str, required: bool = True) -> KLConstants | None:
    """The KL* constants; gamma defaults to the PL constant a convex loss + (reg/2)||w||^2 has
    (mu >= reg, gamma = 1/sqrt(2 reg))."""
    kappa = float(params.kl_kappa)
    gamma = params.kl_gamma
    if gamma is None and problem.reg > 0 and kappa == 2.0 and getattr(problem, "convex", False):
        gamma = 1.0 / math.sqrt(2.0 * problem.reg)
    if gamma is None:
        if not required:
            return None
        raise ValueError(
            f"{who} needs the KL* constant gamma: give kl_gamma (or, for a convex problem with kappa = 2, "
            f"reg > 0, which makes F reg-strongly convex hence PL with gamma = 1/sqrt(2 reg))"
        )
    return KLConstants(gamma=float(gamma), kappa=kappa, f0=params.kl_f0, beta=float(params.kl_beta))


@register("kl-adaptive-gd", AdaptiveKLGDParams, step_size=0.01, absence=ZERO_SUMS)
def build_kl_adaptive_gd(params: AdaptiveKLGDParams, ctx: BuildContext) -> AdaptiveKLGD:
    """Algorithm 3: adaptive noisy GD until the budget is spent (no KL constants needed)."""
    config = AdaptiveKLGDConfig(
        lr=params.lr,
        clip=params.clip,
        beta=float(params.kl_beta),
        neighbouring=ctx.neighbouring,
        norm_rho=params.kl_norm_rho,
        select=params.kl_select,
        select_fraction=float(params.kl_select_fraction),
        max_rounds=params.kl_max_rounds,
    )
    return AdaptiveKLGD(config, ctx.rho_left)


# kl-spider and kl-prox-point: not tuned (no run without --kl-gamma); the previous default
@register("kl-spider", KLSpiderParams, step_size=4.0, absence=ZERO_SUMS)
def build_kl_spider(params: KLSpiderParams, ctx: BuildContext) -> KLSpider:
    """Algorithm 1: private SPIDER under the KL* condition (kappa in [1, 2]; needs gamma)."""
    config = KLSpiderConfig(
        kl=_kl(params, ctx.problem, "kl-spider"),
        smoothness=float(_or(params.kl_smoothness, 1.0 / (2.0 * params.lr))),
        clip=params.clip,
        neighbouring=ctx.neighbouring,
        contraction_constant=float(_or(params.kl_contraction_constant, 64.0)),
        floor_constant=float(_or(params.kl_floor_constant, 32.0)),
        phases=params.kl_phases,
        max_rounds=params.kl_max_rounds,
    )
    return KLSpider(config, ctx.rho_left)


@register("kl-prox-point", ProxPointParams, step_size=4.0, absence=ZERO_SUMS)
def build_kl_prox_point(params: ProxPointParams, ctx: BuildContext) -> PrivateProxPoint:
    """Algorithms 2 + 4: private proximal point (kappa >= 2); inner rounds capped at ``rounds``."""
    prox_steps = params.kl_prox_steps
    config = ProxPointConfig(
        weak_convexity=float(_or(params.kl_weak_convexity, 1.0 / (2.0 * params.lr))),
        kl=_kl(params, ctx.problem, "kl-prox-point", required=prox_steps is None),
        clip=params.clip,
        neighbouring=ctx.neighbouring,
        contraction_constant=float(_or(params.kl_contraction_constant, 32.0)),
        prox_steps=prox_steps,
        inner_rounds=params.kl_inner_rounds,
        max_inner_rounds=params.rounds,
    )
    return PrivateProxPoint(config, ctx.rho_left)


__all__ = [
    "AdaptiveKLGD",
    "AdaptiveKLGDConfig",
    "AdaptiveKLGDParams",
    "KLConstants",
    "KLResult",
    "KLSpider",
    "KLSpiderConfig",
    "KLSpiderParams",
    "PrivateProxPoint",
    "ProxPointConfig",
    "ProxPointParams",
    "build_kl_adaptive_gd",
    "build_kl_prox_point",
    "build_kl_spider",
]
