"""Benchmark: the per-user clipped gradient sum of a torch model vs one non-private training step.

    .venv/bin/python simulations/bench_torch_models.py [--models mlp cnn] [--shapes 128x10 1280x1] [--repeats 5]

On the same batch (``users x records`` rows of 784 features, 10 classes; random features: the cost does
not depend on their values), one torch thread, for paper 004's MLP (784-128-128-10) and the small CNN of
simulations/nets.py (two 5x5 convolutions with GroupNorm, a linear head), it measures:
  * non-private: one training step's gradient, forward + backward of the mean loss w.r.t. the parameters;
  * ghost:       :func:`fedkl.federation.ghost_clipping.ghost_clipped_sum` (what the in-process backend
                 answers a ClippedGradient sum with, by default);
  * per-record:  the old path, ``per_user_gradients`` (per-record gradients by vmap(grad), summed into
                 users) + ``clip_rows`` + sum (``InProcessFederation(..., ghost=False)``);
time: min and median of ``--repeats`` (>= 3) calls after a warm-up call, the methods interleaved, in CPU
time of the calling thread (torch runs on that one thread) and in wall time; peak memory: the largest amount of
memory torch allocated on the CPU during one call above what was live when it started (the torch
profiler's memory events, ``profile_memory=True``, in a separate call from the timings); and the
relative difference of the ghost and per-record sums. Writes simulations/results/bench_torch_models.md
(and .json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedkl.data.base import UserData  # noqa: E402
from fedkl.federation.clipping import clip_rows  # noqa: E402
from fedkl.federation.ghost_clipping import ghost_clipped_sum  # noqa: E402
from fedkl.problems import MLP, TorchModel  # noqa: E402
from simulations.nets import small_cnn  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_torch_models")
CLIP = 1.0


def _problem(name: str) -> TorchModel:
    if name == "mlp":
        return MLP(784, (128, 128), 10, seed=0)
    return TorchModel(small_cnn, 784, "multiclass", 10, seed=0)


def _batch(users: int, records: int) -> UserData:
    g = torch.Generator().manual_seed(0)
    n = users * records
    X = torch.randn(n, 784, generator=g) / 28  # rows of norm ~1
    y = torch.randint(0, 10, (n,), generator=g)
    return UserData(X, y, torch.arange(users).repeat_interleave(records), tuple(map(str, range(users))))


def _methods(problem: TorchModel, data: UserData) -> dict:
    w = problem.init_params()
    X, y = data.X.to(problem.dtype), data.y
    params = {k: v.detach().clone().requires_grad_(True) for k, v in problem._unflatten(w).items()}

    def non_private():
        out = torch.func.functional_call(problem.module, params, (X,))
        return torch.autograd.grad(F.cross_entropy(out, y), list(params.values()))

    def ghost():
        return ghost_clipped_sum(problem, w, data, CLIP)[0]

    def per_record():
        return clip_rows(problem.per_user_gradients(w, data), CLIP)[0].sum(0)

    return {"non-private": non_private, "ghost": ghost, "per-record": per_record}


def _timed(methods: dict, repeats: int) -> dict[str, dict[str, float]]:
    """Per method: min and median of ``repeats`` calls (after one warm-up call each), the methods
    interleaved (so a change in the machine's load hits all of them): CPU time of this thread
    (``time.thread_time``; torch runs on this one thread) and wall time."""
    for fn in methods.values():
        fn()
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    wall: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            c, t = time.thread_time(), time.perf_counter()
            fn()
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - t)
    return {
        name: {
            "cpu_min_s": min(cpu[name]),
            "cpu_median_s": statistics.median(cpu[name]),
            "wall_min_s": min(wall[name]),
            "wall_median_s": statistics.median(wall[name]),
        }
        for name in methods
    }


def _peak_bytes(fn) -> int:
    """Peak of torch's CPU allocations during one call, above the memory live at its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def bench(model: str, users: int, records: int, repeats: int) -> list[dict]:
    problem, data = _problem(model), _batch(users, records)
    methods = _methods(problem, data)
    ghost, stock = methods["ghost"](), methods["per-record"]()
    diff = float((ghost - stock).norm() / stock.norm())
    times = _timed(methods, repeats)
    rows = [
        {
            "model": model,
            "users": users,
            "records": records,
            "params": problem.num_params,
            "method": name,
            **times[name],
            "peak_mb": _peak_bytes(fn) / 2**20,
            "rel_diff_ghost_vs_per_record": diff,
        }
        for name, fn in methods.items()
    ]
    base = rows[0]
    for r in rows:
        r["time_ratio"] = r["cpu_min_s"] / base["cpu_min_s"]
        r["memory_ratio"] = r["peak_mb"] / base["peak_mb"]
    return rows


def _markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Per-user clipped gradient sums of torch models vs a non-private step",
        "",
        f"Generated by `{command}` (one torch thread, on the shared 2-core CPU machine).",
        "Same batch for every method (users x records rows, 784 random features, 10 classes). Time: CPU time of the",
        "calling thread (`time.thread_time`, the one torch thread; less sensitive than wall time to the other jobs on",
        "the machine), min / median of the repeats, the methods interleaved; wall min / median beside it. Peak: the",
        "most memory torch allocated on the CPU during one call above what was live at its start (torch profiler,",
        "`profile_memory=True`). Ratios: to the non-private step's minimum CPU time and its peak.",
        "",
        "| model | params | users x records | method | CPU min / median (ms) | wall min / median (ms) "
        "| time / non-private | peak (MB) | memory / non-private |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params']:,} | {r['users']} x {r['records']} | {r['method']} | "
            f"{1e3 * r['cpu_min_s']:.1f} / {1e3 * r['cpu_median_s']:.1f} | "
            f"{1e3 * r['wall_min_s']:.1f} / {1e3 * r['wall_median_s']:.1f} | {r['time_ratio']:.2f} | "
            f"{r['peak_mb']:.1f} | {r['memory_ratio']:.2f} |"
        )
    diffs = {(r["model"], r["users"], r["records"]): r["rel_diff_ghost_vs_per_record"] for r in rows}
    lines += [
        "",
        "Relative difference of the ghost and per-record clipped sums (float32): "
        + ", ".join(f"{m} {u}x{k}: {d:.1e}" for (m, u, k), d in diffs.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    ap.add_argument("--shapes", nargs="+", default=["128x10", "1280x1"], help="users x records per user")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=OUT, help="output path without extension (.md and .json are written)")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats must be at least 3")
    torch.set_num_threads(1)
    rows = []
    for model in args.models:
        for shape in args.shapes:
            users, records = (int(v) for v in shape.split("x"))
            for r in bench(model, users, records, args.repeats):
                print(
                    f"{model} {users}x{records} {r['method']:12s} cpu min {1e3 * r['cpu_min_s']:8.1f} ms "
                    f"median {1e3 * r['cpu_median_s']:8.1f} ms ({r['time_ratio']:.2f}x)  peak {r['peak_mb']:7.1f} MB "
                    f"({r['memory_ratio']:.2f}x)",
                    flush=True,
                )
                rows.append(r)
    command = "python simulations/bench_torch_models.py " + " ".join(sys.argv[1:])
    with open(args.out + ".md", "w") as f:
        f.write(_markdown(rows, command.strip()))
    with open(args.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
