"""The drop-in for existing Flower apps (fedkl.flower.dropin.UserLevelDPStrategy): the example app of
simulations/flower_dropin_app.py on Flower's simulation engine charges every node's user in fedkl's
ledger before each noisy aggregate, with the stated noise scale; server-side clipping bounds a
misbehaving client; a second run on a spent ledger is refused before any noise is drawn; a user is the id
its node declares (never the transport's node id), so the same people across runs compose on one ledger."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from scipy.stats import chi2

from fedkl.experiments.report import load_function
from fedkl.flower.dropin import UserLevelDPStrategy, declare_user
from fedkl.flower.localgrid import LocalGrid
from fedkl.privacy import Budget, BudgetExceeded, PrivacyLedger, Releaser

# the example app, loaded by path (the library and tests never import simulations/ as a package)
run_example_app = load_function(str(Path(__file__).resolve().parents[2] / "simulations" / "flower_dropin_app.py:run"))
example = sys.modules[run_example_app.__module__]

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
    import ray.cloudpickle

    # Ray's workers cannot import a module loaded by path: its ClientApp travels by value (else every node fails)
    ray.cloudpickle.register_pickle_by_value(example)
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
        # each node's user is the id its ClientApp declares (the owner of partition p), never the node id
        assert sorted(r["user_id"] for r in led.user_spends()) == sorted(f"user-{p}" for p in range(nodes))
        for p in range(nodes):
            spend = led.spend(f"user-{p}")
            assert spend.releases == rounds and spend.rho == pytest.approx(Budget(eps, delta).rho)
            assert spend.epsilon(delta) <= eps + 1e-9
    # the noise drawn has the ledger's scale: sum of squares / sigma^2 ~ chi2(rounds * dim)
    noise = np.concatenate([(released - value).numpy() for value, released, _, _ in calls])
    k = noise.size
    stat = float((noise**2).sum()) / sigma**2
    assert chi2.ppf(1e-6, k) < stat < chi2.ppf(1 - 1e-6, k)
    # each round's exact sum is the sum of every node's clipped update from the model it was sent (every node
    # trained: none failed), and each round's model is the previous one plus the noisy mean
    w = np.zeros(example.DIM)
    for value, released, _, _ in calls:
        updates = [example.local_model(w, p) - w for p in range(nodes)]
        expected = sum(u * min(1.0, clip / np.linalg.norm(u)) for u in updates)
        np.testing.assert_allclose(value.numpy(), expected, rtol=1e-9, atol=1e-12)
        w = w + released.numpy() / nodes
    np.testing.assert_allclose(out["w"], w, rtol=1e-12, atol=1e-12)


def _app(bad_partition: int | None = None, *, declare: bool = True, trained: list | None = None) -> ClientApp:
    """Nodes move ``w`` by 0.01 (partition + 1); ``declare``: the node answers the strategy's handshake with
    its node config's ``user-id`` (:func:`declare_user`); ``trained`` collects the partitions that trained."""
    app = ClientApp()
    if declare:
        declare_user(app)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        w = msg.content["arrays"]["w"].numpy().copy()
        pid = context.node_config["partition-id"]
        if trained is not None:
            trained.append(pid)
        w += 1e6 if pid == bad_partition else 0.01 * (pid + 1)
        content = RecordDict({"arrays": ArrayRecord({"w": Array(w)}), "metrics": MetricRecord({"num-examples": 1})})
        if pid == 1:  # another node replies with garbage: it contributes zero
            content = RecordDict({"arrays": ArrayRecord({"v": Array(np.zeros(3))}), "metrics": MetricRecord({})})
        return Message(content, reply_to=msg)

    return app


def _strategy(ledger: str, rounds: int = 2, **kw) -> UserLevelDPStrategy:
    return UserLevelDPStrategy(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0),
        ledger_path=ledger,
        epsilon=1.0,
        delta=1e-3,
        clip=0.5,
        rounds=rounds,
        noise_seed=3,
        **kw,
    )


PEOPLE = {p: {"user-id": f"person-{p}"} for p in range(4)}  # node config: each node declares its person


def _w0() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(3))})


def test_server_side_clip_bounds_a_misbehaving_client_and_a_spent_ledger_refuses_before_noise(tmp_path, monkeypatch):
    calls = _record_gaussians(monkeypatch)
    ledger = str(tmp_path / "l.sqlite")
    strategy = _strategy(ledger)
    grid = LocalGrid(_app(bad_partition=0), 4, node_config=PEOPLE)
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


