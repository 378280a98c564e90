"""The audit's small setting per algorithm: ONE place, read by ``fedkl audit``, the CI audit of every
registered algorithm (tests/audit/test_audit_run.py) and simulations/studies/audit.toml; ``--set``
and the CLI's options override it.

``fedkl run`` settings common to all (:data:`AUDIT_DEFAULTS`), each applied where the algorithm has it:

* ``reg = 0.1``: the strongly convex algorithms refuse a loss without it (and the others accept it);
* ``radius = 5`` where the algorithm has a domain (paper 002/003 need a public bound on ||w - w*||);
* ``clip = 0.1`` where it clips: below the logistic loss's gradient 1/2 at w = 0, so the outlier's
  term sits at the clip and the pair reaches the sensitivity the noise was calibrated for.

Per algorithm (its class's ``audit``, a :class:`~fedkl.algorithms.contract.SmallAudit` that ``@register``
requires of every algorithm): the claimed
eps, the runs per dataset and the size of the many-run pair (:func:`fedkl.audit.worlds.neighbour_pair`)
of the CI audit, plus the algorithm's own settings. Most take the default (eps 0.5, 40 runs, 40 users
of 10 records). The paper-002 algorithms refuse that (their theorems need n >= c kappa(eps, delta)
users per call, hundreds at eps = 0.5): they are audited at a claim of eps = 2 with 70 runs a side (the
most the bound can show is then 2.3 > 2, so the audit can refute the claim), on 100-260 users of few
records (each run stays cheap), at settings their theorems cover (fewer phases, the matching score:
both proven, polynomial).
"""

from __future__ import annotations

import dataclasses

from fedkl.algorithms.catalog import REGISTRY
from fedkl.algorithms.contract import SmallAudit

AUDIT_DEFAULTS = {"reg": 0.1, "radius": 5.0, "clip": 0.1}
RUN_LEVEL = ("reg",)


def small_audit(algorithm: str) -> SmallAudit:
    """``algorithm``'s :class:`SmallAudit`: its class's declaration."""
    if algorithm not in REGISTRY:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    return REGISTRY[algorithm].audit


def small_settings(algorithm: str, overrides: dict | None = None) -> dict:
    """The audit's ``fedkl run`` settings for ``algorithm`` (module docstring), then ``overrides``."""
    own = {f.name for f in dataclasses.fields(REGISTRY[algorithm].params)}
    out = {k: v for k, v in AUDIT_DEFAULTS.items() if k in RUN_LEVEL or k in own}
    out.update(small_audit(algorithm).settings)
    out.update(overrides or {})
    return out
