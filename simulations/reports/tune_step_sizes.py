"""Report of simulations/studies/tune_step_sizes.toml: each algorithm's default step size, chosen by
the grid's score (test accuracy minus the majority-class baseline, mean over the noise seeds and the
datasets), keeping the previous default when it scores within the tolerance of the best. Writes the
markdown (its "chosen" column is what each algorithm's ``register(..., step_size=...)`` ships:
tests/test_defaults.py) and the per-(algorithm, lr) summary CSV. Run by
``fedkl report simulations/studies/tune_step_sizes.toml``.

``[report] demo`` (the dataset that ``make demo`` and the README report on): the last column re-derives each
choice by the same rule WITHOUT that dataset (from the same committed runs), so the leak of tuning on the
demo's own test set is measured: where it differs, the shipped default depends on the demo's data
(issue 32, "honest defaults")."""

from __future__ import annotations

import csv
import statistics


def report(study) -> list[str]:
    previous, tolerance = float(study.option("previous")), float(study.option("tolerance"))
    demo = study.option("demo")
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
    others = [d for d in datasets if d != demo]

    def choose(mine: list[dict], score) -> tuple[dict, dict, dict | None]:
        best = max(mine, key=score)
        prev = next((r for r in mine if r["lr"] == previous), None)
        return (prev if prev is not None and score(prev) >= score(best) - tolerance else best), best, prev

    without = f"chosen without {demo} (score)" if demo in datasets else None
    lines = [
        f"Test accuracy minus the majority-class baseline at eps = 2 (mean over {len(seeds)} noise seed(s)) of the "
        f"chosen default step size; score = the mean over {', '.join(datasets)}; the previous default "
        f"{previous:g} is kept when it scores within {tolerance} of the best."
        + (
            f" Last column: the same rule on {', '.join(others)} only (the same runs, without {demo}, the data "
            "`make demo` and the README report on)."
            if without
            else ""
        ),
        "",
        f"| algorithm | best lr (score) | previous {previous:g} (score) | chosen | {' | '.join(datasets)} |"
        + (f" {without} |" if without else ""),
        "|---|---|---|---|" + "---|" * (len(datasets) + bool(without)),
    ]
    for algorithm in algorithms:
        mine = [r for r in rows if r["algorithm"] == algorithm]
        chosen, best, prev = choose(mine, lambda r: r["score"])
        cells = " | ".join(f"{chosen[d]:+.4f}" for d in datasets)
        old = f"{prev['score']:+.4f}" if prev else "-"
        line = f"| {algorithm} | {best['lr']:g} ({best['score']:+.4f}) | {old} | {chosen['lr']:g} | {cells} |"
        if without:

            def held(r: dict) -> float:
                return statistics.fmean(r[d] for d in others)

            alt = choose(mine, held)[0]
            line += f" {alt['lr']:g} ({held(alt):+.4f}) |"
        lines.append(line)
    path = study.output("markdown")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return [path, summary]
