"""The drop-in example that is Flower's PyTorch quickstart plus the diff (issue 31): simulations/
flower_pytorch_dropin/ differs from the template's structure only by the lines marked ``# fedkl``, four, each
shown in the diff of docs/how-to/flower-dropin.md; run on the LocalGrid with its own run config it charges every sampled user in one
finished ledger run, logs the privacy line, saves the app's float32 model, and leaves the run's model.pt,
result.json and ledger as every entry point does."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict

from fedkl.cli import main
from fedkl.flower.localgrid import LocalGrid
from fedkl.privacy import Budget, PrivacyLedger

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "simulations" / "flower_pytorch_dropin"


def _marked() -> list[str]:
    return [
        line.strip()
        for path in sorted((APP / "pytorchexample").glob("*.py"))
        for line in path.read_text().splitlines()
        if line.rstrip().endswith(("# fedkl", "# fedkl  # fmt: skip"))
    ]


def test_the_diff_is_the_four_marked_lines_the_docs_show():
    marked = _marked()
    assert len(marked) == 4
    page = (ROOT / "docs" / "how-to" / "flower-dropin.md").read_text()
    block = re.search(r"```diff\n(.*?)```", page, re.S).group(1)
    assert sorted(line[1:].strip() for line in block.splitlines() if line.startswith("+")) == sorted(marked)
    for path in (APP / "pytorchexample").glob("*.py"):  # without them: the plain Flower app still compiles
        plain = "\n".join(line for line in path.read_text().splitlines() if line.strip() not in marked)
        compile(plain, str(path), "exec")
        assert "fedkl" not in "\n".join(line for line in plain.splitlines() if not line.startswith('"""'))


def test_the_pytorch_quickstart_with_the_diff_trains_with_user_level_dp(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(APP))
    monkeypatch.chdir(tmp_path)  # the app's relative ledger.sqlite and final_model.pt
    said: list[str] = []
    import flwr.supercore

    monkeypatch.setattr(flwr.supercore, "log", lambda level, msg, *a: said.append(msg % a if a else msg))
    from pytorchexample import client_app, server_app
    from pytorchexample.task import Net

    config = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert config["components"] == {
        "serverapp": "pytorchexample.server_app:app",
        "clientapp": "pytorchexample.client_app:app",
    }
    rc = config["config"]
    nodes, rounds = 4, rc["num-server-rounds"]
    grid = LocalGrid(client_app.app, nodes, run_config=rc)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    with PrivacyLedger(str(tmp_path / "ledger.sqlite")) as led:
        assert [r["status"] for r in led.runs()] == ["finished"] and led.num_releases() == rounds
        sizes = [r["users"] for r in led.releases()]
        spends = led.user_spends()
    assert sizes == [int(nodes * rc["fraction-train"])] * rounds  # FedAvg's sample, every member charged
    assert {r["user_id"] for r in spends} <= {f"user-{p}" for p in range(nodes)}  # the declared users
    assert max(r["rho"] for r in spends) <= Budget(2.0, 1e-5).rho * (1 + 1e-9)
    eps = max(r["epsilon_exact"] for r in spends)
    assert any(line.startswith(f"privacy: user-level (replace-one) epsilon = {eps:.4f}") for line in said)
    state = torch.load(tmp_path / "final_model.pt")
    assert all(v.dtype == torch.float32 for v in state.values())
    Net().load_state_dict(state)  # the app's own model, as the template saves it

    # issue 31: the run's model.pt (the app's state dict in its dtypes, with the privacy receipt), a strict
    # result.json and the ledger, and the summary lines. fedkl predict cannot rebuild the app's network: it refuses
    # the file in one line; the state dict loads into the app's Net (what the artefact is: dropin.write_run_files)
    (run,) = (tmp_path / "runs").iterdir()  # default out: <the ledger's folder>/runs/<run id>
    res = json.loads((run / "result.json").read_text(), parse_constant=lambda c: pytest.fail(f"not strict: {c}"))
    assert res["ledger"]["path"] == str(tmp_path / "ledger.sqlite") and res["test_metric"] is None
    assert res["rounds"] == rounds and res["model_path"] == str(run / "model.pt") and res["epsilon"] == eps
    saved = torch.load(run / "model.pt", weights_only=True)
    assert saved["receipt"]["epsilon"] == eps and saved["receipt"]["run_id"] == run.name
    assert saved["state_dict"].keys() == state.keys()
    assert all(
        torch.equal(saved["state_dict"][k], v) and saved["state_dict"][k].dtype == v.dtype for k, v in state.items()
    )
    Net().load_state_dict(saved["state_dict"])
    assert said[-3].startswith("privacy: user-level") and said[-2].startswith("test metric: none")
    assert said[-1] == f"wrote {run / 'result.json'}, {run / 'model.pt'} and ledger {tmp_path / 'ledger.sqlite'}"
    assert main(["predict", "--model", str(run)]) == 2
    assert "the app's own network, which fedkl cannot rebuild" in capsys.readouterr().err
