"""The drop-in for existing Flower apps (fedkl.flower.dropin.UserLevelDPStrategy): the example app of
simulations/flower_dropin_app.py on Flower's simulation engine charges every node's user in fedkl's
ledger before each noisy aggregate, with the stated noise scale; server-side clipping bounds a
misbehaving client; a second run on a spent ledger is refused before any noise is drawn."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from scipy.stats import chi2

from fedkl.experiments.report import load_function
from fedkl.flower.dropin import UserLevelDPStrategy
from fedkl.flower.localgrid import LocalGrid
from fedkl.privacy import Budget, BudgetExceeded, PrivacyLedger, Releaser

# the example app, loaded by path (the library and tests never import simulations/ as a package)
run_example_app = load_function(str(Path(__file__).resolve().parents[2] / "simulations" / "flower_dropin_app.py:run"))

pytestmark = pytest.mark.flower


def _record_gaussians(monkeypatch) -> list:
    """Every Releaser.gaussian call: (value, released, sensitivity, rho)."""
    calls: list = []
    original = Releaser.gaussian

    def spy(self, value, *, sensitivity, rho, **kw):
        out = original(self, value, sensitivity=sensitivity, rho=rho, **kw)
        calls.append((value.clone(), out.clone(), sensitivity, rho))
        return out

    monkeypatch.setattr(Releaser, "gaussian", spy)
    return calls


def test_example_app_on_flower_simulation_charges_the_ledger_with_the_stated_noise(tmp_path, monkeypatch):
    nodes, rounds, eps, clip = 6, 3, 2.0, 1.0
    delta = 1.0 / nodes**1.1
    calls = _record_gaussians(monkeypatch)
    ledger = str(tmp_path / "ledger.sqlite")
    out = run_example_app(nodes, rounds, eps, ledger, clip=clip, noise_seed=11)
    assert len(out["nodes"]) == nodes and len(calls) == rounds

    rho_round = Budget(eps, delta).rho / rounds
    sigma = 2 * clip / math.sqrt(2 * rho_round)  # replace-one: one user's update replaced
    with PrivacyLedger(ledger) as led:
        led.verify()
        releases = led.releases()
        assert [r["label"] for r in releases] == [f"flower-dropin/round-{t}" for t in range(1, rounds + 1)]
        for r in releases:
            assert r["mechanism"] == "gaussian" and r["sensitivity"] == 2 * clip
            assert r["noise_scale"] == pytest.approx(sigma, rel=1e-12) and r["rho"] == pytest.approx(rho_round)
            assert r["users"] == nodes
        for n in out["nodes"]:
            spend = led.spend(f"node-{n}")
            assert spend.releases == rounds and spend.rho == pytest.approx(Budget(eps, delta).rho)
            assert spend.epsilon(delta) <= eps + 1e-9
    # the noise drawn has the ledger's scale: sum of squares / sigma^2 ~ chi2(rounds * dim)
    noise = np.concatenate([(released - value).numpy() for value, released, _, _ in calls])
    k = noise.size
    stat = float((noise**2).sum()) / sigma**2
    assert chi2.ppf(1e-6, k) < stat < chi2.ppf(1 - 1e-6, k)
    # each round's exact sum is of clipped updates, and the released model is the noisy mean steps
    assert all(float(value.norm()) <= nodes * clip * (1 + 1e-12) for value, _, _, _ in calls)
    expected = sum(released.numpy() for _, released, _, _ in calls) / nodes
    np.testing.assert_allclose(out["w"], expected, rtol=1e-12, atol=1e-12)


def _app(bad_partition: int | None = None) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        w = msg.content["arrays"]["w"].numpy().copy()
        pid = context.node_config["partition-id"]
        w += 1e6 if pid == bad_partition else 0.01 * (pid + 1)
        content = RecordDict({"arrays": ArrayRecord({"w": Array(w)}), "metrics": MetricRecord({"num-examples": 1})})
        if pid == 1:  # another node replies with garbage: it contributes zero
            content = RecordDict({"arrays": ArrayRecord({"v": Array(np.zeros(3))}), "metrics": MetricRecord({})})
        return Message(content, reply_to=msg)

    return app


def _strategy(ledger: str, **kw) -> UserLevelDPStrategy:
    return UserLevelDPStrategy(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0),
        ledger_path=ledger,
        epsilon=1.0,
        delta=1e-3,
        clip=0.5,
        rounds=2,
        noise_seed=3,
        **kw,
    )


def test_server_side_clip_bounds_a_misbehaving_client_and_a_spent_ledger_refuses_before_noise(tmp_path, monkeypatch):
    calls = _record_gaussians(monkeypatch)
    ledger = str(tmp_path / "l.sqlite")
    strategy = _strategy(ledger)
    grid = LocalGrid(_app(bad_partition=0), 4)
    strategy.start(grid, ArrayRecord({"w": Array(np.zeros(3))}), num_rounds=2, train_config=ConfigRecord())
    strategy.close()
    assert len(calls) == 2
    for value, _, sensitivity, _ in calls:
        # node 0's 1e6 update is clipped to 0.5, node 1's garbage is zero, nodes 2 and 3 move by 0.03/0.04
        expected = 0.5 * np.ones(3) / math.sqrt(3) + 0.03 + 0.04
        np.testing.assert_allclose(value.numpy(), expected, rtol=1e-12)
        assert sensitivity == 1.0

    with pytest.raises(BudgetExceeded):  # every user's budget is spent: the first release is refused, nothing drawn
        with _strategy(ledger) as again:
            again.start(grid, ArrayRecord({"w": Array(np.zeros(3))}), num_rounds=1, train_config=ConfigRecord())
    assert len(calls) == 2
    with PrivacyLedger(ledger) as led:
        assert [r["status"] for r in led.runs()] == ["finished", "refused"]


def test_wrapper_refuses_bad_settings_and_keeps_evaluation_out_unless_asked(tmp_path):
    with pytest.raises(ValueError, match="clip"):
        UserLevelDPStrategy(FedAvg(), ledger_path=str(tmp_path / "a.sqlite"), epsilon=1, delta=1e-3, clip=0, rounds=1)
    s = _strategy(str(tmp_path / "b.sqlite"))
    assert s.configure_evaluate(1, ArrayRecord(), ConfigRecord(), LocalGrid(_app(), 2)) == []
    s.close()
