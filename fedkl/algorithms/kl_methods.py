"""Paper 000 (Menart et al.) algorithms for `fedkl run`: builders from a :class:`fedkl.runner.RunConfig`.

* ``kl-adaptive-gd`` — :class:`~fedkl.algorithms.kl_adaptive_gd.AdaptiveKLGD` (Algorithm 3; needs no
  KL constants; rounds run until the run's zCDP filter would be exhausted);
* ``kl-spider`` — :class:`~fedkl.algorithms.kl_spider.KLSpider` (Algorithm 1; kappa in [1, 2]);
* ``kl-prox-point`` — :class:`~fedkl.algorithms.prox_point.PrivateProxPoint` (Algorithms 2 + 4; kappa >= 2).

All three are user-level rho-zCDP (replace-one by default, add-remove available) with every
release charged through :meth:`fedkl.privacy.release.Releaser.gaussian` (and, for the optional
selection of Algorithm 3, :meth:`~fedkl.privacy.release.Releaser.exponential`); see each module.

Configuration: the builders read the existing RunConfig fields (``lr``, ``clip``, ``reg``,
``neighbouring``, ``rounds``) and the optional ``kl_*`` fields below through
``getattr(cfg, name, default)``:

=========================== ============ =====================================================
field                        default      meaning (T = follows the theorem, H = heuristic)
=========================== ============ =====================================================
kl_gamma                     None         gamma of the (gamma, kappa)-KL* condition (T). None:
                                          ``1/sqrt(2 reg)`` (a convex loss + (reg/2)||w||^2 is PL)
kl_kappa                     2.0          kappa (T)
kl_f0                        None         F0 >= F(w0) - F*; None: (clip gamma)^kappa (T)
kl_beta                      0.1          failure probability beta (T)
kl_smoothness                None         L1 (spider); None: 1/(2 lr), the L1 that lr = 1/(2 L1) implies
kl_weak_convexity            None         L~1 (prox point); None: 1/(2 lr), i.e. the prox step eta = lr
kl_contraction_constant      None         the 64 (spider) / 32 (prox point) in c, K, T (T); smaller: H
kl_floor_constant            None         the 32 in spider's Phi floor (T); smaller: H
kl_phases                    None         spider's K; None: the theorem's (T); a number: H
kl_prox_steps                None         prox point's T; None: the theorem's (T); a number: H
kl_inner_rounds              None         prox point's T_in; None: the theorem's capped at ``rounds`` (H)
kl_select                    "last"       adaptive GD output: "last" (Thm 4) or "exponential" (Thm 5)
kl_select_fraction           1/9          budget share of the selection; 1/9 = the paper's eps = sqrt(rho) (T)
kl_norm_rho                  None         adaptive GD norm-release cost; None: sqrt(rho)/n (T)
kl_max_rounds                None         cap on federated rounds (H; adaptive GD / spider)
=========================== ============ =====================================================

``rounds`` is used only by the prox point method (cap on its inner rounds per prox step): adaptive
GD runs until the budget is spent, spider runs its K phases.
"""
from __future__ import annotations

import math

from fedkl.algorithms.kl_adaptive_gd import AdaptiveKLGD, AdaptiveKLGDConfig
from fedkl.algorithms.kl_common import KLConstants, KLResult
from fedkl.algorithms.kl_spider import KLSpider, KLSpiderConfig
from fedkl.algorithms.prox_point import PrivateProxPoint, ProxPointConfig

HELP = (
    "paper-000 KL algorithms (kl-adaptive-gd, kl-spider, kl-prox-point): --kl-gamma/--kl-kappa/--kl-f0/--kl-beta, "
    "--kl-smoothness (default 1/(2 lr)), --kl-weak-convexity (default 1/(2 lr)), --kl-select, "
    "--kl-select-fraction and --kl-norm-rho default to the theorems' values; --kl-contraction-constant, "
    "--kl-floor-constant, --kl-phases, --kl-prox-steps, --kl-inner-rounds (default: the theorem's T_in capped "
    "at --rounds) and --kl-max-rounds are heuristics: they change the schedule (and the utility), never the "
    "privacy guarantee, which is exact for every value.")


# name: (default, --help sentence, "theorem" or "heuristic"): the table of the module docstring, for the CLI
HYPERPARAMETERS = {
    "kl_gamma": (None, "gamma of the (gamma, kappa)-KL* condition (default 1/sqrt(2 reg) for a convex problem "
                       "with --reg > 0, which makes F PL)", "theorem"),
    "kl_kappa": (2.0, "kappa of the KL* condition (2 = PL)", "theorem"),
    "kl_f0": (None, "F0 >= F(w0) - F* (default (clip gamma)^kappa)", "theorem"),
    "kl_beta": (0.1, "failure probability beta of the rates", "theorem"),
    "kl_smoothness": (None, "kl-spider: L1 (default 1/(2 lr))", "theorem"),
    "kl_weak_convexity": (None, "kl-prox-point: L~1 (default 1/(2 lr), i.e. the prox step is lr)", "theorem"),
    "kl_contraction_constant": (None, "the 64 (spider) / 32 (prox point) in c, K, T; smaller values are heuristic",
                                "theorem"),
    "kl_floor_constant": (None, "kl-spider: the 32 in the Phi floor; smaller values are heuristic", "theorem"),
    "kl_phases": (None, "kl-spider: number of phases K (default the theorem's)", "heuristic"),
    "kl_prox_steps": (None, "kl-prox-point: outer steps T (default the theorem's)", "heuristic"),
    "kl_inner_rounds": (None, "kl-prox-point: inner rounds T_in (default the theorem's, capped at --rounds)",
                        "heuristic"),
    "kl_select": ("last", "kl-adaptive-gd output: last (Thm 4) or exponential (Thm 5, exponential-mechanism "
                          "selection of an iterate)", "theorem"),
    "kl_select_fraction": (1.0 / 9.0, "kl-adaptive-gd: budget share of the exponential selection (1/9: the "
                                      "paper's eps = sqrt(rho))", "theorem"),
    "kl_norm_rho": (None, "kl-adaptive-gd: zCDP cost of each gradient-norm release (default sqrt(rho)/n)", "theorem"),
    "kl_max_rounds": (None, "kl-adaptive-gd / kl-spider: cap on federated rounds", "heuristic"),
}
CHOICES = {"kl_select": ("last", "exponential")}


