"""Paper 002's phased algorithms: Phased-ERM (Alg 3), Phased-SCO (Alg 4), SC-ERM / SC-SCO (Alg 5/6).

Data: the mean-estimation family of note §7 T6(a) (fedkl/problems/quadratic_mean.py): l = 0.5||theta - x||^2,
user means drawn exactly from N(theta_pop, s^2 I / m), so the optimum is known in closed form
(theta* = mean of the user means, theta_pop for the population) and every phase's minimizer is exact.
Inner releases: fedkl's SCOutputPert (n <= 20: its certificate or its exact enumeration) or, for
larger cohorts, the exact mean-type DelOutputPert of fedkl/algorithms/output_perturbation/mean_type_inner.py. Fixed seeds
everywhere; sampled checks use tolerances of a few standard errors of their own sample.
"""

import csv
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from release_spies import charge_record

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.output_perturbation.del_output_pert import DeletionRelease
from fedkl.algorithms.output_perturbation.mean_type_inner import MeanTypeInner, gaussian_users_rule
from fedkl.algorithms.output_perturbation.phased_common import (
    CohortFederation,
    PhaseCall,
    lam_sco,
    sc_output_pert_inner,
    sco_cohorts,
    setting_for_problem,
)
from fedkl.algorithms.output_perturbation.phased_erm import PhasedERM, PhasedParams
from fedkl.algorithms.output_perturbation.phased_sco import PhasedSCO
from fedkl.algorithms.output_perturbation.sc_phased import SCPhasedERM, SCPhasedSCO
from fedkl.federation.means import MeanFederation
from fedkl.privacy import Budget, BudgetExceeded, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.charges import ApproxDPCharge
from fedkl.problems.quadratic_mean import QuadraticMean, draw_user_means

D = 4
POP = torch.tensor([1.0, -0.5, 0.25, 0.0], dtype=torch.float64)
X = 3.0  # public bound on ||x|| (feature bound) of the quadratic family
RADIUS = 3.0  # K = B(0, 3) holds theta_pop and every phase minimizer used here
REPO = pathlib.Path(__file__).resolve().parents[2]  # the simulations/ studies run from the repository root


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Recorder:
    """Stands in for the ledger where many releases of one dataset are sampled (no budget check)."""

    def __init__(self):
        self.charges = []

    def charge(self, user_ids, charge, **kw):
        self.charges.append({"users": list(user_ids), **charge_record(charge, **kw)})
        return len(self.charges)


def _problem():
    prob = QuadraticMean(D)
    return prob, setting_for_problem(prob, X, radius=RADIUS)


def _fed(n, m, seed=0, s=1.0):
    return MeanFederation(draw_user_means(n, m, D, POP, s, seed))


def _ledger(tmp_path, eps, delta, name="l.sqlite"):
    return PrivacyLedger(os.path.join(tmp_path, name), Budget(eps, delta))


def _within_budget(ledger, eps, delta):
    b = ledger.budget
    assert b.epsilon >= eps * (1 - 1e-9)
    for uid in ledger._db.execute("SELECT user_id FROM users").fetchall():
        sp = ledger.spend(uid[0])
        assert sp.eps <= b.epsilon * (1 + 1e-9) and sp.delta < b.delta and sp.rho == 0.0
    ledger.verify()


def _zeros():
    return torch.zeros(D, dtype=torch.float64)


def _alg(cls, eps, delta, setting, *, problem=None, inner=None, rule=None, seed=0, **p002):
    """``cls`` on a fresh (eps, delta) budget, with the quadratic problem's ``setting`` and the ``--p002-*``
    settings ``p002`` (without the prefix) over the paper's calibration, which these tests were written for."""
    params = PhasedParams(**{"p002_calibration": "paper", **{f"p002_{k}": v for k, v in p002.items()}})
    ctx = BuildContext.fresh(eps=eps, delta=delta, problem=problem or QuadraticMean(D), feature_bound=X, seed=seed)
    return cls(params, ctx, setting=setting, inner=inner, delta_rule=rule)


# --- schedules (public: computed before any data) -------------------------------------------------
def _delta_uc(G, mu, n, m, k, beta):
    """note §2B's Delta_uc, written out independently of the library."""
    r = 4 * k
    count = n * sum(math.comb(n, s) for s in range(r + 1))
    return 5 * G * math.sqrt(math.log(count) + math.log(1 / beta)) / (mu * (n - r - 1) * math.sqrt(m))


