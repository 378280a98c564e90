"""The deployed ServerApp (``fedkl.flower.server_app:app``) keeps its run's release journal in ``fedkl-out`` and
recovers a run whose process died: over a LocalGrid, a ServerApp that dies after K journalled releases, its
ledger left as a kill -9 leaves it (the run 'running' under a process that is gone), is recovered by a new
ServerApp run with ``fedkl-recover``; the model equals the uninterrupted run's bit for bit and the ledger holds
each release once. The same through ``fedkl run --backend grpc`` and ``--recover`` (the deployment replaced by
the LocalGrid), and, marked ``deployment``, a real SIGKILL of the ServerApp process of a loopback deployment
(TLS, node auth) recovered by ``fedkl run --recover``."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

import fedkl.flower.backends  # noqa: F401  (registers the grpc backend)
from fedkl.flower import client_app, deploy, server_app
from fedkl.flower.localgrid import LocalGrid
from fedkl.privacy import PrivacyLedger
from fedkl.privacy.journal import JournalError, ReleaseJournal
from fedkl.privacy.ledger import LedgerBusy
from fedkl.runner import JOURNAL_FILE, RunConfig, recover_run, run_training

pytestmark = pytest.mark.flower

USERS, ROUNDS, K = 6, 5, 2
RC = {"fedkl-dataset": "synthetic-logistic", "fedkl-users": USERS, "fedkl-algorithm": "noisy-gd",
      "fedkl-rounds": ROUNDS, "fedkl-epsilon": 2.0, "fedkl-seed": 3, "fedkl-noise-seed": 11,
      "fedkl-reference": False, "fedkl-wait-for-nodes": 0}  # fmt: skip


class Died(BaseException):
    """The ServerApp's process dying (no handler of the run sees it as an error of the run)."""


def _serve(rc: dict) -> None:
    """One ServerApp run (what `flwr run` starts) over USERS LocalGrid SuperNodes running fedkl's ClientApp."""
    grid = LocalGrid(client_app.app, USERS, run_config=rc)
    server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))


def _dying_after(monkeypatch, k: int) -> None:
    """The process dies right after the k-th release is journalled (its value never leaves it)."""
    original, seen = ReleaseJournal.record, []

    def record(self, *a):
        if len(seen) == k:
            raise Died
        seen.append(a[0])
        return original(self, *a)

    monkeypatch.setattr(ReleaseJournal, "record", record)


def _as_kill_9_leaves_it(ledger: Path) -> None:
    """A kill -9 runs no handler: the run stays 'running', under a process that no longer exists (here the
    run's recorded process start no longer matches: the ledger's test of a dead or reused pid)."""
    with sqlite3.connect(ledger) as db:
        db.execute("UPDATE runs SET status = 'running', ended = NULL, proc_start = '0'")
    with PrivacyLedger(ledger) as led:
        assert [r["status"] for r in led.runs()] == ["running"]


def _rows(path) -> list[dict]:
    with PrivacyLedger(path) as led:
        return [{k: r[k] for k in ("seq", "label", "charge", "cohort", "state")} for r in led.releases()]


def _result(out: Path) -> dict:
    return json.loads((out / "flower_result.json").read_text())


def test_a_deployed_server_app_killed_after_k_releases_recovers_bit_for_bit(tmp_path, monkeypatch, capsys):
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    _serve({**RC, "fedkl-out": str(clean)})
    assert len(ReleaseJournal.open(clean / JOURNAL_FILE)) == ROUNDS  # the deployed run journals every release
    with monkeypatch.context() as m:
        _dying_after(m, K)
        with pytest.raises(Died):
            _serve({**RC, "fedkl-out": str(crashed)})
    assert not (crashed / "flower_result.json").exists()
    _as_kill_9_leaves_it(crashed / "ledger.sqlite")
    assert len(_rows(crashed / "ledger.sqlite")) == K + 1  # the (K+1)-th charged, its value never journalled
    capsys.readouterr()

    _serve({**RC, "fedkl-out": str(crashed), "fedkl-recover": str(crashed)})  # a new ServerApp run
    assert f"{K} releases replayed from its journal, none charged twice" in capsys.readouterr().out
    got, want = _result(crashed), _result(clean)
    assert (got["replayed"], want["replayed"]) == (K, None)
    assert got["w"] == want["w"] and got["failed_users"] == [0] * ROUNDS  # bit for bit; every node answered again
    rows = _rows(crashed / "ledger.sqlite")
    assert rows == _rows(clean / "ledger.sqlite") and [r["seq"] for r in rows] == list(range(ROUNDS))
    with PrivacyLedger(crashed / "ledger.sqlite") as led, PrivacyLedger(clean / "ledger.sqlite") as ref:
        assert led.user_spends() == ref.user_spends()  # each release charged exactly once
        ((run),) = led.runs()
        assert run["status"] == "finished" and run["reserved_users"] == 0
        led.verify()


