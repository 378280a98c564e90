"""Phased-ERM's split of (eps, delta) between its phases (fedkl/algorithms/output_perturbation/phased_erm.py, "The split
between phases"): the rule minimises the error bound's S = sum_j w_j c_j^2, the charges sum to the
budget, and the equal split stays available for reproducing the paper.

Plans are public (no data); the run uses the quadratic mean family with the exact mean-type inner
release (fedkl/algorithms/output_perturbation/mean_type_inner.py), as in test_phased_output_pert.py.
"""

import dataclasses
import functools
import math
import os

import numpy as np
import pytest
import torch

# the exact audit of one diameter-test release and its federation
from test_diameter_output_pert import M, _federation, audit_neighbours  # noqa: E402
from test_output_pert import _one_thread  # noqa: E402,F401  (the thread fixture, autouse)

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.output_perturbation.mean_type_inner import MeanTypeInner, gaussian_users_rule
from fedkl.algorithms.output_perturbation.phased_common import (
    geometric_split,
    kappa,
    phase_weights,
    setting_for_problem,
    split_bound,
)
from fedkl.algorithms.output_perturbation.phased_erm import PhasedERM, PhasedParams
from fedkl.federation.means import MeanFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.problems.quadratic_mean import QuadraticMean, draw_user_means

D = 4
X = 3.0
POP = torch.tensor([1.0, -0.5, 0.25, 0.0], dtype=torch.float64)


def _problem():
    prob = QuadraticMean(D)
    return prob, setting_for_problem(prob, X, radius=3.0)


def _alg(eps, delta, setting, *, problem=None, fb=X, inner=None, rule=None, **p002):
    """PhasedERM on a fresh (eps, delta) budget with the ``--p002-*`` settings ``p002`` (without the prefix)
    over the paper's calibration (the default these tests were written against, unless they say otherwise)."""
    params = PhasedParams(**{"p002_calibration": "paper", **{f"p002_{k}": v for k, v in p002.items()}})
    ctx = BuildContext.fresh(eps=eps, delta=delta, problem=problem or QuadraticMean(D), feature_bound=fb)
    return PhasedERM(params, ctx, setting=setting, inner=inner, delta_rule=rule)


class PowerLawInner:
    """A stand-in inner release (plans only) whose sigma/Delta is exactly A eps^-p: with the scaled
    rule (a constant factor) every phase's c_j = A' eps_j^-p, where the optimum is known in closed form."""

    def __init__(self, p: float, A: float = 50.0):
        self.p, self.A = p, A

    def noise_ratio(self, n, eps, delta):
        return self.A * eps**-self.p

    def __call__(self, federation, releaser, call):  # pragma: no cover - plans only
        raise AssertionError("plans only")


def _power_law_alg(p, eps=4.0, delta=1e-5, T=8):
    _, st = _problem()
    return _alg(
        eps, delta, st, inner=PowerLawInner(p), phases=T, records=100, delta_rule="scaled", phase_split="optimal"
    )


def _S(alg, n, eps_split, delta_split, beta):
    return split_bound(
        phase_weights(len(eps_split)), [alg.phase_c(n, e, d, beta)[1] for e, d in zip(eps_split, delta_split)]
    )