def test_phased_erm_schedule_matches_the_formulas():
    prob, st = _problem()
    n, m, eps, delta = 5000, 100, 50.0, 1e-3
    alg = _alg(PhasedERM, eps, delta, st, records=m, phase_split="equal")
    plan = alg.plan(n, _zeros())
    T = math.ceil(math.log(n * m))
    assert plan.phases == T == 14
    dop = DeletionRelease(eps / T, delta / T, 1.0, "paper")
    k, ratio, G = dop.kappa, dop.sigma, st.lipschitz
    beta_i = 1.0 / (n * m) / T
    c = ratio * _delta_uc(2 * G, 1.0, n, m, k, beta_i) * n * math.sqrt(m) / (2 * G)
    Dist = RADIUS + 0.0  # D = radius + ||w0||
    lam_star = (2 / math.sqrt(3)) * c * G * math.sqrt(D) / (Dist * n * math.sqrt(m))
    assert plan.kappa == k and plan.noise_constant == pytest.approx(c, rel=1e-12)
    assert plan.lam == pytest.approx(lam_star, rel=1e-12)
    for i, spec in enumerate(plan.specs, start=1):
        assert (spec.index, spec.eps, spec.delta, spec.users) == (i, eps / T, delta / T, None)
        assert spec.lam == pytest.approx(lam_star * 4**i, rel=1e-12)
        assert spec.Delta == pytest.approx(_delta_uc(2 * G, 1.0 + spec.lam, n, m, k, beta_i), rel=1e-12)
    # lambda* minimises 2 lam D^2 + (8/3) c^2 d G^2 / (lam n^2 m), at value (8/sqrt 3) c D G sqrt(d)/(n sqrt m);
    # the paper's lam = G sqrt(d)/(D n sqrt m) is (2/sqrt 3) c times smaller (pitfall 7)
    bound = lambda lam: 2 * lam * Dist**2 + (8 / 3) * c**2 * D * G**2 / (lam * n**2 * m)  # noqa: E731
    assert bound(lam_star) == pytest.approx(8 / math.sqrt(3) * c * Dist * G * math.sqrt(D) / (n * math.sqrt(m)))
    assert bound(lam_star) < min(bound(lam_star * 1.05), bound(lam_star / 1.05))
    assert plan.lam / (G * math.sqrt(D) / (Dist * n * math.sqrt(m))) == pytest.approx(2 / math.sqrt(3) * c)
    # the uc rule is refused (public n, nothing read) below 4 kappa' + 2 users
    fixed_T = PhasedERM(replace(alg.params, p002_phases=T), alg.ctx, setting=st)
    assert fixed_T.plan(4 * k + 2, _zeros()).kappa == k
    with pytest.raises(ValueError, match="4 kappa"):
        fixed_T.plan(4 * k + 1, _zeros())


