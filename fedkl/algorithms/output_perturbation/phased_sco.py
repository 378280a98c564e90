"""Phased-SCO (paper 002, Algorithm 4, Theorem 5.1): localisation over DISJOINT user cohorts.

Phase i = 1..T uses only cohort i, about n / 2^i users (shared machinery and derivations in
:mod:`fedkl.algorithms.output_perturbation.phased_common`)::

    N0 = 8 kappa(eps, delta);  T = floor(log2(n / N0))                       # pitfall 5
    order = users sorted by sha256(seed, user_id)                             # public, data-independent
    cohort i = order[floor(n/2^i) : floor(n/2^(i-1))]                         # half-open, disjoint
    lam_i = lam 4^i;  theta^_i = Inner_{eps, delta, Delta_i}(l_i; cohort i)   # FULL (eps, delta)
    ⊥ -> keep theta^_{i-1};  else Proj_K(Clip_{B(theta^_{i-1}, G_c/lam_i)}(theta^_i))

Guarantee
---------
**(eps, delta)-DP, user level, relation replace-one, n public**, by parallel composition: the cohorts
are disjoint and chosen from the user ids and a public seed only (a user's data never decides which
cohort it is in), so a user's records enter exactly one inner release, which is (eps, delta)-DP
(Thm 3.3) and whose centre is an earlier private output of OTHER users' data (post-processing for
this user). Every other release is post-processing from this user's point of view. The ledger shows
each cohort user charged (eps, delta) once (by its own cohort's release) and the floor(n/2^T) unused
users never charged. :meth:`PhasedSCO.run` refuses before reading data if some cohort user cannot
afford (eps, delta).

Parameters (pitfall 6: the paper's lambda does not balance the 1/sqrt(nm) term)
---------------------------------------------------------------------------
lam = lambda_SCO = (G/D) sqrt((8 + 4 (T-1) d c^2 / n) / (n m)) minimises the re-derived bound
2 lam D^2 + (G^2/(lam n m))(16 + 8 (T-1) d c^2 / n) (Lemma 5.2 with n_i m samples per cohort), with c
the largest per-cohort noise constant (sigma/Delta at (eps, delta) x the threshold factor at n_i).
Delta_i = Delta_uc(2G, mu + lam_i, n_i, m, kappa, beta/T) by default; beta = 1/(nm).

The population excess risk it targets is O~(RG (sqrt(d)/(n sqrt m) + 1/sqrt(nm))); the exact fallback
of SCOutputPert limits every cohort to <= 20 users here, far below N0 at practical budgets.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from fedkl.algorithms.contract import SmallAudit
from fedkl.algorithms.output_perturbation.phased_common import (
    PhasedResult,
    PhaseSpec,
    check_approx_releaser,
    kappa,
    lam_sco,
    sco_cohorts,
    sco_min_cohort,
    sco_phases,
)
from fedkl.algorithms.output_perturbation.phased_erm import PhasedERM, PhasedPlan
from fedkl.algorithms.registry import register
from fedkl.federation.base import Federation
from fedkl.privacy.charges import ApproxDPCharge, Need
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, PAPER_002_RELATIONS, Guarantee
from fedkl.privacy.release import Releaser


@register
class PhasedSCO(PhasedERM):
    """Algorithm 4 of paper 002 (see the module docstring). Same constructor as
    :class:`~fedkl.algorithms.output_perturbation.phased_erm.PhasedERM`; the cohort hash's seed is the run's
    (``ctx.seed``)."""

    name = "phased-sco"
    guarantee = Guarantee(
        "approx-dp", "parallel", IN_CLASS_CLIENTS, relations=PAPER_002_RELATIONS
    )  # each user in one hashed cohort
    small: dict = {"reg": 0.1, "p002_delta_rule": "fixed", "p002_phases": 1, "p002_min_cohort": 4, "p002_lam": 0.05}
    audit = SmallAudit(epsilon=2.0, runs=70, users=100, records=2)

    def public_plan(self, n: int, w0: torch.Tensor, user_ids: tuple[str, ...] | None = None) -> PhasedPlan:
        return self.plan(n, w0, user_ids=user_ids)

    def plan(
        self, n: int, w0: torch.Tensor, *, distance: float | None = None, user_ids: tuple[str, ...] | None = None
    ) -> PhasedPlan:
        """N0, T, the cohorts (positions; needs ``user_ids``), lam and Delta_i: public."""
        p, st = self.params, self.setting
        m = p.p002_records
        if user_ids is None or len(user_ids) != n:
            raise ValueError("Phased-SCO's cohorts are a hash of the user ids: give all n user ids")
        n0 = p.p002_min_cohort
        if n0 is None:  # 8 kappa, and at least what the inner release accepts (the matching test: 8 kappa + 1)
            own = getattr(self.inner, "min_users", None)
            n0 = max(
                sco_min_cohort(self.eps, self.delta, p.p002_calibration),
                own(self.eps, self.delta) if own is not None else 0,
            )
        T = p.p002_phases if p.p002_phases is not None else sco_phases(n, n0)
        if T < 1:
            raise ValueError(
                f"Phased-SCO needs n >= 2 N0 = {2 * n0} users (N0 = 8 kappa(eps, delta) keeps every "
                f"cohort in Cor 3.7's regime), got n = {n}; nothing was read or charged"
            )
        if (n >> T) < 2:
            raise ValueError(f"{T} phases leave a last cohort of {n >> (T - 1)} - {n >> T} users at n = {n}: too few")
        cohorts = sco_cohorts(user_ids, T, self.ctx.seed)
        beta = p.p002_beta if p.p002_beta is not None else 1.0 / (n * m)
        beta_i = beta / T
        k = kappa(self.eps, self.delta, p.p002_calibration)
        c = self.noise_constant([len(ch) for ch in cohorts], self.eps, self.delta, k, beta_i)
        lam, D = self.base_lam(c, "lambda_SCO", w0, distance, lambda c_, G, D_: lam_sco(c_, G, D_, st.dim, n, m, T))
        specs = []
        for i, cohort in enumerate(cohorts, start=1):
            lam_i = lam * 4.0**i
            Delta_i = self.phase_delta(i, lam_i, len(cohort), k, beta_i)
            specs.append(PhaseSpec(i, self.eps, self.delta, lam_i, Delta_i, tuple(cohort)))
        return PhasedPlan(
            T,
            self.eps,
            self.delta,
            lam,
            beta,
            k,
            c,
            D,
            tuple(specs),
            {
                "min_cohort": n0,
                "cohort_sizes": [len(ch) for ch in cohorts],
                "unused_users": n - sum(len(ch) for ch in cohorts),
            },
        )

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Each user of a cohort: the run's (eps, delta) once (parallel composition); the unused users nothing.
        The cohorts are a hash of the ids and n (w0 enters only the phases' lam and Delta)."""
        plan = self.plan(len(user_ids), self.ctx.problem.init_params(), user_ids=tuple(user_ids))
        used = tuple(user_ids[u] for spec in plan.specs for u in spec.users)
        return (Need(used, ApproxDPCharge(self.eps, self.delta, "declared-needs")),)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> PhasedResult:
        check_approx_releaser(releaser, self.name)
        w0 = torch.as_tensor(w0)
        plan = self.plan(federation.num_users, w0, user_ids=federation.user_ids)
        return self.run_plan(
            federation, releaser, self.setting.project(w0.to(torch.float64)), plan, progress, out_dtype=w0.dtype
        )

    def run_plan(self, federation, releaser, center, plan, progress=None, **kw) -> PhasedResult:
        res = super().run_plan(federation, releaser, center, plan, progress, **kw)
        res.details["dp"] = (
            "approximate (eps, delta)-DP, user level, replace-one, n public; parallel composition "
            f"over {plan.phases} disjoint hashed cohorts, each user charged (eps, delta) once"
        )
        res.details.update(plan.extra)
        res.details["lam_rule"] = "given" if self.params.p002_lam is not None else "lambda_SCO (pitfall 6)"
        return res


__all__ = ["PhasedSCO"]
