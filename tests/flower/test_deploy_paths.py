"""`fedkl run --backend grpc` with relative paths (issue 31): every path the user gives is resolved where the
user typed it, before anything starts, so a deployment whose ServerApp and ClientApps run in a temporary work
folder (Flower starts them there) writes the ledger, result.json and model.pt where the user asked, and the
work folder's removal never takes them along. The deployment is replaced by a LocalGrid served from inside the
work folder (the ServerApp's and ClientApps' working directory in a real one); the real loopback deployment
with a relative --out is test_deploy_limits.py::test_fedkl_run_over_grpc_writes_its_result_and_model."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict
from run_files import check_round_metrics  # tests/run_files.py

import fedkl.flower.backends  # noqa: F401  (registers the grpc backend)
from fedkl.cli import main
from fedkl.flower import client_app, deploy, server_app
from fedkl.flower.localgrid import LocalGrid
from fedkl.privacy import PrivacyLedger
from fedkl.runner import RunConfig, absolute_paths

pytestmark = pytest.mark.flower


def _deploy_in_work(work: Path, rc: dict, num_users: int, *args) -> dict:
    """run_grpc's _deploy with the SuperLink, SuperNodes and ServerApp replaced by a LocalGrid whose
    ServerApp and ClientApps run with the work folder as their working directory, as Flower's do."""
    rc = {**rc, "fedkl-wait-for-nodes": 0}
    here = os.getcwd()
    os.chdir(work)
    try:
        grid = LocalGrid(client_app.app, num_users, run_config=rc)
        server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    finally:
        os.chdir(here)
    return deploy.read_outcome(Path(rc["fedkl-out"]), work / "flwr-run.log")


def test_fedkl_run_grpc_with_the_default_relative_out_keeps_ledger_model_and_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(deploy, "_deploy", _deploy_in_work)
    monkeypatch.setattr(deploy.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "me").mkdir()
    monkeypatch.chdir(tmp_path / "me")
    argv = ["run", "--backend", "grpc", "--dataset", "synthetic-least-squares", "--problem", "least-squares"]
    argv += ["--users", "3", "--rounds", "1", "--no-reference", "--seed", "3", "--ledger", "my-ledger.sqlite"]
    assert main(argv) == 0, capsys.readouterr().err
    (out,) = (tmp_path / "me" / "runs").iterdir()  # the default --out, under the folder the user ran it from
    res = json.loads((out / "result.json").read_text())
    assert res["out_dir"] == str(out) and res["model_path"] == str(out / "model.pt") and (out / "model.pt").exists()
    ledger = tmp_path / "me" / "my-ledger.sqlite"
    assert res["ledger"]["path"] == str(ledger) and res["config"]["ledger"] == str(ledger)
    with PrivacyLedger(ledger) as led:
        assert [r["status"] for r in led.runs()] == ["finished"] and led.num_releases() == 1
    assert list((tmp_path / "tmp").iterdir()) == []  # the work folder is gone, and nothing of the run was in it
    check_round_metrics(out, 1)  # the per-round metrics, from the history the ServerApp returned


def test_every_path_a_run_is_given_is_absolute_before_it_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(RunConfig(dataset="data/users.csv", out="o", ledger="l.sqlite"))
    assert (cfg.dataset, cfg.out, cfg.ledger) == (
        str(tmp_path / "data/users.csv"),
        str(tmp_path / "o"),
        str(tmp_path / "l.sqlite"),
    )
    named = absolute_paths(RunConfig(dataset="synthetic-logistic"))  # a dataset name is not a path; no out: the default
    assert (named.dataset, named.out, named.ledger) == ("synthetic-logistic", None, None)
    # run_grpc itself resolves the path keys of a run config it is given (the caller's folder, not the work folder's)
    rc = deploy.absolute_run_config({"fedkl-out": "o", "fedkl-ledger": "l.sqlite", "fedkl-dataset": "d.csv",
                                     "fedkl-recover": "r", "fedkl-users": 3})  # fmt: skip
    assert rc == {"fedkl-out": str(tmp_path / "o"), "fedkl-ledger": str(tmp_path / "l.sqlite"),
                  "fedkl-dataset": str(tmp_path / "d.csv"), "fedkl-recover": str(tmp_path / "r"), "fedkl-users": 3}  # fmt: skip


