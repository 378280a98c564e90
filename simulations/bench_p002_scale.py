"""Benchmark: paper 002's phased-erm and mean-output-pert at 1,000 to 100,000 synthetic users.

    .venv/bin/python simulations/bench_p002_scale.py [--users 1000 4000 16000 100000] [--before <a checkout before the change>]

Each point is one full ``fedkl.train`` run (imports excluded from its time) (synthetic-logistic, the loader's default records per user
and dimension, eps = 2, in-process backend, one thread) in its own subprocess, so the peak RSS is that
run's. It prints wall time, CPU time (steadier than wall on a loaded machine) and peak RSS per algorithm and
population (a population's 'before' run right after its own runs):

  * ``phased-erm``: paper 002 Alg 3 with the diameter test (batched certified Newton, the per-user
    residual recomputation through the per-user record index, the blocked conflict graph);
  * ``mean-output-pert`` with ``mean_local_solver=newton`` (batched) and, where cheap, ``lbfgs``
    (the per-user L-BFGS loop, ~75 ms a user);
  * ``--before DIR``: the same runs with another checkout's ``fedkl`` (e.g. the code before this change)
    at the populations listed in ``--before-users``.

Results also go to simulations/results/bench_p002_scale.json. Times on a shared machine vary: docs/studies/performance.md
quotes them as measured under load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, resource, sys, tempfile, time
import torch
torch.set_num_threads(1)
from fedkl.api import train  # imports outside the timed region
alg, n, extra = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
start, cpu = time.perf_counter(), time.process_time()
run = train("synthetic-logistic", alg, epsilon=2.0, users=n, force=True, noise_seed=0, log=None,
                  out=tempfile.mkdtemp(), **extra)
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "test_metric": run.result.get("test_metric")}))
"""


def run_point(tree: Path, alg: str, n: int, extra: dict, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, alg, str(n), json.dumps(extra)],
            env=env, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir(),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, nargs="+", default=[1000, 4000, 16000, 100000])
    ap.add_argument("--lbfgs-users", type=int, nargs="*", default=[1000], help="populations for the L-BFGS solver")
    ap.add_argument("--before", type=Path, default=None, help="another checkout to run as 'before'")
    ap.add_argument("--before-users", type=int, nargs="*", default=[1000, 4000], help="phased-erm 'before' runs")
    ap.add_argument("--before-mean-users", type=int, nargs="*", default=[1000], help="mean-output-pert 'before'")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", type=Path, default=ROOT / "simulations" / "results" / "bench_p002_scale.json")
    args = ap.parse_args()

    cases = [("phased-erm", {}, "phased-erm"), ("mean-output-pert", {"mean_local_solver": "newton"}, "mean (newton)")]
    rows = []

    def record(label: str, tree: Path, alg: str, n: int, extra: dict) -> None:
        res = {"case": label, "users": n, **run_point(tree, alg, n, extra, args.timeout)}
        rows.append(res)
        print(json.dumps(res), flush=True)

    for n in args.users:  # each population's 'before' right after its 'now' (the load drifts on a shared machine)
        for alg, extra, label in cases:
            record(label, ROOT, alg, n, extra)
        if args.before is not None and n in args.before_users:
            record("phased-erm (before)", args.before, "phased-erm", n, {})
    for n in args.lbfgs_users:
        record("mean (lbfgs)", ROOT, "mean-output-pert", n, {"mean_local_solver": "lbfgs"})
    if args.before is not None:
        for n in sorted(set(args.before_users) - set(args.users)):
            record("phased-erm (before)", args.before, "phased-erm", n, {})
        for n in args.before_mean_users:
            record("mean (before: lbfgs)", args.before, "mean-output-pert", n, {})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'case':22s} {'users':>7s} {'seconds':>9s} {'CPU s':>9s} {'peak MB':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:22s} {r['users']:7d}   {r['error']}")
        else:
            print(
                f"{r['case']:22s} {r['users']:7d} {r['seconds']:9.1f} {r['cpu_seconds']:9.1f} {r['peak_rss_mb']:8.0f}"
            )


if __name__ == "__main__":
    main()
