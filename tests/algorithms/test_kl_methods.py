"""Paper 000 (Menart et al.): adaptive noisy GD, KL-Spider, private proximal point, and the
exponential-mechanism release. Privacy: every release has the user-level sensitivity and the
ledger charge its theorem says, is refused (with nothing released) when the budget is spent, and
the noise drawn matches both. Utility: on PL least squares (known ERM optimum) the excess risk
falls with n and rho at roughly the rates the paper states.

Rate tests: ``synthetic_least_squares`` (d = 5, 5 records per user) is PL with
``mu = lambda_min(H)``, ``L1 = lambda_max(H)`` of the exact train Hessian H; gamma = 1/sqrt(2 mu),
kappa = 2. Excess risks are geometric means over 8 seeds; slopes are least-squares fits of
log(excess) on log(n) (or log(rho)). The measured slopes (several seed batches) were: adaptive GD
-1.36..-1.42 in n and -0.67..-0.88 in rho (paper: d/(n^2 rho) + 1/(n sqrt(rho)), i.e. between -2
and -1 in n, -1 and -1/2 in rho); spider -1.70..-2.05 in n, -0.92..-0.97 in rho (paper: -2, -1);
prox point -1.89..-2.08 in n, -0.99 in rho (paper: -2, -1). The tolerances are wide around the
paper's ranges but fail for an algorithm whose noise does not shrink with n or rho (slope ~ 0).
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest
import torch

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.kl.kl_adaptive_gd import AdaptiveKLGD, AdaptiveKLGDParams
from fedkl.algorithms.kl.kl_common import KLConstants
from fedkl.algorithms.kl.kl_spider import ANCHOR_WEIGHT, KLSpider, KLSpiderParams
from fedkl.algorithms.kl.prox_point import PrivateProxPoint, ProxPointParams
from fedkl.data import load_dataset
from fedkl.federation.base import ClippedGradient, GradientDifference
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import (
    Budget,
    BudgetExceeded,
    BudgetExhausted,
    ExponentialMechanism,
    NoiseSource,
    PrivacyLedger,
    Releaser,
    ZCDPFilter,
)
from fedkl.privacy.guarantee import sum_sensitivity
from fedkl.problems import make_problem
from fedkl.runner import RunConfig

BIG = Budget(epsilon=1e3, delta=1e-6)  # for tests about utility: the filter is the budget
USERS = [f"u{i}" for i in range(5)]


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _least_squares(n: int, seed: int, d: int = 5, m: int = 5):
    """Dataset, problem, federation and the PL constants (mu, L1) of the exact train Hessian."""
    ds = load_dataset("synthetic-least-squares", n_users=n, m=m, d=d, seed=seed)
    problem = make_problem("least-squares", ds)
    tr = ds.train
    X = tr.X.double().numpy()
    counts = tr.counts().double().numpy()
    weights = 1.0 / (tr.num_users * counts[tr.user_index.numpy()])
    ev = np.linalg.eigvalsh(X.T @ (weights[:, None] * X))
    return ds, problem, InProcessFederation(problem, ds), float(ev[0]), float(ev[-1])


def _excess(ds, problem, w) -> float:
    return problem.loss(w, ds.train) - problem.loss(ds.extra["erm_optimum"], ds.train)


def _ctx(rho: float, neighbouring: str = "replace-one") -> BuildContext:
    return BuildContext.fresh(rho=rho, neighbouring=neighbouring)


def _make(name: str, rho: float, mu: float, L1: float, neighbouring: str = "replace-one", **kw):
    """The three algorithms on a PL problem (gamma = 1/sqrt(2 mu), kappa = 2, lr = 1/(2 L1)), with the
    heuristic constants that make the schedules usable at n <= 1000 (privacy does not depend on them)."""
    ctx = _ctx(rho, neighbouring)
    gamma = 1.0 / math.sqrt(2.0 * mu)
    if name == "adaptive":
        return AdaptiveKLGD(AdaptiveKLGDParams(lr=1.0 / (2.0 * L1), **kw), ctx)
    if name == "spider":
        kw = {"kl_contraction_constant": 1.0, "kl_floor_constant": 1.0, **kw}
        return KLSpider(KLSpiderParams(kl_gamma=gamma, kl_smoothness=L1, **kw), ctx)
    kw = {"kl_prox_steps": 5, "kl_inner_rounds": 6, "kl_weak_convexity": 0.05, **kw}
    return PrivateProxPoint(ProxPointParams(kl_gamma=gamma, **kw), ctx)


def _run(name: str, n: int, rho: float, seed: int, **kw) -> float:
    ds, problem, fed, mu, L1 = _least_squares(n, seed)
    alg = _make(name, rho, mu, L1, **kw)
    ledger = PrivacyLedger(":memory:", BIG)
    res = alg.run(fed, Releaser(ledger, NoiseSource(seed), ZCDPFilter(rho)), problem.init_params())
    return _excess(ds, problem, res.w)


def _geo_mean_excess(name: str, n: int, rho: float, seeds: int = 8, **kw) -> float:
    return float(np.exp(np.mean([math.log(_run(name, n, rho, 1000 * n + s, **kw)) for s in range(seeds)])))


def _slope(xs, ys) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


class _Recorder(Releaser):
    """A Releaser that also keeps (exact value, released value, arguments) of every Gaussian release."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = []

    def gaussian(self, value, **kw):
        out = super().gaussian(value, **kw)
        self.calls.append((value.detach().clone(), out.detach().clone(), kw))
        return out


