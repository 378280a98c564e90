"""Paper 002 (Ghazi et al., "On User-Level Private Convex Optimization") phased algorithms in fedkl:
names, builders, hyperparameters.

| name | paper | problem class | guarantee (user level, replace-one, n public) | ledger per user | rate |
|---|---|---|---|---|---|
| ``phased-erm`` | Alg 3, Thm 4.1 | convex, G-Lipschitz | (eps, delta)-DP, basic composition | T x (eps/T, delta/T), T = ceil(ln nm) | O~(R G sqrt(d)/(n sqrt m)) empirical |
| ``phased-sco`` | Alg 4, Thm 5.1 | convex, G-Lipschitz | (eps, delta)-DP, parallel composition over hashed cohorts | (eps, delta) once, own cohort only | O~(R G (sqrt(d)/(n sqrt m) + 1/sqrt(nm))) population |
| ``sc-phased-erm`` | Alg 5, Thm 4.3 | mu-strongly convex, G-Lipschitz | (eps, delta)-DP | (eps/2, delta/2) + T x (eps/(2T), delta/(2T)) | O~(G^2 d/(mu n^2 m)) empirical |
| ``sc-phased-sco`` | Alg 6, Thm 5.3 | mu-strongly convex, G-Lipschitz | (eps, delta)-DP | (eps/2, delta/2) + (eps/2, delta/2) if in a cohort | O~((G^2/mu)(d/(n^2 m) + 1/(nm))) population |

Every builder has the runner's signature ``build(cfg, rho_total, *, problem, dataset, delta, ledger,
user_ids)``, takes its (eps, delta) from ``ledger.approx_left(user_ids)`` (the whole budget on a fresh
ledger), and reads :data:`HYPERPARAMETERS` with ``getattr(cfg, name, default)`` plus the existing
``RunConfig`` fields ``seed`` (Phased-SCO's cohort hash) and ``stability_delta`` (only with
``p002_delta_rule = "fixed"``); ``rounds``, ``lr``, ``clip``, ``phased_lam`` are NOT read. All four
make (eps, delta) releases (their classes declare ``Guarantee("approx-dp", ...)``), so the runner gives
them a Releaser WITHOUT the zCDP filter; they refuse a filtered Releaser before reading data.
"""
from __future__ import annotations

from fedkl.algorithms.phased_common import CHOICES, HYPERPARAMETERS
from fedkl.algorithms.phased_erm import PhasedConfig, PhasedERM, build_phased_erm
from fedkl.algorithms.phased_sco import PhasedSCO, build_phased_sco
from fedkl.algorithms.sc_phased import SCPhasedERM, SCPhasedSCO, build_sc_phased_erm, build_sc_phased_sco

PHASED_BUILDERS = {
    "phased-erm": build_phased_erm,
    "phased-sco": build_phased_sco,
    "sc-phased-erm": build_sc_phased_erm,
    "sc-phased-sco": build_sc_phased_sco,
}

__all__ = ["CHOICES", "HYPERPARAMETERS", "PHASED_BUILDERS", "PhasedConfig", "PhasedERM", "PhasedSCO", "SCPhasedERM",
           "SCPhasedSCO", "build_phased_erm", "build_phased_sco", "build_sc_phased_erm", "build_sc_phased_sco"]
