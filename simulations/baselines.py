"""Baselines at the same user-level (ε, δ): the utility benchmark, from Python.

    .venv/bin/python simulations/baselines.py [--quick] [--resume] [--config simulations/configs/utility.toml]

The benchmark is the sweep file ``simulations/configs/utility.toml``: fedkl's best algorithm on
each convex real dataset, the DP-FedAvg baseline (``dp-fedavg``) and Flower 1.41's own
``DifferentialPrivacyServerSideFixedClipping`` (``flower-dp-fixed``, from
``simulations/flower_dp_baseline.py``; noise calibrated to its real user-level ε). They run at
ε ∈ {0.5, 1, 2, 4, 8}, δ = 1/n^1.1, replace-one, on MovieLens, TV16 and Adult, with 5 seeds. Every run
also records the non-private reference (the exact minimizer of the same objective) and the
majority-class baseline. This script does what these two commands do (``make bench`` runs the commands):

    fedkl sweep simulations/configs/utility.toml --restart
    fedkl plot simulations/results/utility.csv --kind privacy-utility \\
        --out simulations/results/utility.png --markdown simulations/results/utility.md

``--quick``: seeds 0-1 and ε ∈ {1, 4}, into ``simulations/results/quick/``. ``--resume``: keep the
rows already in the table (default: start over).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedkl import experiments  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join("simulations", "configs", "utility.toml")
QUICK_SETS = ("seed=0,1", "epsilon=1,4")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--quick", action="store_true", help="seeds 0-1, eps 1 and 4, into simulations/results/quick/")
    p.add_argument("--resume", action="store_true", help="keep the rows already in the table")
    args = p.parse_args(argv)
    os.chdir(ROOT)  # the config's paths (table, plugins) are relative to the repository root
    spec = experiments.load_sweep(args.config)
    if args.quick:
        table = os.path.join(os.path.dirname(spec.table), "quick", os.path.basename(spec.table))
        spec = experiments.load_sweep(args.config, table=table, sets=QUICK_SETS)
    experiments.run_sweep(spec, restart=not args.resume)
    stem = os.path.splitext(spec.table)[0]
    summary = experiments.plot_table(spec.table, "privacy-utility", stem + ".png", markdown=stem + ".md")
    print(f"wrote {stem}.png and {stem}.md")
    return summary


if __name__ == "__main__":
    main()