def _release_noise(rec: _Recorder, ledger: PrivacyLedger, users: int) -> torch.Tensor:
    """Every Gaussian release is in the ledger, charged to every user, with its sensitivity, rho and
    sigma = Delta/sqrt(2 rho); returns the noise drawn divided by that sigma."""
    rows = [r for r in ledger.releases() if r["mechanism"] == "gaussian"]
    assert len(rows) == len(rec.calls)
    z = []
    for (value, out, kw), row in zip(rec.calls, rows):
        sigma = kw["sensitivity"] / math.sqrt(2.0 * kw["rho"])
        assert row["sensitivity"] == pytest.approx(kw["sensitivity"], rel=1e-12)
        assert row["rho"] == pytest.approx(kw["rho"], rel=1e-12)
        assert row["noise_scale"] == pytest.approx(sigma, rel=1e-12)
        assert row["users"] == users  # every user is charged for every release
        z.append(((out - value) / sigma).flatten())
    return torch.cat(z)


def _assert_standard_normal(z: torch.Tensor) -> None:
    """The pooled normalized noise has std 1 and mean 0 within 5 standard errors (the std of a
    sample std of N normals is ~ 1/sqrt(2N)); a noise scale off by the relation's factor 2 fails."""
    N = z.numel()
    assert 5.0 / math.sqrt(2 * N) < 0.25  # N >= 200 draws
    assert abs(float(z.std()) - 1.0) < 5.0 / math.sqrt(2 * N)
    assert abs(float(z.mean())) < 5.0 / math.sqrt(N)


# --------------------------------------------------------------------------------------------------
# Releaser.exponential
# --------------------------------------------------------------------------------------------------
class _WatchedNoise(NoiseSource):
    """Seeded noise that records the ledger's and the filter's state when a selection is sampled."""

    def __init__(self, seed, ledger, flt):
        super().__init__(seed)
        self.ledger, self.flt, self.seen = ledger, flt, []

    def categorical(self, log_weights):
        self.seen.append((self.ledger.num_releases(), self.flt.spent if self.flt else None))
        return super().categorical(log_weights)


@pytest.mark.parametrize("monotone,rho_factor", [(False, 1 / 8), (True, 1 / 2)])
def test_exponential_charges_before_sampling(tmp_path, monotone, rho_factor):
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(2.0, 1e-5))
    flt = ZCDPFilter(0.5)
    noise = _WatchedNoise(3, ledger, flt)
    eps, sens = 0.3, 0.25
    idx = Releaser(ledger, noise, flt).exponential(
        [0.1, -0.3, 0.7], eps=eps, sensitivity=sens, user_ids=USERS, label="sel", monotone=monotone
    )
    assert idx in (0, 1, 2)
    rho = rho_factor * eps**2
    assert noise.seen == [(1, pytest.approx(rho, rel=1e-12))]  # charged AND filtered before the draw
    (row,) = ledger.releases()
    assert row["mechanism"] == "exponential" and row["label"] == "sel" and row["users"] == len(USERS)
    assert row["rho"] == pytest.approx(rho, rel=1e-12) and row["sensitivity"] == sens
    assert ledger.spend(USERS[0]).rho == pytest.approx(rho, rel=1e-12)
    ledger.verify()


def test_exponential_refusals_release_nothing(tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(2.0, 1e-5))
    flt = ZCDPFilter(0.01)
    noise = _WatchedNoise(0, ledger, flt)
    rel = Releaser(ledger, noise, flt)
    with pytest.raises(BudgetExhausted):  # eps^2/8 = 0.02 > the filter's 0.01
        rel.exponential([0.0, 1.0], eps=0.4, sensitivity=1.0, user_ids=USERS, label="too-big")
    assert ledger.num_releases() == 0 and flt.spent == 0.0 and noise.seen == []
    # the ledger refuses (its budget is far below eps^2/8 = 12.5) before the filter records anything
    rel2 = Releaser(ledger, noise, ZCDPFilter(100.0))
    with pytest.raises(BudgetExceeded):
        rel2.exponential([0.0, 1.0], eps=10.0, sensitivity=1.0, user_ids=USERS, label="ledger")
    assert ledger.num_releases() == 0 and rel2.filter.spent == 0.0 and noise.seen == []
    for bad in ([], [[0.0, 1.0]], [0.0, float("nan")], [float("inf")]):
        with pytest.raises(ValueError):
            rel2.exponential(bad, eps=0.1, sensitivity=1.0, user_ids=USERS, label="bad")
    for eps, sens in ((0.0, 1.0), (-1.0, 1.0), (0.1, 0.0), (0.1, float("nan"))):
        with pytest.raises(ValueError):
            rel2.exponential([0.0, 1.0], eps=eps, sensitivity=sens, user_ids=USERS, label="bad")
    assert ledger.num_releases() == 0 and noise.seen == []