def _opt(cfg, name: str, default=None):
    value = getattr(cfg, name, default)
    return default if value is None else value


def _gamma(cfg, problem, kappa: float, who: str, required: bool = True) -> float | None:
    """``kl_gamma``, else the PL constant a convex loss + (reg/2)||w||^2 has: mu >= reg, gamma = 1/sqrt(2 reg)."""
    gamma = getattr(cfg, "kl_gamma", None)
    if gamma is not None:
        return float(gamma)
    if cfg.reg > 0 and kappa == 2.0 and getattr(problem, "convex", False):
        return 1.0 / math.sqrt(2.0 * cfg.reg)
    if not required:
        return None
    raise ValueError(f"{who} needs the KL* constant gamma: give kl_gamma (or, for a convex problem with kappa = 2, "
                     f"reg > 0, which makes F reg-strongly convex hence PL with gamma = 1/sqrt(2 reg))")


def _kl(cfg, problem, who: str, required: bool = True) -> KLConstants | None:
    kappa = float(_opt(cfg, "kl_kappa", 2.0))
    gamma = _gamma(cfg, problem, kappa, who, required)
    if gamma is None:
        return None
    return KLConstants(gamma=gamma, kappa=kappa, f0=getattr(cfg, "kl_f0", None), beta=float(_opt(cfg, "kl_beta", 0.1)))


def build_kl_adaptive_gd(cfg, rho_total: float, *, problem=None, dataset=None, delta=None, ledger=None,
                         user_ids=None) -> AdaptiveKLGD:
    """Algorithm 3 (no KL constants needed)."""
    config = AdaptiveKLGDConfig(
        lr=cfg.lr, clip=cfg.clip, beta=float(_opt(cfg, "kl_beta", 0.1)), neighbouring=cfg.neighbouring,
        norm_rho=getattr(cfg, "kl_norm_rho", None), select=_opt(cfg, "kl_select", "last"),
        select_fraction=float(_opt(cfg, "kl_select_fraction", 1.0 / 9.0)),
        max_rounds=getattr(cfg, "kl_max_rounds", None))
    return AdaptiveKLGD(config, rho_total)


def build_kl_spider(cfg, rho_total: float, *, problem=None, dataset=None, delta=None, ledger=None,
                    user_ids=None) -> KLSpider:
    """Algorithm 1 (kappa in [1, 2]; needs gamma: kl_gamma, or reg > 0 on a convex problem)."""
    config = KLSpiderConfig(
        kl=_kl(cfg, problem, "kl-spider"), smoothness=float(_opt(cfg, "kl_smoothness", 1.0 / (2.0 * cfg.lr))),
        clip=cfg.clip, neighbouring=cfg.neighbouring,
        contraction_constant=float(_opt(cfg, "kl_contraction_constant", 64.0)),
        floor_constant=float(_opt(cfg, "kl_floor_constant", 32.0)), phases=getattr(cfg, "kl_phases", None),
        max_rounds=getattr(cfg, "kl_max_rounds", None))
    return KLSpider(config, rho_total)


def build_kl_prox_point(cfg, rho_total: float, *, problem=None, dataset=None, delta=None, ledger=None,
                        user_ids=None) -> PrivateProxPoint:
    """Algorithms 2 + 4 (kappa >= 2); the theorem's inner rounds are capped at ``cfg.rounds``."""
    prox_steps = getattr(cfg, "kl_prox_steps", None)
    config = ProxPointConfig(
        weak_convexity=float(_opt(cfg, "kl_weak_convexity", 1.0 / (2.0 * cfg.lr))),
        kl=_kl(cfg, problem, "kl-prox-point", required=prox_steps is None), clip=cfg.clip,
        neighbouring=cfg.neighbouring, contraction_constant=float(_opt(cfg, "kl_contraction_constant", 32.0)),
        prox_steps=prox_steps, inner_rounds=getattr(cfg, "kl_inner_rounds", None), max_inner_rounds=cfg.rounds)
    return PrivateProxPoint(config, rho_total)


KL_BUILDERS = {"kl-adaptive-gd": build_kl_adaptive_gd, "kl-spider": build_kl_spider,
               "kl-prox-point": build_kl_prox_point}

__all__ = ["CHOICES", "HYPERPARAMETERS", "AdaptiveKLGD", "AdaptiveKLGDConfig", "HELP", "KLConstants", "KLResult", "KLSpider", "KLSpiderConfig",
           "KL_BUILDERS", "PrivateProxPoint", "ProxPointConfig", "build_kl_adaptive_gd", "build_kl_prox_point",
           "build_kl_spider"]
