"""What every audit writes: the per-run statistics file (resumable), the report and the histogram,
and the verdict words."""

from __future__ import annotations

import json
import math
import os
from typing import Callable

import numpy as np

VIOLATION, CONSISTENT, REFUSED, FAILED = "VIOLATION", "consistent with claim", "refused", "failed"


def noise_seed(seed: int, world: int, run: int) -> int:
    """The privacy-noise seed of run ``run`` on ``world``: distinct and independent across runs."""
    return int(np.random.SeedSequence([seed, world, run]).generate_state(1, np.uint64)[0] >> 1)


class Statistics:
    """``statistics.jsonl`` of an output folder: one JSON line per finished run, keyed by
    (world, run); its first line records the audit's settings, and a folder written with other
    settings is refused rather than mixed."""

    def __init__(self, out: str, header: dict) -> None:
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, "statistics.jsonl")
        self.done: dict[tuple[int, int], float] = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            if lines and lines[0].get("header") != header:
                raise ValueError(
                    f"{self.path} holds an audit with other settings ({lines[0].get('header')}); "
                    "use another --out or delete it"
                )
            for rec in lines[1:]:
                self.done[(rec["world"], rec["run"])] = math.nan if rec["stat"] is None else rec["stat"]
        else:
            with open(self.path, "w") as f:
                f.write(json.dumps({"header": header}) + "\n")

    def add(self, world: int, run: int, stat: float) -> None:
        self.done[(world, run)] = stat
        with open(self.path, "a") as f:
            f.write(json.dumps({"world": world, "run": run, "stat": None if math.isnan(stat) else stat}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def audited_settings(cfg) -> dict:
    """The audited runs' ``fedkl run`` settings, less those the audit sets itself (data, paths)."""
    skip = ("dataset", "users", "out", "ledger", "noise_seed", "reference")
    return {k: v for k, v in cfg.settings().items() if k not in skip}


def verdict(lower: float, claimed: float) -> str:
    return VIOLATION if lower > claimed else CONSISTENT


def refused(out: str, report: dict, reason: str, log: Callable[[str], None], verdict: str = REFUSED) -> dict:
    report.update(verdict=verdict, reason=reason, epsilon_lower_bound=None)
    what = "refused the audit setting" if verdict == REFUSED else "FAILED (an error in the algorithm)"
    log(f"{report['algorithm']}: {what}: {reason}")
    write_report(out, report)
    return report


def write_report(out: str, report: dict) -> None:
    with open(os.path.join(out, "audit.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)


def histogram(path: str, samples: dict[str, np.ndarray], xlabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    finite = [s[np.isfinite(s)] for s in samples.values()]
    allv = np.concatenate(finite) if finite else np.zeros(0)
    bins = np.histogram_bin_edges(allv, bins=40) if allv.size else 10
    for (label, s), f in zip(samples.items(), finite):
        bottoms = int(np.isnan(s).sum())
        ax.hist(f, bins=bins, alpha=0.5, label=label + (f" (⊥: {bottoms})" if bottoms else ""))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