def test_exponential_frequencies_match_pmf():
    u = np.array([0.0, -1.0, -2.0, 0.5, -0.5])
    eps, sens = 1.5, 0.5
    pmf = ExponentialMechanism(eps, sens).probabilities(u)
    assert np.allclose(pmf, np.exp(eps * u / (2 * sens)) / np.exp(eps * u / (2 * sens)).sum())
    ledger = PrivacyLedger(":memory:", Budget(1e7, 1e-6))
    rel = Releaser(ledger, NoiseSource(123), None)
    N = 4000
    counts = np.bincount(
        [rel.exponential(u, eps=eps, sensitivity=sens, user_ids=USERS[:1], label="f") for _ in range(N)],
        minlength=u.size,
    )
    assert ledger.num_releases() == N
    se = np.sqrt(N * pmf * (1 - pmf))
    assert np.all(np.abs(counts - N * pmf) < 5 * se)
    # the monotone pmf (no factor 2) is far outside those bounds: the test can tell them apart
    wrong = ExponentialMechanism(eps, sens, monotone=True).probabilities(u)
    assert np.any(np.abs(counts - N * wrong) > 5 * se)


# --------------------------------------------------------------------------------------------------
# sensitivities of the queries the algorithms release, on adversarial neighbours
# --------------------------------------------------------------------------------------------------
def test_query_sensitivities_on_adversarial_neighbours(dishonest_records):
    """Replacing one user's records (by records far outside every bound) moves ||S||, the clipped
    difference sum and the selection utility -||S||/n by at most 2C, 2C_k and 2C/n; removing one
    user by C, C_k, C/n (the relation-specific sensitivities the algorithms pass to the Releaser)."""
    from fedkl.data.base import FederatedDataset, UserData

    ds = load_dataset("synthetic-least-squares", n_users=20, m=6, d=4, seed=7)
    problem = make_problem("least-squares", ds)
    g = torch.Generator().manual_seed(1)
    C, Ck, n = 0.4, 0.05, 20
    for _ in range(15):
        tr = ds.train
        mine = tr.user_index == 3
        X, y = tr.X.clone(), tr.y.clone()
        X[mine] = torch.randn(int(mine.sum()), tr.dim, generator=g, dtype=torch.float64) * 1e3
        y[mine] = -1e3 * y[mine]
        adv = FederatedDataset("adv", UserData(X, y, tr.user_index, tr.user_ids), ds.test, "regression", 1.0, "adv")
        w_old = torch.randn(problem.num_params, generator=g, dtype=torch.float64)
        w_new = w_old + 0.3 * torch.randn(problem.num_params, generator=g, dtype=torch.float64)
        fed, fed_adv = InProcessFederation(problem, ds), InProcessFederation(problem, adv)
        others = [u for u in range(n) if u != 3]
        s, s_adv = (f.sum(ClippedGradient(w_old, C)).total() for f in (fed, fed_adv))
        s_del = fed.sum(ClippedGradient(w_old, C), others).total()
        assert abs(float(s.norm()) - float(s_adv.norm())) <= sum_sensitivity(C, "replace-one") * (1 + 1e-12)
        assert abs(float(s.norm()) - float(s_del.norm())) <= sum_sensitivity(C, "add-remove") * (1 + 1e-12)
        assert abs(float(s.norm()) / n - float(s_adv.norm()) / n) <= 2 * C / n * (1 + 1e-12)
        q = GradientDifference(w_new, w_old, Ck)
        dd, dd_adv = fed.sum(q).total(), fed_adv.sum(q).total()
        dd_del = fed.sum(q, others).total()
        assert float((dd - dd_adv).norm()) <= 2 * Ck * (1 + 1e-12)
        assert float((dd - dd_del).norm()) <= Ck * (1 + 1e-12)


# --------------------------------------------------------------------------------------------------
# adaptive noisy GD (Algorithm 3)
# --------------------------------------------------------------------------------------------------
def test_adaptive_gradient_cost_follows_the_noisy_norm():
    alg = AdaptiveKLGD(AdaptiveKLGDParams(clip=0.5), _ctx(0.8))
    n, d = 400, 7
    plan = alg.plan(n, d)
    assert plan.rho_norm == pytest.approx(math.sqrt(0.8) / n)
    assert plan.rho_norm + plan.rho_cap == pytest.approx(0.4)  # the paper's rho/2 split
    assert plan.A == pytest.approx(math.log(n * math.sqrt(0.8) / 0.1))
    Delta = 2 * 0.5
    for N in (0.3, 0.05):  # sigma_t = N/sqrt(dA) on the mean: rho_t = Delta^2 d A / (2 n^2 N^2)
        assert alg.gradient_rho(plan, N, n, d) == pytest.approx(
            min(Delta**2 * d * plan.A / (2 * n**2 * N**2), plan.rho_cap)
        )
    for N in (1e-4, 0.0, -0.2):  # tiny or negative noisy norms: the floor, never a cheaper release
        assert alg.gradient_rho(plan, N, n, d) == pytest.approx(plan.rho_cap)
    with pytest.raises(ValueError, match="too small"):
        AdaptiveKLGD(AdaptiveKLGDParams(), _ctx(1e-4)).plan(n=10, d=3)


