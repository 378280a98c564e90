"""The per-user privacy ledger: every release is charged to every participating user BEFORE it is made.

Storage is one SQLite file in WAL mode with ``synchronous=FULL``: a charge returns only after its
transaction is durable, so a crash (SIGKILL, power loss) at any point either happened before the
charge committed (then nothing was released either: releases happen after the charge returns) or
after (then the charge is on disk). A restarted run that opens the same file sees what was spent.

What a user spends has three parts, composed as follows:

* ``rho``: zCDP charges (Gaussian mechanisms ...), added up (zCDP composition, fully adaptive);
* ``eps``, ``delta``: approximate-DP charges of mechanisms that are not zCDP (e.g. a PTR test),
  added up by basic composition.

A user's guarantee at the budget's delta is ``eps(u) = zcdp_to_eps(rho_u, delta - delta_u) + eps_u``
(valid because composing a (eps1, delta1) and a (eps2, delta2) guarantee gives
(eps1 + eps2, delta1 + delta2)). A charge is refused, atomically and with nothing written, if it would
take any participating user's ``eps(u)`` above the budget's epsilon. The refusal is computed from
the ledger alone (public bookkeeping), never from the users' data.

Cohorts (the list of users a release charged) are stored once per distinct cohort, so full
participation over many rounds costs one row per round, and :meth:`PrivacyLedger.verify` can
recompute every user's total from the release log.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sqlite3
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from fedkl.privacy.charges import Charge, from_record, to_record
from fedkl.privacy.filter import BudgetExhausted
from fedkl.privacy.zcdp import CONVERSIONS, rho_for_eps_delta, zcdp_to_eps

SCHEMA_VERSION = 2  # 2: releases.charge holds the typed charge (fedkl.privacy.charges); 1 is upgraded in place
_REL_TOL = 1e-12

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, started REAL NOT NULL, config TEXT NOT NULL, status TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cohorts (
    id INTEGER PRIMARY KEY, digest TEXT UNIQUE NOT NULL, size INTEGER NOT NULL, members TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS releases (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT, label TEXT NOT NULL, mechanism TEXT NOT NULL,
    sensitivity REAL, noise_scale REAL, rho REAL NOT NULL, eps REAL NOT NULL, delta REAL NOT NULL,
    cohort_id INTEGER NOT NULL REFERENCES cohorts(id), created REAL NOT NULL, details TEXT, charge TEXT);
CREATE TABLE IF NOT EXISTS users (
    user_id TEXT PRIMARY KEY, rho REAL NOT NULL, eps REAL NOT NULL, delta REAL NOT NULL,
    releases INTEGER NOT NULL);
"""


class LedgerError(RuntimeError):
    """The ledger file is unusable as asked (wrong budget, wrong schema ...)."""


