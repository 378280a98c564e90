"""The polynomial-time deletion tests of paper 002's output perturbation (fedkl's derivation):
the maximum-matching score, the deletion-jump lemma, DiameterSCOutputPert and its use by the phased
algorithms (fedkl.algorithms.output_perturbation.matching, .diameter_output_pert, .phased_common.SCInnerRelease).

Privacy is checked EXACTLY where it can be: the released law is an atom at ⊥ plus a Gaussian, so its
hockey-stick divergence between neighbouring datasets has a closed form (no sampling error). Sampled
checks use fixed seeds and tolerances of a few binomial standard errors of their own sample.
"""

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest
import torch
from scipy import stats

# the thread fixture (autouse) and the stand-in ledger of the output-perturbation tests
from test_output_pert import _CountingLedger, _one_thread  # noqa: E402,F401

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.output_perturbation.del_output_pert import DeletionRelease, DelOutputPert
from fedkl.algorithms.output_perturbation.diameter_output_pert import (
    DiameterSCOutputPert,
    DiameterTest,
    jump_factor,
    resolve_test,
)
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert
from fedkl.algorithms.output_perturbation.matching import matching_cover, maximum_matching
from fedkl.algorithms.output_perturbation.phased_common import PhaseCall, SCInnerRelease, setting_for_problem
from fedkl.algorithms.output_perturbation.phased_erm import PhasedParams
from fedkl.algorithms.output_perturbation.phased_sco import PhasedSCO
from fedkl.algorithms.output_perturbation.vertex_cover import graph_from_edges, min_vertex_cover, worst_case_calls
from fedkl.data.synthetic import synthetic_logistic
from fedkl.federation.base import Federation
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy.mechanisms import TruncatedDiscreteLaplace
from fedkl.problems import make_problem


class _Recorder(_CountingLedger):
    """The stand-in ledger, also recording which users each release charged."""

    def charge(self, user_ids, charge, **kw):
        return super().charge(user_ids, charge, users=list(user_ids), **kw)


# --- the matching score ---------------------------------------------------------------------------
def _brute_matching(n, edges):
    """nu(G) by trying every edge subset (small graphs only)."""
    best = 0
    for k in range(1, len(edges) + 1):
        found = False
        for sub in itertools.combinations(edges, k):
            ends = [v for e in sub for v in e]
            if len(set(ends)) == len(ends):
                found = True
                break
        if not found:
            break
        best = k
    return best


def _brute_cover(n, edges):
    for k in range(n + 1):
        for S in itertools.combinations(range(n), k):
            s = set(S)
            if all(a in s or b in s for a, b in edges):
                return k
    return n


