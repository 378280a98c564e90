"""kill -9 at every release index, for every registered algorithm, with secure noise (issue 28, §3).

For each algorithm of the registry at its small setting (tests/build_helpers.py SMALL), with secure
(unseeded) noise and ``fedkl run``'s defaults (each release charged right before its draw), the process "dies" at each crash point below; ``fedkl run --recover`` then finishes the run from its
journal and ledger, and the generic check asserts:

(a) every value that left the first process (durable in its journal) is returned unchanged by the recovery;
(b) every ledger row backs at most one value that left any process (one row per seq, one value per seq),
    and every value was drawn only once its charge was durable (checked at every draw, in every process);
(c) every value the recovery releases is the uninterrupted run's value with the same noise: the first
    process's draws for what it released, fresh draws for the rest. For an algorithm whose later noise
    depends on earlier draws (``register(..., noise_state=True)``: dp-ftrl's correlated noise) this says the
    generator was rebuilt from the ORIGINAL draws, not from re-drawn ones; the released model follows;
(d) the ledger after recovery equals the uninterrupted run's (same rows, same per-user spends).

Secure noise, made comparable: :class:`release_spies.KeyedNoise` keys every draw by the release it is made
for; the recovering process draws other ("fresh") bits at every seq its first process drew (journalled or
lost with it), as os.urandom would, and the uninterrupted run's bits elsewhere. The reference of (c) is the
uninterrupted run with the same fresh bits at the lost seqs (the values redrawn under their charges) and the
first bits everywhere else: a recovery that feeds re-drawn noise into anything later differs from it, and
one that redraws a value a durable charge was computed from is refused (the charge no longer matches).

Crash points (a kill -9 is simulated in-process: a BaseException raised by a spy, and the journal's
in-memory buffer dropped, as the process's memory would be):

* ``charged k``: at the start of release k's draw. Its ledger row is durable (written at this release, or
  with its schedule), nothing of it is drawn, and whatever the journal had buffered since the last flush is lost.
  A death anywhere from the ledger write to the next flush leaves the same state on disk (the draw, the
  buffer and in-process computation write nothing), so this one point stands for that whole window: the
  one where a charge computed from a buffered value (kl-adaptive-gd) could be durable without the value.
  Progress records are throttled as far as they go (first and last round only) to make the window widest.
* ``flushed f``: right after the f-th journal flush that made a new value durable (a progress record
  every round, so every round's release gets its own point): those values left the process; recovery
  must return them and continue from exactly the state the first process had, its noise state included.
* A death before a release's ledger write leaves nothing of that release on disk: the state of a death in
  the previous release's window (its ``charged`` point), or of a run that never started: no point of its own.

Every release index is a ``charged`` point where a run has at most LIMIT releases (the small settings make
1-14); past that the first, the middle, the last, and the first release of every kind (its label without
numbers), so every kind of release each algorithm makes is hit. ``flushed`` points: the middle and the last
flush (everything journalled). An earlier flush needs no point of its own: a crash right after it leaves what
the ``charged`` point of the next release leaves when that release writes its ledger row (the Releaser
flushes before every ledger write: the same journal, one row more), and the middle flush stands for the
scheduled releases, which write none. A crash that leaves the same state on disk as an earlier
point (journal, lost draws, ledger rows) is not recovered twice. Negative controls: dp-ftrl registered without
its ``noise_state`` declaration, and kl-adaptive-gd under a Releaser that writes the ledger without flushing
the journal first (the old behaviour): the check fails on both.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from build_helpers import SMALL, small_config  # tests/build_helpers.py
from release_spies import KeyedNoise  # tests/release_spies.py
from test_journal_recovery import Crash, _ledger_rows, _lose_the_buffer, _model, _spends  # tests/privacy

import fedkl.algorithms.catalog  # noqa: F401  (fills the registry)
import fedkl.runner as runner
from fedkl.algorithms.registry import REGISTRY, register, unregister
from fedkl.privacy.journal import ReleaseJournal
from fedkl.privacy.release import Releaser, ScheduledGaussian
from fedkl.runner import JOURNAL_FILE, recover_run, run_training

NAMES = sorted(REGISTRY)
FIRST, FRESH = 1, 2  # KeyedNoise salts: the first process (and the uninterrupted run), a recovery's fresh draws


def _same(a, b) -> bool:
    if isinstance(a, ScheduledGaussian) or isinstance(b, ScheduledGaussian):  # a schedule's handle (journalled: None)
        return isinstance(a, ScheduledGaussian | None) and isinstance(b, ScheduledGaussian | None)
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


class Process:
    """Spies on one process's releases: the value each returns, by seq, and whether its charge was durable
    when it was drawn; ``crash_at``: die at the start of that release's draw."""

    def __init__(self, monkeypatch, crash_at: int | None = None) -> None:
        self.values: dict[int, object] = {}
        self.labels: dict[int, str] = {}
        self.undrawn_charge: list[str] = []
        emit = Releaser._emit

        def spy(rel, seq, label, record, cohort, sample):
            rows = rel.ledger.run_releases()
            step = record.get("type") == "scheduled-step"  # charged with its schedule, at an earlier seq
            ok = (
                any(r["label"] == label.split("#")[0] for r in rows)
                if step
                else any((r["seq"], r["label"], r["cohort"]) == (seq, label, cohort) for r in rows)
            )
            if not ok or rel.ledger._db.in_transaction:
                self.undrawn_charge.append(f"release {seq} ({label}) drawn before its charge was durable")
            if seq == crash_at:
                raise Crash
            value = emit(rel, seq, label, record, cohort, sample)
            self.values[seq] = value.clone() if torch.is_tensor(value) else value
            self.labels[seq] = label
            return value

        monkeypatch.setattr(Releaser, "_emit", spy)


