"""sc-output-pert with Delta chosen privately (``--p002-delta-select sparse-vector``) against the fixed
union-bound Delta_uc and DP-FedAvg, on fertility-partition (the paper's random-partition model on
real records), at equal user-level (eps, delta = 1/n^1.1), replace-one, reg = 0.1.

Settings are those of simulations/paper002_crossover.py (its ``load`` and ``settings_for``: Delta_uc,
the tight calibration; DP-FedAvg's validation-tuned setting: 10 rounds, 5 local steps, local lr 4 at
eps 4 and 1 at eps 8).
The sc-output-pert rows use the study's "tight" noise except the last, which adds fedkl's default
"profile" calibration. Writes simulations/results/paper002_delta_selection.{csv,md}.

    OMP_NUM_THREADS=1 .venv/bin/python simulations/paper002_delta_selection.py        (~3 min)
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling study's loaders

from paper002_crossover import REG, load, settings_for  # noqa: E402

import fedkl  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
VARIANTS = (
    ("sc-output-pert, Delta_uc", "sc-output-pert", {}),
    ("sc-output-pert, Delta by sparse vector", "sc-output-pert", {"p002_delta_select": "sparse-vector"}),
    (
        "sc-output-pert, Delta by sparse vector, profile noise",
        "sc-output-pert",
        {"p002_delta_select": "sparse-vector", "p002_calibration": "profile"},
    ),
    ("dp-fedavg (tuned)", "dp-fedavg", {"rounds": 10, "local_steps": 5}),
)
# DP-FedAvg's local lr: the crossover study's validation-tuned choice on fertility-partition, per eps
FEDAVG_LOCAL_LR = {4.0: 4.0, 8.0: 1.0}


def run(ms, epsilons, seeds, log=print) -> list[dict]:
    rows = []
    for m in ms:
        for seed in seeds:
            ds = load("fertility-partition", 1000, m, seed)
            n = len(ds.train.user_ids)
            delta = 1.0 / n**1.1
            for eps in epsilons:
                for label, algorithm, extra in VARIANTS:
                    settings = dict(extra)
                    if algorithm == "dp-fedavg":
                        settings["local_lr"] = FEDAVG_LOCAL_LR[eps]
                    if algorithm == "sc-output-pert":  # the study's settings (tight noise), then the variant's
                        settings = {**settings_for(algorithm, m, n, eps, delta, {}), **extra, "force": True}
                    r = fedkl.train(
                        ds,
                        algorithm=algorithm,
                        epsilon=eps,
                        delta=delta,
                        noise_seed=seed,
                        seed=seed,
                        log=None,
                        reg=REG,
                        out=tempfile.mkdtemp(prefix="p002-dsel-"),
                        **settings,
                    )
                    d = r.result["algorithm_details"]
                    diag = d.get("nonprivate_diagnostics") or {}
                    rows.append(
                        {
                            "m": m,
                            "epsilon": eps,
                            "seed": seed,
                            "variant": label,
                            "test_loss": None if r.model is None else r.metrics["loss"],
                            "test_accuracy": None if r.model is None else r.metrics["accuracy"],
                            "epsilon_spent": r.epsilon,
                            "Delta": d.get("Delta"),
                            "sigma": d.get("sigma"),
                            "deletions": diag.get("dist"),
                            "scores": diag.get("nonprivate_scores"),
                        }
                    )
                    log(f"m={m} eps={eps} seed={seed} {label}: loss {rows[-1]['test_loss']}, Delta {rows[-1]['Delta']}")
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "# sc-output-pert with a privately chosen Delta (fertility-partition, n = 1000)",
        "",
        "Regenerate: `OMP_NUM_THREADS=1 .venv/bin/python simulations/paper002_delta_selection.py`. Mean over "
        "seeds of the test objective (per-user mean log-loss + reg/2 ||w||^2 on held-out records; lower is "
        "better; evaluation only, not private), the Delta the release used and its noise sigma per coordinate.",
        "",
        "| m | eps | variant | test loss | Delta | sigma | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["m"], r["epsilon"], r["variant"]) for r in rows},
        key=lambda k: (k[0], k[1], [v[0] for v in VARIANTS].index(k[2])),
    )
    for m, eps, variant in keys:
        group = [r for r in rows if (r["m"], r["epsilon"], r["variant"]) == (m, eps, variant)]
        losses = [r["test_loss"] for r in group if r["test_loss"] is not None]
        deltas = [r["Delta"] for r in group if r["Delta"] is not None]
        sigmas = [r["sigma"] for r in group if r["sigma"] is not None]
        fmt = lambda xs: f"{statistics.mean(xs):.4g}" if xs else "-"  # noqa: E731
        lines.append(f"| {m} | {eps:g} | {variant} | {fmt(losses)} | {fmt(deltas)} | {fmt(sigmas)} | {len(group)} |")
    lines += [
        "",
        "Reading: the sparse vector picks the smallest grid Delta whose diameter-test deletion score is "
        "near zero: 2-4x below Delta_uc here (Delta_uc/4 in most runs), cutting sigma 2-3x (the selection's share of eps "
        "costs back 4/3). It is not the measured deletion jump (~1/80 of Delta_uc, "
        "paper002_crossover.md): the diameter test certifies a deletion only through the users' local "
        "minimizers' diameter, a factor (L/mu)^2 = 12 above the jump for logistic loss at reg 0.1. "
        "The whole-release profile calibration (fedkl's default) cuts sigma by a further ~2.6x at the same "
        "Delta. DP-FedAvg, within 1e-4 of the non-private objective at these m, still wins.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="m = 64, eps = 8, one seed")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    rows = run((64,), (8.0,), (0,)) if args.quick else run((64, 254), (4.0, 8.0), (0, 1, 2))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "paper002_delta_selection.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "paper002_delta_selection.md"), "w") as f:
        f.write(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