@pytest.mark.parametrize("relation,factor", [("replace-one", 2.0), ("add-remove", 1.0)])
def test_adaptive_noise_charges_and_stop_at_filter(relation, factor):
    rho, clip, z = 2.0, 0.7, []
    for seed in range(4):
        ds, problem, fed, mu, L1 = _least_squares(120, seed, d=40)
        n, d = fed.num_users, fed.num_params
        alg = AdaptiveKLGD(AdaptiveKLGDParams(lr=1.0 / (2 * L1), clip=clip), _ctx(rho, relation))
        ledger = PrivacyLedger(":memory:", BIG)
        flt = ZCDPFilter(rho)
        rec = _Recorder(ledger, NoiseSource(4 + seed), flt)
        res = alg.run(fed, rec, problem.init_params())
        plan = alg.plan(n, d)
        norms, grads = rec.calls[0::2], rec.calls[1::2]
        assert len(norms) == len(grads) == res.rounds >= 2
        for (nv, nout, nkw), (_, _, gkw) in zip(norms, grads):
            assert nkw["sensitivity"] == gkw["sensitivity"] == factor * clip
            assert nv.shape == (1,) and nkw["rho"] == pytest.approx(plan.rho_norm)
            # the gradient's cost is the one the RELEASED norm implies
            assert gkw["rho"] == pytest.approx(alg.gradient_rho(plan, float(nout[0]) / n, n, d), rel=1e-12)
        z.append(_release_noise(rec, ledger, n))
        total = sum(r["rho"] for r in ledger.releases())
        assert total == pytest.approx(flt.spent, rel=1e-12) and total == pytest.approx(res.rho_spent, rel=1e-12)
        assert total <= rho * (1 + 1e-12)
        # it stopped because no worst-case round fits any more, not earlier
        assert not flt.admits(plan.rho_norm + plan.rho_cap) and res.details["stopped"] == "budget"
        assert ledger.spend(fed.user_ids[0]).releases == 2 * res.rounds
    _assert_standard_normal(torch.cat(z))


def test_adaptive_round_cap_spends_the_rest_on_the_last_step():
    ds, problem, fed, mu, L1 = _least_squares(200, 1)
    rho = 1.0
    ledger = PrivacyLedger(":memory:", BIG)
    flt = ZCDPFilter(rho)
    res = AdaptiveKLGD(AdaptiveKLGDParams(lr=1.0 / (2 * L1), kl_max_rounds=2), _ctx(rho)).run(
        fed, Releaser(ledger, NoiseSource(0), flt), problem.init_params()
    )
    assert res.rounds == 2 and res.details["stopped"] == "max_rounds"
    labels = [r["label"] for r in ledger.releases()]
    assert labels == ["kl-adaptive-gd/round-0/norm", "kl-adaptive-gd/round-0/grad", "kl-adaptive-gd/round-1/grad"]
    assert flt.spent == pytest.approx(rho, rel=1e-12)


def test_adaptive_exhausted_budget_stops_it(tmp_path):
    ds, problem, fed, mu, L1 = _least_squares(200, 2)
    params = AdaptiveKLGDParams(lr=1.0 / (2 * L1))
    # an exhausted filter: refused before anything is released
    ledger = PrivacyLedger(tmp_path / "a.sqlite", Budget(2.0, 1e-5))
    flt = ZCDPFilter(0.5)
    flt.spend(0.5)
    with pytest.raises(BudgetExhausted):
        AdaptiveKLGD(params, _ctx(0.5)).run(fed, Releaser(ledger, NoiseSource(0), flt), problem.init_params())
    assert ledger.num_releases() == 0
    # users whose ledger budget is smaller than what the algorithm was told: the ledger refuses a
    # release mid-run; what was released stays within the users' budget
    ledger = PrivacyLedger(tmp_path / "b.sqlite", Budget(0.5, 1e-5))
    rho = 10 * ledger.budget.rho
    with pytest.raises(BudgetExceeded):
        AdaptiveKLGD(params, _ctx(rho)).run(
            fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(rho)), problem.init_params()
        )
    assert ledger.num_releases() >= 1
    ledger.verify()
    assert max(ledger.epsilon(u) for u in fed.user_ids) <= 0.5 * (1 + 1e-9)


