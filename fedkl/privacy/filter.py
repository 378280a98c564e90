"""A fully adaptive zCDP privacy filter.

Guarantee: if an interaction runs mechanisms ``M_1, M_2, ...`` whose zCDP parameters ``rho_t`` are
chosen adaptively (each may depend on every earlier output) and the filter refuses any step that
would make ``sum_t rho_t`` exceed ``budget``, the whole interaction is ``budget``-zCDP.
Reference: Feldman & Zrnic (2021), Rényi-DP filters, applied at every order alpha; Whitehouse,
Ramdas, Rogers & Wu (2023), "Fully-adaptive composition in differential privacy", which shows such
filters lose nothing against fixed composition. Paper 000's Algorithm 3 relies on it.

Floating point: a step is admitted iff ``spent + rho <= budget * (1 + 1e-12)``; the tolerance only
absorbs rounding when a budget is split into equal parts, and the filter never reports less than
it admitted.
"""

from __future__ import annotations

import math

_REL_TOL = 1e-12


class BudgetExhausted(RuntimeError):
    """A release was refused because it would exceed a privacy budget. Nothing was released."""


class ZCDPFilter:
    def __init__(self, budget: float) -> None:
        if not (budget > 0 and math.isfinite(budget)):
            raise ValueError(f"the zCDP budget must be finite and > 0, got {budget}")
        self.budget = float(budget)
        self.spent = 0.0
        self.steps = 0

    @property
    def remaining(self) -> float:
        return max(self.budget - self.spent, 0.0)

    def admits(self, rho: float) -> bool:
        if not (rho >= 0 and math.isfinite(rho)):
            raise ValueError(f"rho must be finite and >= 0, got {rho}")
        return self.spent + rho <= self.budget * (1 + _REL_TOL)

    def spend(self, rho: float) -> None:
        """Record a release of cost ``rho``; raises :class:`BudgetExhausted` (and records nothing)
        if it does not fit."""
        if not self.admits(rho):
            raise BudgetExhausted(
                f"zCDP filter: a release costing rho={rho:.6g} would bring the total to "
                f"{self.spent + rho:.6g} > budget {self.budget:.6g}; refused"
            )
        self.spent += rho
        self.steps += 1
