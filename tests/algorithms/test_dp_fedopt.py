"""DP-FedAdam / DP-FedYogi (fedkl/algorithms/gradient/dp_fedopt.py): DP-FedAvg's releases and charges
exactly (the server optimizer is post-processing), the noise at the calibrated scale, the server update
equal to Adam's / Yogi's step written out by hand on the recorded noisy aggregates, refusals of
DP-FedAvg's own server settings, and a short run that learns."""

import math

import pytest
import torch
from release_spies import record_schedule_releases

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.dp_fedavg import DPFedAvg, DPFedAvgParams
from fedkl.algorithms.gradient.dp_fedopt import DPFedAdam, DPFedOptParams, DPFedYogi
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy.accounting import noise_multiplier_for
from fedkl.problems import make_problem

ADAPTIVE = (DPFedAdam, DPFedYogi)
COMMON = dict(rounds=20, clip=0.5, sampling_rate=0.5, local_steps=2, local_lr=0.5, accountant="rdp")


def _run(tmp_path, cls, params, name, n_users=20, d=50, neighbouring="add-remove", noise_seed=0):
    ds = load_dataset("synthetic-logistic", n_users=n_users, m=6, d=d, seed=0)
    fed = InProcessFederation(make_problem("logistic", ds), ds)
    ledger = PrivacyLedger(tmp_path / f"{name}.sqlite", Budget(2.0, 1e-5))
    eps, delta = ledger.approx_left(fed.user_ids)
    ctx = BuildContext.fresh(eps=eps, delta=delta, user_ids=fed.user_ids, neighbouring=neighbouring)
    alg = cls(cls.Params(**params), ctx)
    res = alg.run(fed, Releaser(ledger, NoiseSource(noise_seed)), fed.problem.init_params())
    return fed, ledger, res


@pytest.mark.statistical
@pytest.mark.parametrize("cls", ADAPTIVE)
def test_noise_scale_and_charges_are_dp_fedavgs(tmp_path, monkeypatch, cls):
    """The same schedule (z from dp-accounting, sigma = z C under add-remove), the same ledger row but
    for its label, the same first release (same w0 and noise seed); and the noise drawn has std sigma:
    20 rounds x 50 coordinates, 5 standard errors (11%), far inside the x2 of a replace-one scale."""
    pairs = record_schedule_releases(monkeypatch)
    _, ledger, res = _run(tmp_path, cls, {**COMMON, "server_eta": 0.1}, "adaptive")
    adaptive_pairs = list(pairs)
    pairs.clear()
    _, ledger_avg, avg = _run(tmp_path, DPFedAvg, COMMON, "fedavg")
    z = noise_multiplier_for(2.0, 1e-5, 0.5, 20, "rdp")
    assert res.noise_multiplier == avg.noise_multiplier == pytest.approx(z, rel=1e-9)
    assert res.sigma == avg.sigma == pytest.approx(z * 0.5, rel=1e-9)  # add-remove: Delta = C
    assert (res.epsilon, res.delta) == (avg.epsilon, avg.delta)
    (row,), (row_avg,) = ledger.releases(), ledger_avg.releases()
    for key in ("mechanism", "eps", "delta", "sensitivity", "noise_scale", "users"):
        assert row[key] == row_avg[key], key
    assert row["sensitivity"] == pytest.approx(0.5) and row["label"] == f"{cls.name}/schedule"
    assert torch.equal(adaptive_pairs[0][1], pairs[0][1])  # round 1: the same release
    noise = torch.cat([out - value for value, out in adaptive_pairs])
    assert noise.numel() == 20 * 50
    assert abs(float(noise.std()) / res.sigma - 1) < 5 / math.sqrt(2 * noise.numel())
    ledger.verify()