def _crash_at_flush(m, f: int) -> None:
    """Die right after the f-th journal flush that makes a new value durable (0-based)."""
    flush, seen = ReleaseJournal.flush, []

    def spy(self):
        before = len(self)
        flush(self)
        if len(self) > before and len(seen) <= f:
            seen.append(len(self))
            if len(seen) == f + 1:
                raise Crash

    m.setattr(ReleaseJournal, "flush", spy)


SECURE = {"noise_seed": None}  # secure noise (KeyedNoise stands in for os.urandom)
LIMIT = 3  # crash at every release (and every flush) of a run that has at most this many, else at a sample
# settings beyond SMALL: kl-adaptive-gd's gradient charges depend on the noisy norms only above its noise
# floor (at SMALL every charge is the floor's), so that the check sees a charge computed from a released value;
# the paper-002 stability tests at 8 users make the same releases as at 12 in a twentieth of the time
SETTINGS = {
    "kl-adaptive-gd": {"users": 100, "epsilon": 10.0},
    **{name: {"users": 8} for name in ("phased-erm", "sc-phased-erm", "sc-output-pert", "sc-phased-sco")},
}


def _run(cfg, monkeypatch, progress_every_s: float, crash_at=None, crash_flush=None) -> tuple[dict | None, Process]:
    with monkeypatch.context() as m:
        m.setattr(runner, "PROGRESS_EVERY_S", progress_every_s)
        proc = Process(m, crash_at)
        if crash_at is None and crash_flush is None:
            return run_training(cfg, log=lambda s: None), proc
        if crash_flush is not None:
            _crash_at_flush(m, crash_flush)
        _lose_the_buffer(m)
        with pytest.raises(Crash):
            run_training(cfg, log=lambda s: None)
        return None, proc