def _random_graph(rng, n, p):
    return [(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < p]


def test_matching_score_is_exact_and_the_cover_at_most_twice_it():
    rng = random.Random(0)
    for trial in range(60):
        n = rng.randint(2, 8)
        edges = _random_graph(rng, n, rng.choice([0.1, 0.3, 0.6]))
        nu, cover = matching_cover(n, edges)
        assert nu == _brute_matching(n, edges) == len(maximum_matching(n, edges))
        assert all(a in cover or b in cover for a, b in edges), "not a vertex cover"
        tau = _brute_cover(n, edges)
        assert nu <= tau <= len(cover) <= 2 * nu


def test_matching_score_moves_by_at_most_one_when_one_user_is_replaced():
    """Fact 1 of the proof: replacing one vertex's edges changes nu by <= 1 (exhaustive on small graphs
    plus random larger ones, including the extreme replacements: isolated vertex <-> hub)."""
    rng = random.Random(1)
    for trial in range(300):
        n = rng.randint(2, 12)
        edges = _random_graph(rng, n, rng.random())
        v = rng.randrange(n)
        rest = [e for e in edges if v not in e]
        choice = rng.random()
        if choice < 0.3:
            new = []  # v becomes typical (isolated)
        elif choice < 0.6:
            new = [(min(v, w), max(v, w)) for w in range(n) if w != v]  # v conflicts with everyone
        else:
            new = [(min(v, w), max(v, w)) for w in range(n) if w != v and rng.random() < 0.5]
        nu, _ = matching_cover(n, edges)
        nu2, _ = matching_cover(n, rest + new)
        assert abs(nu - nu2) <= 1


def test_matching_refuses_bad_edges():
    with pytest.raises(ValueError):
        matching_cover(3, [(0, 0)])
    with pytest.raises(ValueError):
        matching_cover(3, [(0, 3)])
    assert matching_cover(5, []) == (0, ())
    # the matching's graph holds the vertices of some edge only (issue 34: not a dict of all n users per call)
    assert graph_from_edges(100_000, [(7, 3), (3, 9)], isolated=False) == {3: {7, 9}, 7: {3}, 9: {3}}
    with pytest.raises(ValueError):
        graph_from_edges(3, [(0, 3)], isolated=False)


# --- the release parameters of the matching score ------------------------------------------------------
@pytest.mark.parametrize("calibration", ["paper", "tight"])
def test_matching_score_sensitivity_depth_and_sigma(calibration):
    for eps, delta in ((1.0, 1e-6), (2.0, 1e-3), (8.0, 0.1)):
        c = DeletionRelease(eps, delta, 0.5, calibration, score="matching")
        k = c.kappa
        assert c.depth == 8 * k and c.sensitivity == pytest.approx((8 * k + 2) * 0.5)
        # the output step is (eps_bar, delta_bar)-DP by the exact analytic-Gaussian characterisation
        assert c.gaussian.epsilon(c.delta_bar) <= c.eps_bar * (1 + 1e-9)
        if calibration == "paper":
            assert c.sigma == pytest.approx(2 * math.sqrt(math.log(2 / c.delta_bar)) * c.sensitivity / c.eps_bar)
        else:  # analytic: tight at (eps_bar, delta_bar)
            assert c.gaussian.epsilon(c.delta_bar) == pytest.approx(c.eps_bar, rel=1e-3)
    with pytest.raises(ValueError):
        DeletionRelease(1.0, 1e-6, 0.5, score="greedy")


def test_auto_picks_the_exact_cover_while_its_work_bound_fits():
    assert resolve_test("auto", 100, 5) == "vertex-cover"
    assert resolve_test("auto", 100, 30) == "matching"  # 1.38^60 calls: over the budget
    assert worst_case_calls(60) > 4_000_000 >= worst_case_calls(40)
    assert resolve_test("auto", 20, 5) == "vertex-cover"  # too few users for both: the cover's refusal
    assert resolve_test("matching", 100, 5) == "matching"
    with pytest.raises(ValueError):
        resolve_test("greedy", 100, 5)


# --- the deletion-jump lemma ----------------------------------------------------------------------------
def _ridge_logistic_users(rng, n, d, m, spread):
    users = []
    for u in range(n):
        shift = spread * rng.standard_normal(d)
        X = rng.standard_normal((m, d))
        X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
        y = np.where(rng.random(m) < 1 / (1 + np.exp(-(X @ (np.ones(d) + shift)))), 1.0, -1.0)
        users.append((X, y))
    return users


def _newton_min(users, idx, lam, c, iters=60):
    """argmin of sum_{u in idx} [mean logistic loss of u + lam/2 ||t - c||^2] to machine precision."""
    t = c.copy()
    d = len(c)
    for _ in range(iters):
        g = np.zeros(d)
        H = np.zeros((d, d))
        for u in idx:
            X, y = users[u]
            z = X @ t
            s = 1 / (1 + np.exp(y * z))
            g += (-(y * s) @ X) / len(y) + lam * (t - c)
            w = s * (1 - s)
            H += (X.T * w) @ X / len(y) + lam * np.eye(d)
        t = t - np.linalg.solve(H, g)
    return t


def test_deletion_jump_never_exceeds_the_diameter_lemma():
    """||theta*(z) - theta*(z - i)|| <= j(L/mu, |z|) diam{v_u : u in z} on every subset z and user i
    (brute force over all subsets of random heterogeneous ridge-logistic users, several lam); j is the
    smaller of the function-value bound and the earlier (L/mu)^2 / |z|, and strictly smaller once L/mu > 1.5."""
    rng = np.random.default_rng(3)
    worst = 0.0
    for lam, spread in ((0.05, 2.0), (0.3, 1.0), (2.0, 3.0), (0.02, 0.5)):
        n, d, m = 6, 3, 8
        users = _ridge_logistic_users(rng, n, d, m, spread)
        c = 0.3 * rng.standard_normal(d)
        L, mu = 0.25 + lam, lam  # ||x|| <= 1: logistic smoothness 1/4; strong convexity lam
        v = [_newton_min(users, [u], lam, c) for u in range(n)]
        theta = {
            S: _newton_min(users, list(S), lam, c) for k in range(1, n + 1) for S in itertools.combinations(range(n), k)
        }
        for S, t in theta.items():
            if len(S) < 2:
                continue
            diam = max(np.linalg.norm(v[a] - v[b]) for a in S for b in S)
            bound = jump_factor(L / mu, len(S)) * diam
            old = (L / mu) ** 2 * diam / len(S)
            assert bound <= old * (1 + 1e-12)
            if L / mu > 2:
                assert bound < 0.9 * old
            for i in S:
                jump = np.linalg.norm(t - theta[tuple(u for u in S if u != i)])
                assert jump <= bound * (1 + 1e-9) + 1e-12
                worst = max(worst, jump / bound)
    assert worst > 0.5  # nearly tight on some instance


def test_no_local_minimizer_test_beats_the_condition_number():
    """The factor L/mu of the lemma cannot go: k - 1 one-dimensional quadratics of curvature mu at 0 and one of
    curvature L at D (all mu-strongly convex, L-smooth, local minimizers within D) have the deletion jump
    c D / (k - 1 + c), c = L/mu; the lemma's j(c, k) D is within a factor 1 + sqrt((c - 1)/2) (+ O(1/k)) of it.
    So a test that sees only the local minimizers cannot certify a Delta below ~c D / k on such data, while
    the jump of IID users is ~D/k (what sc-output-pert's chosen Delta / jump measures)."""
    for c in (1.0, 2.0, 3.5, 11.0):
        for k in (2, 5, 100, 1000):
            mu, L, D = 0.1, 0.1 * c, 1.0
            theta_z = L * D / ((k - 1) * mu + L)  # argmin of (k-1) mu t^2/2 + L (t - D)^2/2
            jump = theta_z - 0.0  # without the outlying user the minimizer is 0
            assert jump == pytest.approx(c * D / (k - 1 + c))
            assert jump <= jump_factor(c, k) * D * (1 + 1e-12)
            assert jump_factor(c, k) * D <= (1 + math.sqrt((c - 1) * k / (2 * (k - 1)))) * jump * (k - 1 + c) / k * (
                1 + 1e-12
            )
    assert jump_factor(3.5, 984) < 0.62 * 3.5**2 / 984  # the gain at fertility-partition's L/mu and n - depth
    with pytest.raises(ValueError):
        jump_factor(0.5, 10)
    with pytest.raises(ValueError):
        jump_factor(2.0, 1)


# --- the mechanism on a small federation -----------------------------------------------------------------
EPS, DELTA = 8.0, 0.3  # kappa = 3: the matching test needs n > 24 users
N, DIM, M = 30, 2, 40
LAM = 0.5


def _federation(outliers=(), flip=True, seed=0, n=N):
    """n users drawn IID (synthetic logistic); the users in ``outliers`` get every label flipped and every
    feature pushed to the unit sphere (one user's records replaced: a replace-one neighbour)."""
    ds = synthetic_logistic(n, M, DIM, seed=seed)
    tr = ds.train
    X, y = tr.X.clone(), tr.y.clone()
    for u in outliers:
        rec = tr.user_index == u
        X[rec] = torch.tensor([1.0] + [0.0] * (DIM - 1), dtype=X.dtype)
        y[rec] = -1.0 if flip else 1.0
    ds = dataclasses.replace(ds, train=dataclasses.replace(tr, X=X, y=y))
    prob = make_problem("logistic", ds)
    return InProcessFederation(prob, ds), prob, ds


def _mechanism(prob, ds, Delta, test="matching", calibration="tight", eps=EPS, delta=DELTA):
    solver = SCOutputPert.for_problem(
        prob,
        ds.feature_bound,
        torch.zeros(prob.num_params, dtype=torch.float64),
        eps=eps,
        delta=delta,
        Delta=Delta,
        extra_reg=LAM,
        calibration=calibration,
    )
    return DiameterSCOutputPert(solver, DiameterTest(test=test))


def _hockey_stick(p_bot, a, mu1, q_bot, b, mu2, sigma, eps):
    """sup_E P(E) - e^eps Q(E) for P = p_bot ⊥ + a N(mu1, s^2 I), Q = q_bot ⊥ + b N(mu2, s^2 I)."""
    out = max(0.0, p_bot - math.exp(eps) * q_bot)
    if a <= 0:
        return out
    if b <= 0:
        return out + a
    D = float(np.linalg.norm(mu1 - mu2))
    e2 = eps + math.log(b / a)
    if D == 0:
        return out + max(0.0, a - math.exp(eps) * b)
    return (
        out
        + a * stats.norm.cdf(D / (2 * sigma) - e2 * sigma / D)
        - math.exp(eps) * b * stats.norm.cdf(-D / (2 * sigma) - e2 * sigma / D)
    )


@pytest.mark.parametrize("calibration", ["tight", "profile"])
@pytest.mark.parametrize("test", ["matching", "vertex-cover"])
def test_exact_privacy_audit_on_neighbouring_federations(test, calibration):
    """Neighbours differ in ONE user's records (typical <-> outlier, with 0-3 other outliers present).
    The released law is ⊥ w.p. Pr[R1 < score] and else N(f~(x_{-S}), sigma^2 I): its exact hockey-stick
    divergence must be <= delta in both directions, and the proof's two facts must hold."""
    instances = ((0, 0.5), (0, 0.2), (1, 0.1), (3, 0.1), (0, 0.05), (3, 0.05))
    seen_bottom, seen_deletion, _ = audit_neighbours(test, calibration, instances)
    # the instances exercise every branch: deletions, and ⊥ as the likely outcome on one side
    assert seen_deletion and seen_bottom


def audit_neighbours(test, calibration, instances, eps=EPS, delta=DELTA, n=N, claim=None):
    """The exact audit of one release at (eps, delta) over n users: for each (others, Delta) of
    ``instances``, x has ``others`` outliers and its neighbour y one more (user 0); asserts the hockey-stick
    divergence <= delta both ways and the proof's two facts; returns (seen ⊥ likely, seen a deletion, the
    largest divergence). ``claim`` = (eps', delta'): measure the divergence at eps' instead and assert
    nothing about it (negative controls: a release calibrated for a larger budget than claimed)."""
    seen_bottom, seen_deletion, worst = False, False, 0.0
    for others, Delta in instances:
        base = tuple(range(1, others + 1))
        fx, prob, ds = _federation(base, n=n)
        fy, _, ds2 = _federation(base + (0,), n=n)
        mech = _mechanism(prob, ds, Delta, test, calibration, eps, delta)
        dop = mech.dop(n)
        plan_x, _ = mech.plan(fx, torch.zeros(prob.num_params, dtype=torch.float64))
        plan_y, _ = mech.plan(fy, torch.zeros(prob.num_params, dtype=torch.float64))
        law = TruncatedDiscreteLaplace(dop.eps_bar, dop.delta_bar)
        pmf = law.pmf()

        def release_law(plan):
            if plan.dist is None:
                return 1.0, 0.0, None
            p_pass = float(sum(pmf[r] for r in range(plan.dist, len(pmf))))
            return 1.0 - p_pass, p_pass, plan.value.numpy()

        bx, ax, mx = release_law(plan_x)
        by, ay, my = release_law(plan_y)
        seen_bottom |= bx > 0.5 or by > 0.5
        seen_deletion |= bool(plan_x.deleted) or bool(plan_y.deleted)
        if plan_x.dist is not None and plan_y.dist is not None:
            assert abs(plan_x.dist - plan_y.dist) <= 1
            assert np.linalg.norm(mx - my) <= dop.sensitivity
        for P, Q in (((bx, ax, mx), (by, ay, my)), ((by, ay, my), (bx, ax, mx))):
            d = _hockey_stick(P[0], P[1], P[2], Q[0], Q[1], Q[2], dop.sigma, eps if claim is None else claim[0])
            assert claim is not None or d <= delta * (1 + 1e-9), (others, Delta, d)
            worst = max(worst, d)
    return seen_bottom, seen_deletion, worst


def test_plan_keeps_a_conflict_free_set_and_reports_the_score():
    fed, prob, ds = _federation(outliers=(0, 1, 2))
    mech = _mechanism(prob, ds, 0.1, "matching")
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    plan, diag = mech.plan(fed, center)
    V, err = mech.local_vectors(fed, center)
    edges = mech.conflict_edges(V, err, diag["rho"])
    nu, _ = matching_cover(N, edges)
    assert plan.dist == nu == diag["matching"] and diag["conflict_edges"] == len(edges) > 0
    kept = [u for u in range(N) if u not in plan.deleted]
    assert len(plan.deleted) <= 2 * nu
    for a, b in itertools.combinations(kept, 2):  # no conflict left: distance + certified errors <= rho
        assert float((V[a] - V[b]).norm() + err[a] + err[b]) <= diag["rho"]
    # the released value is f~ on the kept users: the minimizer of their objective to within tau
    mask = torch.zeros(1, N, dtype=torch.bool)
    mask[0, kept] = True
    assert torch.equal(plan.value, mech.solver.solve(fed, mask, center)[0])
    # rho is the public formula
    sol = mech.solver
    assert diag["rho"] == pytest.approx((sol.Delta - 2 * sol.tau) * (N - 8 * mech.kappa) / (sol.beta / sol.mu) ** 2)
    # exact cover variant: the minimum cover, and at most the matching's
    vc = _mechanism(prob, ds, 0.1, "vertex-cover")
    plan_vc, diag_vc = vc.plan(fed, center)
    rho_vc = diag_vc["rho"]
    edges_vc = vc.conflict_edges(V, err, rho_vc)
    exact = min_vertex_cover(graph_from_edges(N, edges_vc), 2 * vc.kappa)
    assert exact is not None and plan_vc.dist == exact[0] and plan_vc.deleted == exact[1]


def test_bottom_frequency_through_the_releaser_matches_the_score():
    fed, prob, ds = _federation(outliers=(0, 1))
    mech = _mechanism(prob, ds, 0.2, "matching")
    plan, _ = mech.plan(fed, torch.zeros(prob.num_params, dtype=torch.float64))
    assert plan.dist is not None and 1 <= plan.dist < 2 * mech.kappa  # both ⊥ and values are likely
    dop = DelOutputPert(mech.dop(N))
    law = TruncatedDiscreteLaplace(dop.config.eps_bar, dop.config.delta_bar)
    p_bot = float(sum(law.pmf()[: plan.dist]))
    draws = 4000
    rec = _Recorder()
    releaser = Releaser(rec, NoiseSource(11))
    outs = [dop.release(plan, releaser, fed.user_ids, "t") for _ in range(draws)]
    bottoms = sum(o is None for o in outs)
    se = math.sqrt(p_bot * (1 - p_bot) / draws)
    assert abs(bottoms / draws - p_bot) <= 4 * se + 1e-9
    assert len(rec.charges) == draws  # every release (⊥ included) charged, with its sensitivity and sigma
    assert all(c["sensitivity"] == dop.config.sensitivity and c["noise_scale"] == dop.config.sigma for c in rec.charges)
    # the noise of the released values has std sigma: the variance of N draws is within 5 standard errors
    # (relative SE of a Gaussian sample variance: sqrt(2/N)); a sigma off by 10% fails at N >= 2000
    noise = torch.stack([o - plan.value for o in outs if o is not None]).flatten()
    ratio = float(noise.var()) / dop.config.sigma**2
    assert noise.numel() >= 2000 and abs(ratio - 1) <= 5 * math.sqrt(2 / noise.numel())


def test_run_charges_every_user_once_and_reports():
    fed, prob, ds = _federation(outliers=(0,))
    mech = _mechanism(prob, ds, 0.05, "auto")
    rec = _Recorder()
    res = mech.run(fed, Releaser(rec, NoiseSource(5)), torch.zeros(prob.num_params, dtype=torch.float64))
    assert len(rec.charges) == 1 and sorted(rec.charges[0]["users"]) == sorted(fed.user_ids)
    assert rec.charges[0]["eps"] == EPS and rec.charges[0]["delta"] == DELTA
    assert res.diagnostics["test"] == "vertex-cover" and res.sigma == mech.sigma(N)
    assert res.sensitivity == pytest.approx((4 * mech.kappa + 1) * 0.05)


def test_refusals_come_from_public_values_before_any_data_is_read(tmp_path):
    class Spy(InProcessFederation):
        calls = 0

        def compute(self, query, users=None):
            Spy.calls += 1
            return super().compute(query, users)

    ds = synthetic_logistic(20, M, DIM, seed=0)
    prob = make_problem("logistic", ds)
    fed = Spy(prob, ds)
    mech = _mechanism(prob, ds, 0.05, "matching")  # 20 users <= 8 kappa = 24
    ledger = PrivacyLedger(str(tmp_path / "l.sqlite"), Budget(EPS, DELTA * 1.01))
    with pytest.raises(ValueError, match="needs n >= 8 kappa \\+ 2"):
        mech.run(fed, Releaser(ledger, NoiseSource(0)), torch.zeros(prob.num_params, dtype=torch.float64))
    assert Spy.calls == 0 and ledger.spend(fed.user_ids[0]).eps == 0
    # Phased-SCO: the LAST (smallest) cohort is too small for the matching test: refused before phase 1
    ds = synthetic_logistic(100, M, DIM, seed=1)
    fed = Spy(prob, ds)
    setting = setting_for_problem(prob, ds.feature_bound, radius=3.0)
    alg = PhasedSCO(
        PhasedParams(
            p002_phases=3, p002_min_cohort=2, p002_test="matching", p002_delta_rule="scaled", p002_calibration="paper"
        ),
        BuildContext.fresh(eps=EPS, delta=DELTA, problem=prob, feature_bound=ds.feature_bound),
        setting=setting,
    )
    with pytest.raises(ValueError, match="diameter test needs at least"):
        alg.run(fed, Releaser(ledger, NoiseSource(0)), torch.zeros(prob.num_params, dtype=torch.float64))
    assert Spy.calls == 0 and all(ledger.spend(u).eps == 0 for u in fed.user_ids)


def test_inner_release_chooses_exact_up_to_20_users_and_the_diameter_test_above():
    ds = synthetic_logistic(40, M, DIM, seed=2)
    prob = make_problem("logistic", ds)
    inner = SCInnerRelease(prob, ds.feature_bound, calibration="tight")
    assert inner.kind(20, EPS, DELTA) == "exact" and inner.kind(40, EPS, DELTA) == "vertex-cover"
    assert inner.kind(40, 0.5, 1e-6) == "matching"
    assert inner.noise_ratio(40, EPS, DELTA) == DeletionRelease(EPS, DELTA, 1.0, "tight").sigma
    assert inner.noise_ratio(40, 0.5, 1e-6) == DeletionRelease(0.5, 1e-6, 1.0, "tight", score="matching").sigma
    with pytest.raises(ValueError, match="max_exact_users"):
        SCInnerRelease(prob, ds.feature_bound, test="exact").check(40, EPS, DELTA)
    fed = InProcessFederation(prob, ds)
    rec = _Recorder()
    out = inner(
        fed,
        Releaser(rec, NoiseSource(4)),
        PhaseCall("t/phase-1", 1, EPS, DELTA, 0.05, LAM, torch.zeros(prob.num_params, dtype=torch.float64)),
    )
    assert out.diagnostics["decided_by"] == "diameter-vertex-cover" and len(rec.charges) == 1


def test_iid_users_pass_the_diameter_test_at_delta_uc():
    """In the paper's regime (exchangeable users, Delta_uc of Cor 3.7) the conflict graph is empty: the
    release is theta~ + N(0, sigma^2 I) with no deletion, as in Thm 3.1 (the test costs no utility)."""
    from fedkl.algorithms.output_perturbation.exact_output_pert import delta_union_bound

    n, m, d, lam, eps, delta = 200, 200, 3, 1.0, 8.0, 0.01
    ds = synthetic_logistic(n, m, d, seed=0)
    prob = make_problem("logistic", ds)
    fed = InProcessFederation(prob, ds)
    center = torch.zeros(d, dtype=torch.float64)
    probe = SCOutputPert.for_problem(
        prob, 1.0, center, eps=eps, delta=delta, Delta=1.0, extra_reg=lam, calibration="paper"
    )
    m_min = int(ds.train.counts().min())
    Delta = delta_union_bound(2.0, lam, n, m_min, probe.dop.kappa, 1 / (n * m))
    for test in ("vertex-cover", "matching"):
        solver = SCOutputPert.for_problem(
            prob, 1.0, center, eps=eps, delta=delta, Delta=Delta, extra_reg=lam, calibration="paper"
        )
        plan, diag = DiameterSCOutputPert(solver, DiameterTest(test=test)).plan(fed, center)
        assert diag["conflict_edges"] == 0 and plan.dist == 0 and plan.deleted == ()


# --- the matching score for the mean of user vectors (mean-output-pert) -------------------------------------
@pytest.mark.parametrize("calibration", ["profile", "tight"])
def test_mean_output_pert_matching_score_exact_audit(calibration):
    """MeanOutputPert with the matching score on random 2-D user vectors with outliers: for random and
    adversarial replace-one neighbours, the score moves by <= 1, the two released means are within the
    sensitivity (8 kappa + 2) Delta, and the exact hockey-stick divergence is <= delta both ways."""
    from fedkl.algorithms.output_perturbation.mean_output_pert import MeanOutputPert, mean_stability_plan

    rng = np.random.default_rng(7)
    n = 40
    cfg = MeanOutputPert(EPS, DELTA, rho=0.5, calibration=calibration, test="matching")
    dop = cfg.dop(n)
    assert cfg.score(n) == "matching" and dop.score == "matching"
    assert cfg.Delta(n) == pytest.approx(0.5 / (n - 8 * cfg.kappa - 1))
    pmf = TruncatedDiscreteLaplace(dop.eps_bar, dop.delta_bar).pmf()

    def law(V):
        plan, _ = mean_stability_plan(torch.tensor(V), cfg)
        if plan.dist is None:
            return plan, 1.0, 0.0
        p = float(pmf[plan.dist :].sum())
        return plan, 1.0 - p, p

    deletions = 0
    for trial in range(150):
        V = rng.uniform(-0.2, 0.2, size=(n, 2))
        k = rng.integers(0, 8)
        V[:k] = rng.uniform(-3, 3, size=(k, 2))  # outliers
        W = V.copy()
        i = rng.integers(0, n)
        W[i] = rng.choice([rng.uniform(-0.2, 0.2, 2), rng.uniform(-3, 3, 2), np.array([0.45, 0.0])])
        (px, bx, ax), (py, by, ay) = law(V), law(W)
        deletions += bool(px.deleted)
        if px.dist is not None and py.dist is not None:
            assert abs(px.dist - py.dist) <= 1
            assert float((px.value - py.value).norm()) <= dop.sensitivity * (1 + 1e-12)
        for P, Q in (((bx, ax, px), (by, ay, py)), ((by, ay, py), (bx, ax, px))):
            dv = _hockey_stick(
                P[0],
                P[1],
                None if P[2].value is None else P[2].value.numpy(),
                Q[0],
                Q[1],
                None if Q[2].value is None else Q[2].value.numpy(),
                dop.sigma,
                EPS,
            )
            assert dv <= DELTA * (1 + 1e-9)
    assert deletions > 10


def test_mean_output_pert_auto_switches_to_matching_instead_of_refusing():
    from fedkl.algorithms.output_perturbation.mean_output_pert import MeanOutputPert

    big = MeanOutputPert(0.5, 1e-6, rho=1.0)  # kappa 32: the cover's bound exceeds 4e6 calls
    assert big.score(600) == "matching" and big.dop(600).score == "matching"
    assert big.Delta(600) == pytest.approx(1.0 / (600 - 8 * big.kappa - 1))
    with pytest.raises(ValueError, match="8 kappa"):
        big.check(8 * big.kappa + 1)
    with pytest.raises(ValueError, match="work budget"):
        MeanOutputPert(0.5, 1e-6, rho=1.0, test="vertex-cover").check(600)
    small = MeanOutputPert(EPS, DELTA, rho=1.0)
    assert small.score(100) == "vertex-cover" and small.Delta(100) == pytest.approx(1.0 / (100 - 4 * small.kappa - 1))


def test_the_matching_score_is_capped_at_its_own_releases_kappa():
    """Issue 28 §2: the matching score is capped at 2 kappa of the release's OWN deletion budget (the matching
    profile's: 3 at eps = 16, delta = 1e-6), not the exact score's (4 there). A score of 7 = 2 kappa + 1 is
    then "always ⊥" without solving anything (it used to be a dist of 7 that no R1 <= 6 releases)."""
    eps, delta, n, d = 16.0, 1e-6, 40, 8
    ds = synthetic_logistic(n, 4, d - 1, seed=0)
    prob = make_problem("logistic", ds)
    solver = SCOutputPert.for_problem(
        prob, ds.feature_bound, torch.zeros(d, dtype=torch.float64), eps=eps, delta=delta, Delta=1.0,
        extra_reg=LAM, calibration="profile",
    )  # fmt: skip
    mech = DiameterSCOutputPert(solver, DiameterTest(test="matching"))
    assert mech.dop(n).score == "matching" and (mech.release_kappa(n), mech.kappa) == (3, 4)
    assert mech.dop(n).deletion_budget.pmf().shape[0] == 2 * 3 + 1  # R1 in {0, ..., 6}
    # 7 disjoint conflicting pairs (a_i, b_i) = (+-0.6 rho e_i) around a cluster at 0: nu = 7, every other
    # distance <= 0.85 rho
    rho = mech.rho(n)
    V = torch.zeros(n, d, dtype=torch.float64)
    for i in range(7):
        V[2 * i, i], V[2 * i + 1, i] = 0.6 * rho, -0.6 * rho
    err = torch.zeros(n, dtype=torch.float64)
    assert mech.deletion_score(n, V, err) == 7

    class NoAnswers(Federation):  # the plan must not need any answer once the score is over the cap
        user_ids = property(lambda self: tuple(f"u{i}" for i in range(n)))
        num_params = property(lambda self: d)

        def compute(self, query, users=None):
            raise AssertionError("no query expected")

    plan, diag = mech.plan(NoAnswers(), torch.zeros(d, dtype=torch.float64), (V, err, 0))
    assert diag["matching"] == 7 and plan.dist is None and plan.choose(2 * mech.release_kappa(n)) is None


def test_log_subset_count_is_the_exact_binomial_sum():
    """Delta_uc's ln(n sum_{s<=r} C(n, s)) from the term recurrence (issue 34) is the math.comb sum's
    logarithm exactly (the same integer), r beyond n included; a negative r is refused."""
    from fedkl.algorithms.output_perturbation.exact_output_pert import _log_subset_count

    for n, r in [(1, 0), (1, 3), (5, 5), (5, 9), (10, 4), (100, 0), (1000, 37), (100_000, 400), (250, 249)]:
        assert _log_subset_count(n, r) == math.log(n) + math.log(sum(math.comb(n, s) for s in range(r + 1)))
    with pytest.raises(ValueError):
        _log_subset_count(10, -1)