def test_phased_sco_schedule_cohorts_and_lambda():
    prob, st = _problem()
    n, m, eps, delta, seed = 5000, 100, 8.0, 1e-5, 7
    ids = tuple(f"user:{u}" for u in range(n))
    alg = _alg(PhasedSCO, eps, delta, st, seed=seed, records=m)
    plan = alg.plan(n, _zeros(), user_ids=ids)
    k = DeletionRelease(eps, delta, 1.0).kappa
    n0 = 8 * k
    T = math.floor(math.log2(n / n0))
    assert (k, n0, T, plan.phases) == (5, 40, 6, 6)
    assert (n >> T) >= n0 > (n >> (T + 1))  # pitfall 5: the printed ceil would leave a last cohort < N0
    # cohorts: ranks [floor(n/2^i), floor(n/2^(i-1))) of sha256(seed, id), disjoint, data-independent
    order = sorted(range(n), key=lambda u: hashlib.sha256(f"p002-phased-sco\x1f{seed}\x1f{ids[u]}".encode()).digest())
    cohorts = [list(s.users) for s in plan.specs]
    assert cohorts == [sorted(order[n >> i : n >> (i - 1)]) for i in range(1, T + 1)]
    assert [len(c) for c in cohorts] == [(n >> (i - 1)) - (n >> i) for i in range(1, T + 1)]
    flat = [u for c in cohorts for u in c]
    assert len(flat) == len(set(flat)) == n - (n >> T) and min(len(c) for c in cohorts) >= n0
    assert cohorts != [
        list(s.users)
        for s in alg.__class__(alg.params, replace(alg.ctx, seed=seed + 1), setting=st)
        .plan(n, _zeros(), user_ids=ids)
        .specs
    ]
    # lambda_SCO (pitfall 6) with c = max over cohorts; Delta_i = Delta_uc(2G, 1 + lam_i, n_i, m, kappa, beta/T)
    G, beta_i = st.lipschitz, 1.0 / (n * m) / T
    ratio = DeletionRelease(eps, delta, 1.0).sigma
    c = ratio * max(_delta_uc(2 * G, 1.0, len(ch), m, k, beta_i) * len(ch) * math.sqrt(m) / (2 * G) for ch in cohorts)
    lam = (G / RADIUS) * math.sqrt((8 + 4 * (T - 1) * D * c * c / n) / (n * m))
    assert plan.lam == pytest.approx(lam, rel=1e-12) == lam_sco(c, G, RADIUS, D, n, m, T)
    for i, (spec, ch) in enumerate(zip(plan.specs, cohorts), start=1):
        assert (spec.eps, spec.delta) == (eps, delta) and spec.lam == pytest.approx(lam * 4**i)
        assert spec.Delta == pytest.approx(_delta_uc(2 * G, 1.0 + spec.lam, len(ch), m, k, beta_i), rel=1e-12)
    with pytest.raises(ValueError, match="2 N0"):
        alg.plan(2 * n0 - 1, _zeros(), user_ids=ids[: 2 * n0 - 1])


@pytest.mark.parametrize("cls", [SCPhasedERM, SCPhasedSCO])
def test_strongly_convex_localisation_schedule(cls):
    prob, st = _problem()
    n, m, eps, delta = 5000, 100, 16.0, 1e-3
    plan = _alg(cls, eps, delta, st, records=m).plan(n, _zeros(), tuple(f"user:{u}" for u in range(n)))
    beta = 1.0 / (2 * n * n * m)
    dop = DeletionRelease(eps / 2, delta / 2, 1.0)
    G, mu = st.lipschitz, 1.0
    Delta0 = _delta_uc(G, mu, n, m, dop.kappa, beta)
    sigma0 = dop.sigma * Delta0
    R = sigma0 * (math.sqrt(D) + math.sqrt(2 * math.log(1 / beta)))  # pitfall 8
    if cls is SCPhasedSCO:
        R += 30 * G * math.sqrt(math.log(2 / beta)) / (mu * math.sqrt(n * m))  # Prop B.1
    assert (plan.eps0, plan.delta0, plan.beta) == (eps / 2, delta / 2, beta)
    assert plan.Delta0 == pytest.approx(Delta0, rel=1e-12) and plan.sigma0 == pytest.approx(sigma0, rel=1e-12)
    assert plan.radius_prime == pytest.approx(R, rel=1e-12) and plan.phased.distance == plan.radius_prime
    spec_eps = sum(s.eps for s in plan.phased.specs)
    if cls is SCPhasedERM:
        assert spec_eps == pytest.approx(eps / 2) and plan.phased.phases == math.ceil(math.log(n * m))
    else:
        assert {(s.eps, s.delta) for s in plan.phased.specs} == {(eps / 2, delta / 2)}


# --- ledger (T7): charges, no user over budget, refusal before anything --------------------------
def test_phased_erm_ledger_charges_T_times_eps_over_T(tmp_path):
    prob, st = _problem()
    n, m, eps, delta, T = 16, 10**12, 30.0, 0.3, 3
    fed = _fed(n, m)
    ledger = _ledger(tmp_path, eps, 0.31)
    alg = _alg(PhasedERM, eps, delta, st, phases=T, records=m, phase_split="equal")  # the paper's split
    res = alg.run(fed, Releaser(ledger, NoiseSource(1)), _zeros())
    rels = ledger.releases()
    assert [(r["label"], r["users"]) for r in rels] == [(f"phased-erm/phase-{i}", n) for i in (1, 2, 3)]
    assert all(r["eps"] == pytest.approx(eps / T) and r["delta"] == pytest.approx(delta / T) for r in rels)
    for uid in fed.user_ids:
        sp = ledger.spend(uid)
        assert (sp.releases, sp.eps, sp.delta) == (T, pytest.approx(eps), pytest.approx(delta))
    _within_budget(ledger, eps, delta)
    assert res.bottoms == 0 and res.phases == T and len(res.history) == T


