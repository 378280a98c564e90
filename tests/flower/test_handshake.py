"""The handshake under load, in simulated time (a LocalGrid whose nodes connect late and whose ClientApps
answer slowly): the wait returns on the event (the last expected reply), not at a deadline; at the
deadline (which scales with the federation) the missing users are named in one line and, with an
enrolment, fail 'absent' and are charged; a user claimed by two nodes costs only the claimants
(the bound node wins; without a binding the user fails 'duplicate-claim'), never the run."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_flower import LS, N, _inprocess, _noisy_gd_with, _w

from fedkl.federation.base import ClippedGradient
from fedkl.flower import localgrid
from fedkl.flower.client_app import make_client_app
from fedkl.flower.federation import POLL_S, STALL_FACTOR, FlowerFederation, answer_deadline, connect_deadline
from fedkl.flower.localgrid import LocalGrid

pytestmark = pytest.mark.flower

IDS = _inprocess(LS).user_ids


def _grid(**kw) -> LocalGrid:
    return LocalGrid(make_client_app(LS), N, **kw)


def _node(grid: LocalGrid, p: int) -> int:
    return next(nid for nid, q in grid.partition_of.items() if q == p)


def test_the_wait_returns_on_the_last_reply_of_late_nodes_and_slow_clientapps():
    connect_at = {p: 3.0 * p for p in range(N)}  # the last node connects after 45 s
    slow = {p: 20.0 + p for p in range(0, N, 2)}  # their ClientApps take 20-34 s to answer
    grid = _grid(connect_at=connect_at, faults={p: localgrid.delay(s, handshake=True) for p, s in slow.items()})
    fed = FlowerFederation(grid, user_ids=IDS)
    last = max(connect_at[p] + slow.get(p, 0.0) for p in range(N))
    assert last <= grid.clock.now <= last + POLL_S  # the event, one poll at most
    assert grid.clock.now < min(connect_deadline(N), answer_deadline(1))  # long before any deadline
    assert fed.missing == [] and fed.handshake["unserved"] == {} and fed.handshake["refused_nodes"] == {}
    assert sorted(fed.node_of) == list(range(N))
    assert fed.compute(ClippedGradient(_w(0), 1.0)).failed == []


def test_at_the_deadline_the_missing_users_are_named_in_one_line_and_charged(tmp_path, caplog):
    never = [2, 5, 7, 8, 9, 11, 13]  # never connect
    too_slow = 14  # would answer the handshake long after the deadline, but crashes (goes offline) first
    grid = _grid(absent=never, faults={too_slow: localgrid.delay(10_000.0, handshake=True)}, leave_at={too_slow: 30.0})
    with caplog.at_level(logging.WARNING, logger="fedkl.flower.federation"):
        fed = FlowerFederation(grid, user_ids=IDS)
    asked = N - len(never)
    assert answer_deadline(asked) <= grid.clock.now <= answer_deadline(asked) + POLL_S  # waited the deadline
    missing = sorted(never + [too_slow])
    assert fed.missing == missing
    lines = [r.getMessage() for r in caplog.records if "enrolled users have no node" in r.getMessage()]
    names = ", ".join(repr(IDS[p]) for p in missing[:5])
    assert lines == [
        f"8 of {N} enrolled users have no node after {grid.clock.now:.0f} s ({names}, ... (+3 more)); "
        "they contribute zero, are charged, and are reported failed"
    ]
    assert fed.handshake["refused_nodes"] == {str(_node(grid, too_slow)): "no handshake reply before the deadline"}
    assert set(fed.handshake["unserved"]) == {IDS[p] for p in missing}

    res, ledger, _ = _noisy_gd_with(fed, tmp_path, "late")
    assert [h["failed_users"] for h in res.history] == [len(missing)] * 4
    for uid in IDS:  # every enrolled user charged, missing or not
        assert ledger.spend(uid).releases == 4
    report = fed.failure_report()
    assert report["counts"] == {"absent": 4 * len(missing)}
    assert json.loads(json.dumps(report))["handshake"]["unserved"][IDS[2]].startswith("absent: ")


def test_a_node_still_online_at_the_deadline_is_waited_for_longer_one_that_crashed_is_not(caplog):
    """A loaded machine: node 3's ClientApp answers at 1.5x the answer deadline while its SuperNode stays
    online, so it is waited for (one line says so) and serves its user; node 9 stays online and never answers:
    given up at STALL_FACTOR x the deadline. An explicit handshake_timeout is not extended."""
    d = answer_deadline(N)
    faults = {3: localgrid.delay(1.5 * d, handshake=True), 9: localgrid.delay(10_000.0, handshake=True)}
    with caplog.at_level(logging.WARNING, logger="fedkl.flower.federation"):
        fed = FlowerFederation(_grid(faults=faults), user_ids=IDS, wait_for_nodes=0.0)
    assert 3 in fed.node_of and fed.missing == [9]
    now = fed.grid.clock.now
    assert STALL_FACTOR * d <= now <= STALL_FACTOR * (d + POLL_S) + POLL_S
    waits = [r.getMessage() for r in caplog.records if "still online" in r.getMessage()]
    assert len(waits) == 1 and waits[0].startswith("2 asked node(s) have not answered the fedkl handshake after")

    fed = FlowerFederation(_grid(faults=faults), user_ids=IDS, wait_for_nodes=0.0, handshake_timeout=50.0)
    assert fed.missing == [3, 9] and 50.0 <= fed.grid.clock.now <= 50.0 + POLL_S


def test_without_an_enrolment_missing_users_refuse_the_run_in_one_line():
    grid = _grid(absent=[3, 4])
    with pytest.raises(RuntimeError, match=r"^2 user positions have no node after \d+ s \(3, 4\); pass user_ids"):
        FlowerFederation(grid, num_users=N)
    assert connect_deadline(N) <= grid.clock.now <= connect_deadline(N) + POLL_S


def test_an_explicit_short_connect_wait_still_gives_connected_nodes_the_answer_allowance():
    """What a local deployment sets (``fedkl-wait-for-nodes``) when a node is known never to come: the
    connected nodes' ClientApps still have the scaled answer deadline, and the wait ends on their replies."""
    grid = _grid(absent=[5], faults={p: localgrid.delay(150.0, handshake=True) for p in range(N)})
    fed = FlowerFederation(grid, user_ids=IDS, wait_for_nodes=1.0)
    assert fed.missing == [5] and 150.0 <= grid.clock.now <= 150.0 + POLL_S


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
def test_a_duplicate_claim_is_refused_for_the_impostor_only(tmp_path, bound):
    """Node 3 claims user position 2. Unbound: neither claimant is asked, user 2 fails 'duplicate-claim'
    (charged, zero) and user 3 (whose node is busy impersonating) 'absent'; the run goes on. Bound by the
    enrolment to the genuine node: that node serves user 2, only the impostor is refused."""
    grid = _grid(node_config={3: {"partition-id": 2}})
    bindings = {IDS[2]: _node(grid, 2)} if bound else None
    fed = FlowerFederation(grid, user_ids=IDS, wait_for_nodes=0.0, bindings=bindings)
    impostor = str(_node(grid, 3))
    if bound:
        assert fed.node_of[2] == _node(grid, 2)
        assert fed.handshake["refused_nodes"] == {
            impostor: f"claims user {IDS[2]!r}, bound by the enrolment to node {_node(grid, 2)}"
        }
        failed = [3]
    else:
        assert 2 not in fed.node_of and set(fed.handshake["refused_nodes"]) == {str(_node(grid, 2)), impostor}
        assert fed.handshake["unserved"][IDS[2]].startswith("duplicate-claim: claimed by nodes")
        failed = [2, 3]
    q = ClippedGradient(_w(1, 2.0), 0.4)
    a, ref = fed.compute(q), _inprocess(LS).compute(q)
    assert a.failed == failed
    assert torch.equal(a.values[failed], torch.zeros(len(failed), a.values.shape[1], dtype=a.values.dtype))
    good = [u for u in range(N) if u not in failed]
    assert torch.allclose(a.values[good], ref.values[good], rtol=0, atol=1e-12)
    kinds = {uid: why.split(":", 1)[0] for uid, why in fed.failures[-1]["failed"].items()}
    assert kinds == ({IDS[3]: "absent"} if bound else {IDS[2]: "duplicate-claim", IDS[3]: "absent"})

    res, ledger, _ = _noisy_gd_with(fed, tmp_path, f"dup-{bound}")
    assert [h["failed_users"] for h in res.history] == [len(failed)] * 4
    assert all(ledger.spend(uid).releases == 4 for uid in IDS)  # the claimed user charged too