def test_a_recovery_with_other_settings_or_a_live_run_is_refused_in_one_line(tmp_path, monkeypatch):
    crashed = tmp_path / "crashed"
    with monkeypatch.context() as m:
        _dying_after(m, K)
        with pytest.raises(Died):
            _serve({**RC, "fedkl-out": str(crashed)})
    rows = _rows(crashed / "ledger.sqlite")
    with pytest.raises(JournalError, match=r"\(rounds differ\).*nothing was charged"):
        _serve({**RC, "fedkl-rounds": ROUNDS + 1, "fedkl-out": str(crashed), "fedkl-recover": str(crashed)})
    error = json.loads((crashed / "flower_error.json").read_text())["error"]
    assert "rounds differ" in error and "\n" not in error  # what `fedkl run --backend grpc` reports
    # a run started by `flwr run` (backend setting not grpc) is recovered by `flwr run`, not `fedkl run --recover`
    with pytest.raises(JournalError, match="fedkl-recover="):
        recover_run(str(crashed), log=lambda s: None)
    with sqlite3.connect(crashed / "ledger.sqlite") as db:  # the first ServerApp still running (pid 1 is alive)
        db.execute("UPDATE runs SET status = 'running', ended = NULL, pid = 1, proc_start = NULL")
    with pytest.raises(LedgerBusy, match="still running"):
        _serve({**RC, "fedkl-out": str(crashed), "fedkl-recover": str(crashed)})
    assert _rows(crashed / "ledger.sqlite") == rows  # nothing charged by the refusals
    with pytest.raises(JournalError, match="no release journal"):
        _serve({**RC, "fedkl-out": str(tmp_path / "x"), "fedkl-recover": str(tmp_path / "nowhere")})


def test_fedkl_run_backend_grpc_recover_hands_the_run_to_a_recovering_server_app(tmp_path, monkeypatch):
    """`fedkl run --backend grpc` then `fedkl run --recover`: the recovery is the ServerApp's (fedkl-recover set
    to the run folder, the run's own settings and fedkl-out), the local deployment replaced by the LocalGrid."""
    submitted: list[dict] = []

    def over_local_grid(rc, num_users, *, user_ids=None, log=print, **kw):
        submitted.append(dict(rc))
        _serve({**rc, "fedkl-wait-for-nodes": 0})
        return deploy.read_outcome(Path(rc["fedkl-out"]), Path("flwr-run.log"))

    monkeypatch.setattr(deploy, "run_grpc", over_local_grid)
    settings = dict(dataset="synthetic-logistic", users=USERS, algorithm="noisy-gd", rounds=ROUNDS, epsilon=2.0,
                    seed=3, noise_seed=11, reference=False, backend="grpc")  # fmt: skip
    clean = run_training(RunConfig.from_settings(**settings, out=str(tmp_path / "clean")), log=lambda s: None)
    out = tmp_path / "crashed"
    with monkeypatch.context() as m:
        _dying_after(m, K)
        with pytest.raises(Died):
            run_training(RunConfig.from_settings(**settings, out=str(out)), log=lambda s: None)
    _as_kill_9_leaves_it(out / "ledger.sqlite")
    said: list[str] = []
    recovered = recover_run(str(out), log=said.append)
    assert f"fedkl grpc: the ServerApp recovered {out.resolve()}: {K} releases replayed from its journal" in said
    assert submitted[-1]["fedkl-recover"] == str(out.resolve()) and submitted[-1]["fedkl-out"] == str(out)
    assert [rc.get("fedkl-recover") for rc in submitted[:-1]] == [None, None]
    with PrivacyLedger(out / "ledger.sqlite") as led:
        ((run),) = led.runs()
    assert recovered["backend"] == "grpc" and recovered["run_id"] == run["run_id"] and run["status"] == "finished"
    assert _result(out)["w"] == _result(tmp_path / "clean")["w"]
    assert _rows(out / "ledger.sqlite") == _rows(Path(clean["out_dir"]) / "ledger.sqlite")


def _journalled(path: Path) -> int:
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    except sqlite3.Error:  # not created yet
        return 0


