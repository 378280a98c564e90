"""Report of simulations/studies/tune_private_vs_oracle.toml: test accuracy minus the majority-class
baseline of ``tune`` (private search, the total epsilon), ``defaults`` and ``oracle`` (test-set selection,
its training epsilon only) per dataset and total epsilon; mean over the seeds of the table."""

from __future__ import annotations

import statistics

METHODS = ("tune", "defaults", "oracle")


def report(study) -> list[str]:
    cells: dict[tuple[str, float, str], list[float]] = {}
    settings: dict[tuple[str, float, str], list[str]] = {}
    for r in study.rows:
        key = (r["dataset"], float(r["epsilon"]), r["method"])
        cells.setdefault(key, []).append(float(r["test_metric"]) - float(r["trivial_metric"]))
        settings.setdefault(key, []).append(r["settings"])
    seeds = sorted({r["seed"] for r in study.rows})
    combos = sorted({(d, e) for d, e, _ in cells})
    lines = [
        f"Test accuracy minus the majority-class baseline (mean over {len(seeds)} seed(s): {', '.join(seeds)}), "
        "noisy-gd, grid lr in {0.3, 1, 4}. `tune`: `fedkl tune` (E[K] = 3) whose whole search costs the total "
        "epsilon; `defaults`: the shipped lr = 4 at that epsilon; `oracle`: the grid point with the best TEST "
        "accuracy, whose epsilon counts its training only (the selection is not private and not paid for).",
        "",
        "| dataset | total eps | tune | defaults | oracle (training eps only) | tune picked | oracle picked |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, e in combos:
        val = {m: statistics.fmean(cells[d, e, m]) if (d, e, m) in cells else float("nan") for m in METHODS}
        lines.append(
            f"| {d} | {e:g} | {val['tune']:+.4f} | {val['defaults']:+.4f} | {val['oracle']:+.4f} | "
            f"{'; '.join(settings.get((d, e, 'tune'), []))} | {'; '.join(settings.get((d, e, 'oracle'), []))} |"
        )
    md = study.output("markdown")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    width = 0.26
    for i, m in enumerate(METHODS):
        ys = [statistics.fmean(cells.get((d, e, m), [float("nan")])) for d, e in combos]
        ax.bar([j + (i - 1) * width for j in range(len(combos))], ys, width, label=m)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(combos)), [f"{d}\neps={e:g}" for d, e in combos])
    ax.set_ylabel("test acc. - baseline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = study.output("plot")
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return [md, png]
