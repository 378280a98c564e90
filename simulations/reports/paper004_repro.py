"""Report of simulations/studies/paper004_repro.toml (paper 004's Section 6 on MNIST / Fashion-MNIST): the
final accuracies, the paper's claim checked cell by cell, the learning-rate grid (and a check that every
other variant runs the grid's choice), the extra seeds, the feature ablation, the longer horizon, the
stock-kernel cross-check, the kernels' timing and one figure of learning curves per (dataset, level), all
from the table and each run's curve in its JSON lines. Run by
``fedkl report simulations/studies/paper004_repro.toml``."""

from __future__ import annotations

import math

import numpy as np

from fedkl.experiments.config import ConfigError
from fedkl.experiments.plot import write_text

DELTA = 1e-5
SIGMAS = (2.0, 4.0, 8.0)
PAPER_LABELS = {2.0: 1.22, 4.0: 0.57, 8.0: 0.28}
OPTIMIZERS = ("sgd", "rmsprop", "adam")
COLORS = {"sgd": "tab:blue", "rmsprop": "tab:orange", "adam": "tab:green"}
NAMES = {"sgd": "DP-SGD", "rmsprop": "DP-RMSProp", "adam": "DP-Adam"}
SHORT = {"mnist": "mnist", "fashion-mnist": "fashion"}
SETTINGS = [("mnist", "record"), ("mnist", "user"), ("fashion", "record"), ("fashion", "user")]


def curve_rows(study, row: dict) -> list[dict]:
    """A run's evaluation points (its curve, from the JSON lines) with the run's settings, as the
    tables below read them."""
    result = study.result(row)
    n, q = int(row["users"]), float(row["sampling_rate"])
    base = {
        "dataset": SHORT[row["dataset"]],
        "level": row["level"],
        "n_units": n,
        "per_user": int(row["per_user"]),
        "optimizer": row["optimizer"],
        "sigma": float(row["sigma"]),
        "noise_multiplier": float(row["noise_multiplier"]),
        "lr": float(row["lr"]),
        "sampling_rate": q,
        "steps_total": int(row["steps"]),
        "epsilon": float(row["epsilon"]),
        "seed": int(row["seed"]),
        "kernel": row.get("kernel") or "ghost",
        "test_eval": int(row.get("test_eval") or 0),
    }
    return [{**base, **point} for point in result["curve"]]


def _by_variant(study) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in study.rows:
        if row["algorithm"] == "paper004-adaptive":
            out.setdefault(row["variant"], []).extend(curve_rows(study, row))
    return out


def check_lrs(runs: dict[str, list[dict]]) -> dict[tuple[str, float], float]:
    """The grid's choice per (optimizer, sigma); refuses a table whose other variants run another lr
    (the choice is written in the study as [[sweep.exclude]] entries)."""
    chosen = choose_lrs(runs["lr grid"])
    for variant, rows in runs.items():
        if variant in ("lr grid", "long"):
            continue
        for r in rows:
            if chosen[(r["optimizer"], r["sigma"])] != r["lr"]:
                raise ConfigError(
                    f"variant {variant!r} runs {r['optimizer']} at sigma {r['sigma']:g} with lr {r['lr']:g}, but the "
                    f"lr grid chooses {chosen[(r['optimizer'], r['sigma'])]:g}: update the study's exclusions"
                )
    return chosen