class BudgetExceeded(BudgetExhausted):
    """A charge would take a user over the budget; nothing was charged and nothing may be released."""


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
    """

    def __init__(
        self,
        path: str | os.PathLike,
        budget: Budget | None = None,
        run_id: str | None = None,
        run_config: dict | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.run_id = run_id
        if budget is None and not os.path.exists(self.path):
            raise LedgerError(f"{self.path} does not exist: a new ledger needs a budget (epsilon, delta)")
        self._db = sqlite3.connect(self.path, isolation_level=None, timeout=60.0)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            self._db.execute("CREATE TEMP TABLE IF NOT EXISTS cohort (user_id TEXT PRIMARY KEY)")
            self.budget = self._init_budget(budget)
        except BaseException:
            self._db.close()
            raise
        if run_id is not None:
            self._db.execute(
                "INSERT OR IGNORE INTO runs VALUES (?, ?, ?, 'running')",
                (run_id, time.time(), json.dumps(run_config or {}, default=str)),
            )

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
        if int(rows["schema"]) == 1:  # a ledger written before typed charges: add the column, keep every row
            self._db.execute("BEGIN IMMEDIATE")
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(releases)")}
            if "charge" not in columns:
                self._db.execute("ALTER TABLE releases ADD COLUMN charge TEXT")
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

    def __exit__(self, *exc) -> None:
        self.close()

    def finish_run(self, status: str = "finished") -> None:
        if self.run_id is not None:
            self._db.execute("UPDATE runs SET status = ? WHERE run_id = ?", (status, self.run_id))

    # --- charging ----------------------------------------------------------------------------
    def _fill_cohort(self, members: Sequence[str]) -> None:
        self._db.execute("DELETE FROM temp.cohort")
        self._db.executemany("INSERT INTO temp.cohort VALUES (?)", ((m,) for m in members))

    def _check_fits(self, rho: float, eps: float, delta: float) -> None:
        """Raise BudgetExceeded if any cohort user would go over budget after this charge."""
        groups = self._db.execute(
            "SELECT COALESCE(u.rho, 0), COALESCE(u.eps, 0), COALESCE(u.delta, 0), MIN(c.user_id), COUNT(*) "
            "FROM temp.cohort c LEFT JOIN users u ON u.user_id = c.user_id "
            "GROUP BY 1, 2, 3"
        ).fetchall()
        b = self.budget
        for rho_u, eps_u, delta_u, example, count in groups:
            rho_after, eps_after, delta_after = rho_u + rho, eps_u + eps, delta_u + delta
            cap = _rho_cap(b.epsilon - eps_after, b.delta - delta_after, b.conversion)
            fits = (
                eps_after <= b.epsilon * (1 + _REL_TOL) and delta_after < b.delta and rho_after <= cap * (1 + _REL_TOL)
            )
            if not fits:
                now = UserSpend(example, rho_u, eps_u, delta_u).epsilon(b.delta, b.conversion)
                after = UserSpend(example, rho_after, eps_after, delta_after).epsilon(b.delta, b.conversion)
                raise BudgetExceeded(
                    f"privacy budget exhausted: this release would take {count} user(s) (e.g. {example!r}) "
                    f"from eps={now:.4g} to eps={after:.4g} > budget eps={b.epsilon:g} at delta={b.delta:g}. "
                    "Nothing was charged or released; lower the number of rounds, raise the noise, "
                    "or use a new ledger for new data."
                )

    def charge(self, user_ids: Sequence[str], charge: Charge, *, label: str, details: dict | None = None) -> int:
        """Charge every user in ``user_ids`` the cost of ``charge`` (a typed charge of
        :mod:`fedkl.privacy.charges`) and return the release id. Atomic and durable.

        Raises :class:`BudgetExceeded` (nothing written) if any user would exceed the budget.
        """
        record = to_record(charge)  # TypeError for anything but a typed charge
        rho, eps, delta = charge.cost()
        mechanism = charge.mechanism
        if rho > 0 and mechanism != "gaussian" and self.budget.conversion == "gaussian":
            raise LedgerError(
                f"this ledger converts zCDP by the exact Gaussian profile (conversion 'gaussian'), which "
                f"holds only for Gaussian releases; a {mechanism!r} zCDP charge is refused (nothing was "
                "charged or released). Use conversion 'cks' for this algorithm."
            )
        members = sorted(set(map(str, user_ids)))
        if len(members) != len(user_ids):
            raise ValueError("a release charges each user once: user_ids has duplicates")
        if not members:
            raise ValueError("a release must charge at least one user")
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            self._fill_cohort(members)
            self._check_fits(rho, eps, delta)
            digest = _digest(members)
            db.execute(
                "INSERT OR IGNORE INTO cohorts (digest, size, members) VALUES (?, ?, ?)",
                (digest, len(members), json.dumps(members)),
            )
            cohort_id = db.execute("SELECT id FROM cohorts WHERE digest = ?", (digest,)).fetchone()[0]
            cur = db.execute(
                "INSERT INTO releases (run_id, label, mechanism, sensitivity, noise_scale, rho, eps, delta, "
                "cohort_id, created, details, charge) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                ),
            )
            db.execute(
                "INSERT INTO users (user_id, rho, eps, delta, releases) "
                "SELECT user_id, ?, ?, ?, 1 FROM temp.cohort WHERE true "
                "ON CONFLICT(user_id) DO UPDATE SET rho = rho + excluded.rho, eps = eps + excluded.eps, "
                "delta = delta + excluded.delta, releases = releases + 1",
                (rho, eps, delta),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return int(cur.lastrowid)

    # --- reading -----------------------------------------------------------------------------
    def spend(self, user_id: str) -> UserSpend:
        row = self._db.execute(
            "SELECT rho, eps, delta, releases FROM users WHERE user_id = ?", (str(user_id),)
        ).fetchone()
        return UserSpend(str(user_id), *row) if row else UserSpend(str(user_id))

    def epsilon(self, user_id: str) -> float:
        return self.spend(user_id).epsilon(self.budget.delta, self.budget.conversion)

    def _distinct_spends(self, user_ids: Iterable[str]) -> list[tuple[float, float, float]]:
        """The distinct (rho, eps, delta) totals among the listed users (unknown users: zeros)."""
        self._db.execute("BEGIN")
        try:
            self._fill_cohort(sorted(set(map(str, user_ids))))
            return self._db.execute(
                "SELECT DISTINCT COALESCE(u.rho, 0), COALESCE(u.eps, 0), COALESCE(u.delta, 0) "
                "FROM temp.cohort c LEFT JOIN users u ON u.user_id = c.user_id"
            ).fetchall()
        finally:
            self._db.execute("COMMIT")

    def rho_left(self, user_ids: Iterable[str]) -> float:
        """The largest zCDP charge every listed user can still afford."""
        groups = self._distinct_spends(user_ids)
        b = self.budget
        return min(
            (max(_rho_cap(b.epsilon - e, b.delta - d, b.conversion) - r, 0.0) for r, e, d in groups), default=0.0
        )

    def approx_left(self, user_ids: Iterable[str]) -> tuple[float, float]:
        """An (eps, delta) charge that every listed user can still afford (conservative).

        A user with zCDP spend rho_u keeps half of its remaining delta for the zCDP conversion; the
        other half (or, without zCDP spend, all but a 1e-9 fraction: the ledger needs delta strictly
        below the budget) is offered. Returns (0, 0) when nothing is left.
        """
        groups = self._distinct_spends(user_ids)
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
        if not groups or eps_left <= 0:
            return 0.0, 0.0
        return eps_left * (1 - 1e-12), delta_left

    def num_releases(self, run_id: str | None = None) -> int:
        if run_id is None:
            return self._db.execute("SELECT COUNT(*) FROM releases").fetchone()[0]
        return self._db.execute("SELECT COUNT(*) FROM releases WHERE run_id = ?", (run_id,)).fetchone()[0]

    def releases(self, run_id: str | None = None) -> list[dict]:
        """The release log in order: one dict per release, with ``users`` (how many were charged),
        ``cohort`` (the digest of who) and ``charge`` (the typed charge's stored record)."""
        q = (
            "SELECT r.id, r.run_id, r.label, r.mechanism, r.sensitivity, r.noise_scale, r.rho, r.eps, "
            "r.delta, c.size, c.digest, r.charge FROM releases r JOIN cohorts c ON c.id = r.cohort_id"
        )
        rows = self._db.execute(
            q + (" WHERE r.run_id = ?" if run_id else "") + " ORDER BY r.id", (run_id,) if run_id else ()
        ).fetchall()
        keys = ("id", "run_id", "label", "mechanism", "sensitivity", "noise_scale", "rho", "eps", "delta", "users")
        return [
            {**dict(zip(keys, r[:10])), "cohort": r[10], "charge": json.loads(r[11]) if r[11] else None} for r in rows
        ]

    def _non_gaussian_zcdp_users(self) -> set[str]:
        """Users charged at least one zCDP release that is not a Gaussian mechanism."""
        out: set[str] = set()
        for (members,) in self._db.execute(
            "SELECT DISTINCT c.members FROM releases r JOIN cohorts c ON c.id = r.cohort_id "
            "WHERE r.rho > 0 AND r.mechanism != 'gaussian'"
        ):
            out.update(json.loads(members))
        return out

    def summary(self) -> dict:
        """Worst user, counts and the budget: what result files report.

        ``max_user_epsilon`` is each user's guarantee by the budget's conversion (what the budget is
        enforced with). ``max_user_epsilon_exact`` converts the zCDP part EXACTLY for every user whose
        zCDP charges were all Gaussian releases (:func:`fedkl.privacy.zcdp.eps_gaussian`: a
        composition of Gaussians with total rho is sqrt(2 rho)-GDP), and by the budget's conversion
        for the others; it is never larger."""
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

    def verify(self) -> None:
        """Recompute every release's cost from its stored typed charge and every user's totals from
        the release log; raise LedgerError on any mismatch. (Rows written before typed charges, schema
        1, have no charge to recompute; their stored costs still enter the totals.)"""
        totals: dict[str, list[float]] = {}
        for rid, rho, eps, delta, mechanism, sensitivity, noise_scale, charge, members in self._db.execute(
            "SELECT r.id, r.rho, r.eps, r.delta, r.mechanism, r.sensitivity, r.noise_scale, r.charge, c.members "
            "FROM releases r JOIN cohorts c ON c.id = r.cohort_id"
        ):
            if charge is not None:
                typed = from_record(json.loads(charge))
                stored_row = (rho, eps, delta, mechanism, sensitivity, noise_scale)
                if (*typed.cost(), typed.mechanism, typed.sensitivity, typed.noise_scale) != stored_row:
                    raise LedgerError(f"release {rid}: the stored cost {stored_row} is not that of its charge {typed}")
            for m in json.loads(members):
                t = totals.setdefault(m, [0.0, 0.0, 0.0, 0])
                t[0] += rho
                t[1] += eps
                t[2] += delta
                t[3] += 1
        stored = {u: (r, e, d, n) for u, r, e, d, n in self._db.execute("SELECT * FROM users")}
        if set(stored) != set(totals):
            raise LedgerError("ledger users table and release log list different users")
        for u, (r, e, d, n) in stored.items():
            t = totals[u]
            if n != t[3] or any(not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip((r, e, d), t)):
                raise LedgerError(f"ledger totals of user {u!r} do not match its release log")
