"""Shared pieces of paper 000's algorithms (Menart et al., DP non-convex optimization under KL*).

Notation (the paper's, mapped to users): ``F(w) = (1/n) sum_u f_u(w)`` with ``f_u`` the mean loss of
user u's records; ``L0`` is played by the per-user clip C; the (gamma, kappa)-KL* condition is
``F(w) - F* <= gamma^kappa ||grad F(w)||^kappa`` (kappa = 2 is PL: a PL constant mu, i.e.
``F - F* <= ||grad F||^2 / (2 mu)``, gives ``gamma = 1/sqrt(2 mu)``); ``F0 >= F(w0) - F*`` (default
``(L0 gamma)^kappa``, always valid by the paper's Section 2).

Every release is a SUM over users of terms whose norm is bounded by a clip B fixed before the round
(never by the data), released through :meth:`fedkl.privacy.release.Releaser.gaussian` with the
sensitivity :func:`sum_sensitivity` (2B replace-one, B add-remove); the algorithms divide by the
public n. The paper states its noise for the mean with Delta = L0/n and charges (Delta/sigma)^2;
fedkl instead charges every release exactly ``rho = Delta^2 / (2 sigma^2)`` with the relation's Delta
(see docs/derivations/paper-000.md §6, pitfall 1), so the constants below are derived, not copied.

The hyperparameters the three algorithms share are the mixins below (:class:`KLBase`,
:class:`KLConstantsParams`, :class:`MaxRounds`; one definition per flag); each algorithm's ``Params``
sits next to its class. ``None`` means the theorem's value: ``kl_gamma`` 1/sqrt(2 reg) (a convex loss +
(reg/2)||w||^2 is PL; :meth:`KLConstantsParams.constants`), ``kl_f0`` (clip gamma)^kappa,
``kl_smoothness`` and ``kl_weak_convexity`` 1/(2 lr), ``kl_contraction_constant`` 64 (spider) / 32 (prox
point), ``kl_floor_constant`` 32, ``kl_norm_rho`` sqrt(rho)/n; ``reg`` (through the problem) and
``neighbouring`` come from the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedkl.algorithms.contract import Algorithm, AlgorithmParams, Clip, ModelResult, P, SmallAudit, StepSize, param
from fedkl.privacy.guarantee import ZERO_SUMS, Guarantee, check_relation, sum_sensitivity


def check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")


def log_bracket(f0: float, kappa: float, n: int, rho: float, gamma: float, lipschitz: float, d: int) -> float:
    """``log F0 + kappa log(n sqrt(rho) / (gamma L0 sqrt(d)))`` clamped to >= 1 (the bracket in the
    paper's K and T; it is <= 0 for small n: docs/derivations/paper-000.md §6, pitfall 6)."""
    value = math.log(f0) + kappa * math.log(n * math.sqrt(rho) / (gamma * lipschitz * math.sqrt(d)))
    return max(1.0, value)


@dataclass(frozen=True)
class KLConstants:
    """The KL* constants of the objective, as the theorems take them.

    Attributes:
        gamma: gamma > 0 of the (gamma, kappa)-KL* condition.
        kappa: kappa >= 1.
        f0: an upper bound on F(w0) - F*; None means ``(L0 gamma)^kappa``.
        beta: the failure probability of the high-probability statements (only enters logs).
    """

    gamma: float
    kappa: float = 2.0
    f0: float | None = None
    beta: float = 0.1

    def __post_init__(self) -> None:
        check_positive("gamma", self.gamma)
        if not (self.kappa >= 1 and math.isfinite(self.kappa)):
            raise ValueError(f"kappa must be finite and >= 1, got {self.kappa!r}")
        if self.f0 is not None:
            check_positive("f0", self.f0)
        if not 0 < self.beta < 1:
            raise ValueError(f"beta must be in (0, 1), got {self.beta!r}")

    def initial_gap(self, lipschitz: float) -> float:
        """F0: the given bound, else ``(L0 gamma)^kappa``."""
        return self.f0 if self.f0 is not None else (lipschitz * self.gamma) ** self.kappa


@dataclass(frozen=True)
class KLBase(StepSize, Clip):
    kl_beta: float = param(0.1, "failure probability beta of the rates", "theorem")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.kl_beta < 1:
            raise ValueError(f"--kl-beta must be in (0, 1), got {self.kl_beta}")


@dataclass(frozen=True)
class KLConstantsParams(KLBase):
    kl_gamma: float | None = param(
        None,
        "gamma of the (gamma, kappa)-KL* condition (default 1/sqrt(2 reg) for a convex problem with --reg > 0, "
        "which makes F PL)",
        "theorem",
        positive=True,
    )
    kl_kappa: float = param(2.0, "kappa of the KL* condition (2 = PL)", "theorem")
    kl_f0: float | None = param(None, "F0 >= F(w0) - F* (default (clip gamma)^kappa)", "theorem", positive=True)
    kl_contraction_constant: float | None = param(
        None, "the 64 (spider) / 32 (prox point) in c, K, T; smaller values are heuristic", "theorem", positive=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.kl_kappa >= 1 and math.isfinite(self.kl_kappa)):
            raise ValueError(f"--kl-kappa must be finite and >= 1, got {self.kl_kappa}")

    def constants(self, problem, who: str, required: bool = True) -> KLConstants | None:
        """The KL* constants; gamma defaults to the PL constant a convex loss + (reg/2)||w||^2 has
        (mu >= reg, gamma = 1/sqrt(2 reg)). None when gamma is neither given nor derivable and not
        ``required``."""
        kappa = float(self.kl_kappa)
        gamma = self.kl_gamma
        if gamma is None and problem is not None and problem.reg > 0 and kappa == 2.0 and problem.convex:
            gamma = 1.0 / math.sqrt(2.0 * problem.reg)
        if gamma is None:
            if not required:
                return None
            raise ValueError(
                f"{who} needs the KL* constant gamma: give kl_gamma (or, for a convex problem with kappa = 2, "
                f"reg > 0, which makes F reg-strongly convex hence PL with gamma = 1/sqrt(2 reg))"
            )
        return KLConstants(gamma=float(gamma), kappa=kappa, f0=self.kl_f0, beta=float(self.kl_beta))


@dataclass(frozen=True)
class MaxRounds(AlgorithmParams):
    kl_max_rounds: int | None = param(
        None, "kl-adaptive-gd / kl-spider: cap on federated rounds", "heuristic", positive=True
    )


def or_default(value, default):
    """``value``, or ``default`` where it is None (the theorem's value)."""
    return default if value is None else value


# what the paper-000 algorithms return: ``w`` the private output; ``rounds`` the federated rounds (queries to
# the users); ``sigma`` the noise std on the SUM of the last gradient release; ``rho_spent`` what this run
# charged (zCDP); ``details`` / ``history`` only data-independent parameters and post-processing of the releases
KLResult = ModelResult


class KLAlgorithm(Algorithm[P]):
    """Base of the paper-000 algorithms (not registered): zCDP releases of sums of clipped gradients (a
    failed user's row is zero), the small audit. Built with ``self.kl``, the KL* constants it needs
    (:meth:`kl_constants`), then ``self.rho_total``, the run's zCDP budget (what is left of it,
    ``ctx.rho_left``), checked positive, with a neighbouring relation fedkl knows."""

    guarantee = Guarantee("zcdp")
    absence = ZERO_SUMS
    audit = SmallAudit()

    def __init__(self, params: P, ctx) -> None:
        super().__init__(params, ctx)
        self.kl = self.kl_constants(ctx)
        check_positive("rho_total", ctx.rho_left)
        check_relation(ctx.neighbouring)
        self.rho_total = float(ctx.rho_left)

    def kl_constants(self, ctx) -> KLConstants | None:
        return None  # needs none

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of a sum of gradients clipped to ``clip`` (and of its norm) under the relation."""
        return sum_sensitivity(self.params.clip, self.ctx.neighbouring)


def project_ball(w: torch.Tensor, center: torch.Tensor, radius: float) -> torch.Tensor:
    """Euclidean projection of ``w`` onto the ball of ``radius`` around ``center``."""
    diff = w - center
    norm = float(diff.norm())
    return w if norm <= radius else center + diff * (radius / norm)