def test_phased_sco_charges_each_user_once_and_only_its_cohort(tmp_path):
    prob, st = _problem()
    n, m, eps, delta = 256, 10**8, 10.0, 0.1
    fed = _fed(n, m, seed=3)
    ledger = _ledger(tmp_path, eps, 0.11)
    alg = _alg(PhasedSCO, eps, delta, st, inner=MeanTypeInner(), rule=gaussian_users_rule(1.0, D), seed=5, records=m)
    plan = alg.plan(n, _zeros(), user_ids=fed.user_ids)
    assert plan.phases == 3 and [len(s.users) for s in plan.specs] == [128, 64, 32]
    res = alg.run(fed, Releaser(ledger, NoiseSource(2)), _zeros())
    rels = ledger.releases()
    assert [r["users"] for r in rels] == [128, 64, 32]
    assert all((r["eps"], r["delta"]) == (eps, delta) for r in rels)
    cohort_of = {fed.user_ids[u]: s.index for s in plan.specs for u in s.users}
    for uid in fed.user_ids:
        sp = ledger.spend(uid)
        if uid in cohort_of:
            assert (sp.releases, sp.eps, sp.delta) == (1, eps, delta)
        else:
            assert (sp.releases, sp.eps) == (0, 0.0)  # the n/2^T users outside every cohort
    # the release of phase i charged exactly cohort i (the ledger stores each release's members)
    for (members,), spec in zip(
        ledger._db.execute("SELECT c.members FROM releases r JOIN cohorts c ON c.id = r.cohort_id ORDER BY r.id"),
        plan.specs,
    ):
        assert sorted(json.loads(members)) == sorted(fed.user_ids[u] for u in spec.users)
    _within_budget(ledger, eps, delta)
    assert res.bottoms == 0


@pytest.mark.parametrize("cls", [SCPhasedERM, SCPhasedSCO])
def test_strongly_convex_variants_charge_two_halves(tmp_path, cls):
    prob, st = _problem()
    n, m, eps, delta = 256, 10**8, 20.0, 0.2
    fed = _fed(n, m, seed=4)
    ledger = _ledger(tmp_path, eps, 0.21)
    rule = gaussian_users_rule(1.0, D)
    alg = _alg(cls, eps, delta, st, inner=MeanTypeInner(), rule=rule, records=m, phases=3, min_cohort=32)
    res = alg.run(fed, Releaser(ledger, NoiseSource(5)), _zeros())
    rels = ledger.releases()
    assert rels[0]["label"] == f"{cls.name}/localize" and rels[0]["users"] == n
    assert (rels[0]["eps"], rels[0]["delta"]) == (eps / 2, delta / 2)
    if cls is SCPhasedERM:  # then T releases to everyone at the plan's split of (eps/2, delta/2)
        split = res.details["schedule"][1:]
        assert [(r["users"], r["eps"], r["delta"]) for r in rels[1:]] == [(n, h["eps"], h["delta"]) for h in split]
        assert math.fsum(r["eps"] for r in rels[1:]) == pytest.approx(eps / 2, rel=1e-12)
        assert math.fsum(r["delta"] for r in rels[1:]) == pytest.approx(delta / 2, rel=1e-12)
        totals = {(1 + 3, eps, delta)}
    else:  # then (eps/2, delta/2) once, cohort users only
        assert [(r["users"], r["eps"], r["delta"]) for r in rels[1:]] == [
            (128, eps / 2, delta / 2),
            (64, eps / 2, delta / 2),
            (32, eps / 2, delta / 2),
        ]
        totals = {(2, eps, delta), (1, eps / 2, delta / 2)}
    seen = {(sp.releases, round(sp.eps, 9), round(sp.delta, 12)) for sp in (ledger.spend(u) for u in fed.user_ids)}
    assert seen == totals
    _within_budget(ledger, eps, delta)
    assert res.w is not None and res.phases == 4 and res.history[0]["phase"] == 0


