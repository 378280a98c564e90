"""The per-user privacy ledger: budget checks, atomic refusals, durability across SIGKILL, tamper
detection and concurrent handles."""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from fedkl.privacy.charges import ApproxDPCharge, ExponentialCharge, GaussianCharge
from fedkl.privacy.filter import BudgetExhausted
from fedkl.privacy.ledger import SCHEMA_VERSION, Budget, BudgetExceeded, LedgerError, PrivacyLedger, UserSpend
from fedkl.privacy.zcdp import rho_for_eps_delta, zcdp_to_eps

BUDGET = Budget(epsilon=2.0, delta=1e-5)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def table_counts(path) -> dict:
    """Row counts of every persistent table, read through an independent connection."""
    con = sqlite3.connect(path)
    try:
        return {
            t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
            for t in ("meta", "runs", "cohorts", "releases", "users")
        }
    finally:
        con.close()


def users_snapshot(path) -> list:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT * FROM users ORDER BY user_id").fetchall()
    finally:
        con.close()


@pytest.fixture
def ledger(tmp_path):
    led = PrivacyLedger(tmp_path / "ledger.db", BUDGET, run_id="run-1")
    yield led
    led.close()


# --------------------------------------------------------------------------------------------------
# budget and charging
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps,delta,conv", [(2.0, 1e-5, "cks"), (0.5, 1e-8, "cks"), (8.0, 1e-6, "bun_steinke")])
def test_budget_rho(eps, delta, conv):
    b = Budget(eps, delta, conv)
    assert b.rho == rho_for_eps_delta(eps, delta, conv)
    assert zcdp_to_eps(b.rho, delta, conv) <= eps


def test_budget_invalid():
    for args in ((0.0, 1e-5), (-1.0, 1e-5), (float("inf"), 1e-5), (1.0, 0.0), (1.0, 1.0)):
        with pytest.raises(ValueError):
            Budget(*args)
    with pytest.raises(ValueError):
        Budget(1.0, 1e-5, "rdp")


def test_charge_accumulates_per_user(ledger):
    r1 = ledger.charge(["a", "b", "c"], GaussianCharge(rho=0.01, sensitivity=1.0), label="round 1")
    r2 = ledger.charge(["a", "c"], GaussianCharge(rho=0.02), label="round 2")
    r3 = ledger.charge(["a"], GaussianCharge(rho=0.005), label="round 3")
    assert r1 < r2 < r3
    a, b, c = ledger.spend("a"), ledger.spend("b"), ledger.spend("c")
    assert math.isclose(a.rho, 0.035, rel_tol=1e-12) and a.releases == 3
    assert math.isclose(b.rho, 0.01, rel_tol=1e-12) and b.releases == 1
    assert math.isclose(c.rho, 0.03, rel_tol=1e-12) and c.releases == 2
    # a user outside every cohort is not charged
    assert ledger.spend("d") == UserSpend("d")
    assert ledger.epsilon("d") == 0.0
    assert ledger.num_releases() == 3 and ledger.num_releases("run-1") == 3
    rel = ledger.releases()
    assert [r["users"] for r in rel] == [3, 2, 1]
    assert (
        rel[0]["sensitivity"] == 1.0 and rel[0]["noise_scale"] == 1.0 / math.sqrt(0.02) and rel[0]["run_id"] == "run-1"
    )
    assert math.isclose(ledger.epsilon("a"), zcdp_to_eps(0.035, BUDGET.delta), rel_tol=1e-12)
    s = ledger.summary()
    assert s["users_charged"] == 3 and s["releases"] == 3
    assert math.isclose(s["max_user_rho"], 0.035, rel_tol=1e-12)
    assert math.isclose(s["max_user_epsilon"], ledger.epsilon("a"), rel_tol=1e-12)
    ledger.verify()