class Reference:
    """An uninterrupted run of ``name`` with KeyedNoise's ``salt``: its result, its released values (and
    labels) by seq, and how many journal flushes made a new value durable (a progress record every round)."""

    def __init__(self, name: str, out, monkeypatch, settings: dict, salt=lambda seq: FIRST) -> None:
        self.flushes = 0
        flush = ReleaseJournal.flush

        def count(journal):
            before = len(journal)
            flush(journal)
            self.flushes += len(journal) > before

        self.dir = out
        with monkeypatch.context() as m:
            KeyedNoise(m).salt = salt
            m.setattr(ReleaseJournal, "flush", count)
            self.result, proc = _run(small_config(name, out, **settings), m, 0.0)
        self.values, self.labels = proc.values, proc.labels

    def crash_points(self, limit: int = LIMIT) -> list[tuple]:
        """("charged", k) points: every one where there are at most ``limit``; else the first, the last, the
        middle one, and the first release of every kind (its label with the numbers taken out), so that every
        kind of release is crashed at. ("flushed", f) points: the middle and the last flush (module docstring)."""

        def pick(n: int, firsts: set[int]) -> list[int]:
            return list(range(n)) if n <= limit else sorted({0, n // 2, n - 1} | firsts)

        kinds: dict[str, int] = {}
        for seq in sorted(self.labels):
            kinds.setdefault(re.sub(r"[0-9]+", "#", self.labels[seq]), seq)
        charged = pick(len(self.values), set(kinds.values()))
        flushed = sorted({self.flushes // 2, self.flushes - 1}) if self.flushes else []
        return [("charged", k) for k in charged] + [("flushed", f) for f in flushed]


def check_recovery(
    name: str, tmp_path, monkeypatch, settings: dict, clean: Reference, point: tuple, seen: list
) -> None:
    """Crash the run of ``name`` at ``point`` (("charged", k) or ("flushed", f)), recover it and assert
    (a)-(d) of the module docstring against the uninterrupted run (AssertionError on any failure). ``seen``:
    the durable states (journal, lost draws, ledger rows) already recovered, skipped (appended to)."""
    kind, k = point
    progress_every_s = 1e9 if kind == "charged" else 0.0  # the widest buffered window; a flush every round
    dead_dir = tmp_path / f"{kind}-{k}"
    with monkeypatch.context() as m:
        keyed = KeyedNoise(m)
        _, first = _run(
            small_config(name, dead_dir, **settings),
            m,
            progress_every_s,
            crash_at=k if kind == "charged" else None,
            crash_flush=k if kind == "flushed" else None,
        )
        journal = ReleaseJournal.open(dead_dir / JOURNAL_FILE)
        left = {seq: e.value() for seq, e in journal.entries().items()}  # what left the first process
        journal.close()
        lost = set(first.values) - set(left)  # drawn by the first process, lost with it: redrawn afresh
        state = (sorted(left), sorted(lost), [(r["seq"], r["state"]) for r in _ledger_rows(dead_dir / "ledger.sqlite")])
        if state in seen:  # what is on disk is another point's (the recovery would be the same): checked there
            return
        seen.append(state)
        keyed.salt = lambda seq: FRESH if seq in left or seq in lost else FIRST
        m.setattr(runner, "PROGRESS_EVERY_S", progress_every_s)
        rec = Process(m)
        try:
            recovered = recover_run(str(dead_dir), log=lambda s: None)
        except Exception as e:  # a recovery that is refused is a failure of the check
            raise AssertionError(f"{name} {kind} {k}: the recovery failed: {type(e).__name__}: {e}") from e
    if lost:  # the uninterrupted run with those fresh draws
        clean = Reference(
            name, tmp_path / f"ref-{kind}-{k}", monkeypatch, settings, lambda s: FRESH if s in lost else FIRST
        )
    where = f"{name} {kind} {k} ({len(left)} values had left the first process, {len(lost)} were lost)"
    # (b) every value drawn after its charge was durable, in both processes
    assert not first.undrawn_charge + rec.undrawn_charge, f"{where}: {first.undrawn_charge + rec.undrawn_charge}"
    # (a) what left the first process is what the recovery returns
    for seq, value in left.items():
        assert seq in rec.values and _same(rec.values[seq], value), f"{where}: release {seq} left, recovery changed it"
    # (c) every released value is the uninterrupted run's, with the original draws where they had left
    assert sorted(rec.values) == sorted(clean.values), f"{where}: other releases than the uninterrupted run's"
    differ = [s for s in sorted(rec.values) if not _same(rec.values[s], clean.values[s])]
    assert not differ, f"{where}: releases {differ} are not the uninterrupted run's (noise fed re-drawn draws?)"
    assert (recovered["model_path"] is None) == (clean.result["model_path"] is None), f"{where}: model"
    if clean.result["model_path"]:
        assert torch.equal(_model(dead_dir), _model(clean.dir)), f"{where}: not the uninterrupted run's model"
    # (b, d) one ledger row per seq, the uninterrupted run's rows (a recovery charges per release past the
    # rows its first process charged) and per-user spends
    rows = _ledger_rows(dead_dir / "ledger.sqlite")
    seqs = [r["seq"] for r in rows]
    assert len(seqs) == len(set(seqs)), f"{where}: a seq charged twice: {seqs}"
    assert rows == _ledger_rows(clean.result["ledger"]["path"]), f"{where}: not the uninterrupted run's ledger rows"
    assert _spends(dead_dir / "ledger.sqlite") == _spends(clean.result["ledger"]["path"]), f"{where}: spends"


def check_every_point(name: str, tmp_path, monkeypatch, settings: dict | None = None) -> list[str]:
    """The failures of :func:`check_recovery` over the crash points of ``name`` (empty: it passed)."""
    settings = {**SECURE, **SETTINGS.get(name, {}), **(settings or {})}
    clean = Reference(name, tmp_path / "clean", monkeypatch, settings)
    failures, seen = [], []
    for point in clean.crash_points():
        try:
            with monkeypatch.context() as m:
                check_recovery(name, tmp_path, m, settings, clean, point, seen)
        except AssertionError as e:
            failures.append(str(e).splitlines()[0][:400])
    return failures


@pytest.mark.parametrize("name", NAMES)
def test_kill_at_every_release_then_recover(tmp_path, monkeypatch, name):
    assert name in SMALL, f"{name}: give it a small setting in tests/build_helpers.py SMALL"
    failures = check_every_point(name, tmp_path, monkeypatch)
    assert not failures, "\n".join(failures)


def test_the_check_catches_stateful_noise_that_is_not_declared(tmp_path, monkeypatch):
    """dp-ftrl registered WITHOUT ``noise_state``: its recovery feeds re-drawn noise into the tree generator,
    so a later release carries noise correlated with draws that were never released: caught by (c)."""
    spec = REGISTRY["dp-ftrl"]
    assert spec.noise_state  # the real one declares it
    register(type("Undeclared", (spec.cls,), {"name": "dp-ftrl-undeclared", "noise_state": False}))
    try:
        failures = check_every_point("dp-ftrl-undeclared", tmp_path, monkeypatch)
    finally:
        unregister("dp-ftrl-undeclared")
    assert failures and all("not the uninterrupted run's" in f for f in failures), failures


def test_the_check_catches_a_ledger_write_before_the_journal_flush(tmp_path, monkeypatch):
    """kl-adaptive-gd under the old Releaser (a ledger row written while the value its charge was computed
    from is only buffered): killed there, the recovery re-draws that value and is refused, caught."""
    monkeypatch.setattr(Releaser, "_flush_before_ledger_write", lambda self: None)
    failures = check_every_point("kl-adaptive-gd", tmp_path, monkeypatch)
    assert failures and all("charged" in f for f in failures), failures
    assert any("recovery failed" in f for f in failures), failures


def test_the_noise_draws_are_a_secret_of_the_run_folder_purged_when_it_finishes(tmp_path, monkeypatch):
    """Where the secret lives: beside the journal, readable by its owner only (0600, its WAL too), and
    deleted once the run finished; a run of an algorithm without noise state keeps none."""
    seen = []
    close = ReleaseJournal.close

    def spy(self):
        secret = self.secret_path
        if secret is not None and os.path.exists(secret):
            seen.extend(os.stat(p).st_mode & 0o777 for p in (secret, secret + "-wal") if os.path.exists(p))
        close(self)

    monkeypatch.setattr(ReleaseJournal, "close", spy)
    run_training(small_config("dp-ftrl", tmp_path / "ftrl", noise_seed=None), log=lambda s: None)
    assert seen and set(seen) == {0o600}
    assert not [f for f in os.listdir(tmp_path / "ftrl") if "secret" in f]  # purged: the run finished
    seen.clear()
    run_training(small_config("noisy-gd", tmp_path / "gd", noise_seed=None), log=lambda s: None)
    assert not seen and not [f for f in os.listdir(tmp_path / "gd") if "secret" in f]


@pytest.mark.parametrize("factorization", ["banded", "blt", "blt-opt"])
def test_every_correlated_noise_generator_recovers_from_the_original_draws(tmp_path, monkeypatch, factorization):
    """dp-ftrl's other generators (the registry's run above uses the tree): banded Toeplitz and BLT keep
    earlier draws in their state too."""
    failures = check_every_point("dp-ftrl", tmp_path, monkeypatch, {"factorization": factorization})
    assert not failures, "\n".join(failures)


def test_a_run_whose_noise_draws_are_gone_is_refused_before_anything_is_charged(tmp_path, monkeypatch):
    """Recovery of a dp-ftrl run with secure noise needs its secret: without it (deleted, or a journal that
    never kept one) it is refused in one line, the ledger unchanged."""
    import sqlite3

    from fedkl.privacy.journal import JournalError, secret_path

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        _crash_at_flush(m, 1)
        _lose_the_buffer(m)
        with pytest.raises(Crash):
            run_training(small_config("dp-ftrl", out, noise_seed=None), log=lambda s: None)
    before = _ledger_rows(out / "ledger.sqlite")
    secret = secret_path(str(out / JOURNAL_FILE))
    os.rename(secret, secret + ".away")
    with pytest.raises(JournalError, match="noise draws .* are gone"):
        recover_run(str(out), log=lambda s: None)
    os.rename(secret + ".away", secret)
    with sqlite3.connect(out / JOURNAL_FILE) as db:  # as a journal written before the draws were kept
        db.execute("UPDATE header SET value = 'false' WHERE key = 'noise_draws'")
    with pytest.raises(JournalError, match="cannot be recovered"):
        recover_run(str(out), log=lambda s: None)
    assert _ledger_rows(out / "ledger.sqlite") == before


FLOAT32 = sorted(n for n, spec in REGISTRY.items() if spec.cls.float32)


@pytest.mark.parametrize("name", FLOAT32)
def test_a_float32_run_killed_mid_run_recovers_to_the_uninterrupted_float32_run(tmp_path, monkeypatch, name):
    """``--dtype float32`` for every algorithm that declares ``float32``: killed at its middle release (charged,
    not drawn) and right after its last flush, then recovered, it releases the uninterrupted float32 run's values
    (float64 ones, as every release is) and model (float32, bit for bit), with its ledger (check_recovery's (a)-(d)).
    Two points, not every one: the journal and the ledger do not depend on the dtype (the float64 runs above
    crash at every point); these check that a float32 run's recovery rebuilds its float32 problem and state."""
    settings = {**SECURE, **SETTINGS.get(name, {}), "dtype": "float32"}
    clean = Reference(name, tmp_path / "clean", monkeypatch, settings)
    assert clean.result["model_path"] and _model(clean.dir).dtype == torch.float32
    assert all(v.dtype == torch.float64 for v in clean.values.values() if torch.is_tensor(v))
    points = [("charged", len(clean.values) // 2)] + ([("flushed", clean.flushes - 1)] if clean.flushes else [])
    seen: list = []
    for point in points:
        with monkeypatch.context() as m:
            check_recovery(name, tmp_path, m, settings, clean, point, seen)
        assert _model(tmp_path / f"{point[0]}-{point[1]}").dtype == torch.float32  # (torch.equal ignores dtypes)
