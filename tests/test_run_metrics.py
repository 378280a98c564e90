"""Per-round metrics next to result.json (issue 31, Operations): every run writes metrics.jsonl (one line a
round), metrics.csv and curves.png from its public round records, and TensorBoard event files where the
tensorboard package is installed (else a line says how to view the CSV). The LocalGrid (deployed ServerApp)
run's files: tests/flower/test_deploy_paths.py."""

from __future__ import annotations

import json
import sys
import types

from run_files import check_round_metrics  # tests/run_files.py

import fedkl
from fedkl.results import write_round_metrics


def test_an_in_process_run_writes_its_round_metrics_and_curves(tmp_path):
    out = tmp_path / "run"
    run = fedkl.train("synthetic-logistic", "noisy-gd", users=8, rounds=3, out=str(out), log=None, noise_seed=1)
    rows = check_round_metrics(out, 3)
    res = json.loads((out / "result.json").read_text())
    assert (
        rows[-1]["rho_spent"] == res["rho"] == run.result["rho"]
    )  # the records are the run's own: its zCDP, round by round
    assert all(r["rounds"] == 3 and r["noisy_grad_norm"] > 0 for r in rows)
    assert not (out / "tensorboard").exists()  # tensorboard is no dependency (the next test fakes one)


def test_tensorboard_event_files_where_tensorboard_is_installed_else_a_line_on_the_csv(tmp_path, monkeypatch):
    history = [{"round": t, "rounds": 2, "noisy_grad_norm": 0.5 * t, "rho_spent": 0.1 * t, "extra": [1, 2],
                "sampled": 7 + t} for t in (1, 2)]  # fmt: skip
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed: the import fails
    line = write_round_metrics(str(tmp_path), history)
    assert "TensorBoard is not installed" in line and "metrics.csv" in line
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0]
    assert header == "round,rounds,noisy_grad_norm,rho_spent"  # a list field is not a scalar metric, and
    assert "sampled" not in (tmp_path / "metrics.jsonl").read_text()  # a secret Poisson sample's size is not public
    scalars, closed = [], []

    class Writer:  # torch.utils.tensorboard.SummaryWriter's interface
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((self.log_dir, tag, value, step))

        def close(self):
            closed.append(True)

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    line = write_round_metrics(str(tmp_path / "b"), history)
    board = str(tmp_path / "b" / "tensorboard")
    assert f"tensorboard --logdir {board}" in line and closed == [True]
    assert sorted(scalars) == sorted(
        (board, k, h[k], h["round"]) for h in history for k in ("noisy_grad_norm", "rho_spent")
    )
    check_round_metrics(tmp_path / "b", 2)
    assert write_round_metrics(str(tmp_path / "c"), []) is None  # a one-shot release: no rounds, no files
    assert not (tmp_path / "c").exists()