def test_user_ids_normalised_and_duplicates_refused(ledger, tmp_path):
    ledger.charge([1, 2], GaussianCharge(rho=0.01), label="ints")
    assert math.isclose(ledger.spend("1").rho, 0.01, rel_tol=1e-12)
    before = table_counts(ledger.path)
    for bad in (["a", "a"], ["x", "y", "x"], [1, "1"]):
        with pytest.raises(ValueError):
            ledger.charge(bad, GaussianCharge(rho=0.01), label="dup")
    with pytest.raises(ValueError):
        ledger.charge([], GaussianCharge(rho=0.01), label="empty")
    for v in (-1e-3, float("nan"), float("inf")):  # a bad cost is refused when the charge is made
        for make in (
            lambda v: GaussianCharge(rho=v),
            lambda v: ApproxDPCharge(eps=v, delta=0.0, mechanism="ptr"),
            lambda v: ApproxDPCharge(eps=0.1, delta=v, mechanism="ptr"),
        ):
            with pytest.raises(ValueError):
                ledger.charge(["a"], make(v), label="bad")
    with pytest.raises(TypeError, match="not a charge"):
        ledger.charge(["a"], {"rho": 0.01}, label="untyped")
    assert table_counts(ledger.path) == before
    ledger.verify()


def test_the_ledger_stores_typed_charges_and_verify_recomputes_their_cost(ledger):
    """Each release row holds its typed charge; verify() recomputes the cost, sensitivity and noise
    scale from it, so a row whose cost or noise was altered (the log no longer says what the noise
    was for) is caught even when the users' totals were altered consistently."""
    g = GaussianCharge(rho=0.02, sensitivity=2.0)
    x = ExponentialCharge(eps=0.3, sensitivity=1.0)
    a = ApproxDPCharge(eps=0.1, delta=1e-7, mechanism="stability-gaussian", sensitivity=0.5, noise_scale=3.0)
    for label, charge in (("g", g), ("x", x), ("a", a)):
        ledger.charge(["u"], charge, label=label)
    rows = {r["label"]: r for r in ledger.releases()}
    assert (rows["g"]["rho"], rows["g"]["noise_scale"]) == (0.02, 2.0 / math.sqrt(0.04))
    assert (rows["x"]["rho"], rows["x"]["mechanism"], rows["x"]["noise_scale"]) == (0.3**2 / 8, "exponential", 2 / 0.3)
    assert (rows["a"]["eps"], rows["a"]["delta"], rows["a"]["rho"]) == (0.1, 1e-7, 0.0)
    ledger.verify()
    con = sqlite3.connect(ledger.path)
    for column, value in (("rho", 0.01), ("noise_scale", 1.0), ("sensitivity", 1.0), ("mechanism", "'laplace'")):
        con.execute(f"UPDATE releases SET {column} = {value} WHERE label = 'g'")
        if column == "rho":  # keep the user's total consistent with the altered row
            con.execute("UPDATE users SET rho = rho - 0.01 WHERE user_id = 'u'")
        con.commit()
        with pytest.raises(LedgerError, match="is not that of its charge"):
            ledger.verify()
        con.execute(
            f"UPDATE releases SET {column} = ? WHERE label = 'g'",
            ({"rho": 0.02, "noise_scale": 2.0 / math.sqrt(0.04), "sensitivity": 2.0, "mechanism": "gaussian"}[column],),
        )
        if column == "rho":
            con.execute("UPDATE users SET rho = rho + 0.01 WHERE user_id = 'u'")
        con.commit()
        ledger.verify()


def test_a_schema_1_ledger_is_upgraded_in_place(tmp_path):
    """A ledger written before typed charges (no charge column) opens, keeps its spend, verifies,
    and takes typed charges from then on."""
    path = str(tmp_path / "old.sqlite")
    with PrivacyLedger(path, BUDGET) as led:
        led.charge(["a"], GaussianCharge(rho=0.01), label="old")
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE releases DROP COLUMN charge")
    con.execute("UPDATE meta SET value = '1' WHERE key = 'schema'")
    con.commit()
    con.close()
    with PrivacyLedger(path) as led:
        assert led.spend("a").rho == 0.01
        led.verify()
        led.charge(["a"], GaussianCharge(rho=0.02), label="new")
        led.verify()
        assert led.spend("a").rho == pytest.approx(0.03)


