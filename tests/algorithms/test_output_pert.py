"""Paper 002's user-level output perturbation: DelOutputPert (Alg 1) and SCOutputPert (Alg 2 + App. C).

Fixed seeds everywhere; every sampled check has a tolerance of a few standard errors of its sample.
"""

import functools
import itertools
import math

import numpy as np
import pytest
import torch
from release_spies import charge_record
from scipy import stats

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.output_perturbation.del_output_pert import (
    DeletionRelease,
    DelOutputPert,
    exact_stability,
    masks_tensor,
    mean_of_user_vectors,
)
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert, lemma_c1_bound
from fedkl.algorithms.output_perturbation.phased_common import setting_for_problem
from fedkl.algorithms.output_perturbation.phased_erm import PhasedERM, PhasedParams
from fedkl.data import load_dataset
from fedkl.federation.base import GradientsAtPoints
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, BudgetExhausted, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.problems import make_problem


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The enumerations run many tiny tensor ops: intra-op threads only spin on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _CountingLedger:
    """Stands in for the ledger in the sampling tests (thousands of releases of one dataset would
    exhaust any real budget); records the charges so tests can check them."""

    def __init__(self):
        self.charges = []

    def charge(self, user_ids, charge, **kw):
        self.charges.append(charge_record(charge, **kw))
        return len(self.charges)


def _ids(n):
    return [f"u{i}" for i in range(n)]


def _outlier_values(n, outliers, seed=0):
    """1-D user values: typical users uniform in [-0.1, 0.1], ``outliers`` of them at 10."""
    rng = np.random.default_rng(seed)
    v = rng.uniform(-0.1, 0.1, size=(n, 1))
    v[:outliers] = 10.0
    return torch.tensor(v)


# --- constants --------------------------------------------------------------------------------
def test_constants_follow_algorithm_1_and_the_note_table():
    cfg = DeletionRelease(eps=1.0, delta=1e-6, Delta=1.0)
    assert cfg.eps_bar == 0.5 and cfg.delta_bar == pytest.approx(1e-6 / (math.exp(0.5) + 2))
    assert cfg.kappa == 1 + math.ceil(math.log(1 / cfg.delta_bar) / 0.5) == 32  # note §4 table
    assert cfg.sensitivity == 8 * 32
    assert cfg.sigma == pytest.approx(2 * math.sqrt(math.log(2 / cfg.delta_bar)) * 8 * 32 / 0.5)
    assert cfg.sigma == pytest.approx(4071, rel=1e-3)
    tight = DeletionRelease(eps=1.0, delta=1e-6, Delta=1.0, calibration="tight")
    assert tight.sensitivity == 4 * 32 + 1 and tight.sigma == pytest.approx(1109, rel=2e-3)
    # the paper's sigma gives the output step (eps_bar, delta_bar) by the exact analytic Gaussian
    for eps in (0.5, 1, 4, 8):
        c = DeletionRelease(eps=eps, delta=1e-5, Delta=0.1)
        assert c.gaussian.epsilon(c.delta_bar) <= c.eps_bar and c.kappa >= 3


# --- the exact test against a brute-force definition ------------------------------------------
def test_exact_stability_matches_brute_force_definition():
    rng = np.random.default_rng(1)
    n = 7
    for trial in range(12):
        v = torch.tensor(rng.normal(0, 0.1, (n, 2)))
        v[rng.integers(0, n, 2)] += 3.0
        f = mean_of_user_vectors(v)
        cfg = DeletionRelease(8, 0.1, float(rng.choice([0.05, 0.2, 0.5, 1.0, 2.0])))

        def F(y):
            m = torch.zeros(1, n, dtype=torch.bool)
            m[0, list(y)] = True
            return f(m)[0]

        @functools.lru_cache(None)
        def dbar(y, b):  # Dbar_b f(y), Def 3.2, by recursion over deletions
            c = max([float((F(y) - F(tuple(u for u in y if u != i))).norm()) for i in y], default=0.0)
            return c if b == 0 else max([c] + [dbar(tuple(u for u in y if u != i), b - 1) for i in y])

        plan = exact_stability(f, n, cfg)
        expected = None
        for s in range(2 * cfg.kappa + 1):
            sets = [
                S
                for S in itertools.combinations(range(n), s)
                if dbar(tuple(u for u in range(n) if u not in S), cfg.depth - s) <= cfg.Delta
            ]
            if sets:
                expected = (s, min(sets))
                break
        assert (plan.dist, plan.deleted) == (expected or (None, None))
        if expected:
            assert torch.equal(plan.value, F(tuple(u for u in range(n) if u not in expected[1])))