def _hand(w0, deltas, eta, b1, b2, tau, yogi):
    """Reddi et al.'s Algorithm 2 from the released mean updates, coordinate by coordinate in floats;
    also how often Yogi's sign(v - Delta^2) was +1 and -1."""
    w, m, v = list(map(float, w0)), [0.0] * len(w0), [tau * tau] * len(w0)
    signs = {1: 0, -1: 0}
    for delta in deltas:
        for j, dj in enumerate(map(float, delta)):
            m[j] = b1 * m[j] + (1 - b1) * dj
            if yogi:
                s = (v[j] > dj * dj) - (v[j] < dj * dj)
                signs[s] = signs.get(s, 0) + 1
                v[j] = v[j] - (1 - b2) * dj * dj * s
            else:
                v[j] = b2 * v[j] + (1 - b2) * dj * dj
            w[j] += eta * m[j] / (math.sqrt(v[j]) + tau)
    return torch.tensor(w, dtype=torch.float64), signs


@pytest.mark.parametrize("cls", ADAPTIVE)
def test_server_update_is_the_hand_computed_step_on_the_recorded_aggregates(tmp_path, monkeypatch, cls):
    """w_T rebuilt by hand from the run's own released sums / (q n): Adam's or Yogi's step, and not the
    other's (beta2 = 0.5, tau = 0.05: Yogi's sign takes both values, and the two rules differ)."""
    eta, b1, b2, tau = 0.2, 0.7, 0.5, 0.05
    params = dict(COMMON, rounds=8, server_eta=eta, server_beta1=b1, server_beta2=b2, server_tau=tau)
    pairs = record_schedule_releases(monkeypatch)
    fed, _, res = _run(tmp_path, cls, params, "hand", d=6)
    deltas = [out / (0.5 * fed.num_users) for _, out in pairs]
    assert len(deltas) == 8 and res.details["fixed_denominator"] == 0.5 * fed.num_users
    w0 = fed.problem.init_params()
    mine, signs = _hand(w0, deltas, eta, b1, b2, tau, yogi=cls is DPFedYogi)
    other, _ = _hand(w0, deltas, eta, b1, b2, tau, yogi=cls is DPFedAdam)
    assert torch.allclose(res.w, mine, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(res.w, other, rtol=1e-6, atol=1e-9)
    if cls is DPFedYogi:
        assert signs[1] > 0 and signs[-1] > 0
    assert res.details["server_optimizer"] == cls.name.removeprefix("dp-fed")
    assert res.details["server_eta"] == eta and "server_momentum" not in res.details


def test_dp_fedavgs_own_server_step_and_bad_moments_are_refused():
    for kw, msg in [
        ({"server_lr": 0.5}, "--server-lr and --server-momentum"),
        ({"server_momentum": 0.9}, "--server-lr and --server-momentum"),
        ({"server_beta1": 1.0}, "--server-beta1 must be in"),
        ({"server_beta2": -0.1}, "--server-beta2 must be in"),
        ({"server_tau": 0.0}, "--server-tau must be > 0"),
        ({"server_eta": float("inf")}, "--server-eta must be > 0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            DPFedOptParams(**kw)
    # DP-FedAvg's settings and checks are inherited, not copied
    assert issubclass(DPFedOptParams, DPFedAvgParams) and issubclass(DPFedYogi, DPFedAvg)
    with pytest.raises(ValueError, match="--sampling-rate"):
        DPFedOptParams(sampling_rate=0.0)


@pytest.mark.parametrize("name", ["dp-fedadam", "dp-fedyogi"])
def test_a_short_run_learns_on_synthetic_logistic(tmp_path, name):
    """`fedkl run`'s path at its defaults (10 rounds, eta 0.01) on 200 users at eps 2: the released model
    beats the trivial baseline (measured: 0.64-0.67 test accuracy against 0.49-0.53)."""
    from fedkl.runner import RunConfig, run_training

    cfg = RunConfig.from_settings(strict=False, dataset="synthetic-logistic", problem="logistic", algorithm=name,
                                  epsilon=2.0, neighbouring="add-remove", seed=0, noise_seed=0, reference=False,
                                  force=True, out=str(tmp_path / "run"))  # fmt: skip
    res = run_training(cfg, log=lambda s: None)
    assert res["test_metrics"]["accuracy"] > res["trivial_baseline"]["accuracy"] + 0.05
