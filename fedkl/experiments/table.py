"""Result tables: the columns of a sweep's CSV table, one row per run, and appending that survives
an interruption (every row and JSON line is flushed and fsynced before the next run starts).

Metrics in the tables are computed on held-out records for evaluation only: they are NOT private.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fedkl.experiments.config import ConfigError
from fedkl.experiments.runners import resolved_settings

BASE_COLUMNS = (
    "run_key",
    "status",
    "algorithm",
    "dataset",
    "users",
    "neighbouring",
    "seed",
    "noise_seed",
    "epsilon_target",
    "epsilon",
    "delta",
    "metric",
    "test_metric",
    "test_loss",
    "reference_metric",
    "reference_loss",
    "excess_loss",
    "trivial_metric",
    "rounds",
    "sigma_sum",
    "noise_multiplier",
    "wall_s",
    "error",
)


IDENTITY_COLUMNS = frozenset(
    ("algorithm", "dataset", "users", "neighbouring", "seed", "noise_seed", "epsilon_target", "rounds")
)
OUTCOME_COLUMNS = frozenset(BASE_COLUMNS) - IDENTITY_COLUMNS
"""What a run measured; every other column is part of what identifies it (its configuration)."""


def check_unique(rows: Sequence[Mapping[str, str]], table: str) -> None:
    """Refuse a table in which two ``ok`` rows are the same run: the same ``run_key``, or the same
    value in every configuration column (e.g. rows of a sweep appended again after its keys changed).
    A summary would silently average them (``n = 7`` instead of 5)."""
    seen: dict[Any, int] = {}
    for i, row in enumerate(rows, 2):  # line 1 is the header
        if row.get("status", "ok") != "ok":
            continue
        for ident in (
            ("run_key", row["run_key"]) if row.get("run_key") else None,
            tuple(sorted((k, v) for k, v in row.items() if k not in OUTCOME_COLUMNS)),
        ):
            if ident is None:
                continue
            if ident in seen:
                what = f"run_key {row['run_key']}" if ident[0] == "run_key" else "configuration"
                raise ConfigError(
                    f"table {table}: lines {seen[ident]} and {i} are the same run ({what}); a table holds one row "
                    "per run: remove the stale rows, or rerun into a new table (fedkl sweep --table NEW.csv)"
                )
            seen[ident] = i


def read_table(path: str) -> list[dict[str, str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _fmt(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return v


def result_row(
    cfg: Mapping[str, Any], key: str, payload: dict | None, wall: float, columns: Sequence[str], error: str = ""
) -> dict[str, Any]:
    """One table row from a run's configuration and result (``payload=None``: a failed run)."""
    c = resolved_settings(cfg)
    row: dict[str, Any] = {col: "" for col in columns}
    row.update(
        {
            "run_key": key,
            "status": "ok" if payload is not None else "error",
            "algorithm": c["algorithm"],
            "dataset": c["dataset"],
            "neighbouring": c["neighbouring"],
            "seed": c["seed"],
            "noise_seed": c["noise_seed"],
            "epsilon_target": c["epsilon"],
            "wall_s": wall,
            "error": error.replace("\n", " ")[:500],
        }
    )
    for name in columns:
        if name not in BASE_COLUMNS and name in cfg:
            row[name] = cfg[name]
    if payload is None:
        return {k: _fmt(v) for k, v in row.items()}
    test = payload.get("test_metrics") or {}
    metric = (payload.get("test_metric") or {}).get("name")
    ref = payload.get("nonprivate_reference") or {}
    trivial = payload.get("trivial_baseline") or {}
    details = payload.get("algorithm_details") or {}
    row.update(
        {
            "users": payload.get("users"),
            "epsilon": payload.get("epsilon"),
            "delta": payload.get("delta"),
            "metric": metric,
            "test_metric": (payload.get("test_metric") or {}).get("value"),
            "test_loss": test.get("loss"),
            "reference_metric": ref.get(metric) if metric else None,
            "reference_loss": ref.get("loss"),
            "trivial_metric": trivial.get(metric) if metric else None,
            "rounds": payload.get("rounds"),
            "sigma_sum": payload.get("sigma_sum"),
            "noise_multiplier": details.get("noise_multiplier") if isinstance(details, dict) else None,
        }
    )
    if row["test_loss"] not in (None, "") and row["reference_loss"] not in (None, ""):
        row["excess_loss"] = float(row["test_loss"]) - float(row["reference_loss"])
    for name, value in (payload.get("table_extra") or {}).items():
        if name in row:
            row[name] = value
    return {k: _fmt(v) for k, v in row.items()}


def append_line(path: str, text: str) -> None:
    with open(path, "a") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def append_row(path: str, columns: Sequence[str], row: Mapping[str, Any]) -> None:
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns))
        if new:
            writer.writeheader()
        writer.writerow(row)
        fh.flush()
        os.fsync(fh.fileno())