def test_exact_test_refuses_large_n_before_reading_data():
    called = []

    def f(masks):
        called.append(1)
        return torch.zeros(masks.shape[0], 1)

    with pytest.raises(ValueError, match="max_exact_users"):
        exact_stability(f, 21, DeletionRelease(8, 0.1, 0.3))
    assert not called


# --- privacy of the test: ⊥ frequencies on neighbours -----------------------------------------
def test_bottom_frequencies_on_neighbours_respect_eps_delta():
    cfg = DeletionRelease(eps=4.0, delta=0.2, Delta=0.3)  # kappa = 3, visible TDLap tails
    n, N = 16, 20000
    pmf = cfg.deletion_budget.pmf()
    datasets = {k: _outlier_values(n, k) for k in (2, 3, 4)}
    plans = {k: exact_stability(mean_of_user_vectors(v), n, cfg) for k, v in datasets.items()}
    assert {k: p.dist for k, p in plans.items()} == {2: 2, 3: 3, 4: 4}  # delete the outliers
    assert plans[3].deleted == (0, 1, 2)
    exact = {k: float(pmf[:k].sum()) for k in plans}  # Pr[⊥] = Pr[R1 < dist]
    observed = {}
    for k, plan in plans.items():
        rel = Releaser(_CountingLedger(), NoiseSource(100 + k))
        mech = DelOutputPert(cfg)
        bottoms = sum(mech.release(plan, rel, _ids(n), "t") is None for _ in range(N))
        observed[k] = bottoms / N
        se = math.sqrt(exact[k] * (1 - exact[k]) / N)
        assert abs(observed[k] - exact[k]) <= 5 * se + 1e-12
    # (2, 3) and (3, 4) are neighbours: one user replaced (an outlier <-> a typical user)
    for a, b in ((2, 3), (3, 2), (3, 4), (4, 3)):
        assert exact[a] <= math.exp(cfg.eps_bar) * exact[b] + cfg.delta_bar + 1e-15  # eq. (2)
        se = math.sqrt(observed[a] * (1 - observed[a]) / N) + math.exp(cfg.eps) * math.sqrt(
            observed[b] * (1 - observed[b]) / N
        )
        assert observed[a] <= math.exp(cfg.eps) * observed[b] + cfg.delta + 5 * se
    # the released values are centred on the mean of the kept (typical) users
    assert torch.allclose(plans[3].value, datasets[3][3:].mean(0))


def _hockey_stick(plan_a, plan_b, cfg, eps):
    """Exact delta(eps) = sup_S Pr[M(a) in S] - e^eps Pr[M(b) in S]. The output law of a plan is an
    atom at ⊥ of mass Pr[R1 < dist] plus that mass's complement times N(value, sigma^2 I)."""
    pmf = cfg.deletion_budget.pmf()

    def law(plan):
        if plan.dist is None:
            return 1.0, 0.0, None
        pb = float(pmf[: plan.dist].sum())
        return pb, 1.0 - pb, plan.value

    ba, va, ma = law(plan_a)
    bb, vb, mb = law(plan_b)
    out = max(0.0, ba - math.exp(eps) * bb)
    if va > 0 and vb == 0:
        return out + va
    if va > 0:
        L = float((ma - mb).norm()) / cfg.sigma
        if L == 0:
            return out + max(0.0, va - math.exp(eps) * vb)
        t = L / 2 - (eps + math.log(vb / va)) / L
        out += va * stats.norm.cdf(t) - math.exp(eps) * vb * stats.norm.cdf(t - L)
    return out