@pytest.mark.parametrize("p", [1.0, 2.0, 2.5])
def test_optimal_split_minimises_the_bound_against_every_alternative(p):
    """c_j = A eps_j^-p: minimising S = sum_j w_j A^2 eps_j^-2p under sum_j eps_j = eps (strictly convex)
    gives eps_j ~ w_j^(1/(2p+1)) (Lagrange). The plan's split has that exponent, sums to the budget,
    and no alternative of a grid beats its S: the equal split, the geometric family at other exponents
    (among them the 4^(-j/3) that c ~ 1/eps would give), 200 random splits and every pairwise transfer
    of 5% of a phase's eps. A wrong rule (any other exponent) fails this test."""
    n, eps, delta, T = 10**6, 4.0, 1e-5, 8
    alg = _power_law_alg(p, eps, delta, T)
    plan = alg.plan(n, torch.zeros(D, dtype=torch.float64))
    beta = plan.beta / T
    e = [s.eps for s in plan.specs]
    d = [s.delta for s in plan.specs]
    assert math.fsum(e) == pytest.approx(eps, rel=1e-12) and math.fsum(d) == pytest.approx(delta, rel=1e-12)
    assert plan.extra["split_exponent"] == pytest.approx(1 / (2 * p + 1), rel=1e-9)
    w = phase_weights(T)
    assert [ei / e[0] for ei in e] == pytest.approx([(wj / w[0]) ** (1 / (2 * p + 1)) for wj in w], rel=1e-9)
    best = _S(alg, n, e, d, beta)
    assert plan.noise_constant == pytest.approx(math.sqrt(3 * best), rel=1e-12)
    alternatives = [geometric_split(eps, w, a) for a in (0.0, 0.05, 0.1, 0.2, 0.3, 1 / 3, 0.5)]
    rng = np.random.default_rng(0)
    alternatives += [tuple(eps * rng.dirichlet(np.ones(T))) for _ in range(200)]
    for i in range(T):
        for j in range(T):
            if i != j:
                alt = list(e)
                alt[i], alt[j] = alt[i] * 0.95, alt[j] + alt[i] * 0.05
                alternatives.append(tuple(alt))
    for alt in alternatives:
        assert _S(alg, n, alt, d, beta) >= best * (1 - 1e-12)
    # the chosen split is strictly better than the paper's equal split and than c ~ 1/eps's 4^(-j/3)
    assert _S(alg, n, geometric_split(eps, w, 0.0), d, beta) > 1.05 * best
    if p != 1.0:
        assert _S(alg, n, geometric_split(eps, w, 1 / 3), d, beta) > 1.05 * best


def test_the_equal_split_reproduces_the_paper():
    """--p002-phase-split equal (and the default "auto" with the paper's constants, --p002-calibration
    paper): (eps/T, delta/T) in every phase, c of that budget."""
    n, eps, delta, T = 10**6, 4.0, 1e-5, 8
    _, st = _problem()
    alg = _alg(eps, delta, st, inner=PowerLawInner(2.0), phases=T, records=100, delta_rule="scaled")
    plan = alg.plan(n, torch.zeros(D, dtype=torch.float64))
    assert [(s.eps, s.delta) for s in plan.specs] == [(eps / T, delta / T)] * T
    assert plan.extra["split_exponent"] == 0.0 and plan.noise_constant == pytest.approx(50.0 * (eps / T) ** -2.0)
    with pytest.raises(ValueError, match="--p002-phase-split must be one of"):
        PhasedParams(p002_phase_split="geometric")


def test_optimal_split_with_the_real_release_beats_every_admissible_alternative():
    """The default inner release (paper calibration, uc thresholds) at n = 5000, m = 100, eps = 8: c is
    not a power law (kappa is an integer, Delta_uc grows with kappa), so the rule is the power-law
    optimum at the measured slope, restricted to splits whose every call runs in Cor 3.7's regime
    (n >= 8 kappa_j). Its S is within 2% of every admissible member of a grid of alternatives (the
    geometric family at exponents 0..0.3, with delta split like eps or equally: the slack is c's
    departure from a power law; measured 0.6% here), and far below the equal split's (S / 60)."""
    _, st = _problem()
    n, m, eps, delta = 5000, 100, 8.0, 1e-5
    alg = _alg(eps, delta, st, records=m, phase_split="optimal")
    plan = alg.plan(n, torch.zeros(D, dtype=torch.float64))
    T = plan.phases
    beta = plan.beta / T
    e, d = [s.eps for s in plan.specs], [s.delta for s in plan.specs]
    assert math.fsum(e) == pytest.approx(eps, rel=1e-12) and math.fsum(d) == pytest.approx(delta, rel=1e-12)
    assert plan.kappa <= n // 8 and plan.extra["split_exponent"] > 0
    best = _S(alg, n, e, d, beta)
    w = phase_weights(T)
    equal = _S(alg, n, (eps / T,) * T, (delta / T,) * T, beta)
    assert best < 0.1 * equal
    for a in np.arange(0.0, 0.301, 0.025):
        ea = geometric_split(eps, w, float(a))
        for da in (geometric_split(delta, w, float(a)), (delta / T,) * T):
            try:
                ks_cs = [alg.phase_c(n, ej, dj, beta) for ej, dj in zip(ea, da)]
            except ValueError:
                continue
            if max(k for k, _ in ks_cs) > n // 8:
                continue  # outside Cor 3.7's regime: not admissible
            assert split_bound(w, [c for _, c in ks_cs]) >= best / 1.02, a


