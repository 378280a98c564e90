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
  * ``--before DIR``: the same runs with another checkout's ``fedkl`` (e.g. the code before this change,
    ``git archive <commit> | tar -x -C DIR``) at the populations listed in ``--before-users``.

``--repeats N`` runs every point N times, interleaved (each repeat runs every population's 'now' then its
'before' in turn), and the table gives min and median of CPU and wall seconds, the median peak RSS, the
1-minute load average around the runs, before/now ratios and the log-log CPU exponent between the smallest
and largest population; ``--md FILE`` writes that table (``--only phased-erm``: that algorithm alone; ``--render``: the table of
the ``--out`` file, running nothing; ``--note``: a line under it).

Results (every run, and the summary) also go to ``--out`` (default simulations/results/bench_p002_scale.json), rewritten after every run. Times on a shared machine vary: docs/studies/performance.md
quotes them as measured under load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
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


def summarize(rows: list[dict]) -> list[dict]:
    """Min and median of CPU and wall seconds (and the median peak RSS) per (case, users), in first-seen order."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault((r["case"], r["users"]), []).append(r)
    out = []
    for (case, n), rs in groups.items():
        stat = {k: (min(x[k] for x in rs), statistics.median(x[k] for x in rs)) for k in ("cpu_seconds", "seconds")}
        metric = rs[0].get("test_metric") or {}
        out.append({"case": case, "users": n, "runs": len(rs), "cpu_min": stat["cpu_seconds"][0],
                    "cpu_median": stat["cpu_seconds"][1], "wall_min": stat["seconds"][0],
                    "wall_median": stat["seconds"][1], "peak_mb": statistics.median(x["peak_rss_mb"] for x in rs),
                    "test_metric": metric.get("value"),
                    "load": [min(x["load"] for x in rs), max(x["load"] for x in rs)] if "load" in rs[0] else None})  # fmt: skip
    return out


def markdown(summary: list[dict], command: str, note: str = "") -> str:
    """The min / median table, then for each case with a '(before)' twin: before / now (CPU, min and median)
    per population and the log-log exponent between the smallest and largest population (median CPU); the
    command and ``note`` (what the 'before' tree is, the machine) last."""
    lines = [
        "# Paper 002 at scale: phased-erm and mean-output-pert (bench_p002_scale)",
        "",
        "| case | users | runs | CPU s min / med | wall s min / med | peak MB | test accuracy | load (1-min avg) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        load = f"{r['load'][0]:.1f}-{r['load'][1]:.1f}" if r["load"] else ""
        lines.append(
            f"| {r['case']} | {r['users']:,} | {r['runs']} | {r['cpu_min']:.1f} / {r['cpu_median']:.1f} | "
            f"{r['wall_min']:.1f} / {r['wall_median']:.1f} | {r['peak_mb']:.0f} | {r['test_metric']} | {load} |"
        )
    by = {(r["case"], r["users"]): r for r in summary}
    notes = []
    for case in dict.fromkeys(r["case"] for r in summary):
        if case.endswith(" (before)"):
            continue
        for n in sorted(n for c, n in by if c == case):
            old = by.get((f"{case} (before)", n))
            if old:
                now = by[(case, n)]
                notes.append(f"{case} at {n:,} users: before / now CPU {old['cpu_min'] / now['cpu_min']:.2f}x (min), "
                             f"{old['cpu_median'] / now['cpu_median']:.2f}x (median)")  # fmt: skip
        for label in (case, f"{case} (before)"):
            ns = sorted(n for c, n in by if c == label)
            if len(ns) >= 2:
                a, b = by[(label, ns[0])], by[(label, ns[-1])]
                k = math.log(b["cpu_median"] / a["cpu_median"]) / math.log(ns[-1] / ns[0])
                notes.append(f"{label}: CPU exponent {ns[0]:,} -> {ns[-1]:,} users {k:.2f} (median)")
    tail = f"\n`{command}`\n" + (f"\n{note}\n" if note else "")
    return "\n".join(lines) + "\n\n" + "".join(f"- {x}\n" for x in notes) + tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, nargs="+", default=[1000, 4000, 16000, 100000])
    ap.add_argument("--lbfgs-users", type=int, nargs="*", default=[1000], help="populations for the L-BFGS solver")
    ap.add_argument("--before", type=Path, default=None, help="another checkout to run as 'before'")
    ap.add_argument("--before-users", type=int, nargs="*", default=[1000, 4000], help="phased-erm 'before' runs")
    ap.add_argument("--before-mean-users", type=int, nargs="*", default=[1000], help="mean-output-pert 'before'")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every point, interleaved (min and median)")
    ap.add_argument("--only", choices=["phased-erm", "mean-output-pert"], default=None, help="one algorithm")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", type=Path, default=ROOT / "simulations" / "results" / "bench_p002_scale.json")
    ap.add_argument("--md", type=Path, default=None, help="also the min / median table as markdown")
    ap.add_argument("--note", default="", help="a line under the table (the 'before' tree's commit, the load)")
    ap.add_argument("--render", action="store_true", help="run nothing: the --md table from the --out JSON")
    args = ap.parse_args()
    if args.render:  # the table of a finished (or interrupted) benchmark, from its output file
        saved = json.loads(args.out.read_text())
        table = markdown(summarize(saved["rows"]), saved["command"], args.note)
        if args.md is not None:
            args.md.write_text(table)
        print(table)
        return

    cases = [("phased-erm", {}, "phased-erm"), ("mean-output-pert", {"mean_local_solver": "newton"}, "mean (newton)")]
    cases = [c for c in cases if args.only in (None, c[0])]
    rows = []

    command = "simulations/bench_p002_scale.py " + " ".join(sys.argv[1:])

    def write() -> str:  # after every run: an interrupted benchmark keeps what it measured
        summary = summarize(rows)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command, "rows": rows, "summary": summary}, indent=1) + "\n")
        table = markdown(summary, command, args.note)
        if args.md is not None:
            args.md.write_text(table)
        return table

    def record(label: str, tree: Path, alg: str, n: int, extra: dict) -> None:
        load = os.getloadavg()[0]
        res = {"case": label, "users": n, **run_point(tree, alg, n, extra, args.timeout)}
        res["load"] = round(max(load, os.getloadavg()[0]), 2)  # the 1-minute load average at its start and end
        rows.append(res)
        print(json.dumps(res), flush=True)
        write()

    for _ in range(args.repeats):  # every repeat runs every point once, in turn (the load drifts on a shared machine)
        for n in args.users:  # each population's 'before' right after its 'now'
            for alg, extra, label in cases:
                record(label, ROOT, alg, n, extra)
            if args.before is not None and n in args.before_users and args.only in (None, "phased-erm"):
                record("phased-erm (before)", args.before, "phased-erm", n, {})
    if args.only in (None, "mean-output-pert"):
        for n in args.lbfgs_users:
            record("mean (lbfgs)", ROOT, "mean-output-pert", n, {"mean_local_solver": "lbfgs"})
    if args.before is not None:
        for n in sorted(set(args.before_users) - set(args.users)) if args.only in (None, "phased-erm") else []:
            record("phased-erm (before)", args.before, "phased-erm", n, {})
        for n in args.before_mean_users if args.only in (None, "mean-output-pert") else []:
            record("mean (before: lbfgs)", args.before, "mean-output-pert", n, {})
    print(write())


if __name__ == "__main__":
    main()
