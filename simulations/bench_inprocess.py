"""Benchmark: one user-level DP round on the in-process backend vs its floor, at 100 / 1,000 / 10,000 users.

    .venv/bin/python simulations/bench_inprocess.py [--users 100 1000 10000] [--rounds 5]

For each population size it measures, in one run:
  * floor:    the raw tensor work a round needs (per-user gradients of all users + clipping + sum);
  * round:    a full noisy-GD round through the federation interface, the Releaser and the durable
              per-user ledger (one SQLite transaction charging every user);
  * ledger:   the ledger charge alone;
and prints rounds/s, the overhead ratio round/floor and the peak RSS. Results also go to
simulations/results/bench_inprocess.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time

import torch

from fedkl.algorithms.noisy_gd import NoisyGDConfig, NoisyGradientDescent
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation, clip_rows
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.charges import GaussianCharge
from fedkl.problems import make_problem


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench(n_users: int, m: int, d: int, rounds: int) -> dict:
    data = load_dataset("synthetic-logistic", n_users=n_users, m=m, d=d, seed=0)
    problem = make_problem("logistic", data)
    fed = InProcessFederation(problem, data)
    w = torch.zeros(problem.num_params, dtype=problem.dtype)
    train = data.train.to(problem.dtype)

    def floor() -> None:
        clip_rows(problem.per_user_gradients(w, train), 1.0)[0].sum(0)

    floor_s = _best_of(floor, 5)
    with tempfile.TemporaryDirectory() as tmp:
        ledger = PrivacyLedger(os.path.join(tmp, "ledger.sqlite"), Budget(1e6, 1e-5))
        ids = list(fed.user_ids)
        ledger_s = _best_of(lambda: ledger.charge(ids, GaussianCharge(rho=1e-9), label="bench"), 3)
        alg = NoisyGradientDescent(NoisyGDConfig(rounds=rounds, lr=1.0), rho_total=1.0)
        result = alg.run(fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(1.0)), w)
        round_s = statistics.median(h["seconds"] for h in result.history)  # median: skips warm-up
        ledger.close()
    return {
        "users": n_users,
        "records": data.train.num_records,
        "dim": d,
        "floor_s": floor_s,
        "round_s": round_s,
        "ledger_charge_s": ledger_s,
        "rounds_per_s": 1.0 / round_s,
        "overhead_ratio": round_s / floor_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--records", type=int, default=20, help="records per user")
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_inprocess.json"))
    args = p.parse_args(argv)
    rows = []
    print(
        f"{'users':>7} {'records':>9} {'floor ms':>9} {'round ms':>9} {'ledger ms':>10} {'rounds/s':>9} "
        f"{'round/floor':>11} {'peak MB':>8}"
    )
    for n in args.users:
        r = bench(n, args.records, args.dim, args.rounds)
        rows.append(r)
        print(
            f"{r['users']:>7} {r['records']:>9} {1e3 * r['floor_s']:>9.2f} {1e3 * r['round_s']:>9.2f} "
            f"{1e3 * r['ledger_charge_s']:>10.2f} {r['rounds_per_s']:>9.1f} {r['overhead_ratio']:>11.2f} "
            f"{r['peak_rss_mb']:>8.0f}",
            flush=True,
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