def test_optimal_split_charges_sum_to_the_budget(tmp_path):
    """A run charges every user one entry per phase at the plan's (eps_j, delta_j), decreasing in j,
    summing to the budget (basic composition), and reports the split in result details."""
    _, st = _problem()
    n, m, eps, delta, T = 256, 10**8, 20.0, 0.2, 4
    fed = MeanFederation(draw_user_means(n, m, D, POP, 1.0, 3))
    rule = gaussian_users_rule(1.0, D)
    alg = _alg(eps, delta, st, inner=MeanTypeInner(), rule=rule, records=m, phases=T, phase_split="optimal")
    plan = alg.plan(n, torch.zeros(D, dtype=torch.float64))
    ledger = PrivacyLedger(os.path.join(tmp_path, "l.sqlite"), Budget(eps, delta * 1.01))
    res = alg.run(fed, Releaser(ledger, NoiseSource(1)), torch.zeros(D, dtype=torch.float64))
    rels = ledger.releases()
    assert [(r["label"], r["eps"], r["delta"]) for r in rels] == [
        (f"phased-erm/phase-{s.index}", s.eps, s.delta) for s in plan.specs
    ]
    assert all(a["eps"] > b["eps"] and a["delta"] > b["delta"] for a, b in zip(rels, rels[1:]))
    for uid in fed.user_ids:
        sp = ledger.spend(uid)
        assert (sp.releases, sp.eps, sp.delta) == (T, pytest.approx(eps, rel=1e-12), pytest.approx(delta, rel=1e-12))
    ledger.verify()
    assert res.details["eps_per_phase"] == [s.eps for s in plan.specs]
    assert res.details["phase_split"].startswith("optimal")


# --- the default split's releases with the real inner release, audited exactly -----------------------
# The diameter-test federation of test_diameter_output_pert.py (synthetic logistic, d = 2, 40 records per
# user) at n = 60 users, (eps, delta) = (8, 0.3) over T = 4 phases, the default (profile) calibration.
AUDIT_N, AUDIT_EPS, AUDIT_DELTA, AUDIT_T = 60, 8.0, 0.3, 4


@functools.lru_cache(maxsize=2)
def _audit_plan(eps=AUDIT_EPS, delta=AUDIT_DELTA):
    fed, prob, ds = _federation(n=AUDIT_N)
    st = setting_for_problem(prob, ds.feature_bound, radius=3.0)
    alg = _alg(eps, delta, st, problem=prob, fb=ds.feature_bound, phases=AUDIT_T, records=M, calibration="profile")
    return alg, alg.plan(AUDIT_N, torch.zeros(prob.num_params, dtype=torch.float64))


def test_the_default_split_is_the_optimal_one_and_the_paper_constants_keep_the_equal_split():
    """phase_split "auto" (the default, --p002-phase-split auto) is the optimal split, except with the
    paper's constants (calibration "paper"), where it is the paper's (eps/T, delta/T); the optimal split's
    last phase has the smallest budget and the deepest test (kappa above the equal split's)."""
    alg, plan = _audit_plan()
    assert PhasedParams().p002_phase_split == "auto"
    assert alg.params.split == "optimal" and plan.extra["phase_split"].startswith("optimal")
    e, d = [s.eps for s in plan.specs], [s.delta for s in plan.specs]
    assert e == sorted(e, reverse=True) and d == sorted(d, reverse=True) and e[-1] < AUDIT_EPS / AUDIT_T
    k_equal = kappa(AUDIT_EPS / AUDIT_T, AUDIT_DELTA / AUDIT_T, "profile")
    assert kappa(e[-1], d[-1], "profile") == plan.kappa > k_equal
    paper = dataclasses.replace(alg.params, p002_calibration="paper")
    assert paper.split == "equal" and dataclasses.replace(paper, p002_phase_split="optimal").split == "optimal"
    eq = PhasedERM(paper, alg.ctx, setting=alg.setting).plan(AUDIT_N, torch.zeros(3, dtype=torch.float64))
    assert [(s.eps, s.delta) for s in eq.specs] == [(AUDIT_EPS / AUDIT_T, AUDIT_DELTA / AUDIT_T)] * AUDIT_T


