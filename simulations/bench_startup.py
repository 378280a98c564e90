"""Benchmark: CPU time of the ``fedkl`` command line before it does any work (issue 18 §5).

    .venv/bin/python simulations/bench_startup.py [--repeats 5]

Measures user + system CPU seconds of fresh interpreters (min and median of ``--repeats`` >= 3 runs each):
``python -c pass`` (the interpreter itself), ``fedkl --help``, ``fedkl run --help``, ``fedkl run
--algorithm phased-erm --help``, an argument error (``fedkl run --epsilon 0``), and, for comparison, the
import of the training stack the grammar used to need (``import fedkl.runner``: torch, every algorithm).
The grammar is read from fedkl/flags_catalog.json (fedkl.flags.catalog), so the first four import neither
torch nor any algorithm (tests/test_flags_catalog.py checks that, and that the file matches the code).
Results also go to simulations/results/bench_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    "python -c pass": ["-c", "pass"],
    "fedkl --help": ["-m", "fedkl.cli", "--help"],
    "fedkl run --help": ["-m", "fedkl.cli", "run", "--help"],
    "fedkl run --algorithm phased-erm --help": ["-m", "fedkl.cli", "run", "--algorithm", "phased-erm", "--help"],
    "fedkl run --epsilon 0 (error)": ["-m", "fedkl.cli", "run", "--epsilon", "0"],
    "import fedkl.runner (torch + algorithms)": ["-c", "import fedkl.runner"],
}


def cpu_seconds(args: list[str]) -> float:
    """User + system CPU seconds of one fresh ``python args`` (its children's rusage delta)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs per case (>= 3); min and median reported")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_startup.json"))
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error("--repeats must be >= 3")
    results = {}
    for name, case in CASES.items():
        times = [cpu_seconds(case) for _ in range(args.repeats)]
        results[name] = {"min_s": round(min(times), 4), "median_s": round(statistics.median(times), 4)}
    base = results["python -c pass"]["median_s"]
    print(f"{'command':45s} {'CPU min':>8s} {'median':>8s} {'beyond python':>14s}")
    for name, r in results.items():
        print(f"{name:45s} {r['min_s']:8.3f} {r['median_s']:8.3f} {r['median_s'] - base:14.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"repeats": args.repeats, "cpu_seconds": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
