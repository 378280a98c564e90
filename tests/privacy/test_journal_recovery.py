"""Crash recovery (``fedkl run --recover``): every release charged in its own ledger transaction right
before its noise is drawn, the journal durable at egress.

A run dies after k releases (a crash injected into the journal's commit, so the k-th release is
charged but never journalled: the hardest spot); recovering it gives the model and the ledger of the
uninterrupted run, bit for bit, with every release charged once. The real kill -9 is in
tests/test_recover_kill.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from build_helpers import small_config  # tests/build_helpers.py

from fedkl.privacy import Budget, NoiseSource, PrivacyLedger
from fedkl.privacy.charges import GaussianCharge
from fedkl.privacy.journal import JournalError, ReleaseJournal
from fedkl.privacy.release import RecoveryMismatch, Releaser
from fedkl.runner import JOURNAL_FILE, RunConfig, recover_run, run_training

ROUNDS = 6


class Crash(BaseException):
    """Stands for the process dying (not an Exception: nothing may catch it)."""


def _cfg(out, **kw) -> RunConfig:
    base = dict(dataset="synthetic-logistic", users=12, algorithm="noisy-gd", epsilon=2.0, rounds=ROUNDS, lr=0.5,
                clip=1.0, seed=3, noise_seed=11, reference=False)  # fmt: skip
    return RunConfig.from_settings(**{**base, **kw}, out=str(out))


def _crash_after(monkeypatch, k: int) -> None:
    """The process 'dies' at the (k+1)-th journal commit: releases 0..k-1 are journalled, release k
    is charged and drawn but not journalled."""
    original = ReleaseJournal.record
    seen = []

    def record(self, *a, **kw):
        if len(seen) == k:
            raise Crash
        seen.append(a[0])
        return original(self, *a, **kw)

    monkeypatch.setattr(ReleaseJournal, "record", record)


def _ledger_rows(path) -> list[dict]:
    with PrivacyLedger(path) as led:
        return [{k: r[k] for k in ("seq", "label", "charge", "cohort", "state")} for r in led.releases()]


def _model(out) -> torch.Tensor:
    return torch.load(os.path.join(out, "model.pt"), weights_only=False)["state_dict"]["w"]


def _spends(path) -> list[dict]:
    with PrivacyLedger(path) as led:
        return led.user_spends()


@pytest.mark.parametrize("k", [0, 3])
def test_recovery_gives_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch, k):
    clean = run_training(_cfg(tmp_path / "clean"), log=lambda s: None)
    with monkeypatch.context() as m:
        _crash_after(m, k)
        with pytest.raises(Crash):
            run_training(_cfg(tmp_path / "crashed"), log=lambda s: None)
    ledger = tmp_path / "crashed" / "ledger.sqlite"
    assert len(_ledger_rows(ledger)) == k + 1  # release k was charged, never journalled
    lines = []
    recovered = recover_run(str(tmp_path / "crashed"), log=lines.append)
    assert f"{k} releases replayed" in " ".join(lines)
    assert recovered["run_id"] != clean["run_id"]
    assert torch.equal(_model(tmp_path / "crashed"), _model(tmp_path / "clean"))
    rows, clean_rows = _ledger_rows(ledger), _ledger_rows(tmp_path / "clean" / "ledger.sqlite")
    assert rows == clean_rows and [r["seq"] for r in rows] == list(range(ROUNDS))  # each release charged once
    assert _spends(ledger) == _spends(tmp_path / "clean" / "ledger.sqlite")
    with PrivacyLedger(ledger) as led:
        (run,) = led.runs()
        assert run["status"] == "finished" and run["reserved_users"] == 0
        led.verify()


def test_recovery_returns_the_journalled_value_not_a_recomputed_one(tmp_path, monkeypatch):
    """What left the process is what the recovered run continues from: a journalled value that differs
    from what the replayed noise would give (as if a user's data had changed) is the one returned."""
    with monkeypatch.context() as m:
        _crash_after(m, 2)
        with pytest.raises(Crash):
            run_training(_cfg(tmp_path / "run"), log=lambda s: None)
    path = tmp_path / "run" / JOURNAL_FILE
    journal = ReleaseJournal.open(path)
    entries = journal.entries()
    journal.close()
    led = PrivacyLedger(tmp_path / "run" / "ledger.sqlite", run_id=json.loads(_header(path)["run_id"]))
    journal = ReleaseJournal.open(path)
    rel = Releaser(led, NoiseSource(999), journal=journal, replay=True)
    zeros = torch.zeros_like(entries[0].value())
    users = led.cohorts()[entries[0].cohort]
    got = rel.gaussian(
        zeros,
        sensitivity=entries[0].charge["sensitivity"],
        rho=entries[0].charge["rho"],
        user_ids=users,
        label=entries[0].label,
    )
    assert torch.equal(got, entries[0].value()) and not torch.equal(got, zeros)
    journal.close()
    led.close()


def _header(path) -> dict:
    import sqlite3

    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT key, value FROM header"))


def test_recovery_refuses_a_different_run(tmp_path, monkeypatch):
    """A recovered run that asks for another release than the journal holds at that seq is refused
    in one line, before anything is drawn or charged."""
    with monkeypatch.context() as m:
        _crash_after(m, 2)
        with pytest.raises(Crash):
            run_training(_cfg(tmp_path / "run"), log=lambda s: None)
    path = tmp_path / "run" / JOURNAL_FILE
    run_id = json.loads(_header(path)["run_id"])
    before = _ledger_rows(tmp_path / "run" / "ledger.sqlite")
    led = PrivacyLedger(tmp_path / "run" / "ledger.sqlite", run_id=run_id)
    journal = ReleaseJournal.open(path)
    rel = Releaser(led, NoiseSource(0), journal=journal, replay=True)
    drawn = []
    with pytest.raises(RecoveryMismatch, match="not the same run"):
        rel.release(GaussianCharge(0.01, 1.0), lambda: drawn.append(1), user_ids=["0", "1"], label="other")
    assert drawn == [] and _ledger_rows(tmp_path / "run" / "ledger.sqlite") == before
    journal.close()
    led.close()


def test_a_run_an_older_version_prepaid_and_killed_recovers_without_charging_twice(tmp_path, monkeypatch):
    """A ledger written before prepay was removed: the first process charged releases ahead in batches (rows
    marked 'prepaid': releases 1..4, and at seq 5 a release its plan foresaw for another cohort, an outsider:
    the run spends its whole budget) and died after 2 journalled releases. Those rows are charges like any
    other: the ledger verifies, and the recovery lets each back the release it was charged for (nothing
    charged twice); the prepaid row that matches no release stays charged and refuses nothing, and release 5
    is charged on its own. The run ends with the uninterrupted run's model and releases."""
    from fedkl.privacy.charges import from_record
    from fedkl.privacy.ledger import cohort_digest

    clean = run_training(_cfg(tmp_path / "clean"), log=lambda s: None)
    clean_rows = _ledger_rows(clean["ledger"]["path"])
    with monkeypatch.context() as m:
        _crash_after(m, 2)
        with pytest.raises(Crash):
            run_training(_cfg(tmp_path / "crashed"), log=lambda s: None)
    ledger = tmp_path / "crashed" / "ledger.sqlite"
    run_id = json.loads(_header(tmp_path / "crashed" / JOURNAL_FILE)["run_id"])
    with PrivacyLedger(ledger) as led:
        members = led.cohorts()
    off_plan = {**clean_rows[5], "label": "noisy-gd/a-release-never-made", "cohort": cohort_digest(["outsider"])}
    members[off_plan["cohort"]] = ["outsider"]
    late = PrivacyLedger(ledger, run_id=run_id)  # (not `with`: its exit would end the run)
    for row in [*clean_rows[3:5], off_plan]:  # what the old prepay had charged ahead of the crash
        late.charge(members[row["cohort"]], from_record(row["charge"]), label=row["label"], seq=row["seq"])
    late._db.execute("UPDATE releases SET state = 'prepaid' WHERE seq >= 1")
    late.close()
    with PrivacyLedger(ledger) as led:
        led.verify()  # an older version's rows are read and verified like any other
    lines = []
    recover_run(str(tmp_path / "crashed"), log=lines.append)
    assert "2 releases replayed" in " ".join(lines)
    assert torch.equal(_model(tmp_path / "crashed"), _model(tmp_path / "clean"))
    rows = _ledger_rows(ledger)
    assert [r.pop("state") for r in rows] == [None] + ["prepaid"] * 5 + [None]  # one row added: release 5
    strip = [{k: v for k, v in r.items() if k != "state"} for r in (*clean_rows[:5], off_plan, clean_rows[5])]
    assert rows == strip
    with PrivacyLedger(ledger) as led, PrivacyLedger(clean["ledger"]["path"]) as ref:
        led.verify()
        spends = led.user_spends()
        assert [u for u in spends if u["user_id"] != "outsider"] == ref.user_spends()  # each release charged once
        assert [u["releases"] for u in spends if u["user_id"] == "outsider"] == [1]  # and stays charged


# every kind of release: scheduled Gaussian steps (dp-fedavg), the exponential mechanism (noisy-fw),
# releases chosen from earlier ones (kl-adaptive-gd), a stability test with (eps, delta) charges
# (mean-output-pert), charge-only releases (vr-fw)
KINDS = ["dp-fedavg", "noisy-fw", "kl-adaptive-gd", "mean-output-pert", "vr-fw"]


@pytest.mark.parametrize("name", [*KINDS, "dp-ftrl"])  # dp-ftrl: seeded recovery with its noise draws kept
def test_recovery_of_every_kind_of_release(tmp_path, monkeypatch, name):
    def cfg(out):
        return small_config(name, out)

    clean = run_training(cfg(tmp_path / "clean"), log=lambda s: None)
    with monkeypatch.context() as m:
        _crash_after(m, min(1, len(_ledger_rows(clean["ledger"]["path"])) - 1))  # one replayed where it can
        with pytest.raises(Crash):
            run_training(cfg(tmp_path / "crashed"), log=lambda s: None)
    recovered = recover_run(str(tmp_path / "crashed"), log=lambda s: None)
    ledger = tmp_path / "crashed" / "ledger.sqlite"
    assert _ledger_rows(ledger) == _ledger_rows(clean["ledger"]["path"])
    assert _spends(ledger) == _spends(clean["ledger"]["path"])
    assert (recovered["model_path"] is None) == (clean["model_path"] is None)
    if clean["model_path"]:
        assert torch.equal(_model(tmp_path / "crashed"), _model(tmp_path / "clean"))


def test_take_over_refuses_a_live_run_and_a_finished_one(tmp_path):
    import subprocess
    import sys

    from fedkl.privacy import LedgerBusy, LedgerError
    from fedkl.privacy.ledger import _process_start

    path = tmp_path / "l.sqlite"
    with PrivacyLedger(path, Budget(5.0, 1e-6), run_id="r") as led:
        led.reserve(["a", "b"])
        led.charge(["a", "b"], GaussianCharge(0.01, 1.0), label="x", seq=0)
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            led._db.execute("UPDATE runs SET pid = ?, proc_start = ?", (child.pid, _process_start(child.pid)))
            other = PrivacyLedger(path, run_id="r")  # (not `with`: its exit would end run r)
            with pytest.raises(LedgerBusy, match="still running"):
                other.take_over(["a", "b"])
            other.close()
            assert [r["status"] for r in led.runs()] == ["running"]
        finally:
            child.stdin.close()
            child.wait()
        with PrivacyLedger(path, run_id="r") as again:  # its process is gone now: taken over
            again.take_over(["a", "b"])
            assert [(r["status"], r["pid"], r["reserved_users"]) for r in again.runs()] == [("running", os.getpid(), 2)]
            again.finish_run("finished")
            with pytest.raises(LedgerError, match="ended finished: there is nothing to recover"):
                again.take_over(["a", "b"])


def test_fedkl_run_recover_refuses_other_options_and_a_folder_without_journal(tmp_path, capsys):
    from fedkl.cli import main

    assert main(["run", "--recover", str(tmp_path), "--epsilon", "3"]) == 2
    assert "--recover takes no other option" in capsys.readouterr().err
    assert main(["run", "--recover", str(tmp_path)]) == 3
    err = capsys.readouterr().err.strip()
    assert "no release journal there" in err and len(err.splitlines()) == 1


def test_recover_of_a_run_whose_process_lives_is_refused_and_leaves_it_running(tmp_path, monkeypatch):
    import sqlite3
    import subprocess
    import sys

    from fedkl.privacy import LedgerBusy
    from fedkl.privacy.ledger import _process_start

    with monkeypatch.context() as m:
        _crash_after(m, 2)
        with pytest.raises(Crash):
            run_training(_cfg(tmp_path / "run"), log=lambda s: None)
    ledger = tmp_path / "run" / "ledger.sqlite"
    before = _ledger_rows(ledger)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with sqlite3.connect(ledger) as db:  # as if the run were still going in another process
            db.execute(
                "UPDATE runs SET status = 'running', pid = ?, proc_start = ?", (child.pid, _process_start(child.pid))
            )
        with pytest.raises(LedgerBusy, match="still running"):
            recover_run(str(tmp_path / "run"), log=lambda s: None)
        with PrivacyLedger(ledger) as led:
            assert [(r["status"], r["pid"]) for r in led.runs()] == [("running", child.pid)]
        assert _ledger_rows(ledger) == before
    finally:
        child.stdin.close()
        child.wait()


# one of each kind of release and of budget question asked mid-run (fkt-snowball's approx_left per batch,
# phased-erm's per phase); all 29 registered algorithms passed this once (3 min: too slow for every run)
def _lose_the_buffer(m) -> None:
    """A crash drops what the journal buffered (its values and noise draws): ``close`` (the runner's
    ``finally``) finds nothing to flush."""
    close = ReleaseJournal.close

    def crashed(self):
        for buffer in (self._pending, getattr(self, "_pending_draws", [])):
            buffer.clear()
        close(self)

    m.setattr(ReleaseJournal, "close", crashed)


def test_a_release_buffered_but_never_flushed_is_redrawn_under_its_charge(tmp_path, monkeypatch):
    """The journal is durable at egress, not per release, and each ledger write is egress of the values
    before it: when the process 'dies' at release 4 (no progress line since round 1: the throttle is long),
    0..3 were made durable before release 4's charge, and recovery returns them; release 4 (charged, drawn,
    only buffered) never left the process, so it is redrawn under its durable charge, charging nothing twice,
    and the run ends with the uninterrupted run's model and ledger."""
    import fedkl.runner as runner

    clean = tmp_path / "clean"
    run_training(_cfg(clean), log=lambda s: None)
    with monkeypatch.context() as m:
        m.setattr(runner, "PROGRESS_EVERY_S", 1e9)  # only round 1's record flushes before the crash
        _crash_after(m, 4)
        _lose_the_buffer(m)
        with pytest.raises(Crash):
            run_training(_cfg(tmp_path / "crashed"), log=lambda s: None)
    journal = ReleaseJournal.open(tmp_path / "crashed" / JOURNAL_FILE)
    held = sorted(journal.entries())
    assert held == [0, 1, 2, 3]  # what release 4's charge flushed before it was written
    journal.close()
    ledger = tmp_path / "crashed" / "ledger.sqlite"
    assert [r["seq"] for r in _ledger_rows(ledger)] == list(range(5))  # 0..4 charged (durable before drawn)
    lines = []
    recover_run(str(tmp_path / "crashed"), log=lines.append)
    assert f"{len(held)} releases replayed" in " ".join(lines)
    assert torch.equal(_model(tmp_path / "crashed"), _model(clean))
    assert _ledger_rows(ledger) == _ledger_rows(clean / "ledger.sqlite")  # each release charged once
    assert _spends(ledger) == _spends(clean / "ledger.sqlite")


def test_every_progress_line_is_preceded_by_a_flush(tmp_path, monkeypatch):
    """A journal spy: whenever the run logs a line, no journal holds a buffered (not durable) entry."""
    import fedkl.runner as runner

    journals: list[ReleaseJournal] = []
    original = ReleaseJournal.record

    def record(self, *a, **kw):
        if self not in journals:
            journals.append(self)
        return original(self, *a, **kw)

    monkeypatch.setattr(ReleaseJournal, "record", record)
    monkeypatch.setattr(runner, "PROGRESS_EVERY_S", 0.0)  # a line every round
    lines: list[str] = []

    def log(line: str) -> None:
        assert all(j.buffered == 0 for j in journals), line
        lines.append(line)

    run_training(_cfg(tmp_path / "run"), log=log)
    assert journals and sum(line.startswith("  round ") for line in lines) == ROUNDS
    assert journals[0].flushes >= ROUNDS  # one per line (each line follows a new release)


def test_progress_lines_are_throttled_to_one_a_second_with_first_last_and_eta():
    from fedkl.runner import ProgressEgress, RunObserver

    now = [0.0]
    lines, flushed, seen = [], [], []

    class Observer(RunObserver):
        def round(self, record: dict) -> None:
            seen.append(record["round"])

    progress = ProgressEgress(Observer(), lines.append, clock=lambda: now[0], every_s=1.0)
    progress.flush = lambda: flushed.append(len(lines))
    for k in range(1, 11):  # 0.3 s a round
        progress({"round": k, "rounds": 10, "noisy_grad_norm": 2.5})
        now[0] += 0.3
    assert seen == [1, 5, 9, 10]  # first, then >= 1 s apart (0, 1.2, 2.4 s), and the last
    assert flushed == [0, 1, 2, 3]  # a flush before each record handed out
    assert lines[1] == "  round    5/10  noisy grad norm 2.5  ETA 2 s"  # 1.2 s for 4 rounds, 5 rounds left
    assert lines[-1] == "  round   10/10  noisy grad norm 2.5"


def test_dp_ftrl_recovered_with_secure_noise_continues_from_the_original_draws(tmp_path, monkeypatch):
    """issue 28 §1: dp-ftrl's later noise depends on earlier draws (the tree generator). With secure noise
    (os.urandom, nothing to replay), a crash after k journalled releases and a recovery: the generator is
    fed the FIRST process's draws for releases 0..k-1 (they are journalled as its secret), so every later
    release carries the noise the uninterrupted generator makes from the original draws, not from re-drawn
    ones (which would correlate the later noise with draws that were never released)."""
    from fedkl.privacy.matrix_mechanism import TreeNoise

    fed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (Z_t fed, B Z row returned), in this process
    step = TreeNoise.step

    def spy(self, z):
        out = step(self, z)
        fed.append((z.clone(), out.clone()))
        return out

    monkeypatch.setattr(TreeNoise, "step", spy)
    k, rounds = 2, 4  # the tree's release 2 carries Z_1 + Z_2: Z_1 was drawn by the first process
    cfg = small_config("dp-ftrl", tmp_path / "run", noise_seed=None, rounds=rounds)
    with monkeypatch.context() as m:
        _crash_after(m, k)  # releases 0..k-1 journalled (they left the process), release k drawn, never journalled
        with pytest.raises(Crash):
            run_training(cfg, log=lambda s: None)
    first, fed[:] = list(fed), []
    lines = []
    recover_run(str(tmp_path / "run"), log=lines.append)
    assert f"{k} releases replayed" in " ".join(lines) and len(fed) == rounds
    for t in range(k):  # the generator's state is the first process's
        assert torch.equal(fed[t][0], first[t][0]), f"release {t}: the generator was fed a re-drawn Z"
    assert not torch.equal(fed[k][0], first[k][0])  # release k never left: drawn afresh under its charge
    uninterrupted = TreeNoise.__new__(TreeNoise)
    uninterrupted.__init__()
    for t, z in enumerate([z for z, _ in first[:k]] + [z for z, _ in fed[k:]]):
        assert torch.equal(step(uninterrupted, z), fed[t][1]), f"release {t}'s noise is not the original draws'"
    assert not [f for f in os.listdir(tmp_path / "run") if "secret" in f]  # finished: the secret is purged


def test_kl_adaptive_gd_killed_after_a_charge_computed_from_a_buffered_value_recovers(tmp_path, monkeypatch):
    """issue 28 §1: kl-adaptive-gd's gradient release is charged at a rho computed from the noisy norm just
    released. The process dies right after that ledger row is durable and before any other flush: the norm
    must already be journalled (a ledger write is egress of every value released before it), and recovery
    then succeeds with the uninterrupted run's ledger (secure noise: KeyedNoise, fresh bits where the first
    process's values had left)."""
    from release_spies import KeyedNoise  # tests/release_spies.py

    import fedkl.runner as runner

    keyed = KeyedNoise(monkeypatch, 1)
    monkeypatch.setattr(runner, "PROGRESS_EVERY_S", 1e9)  # no progress flush but the first and last round's
    clean = run_training(small_config("kl-adaptive-gd", tmp_path / "clean", noise_seed=None), log=lambda s: None)
    labels = [r["label"] for r in _ledger_rows(clean["ledger"]["path"])]
    i = labels.index("kl-adaptive-gd/round-1/norm")  # its gradient release (i + 1) is charged from it
    assert labels[i + 1] == "kl-adaptive-gd/round-1/grad"
    charge = PrivacyLedger.charge

    def dies_after_the_charge(self, *a, seq=None, **kw):
        out = charge(self, *a, seq=seq, **kw)
        if seq == i + 1:
            raise Crash
        return out

    with monkeypatch.context() as m:
        m.setattr(PrivacyLedger, "charge", dies_after_the_charge)
        _lose_the_buffer(m)
        with pytest.raises(Crash):
            run_training(small_config("kl-adaptive-gd", tmp_path / "run", noise_seed=None), log=lambda s: None)
    journal = ReleaseJournal.open(tmp_path / "run" / JOURNAL_FILE)
    held = sorted(journal.entries())
    journal.close()
    assert i in held, f"release {i + 1}'s charge is durable, the value {i} it was computed from is not: {held}"
    keyed.salt = lambda seq: 2 if seq in held else 1  # fresh draws where a value had left
    recover_run(str(tmp_path / "run"), log=lambda s: None)
    ledger = tmp_path / "run" / "ledger.sqlite"
    assert _ledger_rows(ledger) == _ledger_rows(clean["ledger"]["path"])  # each release charged once
    assert _spends(ledger) == _spends(clean["ledger"]["path"])
    assert torch.equal(_model(tmp_path / "run"), _model(tmp_path / "clean"))


def test_a_recovery_may_name_a_new_ray_cluster_but_no_other_new_setting(tmp_path, monkeypatch):
    """Where the workers are (``--ray-address``, runner.WHERE) is not what the run computes: a recovery after
    the cluster came back at another address is the same run; any other changed setting is refused."""
    from fedkl.runner import open_recovery

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        _crash_after(m, 2)
        with pytest.raises(Crash):
            run_training(_cfg(out), log=lambda s: None)
    open_recovery(str(out), _cfg(out, ray_address="10.0.0.9:6379")).close()
    with pytest.raises(JournalError, match=r"\(lr differ\)"):
        open_recovery(str(out), _cfg(out, lr=0.25))
    res = recover_run(str(out), log=lambda s: None, ray_address="10.0.0.9:6379")  # in-process: the address is unused
    assert res["ledger"]["releases"] == ROUNDS


def test_fedkl_run_recover_accepts_a_ray_address(tmp_path, capsys):
    from fedkl.cli import main

    assert main(["run", "--recover", str(tmp_path), "--ray-address", "10.0.0.9:6379"]) == 3  # no journal there
    assert "--recover takes no other option" not in capsys.readouterr().err
