"""Every `fedkl run` backend writes the same artefacts (issue 31, "Done when"): run from a working folder with a
RELATIVE --out (resolved before anything starts), each of inprocess, ray-shards, flower-local and flower-sim
leaves model.pt (with its receipt), a strict result.json, the ledger and the per-round metrics in the run folder,
ends with the same summary lines (the privacy line and the test metric), and `fedkl predict` on its model.pt
prints the metric the run printed. (The gRPC deployment, its failure after a release and `flwr run .` are covered by
tests/flower/test_deploy_paths.py and tests/flower/test_flwr_app.py; a deployment of sites bringing their own files by
tests/flower/test_sites.py; the drop-in example by tests/flower/test_dropin_pytorch.py.)"""

from __future__ import annotations

import json
import re

import pytest
from run_files import check_round_metrics  # tests/run_files.py

from fedkl import cli

ROUNDS = 3


def _strict(text: str) -> dict:
    def refuse(constant):
        raise AssertionError(f"result.json is not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    "backend, extra",
    [
        ("inprocess", []),
        pytest.param("ray-shards", ["--shards", "2"], marks=pytest.mark.flower),
        pytest.param("flower-local", [], marks=pytest.mark.flower),
        pytest.param("flower-sim", [], marks=pytest.mark.flower),
    ],
)
def test_every_backend_writes_the_same_artefacts_under_a_relative_out(backend, extra, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDKL_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["run", "--dataset", "synthetic-logistic", "--users", "12", "--rounds", str(ROUNDS), "--backend", backend]
    argv += [*extra, "--noise-seed", "3", "--out", "runs/rel", "--no-reference"]
    assert cli.main(argv) == 0
    said = capsys.readouterr().out
    out = tmp_path / "runs" / "rel"
    result = _strict((out / "result.json").read_text())
    assert result["backend"] == backend
    assert (out / "model.pt").is_file() and (tmp_path / result["ledger"]["path"]).is_file()
    check_round_metrics(out, ROUNDS)
    assert re.search(r"user-level .*eps.*=.*delta", said), said  # the privacy line
    printed = re.search(r"test accuracy = ([0-9.]+)", said).group(1)
    assert cli.main(["predict", "--model", "runs/rel"]) == 0
    predicted = re.search(r"accuracy = ([0-9.]+)", capsys.readouterr().out).group(1)
    assert abs(float(predicted) - float(printed)) <= 0.5e-4 + 1e-12, (printed, predicted)