@pytest.mark.parametrize("test", ["vertex-cover", "matching"])
@pytest.mark.parametrize("phase", range(AUDIT_T))
def test_every_phase_release_of_the_optimal_split_passes_the_exact_audit(phase, test):
    """Each phase's release at its own (eps_j, delta_j) of the optimal split (the last: the smallest budget
    the rule produces here, kappa 7, against 4 for the equal split) is the diameter-test release with the
    profile noise at that budget: its exact hockey-stick divergence between neighbouring federations (one
    user typical <-> outlier, with 0, 1, kappa and 2 kappa other outliers, at thresholds from 0.5, where
    nothing conflicts, to 0.03, where typical users conflict too: kept, deleted, ⊥ likely, ⊥ certain) is
    <= delta_j at eps_j in both directions (test_diameter_output_pert.audit_neighbours), and the instances
    come within an order of magnitude of delta_j."""
    alg, plan = _audit_plan()
    spec = plan.specs[phase]
    k = kappa(spec.eps, spec.delta, "profile")
    instances = [(others, Delta) for others in (0, 1, k, 2 * k) for Delta in (0.5, 0.2, 0.1, 0.06, 0.04, 0.03)]
    seen_bottom, seen_deletion, worst = audit_neighbours(test, "profile", instances, spec.eps, spec.delta, AUDIT_N)
    assert seen_bottom and seen_deletion and worst > 0.1 * spec.delta  # measured 0.13-0.16 delta_j: the ⊥ atom


def test_the_audit_catches_a_phase_released_at_the_whole_budget():
    """Negative control: the smallest phase's release calibrated at the run's whole (eps, delta) (a split
    that charged eps_j but forgot to calibrate the phase at it) breaks the audit at the phase's own
    (eps_T, delta_T) on the same instances (measured 0.063 > 0.039). The instances are not the theorem's
    worst case (the releases above reach 0.13-0.16 delta_j), so a milder error, the equal split's noise
    (eps/T, delta/T) for this phase, measures 0.012 and is NOT caught here; the calibration's own worst
    case (tests/algorithms/test_output_pert.py) is what catches a 1% error."""
    alg, plan = _audit_plan()
    last = plan.specs[-1]
    k = kappa(last.eps, last.delta, "profile")
    instances = [(others, Delta) for others in (0, 1, k, 2 * k) for Delta in (0.5, 0.2, 0.1, 0.06, 0.04, 0.03)]
    whole = (AUDIT_EPS, AUDIT_DELTA)
    *_, worst = audit_neighbours("vertex-cover", "profile", instances, *whole, AUDIT_N, claim=(last.eps, last.delta))
    assert worst > last.delta


def test_the_default_split_charges_compose_to_exactly_the_budget(tmp_path):
    """A run of the default Phased-ERM (profile noise, diameter test, optimal split) on a fresh ledger of
    budget (8, 0.3), at what the ledger offers (approx_left: the runner's budget, delta strictly below the
    ledger's): one entry per phase at the plan's (eps_j, delta_j), summing exactly (math.fsum) to the run's
    (eps, delta); the ledger accepts every charge and each user's guarantee is within the budget."""
    fed, _, _ = _federation(n=AUDIT_N)
    ledger = PrivacyLedger(os.path.join(tmp_path, "l.sqlite"), Budget(AUDIT_EPS, AUDIT_DELTA))
    eps, delta = ledger.approx_left(fed.user_ids)
    alg, plan = _audit_plan(eps, delta)
    assert plan.extra["phase_split"].startswith("optimal")
    res = alg.run(fed, Releaser(ledger, NoiseSource(7)), torch.zeros(fed.num_params, dtype=torch.float64))
    rels = ledger.releases()
    assert [(r["label"], r["eps"], r["delta"]) for r in rels] == [
        (f"phased-erm/phase-{s.index}", s.eps, s.delta) for s in plan.specs
    ]
    assert math.fsum(r["eps"] for r in rels) == eps and math.fsum(r["delta"] for r in rels) == delta
    for uid in fed.user_ids:
        sp = ledger.spend(uid)
        assert sp.releases == AUDIT_T and sp.epsilon(AUDIT_DELTA) <= AUDIT_EPS
        assert (sp.eps, sp.delta) == (pytest.approx(eps, rel=1e-12), pytest.approx(delta, rel=1e-12))
    ledger.verify()
    assert res.details["eps_per_phase"] == [s.eps for s in plan.specs]


