"""Report of simulations/studies/tune_step_sizes.toml: each algorithm's default step size, chosen by
the grid's score (test accuracy minus the majority-class baseline, mean over the noise seeds and the
datasets), keeping the previous default when it scores within the tolerance of the best. Writes the
markdown (its "chosen" column is what each algorithm's ``register(..., step_size=...)`` ships:
tests/test_defaults.py) and the per-(algorithm, lr) summary CSV. Run by
``fedkl report simulations/studies/tune_step_sizes.toml``."""

from __future__ import annotations

import csv
import statistics


def report(study) -> list[str]:
    previous, tolerance = float(study.option("previous")), float(study.option("tolerance"))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in study.rows))
    datasets = list(dict.fromkeys(r["dataset"] for r in study.rows))
    gains: dict[tuple[str, float, str], list[float]] = {}
    for r in study.rows:
        key = (r["algorithm"], float(r["lr"]), r["dataset"])
        gains.setdefault(key, []).append(float(r["test_metric"]) - float(r["trivial_metric"]))
    seeds = {r["noise_seed"] for r in study.rows}
    rows = []
    for algorithm in algorithms:
        for lr in sorted({k[1] for k in gains if k[0] == algorithm}):
            if not all((algorithm, lr, d) in gains for d in datasets):
                raise ValueError(f"{study.table}: {algorithm} lr={lr:g} has no run on some of {', '.join(datasets)}")
            row = {"algorithm": algorithm, "lr": lr, **{d: statistics.fmean(gains[algorithm, lr, d]) for d in datasets}}
            row["score"] = statistics.fmean(row[d] for d in datasets)
            rows.append(row)
    summary = study.output("summary")
    with open(summary, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [
        f"Test accuracy minus the majority-class baseline at eps = 2 (mean over {len(seeds)} noise seed(s)) of the "
        f"chosen default step size; score = the mean over {', '.join(datasets)}; the previous default "
        f"{previous:g} is kept when it scores within {tolerance} of the best.",
        "",
        f"| algorithm | best lr (score) | previous {previous:g} (score) | chosen | {' | '.join(datasets)} |",
        "|---|---|---|---|" + "---|" * len(datasets),
    ]
    for algorithm in algorithms:
        mine = [r for r in rows if r["algorithm"] == algorithm]
        best = max(mine, key=lambda r: r["score"])
        prev = next((r for r in mine if r["lr"] == previous), None)
        chosen = prev if prev is not None and prev["score"] >= best["score"] - tolerance else best
        cells = " | ".join(f"{chosen[d]:+.4f}" for d in datasets)
        old = f"{prev['score']:+.4f}" if prev else "-"
        lines.append(f"| {algorithm} | {best['lr']:g} ({best['score']:+.4f}) | {old} | {chosen['lr']:g} | {cells} |")
    path = study.output("markdown")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return [path, summary]
