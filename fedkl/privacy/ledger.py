"""The per-user privacy ledger: every release is charged to every participating user BEFORE it is made.

Storage is one SQLite file with a rollback journal (``journal_mode=DELETE``) and
``synchronous=FULL``: a charge returns only after its transaction is durable, so a crash (SIGKILL,
power loss) at any point either happened before the charge committed (then nothing was released
either: releases happen after the charge returns) or after (then the charge is on disk). A restarted
run that opens the same file sees what was spent. The journal mode is a decision: under WAL a
committed charge can live in ``ledger.sqlite-wal`` until a checkpoint, so copying the ``.sqlite``
file alone silently dropped charges (a reset budget); with a rollback journal every committed charge
is in the main file, so a copy made while no charge is being written is complete. A ledger written
in WAL mode (schema 2) is checkpointed and switched at its first open.

Runs (:meth:`PrivacyLedger.reserve`): a run first verifies the ledger, then reserves, atomically, its
users' whole remaining budget (every fedkl run is sized to what its users have left): while it is
``running`` no other handle can charge those users or see budget left for them, so a second run on
the same users is refused in one line naming the active run (its id, pid, host, start) instead of
both runs sizing themselves to the full budget and exhausting it half-way. A run ends ``finished``,
``failed``, ``interrupted`` or ``refused`` (it ended before making any release), and its reservation
ends with it. The reservation of a run whose process died without ending it (SIGKILL, power loss) is
released only by :meth:`PrivacyLedger.release_stale` (``fedkl ledger release-stale PATH``), after a
check that its process is gone.

A budget counts as spent when what is left is below :data:`SPENT_BELOW` of it (see there).

What a user spends has three parts, composed as follows:

* ``rho``: zCDP charges (Gaussian mechanisms ...), added up (zCDP composition, fully adaptive);
* ``eps``, ``delta``: approximate-DP charges of mechanisms that are not zCDP (e.g. a PTR test),
  added up by basic composition.

A user's guarantee at the budget's delta is ``eps(u) = zcdp_to_eps(rho_u, delta - delta_u) + eps_u``
(valid because composing a (eps1, delta1) and a (eps2, delta2) guarantee gives
(eps1 + eps2, delta1 + delta2); a PTR's (0, delta) charge, the delta of approximate zCDP, composes the
same way: Bun & Steinke 2016 Def. 8.1, :data:`~fedkl.privacy.charges.APPROX_ZCDP_DELTA`). A charge is refused, atomically and with nothing written, if it would
take any participating user's ``eps(u)`` above the budget's epsilon. The refusal is computed from
the ledger alone (public bookkeeping), never from the users' data.

Each release row carries its number in its run (``seq``, :class:`fedkl.privacy.release.Releaser`)
and a ``state`` (:data:`RELEASE_STATES`); :meth:`PrivacyLedger.take_over` hands a run whose process died
to the process that recovers it (``fedkl run --recover``).

Cohorts (the list of users a release charged) are stored once per distinct cohort, so full
participation over many rounds costs one row per round, and :meth:`PrivacyLedger.verify` can
recompute every user's total from the release log.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import socket
import sqlite3
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from fedkl.privacy.charges import APPROX_ZCDP_DELTA, Charge, Need, from_record, to_record
from fedkl.privacy.filter import BudgetExhausted
from fedkl.privacy.zcdp import CONVERSIONS, rho_for_eps_delta, zcdp_to_eps

SCHEMA_VERSION = 4  # 2: releases.charge holds the typed charge; 3: runs' pid/host, reservations; 4: releases' seq
# and state. Older: upgraded
# A release row's state: NULL (charged right before it was made: every row this version writes). An older
# version also wrote 'prepaid' (charged ahead in a batch) and 'unused' (charged ahead, never made): such rows
# are charges like any other (every total counts them, verify checks them; recovery: fedkl.privacy.release)
RELEASE_STATES = (None, "prepaid", "unused")
_REL_TOL = 1e-12
# What is left of a budget (rho, or an (eps, delta) part) below this fraction of the budget counts as spent.
# Derived from two facts: (1) the ledger's own slack is far below it -- approx_left leaves 1e-9 of delta
# and 1e-12 of eps unoffered by construction, and float sums over a million releases drift by about
# 1e6 * 2**-53 ~ 1e-10 relative -- so what an interrupted-and-resumed ledger keeps (rho ~ 5e-15) is
# float dust, not budget; (2) nothing useful is lost: the best single release on 1e-6 of the budget has
# noise at least 1e-6**-0.5 = 1000x that of one release on the whole budget.
SPENT_BELOW = 1e-6
RUN_STATUSES = ("running", "finished", "failed", "interrupted", "refused")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, started REAL NOT NULL, config TEXT NOT NULL, status TEXT NOT NULL,
    pid INTEGER, host TEXT, proc_start TEXT, ended REAL, note TEXT);
CREATE TABLE IF NOT EXISTS reservations (user_id TEXT PRIMARY KEY, run_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cohorts (
    id INTEGER PRIMARY KEY, digest TEXT UNIQUE NOT NULL, size INTEGER NOT NULL, members TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS releases (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT, label TEXT NOT NULL, mechanism TEXT NOT NULL,
    sensitivity REAL, noise_scale REAL, rho REAL NOT NULL, eps REAL NOT NULL, delta REAL NOT NULL,
    cohort_id INTEGER NOT NULL REFERENCES cohorts(id), created REAL NOT NULL, details TEXT, charge TEXT,
    seq INTEGER, state TEXT);
CREATE TABLE IF NOT EXISTS users (
    user_id TEXT PRIMARY KEY, rho REAL NOT NULL, eps REAL NOT NULL, delta REAL NOT NULL,
    releases INTEGER NOT NULL);
"""


