"""Checks of the files a run writes in its folder, shared by the tests of every entry point."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path


def check_round_metrics(out: Path, rounds: int) -> list[dict]:
    """The run folder ``out`` holds metrics.jsonl and metrics.csv with one row per round 1..rounds, and a
    valid PNG of the curves; returns the JSON rows."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, rounds + 1))
    with open(out / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["round"]) for r in table] == list(range(1, rounds + 1))
    assert [float(r["rho_spent"]) for r in table] == [r["rho_spent"] for r in rows]
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 200 and height >= 150 and len(png) > 2000
    return rows
