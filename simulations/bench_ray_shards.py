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

``--interleaved inprocess ray-shards:2 flower-sim`` (issue 33: flower-sim within 5x of ray-shards per round)
instead runs each backend as its own process (its own Ray instance: Flower's simulation engine starts one),
holding its federation open, and asks them one ``sum(ClippedGradient)`` request each in turn, ``--repeats``
times after a warm-up (interleaved, so a load on the machine hits every backend alike). ``flower-sim`` holds
``--users-per-node`` users per simulated node (0: the auto rule of ``fedkl.flower.backends.users_per_node``,
about one node per CPU core; ``flower-sim:1`` is one user per node). Reported: start-up s (federation built,
handshake done), request ms min / median, x in-process and x ray-shards (medians), and whether each total is
the in-process one bit for bit (flower-sim computes with the reproducible kernels, so its total may differ
from the fast in-process total in the last bits: the max abs difference is shown).
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
    p.add_argument("--interleaved", nargs="+", metavar="BACKEND", help="inprocess, ray-shards:K, flower-sim[:B]")
    p.add_argument("--serve", nargs=2, metavar=("BACKEND", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return {}
    if args.interleaved:
        info = interleaved(args.interleaved, args.users[0], args.repeats)
        table = markdown_interleaved(info)
        out = args.out.replace("bench_ray_shards", "bench_flower_blocks")
        with open(out, "w") as f:
            json.dump(info, f, indent=1)
        with open(args.markdown.replace("bench_ray_shards", "bench_flower_blocks"), "w") as f:
            f.write(table)
        print(table)
        return info

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


# --- interleaved: one process per backend, asked in turn ------------------------------------------------------
def serve(backend: str, n: int) -> None:
    """A child: build ``backend``'s federation over ``n`` users, print ``{"start_s"}``, then answer each stdin
    line ``sum`` with one timed request ``{"s", "total"}`` until ``quit``."""
    import torch

    torch.set_num_threads(1)
    from fedkl.federation.base import ClippedGradient

    name, _, arg = backend.partition(":")
    data, problem = build(n)
    w = torch.linspace(-0.1, 0.1, problem.num_params, dtype=problem.dtype)
    t0 = time.perf_counter()
    if name == "inprocess":
        from fedkl.federation.inprocess import InProcessFederation

        fed = InProcessFederation(problem, data)
    elif name == "ray-shards":
        from fedkl.federation.ray_shards import RayShardFederation

        fed = RayShardFederation(functools.partial(build, n), data.train.user_ids, int(arg or 2))
    elif name == "flower-sim":
        from fedkl.flower.backends import users_per_node
        from fedkl.flower.codec import ClientSpec
        from fedkl.flower.server_app import start_federation

        upn = users_per_node(int(arg or 0), "flower-sim", n)
        spec = ClientSpec.build("synthetic-logistic", "logistic", {"n_users": n, "m": RECORDS, "d": DIM, "seed": 0})
        fed = start_federation(
            "flower-sim", spec, user_ids=data.train.user_ids, num_params=problem.num_params, users_per_node=upn
        )
    else:
        raise SystemExit(f"unknown backend {backend!r}")
    print(json.dumps({"start_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        if line.strip() != "sum":
            break
        t0 = time.perf_counter()
        ans = fed.sum(ClippedGradient(w, 1.0))
        secs = time.perf_counter() - t0
        print(json.dumps({"s": secs, "failed": len(ans.failed), "total": ans.total().tolist()}), flush=True)
    if hasattr(fed, "close"):
        fed.close()


def interleaved(backends: list[str], n: int, repeats: int) -> dict:
    import subprocess

    import numpy as np

    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, rows = {}, {}
    try:
        for b in backends:  # start-ups one after the other (each alone on the machine)
            cmd = [sys.executable, os.path.abspath(__file__), "--serve", b, str(n)]
            procs[b] = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
            )
            ready = json.loads(_json_line(procs[b]))
            rows[b] = {"backend": b, "users": n, "start_s": ready["start_s"], "secs": [], "failed": 0}
            print(f"{b}: started in {ready['start_s']:.1f} s", flush=True)

        def ask(b: str) -> dict:
            procs[b].stdin.write("sum\n")
            procs[b].stdin.flush()
            return json.loads(_json_line(procs[b]))

        totals = {b: ask(b)["total"] for b in backends}  # warm-up
        for r in range(repeats):
            order = backends[r % len(backends) :] + backends[: r % len(backends)]  # rotate who goes first
            for b in order:
                out = ask(b)
                rows[b]["secs"].append(out["s"])
                rows[b]["failed"] += out["failed"]
    finally:
        for p in procs.values():
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
                p.wait(timeout=120)
            except Exception:
                import signal

                os.killpg(p.pid, signal.SIGKILL)
    ref = next((b for b in backends if b.startswith("inprocess")), backends[0])
    shards = next((b for b in backends if b.startswith("ray-shards")), None)
    med = {b: statistics.median(rows[b]["secs"]) for b in backends}
    out = []
    for b in backends:
        r = rows[b]
        diff = float(np.abs(np.asarray(totals[b]) - np.asarray(totals[ref])).max())
        out.append(
            {
                "users": n,
                "backend": b,
                "start_s": r["start_s"],
                "sum_ms_min": 1e3 * min(r["secs"]),
                "sum_ms_median": 1e3 * med[b],
                "x_inprocess": med[b] / med[ref],
                "x_ray_shards": med[b] / med[shards] if shards else None,
                "failed": r["failed"],
                "sum_max_abs_diff": diff,
            }
        )
    info = {
        "mode": "interleaved",
        "repeats": repeats,
        "records_per_user": RECORDS,
        "dim": DIM,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "rows": out,
    }
    return info


def _json_line(proc) -> str:
    for line in proc.stdout:
        if line.startswith("{"):
            return line
    raise RuntimeError(f"the backend process exited ({proc.wait()}) before answering")


def markdown_interleaved(info: dict) -> str:
    lines = [
        "| users | backend | start s | request ms min / med | x in-process | x ray-shards | failed | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in info["rows"]:
        xs = f"{r['x_ray_shards']:.2f}" if r["x_ray_shards"] is not None else "—"
        lines.append(
            f"| {r['users']:,} | {r['backend']} | {r['start_s']:.1f} | {r['sum_ms_min']:.1f} / {r['sum_ms_median']:.1f} "
            f"| {r['x_inprocess']:.2f} | {xs} | {r['failed']} | {r['sum_max_abs_diff']:.1e} |"
        )
    lines.append(
        f"\nOne invocation, interleaved (each backend its own process, asked in turn), {info['seconds']:.0f} s in all, "
        f"on {info['cpus']} CPU cores (load average before {info['load_before'][0]:.1f}); one request = "
        f"sum(ClippedGradient) over every user (noisy GD's round); synthetic logistic data, "
        f"{info['records_per_user']} records per user, d = {info['dim']}; min / median of {info['repeats']} "
        "requests after a warm-up; torch single-threaded per process.\n"
    )
    return "\n".join(lines) + "\n"


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
