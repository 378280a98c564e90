"""Strongly convex ERM and SCO (paper 002, Algorithms 5 and 6; Theorems 4.3 and 5.3).

Both first LOCALISE with one SCOutputPert-like release on the mu-strongly convex loss, then run the
phased algorithm in a small ball around it (shared machinery: :mod:`fedkl.algorithms.output_perturbation.phased_common`)::

    theta0 = Inner_{eps/2, delta/2, Delta0}(l; x)      # all users, no extra regularizer (mu = problem's reg)
    ⊥ -> abort: nothing else is released, the result is "no output" (w = None)
    R' = sigma0 (sqrt(d) + sqrt(2 ln(1/beta)))          # Alg 5 (pitfall 8: the exact Gaussian norm tail;
                                                       #   the printed sigma0 sqrt(d log 1/beta) lacks the C)
       + 30 G sqrt(ln(2/beta)) / (mu sqrt(n m))        # Alg 6 only (Prop B.1's constant; printed without 30)
    theta^ = Phased-ERM_{eps/2, delta/2}(l; x)   from theta0 with D = R'   (Alg 5)
           | Phased-SCO_{eps/2, delta/2}(l; x)   from theta0 with D = R'   (Alg 6)

beta = 1/(2 n^2 m) (so that beta R G <= O(G^2/(mu n^2 m)) with diam K <= 2G/mu); Delta0 by the threshold
rule with (G, mu, n, kappa(eps/2, delta/2), beta). The phased part uses lambda* / lambda_SCO with D = R'
(pitfall 7/6; the paper prints lam = G sqrt(d)/(R' n sqrt m)). Centres are projected onto K (pitfall 3);
K' = K ∩ B(theta0, R') enters the bound only through D = R' >= ||theta0 - theta*|| (w.p. 1 - 2 beta):
the telescoping proof of Thm 4.1 uses the domain only in its first term lam_1 ||theta0 - theta*||^2 / 2,
and the inner releases minimise over R^d (see phased_common).

Guarantee
---------
**(eps, delta)-DP, user level, relation replace-one, n public**: theta0 is an (eps/2, delta/2)-DP
release; R', lam and the thresholds are public functions of public constants (sigma0 is the public
noise scale, not the noise); the phased part is (eps/2, delta/2)-DP for any public centre (here the
private theta0: adaptive basic composition); aborting on ⊥ is post-processing. Ledger: every user is
charged (eps/2, delta/2) by the localisation; then Alg 5 charges every user T x (eps/(2T), delta/(2T))
and Alg 6 charges each cohort user (eps/2, delta/2) once (users outside every cohort stop at eps/2).
:meth:`run` refuses before reading data if some user cannot afford its whole charge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from fedkl.algorithms.contract import Algorithm, BuildContext, SmallAudit
from fedkl.algorithms.output_perturbation.p002 import P002_ABSENCE
from fedkl.algorithms.output_perturbation.phased_common import (
    DeltaRule,
    InnerRelease,
    PhaseCall,
    PhasedResult,
    PhasedSetting,
    check_approx_releaser,
    inner_noise_ratio,
    kappa,
    precheck_calls,
    rule_delta,
)
from fedkl.algorithms.output_perturbation.phased_erm import PhasedERM, PhasedParams, PhasedPlan
from fedkl.algorithms.output_perturbation.phased_sco import PhasedSCO
from fedkl.algorithms.registry import register
from fedkl.federation.base import Federation
from fedkl.privacy.charges import ApproxDPCharge, Need
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, PAPER_002_RELATIONS, SOLVER_ITERATES, Guarantee
from fedkl.privacy.release import Releaser


@dataclass(frozen=True)
class SCPlan:
    """Public schedule: the localisation call and the phased plan that follows it."""

    eps0: float
    delta0: float
    Delta0: float
    kappa0: int
    sigma0: float
    beta: float
    radius_prime: float
    phased: PhasedPlan


class _StronglyConvexPhased(Algorithm[PhasedParams]):
    """Algorithms 5/6 (see the module docstring); ``phased_class`` is PhasedERM or PhasedSCO, run as an
    internal engine on half the budget. Same constructor as
    :class:`~fedkl.algorithms.output_perturbation.phased_erm.PhasedERM`."""

    Params = PhasedParams
    guarantee = Guarantee("approx-dp", clients=IN_CLASS_CLIENTS, relations=PAPER_002_RELATIONS)
    absence = P002_ABSENCE
    clients_see = SOLVER_ITERATES
    phased_class: type = PhasedERM
    population = False  # Alg 6 adds Prop B.1's statistical radius to R'

    def __init__(
        self,
        params: PhasedParams,
        ctx: BuildContext,
        *,
        setting: PhasedSetting | None = None,
        inner: InnerRelease | None = None,
        delta_rule: DeltaRule | None = None,
    ) -> None:
        super().__init__(params, ctx)
        self.rule: DeltaRule = params.p002_delta_rule if delta_rule is None else delta_rule
        if self.rule == "fixed":
            raise ValueError(f"{self.name}: the fixed threshold rule has no localisation threshold; use uc or scaled")
        self.eps, self.delta = ctx.approx_budget()
        # the phased part's budget: (eps/2, delta/2) of what every user can still afford
        self._half = replace(ctx, approx_left=(self.eps / 2, self.delta / 2))
        self._template = self.phased_class(params, self._half, setting=setting, inner=inner, delta_rule=delta_rule)
        self.setting = self._template.setting
        self.inner = self._template.inner

    def _phased(self, beta: float) -> PhasedERM:
        p = replace(self.params, p002_beta=beta)
        return self.phased_class(p, self._half, setting=self.setting, inner=self.inner, delta_rule=self.rule)

    def plan(self, n: int, w0: torch.Tensor, user_ids: tuple[str, ...] | None = None) -> SCPlan:
        p, st = self.params, self.setting
        mu = st.strong_convexity
        if not mu > 0:
            raise ValueError(f"{self.name} needs a strongly convex loss: give --reg > 0 (nothing was read or charged)")
        G = st.require_lipschitz(self.name)
        m = p.p002_records
        beta = p.p002_beta if p.p002_beta is not None else 1.0 / (2.0 * n * n * m)
        eps0, delta0 = self.eps / 2, self.delta / 2
        k0 = kappa(eps0, delta0, p.p002_calibration)
        Delta0 = rule_delta(self.rule, G_call=G, mu=mu, n_call=n, m=m, kappa_=k0, beta=beta, scale=p.p002_delta_scale)
        sigma0 = inner_noise_ratio(self.inner, n, eps0, delta0, p.p002_calibration) * Delta0
        r = sigma0 * (math.sqrt(st.dim) + math.sqrt(2.0 * math.log(1.0 / beta)))
        if self.population:
            r += 30.0 * G * math.sqrt(math.log(2.0 / beta)) / (mu * math.sqrt(n * m))
        phased = self._phased(beta)
        kw = {"user_ids": user_ids} if isinstance(phased, PhasedSCO) else {}
        return SCPlan(eps0, delta0, Delta0, k0, sigma0, beta, r, phased.plan(n, w0, distance=r, **kw))

    def forecast(self, n: int, w0: torch.Tensor, user_ids: tuple[str, ...] | None = None) -> dict:
        """The localisation release's forecast, by PhasedERM.forecast's rule (public values only): its
        mu-strongly convex objective's minimizer lies within G/mu of the centre, its noise has norm about
        sigma_0 sqrt(d)."""
        plan = self.plan(n, w0, user_ids)
        signal = self.setting.require_lipschitz(self.name) / self.setting.strong_convexity
        noise = plan.sigma0 * math.sqrt(torch.as_tensor(w0).numel())
        return {
            "sigma_over_Delta": plan.sigma0 / plan.Delta0,
            "sigma_1": plan.sigma0,
            "noise_norm": noise,
            "signal_radius": signal,
            "noise_over_signal": noise / signal,
        }

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Every user the localisation's half; the users of a phase the other half too (SCO's cohorts are a
        hash of the ids and n: w0 enters only lam and Delta)."""
        ids, half = tuple(user_ids), ApproxDPCharge(self.eps / 2, self.delta / 2, "declared-needs")
        if self.phased_class is PhasedERM:
            return (Need(ids, ApproxDPCharge(self.eps, self.delta, "declared-needs")),)
        plan = self.plan(len(ids), self.ctx.problem.init_params(), ids)
        return Need(ids, half), Need(
            tuple(ids[u] for u in sorted({u for s in plan.phased.specs for u in s.users})), half
        )

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> PhasedResult:
        check_approx_releaser(releaser, self.name)
        w0 = torch.as_tensor(w0)
        n = federation.num_users
        plan = self.plan(n, w0, federation.user_ids)
        # every call's refusal before the first one reads data (the localisation, then the phases)
        precheck_calls(
            self.inner,
            [(n, plan.eps0, plan.delta0)]
            + [(n if spec.users is None else len(spec.users), spec.eps, spec.delta) for spec in plan.phased.specs],
        )
        start = self.setting.project(w0.to(torch.float64))
        total = 1 + plan.phased.phases
        out = self.inner(
            federation, releaser, PhaseCall(f"{self.name}/localize", 0, plan.eps0, plan.delta0, plan.Delta0, 0.0, start)
        )
        local = {
            "phase": 0,
            "users": n,
            "eps": plan.eps0,
            "delta": plan.delta0,
            "lam": 0.0,
            "R": plan.radius_prime,
            "Delta": plan.Delta0,
            "sigma": out.sigma,
            "bottom": out.theta is None,
            "clipped": False,
            "projected": False,
        }
        if "Delta_selected" in out.diagnostics:  # a privately chosen Delta (released, charged: public)
            local["Delta_selected"] = out.diagnostics["Delta_selected"]
        if progress is not None:
            progress({"round": 1, "rounds": total, "released": out.theta is not None, "sigma": out.sigma, "phase": 0})
        base = {
            "localization": {
                "eps": plan.eps0,
                "delta": plan.delta0,
                "Delta": plan.Delta0,
                "kappa": plan.kappa0,
                "sigma": plan.sigma0,
                "R_prime": plan.radius_prime,
                "beta": plan.beta,
            }
        }
        if out.theta is None:  # pitfall 3: abort, release nothing more
            details = {
                "dp": "approximate (eps, delta)-DP, user level, replace-one, n public; the localisation "
                "release output ⊥, so the run stopped after charging (eps/2, delta/2)",
                "eps": self.eps,
                "delta": self.delta,
                "aborted": "localization ⊥",
                **base,
                "bottoms": [0],
                "schedule": [local],
                "nonprivate_diagnostics": {"decided_by": {str(out.diagnostics.get("decided_by")): 1}},
            }
            return PhasedResult(None, 1, 1, [out.sigma], details, [local])
        theta0 = out.theta.to(torch.float64)
        center = self.setting.project(theta0)
        local["projected"] = not torch.equal(center, theta0)
        res = self._phased(plan.beta).run_plan(
            federation,
            releaser,
            center,
            plan.phased,
            progress,
            out_dtype=w0.dtype,
            index_offset=1,
            total_rounds=total,
            label=self.name,
        )
        res.history.insert(0, local)
        res.details["schedule"] = res.history
        res.details.update(base)
        res.details["dp"] = (
            "approximate (eps, delta)-DP, user level, replace-one, n public; localisation at "
            "(eps/2, delta/2) then " + res.details["dp"].split("; ", 1)[1] + " at (eps/2, delta/2)"
        )
        res.details["eps"], res.details["delta"] = self.eps, self.delta
        res.details["lam_rule"] += " with D = R'"
        res.phases += 1
        res.sigmas.insert(0, out.sigma)
        how = str(out.diagnostics.get("decided_by", "unknown"))
        dec = res.details["nonprivate_diagnostics"]["decided_by"]
        dec[how] = dec.get(how, 0) + 1
        return res


@register
class SCPhasedERM(_StronglyConvexPhased):
    """Algorithm 5 (Strongly-Convex-ERM): localisation + Phased-ERM. Thm 4.3: O~(G^2 d/(mu n^2 m))."""

    name = "sc-phased-erm"
    phased_class = PhasedERM
    population = False
    small: dict = {"reg": 0.5, "p002_delta_rule": "scaled", "p002_phases": 1}
    audit = SmallAudit(epsilon=2.0, runs=70, users=120, records=2, settings={"p002_phases": 1})


@register
class SCPhasedSCO(_StronglyConvexPhased):
    """Algorithm 6 (Strongly-Convex-SCO): localisation + Phased-SCO. Thm 5.3: O~((G^2/mu)(d/(n^2 m) + 1/(nm)))."""

    name = "sc-phased-sco"
    phased_class = PhasedSCO
    population = True
    small: dict = {"reg": 0.5, "p002_delta_rule": "scaled", "p002_phases": 1, "p002_min_cohort": 4}
    audit = SmallAudit(epsilon=2.0, runs=70, users=260, records=2)


__all__ = ["SCPhasedERM", "SCPhasedSCO", "SCPlan"]
