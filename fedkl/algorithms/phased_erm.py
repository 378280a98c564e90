"""Phased-ERM (paper 002, Algorithm 3, Theorem 4.1): localisation with T calls of SCOutputPert on ALL users.

Phase i = 1..T (every constant public; shared machinery and derivations in
:mod:`fedkl.algorithms.phased_common`)::

    lam_i = lam 4^i;   l_i(theta; x) = l(theta; x) + (lam_i/2)||theta - theta^_{i-1}||^2
    theta^_i = Inner_{eps/T, delta/T, Delta_i}(l_i; x)          # SCOutputPert by default
    ⊥ -> theta^_i = theta^_{i-1}                                # post-processing; logged in `bottoms`
    else theta^_i <- Proj_K(Clip_{B(theta^_{i-1}, R_i)}(theta^_i)),  R_i = G_c / lam_i

Guarantee
---------
**(eps, delta)-DP, user level, relation replace-one, n public** (add-remove is not covered: the inner
release's test is defined for a fixed n). Proof: each inner release is (eps/T, delta/T)-DP for every
deterministic f (Thm 3.3; DelOutputPert's sensitivity (8 kappa' or 4 kappa' + 1) Delta_i comes from
its deletion test, not from a norm bound on the users' answers, kappa' = kappa(eps/(2T), ...)); its
centre theta^_{i-1}, lam_i and Delta_i are public (earlier private outputs or functions of public
constants); the clip/projection and the ⊥ rule are post-processing; basic composition of T releases
gives (eps, delta). Every release is charged to every user through the Releaser before it is made
(the ledger shows T x (eps/T, delta/T) per user; with ``delta_select="sparse-vector"`` each call is
:class:`~fedkl.algorithms.phased_common.SelectedDeltaInnerRelease`, itself (eps/T, delta/T)-DP by adaptive
composition of its eps_sel-DP AboveThreshold and its (eps/T - eps_sel, delta/T) release, charged as those
two entries, so the composition above is unchanged), and :meth:`PhasedERM.run` refuses, before reading
any data, a run that some user cannot afford in full.

Parameters (defaults are the theorem's; pitfalls of note §6)
-------------------------------------------------------------
* T = ceil(ln(n m)) (m = ``records``, public), beta = 1/(n m), beta' = beta / T.
* lam = lambda* = (2/sqrt 3) c G sqrt(d)/(D n sqrt m), NOT the paper's G sqrt(d)/(R n sqrt m), which
  leaves c^2 instead of c in the bound (pitfall 7); c = (sigma/Delta of the inner release at
  (eps/T, delta/T)) x (the threshold rule's factor), D >= ||w0 - theta*|| public.
* Delta_i: ``uc`` = Delta_uc(2G, mu + lam_i, n, m, kappa', beta') (note §2B, pitfall 1), ``scaled`` or
  the legacy ``fixed`` Delta_1 / 4^(i-1).
* K_i = K ∩ B(theta^_{i-1}, R_i), centred at the PREVIOUS OUTPUT (the paper prints theta_{i-1},
  pitfall 5). The inner release minimises over R^d, where the ball is provably inactive
  (phased_common); K enters through the projection of every released centre.

Practical limits: those of the inner release. Every phase runs at kappa' ~ T kappa. The paper's
exact test (``test="exact"``: certificate, else enumeration) refuses n > 20. The default
``test="auto"`` uses it up to 20 users; above that it switches to the local-minimizer diameter test
of :mod:`fedkl.algorithms.diameter_output_pert`. That test releases the same minimizer, is exact, and
runs in polynomial time; it needs n >= 8 kappa' + 2 users (matching score), or n >= 4 kappa' + 2 when the
vertex-cover search fits its work budget. So ``fedkl run --algorithm phased-erm`` runs on MovieLens
(671 users). At the theorem's lambda* the noise constant c is ~1e5-1e6 at n < 1000 (note §4), so
lam_i is large, the phases barely move the centre, and the model stays close to w0 (result.json
says so). See simulations/studies/paper002_slopes.toml for the regime where the theorem applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from fedkl.algorithms.phased_common import (
    DELTA_RULES,
    DELTA_SELECTIONS,
    INNER_TESTS,
    DeltaRule,
    InnerRelease,
    PhasedResult,
    PhasedSetting,
    PhaseSpec,
    check_approx_releaser,
    erm_phases,
    inner_noise_ratio,
    kappa,
    lam_star_erm,
    require_budget,
    rule_delta,
    rule_factor,
    run_phases,
    sc_output_pert_inner,
    setting_for_problem,
)
from fedkl.federation.base import Federation
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, PAPER_002_RELATIONS, Guarantee
from fedkl.privacy.release import Releaser
from fedkl.problems.base import Problem


@dataclass(frozen=True)
class PhasedConfig:
    """Public parameters of a phased algorithm (Phased-ERM, Phased-SCO and the strongly convex
    variants). None means "the theorem's value" (see each algorithm's docstring).

    Args:
        eps, delta: the TOTAL (eps, delta) each user is charged.
        lam: base regularization (lam_i = lam 4^i); None: lambda* (ERM) / lambda_SCO (SCO).
        Delta_1: the legacy fixed rule's phase-1 threshold (Delta_i = Delta_1 / 4^(i-1)).
        phases: T; None: ceil(ln(nm)) (ERM) / floor(log2(n/N0)) (SCO).
        calibration, max_exact_users, use_certificate: the default inner release's (SCOutputPert).
        delta_rule: "uc", "scaled", "fixed" or a function (see phased_common); None: "fixed" when
            Delta_1 is given, else "uc".
        delta_scale: A of the "scaled" rule.
        records: m, the public number of records per user.
        beta: utility failure probability; None: 1/(nm) (1/(2 n^2 m) for the SC variants).
        min_cohort: N0 of Phased-SCO; None: 8 kappa(eps, delta) (at least the inner release's minimum).
        seed: the public seed of Phased-SCO's cohort hash.
        test: the default inner release's deletion test (:class:`~fedkl.algorithms.phased_common.SCInnerRelease`):
            "auto", "exact", "vertex-cover" or "matching".
        delta_select, select_fraction: "fixed" (every call at its rule's Delta) or "sparse-vector" (every
            call chooses its Delta privately below the rule's, spending select_fraction of its eps:
            :class:`~fedkl.algorithms.phased_common.SelectedDeltaInnerRelease`).
    """

    eps: float
    delta: float
    lam: float | None = None
    Delta_1: float | None = None
    phases: int | None = None
    calibration: str = "paper"
    max_exact_users: int = 20
    use_certificate: bool = True
    delta_rule: DeltaRule | None = None
    delta_scale: float = 1.0
    records: int = 1
    beta: float | None = None
    min_cohort: int | None = None
    seed: int = 0
    test: str = "auto"
    delta_select: str = "fixed"
    select_fraction: float = 0.25

    def __post_init__(self) -> None:
        if not (self.eps > 0 and math.isfinite(self.eps) and 0 < self.delta < 1):
            raise ValueError("need finite eps > 0 and 0 < delta < 1")
        if self.phases is not None and (int(self.phases) != self.phases or self.phases < 1):
            raise ValueError(f"phases must be a positive integer, got {self.phases}")
        for name in ("lam", "Delta_1", "beta"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be None or finite and > 0, got {v}")
        if self.beta is not None and not self.beta < 1:
            raise ValueError(f"beta must be < 1, got {self.beta}")
        if not (self.delta_scale > 0 and math.isfinite(self.delta_scale)):
            raise ValueError(f"delta_scale must be finite and > 0, got {self.delta_scale}")
        if int(self.records) != self.records or self.records < 1:
            raise ValueError(f"records (m) must be a positive integer, got {self.records}")
        if self.min_cohort is not None and (int(self.min_cohort) != self.min_cohort or self.min_cohort < 2):
            raise ValueError(f"min_cohort must be an integer >= 2, got {self.min_cohort}")
        if self.test not in INNER_TESTS:
            raise ValueError(f"test must be one of {INNER_TESTS}, got {self.test!r}")
        if self.delta_select not in DELTA_SELECTIONS:
            raise ValueError(f"delta_select must be one of {DELTA_SELECTIONS}, got {self.delta_select!r}")
        if not 0 < self.select_fraction < 1:
            raise ValueError(f"select_fraction must be in (0, 1), got {self.select_fraction}")
        rule = self.rule
        if not callable(rule) and rule not in DELTA_RULES:
            raise ValueError(f"delta_rule must be one of {DELTA_RULES} or a function, got {rule!r}")
        if rule == "fixed" and self.Delta_1 is None:
            raise ValueError("the fixed threshold rule needs Delta_1")

    @property
    def rule(self) -> DeltaRule:
        if self.delta_rule is not None:
            return self.delta_rule
        return "fixed" if self.Delta_1 is not None else "uc"

    # legacy accessors (the first version's fixed schedule)
    def lam_i(self, i: int) -> float:
        if self.lam is None:
            raise ValueError("lam is set at run time (lambda*): use PhasedERM.plan")
        return self.lam * 4.0**i

    def Delta_i(self, i: int) -> float:
        if self.Delta_1 is None:
            raise ValueError("Delta_i depends on the rule and n: use PhasedERM.plan")
        return self.Delta_1 / 4.0 ** (i - 1)


PhasedERMConfig = PhasedConfig  # the name the runner and the first tests use


@dataclass(frozen=True)
class PhasedPlan:
    """The public schedule of one run (computed from public values before any data is read)."""

    phases: int
    eps_phase: float
    delta_phase: float
    lam: float
    beta: float
    kappa: int
    noise_constant: float | None  # c (None when lam was given and the rule is "fixed")
    distance: float | None
    specs: tuple[PhaseSpec, ...]
    extra: dict = field(default_factory=dict)


def _phase_delta(
    config: PhasedConfig, setting: PhasedSetting, i: int, lam_i: float, n_i: int, kappa_: int, beta_i: float
) -> float:
    rule = config.rule
    if rule == "fixed":
        return config.Delta_1 / 4.0 ** (i - 1)
    G = setting.require_lipschitz(f"the {rule!r} threshold rule")
    return rule_delta(
        rule,
        G_call=2.0 * G,
        mu=setting.strong_convexity + lam_i,
        n_call=n_i,
        m=config.records,
        kappa_=kappa_,
        beta=beta_i,
        scale=config.delta_scale,
    )


class PhasedERM:
    """Algorithm 3 of paper 002 (see the module docstring).

    Args:
        config: :class:`PhasedConfig`.
        problem, feature_bound: the loss and the loader-enforced record bound (for the default
            inner release and the default :class:`PhasedSetting`).
        setting: public constants (default :func:`setting_for_problem`).
        inner: the inner release (default :func:`sc_output_pert_inner`).
    """

    name = "phased-erm"
    guarantee = Guarantee("approx-dp", clients=IN_CLASS_CLIENTS, relations=PAPER_002_RELATIONS)

    def __init__(
        self,
        config: PhasedConfig,
        problem: Problem | None = None,
        feature_bound: float | None = None,
        *,
        setting: PhasedSetting | None = None,
        inner: InnerRelease | None = None,
    ) -> None:
        self.config = config
        self.problem = problem
        self.feature_bound = None if feature_bound is None else float(feature_bound)
        if setting is None:
            if problem is None or feature_bound is None:
                raise ValueError("give a problem and its feature bound, or a PhasedSetting")
            setting = setting_for_problem(problem, feature_bound)
        self.setting = setting
        if inner is None:
            if problem is None or feature_bound is None:
                raise ValueError("the default inner release (SCOutputPert) needs the problem and its feature bound")
            inner = sc_output_pert_inner(
                problem,
                float(feature_bound),
                calibration=config.calibration,
                max_exact_users=config.max_exact_users,
                use_certificate=config.use_certificate,
                test=config.test,
                delta_select=config.delta_select,
                select_fraction=config.select_fraction,
            )
        self.inner = inner

    # --- the public schedule -------------------------------------------------------------------
    def plan(self, n: int, w0: torch.Tensor, *, distance: float | None = None) -> PhasedPlan:
        """T, lam, Delta_i (public). ``distance`` overrides the setting's D (the SC variants' R')."""
        cfg, st = self.config, self.setting
        m = cfg.records
        T = cfg.phases if cfg.phases is not None else erm_phases(n, m)
        eps_i, delta_i = cfg.eps / T, cfg.delta / T
        beta = cfg.beta if cfg.beta is not None else 1.0 / (n * m)
        beta_i = beta / T
        k = kappa(eps_i, delta_i, cfg.calibration)
        c = self.noise_constant([n], eps_i, delta_i, k, beta_i)
        lam, D = self.base_lam(c, "lambda*", w0, distance, lambda c_, G, D_: lam_star_erm(c_, G, D_, st.dim, n, m))
        specs = []
        for i in range(1, T + 1):
            lam_i = lam * 4.0**i
            specs.append(PhaseSpec(i, eps_i, delta_i, lam_i, _phase_delta(cfg, st, i, lam_i, n, k, beta_i)))
        return PhasedPlan(T, eps_i, delta_i, lam, beta, k, c, D, tuple(specs))

    def public_plan(self, n: int, w0: torch.Tensor, user_ids: tuple[str, ...] | None = None) -> PhasedPlan:
        """:meth:`plan` from what the runner knows before any data (Phased-SCO also needs the ids)."""
        return self.plan(n, w0)

    def forecast(self, n: int, w0: torch.Tensor, user_ids: tuple[str, ...] | None = None) -> dict:
        """Public values only, before any data: can phase 1 move the model further than its noise?

        The phase objective is (mu + lam_1)-strongly convex and its gradient at the centre is at most G
        (the setting's Lipschitz constant), so its minimizer lies within ``signal_radius = G/(mu + lam_1)``
        of the centre, whatever the data (strong monotonicity). The release adds N(0, sigma_1^2 I_d),
        of norm about ``noise_norm = sigma_1 sqrt(d)``. ``noise_over_signal > 1`` means the first
        release is expected farther from the phase optimum than any data could move it: the model is
        noise around its start (MovieLens at the theorem's lam*: ~1e5). A heuristic forecast, not a
        bound on utility; the runner refuses on it unless forced."""
        plan = self.public_plan(n, w0, user_ids)
        first = plan.specs[0]
        n_call = n if first.users is None else len(first.users)
        ratio = inner_noise_ratio(self.inner, n_call, first.eps, first.delta, self.config.calibration)
        sigma = ratio * first.Delta
        signal = self.setting.require_lipschitz("the forecast") / (self.setting.strong_convexity + first.lam)
        noise = sigma * math.sqrt(torch.as_tensor(w0).numel())
        return {
            "sigma_over_Delta": ratio,
            "noise_constant_c": plan.noise_constant or math.nan,
            "sigma_1": sigma,
            "noise_norm": noise,
            "signal_radius": signal,
            "noise_over_signal": noise / signal,
        }

    def noise_constant(self, call_sizes: list[int], eps: float, delta: float, kappa_: int, beta: float) -> float | None:
        """c = max over the calls (n_i users each) of sigma_i/Delta_i x the threshold rule's factor
        (phased_common); None for the fixed rule, which defines none."""
        cfg = self.config
        if cfg.rule == "fixed":
            return None
        G2 = 2.0 * self.setting.require_lipschitz(f"the {cfg.rule!r} threshold rule")
        return max(
            inner_noise_ratio(self.inner, n_i, eps, delta, cfg.calibration)
            * rule_factor(
                cfg.rule, G_call=G2, n_call=n_i, m=cfg.records, kappa_=kappa_, beta=beta, scale=cfg.delta_scale
            )
            for n_i in call_sizes
        )

    def base_lam(
        self,
        c: float | None,
        name: str,
        w0: torch.Tensor,
        distance: float | None,
        formula: Callable[[float, float, float], float],
    ) -> tuple[float, float | None]:
        """(lam, D): the given lam, else ``formula(c, G, D)`` with the public D (``distance`` or the setting's)."""
        if self.config.lam is not None:
            return self.config.lam, None
        if c is None:
            raise ValueError(
                f"{name} needs the noise constant c, which the fixed threshold rule does not define: "
                "give lam or use the uc/scaled rule"
            )
        G = self.setting.require_lipschitz(name)
        D = distance if distance is not None else self.setting.resolve_distance(w0)
        return formula(c, G, D), D

    # --- the run -------------------------------------------------------------------------------
    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> PhasedResult:
        check_approx_releaser(releaser, self.name)
        w0 = torch.as_tensor(w0)
        plan = self.plan(federation.num_users, w0)
        require_budget(releaser, [(federation.user_ids, self.config.eps, self.config.delta)], self.name)
        return self.run_plan(
            federation, releaser, self.setting.project(w0.to(torch.float64)), plan, progress, out_dtype=w0.dtype
        )

    def run_plan(
        self,
        federation: Federation,
        releaser: Releaser,
        center: torch.Tensor,
        plan: PhasedPlan,
        progress: Callable[[dict], None] | None = None,
        *,
        out_dtype: torch.dtype = torch.float64,
        index_offset: int = 0,
        total_rounds: int | None = None,
        label: str | None = None,
    ) -> PhasedResult:
        """Run a plan from ``center`` (public). The caller has checked the releaser and the budget."""
        center, history, decided = run_phases(
            federation,
            releaser,
            plan.specs,
            center,
            inner=self.inner,
            setting=self.setting,
            name=label or self.name,
            progress=progress,
            index_offset=index_offset,
            total_rounds=total_rounds,
        )
        bottoms = [h["phase"] for h in history if h["bottom"]]
        details = {
            "dp": f"approximate (eps, delta)-DP, user level, replace-one, n public; basic composition of "
            f"{plan.phases} x (eps/T, delta/T)",
            "eps": self.config.eps,
            "delta": self.config.delta,
            "phases": plan.phases,
            "lam": plan.lam,
            "lam_rule": "given" if self.config.lam is not None else "lambda* (pitfall 7)",
            "noise_constant_c": plan.noise_constant,
            "distance_D": plan.distance,
            "beta": plan.beta,
            "kappa_per_phase": plan.kappa,
            "delta_rule": self.config.rule if isinstance(self.config.rule, str) else "custom",
            "records_m": self.config.records,
            "bottoms": bottoms,
            "schedule": history,
            "nonprivate_diagnostics": {"decided_by": decided},
        }
        return PhasedResult(
            center.to(out_dtype), plan.phases, len(bottoms), [h["sigma"] for h in history], details, history
        )


# --- runner builder -------------------------------------------------------------------------------
__all__ = ["PhasedConfig", "PhasedERM", "PhasedERMConfig", "PhasedPlan", "PhasedResult"]
