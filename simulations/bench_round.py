"""Benchmark: a full ``fedkl run`` round against the one-bmm floor, and the durable bookkeeping's share.

    nice -n 15 .venv/bin/python simulations/bench_round.py [--users 1000 10000 100000] [--records 100 100 25]
        [--rounds 10] [--repeats 3] [--dtypes float64 float32] [--mlp 1000x10]

The task of ``simulations/bench_peers.py`` (user-level noisy GD, logistic regression, d = 50, one torch
thread) on ``synthetic-logistic`` data of ``--users`` users x ``--records`` records each (80 % train). For each
size, ``--repeats`` times each (interleaved, so that a change of load hits both alike):

* ``floor``: the true floor, hand-written in torch on the same shape (float64): ``X @ w``, sigmoid, ONE
  batched matmul for the per-user gradients, ``torch.linalg.vector_norm``, clip, sum, noise, step;
* ``run``: :func:`fedkl.runner.run_training` with the defaults (in-process, fast kernels, each release
  charged in its own ledger transaction right before its noise is drawn, the journal durable at egress),
  the dataset passed in (not loaded).

It reports per round: the training loop (``NoisyGradientDescent.run``: queries, Releaser, ledger, journal)
and the whole run (``run_training``'s wall time: reserve and verify, forecast, the loop, result.json and
model.pt; no non-private reference) divided by the rounds, each against the floor (min and median over the
repeats); the ledger's and the journal's time inside the loop (their share of it: the bookkeeping) and their
transactions. ``--dtypes float64 float32``: each size in each float type (``--dtype``: the floor hand-written in
that type, the run with users' data and per-user computation in it; sums and noise stay float64), interleaved.
``--mlp UxR``: also a torch MLP (784-128-128-10, U users x R records, random features): the clipped sum a
noisy-gd round asks for (the in-process ghost path) against one non-private step, per dtype.
Results: ``simulations/results/bench_round.{json,md}`` (``--out``: elsewhere; the float32 table is
``simulations/results/bench_float32.md``). (It replaces ``bench_prepay.py``, which
also measured the prepaid charges removed in issue 29 §3: ``simulations/results/bench_prepay.md``.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from fedkl.algorithms.gradient.noisy_gd import NoisyGradientDescent
from fedkl.data.synthetic import synthetic_logistic
from fedkl.privacy.journal import ReleaseJournal
from fedkl.privacy.ledger import PrivacyLedger
from fedkl.runner import RunConfig, run_training

D, CLIP, LR = 50, 1.0, 0.5


class Timer:
    """Wraps methods of classes and adds up their wall time."""

    def __init__(self) -> None:
        self.spent: dict[str, list[float]] = {}
        self.returned: dict[str, object] = {}  # the last value each wrapped method returned
        self._saved: list = []

    def wrap(self, cls, name: str, key: str) -> None:
        original = getattr(cls, name)
        spent = self.spent.setdefault(key, [])

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                out = original(*a, **kw)
                self.returned[key] = out
                return out
            finally:
                spent.append(time.perf_counter() - t)

        setattr(cls, name, timed)
        self._saved.append((cls, name, original))

    def restore(self) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)


def floor_round_s(n: int, m: int, rounds: int, seed: int = 0, dtype: str = "float64") -> tuple[float, float]:
    """Seconds per round of the hand-written one-bmm round on an (n, m, D) problem in ``dtype``: the mean over
    the rounds, and the median round (steady state: the first round's one-time costs left out)."""
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    X3 = (torch.randn(n, m, D, generator=gen, dtype=torch.float64) / D**0.5).to(dt)
    y2 = torch.randint(0, 2, (n, m), generator=gen).to(dt) * 2 - 1
    X2, y1 = X3.view(n * m, D), y2.view(n * m)
    w = torch.zeros(D, dtype=dt)
    each = []
    for _ in range(rounds):
        start = time.perf_counter()
        coef = -y1 * torch.sigmoid(-y1 * (X2 @ w))
        grads = torch.bmm(coef.view(n, 1, m), X3).squeeze(1) / m
        norms = torch.linalg.vector_norm(grads, dim=1)
        total = torch.clamp(CLIP / norms.clamp_min(1e-30), max=1.0) @ grads
        w = w - LR * (total + CLIP * torch.randn(D, generator=gen, dtype=dt)) / n
        each.append(time.perf_counter() - start)
    return sum(each) / rounds, statistics.median(each)


def one_run(dataset, rounds: int, tmp: str, dtype: str = "auto") -> dict:
    timer = Timer()
    timer.wrap(PrivacyLedger, "charge", "ledger")
    timer.wrap(ReleaseJournal, "flush", "journal")
    timer.wrap(NoisyGradientDescent, "run", "loop")
    try:
        cfg = RunConfig.from_settings(
            dataset="synthetic-logistic", users=len(dataset.train.user_ids), algorithm="noisy-gd", rounds=rounds,
            epsilon=2.0, lr=LR, clip=CLIP, seed=1, noise_seed=2, reference=False, dtype=dtype,
            out=os.path.join(tmp, f"run-{time.monotonic_ns()}"),
        )  # fmt: skip
        started = time.perf_counter()
        run_training(cfg, log=lambda s: None, dataset=dataset)
        wall = time.perf_counter() - started
        round_s = [rec["seconds"] for rec in timer.returned["loop"].history]  # each round's wall time (RoundLog)
    finally:
        timer.restore()
    s = timer.spent
    return {
        "wall_s": wall,
        "loop_s": sum(s["loop"]),
        "ledger_s": sum(s["ledger"]),
        "ledger_transactions": len(s["ledger"]),
        "journal_s": sum(s["journal"]),
        "journal_flushes": len(s["journal"]),
        "median_round_s": statistics.median(round_s),
    }


def summarize(
    n: int, m: int, rounds: int, floors: list[tuple[float, float]], runs: list[dict], dtype: str = "float64"
) -> dict:
    floor, floor_round = [f[0] for f in floors], [f[1] for f in floors]
    loop = [r["loop_s"] / rounds for r in runs]
    whole = [r["wall_s"] / rounds for r in runs]
    book = [(r["ledger_s"] + r["journal_s"]) / r["loop_s"] for r in runs]
    f_min, f_med = min(floor), statistics.median(floor)
    steady = [r["median_round_s"] for r in runs]
    return {
        "users": n,
        "records": m,
        "dtype": dtype,
        "floor_ms": [1e3 * f_min, 1e3 * f_med],
        "loop_ms": [1e3 * min(loop), 1e3 * statistics.median(loop)],
        "run_ms": [1e3 * min(whole), 1e3 * statistics.median(whole)],
        "loop_over_floor": [min(loop) / f_min, statistics.median(loop) / f_med],
        "run_over_floor": [min(whole) / f_min, statistics.median(whole) / f_med],
        # steady state: the median round of a run against the floor's median round
        "median_round_over_floor": [
            min(steady) / min(floor_round),
            statistics.median(steady) / statistics.median(floor_round),
        ],
        "bookkeeping_share_of_loop": [min(book), statistics.median(book)],
        "ledger_transactions": runs[0]["ledger_transactions"],
        "journal_flushes": runs[0]["journal_flushes"],
        "runs": runs,
    }


def markdown(rows: list[dict], settings: dict) -> str:
    def pair(v, fmt):
        return f"{v[0]:{fmt}} / {v[1]:{fmt}}"

    lines = [
        f"# bench_round: a full round vs the one-bmm floor ({settings['rounds']} rounds, d = {D}, one thread; "
        f"min / median of {settings['repeats']} interleaved repeats)",
        "",
        "| users | train records a user | dtype | floor ms/round | loop ms/round | loop / floor | median round / "
        "floor's | run / floor | bookkeeping share of loop | ledger txns | journal flush calls |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['users']:,} | {r['records']} | {r.get('dtype', 'float64')} | {pair(r['floor_ms'], '.1f')} | "
            f"{pair(r['loop_ms'], '.1f')} | "
            f"{pair(r['loop_over_floor'], '.2f')} | {pair(r['median_round_over_floor'], '.2f')} | "
            f"{pair(r['run_over_floor'], '.2f')} | "
            f"{r['bookkeeping_share_of_loop'][0]:.0%} / {r['bookkeeping_share_of_loop'][1]:.0%} | "
            f"{r['ledger_transactions']} | {r['journal_flushes']} |"
        )
    lines += [
        "",
        "loop: `NoisyGradientDescent.run` (queries, Releaser, ledger, journal) per round; median round / floor's: a "
        "run's median round (each round's wall time as the run's history records it) against the floor's median "
        "round, the steady state without the run's one-time costs (the first flush, first calls); run: "
        "`run_training`'s wall time per round (reserve and verify, the loop, result.json, model.pt; data passed in). "
        "Every release is charged in its own ledger transaction right before its noise is drawn (prepaid charges "
        "were removed: [bench_prepay](bench_prepay.md)). "
        f"Load while measured: {settings['load']}.",
    ]
    if settings.get("command"):
        lines[1:1] = ["", f"Generated by `{settings['command']}`."]
    by = {(r["users"], r["dtype"]): r for r in rows if "dtype" in r}
    ratios = [(n, by[(n, "float32")], r) for (n, dt), r in by.items() if dt == "float64" and (n, "float32") in by]
    if ratios:
        lines += ["", "float32 / float64 (min / median of the repeats):", ""]
        lines += ["| users | floor | loop | run |", "|---|---|---|---|"]
        for n, a, b in ratios:
            lines.append(
                f"| {n:,} | "
                + " | ".join(
                    f"{a[k][0] / b[k][0]:.2f} / {a[k][1] / b[k][1]:.2f}" for k in ("floor_ms", "loop_ms", "run_ms")
                )
                + " |"
            )
    for r in settings.get("mlp_rows", []):
        if r is settings["mlp_rows"][0]:
            lines += [
                "",
                f"Torch MLP (784-128-128-10, {r['shape']} users x records, random features; the in-process clipped "
                "sum of a noisy-gd round, ghost path, and one non-private step; ms, min / median):",
                "",
                "| dtype | clipped sum | non-private step | sum / step |",
                "|---|---|---|---|",
            ]
        lines.append(
            f"| {r['dtype']} | {pair(r['sum_ms'], '.1f')} | {pair(r['step_ms'], '.1f')} | "
            f"{r['sum_ms'][0] / r['step_ms'][0]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def mlp_rows(shape: str, repeats: int) -> list[dict]:
    """The torch MLP per dtype: the clipped sum a noisy-gd round asks the in-process backend for, and one
    non-private step (forward + backward of the mean loss), interleaved, min / median ms."""
    from fedkl.data.base import UserData
    from fedkl.federation.base import ClippedGradient
    from fedkl.federation.inprocess import InProcessFederation
    from fedkl.problems import MLP

    users, records = (int(v) for v in shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    n = users * records
    X = torch.rand(n, 784, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    idx = torch.arange(users).repeat_interleave(records)
    data = UserData(X, y, idx, tuple(f"u{u}" for u in range(users)))

    class _Data:  # what InProcessFederation reads of a dataset
        train = test = data

    times: dict[str, dict[str, list[float]]] = {}
    setups = {}
    for dtype in ("float64", "float32"):
        problem = MLP(784, num_classes=10, hidden=(128, 128), dtype=getattr(torch, dtype))
        fed = InProcessFederation(problem, _Data())
        w = problem.init_params().to(torch.float64)  # the server's iterate (float64 whatever the dtype)
        Xd = X.to(problem.dtype)

        def step(problem=problem, Xd=Xd, w=w):
            params = w.to(problem.dtype).requires_grad_(True)
            torch.nn.functional.cross_entropy(problem._outputs(params, Xd), y).backward()

        def clipped(fed=fed, w=w):
            fed.sum(ClippedGradient(w, CLIP))

        setups[dtype] = (step, clipped)
        step(), clipped()  # warm-up (and the ghost-vs-per-record check, once)
        times[dtype] = {"step": [], "sum": []}
    for _ in range(repeats):
        for dtype, (step, clipped) in setups.items():
            for key, fn in (("step", step), ("sum", clipped)):
                t = time.perf_counter()
                fn()
                times[dtype][key].append(time.perf_counter() - t)
    return [
        {
            "shape": shape,
            "dtype": dtype,
            "sum_ms": [1e3 * min(t["sum"]), 1e3 * statistics.median(t["sum"])],
            "step_ms": [1e3 * min(t["step"]), 1e3 * statistics.median(t["step"])],
        }
        for dtype, t in times.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--records", type=int, nargs="+", default=[100, 100, 25], help="per --users entry (or one for all)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float64"], choices=["float64", "float32"])
    ap.add_argument("--mlp", default=None, help="UxR: also time a torch MLP round per dtype (e.g. 1000x10)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_round"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        records = args.records * len(args.users) if len(args.records) == 1 else args.records
        for n, m_all in zip(args.users, records, strict=True):
            dataset = synthetic_logistic(n_users=n, m=m_all, d=D, seed=0)
            m = dataset.train.num_records // n
            floor = {dt: [] for dt in args.dtypes}
            runs = {dt: [] for dt in args.dtypes}
            for seed in range(args.repeats):  # interleaved: a load change hits the floor and the runs alike
                for dt in args.dtypes:
                    floor[dt].append(floor_round_s(n, m, args.rounds, seed, dt))
                    runs[dt].append(one_run(dataset, args.rounds, tmp, dt))
            for dt in args.dtypes:
                row = summarize(n, m, args.rounds, floor[dt], runs[dt], dt)
                rows.append(row)
                print(
                    f"{n:>7} users {dt}: floor {row['floor_ms'][0]:.1f} ms, loop {row['loop_ms'][0]:.1f} ms "
                    f"({row['loop_over_floor'][0]:.2f}x / median {row['loop_over_floor'][1]:.2f}x), run "
                    f"{row['run_over_floor'][0]:.2f}x; bookkeeping {row['bookkeeping_share_of_loop'][0]:.0%} of the "
                    f"loop; {row['ledger_transactions']} ledger txns, {row['journal_flushes']} journal flushes",
                    flush=True,
                )
            del dataset
    settings = {**vars(args), "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    settings["command"] = "nice -n 10 .venv/bin/python simulations/bench_round.py " + " ".join(sys.argv[1:])
    if args.mlp:
        settings["mlp_rows"] = mlp_rows(args.mlp, max(args.repeats, 3))
        for r in settings["mlp_rows"]:
            print(f"mlp {r['shape']} {r['dtype']}: clipped sum {r['sum_ms'][0]:.1f} ms, step {r['step_ms'][0]:.1f} ms")
    with open(args.out + ".json", "w") as f:
        json.dump({"settings": settings, "rows": rows}, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(rows, settings))
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