def _all_algorithms(prob, st, n, m, eps, delta):
    rule = gaussian_users_rule(1.0, D)
    base = {"records": m, "phases": 3, "min_cohort": 32}
    return [
        _alg(PhasedERM, eps, delta, st, inner=MeanTypeInner(), rule=rule, **base),
        _alg(PhasedSCO, eps, delta, st, inner=MeanTypeInner(), rule=rule, **{**base, "phases": None}),
        _alg(SCPhasedERM, eps, delta, st, inner=MeanTypeInner(), rule=rule, **base),
        _alg(SCPhasedSCO, eps, delta, st, inner=MeanTypeInner(), rule=rule, **base),
    ]


def test_exhausted_budget_refuses_before_anything_is_read_or_released(tmp_path):
    prob, st = _problem()
    n, m, eps, delta = 256, 10**8, 20.0, 0.2
    for i, alg in enumerate(_all_algorithms(prob, st, n, m, eps, delta)):
        fed = _fed(n, m, seed=6)
        ledger = _ledger(tmp_path, eps, 0.21, f"l{i}.sqlite")
        ledger.charge(
            [fed.user_ids[0], fed.user_ids[-1]], ApproxDPCharge(eps=1.0, delta=0.0, mechanism="test"), label="earlier"
        )
        before = ledger.num_releases()
        with pytest.raises(BudgetExceeded, match="the run would take"):  # the runner's check (fedkl.runner._afford)
            ledger.check(alg.needs(fed.user_ids))
        assert ledger.num_releases() == before and fed.queries == 0, alg.name
        with pytest.raises(BudgetExceeded, match="Nothing was charged"):  # a direct run: the ledger, at the charge
            alg.run(fed, Releaser(ledger, NoiseSource(0)), _zeros())
    # a user outside every Phased-SCO cohort is never charged, so its spent budget does not block the run
    alg = _all_algorithms(prob, st, n, m, eps, delta)[1]
    fed = _fed(n, m, seed=6)
    plan = alg.plan(n, _zeros(), user_ids=fed.user_ids)
    outside = sorted(set(range(n)) - {u for s in plan.specs for u in s.users})
    ledger = _ledger(tmp_path, eps, 0.21, "outside.sqlite")
    ledger.charge(
        [fed.user_ids[outside[0]]], ApproxDPCharge(eps=eps * 0.9, delta=0.0, mechanism="test"), label="earlier"
    )
    ledger.check(alg.needs(fed.user_ids))
    alg.run(fed, Releaser(ledger, NoiseSource(0)), _zeros())
    assert ledger.num_releases() == 1 + plan.phases


def test_refusals_before_reading_data(tmp_path):
    prob, st = _problem()
    fed = _fed(16, 10**6)
    ledger = _ledger(tmp_path, 30.0, 0.31)
    cfg = {"records": 10**6}  # T = ceil(ln 16e6) = 17 -> kappa' too big
    with pytest.raises(ValueError, match="4 kappa"):
        _alg(PhasedERM, 30.0, 0.3, st, **cfg).run(fed, Releaser(ledger, NoiseSource(0)), _zeros())
    with pytest.raises(ValueError, match="zCDP filter"):
        _alg(PhasedERM, 30.0, 0.3, st, phases=3, **cfg).run(
            fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(1.0)), _zeros()
        )
    weak = QuadraticMean(D)
    flat = replace(setting_for_problem(weak, X, radius=RADIUS), strong_convexity=0.0)
    with pytest.raises(ValueError, match="strongly convex"):
        _alg(SCPhasedERM, 30.0, 0.3, flat, problem=weak, phases=3, **cfg).run(
            fed, Releaser(ledger, NoiseSource(0)), _zeros()
        )
    with pytest.raises(ValueError, match="fixed threshold rule"):
        _alg(SCPhasedSCO, 30.0, 0.3, st, delta_rule="fixed", **cfg)
    assert fed.queries == 0 and ledger.num_releases() == 0