@pytest.mark.parametrize("calibration", ["paper", "tight", "profile"])
def test_exact_privacy_profile_on_neighbouring_datasets(calibration):
    """Audit (note §7 T2): the exact hockey-stick divergence of the whole output law (⊥ atom +
    Gaussian) is <= delta at eps, both directions, for neighbours that change the deletion count,
    that swap a typical user, and at the edge where nothing is stable any more."""
    cfg = DeletionRelease(eps=4.0, delta=0.2, Delta=0.3, calibration=calibration)
    n = 16
    base = _outlier_values(n, 0, seed=5)
    datasets = {}
    for k in range(0, 8):  # k outliers (users 0..k-1); k = 7 > 2 kappa: never stable
        v = base.clone()
        v[:k] = 10.0
        datasets[f"out{k}"] = v
        w = v.clone()
        w[n - 1] = -0.1 if float(v[n - 1]) > 0 else 0.1  # replace a typical user by another one
        datasets[f"swap{k}"] = w
    plans = {name: exact_stability(mean_of_user_vectors(v), n, cfg) for name, v in datasets.items()}
    pairs = [(f"out{k}", f"out{k + 1}") for k in range(7)] + [(f"out{k}", f"swap{k}") for k in range(8)]
    worst = 0.0
    for a, b in pairs:
        assert int(((datasets[a] != datasets[b]).any(dim=1)).sum()) == 1  # neighbours: one user differs
        for x, y in ((a, b), (b, a)):
            worst = max(worst, _hockey_stick(plans[x], plans[y], cfg, cfg.eps))
    assert worst <= cfg.delta
    # negative control: "⊥ unless x itself is stable" (certificate-or-⊥) has delta(eps) = 1
    bad = {k: (1.0 if plans[f"out{k}"].dist else 0.0) for k in (0, 1)}
    assert bad[1] - math.exp(cfg.eps) * bad[0] == 1.0 > cfg.delta


def test_nothing_stable_gives_bottom_every_time_and_is_charged():
    cfg = DeletionRelease(eps=8.0, delta=0.1, Delta=0.3)  # kappa = 3: at most 6 deletions
    n = 14
    plan = exact_stability(mean_of_user_vectors(_outlier_values(n, 7)), n, cfg)
    assert plan.dist is None
    ledger = _CountingLedger()
    rel = Releaser(ledger, NoiseSource(0))
    assert all(DelOutputPert(cfg).release(plan, rel, _ids(n), "t") is None for _ in range(50))
    assert len(ledger.charges) == 50 and all(c["eps"] == 8.0 and c["delta"] == 0.1 for c in ledger.charges)


# --- the noise --------------------------------------------------------------------------------
@pytest.mark.parametrize("calibration", ["paper", "tight", "profile"])
@pytest.mark.statistical
def test_noise_std_matches_sigma(calibration):
    cfg = DeletionRelease(eps=8.0, delta=0.1, Delta=0.05, calibration=calibration)
    n, d, draws = 14, 40, 300
    v = torch.tensor(np.random.default_rng(2).uniform(-0.01, 0.01, (n, d)))
    plan = exact_stability(mean_of_user_vectors(v), n, cfg)
    assert plan.dist == 0 and torch.allclose(plan.value, v.mean(0))
    rel = Releaser(_CountingLedger(), NoiseSource(7))
    noise = torch.stack([DelOutputPert(cfg).release(plan, rel, _ids(n), "t") - plan.value for _ in range(draws)])
    N = noise.numel()  # 12,000 draws: std of the sample std ~ sigma / sqrt(2N) = 0.65%
    assert abs(float(noise.std()) / cfg.sigma - 1) < 5 / math.sqrt(2 * N)
    assert abs(float(noise.mean())) < 5 * cfg.sigma / math.sqrt(N)


# --- the ledger -------------------------------------------------------------------------------
def test_ledger_charged_before_release_and_exhausted_budget_refused(tmp_path):
    n = 14
    events = []

    class SpyNoise(NoiseSource):
        def categorical(self, lw):
            events.append("R1")
            return super().categorical(lw)

        def gaussian(self, shape, std):
            events.append("noise")
            return super().gaussian(shape, std)

    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(epsilon=1.0, delta=1e-3))
    charge = ledger.charge

    def spy_charge(*a, **k):
        events.append("charge")
        return charge(*a, **k)

    ledger.charge = spy_charge
    cfg = DeletionRelease(eps=0.6, delta=6e-4, Delta=1.0)
    f = mean_of_user_vectors(torch.tensor(np.random.default_rng(3).uniform(-0.01, 0.01, (n, 3))))
    # a zCDP filter cannot account an (eps, delta) release: refused, nothing charged
    with pytest.raises(ValueError, match="zCDP filter"):
        DelOutputPert(cfg).run(f, Releaser(ledger, SpyNoise(0), ZCDPFilter(1.0)), _ids(n))
    assert ledger.num_releases() == 0 and events == []
    res = DelOutputPert(cfg).run(f, Releaser(ledger, SpyNoise(0)), _ids(n))
    assert res.theta is not None and events == ["charge", "R1", "noise"]
    (rel,) = ledger.releases()
    assert (rel["eps"], rel["delta"], rel["rho"], rel["users"]) == (0.6, 6e-4, 0.0, n)
    assert rel["mechanism"] == "stability-gaussian" and rel["noise_scale"] == pytest.approx(cfg.sigma)
    ledger.verify()
    with pytest.raises(BudgetExhausted):  # 1.2 > 1.0
        DelOutputPert(cfg).run(f, Releaser(ledger, SpyNoise(0)), _ids(n))
    assert ledger.num_releases() == 1 and events == ["charge", "R1", "noise", "charge"]


