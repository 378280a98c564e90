"""`--backend grpc` within its means: a population the machine cannot hold is refused in one line before
anything starts, and a deployment's key material is deleted whatever the outcome (no process spawned here
beyond one that exits at once)."""

from __future__ import annotations

import subprocess

import pytest

from fedkl.cli import main
from fedkl.flower import deploy

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


@pytest.mark.deployment
def test_fedkl_run_over_grpc_writes_its_result_and_model(tmp_path):
    """`fedkl run --backend grpc` end to end (SuperLink + 3 SuperNodes): the run writes result.json and
    model.pt from the deployed ServerApp's outcome (it used to crash after training, reading a
    ``rounds`` the deployment did not report)."""
    import json

    out = tmp_path / "o"
    argv = ["run", "--backend", "grpc", "--dataset", "synthetic-least-squares", "--problem", "least-squares"]
    argv += ["--users", "3", "--rounds", "1", "--no-reference", "--out", str(out), "--seed", "3"]
    assert main(argv) == 0
    res = json.loads((out / "result.json").read_text())
    assert res["rounds"] == 1 and res["backend"] == "grpc"
    assert (out / "model.pt").exists()


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
    argv += ["--problem", "least-squares", "--users", "3", "--rounds", "500", "--no-reference"]
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
        assert len(up) >= 4, "".join(said)  # the SuperLink and 3 SuperNodes (at least)
        os.killpg(p.pid, signal.SIGINT)
        said += p.communicate()[0].splitlines(keepends=True)
    finally:
        if p.poll() is None:  # pragma: no cover - only if an assertion above failed
            p.kill()
            p.wait()
    assert p.returncode == 128 + signal.SIGINT, "".join(said)
    assert deploy.processes_of(work) == set()  # gone when the command returned, not eventually
    assert not (work / "certs").exists() and not (work / "flwr-home").exists()
    assert f"fedkl grpc: the run failed; its logs are in {work} (keys deleted)\n" in said