def test_the_deployed_server_app_of_flwr_run_writes_the_files_and_lines_fedkl_run_does(tmp_path, capsys):
    """`flwr run .` (or a ServerApp on a SuperLink) has no `fedkl run` process to write model.pt and result.json:
    the ServerApp writes them (and the ledger), ends its output with fedkl run's summary lines, and `fedkl predict`
    on its model reproduces the test metric it printed (issue 31: it wrote flower_result.json only)."""
    out = tmp_path / "o"
    rc = {"fedkl-dataset": "synthetic-logistic", "fedkl-users": 5, "fedkl-algorithm": "noisy-gd", "fedkl-rounds": 2,
          "fedkl-seed": 3, "fedkl-reference": False, "fedkl-wait-for-nodes": 0, "fedkl-out": str(out)}  # fmt: skip
    grid = LocalGrid(client_app.app, 5, run_config=rc)
    server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    said = capsys.readouterr().out
    res = json.loads((out / "result.json").read_text())
    assert (out / "model.pt").exists() and (out / "ledger.sqlite").exists() and (out / "flower_result.json").exists()
    assert res["backend"] == "flwr-run" and res["rounds"] == 2 and res["model_path"] == str(out / "model.pt")
    key, value = res["test_metric"]["name"], res["test_metric"]["value"]
    assert "privacy: user-level (replace-one; any clients) epsilon" in said  # the assumption next to epsilon
    assert f"epsilon = {res['epsilon']:.4f}, delta = {res['delta']:.3g}" in said
    assert f"test {key} = {value:.4f}" in said
    assert main(["predict", "--model", str(out)]) == 0
    assert f"{key} = {value:.6g}" in capsys.readouterr().out
    check_round_metrics(out, 2)  # the per-round metrics and curves of every entry point (issue 31, Operations)
    assert f"wrote 2 rounds' metrics: {out / 'metrics.jsonl'}" in said
    assert "backend flwr-run" in said and "backend inprocess" not in said  # the transport it ran over (issue 31)


def test_the_server_apps_files_never_carry_a_secret_samples_size(tmp_path, capsys):
    """dp-sgd's Poisson sample must stay secret (its amplification assumes it): the ServerApp's
    flower_result.json and metrics files carry the public round records only (round_log.NOT_PUBLIC; it wrote
    each round's `sampled` count into flower_result.json)."""
    out = tmp_path / "o"
    rc = {"fedkl-dataset": "synthetic-logistic", "fedkl-users": 6, "fedkl-algorithm": "dp-sgd", "fedkl-rounds": 2,
          "fedkl-seed": 3, "fedkl-reference": False, "fedkl-wait-for-nodes": 0, "fedkl-out": str(out),
          "fedkl-neighbouring": "add-remove", "fedkl-sampling-rate": 0.5, "fedkl-accountant": "rdp"}  # fmt: skip
    grid = LocalGrid(client_app.app, 6, run_config=rc)
    server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    capsys.readouterr()
    history = json.loads((out / "flower_result.json").read_text())["history"]
    assert len(history) == 2 and all("noisy_grad_norm" in rec for rec in history)
    assert not any("sampled" in rec for rec in history)
    assert "sampled" not in (out / "metrics.jsonl").read_text()