def _runs(program: str, pid: int) -> bool:
    """Whether process ``pid`` runs ``program`` (a console script: its name is argv[0] or, under Python, argv[1])."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(Path(a.decode(errors="replace")).name == program for a in argv[:2])


@pytest.mark.deployment
def test_a_kill_9_of_the_deployed_server_app_then_fedkl_run_recover_keeps_the_ledger_intact(tmp_path):
    """A real loopback deployment (`fedkl run --backend grpc`: SuperLink with TLS and node auth, 2 SuperNodes):
    its ServerApp process (flwr-serverapp, the coordinator holding the ledger) is SIGKILLed once its journal
    holds K releases, the deployment stopped (Ctrl-C), then `fedkl run --recover` finishes the run on a fresh
    deployment: every release charged once, the model the uninterrupted run's. Waits on events only (the
    journal's count, the processes' exits); the guard is a failure bound for a loaded machine.

    Where its time goes (measured at load ~50 on 2 cores): two deployments (SuperLink, a registration and a
    SuperNode per user, the ServerApp: ~80 s each), the handshake (~45 s), then every message of every round
    starts a new ClientApp process on each SuperNode (Flower's subprocess isolation; each imports torch), ~50 s a
    round there, and the recovery asks the replayed rounds again. So: 2 users, 4 rounds, killed after the first
    release: 2 x 5 + 2 x 2-3 ClientApp starts instead of 3 x 14 + 3 x 4-5 (3 users, 10 rounds, K = 3: 668 s at
    load 10-15). The kill lands before the last release as long as the three rounds after the first take longer
    than finding and signalling the ServerApp (a /proc scan): each of them starts ClientApps and waits for a
    SuperNode's idle poll (3 s)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch

    from fedkl.flower.server_app import run_flower_simulation

    rounds, k, guard = 4, 1, 900.0
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    settings = dict(dataset="synthetic-least-squares", problem="least-squares", users=2, rounds=rounds, lr=0.5,
                    seed=3, noise_seed=5)  # fmt: skip
    flags = [f"--{key.replace('_', '-')}={v}" for key, v in settings.items()]
    out = tmp_path / "o"
    with open(tmp_path / "first.log", "w") as first:
        p = subprocess.Popen(
            [sys.executable, "-m", "fedkl.cli", "run", "--backend=grpc", *flags, "--no-reference", f"--out={out}"],
            env=env, stdout=first, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + guard
    try:
        while _journalled(out / JOURNAL_FILE) < k:  # the event: K releases journalled by the ServerApp
            assert p.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the deployed run journalled no release in time"
            time.sleep(0.01)
        (work,) = tmp_path.glob("fedkl-grpc-*")
        server = [pid for pid in deploy.processes_of(work) if _runs("flwr-serverapp", pid)]
        assert len(server) == 1, server
        os.kill(server[0], signal.SIGKILL)  # the coordinator dies
        os.killpg(p.pid, signal.SIGINT)  # and its operator stops the deployment
        p.wait(timeout=guard)
    finally:
        if p.poll() is None:  # pragma: no cover - only if an assertion above failed
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode != 0
    killed_at = _journalled(out / JOURNAL_FILE)
    assert k <= killed_at < rounds, (tmp_path / "first.log").read_text()[-3000:]
    with PrivacyLedger(out / "ledger.sqlite") as led:
        assert [r["status"] for r in led.runs()] == ["running"]  # nobody ended it: the ServerApp was killed
        # every journalled release is charged; beyond it at most the one in flight (each charge flushes the
        # journal first)
        assert killed_at <= led.num_releases() <= killed_at + 1, led.releases()[killed_at:]
        ((dead),) = led.runs()
    # Ctrl-C's line names the ServerApp's ledger run and what it charged (not "nothing was charged")
    assert f"fedkl run: interrupted: run {dead['run_id']} made " in (tmp_path / "first.log").read_text()
    assert (out / "grpc-logs" / "superlink.log").is_file()  # the failed deployment's logs, out of its removed folder

    rec = subprocess.run(
        [sys.executable, "-m", "fedkl.cli", "run", f"--recover={out}"], env=env, capture_output=True, timeout=guard
    )
    said = rec.stdout.decode() + rec.stderr.decode()
    assert rec.returncode == 0, said[-3000:]
    assert f"{killed_at} releases replayed from its journal" in said

    ref = run_flower_simulation(
        RunConfig.from_settings(**settings, out=str(tmp_path / "ref"), reference=False, kernels="reproducible"),
        "inprocess",
        log=lambda s: None,
    )
    assert torch.equal(torch.load(out / "model.pt", weights_only=False)["state_dict"]["w"], ref["w"])
    rows = _rows(out / "ledger.sqlite")
    assert rows == _rows(ref["ledger_path"]) and [r["seq"] for r in rows] == list(range(rounds))
    with PrivacyLedger(out / "ledger.sqlite") as led:
        ((run),) = led.runs()
        assert run["status"] == "finished" and run["reserved_users"] == 0
        led.verify()
    assert list(tmp_path.glob("fedkl-grpc-*")) == []  # both deployments' temporary folders removed
