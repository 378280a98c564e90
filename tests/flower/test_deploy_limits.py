"""`--backend grpc` within its means: a population the machine cannot hold is refused in one line before
anything starts, and a deployment's key material is deleted whatever the outcome (no process spawned here
beyond one that exits at once)."""

from __future__ import annotations

import subprocess

import pytest

from fedkl.cli import main
from fedkl.flower import deploy
from fedkl.runner import RUN_OBSERVER, RunObserver

pytestmark = pytest.mark.flower


def test_grpc_refuses_more_users_than_the_machine_holds_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(deploy, "_mem_available_bytes", lambda: deploy.RESERVED_BYTES + 10 * deploy.NODE_MEMORY_BYTES)
    assert deploy.local_capacity() == 10
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("a process started"))
    argv = ["run", "--backend", "grpc", "--dataset", "synthetic-logistic", "--out", str(tmp_path / "o")]
    assert main([*argv, "--users", "11", "--no-reference"]) == 2
    err = capsys.readouterr().err.strip()
    assert "11 users do not fit, this machine can hold 10 now" in err and "\n" not in err
    assert started == []
    deploy.check_capacity(10)  # what fits is not refused


def test_a_failed_deployment_deletes_its_keys_and_keeps_its_logs(monkeypatch, tmp_path):
    monkeypatch.setattr(deploy, "_bin", lambda name: "/bin/false")  # the SuperLink exits at once
    work = tmp_path / "grpc"
    said = []
    with pytest.raises(RuntimeError, match="exited with 1"):
        deploy.run_grpc({"fedkl-dataset": "synthetic-logistic"}, 2, workdir=str(work), log=said.append)
    assert not (work / "certs").exists() and not (work / "flwr-home").exists()  # CA and server keys gone
    assert (work / "superlink.log").exists() and said == [
        f"fedkl grpc: the run failed; its logs are in {work} (keys deleted)"
    ]