# --- SCOutputPert -----------------------------------------------------------------------------
def _logistic(n, seed=1, m=25, d=2, reg=0.2, heterogeneity=0.0):
    ds = load_dataset("synthetic-logistic", n_users=n, m=m, d=d, seed=seed, heterogeneity=heterogeneity)
    prob = make_problem("logistic", ds, reg=reg)
    return ds, prob, InProcessFederation(prob, ds)


def _sc_release(prob, ds, **kw):
    kw.setdefault("eps", 8.0)
    kw.setdefault("delta", 0.1)
    kw.setdefault("calibration", "paper")
    return SCOutputPert.for_problem(prob, ds.feature_bound, torch.zeros(prob.num_params), **kw)


def test_solver_meets_its_certified_tolerance_on_every_user_set():
    ds = load_dataset("synthetic-least-squares", n_users=9, m=12, d=3, seed=4, heterogeneity=1.0)
    prob = make_problem("least-squares", ds, reg=0.3)
    fed = InProcessFederation(prob, ds)
    alg = _sc_release(prob, ds, Delta=0.05)
    codes = np.arange(1, 1 << 9)
    masks = masks_tensor(codes, 9)
    got = alg.solve(fed, masks, torch.zeros(3, dtype=torch.float64))
    A, b = _ls_stats(ds, prob.reg)
    exact = torch.stack([torch.linalg.solve(A[m].mean(0), b[m].mean(0)) for m in masks])
    assert float((got - exact).norm(dim=1).max()) <= alg.tau


def _ls_stats(ds, reg):
    """Per-user (A_u, b_u) with grad f_u(w) = A_u w - b_u (least squares + ridge), exact."""
    tr = ds.train.to(torch.float64)
    n, d = tr.num_users, tr.dim
    A = torch.zeros(n, d, d, dtype=torch.float64)
    b = torch.zeros(n, d, dtype=torch.float64)
    for u in range(n):
        X, y = tr.X[tr.user_index == u], tr.y[tr.user_index == u]
        A[u] = X.T @ X / len(y) + reg * torch.eye(d, dtype=torch.float64)
        b[u] = X.T @ y / len(y)
    return A, b


@pytest.mark.parametrize("seed", range(6))
def test_certificate_bound_never_exceeded_on_random_strongly_convex_problems(seed):
    """Lemma C.1 (re-derived): ||theta* - theta*_{-S}|| <= s gamma/((n-s) mu), Dbar_r <= U, brute force."""
    rng = np.random.default_rng(seed)
    n, r = 10, 3
    ds = load_dataset(
        "synthetic-least-squares",
        n_users=n,
        m=int(rng.integers(3, 30)),
        d=3,
        seed=seed,
        heterogeneity=float(rng.choice([0.0, 1.0, 3.0])),
    )
    reg = float(rng.choice([0.05, 0.3, 1.0]))
    A, b = _ls_stats(ds, reg)
    beta = float(torch.linalg.matrix_norm(A, ord=2).max())  # each user's smoothness
    theta = {}
    for s in range(r + 2):
        for S in itertools.combinations(range(n), s):
            keep = [u for u in range(n) if u not in S]
            theta[S] = torch.linalg.solve(A[keep].mean(0), b[keep].mean(0))
    t0 = theta[()]
    gamma = float((A @ t0 - b).norm(dim=1).max())
    for S, t in theta.items():
        s = len(S)
        if s <= r + 1:
            assert float((t - t0).norm()) <= s * gamma / ((n - s) * reg) * (1 + 1e-9) + 1e-12
    dbar = max(
        float((theta[S] - theta[tuple(sorted(S + (i,)))]).norm())
        for S in theta
        if len(S) <= r
        for i in range(n)
        if i not in S
    )
    assert dbar <= lemma_c1_bound(n, r, gamma, reg, beta) * (1 + 1e-9)
    assert dbar <= lemma_c1_bound(n, r, gamma, reg) * (1 + 1e-9)