def _flwr_run_in(cwd: Path, out: str, monkeypatch) -> Path:
    """The deployed ServerApp of `flwr run` with ``fedkl-out = out``, run with ``cwd`` as its working directory
    (its SuperLink's); returns the folder that holds result.json."""
    rc = {"fedkl-dataset": "synthetic-least-squares", "fedkl-problem": "least-squares", "fedkl-users": 3,
          "fedkl-rounds": 1, "fedkl-reference": False, "fedkl-wait-for-nodes": 0, "fedkl-out": out}  # fmt: skip
    monkeypatch.chdir(cwd)
    grid = LocalGrid(client_app.app, 3, run_config=rc)
    server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    return Path(
        json.loads((Path(out) if os.path.isabs(out) else cwd / out).joinpath("result.json").read_text())["out_dir"]
    )


def test_a_relative_fedkl_out_under_flwr_run_resolves_against_the_server_apps_folder(tmp_path, monkeypatch):
    """`flwr run . --run-config "fedkl-out='runs/x'"`: resolved when the ServerApp starts, against the directory
    its SuperLink runs in (server_app.resolve_paths); where that is a temporary folder or Flower's home, the run is
    refused before anything is read or charged (a ledger there could be deleted with it)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "sys-tmp"))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    (tmp_path / "site").mkdir()
    assert _flwr_run_in(tmp_path / "site", "runs/x", monkeypatch) == tmp_path / "site" / "runs" / "x"
    assert {"ledger.sqlite", "model.pt", "result.json"} <= {f.name for f in (tmp_path / "site/runs/x").iterdir()}
    for inside in (tmp_path / "sys-tmp" / "fedkl-grpc-1", tmp_path / "flwr-home" / "apps"):
        inside.mkdir(parents=True)
        with pytest.raises(ValueError, match=f"fedkl-out='runs/x' is relative, and this ServerApp runs in {inside}"):
            _flwr_run_in(inside, "runs/x", monkeypatch)
        assert list(inside.iterdir()) == []  # nothing created: no folder, no ledger


def test_a_deployed_run_failing_after_a_release_keeps_its_ledger_and_logs_and_says_where(tmp_path, monkeypatch, capsys):
    """`fedkl run --backend grpc` whose ServerApp fails after its first release was charged: the ledger keeps that
    release (its run ended failed), the logs are moved out of the removed work folder, and the one error line
    names both (issue 31: a failed run never deletes its ledger, and says where its evidence is)."""

    def fail_after_first_round(self, record):
        raise RuntimeError(f"the server's disk is full after round {record['round']}")

    def deploy_then_fail(work: Path, rc: dict, num_users: int, *args) -> dict:
        (work / "superlink.log").write_text("the SuperLink's log\n")
        try:
            return _deploy_in_work(work, rc, num_users, *args)
        except RuntimeError:  # as `flwr run` exits 0: run_grpc reads the ServerApp's flower_error.json
            return deploy.read_outcome(Path(rc["fedkl-out"]), work / "flwr-run.log")

    monkeypatch.setattr(server_app.ProgressLines, "round", fail_after_first_round)
    monkeypatch.setattr(deploy, "_deploy", deploy_then_fail)
    monkeypatch.setattr(deploy.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path)
    argv = ["run", "--backend", "grpc", "--dataset", "synthetic-least-squares", "--problem", "least-squares"]
    assert main([*argv, "--users", "3", "--rounds", "2", "--no-reference", "--out", "o"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    ledger, logs = tmp_path / "o" / "ledger.sqlite", tmp_path / "o" / "grpc-logs"
    assert err.startswith("fedkl run: error: the fedkl ServerApp failed: RuntimeError: the server's disk is full")
    assert err.endswith(f"; its ledger is {ledger}; its logs are in {logs}")
    with PrivacyLedger(ledger) as led:
        assert [r["status"] for r in led.runs()] == ["failed"] and led.num_releases() == 1
    assert (logs / "superlink.log").read_text() == "the SuperLink's log\n"
    assert list((tmp_path / "tmp").iterdir()) == []  # the work folder is gone, and nothing of the run was in it