# --- ⊥ handling ---------------------------------------------------------------------------------
def test_bottom_keeps_the_previous_centre(tmp_path):
    """Phase 2's threshold is forced to 1e-12 (a public constant: still the analysed mechanism), so
    the exact test fails for every R1: the release is ⊥, it is charged, and phase 3 is centred at
    phase 1's output."""
    prob, st = _problem()
    n, m = 16, 10**12
    fed = _fed(n, m, seed=8)
    base = sc_output_pert_inner(prob, X, use_certificate=False)  # the exact enumeration decides
    calls, outs = [], []

    def inner(f, r, call: PhaseCall):
        call = replace(call, Delta=1e-12) if call.index == 2 else call
        calls.append(call)
        outs.append(base(f, r, call))
        return outs[-1]

    ledger = _ledger(tmp_path, 30.0, 0.31)
    res = _alg(PhasedERM, 30.0, 0.3, st, inner=inner, phases=3, records=m).run(
        fed, Releaser(ledger, NoiseSource(9)), _zeros()
    )
    assert [o.theta is None for o in outs] == [False, True, False]
    assert [h["bottom"] for h in res.history] == [False, True, False] and res.bottoms == 1
    assert res.details["bottoms"] == [2]
    assert torch.equal(calls[2].center, calls[1].center)  # the centre survived the ⊥
    assert torch.equal(calls[1].center, outs[0].theta)  # = phase 1's output (no clip/projection here)
    assert torch.equal(res.w, outs[2].theta)
    assert ledger.num_releases() == 3  # ⊥ is a release: it was charged


def test_localisation_bottom_aborts_the_strongly_convex_variants(tmp_path):
    prob, st = _problem()
    fed = _fed(16, 10**12, seed=8)
    base = sc_output_pert_inner(prob, X, use_certificate=False)

    def inner(f, r, call):
        return base(f, r, replace(call, Delta=1e-12))

    ledger = _ledger(tmp_path, 60.0, 0.61)
    alg = _alg(SCPhasedERM, 60.0, 0.6, st, inner=inner, phases=3, records=10**12)
    res = alg.run(fed, Releaser(ledger, NoiseSource(0)), _zeros())
    assert res.w is None and res.bottoms == 1 and res.details["aborted"] == "localization ⊥"
    assert [(r["label"], r["eps"]) for r in ledger.releases()] == [("sc-phased-erm/localize", 30.0)]


# --- convergence to a known optimum -----------------------------------------------------------------
def _predicted_sq_error(history, e0_sq, lam_key="lam", stat=None):
    """E||theta^_T - target||^2 for the quadratic family with every test passing at dist = 0 and no
    clip/projection active: e_i = a_i e_{i-1} + (1 - a_i) zeta_i + xi_i, a_i = lam_i/(1 + lam_i),
    xi_i ~ N(0, sigma_i^2 I_d), zeta_i ~ N(0, stat_i I_d) the phase data's deviation from the target."""
    v = e0_sq
    for j, h in enumerate(history):
        a = h[lam_key] / (1.0 + h[lam_key])
        v = a * a * v + D * h["sigma"] ** 2 + (0.0 if stat is None else (1 - a) ** 2 * D * stat[j])
    return v


def test_phased_erm_converges_to_the_empirical_optimum():
    """100 independent runs (fixed seeds) of Phased-ERM with fedkl's SCOutputPert on one dataset:
    the mean squared distance to theta* = mean of the user means matches the exact prediction of the
    noise recursion within 4 standard errors (||e||^2 / v ~ chi^2_d: SE = v sqrt(2/(d R)))."""
    prob, st = _problem()
    n, m, R = 16, 10**12, 100
    fed = _fed(n, m, seed=11)
    theta_star = fed.means.mean(0)
    alg = _alg(PhasedERM, 30.0, 0.3, st, phases=3, records=m)
    sq, hist = [], None
    for rep in range(R):
        res = alg.run(fed, Releaser(_Recorder(), NoiseSource(1000 + rep)), _zeros())
        assert res.bottoms == 0 and not any(h["clipped"] or h["projected"] for h in res.history)
        sq.append(float((res.w - theta_star).norm() ** 2))
        hist = res.history
    v = _predicted_sq_error(hist, float(theta_star.norm() ** 2))
    assert abs(np.mean(sq) - v) <= 4 * v * math.sqrt(2 / (D * R))
    assert math.sqrt(v) < 1e-2 * float(theta_star.norm())  # it converged from w0 = 0


