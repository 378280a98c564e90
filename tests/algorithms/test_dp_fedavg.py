"""DP-FedAvg (the TFF recipe, McMahan et al. 2018) at user level: the clipped local-update query,
calibration and up-front charge, noise std, refusals, and convergence."""

import math

import pytest
import torch
from release_spies import record_schedule_releases

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.dp_fedavg import DPFedAvg, DPFedAvgParams
from fedkl.data import load_dataset
from fedkl.federation.base import ClippedLocalUpdate
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, BudgetExceeded, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy.accounting import GaussianSchedule, schedule_epsilon
from fedkl.problems import make_problem


def _alg(eps, delta, user_ids=(), neighbouring="add-remove", **params):
    """dp-fedavg built for the (eps, delta) left (``params``: DPFedAvgParams)."""
    ctx = BuildContext.fresh(eps=eps, delta=delta, user_ids=user_ids, neighbouring=neighbouring)
    return DPFedAvg(DPFedAvgParams(**params), ctx)


def _fed(name="synthetic-logistic", problem="logistic", n_users=30, m=7, d=4, seed=0, reg=0.0):
    ds = load_dataset(name, n_users=n_users, m=m, d=d, seed=seed)
    return ds, InProcessFederation(make_problem(problem, ds, reg=reg), ds)


def _local_sgd(problem, one_user, w, steps, lr, batch):
    """The query's definition, written out for one user: cyclic mini-batches in record order."""
    m = one_user.num_records
    for k in range(steps):
        keep = torch.arange(m)
        if batch is not None and batch < m:
            keep = torch.tensor([(k * batch + j) % m for j in range(batch)])
        part = type(one_user)(one_user.X[keep], one_user.y[keep], one_user.user_index[keep], one_user.user_ids)
        w = w - lr * problem.per_user_gradients(w, part)[0]
    return w


@pytest.mark.parametrize(
    "name,problem", [("synthetic-logistic", "logistic"), ("synthetic-least-squares", "least-squares")]
)
@pytest.mark.parametrize("batch", [None, 3])
def test_local_update_query_is_the_definition_and_clipped(name, problem, batch):
    ds, fed = _fed(name, problem, reg=0.05)
    w = torch.linspace(-0.5, 0.5, ds.train.dim, dtype=torch.float64)
    users = [0, 3, 7, 12]
    clip = 0.05
    ans = fed.compute(ClippedLocalUpdate(w, clip, local_steps=4, local_lr=0.3, batch_size=batch), users)
    assert not ans.failed
    for row, u in zip(ans.values, users):
        raw = _local_sgd(fed.problem, ds.train.subset([u]), w.clone(), 4, 0.3, batch) - w
        expected = raw * min(1.0, clip / float(raw.norm()))
        assert torch.allclose(row, expected, rtol=1e-10, atol=1e-13)
        assert float(row.norm()) <= clip * (1 + 1e-12)


def test_bad_local_update_queries_are_refused():
    w = torch.zeros(3, dtype=torch.float64)
    for kw, msg in [
        ({"local_steps": 0}, "local_steps"),
        ({"local_lr": float("nan")}, "local_lr"),
        ({"batch_size": 0}, "batch_size"),
        ({"clip": -1.0}, "clip"),
    ]:
        args = {"clip": 1.0, **kw}
        with pytest.raises(ValueError, match=msg):
            ClippedLocalUpdate(w, **args)
    with pytest.raises(ValueError, match="add-remove"):
        _alg(1.0, 1e-5, sampling_rate=0.5, neighbouring="replace-one")
    for kw, msg in [
        ({"local_steps": 0}, "--local-steps"),
        ({"local_lr": float("nan")}, "--local-lr"),
        ({"batch_size": 0}, "--batch-size"),
        ({"server_lr": 0.0}, "--server-lr"),
        ({"server_momentum": 1.0}, "--server-momentum"),
        ({"sampling_rate": 0.0}, "--sampling-rate"),
    ]:
        with pytest.raises(ValueError, match=msg):
            DPFedAvgParams(**kw)


def _run(tmp_path, cfg, eps=2.0, delta=1e-5, noise_seed=0, **fed_kw):
    ds, fed = _fed(**fed_kw)
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(eps, delta))
    alg = _alg(*ledger.approx_left(fed.user_ids), user_ids=fed.user_ids, **cfg)
    res = alg.run(fed, Releaser(ledger, NoiseSource(noise_seed)), fed.problem.init_params())
    return ds, fed, ledger, res


def test_calibrated_by_dp_accounting_and_charged_up_front(tmp_path):
    cfg = dict(rounds=8, clip=1.0, sampling_rate=0.4, local_steps=2, local_lr=0.5, accountant="rdp")
    ds, fed, ledger, res = _run(tmp_path, cfg)
    eps = schedule_epsilon(GaussianSchedule(res.noise_multiplier, 0.4, 8), res.delta, "rdp")
    assert res.epsilon == pytest.approx(eps, rel=1e-12) and eps <= 2.0 and eps == pytest.approx(2.0, rel=1e-3)
    assert res.sigma == pytest.approx(res.noise_multiplier * cfg["clip"], rel=1e-12)  # add-remove: Delta = C
    rows = ledger.releases()
    assert len(rows) == 1 and rows[0]["mechanism"] == "gaussian-schedule" and rows[0]["users"] == 30
    assert rows[0]["sensitivity"] == pytest.approx(cfg["clip"])
    ledger.verify()
    assert res.details["fixed_denominator"] == pytest.approx(0.4 * 30)
    # the budget is spent: a second run on the same ledger is refused before anything is released
    with pytest.raises((BudgetExceeded, ValueError)):
        _alg(*ledger.approx_left(fed.user_ids), **cfg).run(
            fed, Releaser(ledger, NoiseSource(1)), fed.problem.init_params()
        )
    assert len(ledger.releases()) == 1


@pytest.mark.statistical
def test_noise_std_matches_sigma(tmp_path, monkeypatch):
    """Every release's noise (released value minus the exact sum it was given) has std sigma =
    z * 2C (replace-one) within 5 standard errors."""
    pairs = record_schedule_releases(monkeypatch)
    cfg = dict(
        rounds=40,
        clip=1.0,
        sampling_rate=1.0,
        local_steps=1,
        local_lr=0.1,
        neighbouring="replace-one",
        accountant="rdp",
    )
    ds, fed, ledger, res = _run(tmp_path, cfg, d=50, n_users=20)
    assert res.sigma == pytest.approx(2 * res.noise_multiplier * cfg["clip"])  # replace-one: Delta = 2C
    noise = torch.cat([o - v for v, o in pairs])
    assert len(pairs) == 40
    assert abs(float(noise.std()) / res.sigma - 1) < 5 / math.sqrt(2 * noise.numel())


def test_converges_with_a_large_budget(tmp_path):
    cfg = dict(
        rounds=40,
        sampling_rate=1.0,
        local_steps=5,
        local_lr=0.5,
        clip=10.0,
        neighbouring="replace-one",
        accountant="rdp",
    )
    ds, fed, ledger, res = _run(
        tmp_path, cfg, eps=700.0, delta=1e-5, name="synthetic-least-squares", problem="least-squares", n_users=200, d=3
    )
    from fedkl.algorithms.nonprivate import nonprivate_minimizer

    w_star = nonprivate_minimizer(fed.problem, ds.train)
    loss = fed.problem.loss  # mean of the users' objectives
    start = float(loss(fed.problem.init_params(), ds.train))
    end, best = float(loss(res.w, ds.train)), float(loss(w_star, ds.train))
    assert end - best < 0.02 * (start - best)
