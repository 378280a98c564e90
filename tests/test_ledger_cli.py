"""`fedkl ledger` (show/users/releases/runs/verify/release-stale, table and strict JSON), and what
`fedkl run` does with a ledger: two concurrent runs, a ledger that does not verify, a corrupt or
spent one (exit 3, one line), Ctrl-C (one line, exit 130, the run marked interrupted) and the
progress bar (issue 20, issue 15 §6)."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading

import pytest

from fedkl.cli import main
from fedkl.privacy import Budget, LedgerBusy, PrivacyLedger
from fedkl.privacy.charges import ApproxDPCharge, GaussianCharge

FEDKL = [sys.executable, "-m", "fedkl.cli"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = dict(dataset="synthetic-logistic", epsilon=2.0, delta=1e-5, rounds=3, noise_seed=0, reference=False)


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _train(tmp_path, name: str, ledger: str):
    from fedkl.runner import RunConfig, run_training

    return run_training(RunConfig.from_settings(**RUN, ledger=ledger, out=str(tmp_path / name)), log=lambda s: None)


def _user_ids() -> list[str]:
    from fedkl.data import load_dataset

    return list(load_dataset("synthetic-logistic", seed=0).train.user_ids)


def test_ledger_commands_as_tables_and_strict_json(tmp_path, capsys):
    path = str(tmp_path / "l.sqlite")
    res = _train(tmp_path, "a", path)
    capsys.readouterr()

    assert main(["ledger", "show", path, "--json"]) == 0
    show = _strict_json(capsys.readouterr().out)
    assert show["users_charged"] == res["users"] == 200 and show["releases"] == 3
    assert show["max_user_epsilon_exact"] == pytest.approx(res["epsilon"])
    assert show["runs"] == {"finished": 1} and show["active_runs"] == [] and show["verify"]["ok"]
    assert main(["ledger", "show", path]) == 0
    text = capsys.readouterr().out
    assert "users charged: 200; releases: 3" in text and "1 finished" in text and "verify: ok" in text

    assert main(["ledger", "users", path, "--json", "--limit", "5"]) == 0
    users = _strict_json(capsys.readouterr().out)["users"]
    assert len(users) == 5 and all(u["releases"] == 3 for u in users)
    assert users[0]["epsilon"] == pytest.approx(2.0, rel=1e-9) and users[0]["rho"] == pytest.approx(res["rho"])
    assert main(["ledger", "users", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["user_id", "releases", "rho", "eps", "delta", "epsilon", "epsilon_exact"]
    assert len(lines) == 1 + 200

    assert main(["ledger", "releases", path, "--json", "--run", res["run_id"]]) == 0
    rel = _strict_json(capsys.readouterr().out)["releases"]
    assert [r["id"] for r in rel] == [1, 2, 3] and all(r["users"] == 200 and r["mechanism"] == "gaussian" for r in rel)
    assert sum(r["rho"] for r in rel) == pytest.approx(res["rho"])

    assert main(["ledger", "runs", path, "--json"]) == 0
    runs = _strict_json(capsys.readouterr().out)["runs"]
    assert [(r["run_id"], r["status"], r["releases"], r["pid"]) for r in runs] == [
        (res["run_id"], "finished", 3, os.getpid())
    ]
    assert main(["ledger", "runs", path]) == 0
    assert res["run_id"] in capsys.readouterr().out

    assert main(["ledger", "verify", path]) == 0
    assert "verifies: 3 releases" in capsys.readouterr().out
    assert main(["ledger", "release-stale", path]) == 0
    assert "nothing to release" in capsys.readouterr().out

    # a damaged ledger: verify says so in one line, exit 3; so does a missing one
    con = sqlite3.connect(path)
    con.execute("UPDATE users SET rho = rho / 2 WHERE user_id = (SELECT MIN(user_id) FROM users)")
    con.commit()
    con.close()
    assert main(["ledger", "verify", path]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not match its release log" in err[0]
    assert main(["ledger", "show", str(tmp_path / "missing.sqlite")]) == 3
    assert "does not exist" in capsys.readouterr().err


def test_two_concurrent_runs_on_one_ledger_end_with_one_model_and_no_budget_wasted(tmp_path, monkeypatch):
    """Both runs open the ledger and reach their reservation together (a barrier); the one that
    reserves first trains on the whole budget, the other is refused before any charge, naming the
    active run. Before reservations both sized themselves to the full budget, their charges
    interleaved and both stopped half-way with no model."""
    path = str(tmp_path / "shared.sqlite")
    real_reserve = PrivacyLedger.reserve
    together, reserved = threading.Barrier(2, timeout=60), threading.Barrier(2, timeout=60)

    def reserve(self, user_ids):
        together.wait()  # both runs are about to reserve
        try:
            return real_reserve(self, user_ids)
        finally:
            reserved.wait()  # the winner trains only once the loser's reservation was answered

    monkeypatch.setattr(PrivacyLedger, "reserve", reserve)
    results: dict[str, object] = {}

    def run(name):
        try:
            results[name] = _train(tmp_path, name, path)
        except Exception as e:  # noqa: BLE001  (the test inspects it)
            results[name] = e

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    won = [r for r in results.values() if isinstance(r, dict)]
    lost = [r for r in results.values() if not isinstance(r, dict)]
    assert len(won) == 1 and len(lost) == 1, results
    winner, refusal = won[0], lost[0]
    assert isinstance(refusal, LedgerBusy)
    msg = str(refusal)
    assert f"run {winner['run_id']} (pid {os.getpid()}" in msg and "started" in msg and "\n" not in msg
    # one model, and it used the whole budget: nothing was wasted by the refused run
    assert sorted(p.name for p in tmp_path.glob("*/model.pt")) == ["model.pt"]
    assert winner["ledger"]["max_user_epsilon"] == pytest.approx(2.0, rel=1e-9)
    with PrivacyLedger(path) as led:
        statuses = sorted(r["status"] for r in led.runs())
        assert statuses == ["finished", "refused"]
        assert {r["run_id"] for r in led.releases()} == {winner["run_id"]} and led.num_releases() == 3
        led.verify()


def test_run_refuses_a_ledger_that_does_not_verify_before_any_release(tmp_path, capsys):
    path = tmp_path / "l.sqlite"
    with PrivacyLedger(path, Budget(2.0, 1e-5)) as led:
        led.charge(_user_ids(), GaussianCharge(rho=Budget(2.0, 1e-5).rho / 2), label="earlier")
    con = sqlite3.connect(path)
    con.execute("UPDATE users SET rho = 0")  # the damage that let users reach eps = 3.04 against 2
    con.commit()
    con.close()
    args = ["run", "--dataset", "synthetic-logistic", "--delta", "1e-5", "--rounds", "3", "--no-reference"]
    assert main([*args, "--ledger", str(path), "--out", str(tmp_path / "o")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not match its release log" in err[0]
    with PrivacyLedger(path) as led:
        assert led.num_releases() == 1 and [r["status"] for r in led.runs()] == ["refused"]


@pytest.mark.parametrize("algorithm", ["noisy-gd", "dp-sgd"])
def test_float_dust_and_corrupt_ledgers_exit_3_with_one_line(tmp_path, capsys, algorithm):
    budget, users = Budget(2.0, 1e-5), _user_ids()
    args = ["run", "--dataset", "synthetic-logistic", "--delta", "1e-5", "--no-reference", "--algorithm", algorithm]
    for k, spend in enumerate(
        (
            GaussianCharge(rho=budget.rho - 5e-15),  # what interrupted and resumed runs left: rho ~ 5e-15
            None,  # all that approx_left offers, as a dp-sgd run takes it (it used to end in a RecursionError)
        )
    ):
        dust = tmp_path / f"dust{k}.sqlite"
        with PrivacyLedger(dust, budget) as led:
            eps, delta = led.approx_left(users)
            led.charge(users, spend or ApproxDPCharge(eps=eps, delta=delta, mechanism="gaussian-schedule"), label="x")
        assert main([*args, "--ledger", str(dust), "--out", str(tmp_path / f"o{k}")]) == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "budget" in err[0] and "spent" in err[0]
        with PrivacyLedger(dust) as led:
            assert led.num_releases() == 1  # nothing spent on useless releases
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"\x00garbage" * 1000)
    assert main([*args, "--ledger", str(corrupt), "--out", str(tmp_path / "p")]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable fedkl ledger" in err[0]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_ends_a_run_with_one_line_exit_130_and_the_run_marked_interrupted(tmp_path, sig):
    """Ctrl-C (SIGINT: exit 130) and SIGTERM (exit 143) once the run has made releases."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        FEDKL
        + ["run", "--dataset", "synthetic-logistic", "--rounds", "20000", "--no-reference"]
        + ["--noise-seed", "0", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    for line in proc.stdout:  # wait until training has made releases (a progress line), then Ctrl-C
        if line.strip().startswith("round"):
            proc.send_signal(sig)
            break
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("fedkl run: interrupted: run ") and "no model was released" in lines[0]
    assert "the ledger marks the run interrupted" in lines[0]
    assert not (out / "result.json").exists() and not (out / "model.pt").exists()
    with PrivacyLedger(out / "ledger.sqlite") as led:
        (run,) = led.runs()
        assert run["status"] == "interrupted" and run["reserved_users"] == 0
        # the first progress line is round 1's (then at most one a second)
        assert 1 <= run["releases"] < 20000 and f"made {run['releases']} release(s)" in lines[0]
        led.verify()


def test_the_progress_bar_shows_rounds_and_eta_on_a_terminal_only():
    from rich.console import Console

    from fedkl.run_progress import make_observer

    term = io.StringIO()
    observer = make_observer(type("Tty", (io.StringIO,), {"isatty": lambda self: True})())
    assert observer.console is not None
    observer.console = Console(file=term, force_terminal=True, width=100)
    for k in range(1, 11):
        observer.round({"round": k, "rounds": 10})
    observer.trained(True)  # stops the bar: its last frame is drawn, then erased (transient)
    drawn = term.getvalue()
    assert "10/10" in drawn and "ETA" in drawn
    plain = make_observer(io.StringIO())  # not a terminal: no bar, the run's plain round lines only
    plain.round({"round": 1, "rounds": 10})
    assert plain.console is None


def test_the_interrupt_line_reads_the_run_back_from_the_ledger(tmp_path):
    from fedkl.run_progress import CliObserver

    observer = CliObserver()
    assert observer.interrupted_line() == (
        "fedkl run: interrupted before the run started: nothing was charged or released"
    )
    path = str(tmp_path / "l.sqlite")
    with PrivacyLedger(path, Budget(2.0, 1e-5), run_id="r") as led:
        led.reserve(["a", "b"])
        observer.started("r", path)
        led.charge(["a", "b"], GaussianCharge(rho=0.01), label="1")
        led.charge(["a"], GaussianCharge(rho=0.02), label="2")
        eps_a = led.epsilon("a")
    observer.trained(True)  # interrupted after the algorithm returned its model (e.g. in the reference)
    line = observer.interrupted_line()
    assert line.startswith("fedkl run: interrupted: run r made 2 release(s) charged to ledger ")
    assert f"eps = {eps_a:.4g}, rho = 0.03)" in line and "the model was released" in line
    assert line.endswith("the ledger marks the run finished")
