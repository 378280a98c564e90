"""Benchmark: one user-level DP round on the in-process backend vs the true floor, at 100 / 1,000 / 10,000 users.

    .venv/bin/python simulations/bench_inprocess.py [--users 100 1000 10000] [--records 20] [--rounds 5]

For each population size (logistic regression, ``records`` per user, one torch thread) it measures, in
one run, the per-user clipped gradient sum of a round (per-user gradients of all users + norms + clip
+ sum), min and median of ``--repeats`` (>= 3) timings each:
  * bmm:          the true floor: one ``X @ w``, ``torch.sigmoid``, ONE batched matmul for the per-user
                  sums, ``torch.linalg.vector_norm``, clip, sum (hand-written for this problem);
  * vmap:         ``torch.func.vmap(torch.func.grad(loss))`` over users (records inside each user's loss);
  * fast:         fedkl's kernels in ``--kernels fast`` mode (:func:`fedkl.problems.rowwise.kernels`; what
                  the default ``--kernels auto`` runs in-process);
  * reproducible: fedkl's batch-invariant kernels (bit for bit what a Flower client computes; the Flower default);
and the full noisy-GD round through the federation interface, the Releaser and the durable ledger in
each mode (median over ``--rounds`` rounds), plus the ledger charge alone (one SQLite transaction). It
prints ratios to the bmm floor and the peak RSS; results also go to simulations/results/bench_inprocess.json.
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

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation, clip_rows
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.charges import GaussianCharge
from fedkl.problems import make_problem
from fedkl.problems.rowwise import kernels


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(min, median) seconds of ``repeats`` calls (one warm-up call first)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def _clip_sum(grads: torch.Tensor, clip: float) -> torch.Tensor:
    norms = torch.linalg.vector_norm(grads, dim=1, keepdim=True)
    return torch.where(norms > clip, grads * (clip / norms.clamp_min(1e-300)), grads).sum(0)


def bench(n_users: int, m: int, d: int, rounds: int, repeats: int) -> dict:
    data = load_dataset("synthetic-logistic", n_users=n_users, m=m, d=d, seed=0)
    problem = make_problem("logistic", data)
    fed = InProcessFederation(problem, data)
    w = 0.1 * torch.ones(problem.num_params, dtype=problem.dtype)
    train = data.train.to(problem.dtype)
    counts = train.counts()
    m = int(counts[0])  # training records per user (the split keeps a share of each user's for test)
    if not bool((counts == m).all()) or bool((train.user_index[1:] < train.user_index[:-1]).any()):
        raise ValueError("the bmm floor needs records grouped by user, m per user")
    X3, y2 = train.X.view(n_users, m, -1), train.y.view(n_users, m)

    def floor_bmm() -> torch.Tensor:
        coef = -train.y * torch.sigmoid(-train.y * (train.X @ w))
        grads = torch.bmm(coef.view(n_users, 1, m), X3).squeeze(1) / m
        return _clip_sum(grads, 1.0)

    def user_loss(v: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(-y * (X @ v)).mean()

    per_user_grad = torch.func.vmap(torch.func.grad(user_loss), in_dims=(None, 0, 0))

    def vmap_grad() -> torch.Tensor:
        return _clip_sum(per_user_grad(w, X3, y2), 1.0)

    def fedkl_kernels(mode: str):
        def run() -> torch.Tensor:
            with kernels(mode):
                return clip_rows(problem.per_user_gradients(w, train), 1.0)[0].sum(0)

        return run

    row = {"users": n_users, "records": train.num_records, "dim": d, "repeats": repeats}
    reference = floor_bmm()
    for name, fn in (
        ("bmm", floor_bmm),
        ("vmap", vmap_grad),
        ("fast", fedkl_kernels("fast")),
        ("reproducible", fedkl_kernels("reproducible")),
    ):
        assert torch.allclose(fn(), reference, rtol=1e-9, atol=1e-12), name  # the same quantity
        row[f"{name}_min_s"], row[f"{name}_median_s"] = _timed(fn, repeats)
    with tempfile.TemporaryDirectory() as tmp:
        ledger = PrivacyLedger(os.path.join(tmp, "ledger.sqlite"), Budget(1e6, 1e-5))
        ids = list(fed.user_ids)
        row["ledger_charge_min_s"], row["ledger_charge_median_s"] = _timed(
            lambda: ledger.charge(ids, GaussianCharge(rho=1e-9), label="bench"), repeats
        )
        for mode in ("fast", "reproducible"):
            alg = NoisyGradientDescent(NoisyGDParams(rounds=rounds, lr=1.0), BuildContext.fresh(rho=1.0))
            with kernels(mode):
                result = alg.run(fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(1.0)), w)
            row[f"round_{mode}_median_s"] = statistics.median(h["seconds"] for h in result.history)
        ledger.close()
    floor = row["bmm_min_s"]
    for name in ("vmap", "fast", "reproducible"):
        row[f"{name}_over_bmm"] = row[f"{name}_min_s"] / floor
    for mode in ("fast", "reproducible"):
        row[f"round_{mode}_over_bmm"] = row[f"round_{mode}_median_s"] / floor
    row["ledger_share_of_fast_round"] = row["ledger_charge_median_s"] / row["round_fast_median_s"]
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--records", type=int, default=20, help="records per user")
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="timings per kernel (>= 3); min and median reported")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_inprocess.json"))
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error("--repeats must be >= 3")
    torch.set_num_threads(1)
    rows = []
    print(
        "per-user clipped gradient sum, ms min/median (ratio of min to the bmm floor); full round median ms "
        "(ratio to the bmm floor); ledger charge median ms"
    )
    for n in args.users:
        r = bench(n, args.records, args.dim, args.rounds, args.repeats)
        rows.append(r)
        cells = [f"users {r['users']}, records {r['records']}:"]
        for name in ("bmm", "vmap", "fast", "reproducible"):
            ratio = "" if name == "bmm" else f" ({r[f'{name}_over_bmm']:.2f}x)"
            cells.append(f"{name} {1e3 * r[f'{name}_min_s']:.2f}/{1e3 * r[f'{name}_median_s']:.2f}{ratio}")
        for mode in ("fast", "reproducible"):
            cells.append(f"round[{mode}] {1e3 * r[f'round_{mode}_median_s']:.2f} ({r[f'round_{mode}_over_bmm']:.2f}x)")
        cells.append(f"ledger {1e3 * r['ledger_charge_median_s']:.2f}")
        cells.append(f"peak {r['peak_rss_mb']:.0f} MB")
        print("; ".join(cells), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
