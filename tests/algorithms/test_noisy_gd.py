"""Noisy GD over users: noise calibrated to the user-level sensitivity, every round charged, converges."""

import math

import pytest
import torch

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
from fedkl.algorithms.nonprivate import nonprivate_minimizer
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, BudgetExhausted, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.problems import make_problem


def _setup(tmp_path, n_users=60, d=8, seed=0, eps=2.0, delta=1e-5):
    ds = load_dataset("synthetic-logistic", n_users=n_users, m=20, d=d, seed=seed)
    fed = InProcessFederation(make_problem("logistic", ds), ds)
    ledger = PrivacyLedger(tmp_path / f"ledger-{n_users}-{seed}-{eps}.sqlite", Budget(eps, delta))
    return ds, fed, ledger


class _Recorder(Releaser):
    """A Releaser that also keeps (exact value, released value) pairs for the calibration test."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.pairs = []

    def gaussian(self, value, **kw):
        out = super().gaussian(value, **kw)
        self.pairs.append((value.clone(), out.clone()))
        return out


@pytest.mark.parametrize("relation,factor", [("replace-one", 2.0), ("add-remove", 1.0)])
@pytest.mark.statistical
def test_noise_std_matches_user_level_sensitivity(tmp_path, relation, factor):
    ds, fed, ledger = _setup(tmp_path, d=150)
    rho, rounds, clip = ledger.budget.rho, 40, 0.7
    alg = NoisyGradientDescent(
        NoisyGDParams(rounds=rounds, lr=0.5, clip=clip), BuildContext.fresh(rho=rho, neighbouring=relation)
    )
    expected = factor * clip / math.sqrt(2 * rho / rounds)
    assert alg.sigma == pytest.approx(expected, rel=1e-12)
    rel = _Recorder(ledger, NoiseSource(11), ZCDPFilter(rho))
    alg.run(fed, rel, fed.problem.init_params())
    noise = torch.cat([(out - exact) for exact, out in rel.pairs])
    N = noise.numel()  # 40 rounds x 150 coordinates = 6,000 draws
    # std of the sample std of N normals ~ sigma / sqrt(2N) = 0.9% of sigma; allow 5 standard errors.
    tol = 5 / math.sqrt(2 * N)
    assert abs(float(noise.std()) / expected - 1) < tol
    # the wrong relation's scale (x2 or x0.5) is far outside the tolerance
    assert tol < 0.1
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(N)


def test_every_round_charged_to_every_user_and_budget_enforced(tmp_path):
    ds, fed, ledger = _setup(tmp_path)
    rho, rounds = ledger.budget.rho, 12
    alg = NoisyGradientDescent(NoisyGDParams(rounds=rounds, lr=1.0), BuildContext.fresh(rho=rho))
    alg.run(fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(rho)), fed.problem.init_params())
    assert ledger.num_releases() == rounds
    for uid in fed.user_ids:
        spend = ledger.spend(uid)
        assert spend.releases == rounds
        assert spend.rho == pytest.approx(rho, rel=1e-12)
    assert ledger.epsilon(fed.user_ids[0]) <= 2.0 * (1 + 1e-9)
    ledger.verify()
    # the budget is spent: one more run (a fresh filter, the same users) is refused by the ledger
    with pytest.raises(BudgetExhausted):
        NoisyGradientDescent(NoisyGDParams(rounds=1, lr=1.0), BuildContext.fresh(rho=rho)).run(
            fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(rho)), fed.problem.init_params()
        )
    assert ledger.num_releases() == rounds


def test_filter_stops_an_algorithm_that_overspends(tmp_path):
    ds, fed, ledger = _setup(tmp_path, eps=50.0)
    alg = NoisyGradientDescent(NoisyGDParams(rounds=10, lr=1.0), BuildContext.fresh(rho=0.1))
    with pytest.raises(BudgetExhausted):
        alg.run(fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(0.05)), fed.problem.init_params())
    assert ledger.num_releases() == 5  # the sixth release was refused before any charge


def _excess_risk(tmp_path, n_users, eps, seeds=4):
    out = []
    for s in range(seeds):
        ds, fed, ledger = _setup(tmp_path, n_users=n_users, seed=100 + s, eps=eps)
        w_opt = nonprivate_minimizer(fed.problem, ds.train)
        rho = ledger.budget.rho
        res = NoisyGradientDescent(NoisyGDParams(rounds=15, lr=4.0), BuildContext.fresh(rho=rho)).run(
            fed, Releaser(ledger, NoiseSource(s), ZCDPFilter(rho)), fed.problem.init_params()
        )
        out.append(fed.problem.loss(res.w, ds.train) - fed.problem.loss(w_opt, ds.train))
    return sum(out) / len(out)


def test_converges_and_error_falls_with_users_and_epsilon(tmp_path):
    tight = _excess_risk(tmp_path, n_users=400, eps=8.0)
    fewer_users = _excess_risk(tmp_path, n_users=40, eps=8.0)
    less_eps = _excess_risk(tmp_path, n_users=400, eps=0.5)
    assert tight < 0.05
    assert fewer_users > 2 * tight
    assert less_eps > 2 * tight


def test_round_sum_sensitivity_holds_on_adversarial_neighbours(dishonest_records):
    """||S(x) - S(x')|| <= 2C when one user's records are replaced (even by records far outside the
    feature bound), and <= C when one user is removed: the clip, not the data, bounds it."""
    from fedkl.data.base import FederatedDataset, UserData
    from fedkl.federation.base import ClippedGradient

    ds = load_dataset("synthetic-logistic", n_users=25, m=8, d=4, seed=5)
    problem = make_problem("logistic", ds)
    g = torch.Generator().manual_seed(0)
    clip = 0.3
    for trial in range(20):
        tr = ds.train
        mine = tr.user_index == 0
        X = tr.X.clone()
        X[mine] = torch.randn(int(mine.sum()), tr.dim, generator=g, dtype=torch.float64) * 1e3
        y = tr.y.clone()
        y[mine] = -y[mine]
        replaced = FederatedDataset("adv", UserData(X, y, tr.user_index, tr.user_ids), ds.test, "binary", 1.0, "adv")
        w = torch.randn(problem.num_params, generator=g, dtype=torch.float64) * 2
        s = InProcessFederation(problem, ds).sum(ClippedGradient(w, clip)).total()
        s_rep = InProcessFederation(problem, replaced).sum(ClippedGradient(w, clip)).total()
        s_del = InProcessFederation(problem, ds).sum(ClippedGradient(w, clip), list(range(1, 25))).total()
        assert float((s - s_rep).norm()) <= 2 * clip * (1 + 1e-12)
        assert float((s - s_del).norm()) <= clip * (1 + 1e-12)