def test_sc_phased_erm_and_phased_sco_converge():
    """Alg 5 (empirical optimum, 40 noise seeds on one dataset) and Alg 4 (population optimum
    theta_pop, 40 fresh datasets: the cohort means add s^2/(n_i m) per coordinate), both with the
    exact mean-type inner release at n = 256; tolerance 4 SE of the chi^2 statistic."""
    prob, st = _problem()
    n, m, R = 256, 10**8, 40
    rule = gaussian_users_rule(1.0, D)
    cfg = {"records": m, "phases": 3}
    fed = _fed(n, m, seed=12)
    theta_star = fed.means.mean(0)
    sq = []
    for rep in range(R):
        res = _alg(SCPhasedERM, 20.0, 0.2, st, inner=MeanTypeInner(), rule=rule, **cfg).run(
            fed, Releaser(_Recorder(), NoiseSource(2000 + rep)), _zeros()
        )
        assert res.bottoms == 0 and not any(h["clipped"] or h["projected"] for h in res.history)
        sq.append(float((res.w - theta_star).norm() ** 2))
    hist = res.history
    v = _predicted_sq_error(hist[1:], D * hist[0]["sigma"] ** 2)  # theta0 = theta* + N(0, sigma0^2 I)
    assert abs(np.mean(sq) - v) <= 4 * v * math.sqrt(2 / (D * R))

    sco = _alg(PhasedSCO, 20.0, 0.2, st, inner=MeanTypeInner(), rule=rule, records=m, min_cohort=32)
    sq = []
    for rep in range(R):
        f = _fed(n, m, seed=100 + rep)
        res = sco.run(f, Releaser(_Recorder(), NoiseSource(3000 + rep)), _zeros())
        assert res.bottoms == 0 and not any(h["clipped"] or h["projected"] for h in res.history)
        sq.append(float((res.w - POP).norm() ** 2))
    stat = [1.0 / (h["users"] * m) for h in res.history]
    v = _predicted_sq_error(res.history, float(POP.norm() ** 2), stat=stat)
    assert abs(np.mean(sq) - v) <= 4 * v * math.sqrt(2 / (D * R))


# --- pieces --------------------------------------------------------------------------------------
def test_cohort_federation_reads_and_charges_only_its_users(tmp_path):
    fed = _fed(10, 100)
    view = CohortFederation(fed, [7, 2, 5])
    assert view.user_ids == (fed.user_ids[7], fed.user_ids[2], fed.user_ids[5]) and view.num_users == 3
    from fedkl.federation.base import GradientsAtPoints

    got = view.compute(GradientsAtPoints(torch.zeros(1, D, dtype=torch.float64))).values[:, 0]
    assert torch.equal(got, -fed.means[[7, 2, 5]])
    assert sco_cohorts(fed.user_ids, 2, 0) == sco_cohorts(_fed(10, 1, seed=99).user_ids, 2, 0)  # ids only


def test_mean_type_inner_is_fedkl_mean_output_pert_with_the_phase_minimizers():
    """The mean-type inner release equals fedkl's MeanOutputPert (the note's §5(c) mechanism) run
    on v_u = (xbar_u + lam c)/(1 + lam), with rho = Delta (n - 4 kappa - 1): same deletions, same ⊥,
    same value up to the last bits of sigma; with 3 outlying users the vertex cover decides."""
    from fedkl.algorithms.output_perturbation.mean_output_pert import MeanOutputPert

    n, eps, delta, lam = 40, 20.0, 0.1, 0.3
    means = draw_user_means(n, 10**4, D, POP, 1.0, 21)
    means[[3, 17, 29]] += torch.tensor([5.0, 0, 0, 0], dtype=torch.float64)
    fed = MeanFederation(means)
    center = torch.tensor([0.5, 0.0, 0.0, 0.1], dtype=torch.float64)
    Delta = 0.02
    k = DeletionRelease(eps, delta, 1.0).kappa
    V = (means + lam * center) / (1 + lam)
    for seed in range(6):
        mine = MeanTypeInner(calibration="tight")(
            fed, Releaser(_Recorder(), NoiseSource(seed)), PhaseCall("x", 1, eps, delta, Delta, lam, center)
        )
        ref = MeanOutputPert(eps, delta, Delta * (n - 4 * k - 1), "tight").run_vectors(
            V, Releaser(_Recorder(), NoiseSource(seed)), fed.user_ids
        )
        assert mine.diagnostics["dist"] == ref.diagnostics["dist"] == 3
        assert (mine.theta is None) == (ref.theta is None)
        if mine.theta is not None:
            assert torch.allclose(mine.theta, ref.theta, rtol=0, atol=1e-9 * ref.sigma)
        assert mine.sigma == pytest.approx(ref.sigma, rel=1e-9)


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"p002_phases": 0}, "--p002-phases must be >= 1, got 0"),
        ({"p002_records": 0}, "--p002-records must be >= 1, got 0"),
        ({"p002_lam": -1.0}, "--p002-lam must be finite and > 0, got -1.0"),
        ({"p002_delta_scale": math.inf}, "--p002-delta-scale must be finite and > 0, got inf"),
        ({"p002_beta": 1.0}, "--p002-beta must be in \\(0, 1\\), got 1.0"),
        ({"p002_select_fraction": 1.5}, "--p002-select-fraction must be in \\(0, 1\\), got 1.5"),
        ({"p002_min_cohort": 1}, "--p002-min-cohort must be >= 2, got 1"),
    ],
)
def test_phased_params_refuse_bad_values_naming_the_flag(bad, message):
    with pytest.raises(ValueError, match=message):
        PhasedParams(**bad)