def test_verify_detects_tampering(ledger):
    ledger.charge(["a", "b"], GaussianCharge(rho=0.01), label="r1")
    ledger.charge(["a"], GaussianCharge(rho=0.02), label="r2")
    ledger.verify()
    con = sqlite3.connect(ledger.path)
    con.execute("UPDATE users SET rho = rho / 2 WHERE user_id = 'a'")
    con.commit()
    with pytest.raises(LedgerError):
        ledger.verify()
    con.execute("UPDATE users SET rho = 0.03 WHERE user_id = 'a'")  # restore (0.01 + 0.02)
    con.commit()
    ledger.verify()
    con.execute("UPDATE users SET releases = 1 WHERE user_id = 'a'")
    con.commit()
    with pytest.raises(LedgerError):
        ledger.verify()
    con.execute("UPDATE users SET releases = 2 WHERE user_id = 'a'")
    con.commit()
    ledger.verify()
    con.execute("DELETE FROM users WHERE user_id = 'b'")  # a user vanishes
    con.commit()
    with pytest.raises(LedgerError):
        ledger.verify()
    con.execute("INSERT INTO users VALUES ('b', 0.01, 0, 0, 1)")
    con.commit()
    ledger.verify()
    con.execute("DELETE FROM releases WHERE label = 'r2'")  # a release vanishes from the log
    con.commit()
    with pytest.raises(LedgerError):
        ledger.verify()
    con.close()


# --------------------------------------------------------------------------------------------------
# refusals write nothing
# --------------------------------------------------------------------------------------------------
def test_over_budget_refused_atomically(ledger):
    rho = BUDGET.rho
    with pytest.raises(BudgetExceeded):
        ledger.charge(["a"], GaussianCharge(rho=rho * 1.001), label="too much")
    assert ledger.num_releases() == 0 and ledger.spend("a") == UserSpend("a")

    ledger.charge(["a"], GaussianCharge(rho=0.9 * rho), label="most")
    before, users_before = table_counts(ledger.path), users_snapshot(ledger.path)
    # only 'a' is over; 'b', 'c' (fresh) would fit: the whole release is refused, nobody is charged
    with pytest.raises(BudgetExceeded) as err:
        ledger.charge(["b", "a", "c"], GaussianCharge(rho=0.2 * rho), label="new cohort")
    assert isinstance(err.value, BudgetExhausted)
    assert "'a'" in str(err.value)
    assert table_counts(ledger.path) == before  # no cohort row, no release row, no user row
    assert users_snapshot(ledger.path) == users_before
    assert ledger.spend("b") == UserSpend("b") and ledger.spend("c") == UserSpend("c")
    assert ledger.num_releases() == 1
    # b and c alone can still be charged, a can take what is left and no more
    ledger.charge(["b", "c"], GaussianCharge(rho=0.2 * rho), label="fits")
    assert math.isclose(ledger.rho_left(["a"]), 0.1 * rho, rel_tol=1e-9)
    assert math.isclose(ledger.rho_left(["a", "b"]), 0.1 * rho, rel_tol=1e-9)
    ledger.verify()


@pytest.mark.parametrize("T", [1, 3, 7, 10, 64])
def test_exact_split_fills_budget(tmp_path, T):
    users = ["a", "b"]
    with PrivacyLedger(tmp_path / "l.db", BUDGET) as led:
        part = BUDGET.rho / T
        for t in range(T):
            led.charge(users, GaussianCharge(rho=part), label=f"part {t}")
        assert led.num_releases() == T
        assert led.rho_left(users) <= BUDGET.rho * 1e-12
        before = table_counts(led.path)
        with pytest.raises(BudgetExceeded):
            led.charge(users, GaussianCharge(rho=part), label="one too many")
        with pytest.raises(BudgetExceeded):  # even a tiny further charge
            led.charge(["a"], GaussianCharge(rho=BUDGET.rho * 1e-9), label="crumb")
        assert table_counts(led.path) == before
        assert led.epsilon("a") <= BUDGET.epsilon * (1 + 1e-9)
        led.verify()