def report(study) -> list[str]:
    runs = _by_variant(study)
    check_lrs(runs)
    timing = [
        {
            "level": r["level"],
            **{k: float(r[k]) for k in ("stock_s", "ghost_s", "rel_diff")},
            "records": int(r["records"]),
        }
        for r in study.rows
        if r["algorithm"] == "paper004-kernel-timing"
    ]
    grid_rows = [r for r in runs["lr grid"] if r["step"] == r["steps_total"]]
    written = []
    for variant, md, prefix in (("main", "markdown", "figure_"), ("quick", "quick_markdown", "figure_quick_")):
        if variant not in runs or (variant != "main" and not study.option(md)):
            continue
        rows = runs[variant]
        all_rows = {f"{d}_{lv}": [r for r in rows if (r["dataset"], r["level"]) == (d, lv)] for d, lv in SETTINGS}
        all_rows = {k: v for k, v in all_rows.items() if v}
        elapsed = sum(float(r["wall_s"]) for r in study.rows if r["variant"] == variant)
        extras = runs if variant == "main" else None
        text = summarize(variant, all_rows, extras, elapsed, timing if variant == "main" else None, grid_rows)
        written.append(study.output(md))
        write_text(written[-1], text)
        for key, rr in all_rows.items():
            r0 = rr[0]
            written.append(study.output(prefix + key))
            plot(
                rr,
                written[-1],
                f"{r0['dataset']} {r0['level']} level ({r0['n_units']:,} users x {r0['per_user']}), "
                "MLP 784-128-128-10, clip 1, batch 128, delta 1e-5",
            )
    return written


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sigmas = sorted({r["sigma"] for r in rows})
    fig, axes = plt.subplots(1, len(sigmas), figsize=(4.2 * len(sigmas), 3.6), squeeze=False, sharey=True)
    for ax, sigma in zip(axes[0], sigmas):
        sub = [r for r in rows if r["sigma"] == sigma]
        for opt in OPTIMIZERS:
            rr = sorted((r for r in sub if r["optimizer"] == opt), key=lambda r: r["step"])
            if not rr:
                continue
            x = [r["epoch"] for r in rr]
            ax.plot(
                x,
                [r["test_accuracy"] for r in rr],
                "-o",
                ms=3,
                color=COLORS[opt],
                label=f"{NAMES[opt]} (lr {rr[0]['lr']:g}) test",
            )
            ax.plot(x, [r["train_accuracy"] for r in rr], ":", color=COLORS[opt], alpha=0.8)
        eps = sub[0]["epsilon"]
        ax.set_title(
            f"sigma={sigma:g}: eps={eps:.3f} (PLD, T={sub[0]['steps_total']})\n"
            f"paper label at T=46,875: {PAPER_LABELS.get(sigma, float('nan'))}",
            fontsize=9,
        )
        ax.set_xlabel(
            "epochs (expected passes over the " + ("records" if sub[0]["level"] == "record" else "users") + ")"
        )
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("accuracy (solid: test, dotted: train)")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finals(rows: list[dict]) -> dict[tuple[str, float], dict]:
    """(optimizer, sigma) -> the row of the last evaluation point."""
    out: dict[tuple[str, float], dict] = {}
    for r in rows:
        key = (r["optimizer"], r["sigma"])
        if key not in out or r["step"] > out[key]["step"]:
            out[key] = r
    return out


