"""User-level DP-SGD / DP-RMSProp / DP-Adam (paper 004): calibration, sampling, charging, convergence."""

import math

import pytest
import torch
from release_spies import record_schedule_releases

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.dp_adaptive import OPTIMIZERS, AdaptiveDPParams
from fedkl.algorithms.nonprivate import nonprivate_minimizer
from fedkl.algorithms.registry import algorithm_spec
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, BudgetExhausted, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.accounting import GaussianSchedule, schedule_epsilon
from fedkl.privacy.release import ScheduledGaussian
from fedkl.problems import make_problem


def _fed(n_users=80, d=6, seed=0):
    ds = load_dataset("synthetic-logistic", n_users=n_users, m=20, d=d, seed=seed)
    return ds, InProcessFederation(make_problem("logistic", ds), ds)


def _opt(optimizer, eps, delta, user_ids=(), neighbouring="add-remove", **params):
    """dp-<optimizer> built for the (eps, delta) left (``params``: its Params)."""
    cls = OPTIMIZERS[optimizer]
    ctx = BuildContext.fresh(eps=eps, delta=delta, user_ids=user_ids, neighbouring=neighbouring)
    return cls(cls.Params(**params), ctx)


def _run(tmp_path, cfg, eps=2.0, delta=1e-5, n_users=80, d=6, seed=0, noise_seed=0, name="l"):
    ds, fed = _fed(n_users, d, seed)
    ledger = PrivacyLedger(tmp_path / f"{name}.sqlite", Budget(eps, delta))
    e, dl = ledger.approx_left(fed.user_ids)
    opt = _opt(**cfg, eps=e, delta=dl, user_ids=fed.user_ids)
    res = opt.run(fed, Releaser(ledger, NoiseSource(noise_seed)), fed.problem.init_params())
    return ds, fed, ledger, res


def test_schedule_is_calibrated_by_dp_accounting_and_charged_up_front(tmp_path):
    cfg = dict(optimizer="adam", rounds=12, lr=0.05, clip=1.0, sampling_rate=0.25)
    ds, fed, ledger, res = _run(tmp_path, cfg)
    # the charged eps is dp-accounting's PLD eps of exactly this schedule, and fits the budget
    eps = schedule_epsilon(GaussianSchedule(res.noise_multiplier, 0.25, 12), res.delta, "pld")
    assert res.epsilon == pytest.approx(eps, rel=1e-12)
    assert eps <= 2.0 and eps == pytest.approx(2.0, rel=1e-3)  # the noise is not wasted either
    assert res.sigma == pytest.approx(res.noise_multiplier * cfg["clip"], rel=1e-12)
    rows = ledger.releases()
    assert len(rows) == 1 and rows[0]["mechanism"] == "gaussian-schedule" and rows[0]["users"] == 80
    assert all(ledger.spend(u).epsilon(ledger.budget.delta) <= 2.0 * (1 + 1e-9) for u in fed.user_ids)
    ledger.verify()
    # nothing left: a second schedule on the same ledger is refused before any release
    assert ledger.approx_left(fed.user_ids)[0] < 1e-6


@pytest.mark.statistical
def test_noise_std_and_poisson_sampling_rate(tmp_path, monkeypatch):
    cfg = dict(optimizer="sgd", rounds=60, sampling_rate=0.3, lr=0.01, accountant="rdp")
    ds, fed = _fed(n_users=200, d=100)
    ledger = PrivacyLedger(tmp_path / "s.sqlite", Budget(4.0, 1e-5))
    opt = _opt(**cfg, eps=ledger.approx_left(fed.user_ids)[0], delta=ledger.approx_left(fed.user_ids)[1])
    releaser = Releaser(ledger, NoiseSource(5))
    pairs = record_schedule_releases(monkeypatch)
    res = opt.run(fed, releaser, fed.problem.init_params())
    noise = torch.cat([o - v for v, o in pairs])
    N = noise.numel()  # 60 x 100
    assert abs(float(noise.std()) / res.sigma - 1) < 5 / math.sqrt(2 * N)  # 5 standard errors (~4.6%)
    sampled = sum(h["sampled"] for h in res.history)
    trials = 200 * 60
    # Binomial(12000, 0.3): std = sqrt(12000 * 0.21) = 50; allow 5 std
    assert abs(sampled - 0.3 * trials) < 5 * math.sqrt(trials * 0.3 * 0.7)