def test_mixed_charges(ledger):
    eps_u, delta_u = 0.5, 1e-6
    ledger.charge(["a"], ApproxDPCharge(eps=eps_u, delta=delta_u, mechanism="ptr"), label="ptr")
    sp = ledger.spend("a")
    assert sp.eps == eps_u and sp.delta == delta_u and sp.rho == 0.0
    assert ledger.epsilon("a") == eps_u
    left = ledger.rho_left(["a"])
    expected_left = rho_for_eps_delta(BUDGET.epsilon - eps_u, BUDGET.delta - delta_u)
    assert math.isclose(left, expected_left, rel_tol=1e-12)
    assert left < BUDGET.rho and ledger.rho_left(["fresh"]) == pytest.approx(BUDGET.rho, rel=1e-12)
    # UserSpend.epsilon composes: zcdp_to_eps(rho, delta - delta_u) + eps_u
    ledger.charge(["a"], GaussianCharge(rho=0.5 * left), label="g")
    sp = ledger.spend("a")
    assert math.isclose(
        sp.epsilon(BUDGET.delta), zcdp_to_eps(0.5 * left, BUDGET.delta - delta_u) + eps_u, rel_tol=1e-12
    )
    assert ledger.epsilon("a") == sp.epsilon(BUDGET.delta, BUDGET.conversion)
    assert sp.epsilon(delta_u) == math.inf  # the delta part alone uses up a delta this small
    # the rest of the rho fits exactly; beyond it is refused
    ledger.charge(["a"], GaussianCharge(rho=ledger.rho_left(["a"])), label="g2")
    assert ledger.epsilon("a") <= BUDGET.epsilon * (1 + 1e-9)
    with pytest.raises(BudgetExceeded):
        ledger.charge(["a"], GaussianCharge(rho=1e-6), label="g3")
    # pure eps / delta charges are checked too
    with pytest.raises(BudgetExceeded):
        ledger.charge(["b"], ApproxDPCharge(eps=BUDGET.epsilon * 1.01, delta=0.0, mechanism="laplace"), label="eps")
    with pytest.raises(BudgetExceeded):
        ledger.charge(["b"], ApproxDPCharge(eps=0.1, delta=BUDGET.delta, mechanism="ptr"), label="delta")
    # an eps charge uses budget that rho can no longer have
    ledger.charge(["b"], ApproxDPCharge(eps=BUDGET.epsilon, delta=0.0, mechanism="laplace"), label="eps")
    assert ledger.rho_left(["b"]) == 0.0
    with pytest.raises(BudgetExceeded):
        ledger.charge(["b"], GaussianCharge(rho=1e-9), label="g")
    ledger.verify()


# --------------------------------------------------------------------------------------------------
# persistence
# --------------------------------------------------------------------------------------------------
def test_reopen_keeps_totals(tmp_path):
    path = tmp_path / "l.db"
    with PrivacyLedger(path, BUDGET, run_id="first") as led:
        led.charge(["a", "b"], GaussianCharge(rho=0.01), label="r1")
        led.charge(["a"], GaussianCharge(rho=0.005), label="r2")
    with PrivacyLedger(path, BUDGET, run_id="second") as led:
        assert math.isclose(led.spend("a").rho, 0.015, rel_tol=1e-12) and led.spend("a").releases == 2
        assert led.num_releases() == 2 and led.num_releases("first") == 2 and led.num_releases("second") == 0
        led.charge(["a"], GaussianCharge(rho=0.005), label="r3")
        # the resumed run is still bound by what the first one spent
        with pytest.raises(BudgetExceeded):
            led.charge(["a"], GaussianCharge(rho=BUDGET.rho - 0.015), label="too much")
        led.verify()
    with PrivacyLedger(path) as led:  # budget read from the file
        assert led.budget == BUDGET
        assert math.isclose(led.spend("a").rho, 0.02, rel_tol=1e-12)


def test_reopen_with_other_budget_refused(tmp_path):
    path = tmp_path / "l.db"
    with PrivacyLedger(path, BUDGET) as led:
        led.charge(["a"], GaussianCharge(rho=0.1), label="r1")
    for other in (Budget(3.0, 1e-5), Budget(2.0, 1e-6), Budget(2.0, 1e-5, "bun_steinke")):
        with pytest.raises(LedgerError):
            PrivacyLedger(path, other)
    with PrivacyLedger(path, BUDGET) as led:  # the refusal changed nothing
        assert led.num_releases() == 1


def test_new_file_needs_budget(tmp_path):
    with pytest.raises(LedgerError):
        PrivacyLedger(tmp_path / "new.db")


def test_rollback_journal_and_synchronous_full(ledger):
    assert ledger._db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert ledger._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    con = sqlite3.connect(ledger.path)  # the file is not in WAL mode: no -wal file can hold charges
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    con.close()


