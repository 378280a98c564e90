"""`fedkl run --recover` and the ledger (issue 31): a recovery never creates a ledger (a fresh file in place of
a deleted one would stand for what the run spent, with nothing of it), nor a run in another run's ledger; and
`fedkl ledger verify` during a recovered run gives the right answer."""

from __future__ import annotations

import os
import shutil

import pytest

from fedkl.cli import main
from fedkl.privacy import Budget, PrivacyLedger
from fedkl.privacy.journal import ReleaseJournal
from fedkl.runner import RunConfig, default_delta, run_training

SETTINGS = dict(dataset="synthetic-logistic", users=6, algorithm="noisy-gd", epsilon=2.0, rounds=4, seed=3,
                noise_seed=11, reference=False)  # fmt: skip


class Died(BaseException):
    """The run's process dying (nothing of the run handles it)."""


def _crashed_run(tmp_path, monkeypatch, k: int = 2):
    """A run folder whose process 'died' at its (k+1)-th journalled release (charged per release)."""
    original, seen = ReleaseJournal.record, []

    def record(self, *a, **kw):
        if len(seen) == k:
            raise Died
        seen.append(a[0])
        return original(self, *a, **kw)

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(ReleaseJournal, "record", record)
        with pytest.raises(Died):
            run_training(RunConfig.from_settings(**SETTINGS, out=str(out)), log=lambda s: None)
    return out


def _tree(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def test_recover_with_the_ledger_deleted_says_what_is_missing_and_creates_nothing(tmp_path, monkeypatch, capsys):
    out = _crashed_run(tmp_path, monkeypatch)
    (out / "ledger.sqlite").unlink()
    monkeypatch.chdir(tmp_path)
    before = _tree(tmp_path)
    assert main(["run", "--recover", str(out)]) == 3
    err = capsys.readouterr().err.strip()
    assert f"{out / 'ledger.sqlite'}, is missing" in err and "\n" not in err
    assert _tree(tmp_path) == before  # no ledger, no run folder: nothing created


def test_recover_against_another_ledger_is_refused_and_adds_no_run_to_it(tmp_path, monkeypatch, capsys):
    out = _crashed_run(tmp_path, monkeypatch)
    other = tmp_path / "other.sqlite"
    with PrivacyLedger(other, Budget(2.0, default_delta(6))):  # its budget is the run's
        pass
    (out / "ledger.sqlite").unlink()
    shutil.copy(other, out / "ledger.sqlite")  # a ledger that is not the run's (same file name)
    assert main(["run", "--recover", str(out)]) == 3
    err = capsys.readouterr().err.strip()
    assert "has no run" in err and "\n" not in err
    with PrivacyLedger(out / "ledger.sqlite") as led:
        assert led.runs() == [] and led.num_releases() == 0


class _PausedAt:
    """A ledger handle's connection that runs ``meanwhile()`` once, just before the first statement
    containing ``marker``: another process's commit landing between two statements of a reader."""

    def __init__(self, db, marker: str, meanwhile) -> None:
        self._db, self._marker, self._meanwhile = db, marker, meanwhile

    def execute(self, sql, *args):
        if self._meanwhile is not None and self._marker in sql:
            meanwhile, self._meanwhile = self._meanwhile, None
            meanwhile()
        return self._db.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._db, name)


def test_verify_reads_one_snapshot_while_a_run_charges(tmp_path):
    """The root cause of "ledger totals of user ... do not match its release log" during a recovered run
    (charged release by release, so a charge commits every few milliseconds): verify read the release log,
    the cohorts and the users' totals in separate read transactions, so a charge committed between them
    made the totals newer than the log it had summed. It reads one snapshot now: the charge waits for it."""
    from fedkl.privacy.charges import GaussianCharge
    from fedkl.privacy.ledger import LedgerError

    path = tmp_path / "ledger.sqlite"
    with PrivacyLedger(path, Budget(2.0, 1e-3)) as led:
        led.charge(["a", "b"], GaussianCharge(0.01, 1.0), label="r0")
    blocked = []

    def charge_meanwhile():  # the run's next charge, from its own handle; never waits (timeout 0)
        try:
            with PrivacyLedger(path, timeout=0) as run:
                run.charge(["a", "b"], GaussianCharge(0.01, 1.0), label="r1")
        except LedgerError as e:
            blocked.append(str(e))

    with PrivacyLedger(path) as reader:
        reader._db = _PausedAt(reader._db, "FROM cohorts", charge_meanwhile)
        reader.verify()  # the log and totals of one moment: right
    assert len(blocked) == 1 and "locked" in blocked[0]  # the charge waited for the reader
    with PrivacyLedger(path) as run:  # and goes through once it is done
        run.charge(["a", "b"], GaussianCharge(0.01, 1.0), label="r1")
        run.verify()


def test_fedkl_ledger_verify_between_every_two_transactions_of_a_recovered_run(tmp_path, monkeypatch, capsys):
    """Recovery writes in an order a crash cannot make inconsistent: every write (take-over, each charge, the
    end of the run) is one transaction, and `fedkl ledger verify` run after each of them passes."""
    from fedkl.runner import recover_run

    out = _crashed_run(tmp_path, monkeypatch)
    path = str(out / "ledger.sqlite")
    original, verdicts = PrivacyLedger._transaction, []

    def transaction(self):  # a verify from another handle after each transaction of the run commits
        with original(self) as db:
            yield db
        if self.path == path and self.run_id is not None:
            verdicts.append(main(["ledger", "verify", path]))

    import contextlib

    monkeypatch.setattr(PrivacyLedger, "_transaction", contextlib.contextmanager(transaction))
    recover_run(str(out), log=lambda s: None)
    err = capsys.readouterr().err
    assert len(verdicts) >= 4 and set(verdicts) == {0}, err  # take-over, the 2 releases left, the end
