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
(see ``notes/seed-000.md``, pitfall 1), so the constants below are derived, not copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fedkl.algorithms.registry import AlgorithmResult


def check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")


def check_count(name: str, value: int | None) -> None:
    """``None`` or a positive integer."""
    if value is not None and (int(value) != value or value < 1):
        raise ValueError(f"{name} must be a positive integer (or None), got {value!r}")


def log_bracket(f0: float, kappa: float, n: int, rho: float, gamma: float, lipschitz: float, d: int) -> float:
    """``log F0 + kappa log(n sqrt(rho) / (gamma L0 sqrt(d)))`` clamped to >= 1 (the bracket in the
    paper's K and T; it is <= 0 for small n, see the note's pitfall 6)."""
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


@dataclass
class KLResult(AlgorithmResult):
    """What the paper-000 algorithms return.

    ``w`` is the private output; ``rounds`` the number of federated rounds (queries to the users);
    ``sigma`` the noise std on the SUM of the last gradient release; ``rho_spent`` what this run
    charged (zCDP); ``details`` / ``history`` hold only data-independent parameters and
    post-processing of the releases (private outputs too).
    """

    w: torch.Tensor
    rounds: int
    sigma: float | None
    rho_spent: float
    history: list[dict] = field(default_factory=list)
    details: dict = field(default_factory=dict)


def project_ball(w: torch.Tensor, center: torch.Tensor, radius: float) -> torch.Tensor:
    """Euclidean projection of ``w`` onto the ball of ``radius`` around ``center``."""
    diff = w - center
    norm = float(diff.norm())
    return w if norm <= radius else center + diff * (radius / norm)
