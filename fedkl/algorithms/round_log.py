"""One round-based run's public progress: the per-round record every such algorithm reports, its
history (the result's ``history``) and the progress callback (the runner's ``round t/T`` lines and
the run observer).

A record is ``{"round": t, "rounds": T, **fields, "failed_users": failed, "seconds": s, **extra}``:
``fields`` in the order given (norms of released values, rho spent, the round's public shape),
``failed_users`` only where the algorithm counts them, ``seconds`` since ``start`` (the round's
wall time), ``extra`` (a release's own details) last. Every value but those of :data:`NOT_PUBLIC` is
public or computed from releases (``seconds`` and ``failed_users`` are, like result.json's ``wall_time_s``
and ``failures``, what the server sees: not private releases): the records are handed out as the run's progress and written next to result.json as the run's
per-round metrics (``metrics.jsonl``, ``metrics.csv``, ``curves.png``: :func:`fedkl.results.write_round_metrics`).
"""

from __future__ import annotations

import time
from typing import Callable

# a record's fields that are NOT public: ``sampled``, the realised size of a secret Poisson sample (dp-sgd/
# rmsprop/adam, dp-fedavg: amplification by sampling needs the sample secret, which is why their released sums
# divide by the public q n). Kept in the in-process history (tests read it), never written to a run's files.
NOT_PUBLIC = frozenset({"sampled"})


def public_history(history: list[dict] | None) -> list[dict]:
    """``history`` without the :data:`NOT_PUBLIC` fields: what a run may write to its files."""
    return [{k: v for k, v in rec.items() if k not in NOT_PUBLIC} for rec in history or ()]


class RoundLog:
    """``rounds``: the public number of rounds (the records' ``rounds``); ``progress``: called with
    every record as soon as it is made (None: nobody listens)."""

    def __init__(self, rounds: int, progress: Callable[[dict], None] | None = None) -> None:
        self.rounds = rounds
        self.progress = progress
        self.history: list[dict] = []

    def round(self, t: int, start: float, failed: int | None = None, /, *, extra: dict | None = None, **fields) -> dict:
        """Record round ``t`` (started at ``time.perf_counter()`` value ``start``; ``failed``: the
        users whose answer failed), append it to :attr:`history`, pass it to ``progress``, and return
        it. Positional-only, so that a field may be named ``t`` or ``start``."""
        record = {"round": t, "rounds": self.rounds, **fields}
        if failed is not None:
            record["failed_users"] = failed
        record["seconds"] = time.perf_counter() - start
        record.update(extra or {})
        self.history.append(record)
        if self.progress is not None:
            self.progress(record)
        return record