def test_a_failed_deployed_run_leaves_its_one_line_reason_for_run_grpc(tmp_path):
    from flwr.app import Context, RecordDict

    from fedkl.flower import client_app, server_app

    rc = {"fedkl-dataset": "synthetic-least-squares", "fedkl-seed": 3, "fedkl-rounds": 1}
    rc |= {"fedkl-out": str(tmp_path / "out"), "fedkl-reference": False, "fedkl-wait-for-nodes": 0.0}
    grid = LocalGrid(client_app.app, 4, run_config=rc, absent=range(4))  # nobody comes
    with pytest.raises(RuntimeError, match="no Flower node connected within 0 s"):
        server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    err = json.loads((tmp_path / "out" / "flower_error.json").read_text())["error"]
    assert err.startswith("RuntimeError: no Flower node connected within 0 s") and "\n" not in err
    assert not (tmp_path / "out" / "flower_result.json").exists()
    from fedkl.flower.deploy import read_outcome

    with pytest.raises(RuntimeError, match="^the fedkl ServerApp failed: RuntimeError: no Flower node connected"):
        read_outcome(tmp_path / "out", tmp_path / "flwr-run.log")  # what run_grpc raises after `flwr run` exits 0


def test_fedkl_run_over_grpc_exits_non_zero_in_one_line_when_the_deployment_fails(monkeypatch, capsys, tmp_path):
    from fedkl.cli import main
    from fedkl.flower import deploy

    def failed(*a, **k):
        raise RuntimeError("the fedkl ServerApp failed: RuntimeError: no Flower node connected within 76 s")

    monkeypatch.setattr(deploy, "run_grpc", failed)
    argv = ["run", "--backend", "grpc", "--dataset", "synthetic-least-squares", "--problem", "least-squares"]
    assert main([*argv, "--users", "3", "--no-reference", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "fedkl run: error: the fedkl ServerApp failed: RuntimeError: no Flower node connected within 76 s"


P = _inprocess(LS).num_params  # the server's model size (its own problem)


def test_a_node_answering_for_another_model_is_refused_alone(tmp_path, caplog):
    """Node 4's handshake reports one parameter more than the server's problem: only that node is
    refused; its user fails 'wrong-model' every request (charged, zero), everyone else trains as before."""
    grid = _grid(faults={4: localgrid.wrong_info(num_params=1)})
    with caplog.at_level(logging.WARNING, logger="fedkl.flower.federation"):
        fed = FlowerFederation(grid, user_ids=IDS, wait_for_nodes=0.0, num_params=P)
    why = f"answers for a model of {P + 1} parameters; the server's problem has {P}"
    assert fed.num_params == P and 4 not in fed.node_of and len(fed.node_of) == N - 1
    assert fed.handshake["refused_nodes"] == {str(_node(grid, 4)): why}
    assert fed.handshake["unserved"] == {IDS[4]: f"wrong-model: node {_node(grid, 4)} {why}"}
    assert fed.missing == []
    assert any(f"node {_node(grid, 4)} is refused: {why}" == r.getMessage() for r in caplog.records)
    q = ClippedGradient(_w(1, 2.0), 0.4)
    a, ref = fed.compute(q), _inprocess(LS).compute(q)
    assert a.failed == [4] and not a.values[4].any()
    good = [u for u in range(N) if u != 4]
    assert torch.allclose(a.values[good], ref.values[good], rtol=0, atol=1e-12)
    assert sum(1 for p, _ in grid.calls if p == 4) == 1  # the handshake only: never asked a query

    res, ledger, _ = _noisy_gd_with(fed, tmp_path, "wrong-model")
    assert [h["failed_users"] for h in res.history] == [1] * 4
    assert all(ledger.spend(uid).releases == 4 for uid in IDS)  # the refused node's user charged too
    report = json.loads(json.dumps(fed.failure_report()))
    assert report["counts"] == {"wrong-model": 4 + 1}  # the compute above and the 4 rounds
    assert report["kinds"]["wrong-model"].startswith("its node answers for a model of another size")


def test_another_number_of_users_refuses_that_node_alone():
    grid = _grid(faults={6: localgrid.wrong_info(num_partitions=3)})
    fed = FlowerFederation(grid, user_ids=IDS, wait_for_nodes=0.0, num_params=P)
    assert fed.handshake["refused_nodes"] == {str(_node(grid, 6)): f"holds a dataset of {N + 3} users, expected {N}"}
    assert fed.missing == [6] and fed.compute(ClippedGradient(_w(0), 1.0)).failed == [6]


def test_disagreeing_nodes_without_the_servers_facts_refuse_the_run_in_one_line():
    """Without the server's model size (or enrolment) nobody can tell which node is wrong: refused."""
    with pytest.raises(RuntimeError, match=rf"^nodes disagree on the model size \(num_params \[{P}, {P + 2}\]\); pass"):
        FlowerFederation(_grid(faults={1: localgrid.wrong_info(num_params=2)}), user_ids=IDS, wait_for_nodes=0.0)
    with pytest.raises(RuntimeError, match=rf"^nodes disagree on the number of users \(\[{N}, {N + 1}\]\); pass user"):
        FlowerFederation(_grid(faults={1: localgrid.wrong_info(num_partitions=1)}), wait_for_nodes=0.0)


def test_a_run_with_no_node_left_fails_in_one_line():
    grid = _grid(faults={p: localgrid.wrong_info(num_params=3) for p in range(N)})
    msg = f"^no Flower node is left to ask: all {N} were refused \\(answers for a model of {P + 3} parameters; the server's problem has {P}\\)$"
    with pytest.raises(RuntimeError, match=msg):
        FlowerFederation(grid, user_ids=IDS, wait_for_nodes=0.0, num_params=P)


def _deployed(tmp_path, faults):
    from flwr.app import Context, RecordDict

    from fedkl.flower import client_app, server_app

    rc = {"fedkl-dataset": "synthetic-least-squares", "fedkl-seed": 3, "fedkl-rounds": 2, "fedkl-users": 4}
    rc |= {"fedkl-out": str(tmp_path / "out"), "fedkl-reference": False, "fedkl-wait-for-nodes": 0.0}
    grid = LocalGrid(client_app.app, 4, run_config=rc, faults=faults)
    server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    return tmp_path / "out"


def test_the_deployed_server_refuses_a_wrong_model_node_by_its_own_problem_and_goes_on(tmp_path, capsys):
    out = _deployed(tmp_path, {2: localgrid.wrong_info(num_params=5)})
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fedkl progress: round")]
    assert [line.split(",")[0] for line in progress] == ["fedkl progress: round 1/2", "fedkl progress: round 2/2"]
    res = json.loads(next(out.rglob("flower_result.json")).read_text())
    assert res["failed_users"] == [1, 1]
    assert res["failures"]["counts"] == {"wrong-model": 2}
    (why,) = res["failures"]["handshake"]["unserved"].values()
    assert why.startswith("wrong-model: node ") and "the server's problem has" in why


def test_a_deployed_run_whose_nodes_all_answer_for_another_model_fails_in_one_line(tmp_path):
    with pytest.raises(RuntimeError, match="^no Flower node is left to ask: all 4 were refused"):
        _deployed(tmp_path, {p: localgrid.wrong_info(num_params=5) for p in range(4)})
    err = json.loads((tmp_path / "out" / "flower_error.json").read_text())["error"]
    assert err.startswith("RuntimeError: no Flower node is left to ask") and "\n" not in err