def test_a_copy_of_the_ledger_file_alone_has_every_charge(tmp_path):
    """Copying ledger.sqlite without any side file, while the run that charged still holds the
    ledger open, keeps every charge (under WAL the charges sat in ledger.sqlite-wal and the copy
    silently had the full budget back)."""
    path = tmp_path / "l.db"
    with PrivacyLedger(path, BUDGET, run_id="r") as led:
        for k in range(5):
            led.charge(["a", "b"], GaussianCharge(rho=BUDGET.rho / 10), label=f"{k}")
        assert sorted(os.listdir(tmp_path)) == ["l.db"]  # no -wal / -journal file beside it
        shutil.copy(path, tmp_path / "copy.db")
    with PrivacyLedger(tmp_path / "copy.db") as copy:
        copy.verify()
        assert copy.num_releases() == 5 and copy.spend("a").releases == 5
        assert copy.rho_left(["a"]) == pytest.approx(BUDGET.rho / 2, rel=1e-9)


def test_a_wal_ledger_is_checkpointed_and_switched_at_first_open(tmp_path):
    """A schema-2 ledger in WAL mode whose last charges are still in its -wal file keeps them."""
    path = str(tmp_path / "old.db")
    with PrivacyLedger(path, BUDGET, run_id="old-run") as led:
        led.charge(["a"], GaussianCharge(rho=0.01), label="first")
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("UPDATE meta SET value = '2' WHERE key = 'schema'")  # and schema 2's tables exactly:
    for column in ("pid", "host", "proc_start", "ended", "note"):
        con.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    con.execute("DROP TABLE reservations")
    con.execute("UPDATE users SET rho = rho + 0.02, releases = releases + 1")  # stands in for a charge...
    con.execute(
        "INSERT INTO releases (run_id, label, mechanism, rho, eps, delta, cohort_id, created) "
        "SELECT NULL, 'in wal', 'gaussian', 0.02, 0, 0, id, 0 FROM cohorts"
    )  # ... whose release row is still in the WAL only
    assert os.path.getsize(path + "-wal") > 0
    with pytest.raises(LedgerError, match="locked by another process"):  # its WAL writer is still open
        PrivacyLedger(path, timeout=0.2)
    # the files as a crashed older fedkl leaves them (its close would have checkpointed the WAL)
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for suffix in ("", "-wal"):
        shutil.copy(path + suffix, str(crashed / "old.db") + suffix)
    con.close()
    with PrivacyLedger(crashed / "old.db") as led:
        assert led._db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert led.num_releases() == 2 and led.spend("a").rho == pytest.approx(0.03)
        led.verify()
        assert [(r["run_id"], r["status"], r["pid"]) for r in led.runs()] == [("old-run", "finished", None)]
        assert led._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (str(SCHEMA_VERSION),)
    assert not os.path.exists(crashed / "old.db-wal")


# --------------------------------------------------------------------------------------------------
# crash: SIGKILL at random moments
# --------------------------------------------------------------------------------------------------
# Children import the real fedkl/privacy/ledger.py (and its imports zcdp.py, filter.py) but skip the
# package __init__ files, which pull in torch and dp-accounting (~1.5 s per process) for nothing the
# ledger uses.
LEDGER_ONLY_IMPORT = textwrap.dedent(
    """
    import os, sys, types
    for _name in ("fedkl", "fedkl.privacy"):
        _m = types.ModuleType(_name)
        _m.__path__ = [os.path.join(%r, *_name.split("."))]
        sys.modules[_name] = _m
"""
    % REPO
)

RHO_PER_RELEASE = 1e-6
N_USERS = 50
CRASH_CHILD = LEDGER_ONLY_IMPORT + textwrap.dedent(
    """
    import os, sys
    from fedkl.privacy.charges import GaussianCharge
    from fedkl.privacy.ledger import Budget, PrivacyLedger
    path, log = sys.argv[1], sys.argv[2]
    users = [f"u{i}" for i in range(%d)]
    led = PrivacyLedger(path, Budget(2.0, 1e-5), run_id="crash")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    k = 0
    while True:
        led.charge(users, GaussianCharge(rho=%r), label=f"release {k}")
        # the "release" happens only after charge() returned
        k += 1
        os.write(fd, f"released {k}\\n".encode())
        os.fsync(fd)
        if k == 1:  # warm (lazy imports done, one release made): the parent's kill clock starts now
            print("ready", flush=True)
"""
    % (N_USERS, RHO_PER_RELEASE)
)