_RUN_COLUMNS_V3 = ("pid INTEGER", "host TEXT", "proc_start TEXT", "ended REAL", "note TEXT")
_RELEASE_COLUMNS_V4 = ("charge TEXT", "seq INTEGER", "state TEXT")


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux /proc), else None: with the
    pid it identifies a process, so a reused pid is not taken for the run that held it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int | None, proc_start: str | None) -> bool:
    """Whether process ``pid`` (started at ``proc_start``, when recorded) still runs on this host."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    return proc_start is None or _process_start(pid) in (None, proc_start)


class LedgerError(RuntimeError):
    """The ledger file is unusable as asked (wrong budget, wrong schema ...)."""


class BudgetExceeded(BudgetExhausted):
    """A charge would take a user over the budget; nothing was charged and nothing may be released."""


class LedgerBusy(LedgerError):
    """The users' budget is reserved by another running run (nothing was charged or reserved)."""


@dataclass(frozen=True)
class Budget:
    """Each user's (epsilon, delta)-DP budget for everything charged to this ledger."""

    epsilon: float
    delta: float
    conversion: str = "cks"

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"budget epsilon must be finite and > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"budget delta must be in (0, 1), got {self.delta}")
        if self.conversion not in CONVERSIONS:
            raise ValueError(f"conversion must be one of {CONVERSIONS}, got {self.conversion!r}")

    @property
    def rho(self) -> float:
        """The zCDP budget when nothing but zCDP charges are made."""
        return _rho_cap(self.epsilon, self.delta, self.conversion)


@dataclass(frozen=True)
class UserSpend:
    user_id: str
    rho: float = 0.0
    eps: float = 0.0
    delta: float = 0.0
    releases: int = 0

    def epsilon(self, delta: float, conversion: str = "cks") -> float:
        """This user's (eps, delta)-DP guarantee for everything charged so far."""
        if self.delta >= delta:
            return math.inf
        if self.rho == 0:
            return self.eps
        return zcdp_to_eps(self.rho, delta - self.delta, conversion) + self.eps


@functools.lru_cache(maxsize=4096)
def _rho_cap(eps_left: float, delta_left: float, conversion: str) -> float:
    """Largest total rho that still fits in (eps_left, delta_left) (conservative)."""
    if eps_left <= 1e-9 or delta_left <= 0:  # nothing (or only float dust) left for zCDP charges
        return 0.0
    return rho_for_eps_delta(eps_left, min(delta_left, 1 - 1e-15), conversion)


def _digest(members: Sequence[str]) -> str:
    return hashlib.sha256("\x1f".join(members).encode()).hexdigest()