def test_the_class_built_directly_trains_what_fedkl_run_trains():
    """PhasedParams is the only configuration: research code that builds a phased class from its defaults gets
    the CLI's profile calibration and optimal split (PhasedConfig defaulted to the paper's constants)."""
    from fedkl.runner import RunConfig

    ctx = BuildContext.fresh(eps=2.0, delta=1e-5, problem=QuadraticMean(D), feature_bound=X)
    for cls in (PhasedERM, PhasedSCO, SCPhasedERM, SCPhasedSCO):
        alg = cls(PhasedParams(), ctx)
        assert alg.params == RunConfig.from_settings(algorithm=cls.name).params
        assert alg.inner.calibration == "profile" and alg.params.split == "optimal" and alg.rule == "uc"
        assert (alg.eps, alg.delta) == (2.0, 1e-5)


def test_builders_read_hyperparameters(tmp_path):
    from build_helpers import build

    from fedkl.algorithms.registry import REGISTRY
    from fedkl.runner import RunConfig

    prob, _ = _problem()
    phased = {"phased-erm", "phased-sco", "sc-phased-erm", "sc-phased-sco"}
    assert {name for name, spec in REGISTRY.items() if spec.params is PhasedParams} == phased
    ledger = _ledger(tmp_path, 8.0, 1e-5)
    fed = _fed(64, 10**6)
    for name in sorted(phased):
        cfg = RunConfig.from_settings(
            algorithm=name,
            seed=3,
            stability_delta=0.5,
            radius=RADIUS,
            p002_records=10**6,
            p002_phases=4,
            p002_delta_rule="scaled",
            p002_delta_scale=2.0,
            p002_calibration="tight",
        )
        alg = build(
            cfg,
            0.0,
            problem=prob,
            dataset=SimpleNamespace(feature_bound=X),
            delta=1e-5,
            ledger=ledger,
            user_ids=fed.user_ids,
        )
        c = alg.params
        assert alg.name == name and alg.eps == pytest.approx(8.0) and alg.delta == pytest.approx(1e-5, rel=1e-6)
        assert (c.p002_records, c.p002_phases, alg.rule, c.p002_delta_scale, c.p002_calibration, alg.ctx.seed) == (
            10**6,
            4,
            "scaled",
            2.0,
            "tight",
            3,
        )
        assert c.p002_lam is None and c.p002_beta is None and alg.setting.radius == RADIUS
        assert alg.inner.calibration == "tight"  # the inner release reads --p002-calibration too


def test_slope_experiment_point_is_in_the_theorem_regime(tmp_path):
    """One point of the study simulations/studies/paper002_slopes.toml (n = 4000, m = 1e8, seed 0), run by
    `fedkl sweep`: every algorithm releases without ⊥, every call has >= 8 kappa users (Cor 3.7's
    regime) and the error is finite."""
    table = tmp_path / "slopes.csv"
    sets = ["--set", "users=4000", "--set", f"records={10**8}", "--set", "seed=0"]
    proc = subprocess.run(
        [sys.executable, "-m", "fedkl.cli", "sweep", "simulations/studies/paper002_slopes.toml", "--table", str(table)]
        + sets,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(open(table)))
    assert [r["method"] for r in rows] == [
        "alg2-output-pert",
        "phased-erm",
        "sc-phased-erm",
        "phased-sco",
        "sc-phased-sco",
    ]
    for r in rows:
        assert r["status"] == "ok" and r["outcome"] == "released", r
        assert r["bottoms"] == "0" and r["theorem_regime"] == "True" and math.isfinite(float(r["excess_pop"])), r
