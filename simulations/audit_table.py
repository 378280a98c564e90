"""The audit benchmark: per registered algorithm and claimed eps in {1, 4, 8}, the empirical user-level
lower bounds of ``fedkl audit`` against the claim, written to simulations/results/audit.md.

    PYTHONPATH=. OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python simulations/audit_table.py [--runs 100] [--canaries 200]

* many-run: ``--runs`` trainings on each dataset of the outlier pair (41 users, delta = 1/n^1.1),
  skipped for an algorithm whose one run takes longer than ``--max-seconds`` (the table says so);
* one-run: one training with ``--canaries`` canary users (+40 ordinary ones) at delta = 1e-5
  (the one-run bound pays 2 m delta, so it needs delta well below 1/m);
* one-shot: Andrew et al.'s estimate (no confidence level) from ``--canaries``/2 random-direction canaries.

Each bound is one-sided at 95% confidence; "most" is the largest bound that audit could show
(error-free guesses): a claim above it cannot be refuted by that audit. Resumable: the per-run
statistics live under runs/audit_table/ and are reused by a rerun. A refusal (the algorithm's own
check of the small setting) is printed with its reason, never replaced by another setting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from fedkl.algorithms.catalog import ALGORITHMS
from fedkl.audit import many_run_audit, one_run_audit, one_shot_estimate
from fedkl.audit.release import audit_config, released_model
from fedkl.audit.settings import small_settings
from fedkl.audit.worlds import neighbour_pair

HERE = os.path.dirname(os.path.abspath(__file__))
EPSILONS = (1.0, 4.0, 8.0)


def _seconds_per_run(algorithm: str, eps: float) -> float | str:
    """One run's time on the many-run pair (its refusal message when it refuses)."""
    cfg = audit_config(algorithm, eps, small_settings(algorithm))
    _, d1 = neighbour_pair()
    try:
        released_model(cfg, d1, 0)  # the first run pays one-off set-up (e.g. a cached noise calibration)
        start = time.time()
        released_model(cfg, d1, 1)
    except ValueError as e:
        return str(e)
    except Exception as e:  # an algorithm's crash: reported in the table
        return f"FAILED: {type(e).__name__}: {e}"
    return time.time() - start


def _cell(report: dict | None, note: str = "") -> str:
    if report is None:
        return note
    if report["verdict"] in ("refused", "failed"):
        return report["verdict"].replace("failed", "FAILED")
    flag = " **VIOLATION**" if report["verdict"] == "VIOLATION" else ""
    return f"{report['epsilon_lower_bound']:.2f} (most {report['largest_attainable_bound']:.2f}){flag}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100, help="many-run: trainings per dataset (default 100)")
    ap.add_argument("--canaries", type=int, default=200, help="one-run: canary users (default 200)")
    ap.add_argument("--max-seconds", type=float, default=0.5, help="many-run only for runs faster than this")
    ap.add_argument("--algorithms", default=None, help="comma-separated subset (default: every registered one)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "audit.md"))
    ap.add_argument("--work", default=os.path.join("runs", "audit_table"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = ALGORITHMS if args.algorithms is None else tuple(args.algorithms.split(","))
    quiet = lambda s: None  # noqa: E731
    started = time.time()
    rows, notes = [], []
    for name in names:
        for eps in EPSILONS:
            tag = f"{name} eps={eps:g}"
            speed = _seconds_per_run(name, eps)
            many, note = None, ""
            if isinstance(speed, str):
                note = "FAILED" if speed.startswith("FAILED") else "refused"
                notes.append(f"- {tag}, many-run: {note}: {speed.removeprefix('FAILED: ')}")
            elif speed > args.max_seconds:
                note = f"skipped ({speed:.1f} s/run)"
            else:
                many = many_run_audit(
                    name, eps, os.path.join(args.work, name, f"eps{eps:g}", "many"), runs=args.runs, log=quiet
                )
            one = one_run_audit(
                name,
                eps,
                os.path.join(args.work, name, f"eps{eps:g}", "one"),
                canaries=args.canaries,
                guesses=args.canaries // 10,
                settings={"delta": 1e-5},
                log=quiet,
            )
            shot = one_shot_estimate(
                name,
                eps,
                os.path.join(args.work, name, f"eps{eps:g}", "shot"),
                canaries=args.canaries // 2,
                settings={"delta": 1e-5},
                log=quiet,
            )
            shot_cell = (
                f"{shot['epsilon_estimate']:.2f}"
                if "epsilon_estimate" in shot and shot["epsilon_estimate"] == shot["epsilon_estimate"]
                else ("⊥" if "epsilon_estimate" in shot else _cell(shot))
            )
            if shot["verdict"] in ("refused", "failed"):
                notes.append(f"- {tag}, one-shot: {_cell(shot)}: {shot['reason']}")
            elif shot_cell == "⊥":
                notes.append(f"- {tag}, one-shot: the algorithm released ⊥ (no model): no estimate")
            if one["verdict"] in ("refused", "failed"):
                notes.append(f"- {tag}, one-run: {_cell(one)}: {one['reason']}")
            elif one.get("bottom_output"):
                notes.append(f"- {tag}, one-run: the algorithm released ⊥ (no model): the audit abstains")
            if many is not None and many["bottom_outputs"] != [0, 0]:
                notes.append(f"- {tag}, many-run: ⊥ in {many['bottom_outputs']} of the runs (D0, D1)")
            rows.append((name, eps, _cell(many, note), _cell(one), shot_cell))
            print(f"[{time.time() - started:5.0f} s] {tag}: " + "; ".join(rows[-1][2:]), flush=True)
    lines = [
        "# Empirical user-level privacy audit (`fedkl audit`)",
        "",
        f"Generated by `python simulations/audit_table.py --runs {args.runs} --canaries {args.canaries}` "
        f"in {time.time() - started:.0f} s. Every number is an empirical LOWER bound on the user-level eps "
        "at 95% one-sided confidence (a correct algorithm exceeds its claim with probability <= 5%); "
        '"most" is the largest bound that audit could show, so a claim above it is not tested by it. '
        f"many-run: {args.runs} trainings on each of two datasets differing in one outlier user (41 users, "
        f"delta = 1/41^1.1); one-run: one training with {args.canaries} canary users + 40 others, delta = 1e-5. "
        f"one-shot: Andrew et al. 2023's ESTIMATE (no confidence level, not a bound) from {args.canaries // 2} "
        "random-direction canary users, delta = 1e-5. "
        "Settings: fedkl/audit/settings.py (reg 0.1, clip 0.1, radius 5); noise seeds fixed.",
        "",
        "| algorithm | claimed eps | many-run lower bound | one-run lower bound | one-shot estimate |",
        "|---|---|---|---|---|",
        *[f"| {n} | {e:g} | {m} | {o} | {x} |" for n, e, m, o, x in rows],
        "",
        *(["Notes:", "", *notes, ""] if notes else []),
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
