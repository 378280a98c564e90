"""Runs on the ledger: a run reserves its users' remaining budget atomically (a second run is refused
in one line naming the active one), run statuses are exact, stale reservations of dead runs are
released only by release_stale() after a check, the ledger is verified before a run starts, float
dust counts as spent, and SQLite failures are one-line LedgerErrors (issue 20, issue 15 §6)."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap

import pytest
from test_ledger import BUDGET, LEDGER_ONLY_IMPORT, REPO

from fedkl.privacy.charges import ApproxDPCharge, GaussianCharge
from fedkl.privacy.ledger import SPENT_BELOW, BudgetExceeded, LedgerBusy, LedgerError, PrivacyLedger


def status(path, run_id) -> str:
    con = sqlite3.connect(path)
    try:
        return con.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0]
    finally:
        con.close()


# --------------------------------------------------------------------------------------------------
# reservations
# --------------------------------------------------------------------------------------------------
def test_a_run_holds_its_users_and_a_second_run_is_refused_naming_it(tmp_path):
    path = tmp_path / "l.db"
    a = PrivacyLedger(path, BUDGET, run_id="run-a")
    b = PrivacyLedger(path, BUDGET, run_id="run-b")
    other = PrivacyLedger(path, BUDGET)  # no run: an ad-hoc handle
    try:
        a.reserve(["u1", "u2"])
        assert a.rho_left(["u1", "u2"]) == pytest.approx(BUDGET.rho, rel=1e-12)
        # every other handle sees nothing left for the held users ...
        assert b.rho_left(["u1"]) == 0.0 and b.approx_left(["u2", "u3"]) == (0.0, 0.0)
        assert other.rho_left(["u2"]) == 0.0
        # ... cannot charge them (nothing written) ...
        with pytest.raises(LedgerBusy, match="run run-a"):
            other.charge(["u2", "u3"], GaussianCharge(rho=0.01), label="x")
        assert other.num_releases() == 0 and other.spend("u3").releases == 0
        # ... and a second run on any of them is refused in one line naming the active run
        with pytest.raises(LedgerBusy) as refused:
            b.reserve(["u2", "u3"])
        msg = str(refused.value)
        assert "\n" not in msg
        assert f"run run-a (pid {os.getpid()} on " in msg and "started 20" in msg and "1 of these users" in msg
        assert status(path, "run-b") == "refused"
        # users nobody holds stay free for everyone
        assert other.rho_left(["u3"]) == pytest.approx(BUDGET.rho, rel=1e-12)
        a.charge(["u1", "u2"], GaussianCharge(rho=BUDGET.rho / 4), label="a1")
        a.finish_run("finished")
        # the reservation ends with the run: a new run sees what is left, no more
        c = PrivacyLedger(path, BUDGET, run_id="run-c")
        c.reserve(["u2", "u3"])
        assert c.rho_left(["u2", "u3"]) == pytest.approx(BUDGET.rho * 3 / 4, rel=1e-9)
        c.close()
    finally:
        for h in (a, b, other):
            h.close()
    with PrivacyLedger(path) as led:
        assert [(r["run_id"], r["status"]) for r in led.runs()] == [
            ("run-a", "finished"),
            ("run-b", "refused"),
            ("run-c", "running"),  # closed without finish_run or a with-block: still open
        ]


def test_run_status_is_exact(tmp_path):
    path = tmp_path / "l.db"
    with PrivacyLedger(path, BUDGET, run_id="ok") as led:
        led.reserve(["a"])
        led.charge(["a"], GaussianCharge(rho=0.001), label="x")
    with pytest.raises(RuntimeError):
        with PrivacyLedger(path, BUDGET, run_id="early-error") as led:
            led.reserve(["a"])
            raise RuntimeError("before any release")
    with pytest.raises(RuntimeError):
        with PrivacyLedger(path, BUDGET, run_id="late-error") as led:
            led.reserve(["a"])
            led.charge(["a"], GaussianCharge(rho=0.001), label="x")
            raise RuntimeError("after a release")
    with pytest.raises(KeyboardInterrupt):
        with PrivacyLedger(path, BUDGET, run_id="ctrl-c") as led:
            led.reserve(["a"])
            led.charge(["a"], GaussianCharge(rho=0.001), label="x")
            raise KeyboardInterrupt
    with PrivacyLedger(path) as led:
        got = {r["run_id"]: (r["status"], r["releases"], r["reserved_users"]) for r in led.runs()}
        assert all(r["ended"] is not None for r in led.runs())
    assert got == {
        "ok": ("finished", 1, 0),
        "early-error": ("refused", 0, 0),
        "late-error": ("failed", 1, 0),
        "ctrl-c": ("interrupted", 1, 0),
    }
    with pytest.raises(ValueError):
        PrivacyLedger(path, run_id="x").finish_run("running")


def test_run_charges_reports_the_most_charged_user(tmp_path):
    with PrivacyLedger(tmp_path / "l.db", BUDGET, run_id="r") as led:
        led.charge(["a", "b"], GaussianCharge(rho=0.01), label="1")
        led.charge(["a"], GaussianCharge(rho=0.02), label="2")
        led.charge(["b"], ApproxDPCharge(eps=0.1, delta=1e-7, mechanism="ptr"), label="3")
        got = led.run_charges("r")
        assert got["releases"] == 3 and got["users_charged"] == 2
        assert got["max_user_epsilon"] == pytest.approx(max(led.epsilon("a"), led.epsilon("b")))
        assert led.run_charges("nothing")["releases"] == 0


# --------------------------------------------------------------------------------------------------
# stale runs: a SIGKILLed run is released only by release_stale(), after a check
# --------------------------------------------------------------------------------------------------
HOLDER = LEDGER_ONLY_IMPORT + textwrap.dedent(
    """
    import sys, time
    from fedkl.privacy.ledger import Budget, PrivacyLedger
    led = PrivacyLedger(sys.argv[1], Budget(2.0, 1e-5), run_id="killed")
    led.reserve(["a", "b"])
    print("reserved", flush=True)
    sys.stdin.readline()  # held until killed