@pytest.mark.parametrize("seed,heterogeneity,reg", [(0, 0.0, 0.5), (1, 2.0, 0.2), (2, 5.0, 1.0)])
def test_certificate_claim_bounds_measured_deletion_sensitivity_of_the_solver(seed, heterogeneity, reg):
    """On random regularized logistic problems, the certificate's U + 2 tau (passing or not) is never
    below the enumerated Dbar_{4 kappa} f~(x) (solver error included)."""
    n = 14
    ds, prob, fed = _logistic(n, seed=seed, m=8 + 4 * seed, heterogeneity=heterogeneity, reg=reg)
    w0 = torch.zeros(2, dtype=torch.float64)
    alg = _sc_release(prob, ds, Delta=0.5)
    theta = alg.solve(fed, torch.ones(1, n, dtype=torch.bool), w0)[0]
    _, claimed = alg.certify(fed, theta, w0)
    plan = exact_stability(lambda m: alg.solve(fed, m, w0), n, alg.dop)
    assert 0 < plan.dbar_full <= claimed


@pytest.mark.statistical
def test_fast_path_and_exact_path_give_the_same_output_distribution():
    n = 16
    ds, prob, fed = _logistic(n)
    w0 = torch.zeros(2, dtype=torch.float64)
    fast = _sc_release(prob, ds, Delta=3.0)
    plan_fast = fast.plan(fed, w0)
    assert plan_fast.decided_by == "certificate" and fast.stats == {"certificate": 1, "exact": 0}
    # soundness: the exact enumeration agrees that x itself is stable, and picks the same value
    plan_exact = exact_stability(lambda m: fast.solve(fed, m, w0), n, fast.dop)
    assert (plan_exact.dist, plan_exact.deleted) == (0, ())
    # the certificate's claim (U + 2 tau) bounds the measured Dbar_{4 kappa} f~(x) of the enumeration
    theta = fast.solve(fed, torch.ones(1, n, dtype=torch.bool), w0)[0]
    passed, claimed = fast.certify(fed, theta, w0)
    assert passed and plan_exact.dbar_full <= claimed
    assert torch.equal(plan_exact.value, plan_fast.value)
    draws = {}
    for name, plan, seed in (("fast", plan_fast, 1), ("exact", plan_exact, 2)):
        rel = Releaser(_CountingLedger(), NoiseSource(seed))
        out = [DelOutputPert(fast.dop).release(plan, rel, _ids(n), "t") for _ in range(2000)]
        assert all(o is not None for o in out)  # dist = 0 <= R1 always: never ⊥
        draws[name] = torch.stack(out).numpy()
    for j in range(2):
        assert stats.ks_2samp(draws["fast"][:, j], draws["exact"][:, j]).pvalue > 1e-3


def test_certificate_that_does_not_settle_falls_back_to_the_exact_test(tmp_path):
    n = 14
    ds, prob, fed = _logistic(n, seed=2, heterogeneity=3.0)
    w0 = torch.zeros(2, dtype=torch.float64)
    alg = _sc_release(prob, ds, Delta=0.3)
    th = alg.solve(fed, torch.ones(1, n, dtype=torch.bool), w0)[0]
    assert not alg.certify(fed, th, w0)[0]  # n = 14: (n - 4 kappa - 1) = 1, the bound is loose
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(epsilon=10.0, delta=0.5))
    res = alg.run(fed, Releaser(ledger, NoiseSource(5)), w0)
    assert alg.stats == {"certificate": 0, "exact": 1} and res.diagnostics["decided_by"] == "exact"
    assert alg.fast_path_rate == 0.0
    exact = exact_stability(lambda m: alg.solve(fed, m, w0), n, alg.dop)
    assert res.diagnostics["dist"] == exact.dist
    (rel,) = ledger.releases()
    assert (rel["eps"], rel["delta"], rel["users"]) == (8.0, 0.1, n)


def test_sc_output_pert_refuses_large_n_before_reading_data():
    ds, prob, fed = _logistic(25)
    asked = []
    compute = fed.compute
    fed.compute = lambda q, users=None: asked.append(q) or compute(q, users)
    with pytest.raises(ValueError, match="max_exact_users"):
        _sc_release(prob, ds, Delta=1.0).run(
            fed, Releaser(_CountingLedger(), NoiseSource(0)), torch.zeros(2, dtype=torch.float64)
        )
    assert asked == []