def test_adaptive_exponential_selection_is_charged():
    ds, problem, fed, mu, L1 = _least_squares(300, 3)
    rho, clip = 2.0, 1.0
    alg = AdaptiveKLGD(AdaptiveKLGDParams(lr=1.0 / (2 * L1), clip=clip, kl_select="exponential"), _ctx(rho))
    ledger = PrivacyLedger(":memory:", BIG)
    flt = ZCDPFilter(rho)
    res = alg.run(fed, Releaser(ledger, NoiseSource(9), flt), problem.init_params())
    rows = ledger.releases()
    assert [r["mechanism"] for r in rows].count("exponential") == 1 and rows[-1]["mechanism"] == "exponential"
    sel = rows[-1]
    assert sel["rho"] == pytest.approx(rho / 9, rel=1e-12)  # eps = sqrt(8 rho/9): eps^2/8 = rho/9
    assert sel["sensitivity"] == pytest.approx(2 * clip / fed.num_users, rel=1e-12)
    assert flt.spent <= rho * (1 + 1e-12)
    assert sum(r["rho"] for r in rows[:-1]) <= 8 * rho / 9 * (1 + 1e-12)  # the loop kept off the reserve
    k = res.details["selected_iterate"]
    assert 0 <= k <= res.rounds and res.details["candidates"] == res.rounds + 1
    assert res.details["eps_select"] == pytest.approx(math.sqrt(8 * rho / 9))


def test_adaptive_converges_at_the_stated_rates():
    ns = (100, 300, 900)
    by_n = [_geo_mean_excess("adaptive", n, 2.0) for n in ns]
    ds, problem, *_ = _least_squares(900, 0)
    assert by_n[-1] < 0.01 * _excess(ds, problem, problem.init_params())  # converges (excess at w0 ~ 0.07)
    assert -2.6 < _slope(ns, by_n) < -0.9  # paper: between -2 (d/(n^2 rho)) and -1 (1/(n sqrt rho))
    rhos = (0.5, 2.0, 8.0)
    by_rho = [_geo_mean_excess("adaptive", 900, r) for r in rhos]
    assert -1.6 < _slope(rhos, by_rho) < -0.3  # paper: between -1 and -1/2