def extras_sections(runs: dict[str, list[dict]]) -> list[str]:
    """Sections from the extra variants: extra seeds of MNIST record level, the fedkl-features ablation,
    the longer horizon, the stock-kernel cross-check."""
    lines: list[str] = []
    record = [r for r in runs["main"] if (r["dataset"], r["level"]) == ("mnist", "record")]
    seed_runs = [record] + [runs[v] for v in sorted(runs) if v.startswith("seed ")]
    if len(seed_runs) > 1:
        per_seed = [finals(rows) for rows in seed_runs]
        seeds = [next(iter(f.values()))["seed"] for f in per_seed]
        lines += [
            "",
            f"## MNIST record level over {len(seeds)} seeds ({', '.join(map(str, seeds))}): final test accuracy, "
            "mean ± std (a seed changes the split order, the initialisation, the sampling and the noise)",
            "",
            "| sigma | DP-SGD | DP-RMSProp | DP-Adam | RMSProp - SGD (paired) | Adam - SGD (paired) |",
            "|---|---|---|---|---|---|",
        ]
        for sigma in SIGMAS:
            if not all(("sgd", sigma) in f for f in per_seed):
                continue
            acc = {o: np.array([f[(o, sigma)]["test_accuracy"] for f in per_seed]) for o in OPTIMIZERS}
            ms = lambda v: f"{v.mean():.4f} ± {v.std(ddof=1):.4f}"  # noqa: E731
            lines.append(
                f"| {sigma:g} | {ms(acc['sgd'])} | {ms(acc['rmsprop'])} | {ms(acc['adam'])} | "
                f"{ms(acc['rmsprop'] - acc['sgd'])} | {ms(acc['adam'] - acc['sgd'])} |"
            )
    if runs.get("fedkl features"):
        fa, fz = finals(runs["fedkl features"]), finals(record)
        lines += [
            "",
            "## Feature ablation, MNIST record level, seed 0: fedkl's unit-norm rows vs the paper's z-score",
            "",
            "| sigma | optimizer | lr | test acc, z-score (default) | test acc, fedkl unit-norm rows |",
            "|---|---|---|---|---|",
        ]
        for (o, sigma), r in sorted(fa.items(), key=lambda kv: (kv[0][1], OPTIMIZERS.index(kv[0][0]))):
            z = fz.get((o, sigma))
            lines.append(
                f"| {sigma:g} | {NAMES[o]} | {r['lr']:g} | {z['test_accuracy']:.4f} | {r['test_accuracy']:.4f} |"
                if z
                else f"| {sigma:g} | {NAMES[o]} | {r['lr']:g} | – | {r['test_accuracy']:.4f} |"
            )
    if runs.get("long"):
        rl = runs["long"]
        r0 = rl[0]
        steps = sorted({r["step"] for r in rl})
        lines += [
            "",
            f"## Longer horizon, MNIST record level: T = {r0['steps_total']} "
            f"({r0['steps_total'] * r0['sampling_rate']:.1f} epochs), constant lr, seed 0 "
            "(variant long)",
        ]
        for sigma in sorted({r["sigma"] for r in rl}):
            sub = [r for r in rl if r["sigma"] == sigma]
            cols = sorted({(r["optimizer"], r["lr"]) for r in sub}, key=lambda c: (OPTIMIZERS.index(c[0]), -c[1]))
            acc = {(r["optimizer"], r["lr"], r["step"]): r for r in sub}
            lines += [
                "",
                f"sigma = {sigma:g}, eps = {sub[0]['epsilon']:.4f} (PLD): test accuracy (train loss)",
                "",
                "| step | epoch | " + " | ".join(f"{NAMES[o]} lr {lr:g}" for o, lr in cols) + " |",
                "|---|---|" + "---|" * len(cols),
            ]
            for st in steps:
                lines.append(
                    f"| {st} | {st * r0['sampling_rate']:.2f} | "
                    + " | ".join(
                        f"{acc[(o, lr, st)]['test_accuracy']:.4f} ({acc[(o, lr, st)]['train_loss']:.3f})"
                        if (o, lr, st) in acc
                        else "–"
                        for o, lr in cols
                    )
                    + " |"
                )
            last = {c: acc[(c[0], c[1], steps[-1])]["test_accuracy"] for c in cols if (c[0], c[1], steps[-1]) in acc}
            sgd = [v for c, v in last.items() if c[0] == "sgd"]
            ada = {c: v for c, v in last.items() if c[0] != "sgd"}
            if sgd and ada:
                lines += [
                    "",
                    f"At step {steps[-1]}: best DP-SGD {max(sgd):.4f}; "
                    + ", ".join(f"{NAMES[c[0]]} {v:.4f} ({v - max(sgd):+.4f})" for c, v in ada.items())
                    + f" -> adaptive methods {'ahead of' if min(ada.values()) > max(sgd) else 'NOT all ahead of'} "
                    "every DP-SGD run.",
                ]
    if runs.get("stock check") and runs.get("ghost check"):
        rs, rg = runs["stock check"], runs["ghost check"]
        key = lambda r: (r["optimizer"], r["sigma"], r["step"])  # noqa: E731
        g = {key(r): r for r in rg}
        pairs = [(r, g[key(r)]) for r in rs if key(r) in g]
        dacc = max(abs(a["test_accuracy"] - b["test_accuracy"]) for a, b in pairs)
        dloss = max(abs(a["train_loss"] - b["train_loss"]) / abs(b["train_loss"]) for a, b in pairs)
        sec = {k: max(r["seconds"] for r in rows) for k, rows in (("stock", rs), ("ghost", rg))}
        lines += [
            "",
            "## Cross-check: fedkl's stock kernel vs ghost clipping (same seeds, MNIST record level)",
            "",
            f"{len({(a['optimizer'], a['sigma']) for a, _ in pairs})} runs of T = {rs[0]['steps_total']} "
            f"steps, {len(pairs)} evaluation points: max |test accuracy difference| = {dacc:.4f}, max relative "
            f"train-loss difference = {dloss:.2e}; the slowest run took {sec['stock']:.0f} s with the stock "
            f"kernel and {sec['ghost']:.1f} s with ghost clipping.",
        ]
    return lines