def test_gradients_at_points_query_matches_problem_gradients():
    ds, prob, fed = _logistic(6, d=3)
    P = torch.randn(12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = fed.compute(GradientsAtPoints(P)).values
    for j in range(12):
        assert torch.allclose(got[:, j], prob.per_user_gradients(P[j], fed._train), atol=1e-14)


# --- Phased-ERM -------------------------------------------------------------------------------
@pytest.mark.parametrize("Delta_1,expect_bottoms", [(2.0, 0), (1e-9, 2)])
def test_phased_erm_charges_each_phase_and_keeps_the_center_on_bottom(tmp_path, Delta_1, expect_bottoms):
    n = 10
    ds, prob, fed = _logistic(n, reg=0.0, m=10)
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(epsilon=16.0, delta=0.25))
    params = PhasedParams(
        p002_lam=0.05, stability_delta=Delta_1, p002_delta_rule="fixed", p002_phases=2, p002_calibration="paper"
    )
    ctx = BuildContext.fresh(eps=16.0, delta=0.2, problem=prob, feature_bound=ds.feature_bound)
    alg = PhasedERM(params, ctx, setting=setting_for_problem(prob, ds.feature_bound))  # K = R^d
    w0 = torch.zeros(2, dtype=torch.float64)
    res = alg.run(fed, Releaser(ledger, NoiseSource(3)), w0)
    assert res.bottoms == expect_bottoms and res.phases == 2
    if expect_bottoms == 2:
        assert torch.equal(res.w, w0)  # ⊥ in every phase: the public start point, post-processing
    rels = ledger.releases()
    assert [(r["eps"], r["delta"]) for r in rels] == [(8.0, 0.1)] * 2
    assert ledger.spend(fed.user_ids[0]).eps == pytest.approx(16.0)
    ledger.verify()


@pytest.mark.parametrize(
    "eps,delta,score",
    [(1.0, 1e-6, "exact"), (2.0, 1e-6, "exact"), (8.0, 1e-6, "exact"), (4.0, 0.2, "exact"), (8.0, 1e-6, "matching")],
)
def test_profile_calibration_is_the_smallest_noise_its_theorem_allows(eps, delta, score):
    """The profile calibration meets its theorem's worst case exactly at its sigma (1% less noise breaks
    delta on some reachable pair) and is well below the tight calibration's noise."""
    from fedkl.algorithms.output_perturbation.stability_profile import calibrate, worst_case_divergence

    p = calibrate(eps, delta, score)
    budget = p.deletion_budget
    assert worst_case_divergence(eps, p.sigma_over_Delta, budget, score) <= delta
    assert worst_case_divergence(eps, 0.99 * p.sigma_over_Delta, budget, score) > delta
    prof = DeletionRelease(eps, delta, 1.0, "profile", score=score)
    tight = DeletionRelease(eps, delta, 1.0, "tight", score=score)
    assert prof.sigma == p.sigma_over_Delta and prof.kappa == p.kappa <= tight.kappa
    assert prof.sigma < 0.6 * tight.sigma


def test_profile_split_is_the_grid_split_of_least_noise_and_spends_the_whole_budget():
    """The budget-split rule (stability_profile's docstring): the split (eps_r, delta_r) between the TDLap
    test and the Gaussian is the public-grid point of least sigma/Delta (every error bound of the
    algorithms grows with sigma), and at the chosen sigma the whole release's worst case IS delta:
    the composed total equals the budget (nothing left unspent, nothing over)."""
    from fedkl.algorithms.output_perturbation.stability_profile import (
        DELTA_FRACTIONS,
        EPS_FRACTIONS,
        _smallest_ratio,
        calibrate,
        worst_case_divergence,
    )
    from fedkl.privacy.mechanisms import TruncatedDiscreteLaplace

    eps, delta = 4.0, 0.2
    p = calibrate(eps, delta)
    ratios = {}
    for fe in EPS_FRACTIONS:
        for fd in DELTA_FRACTIONS:
            law = TruncatedDiscreteLaplace(float(fe) * eps, fd * delta)
            ratios[(law.eps, law.delta)] = _smallest_ratio(eps, delta, law, "exact")
    best = min(ratios, key=ratios.get)
    assert (p.eps_r, p.delta_r) == best and p.sigma_over_Delta == ratios[best]
    finite = [r for r in ratios.values() if math.isfinite(r)]
    assert max(finite) > 1.2 * p.sigma_over_Delta  # the choice matters on this grid
    assert worst_case_divergence(eps, p.sigma_over_Delta, p.deletion_budget) == pytest.approx(delta, rel=1e-6)
