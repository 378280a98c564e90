"""Empirical user-level privacy audits (``fedkl audit``): lower bounds on epsilon from the released
models of real runs, against the claimed (eps, delta). See :mod:`fedkl.audit.audit`."""

from fedkl.audit.audit import METHODS, format_report, many_run_audit, one_run_audit
from fedkl.audit.bounds import clopper_pearson_upper, epsilon_from_rates, gdp_bound, one_run_epsilon, two_sample_bound
from fedkl.audit.one_shot import one_shot_estimate
from fedkl.audit.whitebox import white_box_audit

__all__ = [
    "METHODS",
    "clopper_pearson_upper",
    "epsilon_from_rates",
    "format_report",
    "gdp_bound",
    "many_run_audit",
    "one_run_audit",
    "one_run_epsilon",
    "one_shot_estimate",
    "two_sample_bound",
    "white_box_audit",
]