def test_sigkill_never_loses_a_charge(tmp_path):
    rng = random.Random(20240601)
    delays = [0.05, 0.6] + [rng.uniform(0.05, 0.6) for _ in range(4)]
    trials = []
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # start all children at once (the import of fedkl dominates their start-up), kill each after
    # its own delay counted from the moment it reported ready, i.e. after its first release: an event,
    # not a deadline, so that a loaded machine's slow first charge (lazy imports) cannot make every
    # kill land before anything was released
    for i, _ in enumerate(delays):
        path, log = tmp_path / f"crash{i}.db", tmp_path / f"crash{i}.log"
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASH_CHILD, str(path), str(log)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        trials.append((proc, path, log))
    for (proc, _, _), delay in zip(trials, delays):
        line = proc.stdout.readline()
        assert line.strip() == b"ready", proc.stderr.read().decode()
        ready = time.monotonic()
        proc._kill_at = ready + delay
    for proc, _, _ in sorted(trials, key=lambda t: t[0]._kill_at):
        time.sleep(max(0.0, proc._kill_at - time.monotonic()))
        assert proc.poll() is None, proc.stderr.read().decode()  # still charging when killed
        os.kill(proc.pid, signal.SIGKILL)
    for proc, path, log in trials:
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        lines = log.read_text().splitlines() if log.exists() else []
        assert all(l == f"released {k + 1}" for k, l in enumerate(lines))
        with PrivacyLedger(path, Budget(2.0, 1e-5)) as led:
            n = led.num_releases()
            # every released value was charged; at most one charge was in flight and not released
            assert len(lines) <= n <= len(lines) + 1
            led.verify()
            for i in range(N_USERS):
                sp = led.spend(f"u{i}")
                assert sp.releases == n
                assert math.isclose(sp.rho, n * RHO_PER_RELEASE, rel_tol=1e-9)
            assert led.spend("u50").releases == 0
            # the ledger is usable after the crash
            led.charge([f"u{i}" for i in range(N_USERS)], GaussianCharge(rho=RHO_PER_RELEASE), label="after crash")
            assert led.num_releases() == n + 1
            led.verify()
        assert lines  # each child reported ready after its first release, so the kill came mid-run


# --------------------------------------------------------------------------------------------------
# several handles / processes on one file
# --------------------------------------------------------------------------------------------------
def test_two_handles_share_the_budget(tmp_path):
    path = tmp_path / "shared.db"
    h1, h2 = PrivacyLedger(path, BUDGET, run_id="server-1"), PrivacyLedger(path, BUDGET, run_id="server-2")
    try:
        part = BUDGET.rho / 4
        h1.charge(["a", "b"], GaussianCharge(rho=part), label="1")
        h2.charge(["a"], GaussianCharge(rho=part), label="2")
        h1.charge(["a", "c"], GaussianCharge(rho=part), label="3")
        h2.charge(["a", "b"], GaussianCharge(rho=part), label="4")
        for h in (h1, h2):
            assert h.num_releases() == 4
            assert math.isclose(h.spend("a").rho, BUDGET.rho, rel_tol=1e-12) and h.spend("a").releases == 4
        # a is full: both handles see it and refuse
        with pytest.raises(BudgetExceeded):
            h1.charge(["a"], GaussianCharge(rho=part), label="5")
        with pytest.raises(BudgetExceeded):
            h2.charge(["c", "a"], GaussianCharge(rho=part), label="5")
        assert h1.num_releases("server-1") == 2 and h2.num_releases("server-2") == 2
        h1.verify()
        h2.verify()
    finally:
        h1.close()
        h2.close()


RACE_CHILD = LEDGER_ONLY_IMPORT + textwrap.dedent("""
    import sys
    from fedkl.privacy.charges import GaussianCharge
    from fedkl.privacy.ledger import Budget, BudgetExceeded, PrivacyLedger
    path = sys.argv[1]
    b = Budget(2.0, 1e-5)
    led = PrivacyLedger(path, b)
    print("ready", flush=True)
    sys.stdin.readline()  # the parent releases both processes at once
    ok = refused = 0
    for i in range(8):
        try:
            led.charge(["shared", f"own-{sys.argv[2]}-{i}"], GaussianCharge(rho=b.rho / 10), label="x")
            ok += 1
        except BudgetExceeded:
            refused += 1
    print(ok, refused)
""")