# --------------------------------------------------------------------------------------------------
# KL-Spider (Algorithm 1)
# --------------------------------------------------------------------------------------------------
def test_spider_schedule_follows_the_theorem():
    gamma, L1, C, rho, n, d, beta = 1.5, 0.5, 1.0, 0.5, 10_000, 5, 0.1
    params = KLSpiderParams(kl_gamma=gamma, kl_kappa=2.0, kl_beta=beta, kl_smoothness=L1, clip=C)
    sched = KLSpider(params, _ctx(rho)).schedule(n, d)
    F0 = (C * gamma) ** 2
    assert sched.f0 == pytest.approx(F0)
    assert sched.c == pytest.approx(1 + 1 / (64 * gamma**2 * L1))
    bracket = max(1.0, math.log(F0) + 2 * math.log(n * math.sqrt(rho) / (gamma * C * math.sqrt(d))))
    K = math.ceil((1 + 64 * gamma**2 * L1) * bracket)
    assert sched.K == K and sched.beta_prime == pytest.approx(beta / K)
    floor = min((32 * gamma * C * math.sqrt(K * d * math.log(K / beta)) / (n * math.sqrt(rho))) ** 2, F0)
    assert sched.floor == pytest.approx(floor)
    assert sched.targets[0] == pytest.approx(max(F0 / sched.c, floor))
    assert all(t == 1.0 for t in sched.T) and all(m == 1 for m in sched.M)  # PL: T_k = 1
    assert sched.worst_case_rho == pytest.approx(rho, rel=1e-12)
    # per release, sensitivities 2C and 2 C_k = 2 Phi_k^(1/2)/(4 gamma); sigma ratio = the paper's
    # sigma_k / sigma_hat = Phi_k^(1/kappa) sqrt(T_k) / (gamma L0)
    for k in (0, K // 2, K - 1):
        assert sched.sensitivity_diff[k] == pytest.approx(2 * math.sqrt(sched.targets[k]) / (4 * gamma))
        assert sched.diff_clip[k] == pytest.approx(L1 * sched.step[k])
        assert sched.sigma_diff(k) / sched.sigma_anchor == pytest.approx(
            math.sqrt(sched.targets[k]) * math.sqrt(sched.T[k]) / (gamma * C)
        )
    assert sched.rho_anchor / sched.rho_diff[0] == pytest.approx(ANCHOR_WEIGHT)
    # kappa < 2: longer phases as the target shrinks, worst case still exactly rho
    s15 = KLSpider(
        KLSpiderParams(kl_gamma=gamma, kl_kappa=1.5, kl_smoothness=L1, kl_contraction_constant=1, kl_floor_constant=1),
        _ctx(rho),
    ).schedule(n, d)
    assert s15.T[0] < s15.T[-1] and list(s15.M) == [math.ceil(t - 1e-9) for t in s15.T]
    assert all(t == pytest.approx((s15.f0 / p) ** (1 / 3)) for t, p in zip(s15.T, s15.targets))
    assert s15.worst_case_rho == pytest.approx(rho, rel=1e-12)
    assert (
        KLSpider(KLSpiderParams(kl_gamma=gamma, kl_smoothness=L1), _ctx(rho, "add-remove"))
        .schedule(n, d)
        .sensitivity_anchor
        == C
    )


@pytest.mark.parametrize("relation,factor", [("replace-one", 2.0), ("add-remove", 1.0)])
def test_spider_noise_and_charges(relation, factor):
    rho, clip, z, differences = 1.0, 0.8, [], 0
    for seed in range(4):
        ds, problem, fed, mu, L1 = _least_squares(300, seed)
        alg = _make("spider", rho, mu, L1, clip=clip, neighbouring=relation)
        sched = alg.schedule(fed.num_users, fed.num_params)
        ledger = PrivacyLedger(":memory:", BIG)
        flt = ZCDPFilter(rho)
        rec = _Recorder(ledger, NoiseSource(5 + seed), flt)
        res = alg.run(fed, rec, problem.init_params())
        kinds = [kw["details"]["query"] for _, _, kw in rec.calls]
        assert kinds.count("anchor") == sched.K
        differences += kinds.count("difference")
        for value, _, kw in rec.calls:
            k = kw["details"]["phase"]
            if kw["details"]["query"] == "anchor":
                assert kw["sensitivity"] == factor * clip and kw["rho"] == pytest.approx(sched.rho_anchor)
            else:
                assert kw["sensitivity"] == pytest.approx(factor * sched.diff_clip[k])
                assert kw["rho"] == pytest.approx(sched.rho_diff[k])
                assert float(value.norm()) <= fed.num_users * sched.diff_clip[k] * (1 + 1e-12)  # clipped at C_k
        z.append(_release_noise(rec, ledger, fed.num_users))
        assert res.rho_spent == pytest.approx(flt.spent, rel=1e-12) and flt.spent <= rho * (1 + 1e-12)
        assert res.rounds == len(rec.calls) and res.details["steps"] >= 1
    assert differences >= 4
    _assert_standard_normal(torch.cat(z))


def test_spider_exhausted_budget_stops_it():
    ds, problem, fed, mu, L1 = _least_squares(200, 7)
    rho = 1.0
    alg = _make("spider", rho, mu, L1)
    ledger = PrivacyLedger(":memory:", BIG)
    flt = ZCDPFilter(rho / 3)  # a filter smaller than what the algorithm was told it may spend
    with pytest.raises(BudgetExhausted):
        alg.run(fed, Releaser(ledger, NoiseSource(0), flt), problem.init_params())
    total = sum(r["rho"] for r in ledger.releases())
    assert 0 < total == pytest.approx(flt.spent, rel=1e-12) and total <= rho / 3 * (1 + 1e-12)
    assert ledger.num_releases() == flt.steps


def test_spider_round_cap():
    ds, problem, fed, mu, L1 = _least_squares(200, 7)
    ledger = PrivacyLedger(":memory:", BIG)
    flt = ZCDPFilter(1.0)
    res = _make("spider", 1.0, mu, L1, kl_max_rounds=5).run(
        fed, Releaser(ledger, NoiseSource(0), flt), problem.init_params()
    )
    assert res.rounds == ledger.num_releases() == 5 and res.details["stopped"] == "max_rounds"
    assert flt.spent < 1.0  # calibrated for the whole schedule: a capped run under-spends, never over-spends


def test_spider_converges_at_the_stated_rates():
    ns = (100, 300, 900)
    by_n = [_geo_mean_excess("spider", n, 2.0) for n in ns]
    assert by_n[-1] < 0.005
    assert -2.8 < _slope(ns, by_n) < -1.3  # paper: -kappa = -2 (up to the log factors of K)
    rhos = (0.5, 2.0, 8.0)
    by_rho = [_geo_mean_excess("spider", 300, r) for r in rhos]
    assert -1.5 < _slope(rhos, by_rho) < -0.6  # paper: -kappa/2 = -1


# --------------------------------------------------------------------------------------------------
# private proximal point (Algorithms 2 + 4)
# --------------------------------------------------------------------------------------------------
def test_prox_point_schedule_follows_the_theorem():
    gamma, Lw, C, rho, n, d, beta = 1.2, 0.3, 1.0, 0.5, 2000, 5, 0.1
    base = dict(kl_weak_convexity=Lw, kl_gamma=gamma, kl_kappa=2.0, kl_beta=beta, clip=C)
    sched = PrivateProxPoint(ProxPointParams(**base, rounds=10**9), _ctx(rho)).schedule(n, d)  # rounds: no cap
    F0 = (C * gamma) ** 2
    bracket = max(1.0, math.log(F0) + 2 * math.log(n * math.sqrt(rho) / (gamma * C * math.sqrt(d))))
    T = math.ceil((1 + 32 * gamma**2 * Lw) * bracket)
    T_in = math.ceil(n**2 * (rho / T) * math.log(2 * T / beta) ** 2 / d)
    assert (sched.T, sched.T_in, sched.T_in_theorem) == (T, T_in, T_in)
    assert sched.rho_release == pytest.approx(rho / (T * T_in))
    assert sched.sigma == pytest.approx(2 * C / math.sqrt(2 * rho / (T * T_in)))
    capped = PrivateProxPoint(ProxPointParams(**base, rounds=7), _ctx(rho)).schedule(n, d)
    assert capped.T_in == 7 and capped.T_in_theorem == T_in and capped.rho_release == pytest.approx(rho / (T * 7))
    assert PrivateProxPoint(ProxPointParams(**base), _ctx(rho)).radius == pytest.approx(C / (2 * Lw))


@pytest.mark.parametrize("relation,factor", [("replace-one", 2.0), ("add-remove", 1.0)])
def test_prox_point_noise_and_charges(relation, factor):
    ds, problem, fed, mu, L1 = _least_squares(150, 8, d=30)
    rho, clip = 1.0, 0.6
    alg = _make("ppm", rho, mu, L1, clip=clip, neighbouring=relation, kl_prox_steps=3, kl_inner_rounds=5)
    ledger = PrivacyLedger(":memory:", BIG)
    flt = ZCDPFilter(rho)
    rec = _Recorder(ledger, NoiseSource(6), flt)
    res = alg.run(fed, rec, problem.init_params())
    assert res.rounds == len(rec.calls) == 15
    for _, _, kw in rec.calls:
        assert kw["sensitivity"] == factor * clip and kw["rho"] == pytest.approx(rho / 15)
    _assert_standard_normal(_release_noise(rec, ledger, fed.num_users))
    assert flt.spent == pytest.approx(rho, rel=1e-12) and res.rho_spent == pytest.approx(rho, rel=1e-12)


def test_prox_point_exhausted_budget_stops_it():
    ds, problem, fed, mu, L1 = _least_squares(100, 9)
    rho = 1.0
    alg = _make("ppm", rho, mu, L1, kl_prox_steps=2, kl_inner_rounds=5)
    ledger = PrivacyLedger(":memory:", BIG)
    flt = ZCDPFilter(rho / 2)
    with pytest.raises(BudgetExhausted):
        alg.run(fed, Releaser(ledger, NoiseSource(0), flt), problem.init_params())
    assert ledger.num_releases() == flt.steps == 5  # half of the 10 releases; the 6th was refused
    assert flt.spent == pytest.approx(rho / 2, rel=1e-12)


def test_prox_point_converges_at_the_stated_rates():
    ns = (100, 300, 900)
    by_n = [_geo_mean_excess("ppm", n, 2.0) for n in ns]
    assert by_n[-1] < 0.005
    assert -2.8 < _slope(ns, by_n) < -1.3  # paper: -kappa = -2
    rhos = (0.5, 2.0, 8.0)
    by_rho = [_geo_mean_excess("ppm", 300, r) for r in rhos]
    assert -1.5 < _slope(rhos, by_rho) < -0.6  # paper: -kappa/2 = -1


# --------------------------------------------------------------------------------------------------
# configuration and builders
# --------------------------------------------------------------------------------------------------
def test_bad_configurations_are_refused():
    """Each out-of-range hyperparameter is refused by its Params with a one-line error naming the flag."""
    for cls, bad, flag in (
        (AdaptiveKLGDParams, dict(lr=0.0), "--lr"),
        (AdaptiveKLGDParams, dict(clip=-1.0), "--clip"),
        (AdaptiveKLGDParams, dict(kl_beta=1.0), "--kl-beta"),
        (AdaptiveKLGDParams, dict(kl_select="best"), "--kl-select"),
        (AdaptiveKLGDParams, dict(kl_select_fraction=1.0), "--kl-select-fraction"),
        (AdaptiveKLGDParams, dict(kl_max_rounds=0), "--kl-max-rounds"),
        (AdaptiveKLGDParams, dict(kl_norm_rho=-1.0), "--kl-norm-rho"),
        (KLSpiderParams, dict(kl_kappa=2.5), "--kl-kappa: KL-Spider is for kappa in"),
        (KLSpiderParams, dict(kl_kappa=0.5), "--kl-kappa must be finite and >= 1"),
        (KLSpiderParams, dict(kl_smoothness=0.0), "--kl-smoothness"),
        (KLSpiderParams, dict(kl_phases=0), "--kl-phases"),
        (KLSpiderParams, dict(kl_floor_constant=0.0), "--kl-floor-constant"),
        (KLSpiderParams, dict(kl_gamma=0.0), "--kl-gamma"),
        (KLSpiderParams, dict(kl_f0=-1.0), "--kl-f0"),
        (ProxPointParams, dict(kl_kappa=1.5), "--kl-kappa: the proximal point method is for kappa >= 2"),
        (ProxPointParams, dict(kl_weak_convexity=0.0), "--kl-weak-convexity"),
        (ProxPointParams, dict(kl_contraction_constant=0.0), "--kl-contraction-constant"),
        (ProxPointParams, dict(kl_inner_rounds=0), "--kl-inner-rounds"),
    ):
        with pytest.raises(ValueError, match=re.escape(flag)):
            cls(**bad)
    for bad in (dict(gamma=0.0), dict(gamma=1.0, kappa=0.5), dict(gamma=1.0, f0=-1.0), dict(gamma=1.0, beta=0.0)):
        with pytest.raises(ValueError):
            KLConstants(**bad)
    with pytest.raises(ValueError, match="needs the KL\\* constant gamma"):  # no gamma, no problem to derive it
        PrivateProxPoint(ProxPointParams(), _ctx(1.0))
    for cls in (AdaptiveKLGD, KLSpider, PrivateProxPoint):
        params = cls.Params(**({} if cls is AdaptiveKLGD else {"kl_gamma": 1.0}))
        with pytest.raises(ValueError, match="rho_total"):
            cls(params, _ctx(0.0))
        with pytest.raises(ValueError, match="swap"):
            cls(params, _ctx(1.0, "swap"))
    ds, problem, fed, *_ = _least_squares(100, 0)
    with pytest.raises(ValueError, match="filter"):  # adaptive costs need a filter
        AdaptiveKLGD(AdaptiveKLGDParams(), _ctx(1.0)).run(
            fed, Releaser(PrivacyLedger(":memory:", BIG), NoiseSource(0)), problem.init_params()
        )


def test_builders_read_the_run_config():
    from build_helpers import build

    ds, problem, *_ = _least_squares(100, 0)
    common = dict(problem=problem, dataset=ds, delta=1e-5, ledger=None, user_ids=())

    def cfg(name, **kw):
        return RunConfig.from_settings(strict=False, dataset="synthetic-least-squares", algorithm=name, **kw)

    plain = dict(lr=0.5, clip=0.7, neighbouring="add-remove")
    agd = build(cfg("kl-adaptive-gd", **plain), 0.3, **common)
    assert (agd.params.lr, agd.params.clip, agd.ctx.neighbouring, agd.params.kl_select) == (
        0.5,
        0.7,
        "add-remove",
        "last",
    )
    with pytest.raises(ValueError, match="kl_gamma"):  # no gamma and no regularizer to derive it from
        build(cfg("kl-spider", **plain), 0.3, **common)
    with pytest.raises(ValueError, match="kl_gamma"):
        build(cfg("kl-prox-point", **plain), 0.3, **common)
    reg_problem = make_problem("least-squares", ds, reg=0.08)
    sp = build(cfg("kl-spider", lr=0.5, reg=0.08), 0.3, **{**common, "problem": reg_problem})
    assert sp.kl.gamma == pytest.approx(1 / math.sqrt(0.16)) and sp.smoothness == pytest.approx(1.0)
    assert (sp.contraction_constant, sp.floor_constant, sp.kl.kappa) == (64.0, 32.0, 2.0)
    pp_cfg = cfg("kl-prox-point", lr=0.5, reg=0.08)
    pp = build(pp_cfg, 0.3, **{**common, "problem": reg_problem})
    assert pp.weak_convexity == pytest.approx(1.0)
    pp_sched = pp.schedule(100, problem.num_params)  # the theorem's T_in, capped at --rounds
    assert pp_sched.T_in == min(pp_sched.T_in_theorem, pp_cfg.params.rounds) == pp_cfg.params.rounds
    assert pp.contraction_constant == 32.0
    extra = dict(kl_gamma=2.0, kl_kappa=1.5, kl_contraction_constant=2.0, kl_prox_steps=4, kl_select="exponential")
    assert build(cfg("kl-spider", **extra), 0.3, **common).kl.kappa == 1.5
    assert build(cfg("kl-adaptive-gd", **extra), 0.3, **common).params.kl_select == "exponential"
    with pytest.raises(ValueError, match="kappa >= 2"):
        build(cfg("kl-prox-point", **extra), 0.3, **common)
    with pytest.raises(ValueError, match="kl_select='exponential' does not apply to kl-spider"):
        RunConfig.from_settings(algorithm="kl-spider", kl_select="exponential")


@pytest.mark.parametrize("name", ["kl-adaptive-gd", "kl-prox-point", "kl-spider"])
def test_fedkl_run_end_to_end(tmp_path, name):
    """The algorithms are registered in ``fedkl run``'s table and run through it."""
    import json

    import fedkl.runner as runner

    assert name in runner.ALGORITHMS
    cfg = RunConfig.from_settings(
        strict=False,
        dataset="synthetic-least-squares",
        algorithm=name,
        users=60,
        reg=0.1,
        lr=1.0,
        rounds=4,
        epsilon=3.0,
        noise_seed=1,
        out=str(tmp_path / "out"),
        reference=False,
        kl_contraction_constant=1.0,
        kl_floor_constant=1.0,
        kl_prox_steps=3,
    )
    payload = runner.run_training(cfg, log=lambda _: None)
    assert payload["algorithm"] == name and payload["rounds"] >= 1
    assert 0 < payload["epsilon"] <= 3.0 * (1 + 1e-9)
    with open(tmp_path / "out" / "result.json") as f:
        assert json.load(f)["algorithm_details"]
    ledger = PrivacyLedger(tmp_path / "out" / "ledger.sqlite")
    ledger.verify()
    assert ledger.num_releases() >= payload["rounds"]
