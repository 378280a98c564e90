"""The audit's small setting per algorithm: ``fedkl run`` settings that make the synthetic audit
federation (:mod:`fedkl.audit.worlds`) a setting the algorithm's theorem covers and a worst case
for it. One place; ``fedkl audit`` and simulations/studies/audit.toml start from it and ``--set``
overrides it.

* ``reg = 0.1``: the strongly convex algorithms refuse a loss without it (and the others accept it);
* ``radius = 5`` where the algorithm has a domain (paper 002/003 need a public bound on ||w - w*||);
* ``clip = 0.1`` where it clips: below the logistic loss's gradient 1/2 at w = 0, so the outlier's
  term sits at the clip and the pair reaches the sensitivity the noise was calibrated for.
"""

from __future__ import annotations

import dataclasses

from fedkl.algorithms.catalog import REGISTRY

AUDIT_DEFAULTS = {"reg": 0.1, "radius": 5.0, "clip": 0.1}
RUN_LEVEL = ("reg",)


def small_settings(algorithm: str, overrides: dict | None = None) -> dict:
    """The audit's settings for ``algorithm`` (module docstring), then ``overrides``."""
    own = {f.name for f in dataclasses.fields(REGISTRY[algorithm].params)}
    out = {k: v for k, v in AUDIT_DEFAULTS.items() if k in RUN_LEVEL or k in own}
    out.update(overrides or {})
    return out