def test_the_same_people_across_runs_are_the_same_ledger_users_with_composed_epsilon(tmp_path, monkeypatch):
    calls = _record_gaussians(monkeypatch)
    ledger = str(tmp_path / "l.sqlite")
    node_ids: list[int] = []
    for run in (1, 2):  # two runs: the same 4 people behind other (random) node ids, as Flower's simulation draws them
        grid = LocalGrid(_app(), 4, run_id=run, node_config=PEOPLE)
        node_ids += grid.get_node_ids()
        with _strategy(ledger, rounds=4) as s:
            s.start(grid, _w0(), num_rounds=2, train_config=ConfigRecord())
    assert len(set(node_ids)) == 8 and len(calls) == 4
    with PrivacyLedger(ledger) as led:
        spends = led.user_spends()
        assert sorted(r["user_id"] for r in spends) == [f"person-{p}" for p in range(4)]
        for r in spends:  # 2 + 2 releases: the two runs composed, the whole budget of rounds=4 spent
            assert r["releases"] == 4 and r["rho"] == pytest.approx(Budget(1.0, 1e-3).rho)
        assert not any(str(n) in r["user_id"] for n in node_ids for r in spends)  # no transport id is a user
    # a third run (new node ids again) finds every person's budget spent: refused before any noise is drawn
    with pytest.raises(BudgetExceeded):
        with _strategy(ledger, rounds=4) as s:
            s.start(
                LocalGrid(_app(), 4, run_id=3, node_config=PEOPLE), _w0(), num_rounds=1, train_config=ConfigRecord()
            )
    assert len(calls) == 4


@pytest.mark.parametrize("declare, node_config", [(False, PEOPLE), (True, None)], ids=["no-handler", "no-user-id"])
def test_a_run_without_declared_user_ids_is_refused_before_any_charge(tmp_path, monkeypatch, declare, node_config):
    calls = _record_gaussians(monkeypatch)
    ledger, trained = str(tmp_path / "l.sqlite"), []
    grid = LocalGrid(_app(declare=declare, trained=trained), 4, node_config=node_config)
    with pytest.raises(RuntimeError, match="user id") as err:
        with _strategy(ledger) as s:
            s.start(grid, _w0(), num_rounds=2, train_config=ConfigRecord())
    assert "\n" not in str(err.value)
    assert calls == [] and trained == []  # nothing charged, drawn or even sent for training
    with PrivacyLedger(ledger) as led:
        assert led.num_releases() == 0 and led.user_spends() == []
        assert [r["status"] for r in led.runs()] == ["refused"]  # ended before any release


def test_a_node_with_a_missing_duplicated_or_unenrolled_user_id_is_refused_alone(tmp_path, monkeypatch):
    calls = _record_gaussians(monkeypatch)
    ledger, trained = str(tmp_path / "l.sqlite"), []
    ids = {0: "ann", 1: None, 2: "bob", 3: "bob", 4: "eve", 5: "cat"}  # 1 declares none, 2 and 3 both bob
    config = {p: ({"user-id": u} if u else {}) for p, u in ids.items()}
    grid = LocalGrid(_app(trained=trained), 6, node_config=config)
    with _strategy(ledger, enrolment=["ann", "bob", "cat", "dan"]) as s:  # eve is not enrolled
        s.start(grid, _w0(), num_rounds=2, train_config=ConfigRecord())
        refused = {grid.partition_of[n]: why for n, why in s.refused.items()}
    # only ann's and cat's nodes are sent the model; the others never train, nobody is renamed
    assert sorted(trained) == [0, 0, 5, 5] and len(calls) == 2
    assert sorted(refused) == [1, 2, 3, 4]
    assert "user id" in refused[1] and "bob" in refused[2] and "bob" in refused[3] and "enrolment" in refused[4]
    with PrivacyLedger(ledger) as led:
        assert sorted(r["user_id"] for r in led.user_spends()) == ["ann", "cat"]
        assert [r["users"] for r in led.releases()] == [2, 2]


def test_start_ends_the_ledger_run_says_the_privacy_line_and_keeps_the_apps_dtypes(tmp_path, monkeypatch):
    """The drop-in's start() is one ledger run: ended "finished" when it returns (the app need not close
    it), its user-level epsilon and delta said in one line as fedkl run says them, and the model it returns
    has the app's dtypes (a float32 model stays float32: half the size of float64)."""
    said: list[str] = []
    import flwr.supercore

    monkeypatch.setattr(flwr.supercore, "log", lambda level, msg, *a: said.append(msg % a if a else msg))
    ledger = str(tmp_path / "l.sqlite")
    s = _strategy(ledger)
    w0 = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})
    result = s.start(LocalGrid(_app(), 4, node_config=PEOPLE), w0, num_rounds=2, train_config=ConfigRecord())
    assert result.arrays["w"].numpy().dtype == np.float32
    with PrivacyLedger(ledger) as led:
        assert [r["status"] for r in led.runs()] == ["finished"] and led.num_releases() == 2
        spends = led.user_spends()
    line = f"privacy: user-level (replace-one) epsilon = {max(r['epsilon_exact'] for r in spends):.4f}, delta = 0.001"
    assert s.privacy_line.startswith(line) and s.privacy_line in said and "\n" not in s.privacy_line
    assert s.epsilon_spent("person-2") == max(r["epsilon"] for r in spends)  # read from the ledger after the run
