"""Paper 001's use case: a sparse high-dimensional logistic model (d >> n), noisy Frank–Wolfe over an
l1 ball (``noisy-fw``) against noisy GD (``noisy-gd``, l2) at equal user-level (eps, delta).

    .venv/bin/python simulations/p001_sparse_fw.py            # about 15 min on 2 shared cores
    .venv/bin/python simulations/p001_sparse_fw.py --quick    # a smoke run

Writes ``simulations/results/p001_sparse_fw.{csv,md,png}``.

Data (drawn here, seeded): d = 2000 features, a 5-sparse ``w*`` with entries +-40 (so <w*, x> has std
~ 2 for x ~ N(0, I/d), projected onto the unit ball by ``fedkl.from_arrays``), labels ~ Bernoulli(
sigmoid(<w*, x>)), m = 4 records per user, n users, 20% of each user's records held out. Both
algorithms run through ``fedkl.train`` (the ledger, the releaser, replace-one, eps = 2,
delta = 1/n^1.1). Each algorithm's public hyperparameters are swept over a small grid (tuning is
not private: the table reports every point, and "best" is the best mean over seeds) ---
noisy-fw: l1 radius r and l_inf clamp G (rounds: Thm 9's T); noisy-gd: rounds, lr and clip.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import time

import numpy as np

import fedkl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "simulations", "results")
D, SPARSITY, SCALE, RECORDS = 2000, 5, 40.0, 4
EPS = 2.0
GRIDS = {
    "noisy-fw": [{"fw_radius": r, "fw_clamp": c} for r, c in itertools.product((10.0, 30.0), (0.05, 1.0))],
    "noisy-gd": [
        {"rounds": t, "lr": lr, "clip": c} for t, lr, c in itertools.product((10, 30), (1.0, 4.0), (0.1, 1.0))
    ],
}


def sparse_logistic(n: int, seed: int) -> fedkl.FederatedDataset:
    rng = np.random.default_rng(seed)
    w = np.zeros(D)
    support = rng.choice(D, SPARSITY, replace=False)
    w[support] = SCALE * rng.choice([-1.0, 1.0], SPARSITY)
    X = rng.standard_normal((n * RECORDS, D)) / math.sqrt(D)
    p = 1.0 / (1.0 + np.exp(-(X @ w)))
    y = np.where(rng.random(len(p)) < p, 1.0, -1.0)
    users = np.repeat(np.arange(n), RECORDS)
    return fedkl.from_arrays(X, y, users, split_seed=seed, name=f"sparse-logistic-{n}-{seed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seed, n = 250 only")
    args = ap.parse_args()
    ns, seeds = ((250,), (0,)) if args.quick else ((250, 1000, 4000), (0, 1))
    rows = []
    start = time.time()
    for n in ns:
        for seed in seeds:
            ds = sparse_logistic(n, seed)
            for alg, grid in GRIDS.items():
                for point in grid:
                    out = fedkl.train(ds, alg, epsilon=EPS, noise_seed=seed, log=None, **point)
                    rows.append(
                        {
                            "n": n,
                            "seed": seed,
                            "algorithm": alg,
                            "setting": ", ".join(f"{k}={v:g}" for k, v in point.items()),
                            "epsilon": out.epsilon,
                            "delta": out.delta,
                            "accuracy": out.metrics["accuracy"],
                            "loss": out.metrics["loss"],
                            "trivial": out.baseline["accuracy"],
                        }
                    )
            print(f"n={n} seed={seed} done ({time.time() - start:.0f} s)", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    with open(os.path.join(RESULTS, f"p001_sparse_fw{suffix}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = {}
    for r in rows:
        summary.setdefault((r["n"], r["algorithm"], r["setting"]), []).append(r)
    lines = [
        f"# Sparse logistic (d = {D}, {SPARSITY}-sparse w*, m = {RECORDS}): noisy-fw (l1) vs noisy-gd (l2)",
        "",
        f"User-level replace-one, eps = {EPS}, delta = 1/n^1.1, seeds {list(seeds)}; test accuracy mean ± std.",
        "Regenerate: `.venv/bin/python simulations/p001_sparse_fw.py`.",
        "",
        "| n | algorithm | setting | accuracy | loss | trivial |",
        "|---|---|---|---|---|---|",
    ]
    best = {}
    for (n, alg, setting), rs in sorted(summary.items()):
        acc = np.array([r["accuracy"] for r in rs])
        loss = np.mean([r["loss"] for r in rs])
        lines.append(
            f"| {n} | {alg} | {setting} | {acc.mean():.4f} ± {acc.std():.4f} | {loss:.4f} | {rs[0]['trivial']:.4f} |"
        )
        if acc.mean() > best.get((n, alg), (-1, None))[0]:
            best[(n, alg)] = (acc.mean(), setting, acc.std())
    lines += ["", "Best setting per algorithm:", "", "| n | algorithm | setting | accuracy |", "|---|---|---|---|"]
    for (n, alg), (acc, setting, std) in sorted(best.items()):
        lines.append(f"| {n} | {alg} | {setting} | {acc:.4f} ± {std:.4f} |")
    with open(os.path.join(RESULTS, f"p001_sparse_fw{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for alg in GRIDS:
        xs = [n for n in ns]
        ys = [best[(n, alg)][0] for n in ns]
        es = [best[(n, alg)][2] for n in ns]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=f"{alg} (best setting)")
    ax.set_xscale("log")
    ax.set_xlabel("users n")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"sparse logistic, d = {D}, eps = {EPS}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"p001_sparse_fw{suffix}.png"), dpi=120)


if __name__ == "__main__":
    main()
