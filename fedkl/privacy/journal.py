"""The release journal: every value a run released, durable before it leaves the process.

A run's :class:`~fedkl.privacy.release.Releaser` numbers its releases 0, 1, 2, ... (``seq``) and,
right after drawing a noisy value and BEFORE returning it, records ``(seq, label, charge record,
cohort digest, value)`` here. :meth:`ReleaseJournal.record` serialises the value at once (so a later
in-place change of the tensor cannot alter what was journalled) and BUFFERS it in memory;
:meth:`ReleaseJournal.flush` writes every buffered entry in ONE transaction. The file is SQLite in WAL
mode with ``synchronous=FULL``: an entry is on disk (fsync of the WAL) when the flush that wrote it
returns; a kill -9 or a power loss keeps every flushed entry.

Durable at egress, not per release
----------------------------------
What recovery needs (:class:`~fedkl.privacy.release.Releaser`, "Recovery") is exactly: a release that
is charged but not journalled NEVER LEFT THE PROCESS (neither the value nor anything computed from
it), so that it may be redrawn under its charge. Values that stay inside the server's process need no
fsync one by one: the journal is flushed before every egress, i.e. before anything that depends on a
released value can leave the process. The egress points of a run (:func:`fedkl.runner.train_federation`
and the transports), each preceded by :meth:`Releaser.flush <fedkl.privacy.release.Releaser.flush>`:

1. every progress record the runner hands out (its log lines, which carry ``noisy_grad_norm`` and
   metrics, and the :class:`~fedkl.runner.RunObserver`'s ``round``): flushed first, throttled to at
   most one a second plus the first and last round (so a fast run fsyncs about once a second);
2. every message a Flower transport sends to nodes (:class:`fedkl.flower.federation.FlowerFederation`
   calls its federation's ``before_send`` hook, wired by the runner to the Releaser's flush, before
   ``push_messages`` and ``send_and_receive``, the SecAgg+ exchanges included): the model sent to
   clients is computed from released values;
3. the end of the algorithm's run (before the runner logs the outcome and writes ``model.pt`` and
   ``result.json``, the only files a run writes to its out folder after its first release besides the
   ledger, which holds charges and no value, and this journal), and every
   exit path: :meth:`close` flushes, and the runner closes the journal in a ``finally`` (an exception
   or Ctrl-C; only kill -9, a power loss or an abort skip it, and then nothing else left either).

The in-process federation and the Ray shard actors (:mod:`fedkl.federation.ray_shards`) receive the
released model each round but belong to the server's trusted side: what they compute comes back to
the server and leaves only through the points above (a shard actor prints nothing and writes no
file). So the recovery argument holds unchanged: an entry not yet flushed when the process died
belongs to a value that no one outside the process saw; the Releaser redraws it under its durable
charge (never a second charge), and a value that did leave was flushed first, so recovery returns it
and never a fresh draw. Flushing more often than this is always safe (a journalled value is returned
by recovery, which is post-processing of a charged release).

The journal also keeps the run's header: its settings and what its users could still afford when it
started (``rho_left``, ``approx_left``), so that ``fedkl run --recover`` rebuilds the very same
algorithm (sized to that budget, not to what the ledger has left after the crash). How recovery uses
it, and why it neither double-charges nor leaks: :class:`~fedkl.privacy.release.Releaser`.

The values are private outputs (already noisy): the journal is as sensitive as the released model,
no more. Values are stored with ``torch.save`` and read back with ``weights_only=True`` (tensors,
numbers, None: bit for bit).
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
from dataclasses import dataclass

import torch

_SCHEMA = """
CREATE TABLE IF NOT EXISTS header (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY, label TEXT NOT NULL, charge TEXT NOT NULL, cohort TEXT NOT NULL, value BLOB NOT NULL);
"""


class JournalError(RuntimeError):
    """The journal is missing, unreadable, or does not match the run being recovered."""


@dataclass(frozen=True)
class JournalEntry:
    seq: int
    label: str
    charge: dict
    cohort: str
    blob: bytes

    def value(self):
        """The released value, exactly as it was returned the first time."""
        return torch.load(io.BytesIO(self.blob), weights_only=True)


def _dumps(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class ReleaseJournal:
    """One run's journal file (see the module docstring). :meth:`create` starts a fresh one for a
    new run; :meth:`open` reads an existing one to recover its run and appends to it."""

    def __init__(self, path: str | os.PathLike, db: sqlite3.Connection) -> None:
        self.path = os.fspath(path)
        self._db = db
        self._pending: list[tuple] = []  # recorded, not yet flushed (not durable)
        self.flushes = 0  # transactions written by flush() (each one fsync)

    @classmethod
    def _connect(cls, path: str) -> sqlite3.Connection:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a commit returns after the WAL's fsync
        db.executescript(_SCHEMA)
        return db

    @classmethod
    def create(cls, path: str | os.PathLike, header: dict) -> "ReleaseJournal":
        """A new, empty journal at ``path`` with ``header`` (a journal left there by an earlier run
        is replaced: that run can no longer be recovered, its ledger charges stay)."""
        path = os.fspath(path)
        for stale in (path, path + "-wal", path + "-shm"):
            if os.path.exists(stale):
                os.remove(stale)
        db = cls._connect(path)
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT INTO header VALUES (?, ?)", ((k, json.dumps(v, default=str)) for k, v in header.items()))
        db.execute("COMMIT")
        return cls(path, db)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ReleaseJournal":
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise JournalError(f"{path}: no release journal there (only a run started by `fedkl run` keeps one)")
        try:
            return cls(path, cls._connect(path))
        except sqlite3.Error as e:
            raise JournalError(f"{path} is not a readable release journal ({e})") from None

    def header(self) -> dict:
        return {k: json.loads(v) for k, v in self._db.execute("SELECT key, value FROM header")}

    def record(self, seq: int, label: str, charge: dict, cohort: str, value) -> None:
        """Buffer one released value (serialised now); durable after the next :meth:`flush`."""
        self._pending.append((seq, label, json.dumps(charge, sort_keys=True), cohort, _dumps(value)))

    @property
    def buffered(self) -> int:
        """How many recorded entries are not durable yet."""
        return len(self._pending)

    def flush(self) -> None:
        """Write every buffered entry in ONE transaction, durable (fsync) when this returns; nothing
        to do when none is buffered. Call before anything computed from them leaves the process."""
        if not self._pending:
            return
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?)", self._pending)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self._pending.clear()
        self.flushes += 1

    def entries(self) -> dict[int, JournalEntry]:
        """The durable (flushed) entries, by seq."""
        return {
            seq: JournalEntry(seq, label, json.loads(charge), cohort, bytes(blob))
            for seq, label, charge, cohort, blob in self._db.execute(
                "SELECT seq, label, charge, cohort, value FROM entries ORDER BY seq"
            )
        }

    def __len__(self) -> int:
        """How many entries are durable (flushed)."""
        return self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def close(self) -> None:
        """Flush what is buffered, then close (every exit path of a run calls this)."""
        try:
            self.flush()
        finally:
            self._db.close()
