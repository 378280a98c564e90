"""The README's main job, end to end: user-level DP training on MovieLens beats the trivial predictor."""
import json
import subprocess
import sys

import pytest

from simulations.quickstart import main as quickstart


def test_default_job_on_movielens(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "fedkl.cli", "run", "--noise-seed", "7", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "result.json").read_text())
    assert res["dataset"] == "movielens" and res["users"] == 671
    assert res["epsilon"] <= 2.0 * (1 + 1e-9) and res["delta"] == pytest.approx(1 / 671 ** 1.1)
    acc = res["test_metric"]["value"]
    assert res["test_metric"]["name"] == "accuracy"
    # better than the majority class by a margin far above the sampling error of ~20k test records
    # (std of an accuracy estimate <= 0.5/sqrt(20003) = 0.0035)
    assert acc > res["trivial_baseline"]["accuracy"] + 0.05
    assert acc <= res["nonprivate_reference"]["accuracy"] + 0.02
    assert "epsilon = " in proc.stdout and "test accuracy = " in proc.stdout


def test_quickstart_example_runs(tmp_path):
    res = quickstart(["--out", str(tmp_path / "q"), "--noise-seed", "3", "--rounds", "5"])
    assert res["epsilon"] <= 2.0 * (1 + 1e-9) and res["accuracy"] > 0.55
