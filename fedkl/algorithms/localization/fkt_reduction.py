"""The strongly convex reduction of paper 003 (Thm 5.1; fedkl name ``fkt-sc-reduction``).

Run a convex localization algorithm (Phased-SGD, or the paper-003 Phased-ERM) k = ceil(log2 log2 n)
times, each run warm-started at the previous run's output and given its own pool of FRESH users of
GROWING size n_j = floor(2^(j-2) n / log2 n) (sum < n; note pitfall 4: the pools grow). Run j uses the
distance bound D_{j-1} that strong convexity gives from the previous run's guarantee:

    D_0 = min(L/lam, D, diam K)       (lam ||w0 - w*||^2 <= <grad F(w0), w0 - w*> <= L ||w0 - w*||)
    D_j = min(sqrt(2 c L D_{j-1} (1/sqrt(n_j) + sqrt(d)/(rho_p n_j)) / lam), diam K)

where c is the inner algorithm's constant (Thm 4.4: ~20 with the exact noise, see PhasedSGD). D_j
only sets step sizes (public values): it never enters a sensitivity. Rate (Thm 5.1):
O((L^2/lam)(1/n + d/(rho_p^2 n^2))); linear time with Phased-SGD when beta/lam = O(max{sqrt(n/log n),
sqrt(d)/rho_p}).

**Guarantee: user-level rho-zCDP**, that of the inner algorithm: the pools are disjoint and every
user is in one phase of one run, charged rho once by that phase's Gaussian release (parallel
composition); replace-one (default) or add-remove, n public. **Private outputs:** every run's phase
outputs (the model is the last one). **Client view:** that of the inner solver (see
:mod:`fedkl.algorithms.localization.fkt_phased`; use the one-shot solver where intermediate iterates must not
reach clients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from fedkl.algorithms.localization.fkt_common import (
    ConvexSetting,
    FKTResult,
    check_parallel_releaser,
    check_zcdp_budget,
    cohort_order,
    paper_rho,
    project,
)
from fedkl.algorithms.localization.fkt_phased import FKTPhasedERM, LocalizationConfig, PhasedSGD
from fedkl.federation.base import Federation
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, Guarantee
from fedkl.privacy.release import Releaser

INNER = {"phased-sgd": PhasedSGD, "phased-erm": FKTPhasedERM}


@dataclass(frozen=True)
class SCReductionConfig:
    """``inner``: the convex algorithm; ``c``: its constant in c L D (1/sqrt(n) + sqrt(d)/(rho_p n));
    ``localization``: the inner algorithm's configuration (solver, relation, seed, ...)."""

    inner: str = "phased-sgd"
    c: float = 20.0
    localization: LocalizationConfig = field(default_factory=LocalizationConfig)

    def __post_init__(self) -> None:
        if self.inner not in INNER:
            raise ValueError(f"inner must be one of {tuple(INNER)}, got {self.inner!r}")
        if not (self.c > 0 and math.isfinite(self.c)):
            raise ValueError(f"c must be finite and > 0, got {self.c}")


def pool_sizes(n: int) -> list[int]:
    """n_j = floor(2^(j-2) n / log2 n), j = 1..ceil(log2 log2 n) (at least one run)."""
    if n < 4:
        raise ValueError(f"the strongly convex reduction needs at least 4 users, got {n}")
    log_n = math.log2(n)
    k = max(1, math.ceil(math.log2(log_n)))
    return [int(2.0 ** (j - 2) * n / log_n) for j in range(1, k + 1)]


class SCReduction:
    """See the module docstring."""

    name = "fkt-sc-reduction"
    guarantee = Guarantee("zcdp", "parallel", IN_CLASS_CLIENTS)

    def __init__(self, config: SCReductionConfig, setting: ConvexSetting, rho_total: float) -> None:
        setting.require_strongly_convex(self.name)
        self.config, self.setting = config, setting
        self.inner = INNER[config.inner](config.localization, setting, rho_total)
        self.rho_total = self.inner.rho_total

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> FKTResult:
        check_parallel_releaser(releaser, self.name)
        s, cfg = self.setting, self.config
        w = project(torch.as_tensor(w0).to(torch.float64).clone(), s.radius)
        order = cohort_order(federation.user_ids, cfg.localization.seed)
        lam, L = s.strong_convexity, s.lipschitz
        dist = min(L / lam, s.diameter, s.distance if s.distance is not None else math.inf)
        plans, dists, start = [], [], 0
        for size in pool_sizes(federation.num_users):  # the whole public plan first
            pool = order[start : start + size]
            start += size
            plans.append(self.inner.plan(pool, dist))
            dists.append(dist)
            bound = cfg.c * L * dist * (1 / math.sqrt(size) + math.sqrt(s.dim) / (paper_rho(self.rho_total) * size))
            dist = min(math.sqrt(2.0 * bound / lam), s.diameter)
        check_zcdp_budget(
            releaser, federation.ids_of([u for p in plans for ph in p for u in ph.users]), self.rho_total, self.name
        )
        total, records = sum(len(p) for p in plans), []
        for j, phases in enumerate(plans, start=1):
            w, recs = self.inner.run_phases(
                federation, releaser, w, phases, f"{self.name}/run-{j}", progress, offset=len(records), total=total
            )
            records += [{**r, "run": j} for r in recs]
        details = self.inner.describe(federation, records)
        details.update(
            {
                "inner": cfg.inner,
                "runs": len(plans),
                "pool_sizes": [sum(len(ph.users) for ph in p) for p in plans],
                "distances": dists,
                "c": cfg.c,
                "strong_convexity": lam,
            }
        )
        return FKTResult(
            w=w.to(torch.as_tensor(w0).dtype),
            rounds=total,
            sigma=[r["sigma"] for r in records],
            details=details,
            history=records,
        )
