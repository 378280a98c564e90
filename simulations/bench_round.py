"""Benchmark: a full ``fedkl run`` round against the one-bmm floor, and the durable bookkeeping's share.

    nice -n 15 .venv/bin/python simulations/bench_round.py [--users 1000 10000 100000] [--records 100 100 25]
        [--rounds 10] [--repeats 3]

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
transactions. Results: ``simulations/results/bench_round.{json,md}``. (It replaces ``bench_prepay.py``, which
also measured the prepaid charges removed in issue 29 §3: ``simulations/results/bench_prepay.md``.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def floor_round_s(n: int, m: int, rounds: int, seed: int = 0) -> tuple[float, float]:
    """Seconds per round of the hand-written one-bmm round on an (n, m, D) float64 problem: the mean over
    the rounds, and the median round (steady state: the first round's one-time costs left out)."""
    gen = torch.Generator().manual_seed(seed)
    X3 = torch.randn(n, m, D, generator=gen, dtype=torch.float64) / D**0.5
    y2 = torch.randint(0, 2, (n, m), generator=gen).to(torch.float64) * 2 - 1
    X2, y1 = X3.view(n * m, D), y2.view(n * m)
    w = torch.zeros(D, dtype=torch.float64)
    each = []
    for _ in range(rounds):
        start = time.perf_counter()
        coef = -y1 * torch.sigmoid(-y1 * (X2 @ w))
        grads = torch.bmm(coef.view(n, 1, m), X3).squeeze(1) / m
        norms = torch.linalg.vector_norm(grads, dim=1)
        total = torch.clamp(CLIP / norms.clamp_min(1e-30), max=1.0) @ grads
        w = w - LR * (total + CLIP * torch.randn(D, generator=gen, dtype=torch.float64)) / n
        each.append(time.perf_counter() - start)
    return sum(each) / rounds, statistics.median(each)


def one_run(dataset, rounds: int, tmp: str) -> dict:
    timer = Timer()
    timer.wrap(PrivacyLedger, "charge", "ledger")
    timer.wrap(ReleaseJournal, "flush", "journal")
    timer.wrap(NoisyGradientDescent, "run", "loop")
    try:
        cfg = RunConfig.from_settings(
            dataset="synthetic-logistic", users=len(dataset.train.user_ids), algorithm="noisy-gd", rounds=rounds,
            epsilon=2.0, lr=LR, clip=CLIP, seed=1, noise_seed=2, reference=False,
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


def summarize(n: int, m: int, rounds: int, floors: list[tuple[float, float]], runs: list[dict]) -> dict:
    floor, floor_round = [f[0] for f in floors], [f[1] for f in floors]
    loop = [r["loop_s"] / rounds for r in runs]
    whole = [r["wall_s"] / rounds for r in runs]
    book = [(r["ledger_s"] + r["journal_s"]) / r["loop_s"] for r in runs]
    f_min, f_med = min(floor), statistics.median(floor)
    steady = [r["median_round_s"] for r in runs]
    return {
        "users": n,
        "records": m,
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
        "| users | train records a user | floor ms/round | loop ms/round | loop / floor | median round / floor's "
        "| run / floor | bookkeeping share of loop | ledger txns | journal flush calls |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['users']:,} | {r['records']} | {pair(r['floor_ms'], '.1f')} | {pair(r['loop_ms'], '.1f')} | "
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
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--records", type=int, nargs="+", default=[100, 100, 25], help="per --users entry (or one for all)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_round"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        records = args.records * len(args.users) if len(args.records) == 1 else args.records
        for n, m_all in zip(args.users, records, strict=True):
            dataset = synthetic_logistic(n_users=n, m=m_all, d=D, seed=0)
            m = dataset.train.num_records // n
            floor, runs = [], []
            for seed in range(args.repeats):  # interleaved: a load change hits the floor and the runs alike
                floor.append(floor_round_s(n, m, args.rounds, seed))
                runs.append(one_run(dataset, args.rounds, tmp))
            row = summarize(n, m, args.rounds, floor, runs)
            rows.append(row)
            print(
                f"{n:>7} users: floor {row['floor_ms'][0]:.1f} ms, loop {row['loop_ms'][0]:.1f} ms "
                f"({row['loop_over_floor'][0]:.2f}x / median {row['loop_over_floor'][1]:.2f}x), run "
                f"{row['run_over_floor'][0]:.2f}x; bookkeeping {row['bookkeeping_share_of_loop'][0]:.0%} of the "
                f"loop; {row['ledger_transactions']} ledger txns, {row['journal_flushes']} journal flushes",
                flush=True,
            )
            del dataset
    settings = {**vars(args), "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    with open(args.out + ".json", "w") as f:
        json.dump({"settings": settings, "rows": rows}, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(rows, settings))
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
