"""A run imports the one algorithm it trains; a reader of the whole registry still gets every algorithm
(issue 34: the catalog importing 40+ algorithm modules was a tenth of a small run's process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_lookup_imports_one_algorithm_and_iteration_imports_all():
    got = _python("""
import json, sys
from fedkl.algorithms.registry import REGISTRY, algorithm_spec, builtin_modules
spec = algorithm_spec("noisy-gd")
one = sorted(m for m in sys.modules if m.startswith("fedkl.algorithms."))
names = sorted(REGISTRY)
import fedkl.algorithms.catalog as catalog  # the explicit import list: nothing it adds
print(json.dumps({"one": one, "names": names, "builtin": sorted(builtin_modules()), "module": spec.build.__module__,
                  "catalog": sorted(catalog.ALGORITHMS)}))
""")
    assert got["module"] == "fedkl.algorithms.gradient.noisy_gd"
    assert "fedkl.algorithms.catalog" not in got["one"] and len(got["one"]) <= 8, got["one"]
    assert got["names"] == got["builtin"] == got["catalog"] and len(got["names"]) >= 25


def test_a_noisy_gd_run_imports_only_its_algorithm(tmp_path):
    got = _python(f"""
import json, sys
from fedkl.cli import main
main(["run", "--dataset", "synthetic-logistic", "--users", "30", "--rounds", "2", "--no-reference",
      "--out", {str(tmp_path / "run")!r}])
print(json.dumps({{"algorithms": sorted(m for m in sys.modules if m.startswith("fedkl.algorithms.")),
                  "heavy": sorted(m for m in ("matplotlib", "pandas", "scipy") if m in sys.modules)}}))
""")
    assert "fedkl.algorithms.catalog" not in got["algorithms"] and len(got["algorithms"]) <= 8, got
    # curves.png drawn by Pillow (fedkl.results.draw_curves), no pandas for a built-in tensor set, no scipy on
    # the common path (issue 34: matplotlib alone was 0.75 of a 1,000-user run's 2.6 CPU s)
    assert (tmp_path / "run" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert got["heavy"] == [], got["heavy"]


def test_another_algorithms_setting_off_its_default_is_still_refused():
    import pytest

    from fedkl.runner import RunConfig

    with pytest.raises(ValueError, match="does not apply to noisy-gd"):
        RunConfig.from_settings(algorithm="noisy-gd", mean_local_solver="lbfgs")
    RunConfig.from_settings(algorithm="noisy-gd", mean_local_solver="newton")  # at its default: dropped
