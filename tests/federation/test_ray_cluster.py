"""``--backend ray-shards --ray-address`` on a real (local) Ray cluster: a head and a worker raylet
started here (simulations/ray_cluster.py, loaded by path), a noisy-gd run whose worker raylet is
SIGKILLed mid-run, after the first release is in the ledger. The run finishes: the shard that lived on
the killed node fails its users for that request (charged like every asked user, rows zero, the
reason saved in result.json's ``failures``), Ray restarts it on the head (which has a free
``fedkl_shards`` unit), it loads its block again and answers the next request; ``fedkl ledger
verify`` passes and the ledger equals an in-process run's (the failed users were charged).

Every wait is on an event (the head's address file, the GCS listing the nodes alive or the killed one
dead, the ledger holding a release), and the cluster's processes are ended by id even when the test
fails. Cost: ~1-2 min on a loaded 2-core machine (two raylets start), so marked ``cluster``, which
``make test`` leaves out; ``make ray-cluster-test`` runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from fedkl.cli import main as fedkl_main  # noqa: E402
from fedkl.federation.ray_shards import RayShardFederation  # noqa: E402
from fedkl.flower.backends import load_shard_data  # noqa: E402, F401  (registers ray-shards)
from fedkl.privacy import PrivacyLedger  # noqa: E402
from fedkl.runner import RunConfig, load_run_data, run_training  # noqa: E402

pytestmark = [pytest.mark.flower, pytest.mark.cluster]

# loaded by path (the library and tests never import simulations/ as a package)
_spec = importlib.util.spec_from_file_location(
    "ray_cluster", Path(__file__).resolve().parents[2] / "simulations" / "ray_cluster.py"
)
ray_cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ray_cluster)


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # another module's local instance: this module connects to its own cluster
        ray.shutdown()
    c = ray_cluster.LocalCluster(head_shards=2, worker_shards=1)
    try:
        c.start()
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.stop()
        assert c.ours() == []  # nothing the cluster started is left


def _cfg(tmp_path, name, **kw) -> RunConfig:
    base = dict(
        dataset="synthetic-logistic",
        users=30,
        seed=3,
        noise_seed=11,
        reference=False,
        epsilon=2.0,
        algorithm="noisy-gd",
        rounds=3,
        lr=0.5,
        clip=0.5,
        out=str(tmp_path / name),
    )
    return RunConfig.from_settings(strict=False, **{**base, **kw})


def test_a_worker_raylet_killed_mid_run_fails_its_shards_users_for_that_request(cluster, tmp_path, monkeypatch):
    worker_node = cluster.node_id("worker")
    killed = {}
    plain_sum = RayShardFederation.sum
    cfg = _cfg(tmp_path, "sh", backend="ray-shards", shards=2, ray_address=cluster.address)

    def kill_worker_before_round_2(self, query, users=None):
        if not killed:
            with PrivacyLedger(os.path.join(cfg.out, "ledger.sqlite")) as led:
                released = led.num_releases()
            if released >= 1:  # the event: round 1's release is charged (and made)
                nodes = [st["node"] for st in ray.get([a.stats.remote() for a in self.actors])]
                assert nodes.count(worker_node) == 1, nodes  # fedkl_shards spread them: one shard per node
                killed.update(shard=nodes.index(worker_node), releases=released)
                os.kill(cluster.raylet_pid("worker"), signal.SIGKILL)
                ray_cluster.wait_for(
                    "the killed node declared dead",
                    lambda: all(n["NodeID"] != worker_node for n in ray.nodes() if n["Alive"]),
                    cluster.timeout,
                )
        return plain_sum(self, query, users)

    monkeypatch.setattr(RayShardFederation, "sum", kill_worker_before_round_2)
    sh = run_training(cfg, log=lambda s: None)
    monkeypatch.undo()
    ref = run_training(_cfg(tmp_path, "ref"), log=lambda s: None)

    assert killed == {"shard": killed["shard"], "releases": 1}
    k = killed["shard"]
    block = range(0, 15) if k == 0 else range(15, 30)
    failures = sh["failures"]
    assert failures["counts"] == {"shard-died": 15} and failures["shard_deaths"] == [int(i == k) for i in range(2)]
    assert [r["request"] for r in failures["by_request"]] == [1]  # that request only: restarted for round 3
    ids = failures["by_request"][0]["failed"]  # user id -> reason
    assert sorted(ids) == sorted(load_run_data(cfg)[0].train.user_ids[block.start : block.stop])
    assert all(why.startswith(f"shard-died: shard {k} of 2") for why in ids.values())
    saved = json.loads(Path(sh["out_dir"], "result.json").read_text())["failures"]
    assert saved["by_request"][0]["failed"] == ids  # the reason is saved in the result
    assert fedkl_main(["ledger", "verify", os.path.join(sh["out_dir"], "ledger.sqlite")]) == 0  # `fedkl ledger verify`
    with (
        PrivacyLedger(os.path.join(sh["out_dir"], "ledger.sqlite")) as a,
        PrivacyLedger(os.path.join(ref["out_dir"], "ledger.sqlite")) as b,
    ):
        ra, rb = ([{k: r[k] for k in r if k not in ("run_id", "id")} for r in led.releases()] for led in (a, b))
        assert len(ra) == 3 and ra == rb  # every release charged every user, the failed ones too
        assert a.user_spends() == b.user_spends()
    assert len(cluster.alive_nodes()) == 1  # only the head is left; the shard was restarted there
