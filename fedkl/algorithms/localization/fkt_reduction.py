"""The strongly convex reduction of paper 003 (Thm 5.1; fedkl name ``fkt-sc-reduction``).

Run a convex localization algorithm (Phased-SGD, or the paper-003 Phased-ERM) k = ceil(log2 log2 n)
times, each run warm-started at the previous run's output and given its own pool of FRESH users of
GROWING size n_j = floor(2^(j-2) n / log2 n) (sum < n; docs/derivations/paper-003.md §6, pitfall 4:
the pools grow). Run j uses the distance bound D_{j-1} that strong convexity gives from the previous
run's guarantee:

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
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from fedkl.algorithms.contract import Algorithm, BuildContext, SmallAudit, param
from fedkl.algorithms.localization.fkt_common import (
    FKTResult,
    check_parallel_releaser,
    cohort_order,
    paper_rho,
    project,
)
from fedkl.algorithms.localization.fkt_phased import FKTPhasedERM, LocalizationParams, PhasedSGD, localization_view
from fedkl.algorithms.registry import register
from fedkl.federation.base import Federation
from fedkl.privacy.charges import GaussianCharge, Need
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, ZERO_SUMS, Guarantee
from fedkl.privacy.release import Releaser

INNER = {"phased-sgd": PhasedSGD, "phased-erm": FKTPhasedERM}


@dataclass(frozen=True)
class ReductionParams(LocalizationParams):
    """``fkt_inner``: the convex algorithm; ``fkt_reduction_c``: its constant c in
    c L D (1/sqrt(n) + sqrt(d)/(rho_p n)); the inner algorithm reads the other settings."""

    fkt_inner: str = param(
        "phased-sgd",
        "fkt-sc-reduction inner algorithm: phased-sgd or phased-erm",
        "theorem",
        choices=("phased-sgd", "phased-erm"),
    )
    fkt_reduction_c: float = param(
        20.0,
        "fkt-sc-reduction: the inner algorithm's constant c in c L D (1/sqrt n + sqrt d/(rho_p n)) that sets "
        "the next run's distance bound (20: Thm 4.4's proof with the exact noise)",
        "theorem (a constant derived from its proof)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.fkt_reduction_c > 0 and math.isfinite(self.fkt_reduction_c)):
            raise ValueError(f"--fkt-reduction-c must be finite and > 0, got {self.fkt_reduction_c}")


def pool_sizes(n: int) -> list[int]:
    """n_j = floor(2^(j-2) n / log2 n), j = 1..ceil(log2 log2 n) (at least one run)."""
    if n < 4:
        raise ValueError(f"the strongly convex reduction needs at least 4 users, got {n}")
    log_n = math.log2(n)
    k = max(1, math.ceil(math.log2(log_n)))
    return [int(2.0 ** (j - 2) * n / log_n) for j in range(1, k + 1)]


@register
class SCReduction(Algorithm[ReductionParams]):
    """The strongly convex reduction (Thm 5.1) around a convex phased algorithm.

    See the module docstring; ``inner`` is the ``--fkt-inner`` algorithm built from the same Params and
    context (each user's zCDP budget: the run's zCDP left)."""

    name = "fkt-sc-reduction"
    Params = ReductionParams
    guarantee = Guarantee("zcdp", "parallel", IN_CLASS_CLIENTS)
    absence = ZERO_SUMS
    clients_see = staticmethod(localization_view)
    small = {"radius": 2.0, "reg": 0.1, "users": 48}
    audit = SmallAudit()

    def __init__(self, params: ReductionParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.setting = params.setting(ctx)
        self.setting.require_strongly_convex(self.name)
        self.inner = INNER[params.fkt_inner](params, ctx)
        self.rho_total = self.inner.rho_total

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Each user of an inner run's phase: ``rho_total`` once (parallel composition); the others nothing."""
        order, used, start = cohort_order(user_ids, self.ctx.seed), [], 0
        for size in pool_sizes(len(order)):
            used += self.inner.used(order[start : start + size])
            start += size
        return (Need(tuple(user_ids[u] for u in used), GaussianCharge(self.rho_total)),)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> FKTResult:
        check_parallel_releaser(releaser, self.name)
        s, c = self.setting, self.params.fkt_reduction_c
        w = project(torch.as_tensor(w0).to(torch.float64).clone(), s.radius)
        order = cohort_order(federation.user_ids, self.ctx.seed)
        lam, L = s.strong_convexity, s.lipschitz
        dist = min(L / lam, s.diameter, s.distance if s.distance is not None else math.inf)
        plans, dists, start = [], [], 0
        for size in pool_sizes(federation.num_users):  # the whole public plan first
            pool = order[start : start + size]
            start += size
            plans.append(self.inner.plan(pool, dist))
            dists.append(dist)
            bound = c * L * dist * (1 / math.sqrt(size) + math.sqrt(s.dim) / (paper_rho(self.rho_total) * size))
            dist = min(math.sqrt(2.0 * bound / lam), s.diameter)
        total, records = sum(len(p) for p in plans), []
        for j, phases in enumerate(plans, start=1):
            w, recs = self.inner.run_phases(
                federation, releaser, w, phases, f"{self.name}/run-{j}", progress, offset=len(records), total=total
            )
            records += [{**r, "run": j} for r in recs]
        details = self.inner.describe(federation, records)
        details.update(
            {
                "inner": self.params.fkt_inner,
                "runs": len(plans),
                "pool_sizes": [sum(len(ph.users) for ph in p) for p in plans],
                "distances": dists,
                "c": c,
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
