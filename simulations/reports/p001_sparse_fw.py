"""Report of simulations/studies/p001_sparse_fw.toml: noisy-fw (l1) vs noisy-gd (l2) on the sparse
logistic family, every grid point's test accuracy (mean ± std over seeds) and each algorithm's best
setting per n, with a figure of the best settings against n. Run by
``fedkl report simulations/studies/p001_sparse_fw.toml``."""

from __future__ import annotations

import numpy as np

# the hyperparameters each method's grid sweeps (simulations/plugins/p001_sparse_fw.py), in label order
SETTING = {"noisy-fw": ("fw_radius", "fw_clamp"), "noisy-gd": ("rounds", "lr", "clip")}
D, SPARSITY, RECORDS = 2000, 5, 4


def _setting(row: dict) -> str:
    return ", ".join(f"{k}={float(row[k]):g}" for k in SETTING[row["method"]])


def report(study) -> list[str]:
    summary: dict[tuple[int, str, str], list[dict]] = {}
    for r in study.rows:
        summary.setdefault((int(r["users"]), r["method"], _setting(r)), []).append(r)
    (eps,) = {float(r["epsilon_target"]) for r in study.rows}
    seeds = sorted({int(r["seed"]) for r in study.rows})
    lines = [
        f"# Sparse logistic (d = {D}, {SPARSITY}-sparse w*, m = {RECORDS}): noisy-fw (l1) vs noisy-gd (l2)",
        "",
        f"User-level replace-one, eps = {eps}, delta = 1/n^1.1, seeds {seeds}; test accuracy mean ± std.",
        "Regenerate: `fedkl report simulations/studies/p001_sparse_fw.toml` (runs: `fedkl sweep`, the same file).",
        "",
        "| n | algorithm | setting | accuracy | loss | trivial |",
        "|---|---|---|---|---|---|",
    ]
    best: dict[tuple[int, str], tuple[float, str, float]] = {}
    for (n, alg, setting), rs in sorted(summary.items()):
        acc = np.array([float(r["test_metric"]) for r in rs])
        loss = np.mean([float(r["test_loss"]) for r in rs])
        trivial = float(rs[0]["trivial_metric"])
        lines.append(f"| {n} | {alg} | {setting} | {acc.mean():.4f} ± {acc.std():.4f} | {loss:.4f} | {trivial:.4f} |")
        if acc.mean() > best.get((n, alg), (-1, None))[0]:
            best[(n, alg)] = (acc.mean(), setting, acc.std())
    lines += ["", "Best setting per algorithm:", "", "| n | algorithm | setting | accuracy |", "|---|---|---|---|"]
    for (n, alg), (acc, setting, std) in sorted(best.items()):
        lines.append(f"| {n} | {alg} | {setting} | {acc:.4f} ± {std:.4f} |")
    path = study.output("markdown")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    written = [path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    ns = sorted({n for n, _ in best})
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for alg in SETTING:
        ys = [best[(n, alg)][0] for n in ns]
        es = [best[(n, alg)][2] for n in ns]
        ax.errorbar(ns, ys, yerr=es, marker="o", capsize=3, label=f"{alg} (best setting)")
    ax.set_xscale("log")
    ax.set_xlabel("users n")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"sparse logistic, d = {D}, eps = {eps}")
    ax.legend()
    fig.tight_layout()
    figure = study.output("figure")
    fig.savefig(figure, dpi=120)
    plt.close(fig)
    return written + [figure]