def test_two_processes_race_for_the_last_budget(tmp_path):
    """Two processes charge the same user concurrently, 8 tries each, each try a tenth of the
    budget: exactly 10 of the 16 must be accepted, whatever the interleaving."""
    path = tmp_path / "race.db"
    PrivacyLedger(path, BUDGET).close()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE_CHILD, str(path), str(k)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        for k in range(2)
    ]
    for p in procs:  # wait until both have imported and opened the ledger ...
        assert p.stdout.readline().strip() == b"ready", p.stderr.read().decode()
    for p in procs:  # ... then let them charge at the same moment
        p.stdin.write(b"go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        results.append(tuple(map(int, out.split())))
    assert sum(r[0] for r in results) == 10 and sum(r[1] for r in results) == 6
    with PrivacyLedger(path, BUDGET) as led:
        assert led.num_releases() == 10
        assert led.spend("shared").releases == 10
        assert math.isclose(led.spend("shared").rho, BUDGET.rho, rel_tol=1e-9)
        assert led.epsilon("shared") <= BUDGET.epsilon * (1 + 1e-9)
        led.verify()


def test_charges_over_overlapping_cohorts_give_each_user_the_sum_of_its_releases_in_order(tmp_path):
    """Releases over overlapping cohorts of 6 users, with Gaussian and (eps, delta) charges (totals that
    differ between users and collide across groups, each cohort's users updated in one statement): every
    user's totals are exactly (floats compared exactly) the sum, in order, of the costs of its releases."""
    cohorts = [["a", "b", "c"], ["a", "b", "c"], ["c", "d"], ["a", "b", "c", "d", "e", "f"], ["e"]]
    for seed in range(3):
        rng = random.Random(seed)
        led = PrivacyLedger(tmp_path / f"l{seed}.sqlite", BUDGET, run_id="r")
        expected: dict[str, list] = {}
        for i in range(40):
            members = cohorts[rng.randrange(len(cohorts))]
            charge = (
                GaussianCharge(rng.choice([0.001, 0.002, 0.003]), 1.0)
                if rng.random() < 0.7
                else ApproxDPCharge(0.01, 1e-9, "ptr", 1.0, 1.0)
            )
            led.charge(members, charge, label=f"r{i}", seq=i)
            for m in members:
                t = expected.setdefault(m, [0.0, 0.0, 0.0, 0])
                t[:] = [t[0] + charge.cost()[0], t[1] + charge.cost()[1], t[2] + charge.cost()[2], t[3] + 1]
        got = {u["user_id"]: [u["rho"], u["eps"], u["delta"], u["releases"]] for u in led.user_spends()}
        assert got == expected
        assert [r["seq"] for r in led.releases()] == list(range(40))
        led.verify()
        led.close()


def test_a_charge_that_takes_one_user_over_budget_is_refused_whole(tmp_path):
    """One user over budget refuses the charge for every user, with nothing written; a charge that
    exactly fits is made."""
    led = PrivacyLedger(tmp_path / "l.sqlite", BUDGET, run_id="r")
    rho = BUDGET.rho / 4
    led.charge(["a"], GaussianCharge(rho, 1.0), label="first")
    for i in range(3):
        led.charge(["a", "b"], GaussianCharge(rho, 1.0), label=f"r{i}", seq=i)  # a: exactly 4 quarters
    before = led.user_spends()
    with pytest.raises(BudgetExceeded, match="1 user"):
        led.charge(["a", "b"], GaussianCharge(rho, 1.0), label="r3", seq=3)  # a: 5 quarters
    assert led.user_spends() == before and led.num_releases() == 4
    assert led.spend("a").releases == 4 and led.spend("b").rho == 3 * rho
    led.verify()
    led.close()


def test_a_charge_adds_once_where_one_group_reaches_another_groups_totals(tmp_path):
    """User a has spent r, b nothing; a charge of r to both: b's new total is a's old one, and each
    user is still charged exactly once."""
    led = PrivacyLedger(tmp_path / "l.sqlite", BUDGET, run_id="r")
    r = BUDGET.rho / 8
    led.charge(["a"], GaussianCharge(r, 1.0), label="first")
    led.charge(["a", "b"], GaussianCharge(r, 1.0), label="both", seq=0)
    assert (led.spend("a").rho, led.spend("b").rho) == (r + r, r)
    assert (led.spend("a").releases, led.spend("b").releases) == (2, 1)
    led.verify()
    led.close()