@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept-by-FEDKL_KEEP_WORK"])
def test_a_failed_deployment_moves_its_logs_to_the_out_folder_and_removes_its_temporary_folder(
    monkeypatch, tmp_path, keep
):
    """run_grpc's own temporary work folder (what `fedkl run --backend grpc` uses) is removed after a failure too:
    the logs the user needs are copied to <out>/grpc-logs first and the one line says so; FEDKL_KEEP_WORK=1 keeps
    the folder (keys deleted all the same)."""
    monkeypatch.setattr(deploy, "_bin", lambda name: "/bin/false")  # the SuperLink exits at once
    monkeypatch.setattr(deploy.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(deploy.KEEP_WORK, "1" if keep else "0")
    out, said = tmp_path / "out", []
    with pytest.raises(RuntimeError, match="exited with 1"):
        deploy.run_grpc({"fedkl-dataset": "synthetic-logistic", "fedkl-out": str(out)}, 2, log=said.append)
    works = list(tmp_path.glob("fedkl-grpc-*"))
    if keep:
        (work,) = works
        assert (work / "superlink.log").exists() and not (work / "certs").exists()
        assert said == [f"fedkl grpc: the run failed; its logs are in {work} (keys deleted)"]
        assert not (out / "grpc-logs").exists()
    else:
        assert works == []  # nothing left in the temporary directory
        assert said == [f"fedkl grpc: the run failed; its logs are in {out / 'grpc-logs'}"]
        assert (out / "grpc-logs" / "superlink.log").exists()
        assert [p.name for p in (out / "grpc-logs").iterdir()] == ["superlink.log"]  # logs only, never a key


@pytest.mark.deployment
def test_fedkl_run_over_grpc_writes_its_result_and_model(tmp_path, monkeypatch):
    """`fedkl run --backend grpc` end to end (SuperLink + 2 SuperNodes): the run writes result.json and
    model.pt from the deployed ServerApp's outcome (it used to crash after training, reading a
    ``rounds`` the deployment did not report), with the default relative --out: in the folder it was
    run from, not in the deployment's temporary work folder (where its ledger was deleted, issue 31)."""
    import json

    monkeypatch.chdir(tmp_path)
    argv = ["run", "--backend", "grpc", "--dataset", "synthetic-least-squares", "--problem", "least-squares"]
    argv += ["--users", "2", "--rounds", "1", "--no-reference", "--seed", "3"]
    assert main(argv) == 0
    (out,) = (tmp_path / "runs").iterdir()
    res = json.loads((out / "result.json").read_text())
    assert res["rounds"] == 1 and res["backend"] == "grpc"
    assert (out / "model.pt").exists() and res["ledger"]["path"] == str(out / "ledger.sqlite")
    assert (out / "ledger.sqlite").exists()


@pytest.mark.deployment
def test_ctrl_c_on_fedkl_run_over_grpc_stops_every_process_and_deletes_the_keys(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) while `fedkl run --backend grpc` has its SuperLink and
    SuperNodes up: it exits 130 with one line, and by then every process of the deployment (SuperExecs and
    ClientApps included) is gone and the run's keys and Flower home are deleted. Waits on events only: the
    deployment's own "SuperLink on" line, then the process's exit."""
    import os
    import signal
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "fedkl.cli", "run", "--backend", "grpc", "--dataset", "synthetic-least-squares"]
    argv += ["--problem", "least-squares", "--users", "2", "--rounds", "500", "--no-reference"]
    p = subprocess.Popen(
        [*argv, "--out", str(tmp_path / "o")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    said = []
    try:
        for line in p.stdout:
            said.append(line)
            if line.startswith("fedkl grpc: SuperLink on"):
                break
        (work,) = tmp_path.glob("fedkl-grpc-*")  # run_grpc's own temporary folder
        up = deploy.processes_of(work)
        assert len(up) >= 3, "".join(said)  # the SuperLink and 2 SuperNodes (at least)
        os.killpg(p.pid, signal.SIGINT)
        said += p.communicate()[0].splitlines(keepends=True)
    finally:
        if p.poll() is None:  # pragma: no cover - only if an assertion above failed
            p.kill()
            p.wait()
    assert p.returncode == 128 + signal.SIGINT, "".join(said)
    assert deploy.processes_of(work) == set()  # gone when the command returned, not eventually
    assert not work.exists(), "".join(said)  # keys, Flower home and the temporary folder: all gone
    logs = tmp_path / "o" / "grpc-logs"
    assert f"fedkl grpc: the run failed; its logs are in {logs}\n" in said and (logs / "superlink.log").exists()


def test_the_deployed_runs_progress_lines_reach_the_user_as_they_come(tmp_path):
    """`flwr run --stream`'s output goes to its log; the ServerApp's progress lines (with an ETA) also to the
    user, each before the next is printed: the child waits for the test to have seen its first line."""
    import sys

    seen = tmp_path / "seen"
    child = (
        "import pathlib, sys\n"
        "print('INFO: flower noise', flush=True)\n"
        "print('fedkl progress: run r1 on ledger /o/ledger.sqlite', flush=True)\n"
        "print('fedkl progress: round 1/2, 3 s elapsed, ETA 3 s', flush=True)\n"
        f"while not pathlib.Path({str(seen)!r}).exists(): pass\n"
        "print('fedkl progress: round 2/2, 6 s elapsed, ETA 0 s')\n"
    )
    said = []

    def log(line):
        said.append(line)
        seen.touch()  # the event the child waits on: line 1 arrived while the child was still running

    class Observer(RunObserver):
        def started(self, run_id, ledger_path):
            said.append((run_id, ledger_path))

    token = RUN_OBSERVER.set(Observer())
    try:
        deploy.stream([sys.executable, "-c", child], tmp_path / "run.log", 600, log)
    finally:
        RUN_OBSERVER.reset(token)
    assert said == [
        "fedkl progress: run r1 on ledger /o/ledger.sqlite",
        ("r1", "/o/ledger.sqlite"),  # `fedkl run`'s observer learns the ServerApp's ledger run (for Ctrl-C)
        "fedkl progress: round 1/2, 3 s elapsed, ETA 3 s",
        "fedkl progress: round 2/2, 6 s elapsed, ETA 0 s",
    ]
    assert (tmp_path / "run.log").read_text().splitlines()[0] == "INFO: flower noise"
    with pytest.raises(RuntimeError, match=r"^python\S* -c failed \(3\); see .*run\.log$"):
        deploy.stream([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "run.log", 600, log)
    with pytest.raises(RuntimeError, match=r"^python\S* -c did not finish within 0 s \(killed\); see "):
        deploy.stream([sys.executable, "-c", "while True: pass"], tmp_path / "run.log", 0.2, log)


def test_progress_lines_give_the_elapsed_time_and_an_eta_from_the_mean_round():
    from fedkl.flower.server_app import ProgressLines, run_started

    now = [100.0]
    lines = []
    obs = ProgressLines(lines.append, clock=lambda: now[0])
    obs.started("r1", "/srv/my ledger.sqlite")
    for k, t in ((1, 110.0), (2, 130.0), (4, 140.0)):
        now[0] = t
        obs.round({"round": k, "rounds": 4})
    assert run_started(lines.pop(0)) == ("r1", "/srv/my ledger.sqlite")  # which ledger run it charges
    assert [run_started(line) for line in lines] == [None] * 3
    assert lines == [
        "fedkl progress: round 1/4, 10 s elapsed, ETA 30 s",
        "fedkl progress: round 2/4, 30 s elapsed, ETA 30 s",
        "fedkl progress: round 4/4, 40 s elapsed, ETA 0 s",
    ]


def test_a_folder_that_cannot_be_deleted_is_said_not_ignored(monkeypatch, tmp_path):
    (tmp_path / "keys").mkdir()
    said = []
    assert deploy.remove_tree(tmp_path / "keys", said.append)
    assert not (tmp_path / "keys").exists() and said == []
    (tmp_path / "keys").mkdir()

    def busy(path):
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(deploy.shutil, "rmtree", busy)
    monkeypatch.setattr(deploy.time, "sleep", lambda s: None)
    assert not deploy.remove_tree(tmp_path / "keys", said.append)
    assert said == [
        f"fedkl grpc: could not delete {tmp_path / 'keys'} ([Errno 39] Directory not empty); delete it by hand"
    ]


def test_the_wait_for_supernodes_follows_their_progress_not_a_fixed_deadline():
    """On a loaded machine SuperNodes come online late but steadily: each new one restarts the quiet window
    (``connect_timeout``), so 8 nodes 50 s apart are all waited for with a 60 s window; a stall of more than
    the window ends the wait in one line."""
    from fedkl.flower.localgrid import SimClock

    def nodes_at(times):
        clock = SimClock()
        return clock, (lambda: sum(1 for t in times if t <= clock.now))

    clock, online = nodes_at([50.0 * k for k in range(1, 9)])  # the last one at 400 s > 60 s
    assert deploy.wait_online(online, 8, 60.0, clock=clock) == clock.now == 400.0

    clock, online = nodes_at([10.0, 20.0, 200.0])  # the third after a 180 s stall
    with pytest.raises(TimeoutError, match=r"^only 2 of 3 SuperNodes online after 80 s \(none new for 60 s\); see w$"):
        deploy.wait_online(online, 3, 60.0, "see w", clock=clock)


def test_a_ctrl_c_while_a_child_is_being_started_is_raised_once_it_is_recorded():
    import os
    import signal
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # as in a real run (gRPC, Ray): the OS may hand the signal to it
    other.start()
    recorded = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with deploy.signals_deferred() as held:
                os.kill(os.getpid(), signal.SIGINT)  # arrives while Popen would wait for the child's exec
                for _ in range(6000):  # wait for the event (the handler held it), not a fixed delay
                    if held:
                        break
                    stop.wait(0.01)
                assert held == [signal.SIGINT]
                recorded.append("child")  # still runs: the child is recorded, so it can be stopped
    finally:
        stop.set()
        other.join()
    assert recorded == ["child"]