class PrivacyLedger:
    """Durable per-user accounting (see the module docstring for the guarantee).

    Args:
        path: the SQLite file (created if missing).
        budget: required when the file is new; when the file exists it must equal the stored one
            (``None`` reads the stored budget).
        run_id: tag written on every release made through this handle.
        scratch: a throw-away ledger (a plan's dry run on a temporary file): no fsync
            (``synchronous=OFF``); never for a ledger that protects anyone's budget.
        new_run: record ``run_id`` as a new ``running`` run (if the ledger has no such run); False for a
            handle that continues a run (:meth:`take_over`), which must find the run there.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        budget: Budget | None = None,
        run_id: str | None = None,
        run_config: dict | None = None,
        timeout: float = 60.0,
        scratch: bool = False,
        new_run: bool = True,
    ) -> None:
        self.path = os.fspath(path)
        self.run_id = run_id
        self.timeout = timeout
        self.scratch = scratch
        if budget is None and not os.path.exists(self.path):
            raise LedgerError(f"{self.path} does not exist: a new ledger needs a budget (epsilon, delta)")
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, timeout=timeout)
        except sqlite3.Error as e:
            raise self._error(e) from None
        try:
            mode = self._db.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
            if mode not in ("delete", "memory"):  # a WAL ledger open elsewhere cannot be switched (":memory:": memory)
                raise LedgerError(
                    f"ledger {self.path} is in {mode} mode and open in another process (an older fedkl?); "
                    "close it there and retry (nothing was charged or released)"
                )
            self._db.execute("PRAGMA synchronous=" + ("OFF" if scratch else "FULL"))
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            self._db.execute("CREATE TEMP TABLE IF NOT EXISTS cohort (user_id TEXT PRIMARY KEY)")
            self._db.execute(
                "CREATE TEMP TABLE IF NOT EXISTS totals (rho REAL, eps REAL, delta REAL, rho_t REAL, eps_t REAL, "
                "delta_t REAL, PRIMARY KEY (rho, eps, delta))"
            )
            self.budget = self._init_budget(budget)
            if run_id is not None and new_run:
                self._db.execute(
                    "INSERT OR IGNORE INTO runs (run_id, started, config, status, pid, host, proc_start) "
                    "VALUES (?, ?, ?, 'running', ?, ?, ?)",
                    (
                        run_id,
                        time.time(),
                        json.dumps(run_config or {}, default=str),
                        os.getpid(),
                        socket.gethostname(),
                        _process_start(os.getpid()),
                    ),
                )
        except sqlite3.Error as e:
            self._db.close()
            raise self._error(e) from None
        except BaseException:
            self._db.close()
            raise

    def _error(self, e: sqlite3.Error) -> LedgerError:
        """A one-line LedgerError for an SQLite failure (locked, corrupt, not a database ...)."""
        text = str(e)
        if "locked" in text or "busy" in text:
            why = f"is locked by another process (waited {self.timeout:g} s); retry when it is done"
        elif "not a database" in text or "malformed" in text or "corrupt" in text:
            why = "is not a readable fedkl ledger (corrupt, or not an SQLite file); restore it from a copy"
        else:
            why = f"cannot be used: {text}"
        return LedgerError(f"ledger {self.path} {why} (nothing was charged or released)")

    # --- set-up ------------------------------------------------------------------------------
    def _init_budget(self, budget: Budget | None) -> Budget:
        rows = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if "budget" not in rows:
            if budget is None:
                raise LedgerError(f"{self.path} is a new ledger: give it a budget (epsilon, delta)")
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('budget', ?)", (json.dumps(asdict(budget)),))
            self._db.execute("COMMIT")
            rows = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if int(rows["schema"]) in (1, 2, 3):  # an older ledger: add the new columns, keep every row
            self._db.execute("BEGIN IMMEDIATE")
            for table, column in (
                *(("releases", c) for c in _RELEASE_COLUMNS_V4),
                *(("runs", c) for c in _RUN_COLUMNS_V3),
            ):
                if column.split()[0] not in {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
            self._db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (str(SCHEMA_VERSION),))
            self._db.execute("COMMIT")
            rows["schema"] = str(SCHEMA_VERSION)
        if int(rows["schema"]) != SCHEMA_VERSION:
            raise LedgerError(f"{self.path}: ledger schema {rows['schema']} is not {SCHEMA_VERSION}")
        stored = Budget(**json.loads(rows["budget"]))
        if budget is not None and budget != stored:
            raise LedgerError(
                f"{self.path} was created with budget eps={stored.epsilon}, delta={stored.delta} "
                f"({stored.conversion}); this run asks for eps={budget.epsilon}, delta={budget.delta} "
                f"({budget.conversion}). Use the stored budget or a new ledger file."
            )
        return stored

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "PrivacyLedger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """End this handle's run if it is still running (:meth:`end_status`), then close."""
        try:
            if self.run_id is not None:
                self.finish_run(self.end_status(exc))
        except LedgerError:
            if exc is None:  # else the exception that ended the run is the one to report
                raise
        finally:
            self.close()

    def end_status(self, exc: BaseException | None) -> str:
        """The exact status of this handle's run ending with ``exc``: ``finished`` (no exception),
        ``interrupted`` (Ctrl-C, or a signal turned into KeyboardInterrupt/SystemExit), ``refused``
        (an error before this run made any release) or ``failed``."""
        if exc is None:
            return "finished"
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return "interrupted"
        return "failed" if self.run_id is not None and self.num_releases(self.run_id) else "refused"

    def finish_run(self, status: str = "finished", note: str | None = None) -> None:
        """End this handle's run with ``status`` and release its reservation, in one transaction.
        Only a ``running`` run changes: the first end recorded is the one kept."""
        if status not in RUN_STATUSES[1:]:
            raise ValueError(f"a run ends with one of {RUN_STATUSES[1:]}, got {status!r}")
        if self.run_id is not None:
            self._end_runs([self.run_id], status, note)

    @contextlib.contextmanager
    def _transaction(self):
        """One write transaction (BEGIN IMMEDIATE ... COMMIT), rolled back on any exception, an
        interrupt included; SQLite failures become one-line LedgerErrors."""
        db = self._db
        try:
            if db.in_transaction:  # a write cut short by an interrupt before its COMMIT: it never happened
                self._forget()
                db.execute("ROLLBACK")
            try:
                db.execute("BEGIN IMMEDIATE")
                yield db
                db.execute("COMMIT")
            except BaseException:
                self._forget()
                if db.in_transaction:  # (an interrupt can also land after COMMIT)
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            raise self._error(e) from None

    def _end_runs(self, run_ids: Sequence[str], status: str, note: str | None) -> None:
        with self._transaction() as db:
            for run_id in run_ids:
                db.execute(
                    "UPDATE runs SET status = ?, ended = ?, note = ? WHERE run_id = ? AND status = 'running'",
                    (status, time.time(), note, run_id),
                )
                db.execute("DELETE FROM reservations WHERE run_id = ?", (run_id,))

    # --- runs: reservation, listing, stale runs ----------------------------------------------
    def reserve(self, user_ids: Iterable[str]) -> None:
        """Start this handle's run: verify the ledger (every total recomputed from the release log,
        :meth:`verify`), then reserve every listed user's remaining budget for this run, atomically.

        Raises LedgerError if the ledger does not verify, :class:`LedgerBusy` (one line naming the
        active run: id, pid, host, start) if another running run holds any of these users. Either
        way nothing is reserved and this run ends ``refused``."""
        if self.run_id is None:
            raise ValueError("reserve() needs a handle opened with a run_id")
        members = sorted(set(map(str, user_ids)))
        try:
            with self._transaction() as db:
                self.verify()
                self._fill_cohort(members)
                holder = self._holder()
                if holder is None:
                    db.execute("INSERT INTO reservations SELECT user_id, ? FROM temp.cohort WHERE true", (self.run_id,))
        except LedgerError:
            self.finish_run("refused", "the ledger did not verify")
            raise
        if holder is not None:
            self.finish_run("refused", f"users held by run {holder[0]}")
            raise LedgerBusy(self._busy_message(holder, "nothing was charged or reserved"))

    def take_over(self, user_ids: Iterable[str]) -> None:
        """Continue this handle's run (``run_id``) after its process died: the crash recovery of
        ``fedkl run --recover``. Refused (LedgerError, nothing changed) unless the run exists, was
        started on this host and its process is gone (``running`` with a dead pid, or already ended
        ``interrupted``/``failed`` by its own handler or by ``release-stale``), and while another
        running run holds any of its users (LedgerBusy). Then, after :meth:`verify`, atomically:
        the run is ``running`` again under this process and holds its users' budget."""
        if self.run_id is None:
            raise ValueError("take_over() needs a handle opened with a run_id")
        members = sorted(set(map(str, user_ids)))
        with self._transaction() as db:
            row = db.execute(
                "SELECT status, pid, host, proc_start FROM runs WHERE run_id = ?", (self.run_id,)
            ).fetchone()
            if row is None:
                raise LedgerError(f"ledger {self.path} has no run {self.run_id} to recover (nothing was charged)")
            status, pid, host, proc_start = row
            mine = pid == os.getpid() and proc_start == _process_start(os.getpid())
            if status not in ("running", "interrupted", "failed"):
                raise LedgerError(
                    f"run {self.run_id} ended {status}: there is nothing to recover (nothing was charged)"
                )
            if host != socket.gethostname():
                raise LedgerError(f"run {self.run_id} ran on host {host}: recover it there (nothing was charged)")
            if status == "running" and not mine and _alive(pid, proc_start):
                raise LedgerBusy(f"run {self.run_id} is still running (pid {pid}); stop it before recovering it")
            self.verify()
            self._fill_cohort(members)
            holder = self._holder()
            if holder is not None:
                raise LedgerBusy(self._busy_message(holder, "nothing was charged or reserved"))
            db.execute(
                "UPDATE runs SET status = 'running', pid = ?, proc_start = ?, ended = NULL, note = ? WHERE run_id = ?",
                (os.getpid(), _process_start(os.getpid()), f"recovered after pid {pid}", self.run_id),
            )
            db.execute("DELETE FROM reservations WHERE run_id = ?", (self.run_id,))
            db.execute("INSERT INTO reservations SELECT user_id, ? FROM temp.cohort WHERE true", (self.run_id,))

    def run_releases(self) -> list[dict]:
        """This handle's run's releases, in order: ``id``, ``seq``, ``state``, ``label``, ``charge``
        (the stored typed-charge record) and ``cohort`` (the digest of the users charged)."""
        keys = ("id", "seq", "state", "label", "charge", "cohort")
        rows = self._db.execute(
            "SELECT r.id, r.seq, r.state, r.label, r.charge, c.digest FROM releases r "
            "JOIN cohorts c ON c.id = r.cohort_id WHERE r.run_id IS ? ORDER BY r.id",
            (self.run_id,),
        ).fetchall()
        return [{**dict(zip(keys, r)), "charge": json.loads(r[4]) if r[4] else None} for r in rows]

    def cohorts(self) -> dict[str, list[str]]:
        """Every cohort charged so far: its digest -> its user ids."""
        return {d: json.loads(m) for d, m in self._db.execute("SELECT digest, members FROM cohorts")}

    def _holder(self) -> tuple | None:
        """(run_id, pid, host, proc_start, started, users) of another running run that holds users
        of temp.cohort, or None."""
        return self._db.execute(
            "SELECT r.run_id, r.pid, r.host, r.proc_start, r.started, COUNT(*) FROM temp.cohort c "
            "JOIN reservations v ON v.user_id = c.user_id JOIN runs r ON r.run_id = v.run_id "
            "WHERE r.status = 'running' AND r.run_id IS NOT ? GROUP BY r.run_id ORDER BY r.started LIMIT 1",
            (self.run_id,),
        ).fetchone()

    def _busy_message(self, holder: tuple, nothing: str) -> str:
        run_id, pid, host, proc_start, started, count = holder
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        dead = host == socket.gethostname() and not _alive(pid, proc_start)
        return (
            f"ledger {self.path} is in use: run {run_id} (pid {pid} on {host}, started {when}) holds the "
            f"budget of {count} of these users until it ends"
            + (
                f"; its process is gone: `fedkl ledger release-stale {self.path}` releases it ({nothing})"
                if dead
                else f"; wait for it ({nothing})"
            )
        )

    def runs(self) -> list[dict]:
        """Every run of this ledger, oldest first: status, process, times, releases and reserved users."""
        keys = ("run_id", "status", "started", "ended", "pid", "host", "releases", "reserved_users", "note")
        rows = self._db.execute(
            "SELECT r.run_id, r.status, r.started, r.ended, r.pid, r.host, "
            "(SELECT COUNT(*) FROM releases x WHERE x.run_id = r.run_id), "
            "(SELECT COUNT(*) FROM reservations v WHERE v.run_id = r.run_id), r.note FROM runs r ORDER BY r.started"
        ).fetchall()
        return [dict(zip(keys, r)) for r in rows]

    def release_stale(self) -> dict:
        """End, as ``interrupted``, every ``running`` run of this host whose process is gone (pid not
        alive, or reused by another process), releasing its reservation. Returns
        ``{"released": [run ids], "kept": [{"run_id", "why"}]}``: a run that may still be alive (its
        process runs, or it runs on another host, where that cannot be checked) is kept."""
        here = socket.gethostname()
        released, kept = [], []
        for run_id, pid, host, proc_start in self._db.execute(
            "SELECT run_id, pid, host, proc_start FROM runs WHERE status = 'running' ORDER BY started"
        ).fetchall():
            if run_id == self.run_id:
                continue
            if pid is None:  # a schema-2 run: it reserved nothing, only its status was left open
                released.append(run_id)
            elif host != here:
                kept.append({"run_id": run_id, "why": f"it runs on host {host}, where its process cannot be checked"})
            elif _alive(pid, proc_start):
                kept.append({"run_id": run_id, "why": f"its process (pid {pid}) is still running"})
            else:
                released.append(run_id)
        if released:
            note = f"process gone; released by release-stale at {time.strftime('%Y-%m-%d %H:%M:%S')}"
            self._end_runs(released, "interrupted", note)
        return {"released": released, "kept": kept}

    def run_charges(self, run_id: str) -> dict:
        """What run ``run_id`` charged: its releases, and the (rho, eps, delta) and epsilon (at the
        budget's delta and conversion) of the user it charged most."""
        per_user: dict[str, list[float]] = {}
        n = 0
        for rho, eps, delta, count, members in self._db.execute(
            "SELECT SUM(r.rho), SUM(r.eps), SUM(r.delta), COUNT(*), c.members FROM releases r "
            "JOIN cohorts c ON c.id = r.cohort_id WHERE r.run_id = ? GROUP BY r.cohort_id",
            (run_id,),
        ).fetchall():
            n += count
            for m in json.loads(members):
                t = per_user.setdefault(m, [0.0, 0.0, 0.0])
                t[0], t[1], t[2] = t[0] + rho, t[1] + eps, t[2] + delta
        b = self.budget
        worst = max(per_user.values(), key=lambda t: UserSpend("", *t).epsilon(b.delta, b.conversion), default=None)
        r, e, d = worst or (0.0, 0.0, 0.0)
        return {
            "run_id": run_id,
            "releases": n,
            "users_charged": len(per_user),
            "max_user_rho": r,
            "max_user_eps_approx": e,
            "max_user_delta": d,
            "max_user_epsilon": UserSpend("", r, e, d).epsilon(b.delta, b.conversion),
        }

    # --- charging ----------------------------------------------------------------------------
    # What this handle remembers between transactions, so that a run charging the same users again and
    # again does not redo O(users) work (100,000 users: ~0.6 s a transaction): the sorted members of the
    # last user list, what temp.cohort holds, and the cohort's distinct totals after this handle's last
    # charge, valid while no other connection has written the file (PRAGMA data_version unchanged).
    # Forgotten on any rollback (temp tables roll back too).
    _last_ids: tuple = ((), [])
    _filled: list[str] | None = None
    _groups_after: tuple[int, list[str], list[list]] | None = None

    def _forget(self) -> None:
        self._filled = None
        self._groups_after = None

    def _fill_cohort(self, members: Sequence[str]) -> None:
        filled = self._filled
        if filled is not None and (filled is members or filled == members):
            return
        self._filled = None
        self._db.execute("DELETE FROM temp.cohort")
        self._db.executemany("INSERT INTO temp.cohort VALUES (?)", ((m,) for m in members))
        self._filled = list(members)

    def _data_version(self) -> int:
        return self._db.execute("PRAGMA data_version").fetchone()[0]

    def _cohort_groups(self) -> list[list]:
        """The distinct current totals among temp.cohort's users: ``[rho, eps, delta, example user,
        count, never charged]`` each (users never charged: zeros; the last field counts them)."""
        after = self._groups_after
        if after is not None and after[0] == self._data_version() and after[1] is self._filled:
            return [list(g[:5]) + [0] for g in after[2]]  # every member has a row since that charge
        return [
            list(g)
            for g in self._db.execute(
                "SELECT COALESCE(u.rho, 0), COALESCE(u.eps, 0), COALESCE(u.delta, 0), MIN(c.user_id), COUNT(*), "
                "SUM(u.user_id IS NULL) FROM temp.cohort c LEFT JOIN users u ON u.user_id = c.user_id "
                "GROUP BY 1, 2, 3"
            )
        ]

    def check(self, needs: Iterable[Need]) -> None:
        """Refuse (BudgetExceeded naming a user and the amounts; nothing charged) unless every user can
        afford the sum of what ``needs`` charge them, with the one tolerance every charge is checked with
        (:meth:`_check_fits`): the runner calls it once, with the algorithm's declared needs, before any
        data is read (issue 29: affordability is checked once). LedgerBusy while another run holds them."""
        totals: dict[str, tuple[float, float, float]] = {}
        for users, charge in needs:
            cost = charge.cost()
            for u in set(map(str, users)):
                totals[u] = tuple(a + b for a, b in zip(totals.get(u, (0.0, 0.0, 0.0)), cost))
        cohorts: dict[tuple[float, float, float], list[str]] = {}
        for u, total in totals.items():
            cohorts.setdefault(total, []).append(u)
        for (rho, eps, delta), users in sorted(cohorts.items()):
            self._db.execute("BEGIN")
            try:
                self._fill_cohort(sorted(users))
                holder = self._holder()
                if holder is not None:
                    raise LedgerBusy(self._busy_message(holder, "nothing was read or charged"))
                self._check_fits(self._cohort_groups(), rho, eps, delta, "the run")
            finally:
                if self._db.in_transaction:
                    self._db.execute("COMMIT")

    def _check_fits(self, groups: list[list], rho: float, eps: float, delta: float, what: str = "this release") -> None:
        """Raise BudgetExceeded if any user of ``groups`` (:meth:`_cohort_groups`, the totals so far)
        would go over budget after this charge (``what`` makes it, in the message)."""
        b = self.budget
        for rho_u, eps_u, delta_u, example, count, *_ in groups:
            rho_after, eps_after, delta_after = rho_u + rho, eps_u + eps, delta_u + delta
            cap = _rho_cap(b.epsilon - eps_after, b.delta - delta_after, b.conversion)
            fits = (
                eps_after <= b.epsilon * (1 + _REL_TOL) and delta_after < b.delta and rho_after <= cap * (1 + _REL_TOL)
            )
            if not fits:
                now = UserSpend(example, rho_u, eps_u, delta_u).epsilon(b.delta, b.conversion)
                after = UserSpend(example, rho_after, eps_after, delta_after).epsilon(b.delta, b.conversion)
                raise BudgetExceeded(
                    f"privacy budget exhausted: {what} would take {count} user(s) (e.g. {example!r}) "
                    f"from eps={now:.4g} to eps={after:.4g} > budget eps={b.epsilon:g} at delta={b.delta:g} "
                    f"(charging rho={rho:.4g}, eps={eps:.4g}, delta={delta:.3g} more). "
                    "Nothing was charged or released; lower the number of rounds, raise the noise, "
                    "or use a new ledger for new data."
                )

    def charge(
        self,
        user_ids: Sequence[str],
        charge: Charge,
        *,
        label: str,
        details: dict | None = None,
        seq: int | None = None,
    ) -> int:
        """Charge every user in ``user_ids`` the cost of ``charge`` (a typed charge of
        :mod:`fedkl.privacy.charges`) and return the release id. Atomic and durable. ``seq``: the
        release's number in its run (:class:`fedkl.privacy.release.Releaser`), recorded with it.

        Raises :class:`BudgetExceeded` (nothing written) if any user would exceed the budget,
        :class:`LedgerBusy` if another running run holds any of them (:meth:`reserve`).
        """
        members = self._members(user_ids)
        with self._transaction() as db:
            self._fill_cohort(members)
            holder = self._holder()
            if holder is not None:
                raise LedgerBusy(self._busy_message(holder, "nothing was charged or released"))
            release_id, groups = self._insert(db, members, charge, label, details, seq)
            version = self._data_version()
        self._groups_after = (version, self._filled, groups)  # committed: the cohort's totals, for the next charge
        return release_id

    def _members(self, user_ids: Sequence[str]) -> list[str]:
        """The sorted user ids of a release (remembered for the last list: a run asks the same users)."""
        key = tuple(user_ids)
        last = self._last_ids
        if last[1] and last[0] == key:
            return last[1]
        members = sorted(set(map(str, user_ids)))
        if len(members) != len(user_ids):
            raise ValueError("a release charges each user once: user_ids has duplicates")
        if not members:
            raise ValueError("a release must charge at least one user")
        self._last_ids = (key, members)
        return members

    def _insert(
        self, db, members: list[str], charge: Charge, label: str, details: dict | None, seq: int | None
    ) -> tuple[int, list[list]]:
        """Inside a write transaction whose temp.cohort holds ``members``: refuse, before writing
        anything, a charge that would take a user over budget; else write the release row and add its
        cost to every member's totals (one statement). Returns the release id and the cohort's distinct
        totals after the charge (:meth:`_cohort_groups`)."""
        record = to_record(charge)  # TypeError for anything but a typed charge
        rho, eps, delta = charge.cost()
        mechanism = charge.mechanism
        if (
            rho > 0 and mechanism != "gaussian" or mechanism == APPROX_ZCDP_DELTA
        ) and self.budget.conversion == "gaussian":
            raise LedgerError(
                f"this ledger converts zCDP by the exact Gaussian profile (conversion 'gaussian'), which "
                f"holds only for Gaussian releases; a {mechanism!r} charge is refused (nothing was "
                "charged or released). Use conversion 'cks' for this algorithm."
            )
        groups = self._cohort_groups()
        before = [tuple(g[:3]) for g in groups]
        self._check_fits(groups, rho, eps, delta)
        for g in groups:
            g[0], g[1], g[2] = g[0] + rho, g[1] + eps, g[2] + delta
        digest = _digest(members)
        row = db.execute("SELECT id FROM cohorts WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            db.execute(
                "INSERT INTO cohorts (digest, size, members) VALUES (?, ?, ?)",
                (digest, len(members), json.dumps(members)),
            )
            row = db.execute("SELECT id FROM cohorts WHERE digest = ?", (digest,)).fetchone()
        cohort_id = row[0]
        cur = db.execute(
            "INSERT INTO releases (run_id, label, mechanism, sensitivity, noise_scale, rho, eps, delta, "
            "cohort_id, created, details, charge, seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                self.run_id,
                label,
                mechanism,
                charge.sensitivity,
                charge.noise_scale,
                rho,
                eps,
                delta,
                cohort_id,
                time.time(),
                json.dumps(details or {}, default=str),
                json.dumps(record),
                seq,
            ),
        )
        release_id = int(cur.lastrowid)
        # every member's row: its old totals -> the new ones (one statement: each row is updated once,
        # from its old values, even where one group's new totals equal another group's old ones)
        if any(g[5] for g in groups):
            db.execute("INSERT OR IGNORE INTO users SELECT user_id, 0.0, 0.0, 0.0, 0 FROM temp.cohort WHERE true")
        if len(groups) == 1:  # all members had the same totals: they all get the same new ones
            db.execute(
                "UPDATE users SET rho = ?, eps = ?, delta = ?, releases = releases + 1 "
                "WHERE user_id IN (SELECT user_id FROM temp.cohort)",
                groups[0][:3],
            )
            return release_id, groups
        db.execute("DELETE FROM temp.totals")
        db.executemany(
            "INSERT INTO temp.totals VALUES (?, ?, ?, ?, ?, ?)", (b + tuple(g[:3]) for b, g in zip(before, groups))
        )
        db.execute(
            "UPDATE users SET (rho, eps, delta) = (SELECT t.rho_t, t.eps_t, t.delta_t FROM temp.totals t "
            "WHERE t.rho = users.rho AND t.eps = users.eps AND t.delta = users.delta), releases = releases + 1 "
            "WHERE user_id IN (SELECT user_id FROM temp.cohort)"
        )
        return release_id, groups

    # --- reading -----------------------------------------------------------------------------
    def spend(self, user_id: str) -> UserSpend:
        row = self._db.execute(
            "SELECT rho, eps, delta, releases FROM users WHERE user_id = ?", (str(user_id),)
        ).fetchone()
        return UserSpend(str(user_id), *row) if row else UserSpend(str(user_id))

    def max_user_totals(self) -> dict[str, float]:
        """The largest ``rho``, ``eps`` and ``delta`` total of any user (each on its own; 0 when
        nobody was charged)."""
        row = self._db.execute(
            "SELECT COALESCE(MAX(rho), 0), COALESCE(MAX(eps), 0), COALESCE(MAX(delta), 0) FROM users"
        )
        return dict(zip(("rho", "eps", "delta"), row.fetchone()))

    def epsilon(self, user_id: str) -> float:
        return self.spend(user_id).epsilon(self.budget.delta, self.budget.conversion)

    def _distinct_spends(self, user_ids: Iterable[str]) -> list[tuple[float, float, float]] | None:
        """The distinct (rho, eps, delta) totals among the listed users (unknown users: zeros); None
        when another running run holds any of them (nothing is left to this handle)."""
        self._db.execute("BEGIN")
        try:
            self._fill_cohort(sorted(set(map(str, user_ids))))
            if self._holder() is not None:
                return None
            return self._db.execute(
                "SELECT DISTINCT COALESCE(u.rho, 0), COALESCE(u.eps, 0), COALESCE(u.delta, 0) "
                "FROM temp.cohort c LEFT JOIN users u ON u.user_id = c.user_id"
            ).fetchall()
        finally:
            if self._db.in_transaction:
                self._db.execute("COMMIT")

    def rho_left(self, user_ids: Iterable[str]) -> float:
        """The largest zCDP charge every listed user can still afford (0 below :data:`SPENT_BELOW`
        of the budget's rho, and for users another running run holds)."""
        groups = self._distinct_spends(user_ids)
        b = self.budget
        left = min(
            (max(_rho_cap(b.epsilon - e, b.delta - d, b.conversion) - r, 0.0) for r, e, d in groups or ()),
            default=0.0,
        )
        return left if left >= SPENT_BELOW * b.rho else 0.0

    def approx_left(self, user_ids: Iterable[str]) -> tuple[float, float]:
        """An (eps, delta) charge that every listed user can still afford (conservative).

        A user with zCDP spend rho_u keeps half of its remaining delta for the zCDP conversion; the
        other half (or, without zCDP spend, all but a 1e-9 fraction: the ledger needs delta strictly
        below the budget) is offered. Returns (0, 0) when nothing is left: when the eps or the delta
        left is below :data:`SPENT_BELOW` of the budget's, or another running run holds these users.
        """
        groups = self._distinct_spends(user_ids)
        if groups is None:
            return 0.0, 0.0
        b = self.budget
        eps_left, delta_left = math.inf, math.inf
        for rho_u, eps_u, delta_u in groups:
            free = b.delta - delta_u
            if free <= 0:
                return 0.0, 0.0
            if rho_u > 0:
                offered = free / 2
                eps_avail = b.epsilon - eps_u - zcdp_to_eps(rho_u, free - offered, b.conversion)
            else:
                offered = free * (1 - 1e-9)
                eps_avail = b.epsilon - eps_u
            eps_left, delta_left = min(eps_left, eps_avail), min(delta_left, offered)
        if not groups or eps_left < SPENT_BELOW * b.epsilon or delta_left < SPENT_BELOW * b.delta:
            return 0.0, 0.0
        return eps_left * (1 - 1e-12), delta_left

    def num_releases(self, run_id: str | None = None) -> int:
        if run_id is None:
            return self._db.execute("SELECT COUNT(*) FROM releases").fetchone()[0]
        return self._db.execute("SELECT COUNT(*) FROM releases WHERE run_id = ?", (run_id,)).fetchone()[0]

    def releases(self, run_id: str | None = None) -> list[dict]:
        """The release log in order: one dict per release, with ``users`` (how many were charged),
        ``cohort`` (the digest of who), ``charge`` (the typed charge's stored record), ``seq`` (its
        number in its run) and ``state`` (:data:`RELEASE_STATES`)."""
        q = (
            "SELECT r.id, r.run_id, r.label, r.mechanism, r.sensitivity, r.noise_scale, r.rho, r.eps, "
            "r.delta, c.size, c.digest, r.charge, r.seq, r.state FROM releases r JOIN cohorts c ON c.id = r.cohort_id"
        )
        rows = self._db.execute(
            q + (" WHERE r.run_id = ?" if run_id else "") + " ORDER BY r.id", (run_id,) if run_id else ()
        ).fetchall()
        keys = ("id", "run_id", "label", "mechanism", "sensitivity", "noise_scale", "rho", "eps", "delta", "users")
        return [
            {
                **dict(zip(keys, r[:10])),
                "cohort": r[10],
                "charge": json.loads(r[11]) if r[11] else None,
                "seq": r[12],
                "state": r[13],
            }
            for r in rows
        ]

    def _non_gaussian_zcdp_users(self) -> set[str]:
        """Users charged at least one zCDP release that is not a Gaussian mechanism, or the delta of
        approximate zCDP (:data:`~fedkl.privacy.charges.APPROX_ZCDP_DELTA`): the exact Gaussian
        conversion does not hold for them."""
        out: set[str] = set()
        for (members,) in self._db.execute(
            "SELECT DISTINCT c.members FROM releases r JOIN cohorts c ON c.id = r.cohort_id "
            "WHERE (r.rho > 0 AND r.mechanism != 'gaussian') OR r.mechanism = ?",
            (APPROX_ZCDP_DELTA,),
        ):
            out.update(json.loads(members))
        return out

    def user_spends(self, limit: int | None = None) -> list[dict]:
        """Every charged user's totals (``rho``, approximate-DP ``eps``/``delta``, ``releases``) and
        guarantee: ``epsilon`` by the budget's conversion (what the budget is enforced with) and
        ``epsilon_exact`` (the exact Gaussian conversion where all of the user's zCDP charges were
        Gaussian, as :meth:`summary`), most charged first; ``limit``: at most that many."""
        b = self.budget
        other = self._non_gaussian_zcdp_users()
        rows = []
        for user, r, e, d, n in self._db.execute("SELECT user_id, rho, eps, delta, releases FROM users"):
            spend = UserSpend(user, r, e, d, n)
            by_budget = spend.epsilon(b.delta, b.conversion)
            exact = by_budget if user in other else min(by_budget, spend.epsilon(b.delta, "gaussian"))
            rows.append(
                {
                    "user_id": user,
                    "releases": n,
                    "rho": r,
                    "eps": e,
                    "delta": d,
                    "epsilon": by_budget,
                    "epsilon_exact": exact,
                }
            )
        rows.sort(key=lambda row: (-row["epsilon"], row["user_id"]))
        return rows[:limit] if limit is not None else rows

    def summary(self) -> dict:
        """Worst user, counts and the budget: what result files report.

        ``max_user_epsilon`` is each user's guarantee by the budget's conversion (what the budget is
        enforced with). ``max_user_epsilon_exact`` converts the zCDP part EXACTLY for every user whose
        zCDP charges were all Gaussian releases (:func:`fedkl.privacy.zcdp.eps_gaussian`: a
        composition of Gaussians with total rho is sqrt(2 rho)-GDP), and by the budget's conversion
        for the others (also for a user charged the delta of approximate zCDP, whose Gaussian charges
        hold only conditionally: :data:`~fedkl.privacy.charges.APPROX_ZCDP_DELTA`); it is never larger."""
        b = self.budget
        groups = self._db.execute(
            "SELECT rho, eps, delta, COUNT(*), MAX(releases) FROM users GROUP BY rho, eps, delta"
        ).fetchall()
        worst = max((UserSpend("", r, e, d).epsilon(b.delta, b.conversion) for r, e, d, _, _ in groups), default=0.0)
        other = self._non_gaussian_zcdp_users()
        kinds = {
            (r, e, d, user in other) for user, r, e, d in self._db.execute("SELECT user_id, rho, eps, delta FROM users")
        }
        exact = max(
            (
                min(
                    UserSpend("", r, e, d).epsilon(b.delta, b.conversion if mixed else "gaussian"),
                    UserSpend("", r, e, d).epsilon(b.delta, b.conversion),
                )
                for r, e, d, mixed in kinds
            ),
            default=0.0,
        )
        return {
            "path": self.path,
            "budget": asdict(b),
            "users_charged": sum(g[3] for g in groups),
            "releases": self.num_releases(),
            "max_user_rho": max((g[0] for g in groups), default=0.0),
            "max_user_epsilon": worst,
            "max_user_epsilon_exact": exact,
            "delta": b.delta,
        }

    @contextlib.contextmanager
    def snapshot(self):
        """Read the ledger as of one moment: the statements inside are one read transaction (a run's charge
        that would commit meanwhile waits for it, as for any reader of a rollback-journal file). Inside a
        transaction of this handle already: that one. Every reading that combines several statements
        (:meth:`verify`, ``fedkl ledger``'s reports) runs in one: read one statement at a time, a charge
        committed in between made the users' totals newer than the release log read before them."""
        if self._db.in_transaction:
            yield
            return
        try:
            self._db.execute("BEGIN")
        except sqlite3.Error as e:
            raise self._error(e) from None
        try:
            yield
        finally:
            if self._db.in_transaction:
                self._db.execute("COMMIT")  # nothing written: ends the read

    def verify(self) -> None:
        """Recompute every release's cost from its stored typed charge and every user's totals from
        the release log, all read in one :meth:`snapshot`; raise LedgerError on any mismatch. (Rows written
        before typed charges, schema 1, have no charge to recompute; their stored costs still enter the totals.)"""
        with self.snapshot():
            self._verify()

    def _verify(self) -> None:
        per_cohort: dict[int, list[float]] = {}  # summed per cohort first: each cohort's members are read once
        for rid, rho, eps, delta, mechanism, sensitivity, noise_scale, charge, cohort_id in self._db.execute(
            "SELECT id, rho, eps, delta, mechanism, sensitivity, noise_scale, charge, cohort_id FROM releases"
        ):
            if charge is not None:
                typed = from_record(json.loads(charge))
                stored_row = (rho, eps, delta, mechanism, sensitivity, noise_scale)
                if (*typed.cost(), typed.mechanism, typed.sensitivity, typed.noise_scale) != stored_row:
                    raise LedgerError(f"release {rid}: the stored cost {stored_row} is not that of its charge {typed}")
            c = per_cohort.setdefault(cohort_id, [0.0, 0.0, 0.0, 0])
            c[0], c[1], c[2], c[3] = c[0] + rho, c[1] + eps, c[2] + delta, c[3] + 1
        totals: dict[str, list[float]] = {}
        for cohort_id, members in self._db.execute("SELECT id, members FROM cohorts"):
            c = per_cohort.pop(cohort_id, None)
            for m in json.loads(members) if c is not None else ():
                t = totals.setdefault(m, [0.0, 0.0, 0.0, 0])
                t[0], t[1], t[2], t[3] = t[0] + c[0], t[1] + c[1], t[2] + c[2], t[3] + c[3]
        if per_cohort:
            raise LedgerError(f"releases charge cohorts the ledger does not hold: {sorted(per_cohort)[:5]}")
        stored = {u: (r, e, d, n) for u, r, e, d, n in self._db.execute("SELECT * FROM users")}
        if set(stored) != set(totals):
            raise LedgerError("ledger users table and release log list different users")
        for u, (r, e, d, n) in stored.items():
            t = totals[u]
            if n != t[3] or any(not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip((r, e, d), t)):
                raise LedgerError(f"ledger totals of user {u!r} do not match its release log")


def cohort_digest(user_ids: Iterable[str]) -> str:
    """The digest the ledger stores for the cohort of ``user_ids`` (order and repeats ignored)."""
    return _digest(sorted(set(map(str, user_ids))))
