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

1. every ledger transaction of the run (a release's charge): :class:`~fedkl.privacy.release.Releaser`
   flushes before each. A charge may be computed from a released value (kl-adaptive-gd's gradient
   release is charged at a rho chosen from the noisy norm just released), so a durable ledger row can carry information about every value released before it: if it
   were durable while such a value was only buffered, a recovery would redraw that value (a second draw
   under one charge, and a recomputed charge that no longer matches the row: a run that can never be
   recovered). A ledger row is therefore egress of every value released before it. Cheap: the run
   already pays a durable ledger transaction per release;
2. every progress record the runner hands out (its log lines, which carry ``noisy_grad_norm`` and
   metrics, and the :class:`~fedkl.runner.RunObserver`'s ``round``): flushed first, throttled to at
   most one a second plus the first and last round (so a fast run fsyncs about once a second);
3. every message a Flower transport sends to nodes (:class:`fedkl.flower.federation.FlowerFederation`
   calls its federation's ``before_send`` hook, wired by the runner to the Releaser's flush, before
   ``push_messages`` and ``send_and_receive``, the SecAgg+ exchanges included): the model sent to
   clients is computed from released values;
4. the end of the algorithm's run (before the runner logs the outcome and writes ``model.pt`` and
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

The noise draws: a secret, for algorithms with noise state
----------------------------------------------------------
An algorithm registered with ``noise_state=True`` (:func:`fedkl.algorithms.registry.register`: a release's
noise depends on the noise drawn for earlier releases, e.g. dp-ftrl's correlated-noise generators) cannot
be recovered from its released values alone: with secure noise nothing can re-draw what the first process
drew, and feeding fresh draws into the generator would make later releases carry noise correlated with
draws that were never released (true rho up to 1.88x the charged rho after one crash). For such a run the
journal also keeps, per release, the raw random bits the release drew from the run's
:class:`~fedkl.privacy.rng.NoiseSource` (:meth:`record_draws`; the Releaser records them, and plays them back
in recovery so that the generator is rebuilt exactly as the first process had it).

Those bits with the released value give the EXACT aggregate (value minus noise): they are a secret of the
run, as sensitive as the users' data. Where it lives: a separate SQLite file beside the journal,
``<journal>-secret.sqlite`` (:attr:`secret_path`; its ``-wal``/``-shm`` files take the same mode), created
readable and writable by its owner only (0600): only the account that runs the server (which already sees
every exact aggregate) may read it; never copy it with the results. It is flushed with the journal, the
secret FIRST, so a durable entry always has its durable draws (draws without an entry belong to a value
that never left: recovery redraws it and replaces them). It is deleted (:meth:`purge_secret`) as soon as
the run has finished: a finished run cannot be recovered, so nothing needs it any more; a run that died
keeps it until its recovery finishes. A run of an algorithm without noise state keeps no secret. Its size:
8 bytes per Gaussian coordinate drawn, about the size of the journalled values themselves.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
from dataclasses import dataclass

import numpy as np
import torch

_SCHEMA = """
CREATE TABLE IF NOT EXISTS header (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY, label TEXT NOT NULL, charge TEXT NOT NULL, cohort TEXT NOT NULL, value BLOB NOT NULL);
"""


_SECRET_SCHEMA = "CREATE TABLE IF NOT EXISTS draws (seq INTEGER PRIMARY KEY, bits BLOB NOT NULL);"
SECRET_MODE = 0o600  # the noise draws: readable by the server's account only


def secret_path(path: str) -> str:
    """Where the journal at ``path`` keeps its noise draws (module docstring)."""
    base, ext = os.path.splitext(path)
    return f"{base}-secret{ext or '.sqlite'}"


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

    def __init__(
        self, path: str | os.PathLike, db: sqlite3.Connection, secret: sqlite3.Connection | None = None
    ) -> None:
        self.path = os.fspath(path)
        self._db = db
        self._secret = secret  # the noise draws (module docstring), for an algorithm with noise state
        self.secret_path = secret_path(self.path) if secret is not None else None
        self._pending: list[tuple] = []  # recorded, not yet flushed (not durable)
        self._pending_draws: list[tuple] = []
        self.flushes = 0  # transactions written by flush() (each one fsync)

    @classmethod
    def _connect(cls, path: str) -> sqlite3.Connection:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # a commit returns after the WAL's fsync
        db.executescript(_SCHEMA)
        return db

    @classmethod
    def _connect_secret(cls, path: str) -> sqlite3.Connection:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")  # SQLite creates the -wal and -shm files with the file's mode
        db.execute("PRAGMA synchronous=FULL")
        db.execute(_SECRET_SCHEMA)
        return db

    @classmethod
    def create(cls, path: str | os.PathLike, header: dict, noise_draws: bool = False) -> "ReleaseJournal":
        """A new, empty journal at ``path`` with ``header`` (a journal left there by an earlier run
        is replaced: that run can no longer be recovered, its ledger charges stay). ``noise_draws``: it
        also keeps the noise draws of each release, a secret (module docstring; an algorithm registered
        with ``noise_state``)."""
        path = os.fspath(path)
        secret = secret_path(path)
        for stale in (path, secret):
            for name in (stale, stale + "-wal", stale + "-shm"):
                if os.path.exists(name):
                    os.remove(name)
        keep = None
        if noise_draws:  # created 0600 before SQLite opens it (never readable by others, not even briefly)
            os.close(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SECRET_MODE))
            os.chmod(secret, SECRET_MODE)  # whatever the umask
            keep = cls._connect_secret(secret)
        db = cls._connect(path)
        db.execute("BEGIN IMMEDIATE")
        header = {**header, "noise_draws": bool(noise_draws)}
        db.executemany("INSERT INTO header VALUES (?, ?)", ((k, json.dumps(v, default=str)) for k, v in header.items()))
        db.execute("COMMIT")
        return cls(path, db, keep)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ReleaseJournal":
        """The journal at ``path`` (and its noise draws, if its run keeps them: JournalError, nothing
        charged, when they are gone)."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise JournalError(f"{path}: no release journal there (only a run started by `fedkl run` keeps one)")
        try:
            db = cls._connect(path)
        except sqlite3.Error as e:
            raise JournalError(f"{path} is not a readable release journal ({e})") from None
        try:
            row = db.execute("SELECT value FROM header WHERE key = 'noise_draws'").fetchone()
            secret = None
            if row is not None and json.loads(row[0]):
                if not os.path.isfile(secret_path(path)):
                    raise JournalError(
                        f"{path}: its run's noise draws ({secret_path(path)}) are gone, and its later noise "
                        "depends on them: it cannot be recovered (nothing was charged)"
                    )
                secret = cls._connect_secret(secret_path(path))
        except BaseException:
            db.close()
            raise
        return cls(path, db, secret)

    @property
    def keeps_draws(self) -> bool:
        """Whether this journal keeps each release's noise draws (a secret; module docstring)."""
        return self._secret is not None

    def header(self) -> dict:
        return {k: json.loads(v) for k, v in self._db.execute("SELECT key, value FROM header")}

    def record(self, seq: int, label: str, charge: dict, cohort: str, value) -> None:
        """Buffer one released value (serialised now); durable after the next :meth:`flush`."""
        self._pending.append((seq, label, json.dumps(charge, sort_keys=True), cohort, _dumps(value)))

    def record_draws(self, seq: int, bits: np.ndarray) -> None:
        """Buffer the raw random bits (uint64) release ``seq`` drew, a secret (module docstring); durable
        after the next :meth:`flush`, before the release's entry."""
        if self._secret is None:
            raise JournalError(f"{self.path}: this journal keeps no noise draws")
        self._pending_draws.append((seq, np.ascontiguousarray(bits, dtype="<u8").tobytes()))

    @property
    def buffered(self) -> int:
        """How many recorded entries are not durable yet."""
        return len(self._pending)

    @staticmethod
    def _commit(db: sqlite3.Connection, sql: str, rows: list[tuple]) -> None:
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(sql, rows)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def flush(self) -> None:
        """Write every buffered entry in ONE transaction, durable (fsync) when this returns; nothing
        to do when none is buffered. Call before anything computed from them leaves the process. The
        noise draws (if kept) are written first, in their own transaction: an entry is never durable
        without its draws. A recovery replaces the draws of a seq whose entry never became durable."""
        if self._pending_draws:
            self._commit(self._secret, "INSERT OR REPLACE INTO draws VALUES (?, ?)", self._pending_draws)
            self._pending_draws.clear()
        if not self._pending:
            return
        self._commit(self._db, "INSERT INTO entries VALUES (?, ?, ?, ?, ?)", self._pending)
        self._pending.clear()
        self.flushes += 1

    def draws(self) -> dict[int, np.ndarray]:
        """The durable noise draws, by seq (empty when this journal keeps none)."""
        if self._secret is None:
            return {}
        return {
            seq: np.frombuffer(bits, dtype="<u8") for seq, bits in self._secret.execute("SELECT seq, bits FROM draws")
        }

    def purge_secret(self) -> None:
        """Delete the noise draws (their files): at the end of a run that finished (module docstring)."""
        if self._secret is not None:
            self._pending_draws.clear()
            self._secret.close()
            self._secret = None
        path = secret_path(self.path)
        for name in (path, path + "-wal", path + "-shm"):
            if os.path.exists(name):
                os.remove(name)

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
            if self._secret is not None:
                self._secret.close()
