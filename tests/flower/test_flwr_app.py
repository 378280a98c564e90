"""The repository is a Flower app (Flower 1.41): its pyproject.toml passes Flower's own validation, names
loadable components (fedkl's ServerApp / ClientApp through server/app.py and client/app.py), builds into a
small FAB, and its [tool.flwr.app.config] keys are `fedkl run` settings that train as they are."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict

from fedkl import runner
from fedkl.flower import client_app, codec, server_app
from fedkl.flower.localgrid import LocalGrid
from fedkl.saved_model import load_model

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[2]
EXTRA_KEYS = {
    "fedkl-wait-for-nodes",
    "fedkl-handshake-timeout",
    "fedkl-timeout",
    "fedkl-node-bindings",
    "fedkl-recover",
    "fedkl-sites",
}  # the ServerApp's and ClientSpec's own


def _app_config() -> dict:
    from flwr.cli.config_utils import load_and_validate

    config, _warnings = load_and_validate(ROOT / "pyproject.toml", check_module=True)  # imports the components
    return config


def test_pyproject_is_a_valid_flower_app_naming_fedkls_apps():
    import client.app
    import server.app

    config = _app_config()
    components = config["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": "server.app:app", "clientapp": "client.app:app"}
    assert server.app.app is server_app.app and client.app.app is client_app.app


def test_the_fab_holds_the_entry_points_not_the_repository():
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.constant import FAB_MAX_SIZE

    fab = build_fab_from_disk(ROOT)
    names = set(zipfile.ZipFile(io.BytesIO(fab)).namelist())
    assert {"server/app.py", "client/app.py", "pyproject.toml"} <= names
    assert not any(n.startswith(("fedkl/", "tests/")) for n in names) and len(fab) < FAB_MAX_SIZE


def test_app_config_keys_are_run_settings_and_train_as_they_are(tmp_path):
    rc = dict(_app_config()["tool"]["flwr"]["app"]["config"])
    fields = runner.settings_fields()
    unknown = [k for k in rc if k not in EXTRA_KEYS and k.removeprefix("fedkl-").replace("-", "_") not in fields]
    assert unknown == []
    rc["fedkl-out"] = str(tmp_path / "out")  # what `flwr run . --run-config "fedkl-out=..."` would set
    rc["fedkl-noise-seed"] = 3
    cfg = server_app._run_config_from_user_config(rc)
    spec = codec.ClientSpec.from_user_config(rc)
    users = spec.kwargs[0]["n_users"]
    rounds = cfg.params.rounds
    assert (cfg.dataset, cfg.users, cfg.epsilon) == (rc["fedkl-dataset"], rc["fedkl-users"], runner.RunConfig().epsilon)
    grid = LocalGrid(client_app.app, users, run_config=rc)  # the nodes of `--federation-config num-supernodes=N`
    server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))

    def strict(path):  # the one writer of every backend writes strict JSON (no NaN/Infinity literals)
        return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

    res = strict(tmp_path / "out" / "flower_result.json")
    assert res["users"] == users and res["failed_users"] == [0] * rounds
    assert res["ledger"]["releases"] == rounds and res["failures"]["counts"] == {}
    saved = strict(tmp_path / "out" / "result.json")  # and the run's files, by the runner's writer
    assert saved["backend"] == "flwr-run" and saved["rounds"] == rounds and saved["ledger"] == res["ledger"]
    model = load_model(saved["model_path"])
    assert torch.equal(runner.Trained.from_record(res).result.w, model.params.to(torch.float64))


def test_every_key_the_docs_set_is_one_flower_accepts():
    """Flower refuses a --run-config key the app's config does not list: every fedkl-* key a docs page sets
    (docs/how-to/deploy.md, secagg.md, ...) is listed."""
    import re

    pages = "\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    named = set(re.findall(r"(fedkl-[a-z][a-z-]*[a-z])=", pages))
    assert named and named <= set(_app_config()["tool"]["flwr"]["app"]["config"])


@pytest.mark.slow
def test_flwr_run_dot_trains_on_the_local_simulation_engine(tmp_path):
    """docs/how-to/deploy.md's command, as a Flower user runs it: `flwr run` on the local simulation engine (about 30-40 s),
    here from another folder with a relative fedkl-out: the ServerApp resolves it against the folder Flower's local
    SuperLink was started from (server_app.resolve_paths), and ends with fedkl run's files and summary lines
    (issue 31: it wrote flower_result.json only, and its budget line said "backend inprocess").
    Flower leaves its local SuperLink running in the background: stopped here with everything it started."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from fedkl.flower.deploy import _free_port, _proc_table, stop_processes

    home = tmp_path / "flwr-home"
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        # pytest's tmp_path is in the system's temporary folder, where a relative fedkl-out is refused: another
        # one, short (Ray's socket paths must stay under 108 bytes)
        "TMPDIR": tempfile.mkdtemp(prefix="k"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    here, out = tmp_path / "me", tmp_path / "me" / "rel"
    here.mkdir()
    cmd = ["flwr", "run", str(ROOT), "--federation-config", "num-supernodes=6", "--stream"]
    cmd += ["--run-config", "fedkl-out='rel' fedkl-users=6 fedkl-rounds=2 fedkl-epsilon=8.0"]

    class Found:  # a process we did not spawn directly (Flower detaches its local SuperLink)
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def poll(self) -> None:
            return None

        def wait(self, timeout: float | None = None) -> None:
            return None

    try:
        r = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=300)
        said = r.stdout + r.stderr
        assert r.returncode == 0 and (out / "flower_result.json").is_file(), said[-4000:]
        res = json.loads((out / "flower_result.json").read_text())
        assert res["users"] == 6 and res["failed_users"] == [0, 0] and res["ledger"]["releases"] == 2
        saved = json.loads((out / "result.json").read_text())
        assert saved["backend"] == "flwr-run" and (out / "model.pt").is_file() and (out / "ledger.sqlite").is_file()
        assert f"epsilon = {saved['epsilon']:.4f}, delta = {saved['delta']:.3g}" in said, said[-4000:]
        key = saved["test_metric"]["name"]
        assert f"test {key} = {saved['test_metric']['value']:.4f}" in said and "backend flwr-run" in said
    finally:
        mine = []
        for pid in _proc_table():
            try:
                if str(home).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    mine.append(Found(pid))
            except OSError:
                pass
        stop_processes(mine)
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)


def test_a_deployment_refuses_fast_kernels_in_one_line():
    """The deployed ServerApp's clients compute with the reproducible kernels: a run config asking for
    `fedkl-kernels = "fast"` is refused, not silently run differently."""
    from fedkl.flower.server_app import _run_config_from_user_config

    with pytest.raises(ValueError, match="reproducible kernels only"):
        _run_config_from_user_config({"fedkl-kernels": "fast"})
    assert _run_config_from_user_config({"fedkl-kernels": "reproducible"}).kernels == "reproducible"
    # the default (auto) is reproducible here whatever fedkl-backend says: the ServerApp always trains over Flower
    assert _run_config_from_user_config({}).kernels == "reproducible"
    assert _run_config_from_user_config({"fedkl-kernels": "auto"}).settings()["kernels"] == "reproducible"
