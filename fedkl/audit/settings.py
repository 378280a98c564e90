"""The audit's small setting per algorithm: ONE place, read by ``fedkl audit``, the CI audit of every
registered algorithm (tests/audit/test_audit_run.py) and simulations/studies/audit.toml; ``--set``
and the CLI's options override it.

``fedkl run`` settings common to all (:data:`AUDIT_DEFAULTS`), each applied where the algorithm has it:

* ``reg = 0.1``: the strongly convex algorithms refuse a loss without it (and the others accept it);
* ``radius = 5`` where the algorithm has a domain (paper 002/003 need a public bound on ||w - w*||);
* ``clip = 0.1`` where it clips: below the logistic loss's gradient 1/2 at w = 0, so the outlier's
  term sits at the clip and the pair reaches the sensitivity the noise was calibrated for.

Per algorithm (:data:`SMALL_AUDITS`, a :class:`SmallAudit` for EVERY registered algorithm): the claimed
eps, the runs per dataset and the size of the many-run pair (:func:`fedkl.audit.worlds.neighbour_pair`)
of the CI audit, plus the algorithm's own settings. Most take the default (eps 0.5, 40 runs, 40 users
of 10 records). The paper-002 algorithms refuse that (their theorems need n >= c kappa(eps, delta)
users per call, hundreds at eps = 0.5): they are audited at a claim of eps = 2 with 70 runs a side (the
most the bound can show is then 2.3 > 2, so the audit can refute the claim), on 100-260 users of few
records (each run stays cheap), at settings their theorems cover (fewer phases, the matching score:
both proven, polynomial). A new algorithm needs an entry here: the CI audit fails until it has one.
"""

from __future__ import annotations

import dataclasses

from fedkl.algorithms.catalog import REGISTRY
from fedkl.algorithms.contract import SmallAudit

AUDIT_DEFAULTS = {"reg": 0.1, "radius": 5.0, "clip": 0.1}
RUN_LEVEL = ("reg",)


DEFAULT = SmallAudit()
_P002 = {"epsilon": 2.0, "runs": 70}
SMALL_AUDITS: dict[str, SmallAudit] = {
    **{
        name: DEFAULT
        for name in (
            "dp-sgd",
            "dp-rmsprop",
            "dp-adam",
            "dp-adambc",
            "dp-fedavg",
            "fkt-snowball",
            "fkt-snowball-sc",
            "fkt-phased-sgd",
            "fkt-phased-erm",
            "fkt-sc-localization",
            "fkt-sc-reduction",
            "gll-phased-sgd",
            "kl-adaptive-gd",
            "kl-spider",
            "kl-prox-point",
            "noisy-fw",
            "noisy-gd",
            "noisy-gd-conc",
            "dp-ftrl",
            "vr-fw",
            "vr-fw-lp",
        )
    },
    # paper 001 Alg 6 needs a globally Lipschitz loss (no ridge term)
    "pg-mirror-descent": SmallAudit(settings={"reg": 0.0}),
    # paper 002 (module docstring): n >= 4 kappa + 2 (uc threshold), 8 kappa + 2 (matching), 2 N0 (SCO)
    "phased-erm": SmallAudit(**_P002, users=130, records=2, settings={"p002_phases": 2}),
    "phased-sco": SmallAudit(**_P002, users=100, records=2),
    "sc-phased-erm": SmallAudit(**_P002, users=120, records=2, settings={"p002_phases": 1}),
    "sc-phased-sco": SmallAudit(**_P002, users=260, records=2),
    "mean-output-pert": SmallAudit(**_P002, users=100, records=10, settings={"mean_test": "matching"}),
    "phased-mean-output-pert": SmallAudit(**_P002, users=150, records=2, settings={"mean_test": "matching"}),
    "sc-output-pert": SmallAudit(**_P002, users=100, records=10),
    # its PTR test needs the kept weight's noise well below n (module docstring): one round, 300 users, eps 2
    "noisy-gd-outlier": SmallAudit(
        **_P002, users=300, records=2, settings={"rounds": 1, "outlier_test_share": 0.5, "conc_records": 2}
    ),
}


def small_audit(algorithm: str) -> SmallAudit:
    """``algorithm``'s :class:`SmallAudit` (the default one for an algorithm without an entry; the CI
    audit refuses such an algorithm, so every registered one gets its entry)."""
    if algorithm not in REGISTRY:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    declared = REGISTRY[algorithm].audit  # the class's declaration (issue 29); else the legacy table
    return declared if declared is not None else SMALL_AUDITS.get(algorithm, DEFAULT)


def small_settings(algorithm: str, overrides: dict | None = None) -> dict:
    """The audit's ``fedkl run`` settings for ``algorithm`` (module docstring), then ``overrides``."""
    own = {f.name for f in dataclasses.fields(REGISTRY[algorithm].params)}
    out = {k: v for k, v in AUDIT_DEFAULTS.items() if k in RUN_LEVEL or k in own}
    out.update(small_audit(algorithm).settings)
    out.update(overrides or {})
    return out
