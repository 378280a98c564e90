"""Benchmark: one federation request in-process vs sharded over 1 and 2 Ray actors (``--backend ray-shards``).

    .venv/bin/python simulations/bench_ray_shards.py [--users 10000] [--shards 1 2] [--repeats 5]
        [--out simulations/results/bench_ray_shards.json] [--markdown simulations/results/bench_ray_shards.md]

Synthetic logistic data (n users x 20 records, d = 50, the data of bench_backends.py), torch with one
thread per process, Ray started locally with 2 CPUs (one per shard). For each backend it times the two
request shapes a round is made of (the noise, the ledger charge and the algorithm's own arithmetic run
on the server and are the same on every backend; bench_inprocess.py measures them):

  sum ms       ``federation.sum(ClippedGradient)``: the clipped per-user gradients of all n users, summed
              (noisy GD's round): in-process one batched op; sharded, each shard sums its block and the
              server adds the block sums in shard order;
  rows ms     ``federation.compute(GradientsAtPoints(1 point))``: every user's (d,) row back on the server
              (the per-user answers of paper 002's algorithms), n x d float64 through Ray's object store;
  start s     building the federation (in-process: the data is already loaded; Ray actors: each loads
              the dataset and keeps its block);
  same        rows bit for bit equal to in-process; sums equal to float64 rounding (max |diff| shown).

Times are min / median over ``--repeats`` requests after one warm-up. The machine is shared: read
ratios within one invocation, not absolute numbers across days.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RECORDS, DIM = 20, 50


def build(n: int) -> tuple:
    """``(dataset, problem)``: what every shard (and the in-process reference) computes on."""
    from fedkl.data import load_dataset
    from fedkl.problems import make_problem

    data = load_dataset("synthetic-logistic", n_users=n, m=RECORDS, d=DIM, seed=0)
    return data, make_problem("logistic", data)


def timed(fn, repeats: int) -> tuple[list[float], object]:
    out = fn()  # warm-up
    secs = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        secs.append(time.perf_counter() - start)
    return secs, out


def measure(fed, w, point, repeats: int) -> dict:
    from fedkl.federation.base import ClippedGradient, GradientsAtPoints

    sum_s, total = timed(lambda: fed.sum(ClippedGradient(w, 1.0)).total(), repeats)
    rows_s, rows = timed(lambda: fed.compute(GradientsAtPoints(point)).values, repeats)
    return {"sum_s": sum_s, "rows_s": rows_s, "total": total, "rows": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, nargs="+", default=[10_000])
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(RESULTS, "bench_ray_shards.json"))
    p.add_argument("--markdown", default=os.path.join(RESULTS, "bench_ray_shards.md"))
    args = p.parse_args(argv)

    import ray
    import torch

    from fedkl.federation.inprocess import InProcessFederation
    from fedkl.federation.ray_shards import RayShardFederation

    torch.set_num_threads(1)
    started = time.perf_counter()
    ray.init(num_cpus=max(2, max(args.shards)), include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for n in args.users:
            data, problem = build(n)
            w = torch.linspace(-0.1, 0.1, problem.num_params, dtype=problem.dtype)
            point = w.unsqueeze(0)
            t0 = time.perf_counter()
            ref_fed = InProcessFederation(problem, data)
            start_s = time.perf_counter() - t0
            ref = {**measure(ref_fed, w, point, args.repeats), "start_s": start_s}
            results = [("inprocess", ref)]
            for k in args.shards:
                t0 = time.perf_counter()
                fed = RayShardFederation(functools.partial(build, n), data.train.user_ids, k)
                start_s = time.perf_counter() - t0
                try:
                    results.append((f"ray-shards x{k}", {**measure(fed, w, point, args.repeats), "start_s": start_s}))
                finally:
                    fed.close()
            for name, r in results:
                rows.append(
                    {
                        "users": n,
                        "backend": name,
                        "start_s": r["start_s"],
                        "sum_ms_min": 1e3 * min(r["sum_s"]),
                        "sum_ms_median": 1e3 * statistics.median(r["sum_s"]),
                        "rows_ms_min": 1e3 * min(r["rows_s"]),
                        "rows_ms_median": 1e3 * statistics.median(r["rows_s"]),
                        "x_inprocess_sum": statistics.median(r["sum_s"]) / statistics.median(ref["sum_s"]),
                        "rows_bit_equal": bool(torch.equal(r["rows"], ref["rows"])),
                        "sum_max_abs_diff": float((r["total"] - ref["total"]).abs().max()),
                    }
                )
    finally:
        ray.shutdown()
    info = {
        "repeats": args.repeats,
        "records_per_user": RECORDS,
        "dim": DIM,
        "cpus": os.cpu_count(),
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(info, f, indent=1)
    table = markdown(info)
    with open(args.markdown, "w") as f:
        f.write(table)
    print(table)
    return info


def markdown(info: dict) -> str:
    lines = [
        "| users | backend | start s | sum ms min / med | x in-process (sum) | rows ms min / med | rows bit-equal | sum max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in info["rows"]:
        lines.append(
            f"| {r['users']:,} | {r['backend']} | {r['start_s']:.1f} | {r['sum_ms_min']:.1f} / {r['sum_ms_median']:.1f} "
            f"| {r['x_inprocess_sum']:.2f} | {r['rows_ms_min']:.1f} / {r['rows_ms_median']:.1f} "
            f"| {'yes' if r['rows_bit_equal'] else 'NO'} | {r['sum_max_abs_diff']:.1e} |"
        )
    lines.append(
        f"\nOne invocation, {info['seconds']:.0f} s in all, on {info['cpus']} CPU cores shared with other jobs; "
        f"synthetic logistic data, {info['records_per_user']} records per user, d = {info['dim']}; "
        f"min / median of {info['repeats']} requests after a warm-up; torch single-threaded per process.\n"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
