"""How the default step sizes (``--lr``) were chosen: a grid on public benchmark datasets.

    .venv/bin/python simulations/tune_step_sizes.py [--seeds 3] [--quick]

Every algorithm with a step size runs `fedkl run`'s code path (``run_training``) with its default
settings except ``lr`` (the grid GRID) at ε = 2, δ = 1/n^1.1, on the public datasets MovieLens (the
default dataset, `make demo`), adult and tv16, ``--seeds`` noise seeds each. Score of an lr: test
accuracy minus the majority-class baseline, averaged over the seeds and the three datasets. The
default is the best-scoring lr, except that the previous default is kept when it scores within
TOLERANCE of the best (differences that small are within the noise of a few seeds).
The tuning reads the test splits of these public datasets directly, without privacy accounting: it
is a one-off choice of the shipped defaults, not a step of a private run. On your own private data,
tune on public or held-out users (every extra private run is charged to the ledger).

Writes simulations/results/tune_step_sizes.{csv,md}; each algorithm's ``register(...,
step_size=...)`` ships the "chosen" column (tests/algorithms/test_algorithm_registry.py checks it).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile

import torch

from fedkl.runner import RunConfig, run_training

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ALGORITHMS = ("noisy-gd", "dp-sgd", "dp-rmsprop", "dp-adam", "dp-fedavg", "kl-adaptive-gd")
GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 2.0, 4.0, 8.0)
DATASETS = ("movielens", "adult", "tv16")
TOLERANCE = 0.01  # accuracy points: keep the previous default when it scores this close to the best
PREVIOUS = 4.0  # the one default every algorithm had before this tuning (issue 20)


def accuracy_gain(dataset: str, algorithm: str, lr: float, seed: int, tmp: str) -> float:
    """Test accuracy minus the majority-class baseline of one run."""
    cfg = RunConfig.from_settings(
        dataset=dataset, algorithm=algorithm, lr=lr, noise_seed=seed, reference=False, out=tmp, ledger=None
    )
    res = run_training(cfg, log=lambda _: None)
    return res["test_metrics"]["accuracy"] - res["trivial_baseline"]["accuracy"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one seed, three grid values (a smoke run)")
    args = p.parse_args()
    torch.set_num_threads(1)
    grid = (0.1, 1.0, 4.0) if args.quick else GRID
    seeds = range(1 if args.quick else args.seeds)
    rows = []
    for algorithm in ALGORITHMS:
        for lr in grid:
            row = {"algorithm": algorithm, "lr": lr}
            for dataset in DATASETS:
                gains = []
                for seed in seeds:
                    with tempfile.TemporaryDirectory() as tmp:
                        gains.append(accuracy_gain(dataset, algorithm, lr, seed, os.path.join(tmp, "run")))
                row[dataset] = statistics.fmean(gains)
            row["score"] = statistics.fmean(row[d] for d in DATASETS)
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "tune_step_sizes.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"Test accuracy minus the majority-class baseline at eps = 2 (mean over {len(seeds)} noise seed(s)) of the "
        f"chosen default step size; score = the mean over {', '.join(DATASETS)}; the previous default "
        f"{PREVIOUS:g} is kept when it scores within {TOLERANCE} of the best.",
        "",
        f"| algorithm | best lr (score) | previous {PREVIOUS:g} (score) | chosen | {' | '.join(DATASETS)} |",
        "|---|---|---|---|" + "---|" * len(DATASETS),
    ]
    for algorithm in ALGORITHMS:
        mine = [r for r in rows if r["algorithm"] == algorithm]
        best = max(mine, key=lambda r: r["score"])
        previous = next((r for r in mine if r["lr"] == PREVIOUS), None)
        chosen = previous if previous is not None and previous["score"] >= best["score"] - TOLERANCE else best
        cells = " | ".join(f"{chosen[d]:+.4f}" for d in DATASETS)
        prev = f"{previous['score']:+.4f}" if previous else "-"
        lines.append(f"| {algorithm} | {best['lr']:g} ({best['score']:+.4f}) | {prev} | {chosen['lr']:g} | {cells} |")
    with open(os.path.join(RESULTS, "tune_step_sizes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
