"""Phased-ERM (paper 002, Algorithm 3, Theorem 4.1): localisation with T calls of SCOutputPert on ALL users.

Phase i = 1..T (every constant public; shared machinery and derivations in
:mod:`fedkl.algorithms.output_perturbation.phased_common`)::

    lam_i = lam 4^i;   l_i(theta; x) = l(theta; x) + (lam_i/2)||theta - theta^_{i-1}||^2
    theta^_i = Inner_{eps_i, delta_i, Delta_i}(l_i; x)          # SCOutputPert by default
    ⊥ -> theta^_i = theta^_{i-1}                                # post-processing; logged in `bottoms`
    else theta^_i <- Proj_K(Clip_{B(theta^_{i-1}, R_i)}(theta^_i)),  R_i = G_c / lam_i

Guarantee
---------
**(eps, delta)-DP, user level, relation replace-one, n public** (add-remove is not covered: the inner
release's test is defined for a fixed n). Proof (written for the equal split; any split below is the
same with (eps_i, delta_i) for (eps/T, delta/T)): each inner release is (eps/T, delta/T)-DP for every
deterministic f (Thm 3.3; DelOutputPert's sensitivity (8 kappa' or 4 kappa' + 1) Delta_i comes from
its deletion test, not from a norm bound on the users' answers, kappa' = kappa(eps/(2T), ...)); its
centre theta^_{i-1}, lam_i and Delta_i are public (earlier private outputs or functions of public
constants); the clip/projection and the ⊥ rule are post-processing; basic composition of T releases
gives (eps, delta). Every release is charged to every user through the Releaser before it is made
(the ledger shows T x (eps/T, delta/T) per user; with ``delta_select="sparse-vector"`` each call is
:class:`~fedkl.algorithms.output_perturbation.phased_common.SelectedDeltaInnerRelease`, itself (eps/T, delta/T)-DP by adaptive
composition of its eps_sel-DP AboveThreshold and its (eps/T - eps_sel, delta/T) release, charged as those
two entries, so the composition above is unchanged), and :meth:`PhasedERM.run` refuses, before reading
any data, a run that some user cannot afford in full.

The split between phases
------------------------
Any public split (eps_1..eps_T, delta_1..delta_T) with sum eps_i = eps, sum delta_i = delta is
(eps, delta)-DP by the same proof: basic composition holds for ADAPTIVELY chosen releases (phase i's
centre is phase i-1's output) as long as each one's budget is fixed before the run, and the split is a
function of (n, m, eps, delta, T, the constants) only. (Advanced composition would not pay at T ~ 12-16,
docs/derivations/paper-002.md §2E, "the note".) Which split is best is a utility question, answered from the bound:

* Telescoping Lemma 4.2 over the ideal noisy iterates (the note §2E) gives, with sigma_i the phase noise,
  ``E[excess] <= 2 lam D^2 + sum_{i<T} (lam_{i+1}/2) d sigma_i^2 + G sqrt(d) sigma_T``. With
  ``sigma_i = c_i 2G/(lam_i n sqrt m)`` (phased_common; c_i = (sigma/Delta)(eps_i, delta_i) x the
  rule's factor at kappa_i, beta_i) and lam_i = lam 4^i the i-th term is
  ``8 d G^2 4^-i c_i^2/(lam n^2 m)``. Bounding the last phase's term by the tail sum_{j>=T} of the
  same terms at c_T (it is lower order, 4^-T ~ (nm)^-1.39) gives
  ``B(lam, split) = 2 lam D^2 + 8 d G^2 S/(lam n^2 m)``, ``S = sum_j w_j c_j^2``,
  ``w_j = 4^-j`` (j < T), ``w_T = 4^-T 4/3`` (:func:`~fedkl.algorithms.output_perturbation.phased_common.phase_weights`).
  An equal split gives S = c^2/3, the (8/3) c^2 of lambda* below, so nothing changes for it.
* B is increasing in S at every lam, so the split that minimises S minimises the bound whatever lam
  is; at that split lambda* = 2 G sqrt(d S)/(D n sqrt m) = lam_star_erm(sqrt(3 S), ...), bound
  8 D G sqrt(d S)/(n sqrt m). The plan reports c = sqrt(3 S) (the equal split's c with the same bound).
* c_j is not 1/eps_j: sigma/Delta ~ kappa sqrt(ln(1/delta))/eps with kappa ~ ln(1/delta)/eps, and
  Delta_uc grows with kappa too, so c ~ eps^-p with p ~ 2-2.6 (measured by :meth:`PhasedERM.noise_exponent`
  as the log-slope of c between eps/T and 2 eps/T). For c_j = A eps_j^-p, minimising
  sum_j w_j A^2 eps_j^-2p subject to sum_j eps_j = eps is strictly convex and Lagrange's condition
  ``w_j 2p A^2 eps_j^-(2p+1) = nu`` gives ``eps_j = eps w_j^a / sum_k w_k^a``, ``a = 1/(2p+1)``
  (4^-j/5 to 4^-j/6 here, not the 4^-j/3 of c ~ 1/eps). For delta at fixed eps:
  d(c_j^2)/d delta_j ~ -c_j^2/(delta_j ln(1/delta_j)), and Lagrange gives delta_j ~ w_j c_j^2 up to the
  slowly varying ln(1/delta_j); at the eps-optimum w_j c_j^2 ~ w_j^a ~ eps_j, so ``delta_j ~ eps_j``.
* Admissible splits. The smallest phase has the deepest deletion test (kappa_j grows as eps_j falls):
  a split is used only if every call runs at n (the inner release's public check and the uc rule's
  n >= 4 kappa_j + 2) and stays in Cor 3.7's regime n >= 8 kappa_j (or, where the equal split is
  outside it already, no deeper than the equal split). Otherwise a is lowered to an admissible a k/16
  (bisection over k = 15..1).
  The equal split is kept when its S is smaller. Tests: tests/algorithms/test_phase_split.py (the
  power-law case against 200 random splits and every pairwise transfer; the real release within 2% of
  every admissible grid member, S / 60 of the equal split at n = 5000, m = 100, eps = 8; every phase's
  release of the default split, the smallest budget included, through the exact hockey-stick audit at its
  own (eps_j, delta_j); the ledger's entries summing exactly to the run's (eps, delta)).
* The default ``phase_split="auto"`` is this split ("optimal"), except with ``calibration="paper"``
  (the constants as printed, for reproduction), where it is the paper's (eps/T, delta/T) ("equal");
  ``--p002-phase-split equal`` / ``optimal`` choose either explicitly. Every distinct phase budget costs one
  profile calibration (~20-50 ms since the search of :func:`fedkl.algorithms.output_perturbation.stability_profile.calibrate`
  skips grid points that cannot win). On MovieLens (n = 671, T = 7, eps = 2, profile noise) the plan
  takes 0.41 s against the equal split's 0.04 s and c falls from 7.0e5 to 4.2e5
  (simulations/bench_phase_split.py); at n = 5000, m = 100, eps = 8 the gain is S / 60.

Parameters (defaults are the theorem's; pitfalls of the note §6)
-------------------------------------------------------------
* T = ceil(ln(n m)) (m = ``records``, public), beta = 1/(n m), beta' = beta / T; the split above.
* lam = lambda* = (2/sqrt 3) c G sqrt(d)/(D n sqrt m), NOT the paper's G sqrt(d)/(R n sqrt m), which
  leaves c^2 instead of c in the bound (pitfall 7); c = (sigma/Delta of the inner release at
  (eps/T, delta/T)) x (the threshold rule's factor), D >= ||w0 - theta*|| public.
* Delta_i: ``uc`` = Delta_uc(2G, mu + lam_i, n, m, kappa', beta') (the note §2B, pitfall 1), ``scaled`` or
  the legacy ``fixed`` Delta_1 / 4^(i-1).
* K_i = K ∩ B(theta^_{i-1}, R_i), centred at the PREVIOUS OUTPUT (the paper prints theta_{i-1},
  pitfall 5). The inner release minimises over R^d, where the ball is provably inactive
  (phased_common); K enters through the projection of every released centre.

Practical limits: those of the inner release. Every phase runs at kappa' ~ T kappa. The paper's
exact test (``test="exact"``: certificate, else enumeration) refuses n > 20. The default
``test="auto"`` uses it up to 20 users; above that it switches to the local-minimizer diameter test
of :mod:`fedkl.algorithms.output_perturbation.diameter_output_pert`. That test releases the same minimizer, is exact, and
runs in polynomial time; it needs n >= 8 kappa' + 2 users (matching score), or n >= 4 kappa' + 2 when the
vertex-cover search fits its work budget. So ``fedkl run --algorithm phased-erm`` runs on MovieLens
(671 users). At the theorem's lambda* the noise constant c is ~1e5-1e6 at n < 1000 (the note §4), so
lam_i is large, the phases barely move the centre, and the model stays close to w0 (result.json
says so). See simulations/studies/paper002_slopes.toml for the regime where the theorem applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from fedkl.algorithms.contract import Algorithm, BuildContext, Domain, SmallAudit, param
from fedkl.algorithms.output_perturbation.p002 import P002_ABSENCE, P002Release
from fedkl.algorithms.output_perturbation.phased_common import (
    DELTA_RULES,
    PHASE_SPLITS,
    DeltaRule,
    InnerRelease,
    PhasedResult,
    PhasedSetting,
    PhaseSpec,
    check_approx_releaser,
    erm_phases,
    geometric_split,
    inner_noise_ratio,
    kappa,
    lam_star_erm,
    phase_weights,
    precheck_calls,
    rule_delta,
    rule_factor,
    run_phases,
    sc_output_pert_inner,
    setting_from_run_config,
    split_bound,
)
from fedkl.algorithms.registry import register
from fedkl.federation.base import Federation
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, PAPER_002_RELATIONS, SOLVER_ITERATES, Guarantee
from fedkl.privacy.release import Releaser


@dataclass(frozen=True)
class PhasedParams(Domain, P002Release):
    """The four phased algorithms' hyperparameters (``--p002-*``; ``radius``/``distance`` shared with paper
    003, ``stability_delta`` only with ``p002_delta_rule = "fixed"``: Delta_1). The total (eps, delta) each
    user is charged comes from the budget (:class:`~fedkl.algorithms.contract.BuildContext`), Phased-SCO's
    cohort hash seed from the run. None means "the theorem's value" (each algorithm's docstring)."""

    p002_records: int = param(
        1,
        "paper-002 phased algorithms: m, the PUBLIC number of records per user in the thresholds "
        "Delta ~ 1/(n sqrt m) and in T = ceil(ln(nm)) (1 claims no sqrt(m) gain; any public value is private)",
        "theorem",
    )
    p002_phases: int | None = param(
        None,
        "paper-002 phased algorithms: T (default ceil(ln(n m)) for Phased-ERM, floor(log2(n/N0)) for Phased-SCO)",
        "theorem",
    )
    p002_lam: float | None = param(
        None,
        "paper-002 phased algorithms: base regularization lam, lam_i = lam 4^i (default: lambda* of the "
        "re-derived bound, docs/derivations/paper-002.md pitfalls 6/7)",
        "theorem",
    )
    p002_delta_rule: str = param(
        "uc",
        "paper-002 phased algorithms: the per-call deletion threshold: uc (Delta_uc, Cor 3.7 with its union "
        "bound), scaled (P002_DELTA_SCALE G_i/(mu_i n_i sqrt m)) or fixed (STABILITY_DELTA / 4^(i-1); "
        "phased-erm/phased-sco only)",
        "theorem (uc) / heuristic (scaled, fixed)",
        choices=DELTA_RULES,
    )
    p002_delta_scale: float = param(1.0, "paper-002 phased algorithms: A of the scaled threshold rule", "heuristic")
    p002_beta: float | None = param(
        None,
        "paper-002 phased algorithms: utility failure probability beta inside Delta_uc (default 1/(nm); "
        "1/(2 n^2 m) for the strongly convex variants)",
        "theorem",
    )
    p002_phase_split: str = param(
        "auto",
        "phased-erm / sc-phased-erm: the split of (eps, delta) between the T phases: optimal (eps_i, delta_i ~ "
        "4^(-i a), a = 1/(2p+1) from the noise's slope p, the split that minimises the error bound; "
        "fedkl/algorithms/output_perturbation/phased_erm.py), equal ((eps/T, delta/T), the paper's) or auto (optimal, but equal "
        "with --p002-calibration paper)",
        "theorem",
        choices=PHASE_SPLITS,
    )
    p002_min_cohort: int | None = param(
        None, "phased-sco / sc-phased-sco: N0, the smallest cohort (default 8 kappa(eps, delta))", "theorem"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.p002_phases is not None and self.p002_phases < 1:
            raise ValueError(f"--p002-phases must be >= 1, got {self.p002_phases}")
        for flag, v in (("--p002-lam", self.p002_lam), ("--p002-delta-scale", self.p002_delta_scale)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be finite and > 0, got {v}")
        for flag, v in (("--p002-beta", self.p002_beta), ("--p002-select-fraction", self.p002_select_fraction)):
            if v is not None and not 0 < v < 1:
                raise ValueError(f"{flag} must be in (0, 1), got {v}")
        if self.p002_records < 1:
            raise ValueError(f"--p002-records must be >= 1, got {self.p002_records}")
        if self.p002_min_cohort is not None and self.p002_min_cohort < 2:
            raise ValueError(f"--p002-min-cohort must be >= 2, got {self.p002_min_cohort}")

    @property
    def split(self) -> str:
        """The split rule in force: ``p002_phase_split``, "auto" resolved ("equal" for the paper's constants)."""
        if self.p002_phase_split != "auto":
            return self.p002_phase_split
        return "equal" if self.p002_calibration == "paper" else "optimal"


@dataclass(frozen=True)
class PhasedPlan:
    """The public schedule of one run (computed from public values before any data is read).
    ``eps_phase``/``delta_phase``/``kappa``: phase 1's budget and the LARGEST kappa of the phases (each
    spec has its own (eps_i, delta_i)); ``noise_constant``: c, for an unequal split the effective
    sqrt(3 S) (:class:`PhaseSplit`)."""

    phases: int
    eps_phase: float
    delta_phase: float
    lam: float
    beta: float
    kappa: int
    noise_constant: float | None  # c (None when the rule is "fixed")
    distance: float | None
    specs: tuple[PhaseSpec, ...]
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PhaseSplit:
    """Phased-ERM's public split of (eps, delta) between its phases and what it costs.

    ``eps``/``delta``/``kappas``/``cs``: per phase (c_j: the phase's noise constant, or for the fixed rule
    sigma_j/Delta_j, which enters the bound with the same weights); ``exponent``: a of eps_j ~ w_j^a;
    ``bound``: S = sum_j w_j c_j^2; ``rule``: in words."""

    eps: tuple[float, ...]
    delta: tuple[float, ...]
    kappas: tuple[int, ...]
    cs: tuple[float, ...]
    exponent: float
    bound: float
    rule: str

    @property
    def effective_c(self) -> float:
        """sqrt(3 S): the c of an equal split with the same bound (lambda* = lam_star_erm(sqrt(3 S), ...))."""
        return math.sqrt(3.0 * self.bound)


@register
class PhasedERM(Algorithm[PhasedParams]):
    """Algorithm 3 of paper 002 (see the module docstring).

    ``PhasedERM(params, ctx)`` spends the (eps, delta) every user can still afford (``ctx.approx_budget()``);
    the public constants are :func:`setting_from_run_config` of the run's problem, ``--radius`` and
    ``--distance``, the inner release :func:`sc_output_pert_inner` with ``--p002-calibration``/``-test``/
    ``-delta-select``/``-select-fraction``. Research code may replace three of these (keyword-only; the
    runner never does): ``setting`` (public constants), ``inner`` (another inner release, e.g.
    :class:`~fedkl.algorithms.output_perturbation.mean_type_inner.MeanTypeInner`) and ``delta_rule`` (a
    threshold function in place of ``--p002-delta-rule``, see phased_common's ``DeltaRule``).
    """

    name = "phased-erm"
    Params = PhasedParams
    guarantee = Guarantee("approx-dp", clients=IN_CLASS_CLIENTS, relations=PAPER_002_RELATIONS)
    absence = P002_ABSENCE
    clients_see = SOLVER_ITERATES
    small: dict = {"reg": 0.1, "p002_delta_rule": "fixed", "p002_phases": 2, "p002_lam": 0.05}
    audit = SmallAudit(epsilon=2.0, runs=70, users=130, records=2, settings={"p002_phases": 2})

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
        self.eps, self.delta = ctx.approx_budget()  # what every user can still afford (all of it when fresh)
        self.rule: DeltaRule = params.p002_delta_rule if delta_rule is None else delta_rule
        if not callable(self.rule) and self.rule not in DELTA_RULES:
            raise ValueError(f"delta_rule must be one of {DELTA_RULES} or a function, got {self.rule!r}")
        if (setting is None or inner is None) and ctx.problem is None:
            raise ValueError(
                "give the problem (BuildContext problem=, feature_bound=), or a setting and an inner release"
            )
        if setting is None:
            setting = setting_from_run_config(ctx.problem, ctx.feature_bound, params.radius, params.distance)
        self.setting = setting
        if inner is None:
            inner = sc_output_pert_inner(
                ctx.problem,
                float(ctx.feature_bound),
                calibration=params.p002_calibration,
                test=params.p002_test,
                delta_select=params.p002_delta_select,
                select_fraction=params.p002_select_fraction,
            )
        self.inner = inner

    def phase_delta(self, i: int, lam_i: float, n_i: int, kappa_: int, beta_i: float) -> float:
        """Delta_i of a call over n_i users (the threshold rule; ``fixed``: STABILITY_DELTA / 4^(i-1))."""
        p, st = self.params, self.setting
        if self.rule == "fixed":
            return float(p.stability_delta) / 4.0 ** (i - 1)
        G = st.require_lipschitz(f"the {self.rule!r} threshold rule")
        return rule_delta(
            self.rule,
            G_call=2.0 * G,
            mu=st.strong_convexity + lam_i,
            n_call=n_i,
            m=p.p002_records,
            kappa_=kappa_,
            beta=beta_i,
            scale=p.p002_delta_scale,
        )

    # --- the public schedule -------------------------------------------------------------------
    def plan(self, n: int, w0: torch.Tensor, *, distance: float | None = None) -> PhasedPlan:
        """T, the split, lam, Delta_i (public). ``distance`` overrides the setting's D (the SC variants' R')."""
        p, st = self.params, self.setting
        m = p.p002_records
        T = p.p002_phases if p.p002_phases is not None else erm_phases(n, m)
        beta = p.p002_beta if p.p002_beta is not None else 1.0 / (n * m)
        beta_i = beta / T
        split = self.phase_split(n, T, beta_i)
        c = None if self.rule == "fixed" else split.effective_c
        lam, D = self.base_lam(c, "lambda*", w0, distance, lambda c_, G, D_: lam_star_erm(c_, G, D_, st.dim, n, m))
        specs = []
        for i, (e_i, d_i, k_i) in enumerate(zip(split.eps, split.delta, split.kappas), start=1):
            lam_i = lam * 4.0**i
            specs.append(PhaseSpec(i, e_i, d_i, lam_i, self.phase_delta(i, lam_i, n, k_i, beta_i)))
        extra = {
            "phase_split": split.rule,
            "split_exponent": split.exponent,
            "eps_per_phase": list(split.eps),
            "delta_per_phase": list(split.delta),
            "c_per_phase": list(split.cs),
        }
        return PhasedPlan(T, split.eps[0], split.delta[0], lam, beta, max(split.kappas), c, D, tuple(specs), extra)

    # --- the split between phases ----------------------------------------------------------------
    def phase_c(self, n: int, eps: float, delta: float, beta: float) -> tuple[int, float]:
        """(kappa_j, c_j) of one phase at (eps, delta) over n users: c_j = the noise constant, or for the
        fixed rule sigma_j/Delta_j (public; ValueError where the uc rule refuses the call)."""
        p = self.params
        k = kappa(eps, delta, p.p002_calibration)
        if self.rule == "fixed":
            return k, inner_noise_ratio(self.inner, n, eps, delta, p.p002_calibration)
        return k, float(self.noise_constant([n], eps, delta, k, beta))

    def costed_split(self, n: int, eps: tuple, delta: tuple, beta: float, exponent: float, rule: str) -> PhaseSplit:
        """:class:`PhaseSplit` of given per-phase budgets (public values only)."""
        kc = [self.phase_c(n, e, d, beta) for e, d in zip(eps, delta, strict=True)]
        cs = tuple(c for _, c in kc)
        return PhaseSplit(
            eps, delta, tuple(k for k, _ in kc), cs, exponent, split_bound(phase_weights(len(eps)), cs), rule
        )

    def noise_exponent(self, n: int, T: int, beta: float) -> float:
        """p, the log-slope of the phase noise constant (c_j ~ eps_j^-p) between eps/T and 2 eps/T at
        delta/T (the constant c_j where the rule defines it at both points, else sigma/Delta). Public."""
        p = self.params
        lo, hi, d = self.eps / T, 2 * self.eps / T, self.delta / T
        try:
            c_lo, c_hi = self.phase_c(n, lo, d, beta)[1], self.phase_c(n, hi, d, beta)[1]
        except ValueError:  # the rule refuses a call at eps/T over n users: the release's own slope
            c_lo = inner_noise_ratio(self.inner, n, lo, d, p.p002_calibration)
            c_hi = inner_noise_ratio(self.inner, n, hi, d, p.p002_calibration)
        return max(math.log(c_lo / c_hi) / math.log(hi / lo), 0.0)

    def split_feasible(self, n: int, T: int, beta: float, a: float, max_kappa: int) -> bool:
        """Whether every call of the split eps_j, delta_j ~ w_j^a runs at n users with kappa_j <=
        ``max_kappa`` (public). Only the last phase is asked: it has the smallest (eps_j, delta_j), and
        kappa and the refusals only grow as they shrink."""
        w = phase_weights(T)
        e, d = geometric_split(self.eps, w, a)[-1], geometric_split(self.delta, w, a)[-1]
        try:
            precheck_calls(self.inner, [(n, e, d)])
            k, _ = self.phase_c(n, e, d, beta)
        except ValueError:
            return False
        return k <= max_kappa

    def phase_split(self, n: int, T: int, beta: float) -> PhaseSplit:
        """The split of (eps, delta) between the T phases (module docstring, "The split between phases").

        By :attr:`PhasedParams.split`: ``equal``: (eps/T, delta/T). ``optimal``: eps_j, delta_j ~ w_j^a with
        a = 1/(2p+1), p the noise constant's log-slope (:meth:`noise_exponent`), or, where a call of that
        split would be refused at this n or leave Cor 3.7's regime (n >= 8 kappa_j; where the equal split is
        already outside it, no phase deeper than the equal split's), an admissible a of the grid a k/16,
        k = 15..1, found by bisection (admissibility shrinks as a grows: the last phase's budget falls); the
        equal split whenever it has the smaller bound S. Every candidate is a function of public values only."""
        equal = self.costed_split(
            n, (self.eps / T,) * T, (self.delta / T,) * T, beta, 0.0, "equal (eps/T, delta/T), basic composition"
        )
        if self.params.split == "equal" or T == 1:
            return equal
        p = self.noise_exponent(n, T, beta)
        a = 1.0 / (2.0 * p + 1.0)
        kmax = max(n // 8, equal.kappas[0])  # Cor 3.7's regime n >= 8 kappa, or no deeper than the equal split
        if not self.split_feasible(n, T, beta, a, kmax):  # bisection on the grid a k/16 (4 checks)
            lo, hi = 0, 16  # lo: admissible (k = 0 is the equal split), hi: not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self.split_feasible(n, T, beta, a * mid / 16, kmax) else (lo, mid)
            a = a * lo / 16
        if a <= 0.0:
            return equal
        w = phase_weights(T)
        best = self.costed_split(
            n,
            geometric_split(self.eps, w, a),
            geometric_split(self.delta, w, a),
            beta,
            a,
            f"optimal: eps_j, delta_j ~ w_j^{a:.4g} (noise slope p = {p:.3g}), basic composition",
        )
        return best if best.bound < equal.bound else equal

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
        ratio = inner_noise_ratio(self.inner, n_call, first.eps, first.delta, self.params.p002_calibration)
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
        p = self.params
        if self.rule == "fixed":
            return None
        G2 = 2.0 * self.setting.require_lipschitz(f"the {self.rule!r} threshold rule")
        return max(
            inner_noise_ratio(self.inner, n_i, eps, delta, p.p002_calibration)
            * rule_factor(
                self.rule, G_call=G2, n_call=n_i, m=p.p002_records, kappa_=kappa_, beta=beta, scale=p.p002_delta_scale
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
        if self.params.p002_lam is not None:
            return self.params.p002_lam, None
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
            f"{plan.phases} phases (eps_i, delta_i) summing to (eps, delta)",
            "eps": self.eps,
            "delta": self.delta,
            "phases": plan.phases,
            "lam": plan.lam,
            "lam_rule": "given" if self.params.p002_lam is not None else "lambda* (pitfall 7)",
            "noise_constant_c": plan.noise_constant,
            "distance_D": plan.distance,
            "beta": plan.beta,
            "kappa_per_phase": plan.kappa,
            **plan.extra,
            "delta_rule": self.rule if isinstance(self.rule, str) else "custom",
            "records_m": self.params.p002_records,
            "bottoms": bottoms,
            "schedule": history,
            "nonprivate_diagnostics": {"decided_by": decided},
        }
        return PhasedResult(
            center.to(out_dtype), plan.phases, len(bottoms), [h["sigma"] for h in history], details, history
        )


__all__ = ["PhaseSplit", "PhasedERM", "PhasedParams", "PhasedPlan", "PhasedResult"]