def summarize(
    variant: str,
    all_rows: dict[str, list[dict]],
    runs: dict[str, list[dict]] | None,
    elapsed: float,
    timing: list[dict] | None,
    grid_rows: list[dict] | None,
) -> str:
    first = next(iter(all_rows.values()))[0] if all_rows else None
    units = {k: (rows[0]["n_units"], rows[0]["per_user"], rows[0]["sampling_rate"]) for k, rows in all_rows.items()}
    unit_txt = "; ".join(f"{k}: {n:,} users x {p} image(s), q = {q:.6g}" for k, (n, p, q) in units.items())
    seed, kernel, features = first["seed"], first["kernel"], "zscore"
    batch = round(first["sampling_rate"] * first["n_units"])
    test_txt = f"{first['test_eval']:,}" if first["test_eval"] else "all 10,000"
    lines = [
        "# Paper 004 reproduction: DP-SGD vs DP-RMSProp vs DP-Adam (MLP 784-128-128-10)",
        "",
        f"Generated by `fedkl report simulations/studies/paper004_repro.toml` (variant {variant}: {elapsed / 60:.1f} min "
        f"of runs on 2 shared CPU cores). Clip 1, delta = {DELTA:g}, "
        f"expected batch/cohort {batch}, Poisson sampling, fixed denominator q n, seed {seed} (one "
        f"seed), features: {features}, gradient kernel: {'fedkl stock' if kernel == 'stock' else 'ghost clipping'}. "
        f"Units: {unit_txt}. Learning rates: lowest final train loss in the study's lr grid.",
        "",
        "epsilon = the fedkl ledger's `max_user_epsilon` for the schedule actually run (dp-accounting PLD, "
        "add/remove, delta = 1e-5; the unit is a user, which at record level is one image). The paper's "
        "labels 1.22 / 0.57 / 0.28 belong to its 46,875-step schedule under the classic RDP conversion "
        "(`paper004_eps.md`); these runs are much shorter, so their epsilon is much smaller.",
        "",
    ]
    if first is not None:
        lines += [
            f"## Final accuracy (last iterate; test = {test_txt} test images)",
            "",
            "| dataset | level | sigma | T (epochs) | eps run (PLD) | lr SGD / RMSProp / Adam | DP-SGD test | "
            "DP-RMSProp test | DP-Adam test | DP-SGD train loss | DP-RMSProp train loss | DP-Adam train loss | best |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    verdicts = []
    for rows in all_rows.values():
        for sigma in sorted({r["sigma"] for r in rows}):
            final, curve = {}, {}
            for opt in OPTIMIZERS:
                rr = sorted((r for r in rows if r["sigma"] == sigma and r["optimizer"] == opt), key=lambda r: r["step"])
                if rr:
                    final[opt] = rr[-1]
                    curve[opt] = float(np.mean([r["test_accuracy"] for r in rr[1:]]))
            r0 = next(iter(final.values()))
            best = max(final, key=lambda o: final[o]["test_accuracy"])
            cell = lambda o, k, f: format(final[o][k], f) if o in final else "–"  # noqa: E731
            lines.append(
                f"| {r0['dataset']} | {r0['level']} | {sigma:g} | {r0['steps_total']} "
                f"({r0['steps_total'] * r0['sampling_rate']:.2f}) | {r0['epsilon']:.4f} | "
                + " / ".join(cell(o, "lr", "g") for o in OPTIMIZERS)
                + " | "
                + " | ".join(cell(o, "test_accuracy", ".4f") for o in OPTIMIZERS)
                + " | "
                + " | ".join(cell(o, "train_loss", ".3f") for o in OPTIMIZERS)
                + f" | {NAMES[best]} |"
            )
            if all(o in final for o in OPTIMIZERS):
                verdicts.append((r0, {o: final[o]["test_accuracy"] for o in OPTIMIZERS}, curve))
    if verdicts:
        lines += [
            "",
            "## The paper's claim, checked on these runs",
            "",
            "Claim (Section 6, Fig. 1): DP-RMSProp and DP-Adam reach better train and test accuracy than "
            "DP-SGD and progress faster, especially at small epsilon (sigma = 8). Columns: final test accuracy "
            "minus DP-SGD's, and the same for the mean test accuracy over the evaluation points after step 0 "
            '("progresses faster"). One seed per cell; the seed spread is measured for MNIST record level in the '
            "section over 3 seeds below (when those runs exist).",
            "",
            "| dataset | level | sigma | RMSProp - SGD (final) | Adam - SGD (final) | RMSProp - SGD (curve mean) "
            "| Adam - SGD (curve mean) | both adaptive >= SGD (final) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r0, f, c in verdicts:
            holds = f["rmsprop"] >= f["sgd"] and f["adam"] >= f["sgd"]
            lines.append(
                f"| {r0['dataset']} | {r0['level']} | {r0['sigma']:g} | {f['rmsprop'] - f['sgd']:+.4f} | "
                f"{f['adam'] - f['sgd']:+.4f} | {c['rmsprop'] - c['sgd']:+.4f} | {c['adam'] - c['sgd']:+.4f} | "
                f"{'yes' if holds else 'no'} |"
            )
        n_hold = sum(f["rmsprop"] >= f["sgd"] and f["adam"] >= f["sgd"] for _, f, _ in verdicts)
        lines += [
            "",
            f"Both adaptive methods at least as accurate as DP-SGD at the end: {n_hold} of {len(verdicts)} "
            "(dataset, level, sigma) cells.",
        ]
    if grid_rows:
        lines += [
            "",
            "## Learning-rate grid (the paper's {0.1, 0.01, 0.001}, lowest final train loss wins)",
            "",
            "| dataset | level | sigma | optimizer | lr | T | final train loss | final test acc |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in grid_rows:
            lines.append(
                f"| {r['dataset']} | {r['level']} | {float(r['sigma']):g} | {NAMES[r['optimizer']]} | "
                f"{float(r['lr']):g} | {r['steps_total']} | {float(r['train_loss']):.4f} | "
                f"{float(r['test_accuracy']):.4f} |"
            )
    if runs is not None:
        lines += extras_sections(runs)
    lines += [
        "",
        "## Cut or changed relative to the paper",
        "",
        f"* Horizon: T = {first['steps_total'] if first else '?'} steps per run instead of 46,875 (100 epochs); "
        "the paper's x0.1 lr decay at epochs 30/60/90 is never reached (constant lr); see the longer-horizon "
        "section for T = 4,000 at MNIST record level."
        if first
        else "",
        "* Seeds: 1 (paper: 5); extra seeds only for MNIST record level, T = 400.",
        "* LR grid {0.1, 0.01, 0.001} run once, on MNIST record level at T = 400, per sigma; its choice is reused "
        "for Fashion-MNIST and for the user level (paper: tuned per setting over 100 epochs).",
        "* Fashion-MNIST replaces the paper's second task (probably CIFAR-10/ResNet, not in the text, not "
        "available offline); same MLP.",
        "* Optimizers are torch's semantics (bias-corrected Adam, RMSprop alpha 0.99, eps 1e-8, no cap), i.e. "
        "what pyvacy + torch.optim ran, not the paper's Algorithm 1 (no bias correction, cap lambda).",
        "* The epsilons are PLD epsilons of the schedules actually run, not the paper's labels (which are "
        "classic-RDP epsilons of 46,875 steps).",
        "* Train metrics on a fixed 10,000-image training subsample; the last iterate is evaluated.",
    ]
    if timing:
        lines += [
            "",
            "## Gradient kernel timing (one round: clipped per-user gradient sum of 128 sampled users)",
            "",
            "| level | records in the round | fedkl stock (s) | ghost clipping (s) | speed-up | max rel. diff of the sums |",
            "|---|---|---|---|---|---|",
        ]
        for r in timing:
            lines.append(
                f"| {r['level']} | {r['records']} | {r['stock_s']:.3f} | {r['ghost_s']:.4f} | "
                f"{r['stock_s'] / r['ghost_s']:.0f}x | {r['rel_diff']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def choose_lrs(grid_rows: list[dict]) -> dict[tuple[str, float], float]:
    """The paper's rule: per (optimizer, sigma) the lr of the grid with the lowest final training loss
    (a diverged run, non-finite loss, never wins)."""
    best: dict[tuple[str, float], tuple[float, float]] = {}
    for r in grid_rows:
        loss = float(r["train_loss"])
        loss = loss if math.isfinite(loss) else math.inf
        key = (r["optimizer"], float(r["sigma"]))
        if key not in best or loss < best[key][0]:
            best[key] = (loss, float(r["lr"]))
    return {k: v[1] for k, v in best.items()}
