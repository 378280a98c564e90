"""A real kill -9 of `fedkl run` and `fedkl run --recover`: the recovered run's model and ledger equal
the uninterrupted run's, every release charged once.

The test waits on events, never on fixed sleeps: it polls the run's release journal until K releases
are journalled (durable: the journal is flushed before each progress line, at most once a second, so
the releases made after that flush are charged but only buffered when the kill lands), then sends
SIGKILL (the overall timeout is only a failure guard for a loaded machine)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import torch

from fedkl.privacy import PrivacyLedger
from fedkl.runner import JOURNAL_FILE, RunConfig, run_training

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS, K, GUARD_S = 400, 1, 600.0
SETTINGS = dict(dataset="synthetic-logistic", users=12, algorithm="noisy-gd", epsilon=2.0, rounds=ROUNDS, lr=0.5,
                clip=1.0, seed=3, noise_seed=11)  # fmt: skip


def _argv(out) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]
    return [sys.executable, "-m", "fedkl.cli", "run", *flags, "--no-reference", f"--out={out}"]


def _journalled(path) -> int:
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    except sqlite3.Error:  # not created yet
        return 0


def _rows(path) -> list[dict]:
    with PrivacyLedger(path) as led:
        return [{k: r[k] for k in ("seq", "label", "charge", "cohort", "state")} for r in led.releases()]


def _model(out) -> torch.Tensor:
    return torch.load(os.path.join(out, "model.pt"), weights_only=False)["state_dict"]["w"]


def test_kill_9_then_recover_equals_the_uninterrupted_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    out = tmp_path / "killed"
    proc = subprocess.Popen(_argv(out), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + GUARD_S
    try:
        while _journalled(out / JOURNAL_FILE) < K:  # the event: K releases journalled
            assert proc.poll() is None, f"fedkl run ended before the kill: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "fedkl run journalled no release in time"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()  # no-op once it is dead
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    killed_at = _journalled(out / JOURNAL_FILE)
    assert K <= killed_at < ROUNDS  # it died mid-run
    ledger = out / "ledger.sqlite"
    with PrivacyLedger(ledger) as led:
        assert [r["status"] for r in led.runs()] == ["running"]  # nobody ended it
        # each charge flushes the journal first: at most the release in flight is charged and not journalled
        assert killed_at <= led.num_releases() <= killed_at + 1

    rec = subprocess.run(
        [sys.executable, "-m", "fedkl.cli", "run", f"--recover={out}"], cwd=tmp_path, env=env, capture_output=True
    )
    assert rec.returncode == 0, rec.stderr.decode()[-2000:]
    assert f"{killed_at} releases replayed from its journal" in rec.stdout.decode()

    clean = tmp_path / "clean"
    run_training(RunConfig.from_settings(**SETTINGS, reference=False, out=str(clean)), log=lambda s: None)
    assert torch.equal(_model(out), _model(clean))  # bit for bit
    rows = _rows(ledger)  # the recovery charges per release past the rows its first process charged
    assert [r["seq"] for r in rows] == list(range(ROUNDS)) and rows == _rows(clean / "ledger.sqlite")
    with PrivacyLedger(ledger) as led, PrivacyLedger(clean / "ledger.sqlite") as ref:
        assert led.user_spends() == ref.user_spends()  # each release charged exactly once
        ((run),) = led.runs()
        assert run["status"] == "finished" and run["reserved_users"] == 0
        led.verify()
