"""Privacy core: mechanisms, accountants, the zCDP filter, the per-user ledger and the release gate."""

from fedkl.privacy.accounting import GaussianSchedule, noise_multiplier_for, schedule_epsilon
from fedkl.privacy.filter import BudgetExhausted, ZCDPFilter
from fedkl.privacy.ledger import Budget, BudgetExceeded, LedgerBusy, LedgerError, PrivacyLedger, UserSpend
from fedkl.privacy.mechanisms import (
    ExponentialMechanism,
    GaussianMechanism,
    LaplaceMechanism,
    ReportNoisyMax,
    TruncatedDiscreteLaplace,
)
from fedkl.privacy.release import Releaser
from fedkl.privacy.rng import NoiseSource
from fedkl.privacy.zcdp import ZCDPAccountant, delta_cks, eps_bun_steinke, eps_cks, rho_for_eps_delta, zcdp_to_eps

__all__ = [
    "Budget",
    "BudgetExceeded",
    "BudgetExhausted",
    "ExponentialMechanism",
    "GaussianMechanism",
    "GaussianSchedule",
    "LaplaceMechanism",
    "LedgerBusy",
    "LedgerError",
    "NoiseSource",
    "PrivacyLedger",
    "Releaser",
    "ReportNoisyMax",
    "TruncatedDiscreteLaplace",
    "UserSpend",
    "ZCDPAccountant",
    "ZCDPFilter",
    "delta_cks",
    "eps_bun_steinke",
    "eps_cks",
    "noise_multiplier_for",
    "rho_for_eps_delta",
    "schedule_epsilon",
    "zcdp_to_eps",
]
