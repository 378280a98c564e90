"""Baselines at the same user-level (ε, δ): non-private training, DP-FedAvg and fedkl's algorithms.

    .venv/bin/python simulations/baselines.py [--quick] [--algorithms noisy-gd[,dp-adam,...]]
        [--datasets movielens,tv16,adult] [--eps 0.5,1,2,4,8] [--seeds 5] [--neighbouring add-remove]
        [--out-dir simulations/results]

For every convex real dataset (MovieLens by rater, TV16 by state, Adult by native country when its
loader is installed), every ε and every seed (seed s = the per-user train/test split seed s and the
noise seed 1000 + s), with δ = 1/n^1.1:

* ``nonprivate``: the exact minimizer of the same logistic objective (L-BFGS, at most 100
  iterations; NOT private; the accuracy a private model is measured against);
* ``dp-fedavg``: :mod:`fedkl.algorithms.dp_fedavg` (TFF's DP-FedAvg recipe: clipped model deltas
  after local steps, Poisson user sampling, fixed denominator, PLD accounting);
* every algorithm of ``--algorithms`` (default ``noisy-gd``, with ``fedkl run``'s defaults).

All private runs go through ``fedkl.runner.run_training`` (ledger, accountant, noise; ``reference``
off), each under a temporary folder. Relation: ``--neighbouring`` (default add-remove, the relation
of TFF's DP-FedAvg and of Poisson amplification; with replace-one DP-FedAvg runs with q = 1).

Hyperparameters (fixed for every ε, chosen once by a small NON-PRIVATE exploration on seeds 0-1 at
ε ∈ {0.5, 2, 8}, see FEDAVG below; the non-private tuning is not accounted): DP-FedAvg clip 1,
5 local full-batch steps at local lr 2, server lr 1 with momentum 0.5; MovieLens q = 0.3 for 30
rounds, TV16 and Adult (41-51 users) q = 1 for 20 rounds. ``noisy-gd`` keeps ``fedkl run``'s
defaults (10 rounds, lr 4, clip 1).

Writes ``<out-dir>/baseline_results.csv`` (one row per run), ``baseline_table.md`` (test accuracy
mean ± std over seeds) and ``baseline_accuracy.png``. ``--quick``: TV16 only, ε ∈ {0.5, 2},
2 seeds, fewer rounds (about a minute). Set ``torch`` to one thread: the tensors are small and the
machine is shared (two threads are 10x slower under load).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace

if __package__ in (None, ""):  # run as a script: make `fedkl` and `simulations` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import fedkl.runner as runner  # noqa: E402
from fedkl.algorithms.dp_fedavg import build_dp_fedavg  # noqa: E402
from fedkl.algorithms.nonprivate import nonprivate_minimizer  # noqa: E402
from fedkl.data import load_dataset  # noqa: E402
from fedkl.federation.inprocess import InProcessFederation  # noqa: E402
from fedkl.problems import make_problem  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DATASETS = ("movielens", "tv16", "adult")
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)

# DP-FedAvg settings per dataset (see the module docstring for how they were chosen)
_FEDAVG_COMMON = {"clip": 1.0, "local_steps": 5, "local_lr": 2.0, "server_lr": 1.0, "server_momentum": 0.5}
FEDAVG = {
    "movielens": {**_FEDAVG_COMMON, "sampling_rate": 0.3, "rounds": 30},
    "tv16": {**_FEDAVG_COMMON, "sampling_rate": 1.0, "rounds": 20},
    "adult": {**_FEDAVG_COMMON, "sampling_rate": 1.0, "rounds": 20},
}
# fedkl's own algorithms: the run configuration overrides (empty = `fedkl run`'s defaults)
SETTINGS = {
    "noisy-gd": {},
    "dp-sgd": {"rounds": 30, "lr": 4.0, "sampling_rate": 0.3},
    "dp-rmsprop": {"rounds": 30, "lr": 0.05, "sampling_rate": 0.3},
    "dp-adam": {"rounds": 30, "lr": 0.05, "sampling_rate": 0.3},
}


@dataclass(frozen=True)
class FedAvgRunConfig(runner.RunConfig):
    """``RunConfig`` plus the DP-FedAvg fields that ``build_dp_fedavg`` reads with ``getattr``."""

    local_steps: int = 5
    local_lr: float | None = None
    batch_size: int | None = None
    server_lr: float = 1.0
    server_momentum: float = 0.0


def register_dp_fedavg() -> None:
    """Make ``run_training`` know ``dp-fedavg`` (an (eps, delta) schedule: no zCDP filter).

    A shim until ``fedkl/runner.py`` registers the builder itself; idempotent."""
    if "dp-fedavg" not in runner.ALGORITHM_BUILDERS:
        runner.ALGORITHM_BUILDERS["dp-fedavg"] = build_dp_fedavg
    runner.ALGORITHMS = tuple(runner.ALGORITHM_BUILDERS)
    if "dp-fedavg" not in runner.APPROX_DP_ALGORITHMS:
        runner.APPROX_DP_ALGORITHMS = tuple(runner.APPROX_DP_ALGORITHMS) + ("dp-fedavg",)


def available_datasets(names: list[str]) -> list[str]:
    """The names whose loader works here (Adult is being added by another change)."""
    out = []
    for name in names:
        try:
            load_dataset(name, split_seed=0)
            out.append(name)
        except Exception as exc:  # noqa: BLE001 - a missing loader/data file: skip, say so
            print(f"skipping {name}: {type(exc).__name__}: {exc}", flush=True)
    return out


def nonprivate_row(dataset: str, seed: int, max_iter: int) -> dict:
    start = time.perf_counter()
    ds = load_dataset(dataset, split_seed=seed)
    problem = make_problem("logistic", ds)
    w = nonprivate_minimizer(problem, ds.train, max_iter=max_iter)
    test = InProcessFederation(problem, ds).evaluate(w, "test")
    trivial = problem.trivial_metrics(ds.train, ds.test)
    return {"dataset": dataset, "users": ds.train.num_users, "algorithm": "nonprivate", "epsilon_target": math.inf,
            "epsilon": math.inf, "delta": 0.0, "seed": seed, "accuracy": test["accuracy"], "loss": test["loss"],
            "majority": trivial["accuracy"], "rounds": max_iter, "noise_multiplier": 0.0, "sigma_sum": 0.0,
            "sampling_rate": 1.0, "wall_s": time.perf_counter() - start}


def private_row(algorithm: str, dataset: str, eps: float, seed: int, tmp: str, neighbouring: str,
                quick: bool) -> dict:
    if algorithm == "dp-fedavg":
        overrides = dict(FEDAVG[dataset])
        if neighbouring == "replace-one":
            overrides["sampling_rate"] = 1.0  # Poisson amplification is accounted under add-remove only
    else:
        overrides = dict(SETTINGS.get(algorithm, {}))
        if algorithm.startswith("dp-") and neighbouring == "replace-one":
            overrides["sampling_rate"] = 1.0
    if quick:
        overrides["rounds"] = max(3, overrides.get("rounds", runner.RunConfig.rounds) // 3)
    cfg = FedAvgRunConfig(dataset=dataset, algorithm=algorithm, epsilon=eps, seed=seed, noise_seed=1000 + seed,
                          neighbouring=neighbouring, reference=False,
                          out=os.path.join(tmp, f"{algorithm}-{dataset}-{eps:g}-{seed}"), **overrides)
    start = time.perf_counter()
    res = runner.run_training(cfg, log=lambda s: None)
    details = res.get("algorithm_details") or {}
    return {"dataset": dataset, "users": res["users"], "algorithm": algorithm, "epsilon_target": eps,
            "epsilon": res["epsilon"], "delta": res["delta"], "seed": seed,
            "accuracy": res["test_metrics"].get("accuracy"), "loss": res["test_metrics"].get("loss"),
            "majority": res["trivial_baseline"].get("accuracy"), "rounds": res["rounds"],
            "noise_multiplier": details.get("noise_multiplier", ""), "sigma_sum": res.get("sigma_sum"),
            "sampling_rate": details.get("sampling_rate", 1.0), "wall_s": time.perf_counter() - start}


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def write_outputs(rows: list[dict], out_dir: str, algorithms: list[str], epsilons: list[float],
                  neighbouring: str, note: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"baseline_{k}") for k in ("results.csv", "table.md", "accuracy.png")}
    with open(paths["results.csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))

    def cell(ds: str, alg: str, eps: float | None) -> tuple[float, float, int] | None:
        vals = [r["accuracy"] for r in rows if r["dataset"] == ds and r["algorithm"] == alg
                and (eps is None or r["epsilon_target"] == eps) and r["accuracy"] is not None]
        return (*_mean_std(vals), len(vals)) if vals else None

    lines = [f"# Baselines: test accuracy at user-level (ε, δ = 1/n^1.1), {neighbouring}", "",
             "Mean ± std over seeds (seed = split seed and noise seed). Non-private = exact minimizer of the same "
             "logistic objective (not private). Majority = majority-class predictor. Metrics are not private "
             "(evaluation only).", "", note, ""]
    header = "| dataset (users) | algorithm | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |"
    lines += [header, "|" + "---|" * (2 + len(epsilons))]
    for ds in datasets:
        users = next(r["users"] for r in rows if r["dataset"] == ds)
        for alg in algorithms:
            cells = []
            for e in epsilons:
                c = cell(ds, alg, e)
                cells.append(f"{c[0]:.4f} ± {c[1]:.4f}" if c else "—")
            lines.append(f"| {ds} ({users}) | {alg} | " + " | ".join(cells) + " |")
        np_cell = cell(ds, "nonprivate", None)
        maj = statistics.fmean(r["majority"] for r in rows if r["dataset"] == ds)
        if np_cell:
            lines.append(f"| {ds} ({users}) | non-private | " + " | ".join([f"{np_cell[0]:.4f} ± {np_cell[1]:.4f}"]
                                                                          * len(epsilons)) + " |")
        lines.append(f"| {ds} ({users}) | majority class | " + " | ".join([f"{maj:.4f}"] * len(epsilons)) + " |")
    charged = [r["epsilon"] / r["epsilon_target"] for r in rows if r["algorithm"] != "nonprivate"]
    if charged:
        lines += ["", f"Charged ε / target ε over all private runs: min {min(charged):.4f}, max {max(charged):.4f} "
                  "(the ledger's per-user ε; never above the target)."]
    with open(paths["table.md"], "w") as f:
        f.write("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for alg in algorithms:
            pts = [(e, cell(ds, alg, e)) for e in epsilons]
            pts = [(e, c) for e, c in pts if c]
            if pts:
                ax.errorbar([e for e, _ in pts], [c[0] for _, c in pts], yerr=[c[1] for _, c in pts],
                            marker="o", capsize=3, label=alg)
        np_cell = cell(ds, "nonprivate", None)
        if np_cell:
            ax.axhline(np_cell[0], color="k", ls="--", lw=1, label="non-private")
        ax.axhline(statistics.fmean(r["majority"] for r in rows if r["dataset"] == ds), color="grey", ls=":",
                   lw=1, label="majority")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("user-level ε")
        ax.set_title(ds)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["accuracy.png"], dpi=120)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> dict[str, str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="TV16, ε 0.5 and 2, 2 seeds, fewer rounds (~1 minute)")
    p.add_argument("--algorithms", default="noisy-gd", help="fedkl algorithms besides dp-fedavg (comma list)")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--eps", default=",".join(f"{e:g}" for e in EPSILONS))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--neighbouring", default="add-remove", choices=("add-remove", "replace-one"))
    p.add_argument("--out-dir", default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    register_dp_fedavg()
    algorithms = ["dp-fedavg"] + [a for a in args.algorithms.split(",") if a and a != "dp-fedavg"]
    unknown = [a for a in algorithms if a not in runner.ALGORITHM_BUILDERS]
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {unknown}; available: {', '.join(runner.ALGORITHM_BUILDERS)}")
    datasets = ["tv16"] if args.quick else available_datasets(args.datasets.split(","))
    epsilons = [0.5, 2.0] if args.quick else [float(e) for e in args.eps.split(",")]
    seeds = 2 if args.quick else args.seeds
    started = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for ds in datasets:
            for seed in range(seeds):
                rows.append(nonprivate_row(ds, seed, 30 if args.quick else 100))
                for eps in epsilons:
                    for alg in algorithms:
                        r = private_row(alg, ds, eps, seed, tmp, args.neighbouring, args.quick)
                        rows.append(r)
                        print(f"{ds:>9} eps {eps:<4g} seed {seed} {alg:>10}: accuracy {r['accuracy']:.4f} "
                              f"(charged eps {r['epsilon']:.4f}, {r['wall_s']:.1f} s)", flush=True)
    note = (f"{'QUICK run (fewer rounds, 2 seeds). ' if args.quick else ''}DP-FedAvg: {FEDAVG}. "
            f"Other algorithms: {{{', '.join(f'{a}: {SETTINGS.get(a, {})}' for a in algorithms[1:])}}} "
            f"(empty = fedkl run defaults). Wall time {time.perf_counter() - started:.0f} s.")
    paths = write_outputs(rows, args.out_dir, algorithms, epsilons, args.neighbouring, note)
    print("wrote " + ", ".join(paths.values()))
    return paths


if __name__ == "__main__":
    main()