"""
)


def test_a_killed_run_is_released_only_by_release_stale(tmp_path):
    path = tmp_path / "l.db"
    PrivacyLedger(path, BUDGET).close()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO
    )
    assert proc.stdout.readline().strip() == b"reserved"
    with PrivacyLedger(path) as led:  # alive: nothing is released
        assert led.release_stale() == {
            "released": [],
            "kept": [{"run_id": "killed", "why": f"its process (pid {proc.pid}) is still running"}],
        }
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stdin.close()
    # dead, but never released silently: the run stays `running` and a new run is refused, told how
    with PrivacyLedger(path, BUDGET, run_id="next") as nxt:
        with pytest.raises(LedgerBusy, match=r"run killed .*process is gone: `fedkl ledger release-stale "):
            nxt.reserve(["b", "c"])
    assert status(path, "killed") == "running"
    with PrivacyLedger(path) as led:
        assert led.release_stale() == {"released": ["killed"], "kept": []}
        run = next(r for r in led.runs() if r["run_id"] == "killed")
        assert run["status"] == "interrupted" and "release-stale" in run["note"] and run["reserved_users"] == 0
        assert led.release_stale() == {"released": [], "kept": []}
    with PrivacyLedger(path, BUDGET, run_id="after") as led:
        led.reserve(["b", "c"])
        assert led.rho_left(["b", "c"]) == pytest.approx(BUDGET.rho, rel=1e-12)


def test_release_stale_tells_a_reused_pid_and_other_hosts_apart(tmp_path):
    path = tmp_path / "l.db"
    with PrivacyLedger(path, BUDGET, run_id="mine") as me:
        me.reserve(["a"])
        con = sqlite3.connect(path)
        # same pid as a live process, but another process start time: the pid was reused
        con.execute(
            "INSERT INTO runs VALUES ('reused', 0, '{}', 'running', ?, ?, '1', NULL, NULL)",
            (os.getpid(), socket.gethostname()),
        )
        con.execute("INSERT INTO runs VALUES ('far', 0, '{}', 'running', 1, 'elsewhere', NULL, NULL, NULL)")
        con.execute("INSERT INTO runs VALUES ('schema2', 0, '{}', 'running', NULL, NULL, NULL, NULL, NULL)")
        con.commit()
        con.close()
        with PrivacyLedger(path) as led:
            out = led.release_stale()
    assert sorted(out["released"]) == ["reused", "schema2"]
    assert [k["run_id"] for k in out["kept"]] == ["far", "mine"]  # another host; alive
    assert status(path, "mine") == "finished"


# --------------------------------------------------------------------------------------------------
# verify before the first release; float dust; SQLite failures
# --------------------------------------------------------------------------------------------------
def test_a_ledger_that_does_not_verify_is_refused_before_the_run_starts(tmp_path):
    """A damaged ledger (stored totals lowered) let users end at eps = 3.04 against a budget of 2
    when it was verified only after training: now the run is refused before any release."""
    path = tmp_path / "l.db"
    with PrivacyLedger(path, BUDGET) as led:
        led.charge(["a"], GaussianCharge(rho=BUDGET.rho / 2), label="x")
    con = sqlite3.connect(path)
    con.execute("UPDATE users SET rho = 0")
    con.commit()
    con.close()
    with PrivacyLedger(path, BUDGET, run_id="r") as led:
        with pytest.raises(LedgerError, match="do not match its release log"):
            led.reserve(["a"])
    assert status(path, "r") == "refused"


def test_float_dust_counts_as_spent(tmp_path):
    with PrivacyLedger(tmp_path / "l.db", BUDGET) as led:
        # charges that leave rho ~ 5e-15 (what interrupted and resumed runs left behind)
        led.charge(["a"], GaussianCharge(rho=BUDGET.rho - 5e-15), label="x")
        assert 0 < BUDGET.rho - led.spend("a").rho < SPENT_BELOW * BUDGET.rho
        assert led.rho_left(["a"]) == 0.0
        assert led.rho_left(["b"]) == pytest.approx(BUDGET.rho, rel=1e-12)
        # just above the floor is still budget
        led.charge(["c"], GaussianCharge(rho=BUDGET.rho * (1 - 2 * SPENT_BELOW)), label="y")
        assert led.rho_left(["c"]) == pytest.approx(2 * SPENT_BELOW * BUDGET.rho, rel=1e-3)
        # an (eps, delta) budget spent through approx_left's own offer (what dp-sgd takes) is spent
        eps, delta = led.approx_left(["d"])
        led.charge(["d"], ApproxDPCharge(eps=eps, delta=delta, mechanism="gaussian-schedule"), label="z")
        assert led.approx_left(["d"]) == (0.0, 0.0) and led.rho_left(["d"]) == 0.0


def test_locked_and_corrupt_ledgers_are_one_line_ledger_errors(tmp_path):
    path = tmp_path / "l.db"
    led = PrivacyLedger(path, BUDGET, timeout=0.2)
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(LedgerError, match="locked by another process") as e:
            led.charge(["a"], GaussianCharge(rho=0.01), label="x")
        assert "\n" not in str(e.value)
        with pytest.raises(LedgerError, match="locked by another process"):
            PrivacyLedger(path, timeout=0.2)
    finally:
        con.execute("ROLLBACK")
        con.close()
    assert led.num_releases() == 0
    led.close()
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not an sqlite file" * 100)
    with pytest.raises(LedgerError, match="not a readable fedkl ledger"):
        PrivacyLedger(bad)
    with pytest.raises(BudgetExceeded):  # still the budget error, not a LedgerError, when over budget
        with PrivacyLedger(path) as led:
            led.charge(["a"], GaussianCharge(rho=2 * BUDGET.rho), label="too much")
