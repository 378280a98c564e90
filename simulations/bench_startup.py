"""Benchmark: CPU time of the ``fedkl`` command line before it does any work (issue 18 §5), and whole
``fedkl run`` processes the way users run them (issue 34).

    .venv/bin/python simulations/bench_startup.py [--repeats 5]
    .venv/bin/python simulations/bench_startup.py --processes [--repeats 5] [--big] [--before DIR]

Measures user + system CPU seconds of fresh interpreters (min and median of ``--repeats`` >= 3 runs each):
``python -c pass`` (the interpreter itself), ``fedkl --help``, ``fedkl run --help``, ``fedkl run
--algorithm phased-erm --help``, an argument error (``fedkl run --epsilon 0``), and, for comparison, the
import of the training stack the grammar used to need (``import fedkl.runner``: torch, every algorithm).
The grammar is read from fedkl/flags_catalog.json (fedkl.flags.catalog), so the first four import neither
torch nor any algorithm (tests/test_flags_catalog.py checks that, and that the file matches the code).
Results also go to simulations/results/bench_startup.json.

``--processes`` (issue 34) times whole processes instead, interleaved (every repeat runs every case once, in
turn) and reports min and median wall seconds, CPU seconds and peak RSS (the child's ``ru_maxrss``):
``python -c "import torch"``; ``fedkl run --no-reference`` on the default data; on a generated file of 1,000
users x 100 records (.npz, 10 features); with ``--big`` on 100,000 users x 25 records x 50 features (a 1 GB
float64 matrix; ``--big-repeats`` runs, default 1: each takes a while and GBs). From each run's unbuffered
log lines it also reads the time before the budget line (imports, load, set-up: "before 1st round", the last
line before the first round starts), the training loop (the budget line to the privacy line: "loop"; the
process's wall over it: "x loop") and the RSS sampled every 20 ms from /proc before and during the loop
(load-phase peak vs training peak). Each small ``fedkl run`` case runs once more under ``-X importtime``
(:func:`import_share`): its imports' share of that process, torch's own import (with what torch imports)
and the other imports' (issue 34's "imports <= 35 %" is read as the latter: see the function). ``--before DIR`` runs every case also on another
checkout (``git archive <commit> | tar -x -C DIR``), interleaved with this one. All runs: noisy-gd defaults,
``OMP_NUM_THREADS=1``. Results go to simulations/results/bench_processes.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

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


def write_file(path: str, n_users: int, records: int, d: int, seed: int = 0) -> None:
    """A user-partitioned .npz: ``d`` feature columns (norms well inside 1), integer user ids, 0/1 labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = n_users * records
    cols = {f"x{i}": rng.standard_normal(n) * (0.2 / d**0.5) for i in range(d)}
    cols["uid"] = rng.permutation(np.repeat(np.arange(n_users), records))
    cols["y"] = (rng.random(n) < 0.5).astype(np.int64)
    np.savez(path, **cols)


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process so far (/proc/PID/stat), NaN when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def run_process(args: list[str], tree: str, cwd: str) -> dict:
    """One fresh ``python args`` with ``tree`` first on the path: wall, CPU and peak RSS (ru_maxrss); the
    times of its budget and privacy lines; the RSS sampled before and during the loop."""
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    marks: dict[str, float] = {}
    rss = {"before_loop": 0, "loop": 0}
    hwm = [0]  # the process's own VmHWM (ru_maxrss of a child can report the parent's peak from before exec)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    status = {
                        line.split(":")[0]: line.split()[1] for line in f if line.startswith(("VmRSS:", "VmHWM:"))
                    }
                kb = int(status.get("VmRSS", 0))
                hwm[0] = max(hwm[0], int(status.get("VmHWM", 0)))
            except (OSError, ValueError, IndexError):
                kb = 0
            phase = "loop" if "budget" in marks and "privacy" not in marks else "before_loop"
            if "privacy" not in marks:
                rss[phase] = max(rss[phase], kb)
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tail = []
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        now = time.perf_counter() - t0
        tail = (tail + [line])[-20:]
        for key, prefix in (("budget", "budget:"), ("first_round", "  round "), ("privacy", "privacy:")):
            if key not in marks and line.startswith(prefix):
                marks[key] = now
                if key == "budget":  # the CPU seconds so far too (steadier than wall on a loaded machine)
                    marks["budget_cpu"] = proc_cpu_seconds(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if status != 0:
        raise RuntimeError(f"{args} failed ({status}):\n{''.join(tail)}")
    out = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": hwm[0] / 1024}
    if "budget" in marks and "privacy" in marks:
        out.update(
            before_loop_s=marks["budget"],
            before_loop_cpu_s=marks["budget_cpu"],
            **({"first_round_s": marks["first_round"]} if "first_round" in marks else {}),
            loop_s=marks["privacy"] - marks["budget"],
            load_rss_mb=rss["before_loop"] / 1024,
            loop_rss_mb=rss["loop"] / 1024,
        )
    return out


def import_share(args: list[str], tree: str, cwd: str) -> dict:
    """One more fresh ``python -X importtime args``: the seconds spent importing (every module's self time),
    those of ``import torch`` (its cumulative time, with what it imports: numpy, ...) and the rest, as
    shares of that process's wall time. Issue 34's "imports <= 35 % of the samples" read as the imports
    other than torch's own (a process <= 1.6x a bare ``import torch`` is >= 62 % torch's import)."""
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    total = torch_us = 0
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative, name = (part.strip() for part in line[len("import time:") :].split("|"))
        total += int(self_us)
        if name == "torch":
            torch_us = max(torch_us, int(cumulative))
    return {
        "wall_s": wall,
        "imports_s": total / 1e6,
        "torch_import_s": torch_us / 1e6,
        "imports_share": total / 1e6 / wall,
        "torch_share": torch_us / 1e6 / wall,
        "other_imports_share": (total - torch_us) / 1e6 / wall,
    }


def processes(args: argparse.Namespace, tmp: str) -> dict:
    trees = {"now": ROOT, **({"before": os.path.abspath(args.before)} if args.before else {})}
    small = os.path.join(tmp, "users1k.npz")
    make = (
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import bench_startup as b; "
    )
    # in a child: this process stays small (a child's ru_maxrss starts from its parent's)
    subprocess.run([sys.executable, "-c", make + f"b.write_file({small!r}, 1000, 100, 10)"], check=True)
    file_flags = ["--user-column", "uid", "--label-column", "y", "--on-bound", "clip", "--no-reference"]
    cases = {
        'python -c "import torch"': (["-c", "import torch"], args.repeats),
        "fedkl run (default data)": (["-m", "fedkl.cli", "run", "--no-reference"], args.repeats),
        "fedkl run 1,000 users x 100 (npz)": (
            ["-m", "fedkl.cli", "run", "--dataset", small, *file_flags],
            args.repeats,
        ),
    }
    if args.big_only:  # the 100,000-user file (and import torch) alone
        cases = {'python -c "import torch"': (["-c", "import torch"], args.big_repeats)}
    if args.big or args.big_only:
        big = os.path.join(tmp, "users100k.npz")
        subprocess.run([sys.executable, "-c", make + f"b.write_file({big!r}, 100_000, 25, 50)"], check=True)
        cases["fedkl run 100,000 users x 25 (npz, d=50)"] = (["-m", "fedkl.cli", "run", "--dataset", big, *file_flags],
                                                             args.big_repeats)  # fmt: skip
    runs: dict[tuple[str, str], list[dict]] = {}
    counter = 0
    for r in range(max(n for _, n in cases.values())):
        for name, (case, n) in cases.items():
            if r >= n:
                continue
            for label, tree in trees.items():
                counter += 1
                cwd = os.path.join(tmp, f"run{counter}")
                os.makedirs(cwd)
                runs.setdefault((name, label), []).append(run_process(case, tree, cwd))
                print(f"{name} [{label}] {runs[(name, label)][-1]}", flush=True)
    table = {}
    for (name, label), rs in runs.items():
        row = {}
        for key in rs[0]:
            values = [x[key] for x in rs if key in x]
            row[key] = {"min": round(min(values), 3), "median": round(statistics.median(values), 3)}
        row["runs"] = len(rs)
        if name.startswith("fedkl run") and "100,000" not in name:  # one -X importtime run each
            counter += 1
            cwd = os.path.join(tmp, f"run{counter}")
            os.makedirs(cwd)
            row["imports"] = {k: round(v, 3) for k, v in import_share(cases[name][0], trees[label], cwd).items()}
            print(f"{name} [{label}] imports {row['imports']}", flush=True)
        table[f"{name} [{label}]"] = row
    return table


def markdown(table: dict, loaded: str) -> str:
    """The table; the ratios are to ``python -c "import torch"`` of the same tree (min wall, median CPU) and to
    the run's own training loop (median wall / median loop); the import shares of one ``-X importtime`` run;
    then the time before the first round against the other tree's."""
    lines = [
        "| process | runs | wall s min / med | x torch (min wall) | CPU s med | x torch (CPU) | before 1st round s "
        "med | loop s med | x loop | imports % (torch / other) | peak RSS MB | load-phase RSS MB | loop RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        torch_row = table.get('python -c "import torch" [' + name.rsplit("[", 1)[-1], {})

        def cell(key: str, fmt: str = "{:.2f}") -> str:
            return fmt.format(row[key]["median"]) if key in row else ""

        def ratio(key: str, stat: str) -> str:
            return f"{row[key][stat] / torch_row[key][stat]:.2f}" if torch_row else ""

        imp = row.get("imports")
        shares = (
            f"{100 * imp['imports_share']:.0f} ({100 * imp['torch_share']:.0f} / {100 * imp['other_imports_share']:.0f})"
            if imp
            else ""
        )
        per_loop = f"{row['wall_s']['median'] / row['loop_s']['median']:.1f}" if "loop_s" in row else ""
        lines.append(
            f"| {name} | {row['runs']} | {row['wall_s']['min']:.2f} / {row['wall_s']['median']:.2f} | "
            f"{ratio('wall_s', 'min')} | {cell('cpu_s')} | {ratio('cpu_s', 'median')} | {cell('before_loop_s')} | "
            f"{cell('loop_s')} | {per_loop} | {shares} | {cell('peak_rss_mb', '{:.0f}')} | {cell('load_rss_mb', '{:.0f}')} | "
            f"{cell('loop_rss_mb', '{:.0f}')} |"
        )
    before = [
        (name, row, table.get(name.replace("[now]", "[before]"), {}))
        for name, row in table.items()
        if name.endswith("[now]") and "before_loop_s" in row
    ]
    if any("before_loop_s" in b for _, _, b in before):
        lines += [
            "",
            "| process | before 1st round s med: now / before | now / before | CPU s before 1st round: now / before | "
            "now / before | load-phase RSS / loop RSS now |",
        ]
        lines.append("|---|---|---|---|---|---|")
        for name, row, b in before:
            if "before_loop_s" in b:
                now_s, old_s = row["before_loop_s"]["median"], b["before_loop_s"]["median"]
                now_c, old_c = row["before_loop_cpu_s"]["median"], b["before_loop_cpu_s"]["median"]
                lines.append(
                    f"| {name[: -len(' [now]')]} | {now_s:.2f} / {old_s:.2f} | {now_s / old_s:.2f} | "
                    f"{now_c:.2f} / {old_c:.2f} | {now_c / old_c:.2f} | "
                    f"{row['load_rss_mb']['median'] / row['loop_rss_mb']['median']:.2f} |"
                )
    return "\n".join(lines) + f"\n\n{loaded}\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs per case (>= 3); min and median reported")
    p.add_argument("--out", default=None, help="the JSON results (default simulations/results/bench_*.json)")
    p.add_argument("--processes", action="store_true", help="whole fedkl run processes (issue 34) instead")
    p.add_argument("--big", action="store_true", help="with --processes: also the 100,000-user file")
    p.add_argument("--big-repeats", type=int, default=1, help="runs of the 100,000-user case")
    p.add_argument("--big-only", action="store_true", help="with --big: only that case (and import torch)")
    p.add_argument("--before", default=None, help="with --processes: another checkout, run interleaved")
    p.add_argument("--note", default="", help="with --processes: a sentence after the table's load line")
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error("--repeats must be >= 3")
    results_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    if args.processes:
        import shutil

        tmp = tempfile.mkdtemp(prefix="fedkl-bench-")
        try:
            table = processes(args, tmp)
        finally:  # the generated files (1 GB with --big) and the runs' outputs
            shutil.rmtree(tmp, ignore_errors=True)
        load = os.getloadavg()
        loaded = (
            f"Load average at the end: {load[0]:.1f} on {os.cpu_count()} cores; interleaved repeats, noisy-gd "
            "defaults, OMP_NUM_THREADS=1; `simulations/bench_startup.py --processes`."
            + (f" {args.note}" if args.note else "")
        )
        md = markdown(table, loaded)
        print(md)
        out = args.out or os.path.join(results_dir, "bench_processes.json")
        with open(out, "w") as f:
            json.dump(
                {"repeats": args.repeats, "big_repeats": args.big_repeats, "table": table, "note": loaded}, f, indent=1
            )
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(md)
        return table
    args.out = args.out or os.path.join(results_dir, "bench_startup.json")
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
