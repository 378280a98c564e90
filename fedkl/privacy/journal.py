"""The release journal: every value a run released, durable before the algorithm sees it.

A run's :class:`~fedkl.privacy.release.Releaser` numbers its releases 0, 1, 2, ... (``seq``) and,
right after drawing a noisy value and BEFORE returning it, commits ``(seq, label, charge record,
cohort digest, value)`` here. The file is SQLite in WAL mode with ``synchronous=FULL``: a record is
on disk (fsync of the WAL) when :meth:`ReleaseJournal.record` returns, so no released value can leave
the process, by any path, unjournalled; a kill -9 or a power loss keeps every journalled value.

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
        """Commit one released value (durable when this returns)."""
        self._db.execute(
            "INSERT INTO entries VALUES (?, ?, ?, ?, ?)",
            (seq, label, json.dumps(charge, sort_keys=True), cohort, _dumps(value)),
        )

    def entries(self) -> dict[int, JournalEntry]:
        return {
            seq: JournalEntry(seq, label, json.loads(charge), cohort, bytes(blob))
            for seq, label, charge, cohort, blob in self._db.execute(
                "SELECT seq, label, charge, cohort, value FROM entries ORDER BY seq"
            )
        }

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def close(self) -> None:
        self._db.close()
