"""Crash recovery over the Flower transport (`--backend flower-local`: the ServerApp's federation in
this process, clients on the LocalGrid): a run that dies after two journalled releases recovers to
the uninterrupted run's model and ledger, bit for bit."""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fedkl.flower.backends  # noqa: E402,F401  (registers the Flower backends)
from fedkl.privacy import PrivacyLedger  # noqa: E402
from fedkl.privacy.journal import ReleaseJournal  # noqa: E402
from fedkl.runner import RunConfig, recover_run, run_training  # noqa: E402

pytestmark = pytest.mark.flower


class Crash(BaseException):
    pass


def _cfg(out, users_per_node: int = 0) -> RunConfig:
    return RunConfig.from_settings(dataset="synthetic-logistic", users=6, algorithm="noisy-gd", rounds=4, epsilon=2.0,
                                   seed=3, noise_seed=11, reference=False, backend="flower-local", out=str(out),
                                   users_per_node=users_per_node)  # fmt: skip


def _rows(path) -> list[dict]:
    with PrivacyLedger(path) as led:
        return [{k: r[k] for k in ("seq", "label", "charge", "cohort", "state")} for r in led.releases()]


@pytest.mark.parametrize("users_per_node", [0, 3])
def test_a_flower_run_recovers_bit_for_bit(tmp_path, monkeypatch, users_per_node):
    """One user per node, and nodes holding blocks of 3 users (the recovery re-handshakes with the blocks)."""
    clean = run_training(_cfg(tmp_path / "clean", users_per_node), log=lambda s: None)
    original, seen = ReleaseJournal.record, []

    def record(self, *a):
        if len(seen) == 2:
            raise Crash
        seen.append(a[0])
        return original(self, *a)

    with monkeypatch.context() as m:
        m.setattr(ReleaseJournal, "record", record)
        with pytest.raises(Crash):
            run_training(_cfg(tmp_path / "crashed", users_per_node), log=lambda s: None)
    lines: list[str] = []
    recovered = recover_run(str(tmp_path / "crashed"), log=lines.append)
    assert "2 releases replayed" in " ".join(lines) and recovered["backend"] == "flower-local"
    nodes = 6 if users_per_node == 0 else 2
    assert recovered["failures"]["handshake"]["nodes"] == clean["failures"]["handshake"]["nodes"] == nodes
    w = [torch.load(p, weights_only=False)["state_dict"]["w"] for p in (recovered["model_path"], clean["model_path"])]
    assert torch.equal(*w)
    assert _rows(recovered["ledger"]["path"]) == _rows(clean["ledger"]["path"])


def test_no_message_leaves_for_the_nodes_while_a_release_is_unjournalled(tmp_path, monkeypatch):
    """Egress point 2 (fedkl.privacy.journal): every send to the nodes follows a flush of the release
    journal, so the model the nodes get never depends on a value that a crash could lose. The progress
    lines are throttled away (one at the start and end), so only the transport's hook flushes mid-run."""
    import fedkl.runner as runner
    from fedkl.flower.localgrid import LocalGrid

    journals: list[ReleaseJournal] = []
    original, sends = ReleaseJournal.record, []

    def record(self, *a):
        if self not in journals:
            journals.append(self)
        return original(self, *a)

    def spy(name):
        send = getattr(LocalGrid, name)

        def checked(self, *a, **kw):
            sends.append(sum(j.buffered for j in journals))
            return send(self, *a, **kw)

        return checked

    monkeypatch.setattr(ReleaseJournal, "record", record)
    monkeypatch.setattr(runner, "PROGRESS_EVERY_S", 1e9)
    for name in ("push_messages", "send_and_receive"):
        monkeypatch.setattr(LocalGrid, name, spy(name))
    run_training(_cfg(tmp_path / "run"), log=lambda s: None)
    assert journals and len(sends) >= 4 and set(sends) == {0}  # a send after each of the 4 releases, none buffered
    assert journals[0].flushes >= 3  # the sends did flush (rounds 2-4 carry round 1-3's released model)
