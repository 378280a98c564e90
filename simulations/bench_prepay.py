"""Benchmark: the durable bookkeeping's share of a noisy-GD round, charged per release vs prepaid.

    .venv/bin/python simulations/bench_prepay.py [--users 1000] [--records 20] [--rounds 20] [--repeats 3]

Runs ``fedkl run`` (in-process, logistic regression on synthetic-logistic, one torch thread) twice per
repeat: charged per release (one ledger transaction each, the default) and ``--prepay`` (the whole
plan in one ledger transaction). Both keep the release journal (one WAL commit each, what
``--recover`` needs). It times, inside the run, every ledger write (charges and prepaid batches) and
every journal commit, and reports their share of the run's wall time (min and median over
``--repeats``; the prepaid run's wall time includes its plan, a dry run on a public stand-in). Results go to simulations/results/bench_prepay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from fedkl.privacy.journal import ReleaseJournal
from fedkl.privacy.ledger import PrivacyLedger
from fedkl.runner import RunConfig, run_training


def _timing(cls, name: str, spent: list[float]):
    original = getattr(cls, name)

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            if getattr(a[0], "run_id", None) != "plan":  # not the plan's dry run (a scratch ledger, no fsync)
                spent.append(time.perf_counter() - t)

    setattr(cls, name, timed)
    return original


def one_run(users: int, records: int, rounds: int, prepay: bool, tmp: str) -> dict:
    ledger_t: list[float] = []
    journal_t: list[float] = []
    saved = (_timing(PrivacyLedger, "prepay", ledger_t), _timing(ReleaseJournal, "record", journal_t))
    try:
        cfg = RunConfig.from_settings(
            dataset="synthetic-logistic", users=users, algorithm="noisy-gd", rounds=rounds, epsilon=2.0,
            seed=1, noise_seed=2, reference=False, out=os.path.join(tmp, f"run-{prepay}-{time.monotonic_ns()}"),
        )  # fmt: skip
        started = time.perf_counter()
        run_training(cfg, log=lambda s: None, prepay=prepay)
        wall = time.perf_counter() - started
    finally:
        PrivacyLedger.prepay, ReleaseJournal.record = saved
    return {
        "wall_s": wall,
        "ledger_s": sum(ledger_t),
        "ledger_transactions": len(ledger_t),
        "journal_s": sum(journal_t),
        "journal_commits": len(journal_t),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=1000)
    ap.add_argument("--records", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out: dict = {"settings": vars(args), "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for prepay in (False, True):
            runs = [one_run(args.users, args.records, args.rounds, prepay, tmp) for _ in range(args.repeats)]
            share = [(r["ledger_s"] + r["journal_s"]) / r["wall_s"] for r in runs]
            ledger_share = [r["ledger_s"] / r["wall_s"] for r in runs]
            mode = "prepaid" if prepay else "per-release"
            out["modes"][mode] = {
                "runs": runs,
                "bookkeeping_share_min": min(share),
                "bookkeeping_share_median": statistics.median(share),
                "ledger_share_min": min(ledger_share),
                "ledger_share_median": statistics.median(ledger_share),
            }
            r = runs[0]
            print(
                f"{mode:>12}: ledger {r['ledger_transactions']} transactions, journal {r['journal_commits']} commits; "
                f"ledger share of the run min {min(ledger_share):.1%} median {statistics.median(ledger_share):.1%}; "
                f"ledger + journal min {min(share):.1%} median {statistics.median(share):.1%}"
            )
    path = os.path.join(os.path.dirname(__file__), "results", "bench_prepay.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
