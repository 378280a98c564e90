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


def _write_markdown(study, lines: list[str]) -> str:
    path = study.output("markdown")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is missing (the markdown alone)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save_figure(study, plt, fig) -> str:
    fig.tight_layout()
    figure = study.output("figure")
    fig.savefig(figure, dpi=120)
    plt.close(fig)
    return figure


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
    written = [_write_markdown(study, lines)]
    plt = _pyplot()
    if plt is None:
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
    return written + [_save_figure(study, plt, fig)]


# --- the real-data companion: simulations/studies/p001_sparse_fw_movielens.toml --------------------------
L2_METHODS = ("noisy-gd", "dp-fedavg", "gll-phased-sgd")


def _mean(rows: list[dict], key: str) -> float:
    return float(np.mean([float(r[key]) for r in rows]))


def movielens_report(study) -> list[str]:
    """Every variant's test accuracy and loss per eps (mean ± std over noise seeds), the best variant per
    algorithm, and whether noisy-fw wins; if not, the measured reason (from the table: its rounds, hence its
    non-zero coordinates, against the dense non-private reference)."""
    rows = study.rows
    groups: dict[tuple[float, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((float(r["epsilon_target"]), r["variant"]), []).append(r)
    epsilons = sorted({e for e, _ in groups})
    seeds = sorted({int(r["noise_seed"]) for r in rows})
    (trivial,) = {round(float(r["trivial_metric"]), 12) for r in rows}
    (reference,) = {round(float(r["reference_metric"]), 12) for r in rows}
    (n,) = {int(r["users"]) for r in rows}
    (delta,) = {float(r["delta"]) for r in rows}
    lines = [
        f"# movielens-sparse (n = {n} raters x 20 ratings, d = 2069 one-hot features, logistic): noisy-fw (l1) vs "
        "noisy-gd, dp-fedavg, gll-phased-sgd (l2)",
        "",
        f"User-level replace-one, eps in {epsilons}, delta = {delta:.3g}, noise seeds {seeds}; test accuracy "
        f"(mean ± std) and test loss. Majority class: {trivial:.4f}; non-private reference (unconstrained ERM, "
        f"dense): {reference:.4f}.",
        "Regenerate: `fedkl report simulations/studies/p001_sparse_fw_movielens.toml` (runs: `fedkl sweep`, the "
        "same file).",
        "",
        "| eps | variant | algorithm | rounds | accuracy | loss |",
        "|---|---|---|---|---|---|",
    ]
    best: dict[tuple[float, str], tuple[float, float, str, float, int]] = {}
    for (eps, variant), rs in sorted(groups.items()):
        alg = rs[0]["algorithm"]
        acc = np.array([float(r["test_metric"]) for r in rs])
        loss, rounds = _mean(rs, "test_loss"), int(rs[0]["rounds"])
        lines.append(f"| {eps:g} | {variant} | {alg} | {rounds} | {acc.mean():.4f} ± {acc.std():.4f} | {loss:.4f} |")
        if acc.mean() > best.get((eps, alg), (-1.0,))[0]:
            best[(eps, alg)] = (float(acc.mean()), float(acc.std()), variant, loss, rounds)
    lines += [
        "",
        "Best variant per algorithm:",
        "",
        "| eps | algorithm | variant | accuracy | loss |",
        "|---|---|---|---|---|",
    ]
    for (eps, alg), (acc, std, variant, loss, _) in sorted(best.items()):
        lines.append(f"| {eps:g} | {alg} | {variant} | {acc:.4f} ± {std:.4f} | {loss:.4f} |")
    lines += ["", "## Does noisy-fw win?", ""]
    losses = []
    for eps in epsilons:
        fw = best[(eps, "noisy-fw")]
        rivals = {a: best[(eps, a)] for a in L2_METHODS if (eps, a) in best}
        top, top_v = max(rivals.items(), key=lambda kv: kv[1][0])
        won = fw[0] > top_v[0]
        losses += [] if won else [eps]
        lines.append(
            f"- eps = {eps:g}: noisy-fw {'wins' if won else 'does not win'}: its best accuracy {fw[0]:.4f} ({fw[2]}) "
            f"against {top}'s {top_v[0]:.4f} ({top_v[2]}); majority {trivial:.4f}."
        )
    if losses:
        fw_rows = [r for r in rows if r["algorithm"] == "noisy-fw"]
        gap = (
            max(_mean(rs, "test_metric") for (e, v), rs in groups.items() if rs[0]["algorithm"] == "noisy-fw") - trivial
        )
        theorem_t = sorted({int(r["rounds"]) for r in fw_rows if r.get("fw_rounds", "") == ""})
        lines += [
            "",
            "Measured reason (from the rows above): after T rounds noisy Frank-Wolfe's model is a combination of at "
            f"most T vertices +-r e_j, so it has at most T non-zero coordinates of d = 2069; Thm 9's T is "
            f"{theorem_t} here. Its best variant's mean accuracy is {gap:+.4f} from the majority class. "
            "The rows point to a dense signal, not a sparse one: the unconstrained non-private reference "
            f"(no l1 constraint, all 2069 coordinates free) reaches {reference:.4f}, and the l2 methods, whose noise is spread over all "
            "coordinates, recover part of it. Paper 001's advantage (log d instead of sqrt(d) in the rate) needs a "
            "good predictor inside a small l1 ball; the synthetic family with a 5-sparse w* (p001_sparse_fw.md) "
            "has one, and there noisy-fw wins at n = 4000.",
        ]
        for eps in losses:
            many = groups.get((eps, "noisy-fw r=20 T=100"))
            few = groups.get((eps, "noisy-fw r=20"))
            if many and few:
                lines.append(
                    f"- eps = {eps:g}, r = 20: T = 100 rounds (more coordinates, each selection with a smaller "
                    f"share of the budget) give {_mean(many, 'test_metric'):.4f} against "
                    f"{_mean(few, 'test_metric'):.4f} with T = {few[0]['rounds']}."
                )
    written = [_write_markdown(study, lines)]
    plt = _pyplot()
    if plt is None:
        return written
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for alg in ("noisy-fw", *L2_METHODS):
        es = [e for e in epsilons if (e, alg) in best]
        ax.errorbar(
            es, [best[(e, alg)][0] for e in es], yerr=[best[(e, alg)][1] for e in es], marker="o", capsize=3, label=alg
        )
    ax.axhline(trivial, color="grey", linestyle=":", label="majority")
    ax.axhline(reference, color="black", linestyle="--", label="non-private")
    ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
    ax.set_xlabel("user-level eps")
    ax.set_ylabel("test accuracy (best variant)")
    ax.set_title("movielens-sparse, d = 2069, n = 671")
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    return written + [_save_figure(study, plt, fig)]