@pytest.mark.parametrize("optimizer", ["sgd", "rmsprop", "adam"])
def test_converges_at_large_epsilon(tmp_path, optimizer):
    lr = {"sgd": 4.0, "rmsprop": 0.05, "adam": 0.05}[optimizer]
    cfg = dict(optimizer=optimizer, rounds=60, lr=lr, sampling_rate=1.0, accountant="rdp")
    ds, fed, ledger, res = _run(tmp_path, cfg, eps=50.0, n_users=300, name=optimizer)
    w_opt = nonprivate_minimizer(fed.problem, ds.train)
    excess = fed.problem.loss(res.w, ds.train) - fed.problem.loss(w_opt, ds.train)
    start = fed.problem.loss(fed.problem.init_params(), ds.train) - fed.problem.loss(w_opt, ds.train)
    assert excess < 0.1 * start


def test_error_grows_as_epsilon_shrinks(tmp_path):
    def excess(eps):
        out = []
        for s in range(3):
            cfg = dict(optimizer="adam", rounds=30, lr=0.05, sampling_rate=1.0, accountant="rdp")
            ds, fed, ledger, res = _run(
                tmp_path, cfg, eps=eps, n_users=150, seed=10 + s, noise_seed=s, name=f"e{eps}-{s}"
            )
            w_opt = nonprivate_minimizer(fed.problem, ds.train)
            out.append(fed.problem.loss(res.w, ds.train) - fed.problem.loss(w_opt, ds.train))
        return sum(out) / len(out)

    assert excess(0.3) > 2 * excess(8.0)


def test_bias_correction_is_a_flag_that_changes_the_update(tmp_path):
    plain = _run(tmp_path, dict(optimizer="adam", rounds=3, lr=0.05, accountant="rdp"), name="a")[3]
    corrected = _run(
        tmp_path, dict(optimizer="adam", rounds=3, lr=0.05, bias_correction=True, accountant="rdp"), name="b"
    )[3]
    assert plain.details["bias_correction"] is False and corrected.details["bias_correction"] is True
    assert not torch.allclose(plain.w, corrected.w)


def test_bad_configurations_and_refusals(tmp_path):
    with pytest.raises(ValueError, match="add-remove"):
        _opt("adam", 1.0, 1e-5, sampling_rate=0.5, neighbouring="replace-one")
    with pytest.raises(ValueError, match="unknown algorithm"):
        algorithm_spec("dp-lion")
    with pytest.raises(ValueError, match="--beta2 must be in"):
        AdaptiveDPParams(beta2=1.0)
    with pytest.raises(ValueError, match="--sampling-rate must be in"):
        AdaptiveDPParams(sampling_rate=1.5)
    ds, fed = _fed()
    ledger = PrivacyLedger(tmp_path / "z.sqlite", Budget(1.0, 1e-5))
    opt = _opt("adam", 1.0, 1e-5 * 0.5, rounds=2, lr=0.05)
    with pytest.raises(ValueError, match="zCDP filter"):  # an (eps, delta) schedule cannot go through a filter
        opt.run(fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(0.1)), fed.problem.init_params())
    assert ledger.num_releases() == 0
    with pytest.raises(BudgetExhausted):  # more than the budget: refused, nothing released
        _opt("adam", 1.5, 1e-5 * 0.5, rounds=2, lr=0.05).run(
            fed, Releaser(ledger, NoiseSource(0)), fed.problem.init_params()
        )
    assert ledger.num_releases() == 0
    handle = ScheduledGaussian(1.0, 2, NoiseSource(0), "t")
    handle.release(torch.zeros(3))
    handle.release(torch.zeros(3))
    with pytest.raises(BudgetExhausted):
        handle.release(torch.zeros(3))
    with pytest.raises(ValueError):
        ScheduledGaussian(1.0, 2, NoiseSource(0), "t").release(torch.tensor([float("nan")]))
