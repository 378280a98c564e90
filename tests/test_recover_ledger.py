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
            run_training(RunConfig.from_settings(**SETTINGS, out=str(out)), log=lambda s: None, prepay=False)
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