# --- the profile calibration: fast search, same value --------------------------------------------
@pytest.mark.parametrize(
    "eps,delta,score",
    [
        (2.0 / 7, 0.000777 / 7, "matching"),  # a MovieLens phase of the equal split (n = 671, T = 7, eps = 2)
        (0.15, 0.00005, "matching"),  # below every phase budget the MovieLens split produces
        (1.0445363876637748, 0.039170114537391554, "exact"),  # the audit's smallest phase above
        (8.0, 1e-6, "exact"),
    ],
)
def test_profile_calibration_search_and_cache_return_exactly_the_exhaustive_value(eps, delta, score):
    """stability_profile.calibrate skips the grid points that cannot win (one evaluation of H at the best
    ratio so far) and starts at the usual winner: it returns exactly (==, every field) what bisecting every
    grid point in grid order returns (the first point of least ratio), and its cached value is the uncached
    one."""
    from fedkl.algorithms.output_perturbation.stability_profile import (
        DELTA_FRACTIONS,
        EPS_FRACTIONS,
        _smallest_ratio,
        calibrate,
    )
    from fedkl.privacy.mechanisms import TruncatedDiscreteLaplace

    exhaustive = None
    for fe in EPS_FRACTIONS:
        for fd in DELTA_FRACTIONS:
            law = TruncatedDiscreteLaplace(float(fe) * eps, fd * delta)
            ratio = _smallest_ratio(eps, delta, law, score)
            if exhaustive is None or ratio < exhaustive[2]:
                exhaustive = (law.eps, law.delta, ratio, law.kappa)
    uncached = calibrate.__wrapped__(eps, delta, score)
    assert dataclasses.astuple(uncached) == exhaustive
    assert calibrate(eps, delta, score) == uncached and calibrate(eps, delta, score) is calibrate(eps, delta, score)


@pytest.mark.parametrize("score", ["exact", "matching"])
def test_worst_case_divergence_is_the_largest_pairwise_hockey_stick(score):
    """worst_case_divergence (computed once per R1 law, then per sigma) against the closed-form hockey-stick
    of every reachable score pair computed independently (test_diameter_output_pert._hockey_stick: ⊥ atom
    Pr[R1 < d] plus a Gaussian at the chain gap (c d + c d' + 2) Delta, fully apart beyond the depth)."""
    from test_diameter_output_pert import _hockey_stick

    from fedkl.algorithms.output_perturbation.stability_profile import chain_factor, worst_case_divergence
    from fedkl.privacy.mechanisms import TruncatedDiscreteLaplace

    c = chain_factor(score)
    for eps, law, ratio in (
        (2.0, TruncatedDiscreteLaplace(1.0, 1e-4), 50.0),
        (0.5, TruncatedDiscreteLaplace(0.3, 1e-3), 900.0),
    ):
        k, pmf = law.kappa, law.pmf()
        passes = [float(pmf[d:].sum()) for d in range(2 * k + 2)]  # Pr[R1 >= d]
        want = 0.0
        for d in range(2 * k + 2):
            for dp in (d - 1, d, d + 1):
                if not 0 <= dp <= 2 * k + 1:
                    continue
                gap = c * d + c * dp + 2.0 if c * (d + dp) <= 4 * c * k else 1e9
                mu = np.array([gap / ratio])  # sigma = 1
                want = max(
                    want, _hockey_stick(1 - passes[d], passes[d], mu, 1 - passes[dp], passes[dp], 0 * mu, 1.0, eps)
                )
        assert worst_case_divergence(eps, ratio, law, score) == pytest.approx(want, rel=1e-9, abs=1e-15)
