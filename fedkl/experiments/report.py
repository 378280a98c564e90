"""Study reports: ``fedkl report STUDY.toml`` writes a study's markdown / figures from its result table.

A study is a sweep file (:mod:`fedkl.experiments.sweep`) with a ``[report]`` table; ``fedkl sweep``
fills the table, ``fedkl report`` reads it (no training) and writes what ``[report]`` names. Either a
built-in kind (no code)::

    [report]
    kind = "table"                     # or "curve" (y against x per group) or "slope" (log-log fit)
    markdown = "simulations/results/NAME.md"
    rows = ["dataset", "algorithm"]    # kind-specific options, listed in BUILTIN_KINDS' functions

or a function, loaded by FILE PATH (never by importing a package: the library does not import
``simulations``)::

    [report]
    function = "simulations/reports/NAME.py:report"
    markdown = "simulations/results/NAME.md"

``report(study: Study) -> list[str]`` gets the table's ``ok`` rows (refused if two are the same run:
:func:`fedkl.experiments.table.check_unique`), each run's JSON line (its full result) and the
``[report]`` options, writes its outputs at ``study.output(KEY)`` and returns their paths. Paths are
relative to the folder ``fedkl report`` runs in; ``--out-dir`` writes every output into another
folder (to compare a regenerated report with the committed one) and ``--table`` reads another table.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedkl.experiments.config import ConfigError
from fedkl.experiments.plot import (
    filter_rows,
    markdown_privacy_utility,
    markdown_slope,
    mean_std,
    plot_privacy_utility,
    plot_slope,
    write_text,
)
from fedkl.experiments.sweep import load_sweep
from fedkl.experiments.table import check_unique, read_table


@dataclass
class Study:
    """What a report function reads: the study file, its table's ``ok`` rows (in table order), the
    JSON line of each run (``{"run_key", "config", "row", "result"}``) by run key, and ``options``:
    the ``[report]`` table."""

    path: str
    table: str
    rows: list[dict[str, str]]
    records: dict[str, dict] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    out_dir: str | None = None

    def output(self, key: str) -> str:
        """The path ``[report] KEY`` names (inside ``out_dir`` when one is given)."""
        path = self.options.get(key)
        if not isinstance(path, str) or not path:
            raise ConfigError(f'{self.path}: [report] needs `{key} = "PATH"`')
        return os.path.join(self.out_dir, os.path.basename(path)) if self.out_dir else path

    def result(self, row: dict[str, str]) -> dict:
        """The full result (run_training's payload) of a row's run, from the table's JSON lines."""
        record = self.records.get(row.get("run_key", ""))
        if record is None or not isinstance(record.get("result"), dict):
            raise ConfigError(
                f"{self.table}: run {row.get('run_key')!r} has no result in the JSON lines next to the table "
                "(this report needs every run's full result)"
            )
        return record["result"]

    def option(self, key: str, default: Any = None) -> Any:
        return self.options.get(key, default)


def load_function(ref: str, where: str = "[report] function") -> Callable[[Study], list[str]]:
    """``"path/to/file.py:name"``: the function ``name`` of that file, imported by path."""
    path, sep, name = ref.rpartition(":")
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"{where} must be 'path/to/file.py:function', got {ref!r}")
    full = os.path.abspath(path)
    if not os.path.exists(full):
        raise ConfigError(f"{where}: file {path!r} not found (paths are relative to the current folder {os.getcwd()})")
    module_name = "fedkl_report_" + hashlib.sha1(full.encode()).hexdigest()[:10]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, full)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except BaseException:
            del sys.modules[module_name]
            raise
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{where}: {path} has no function {name!r}")
    return fn


def table_report(study: Study) -> list[str]:
    """``kind = "table"``: mean ± std (n) of ``y`` (default ``test_metric``) per combination of the
    ``rows`` columns (default ``["algorithm"]``), one table column per value of ``columns`` (optional);
    ``title``, ``note`` (a paragraph after the table) and ``digits`` (default 4)."""
    y = study.option("y", "test_metric")
    keys = study.option("rows", ["algorithm"])
    keys = [keys] if isinstance(keys, str) else list(keys)
    across = study.option("columns")
    digits = int(study.option("digits", 4))
    for col in [y, *keys, *([across] if across else [])]:
        if study.rows and col not in study.rows[0]:
            raise ConfigError(f"{study.path}: [report] no column {col!r} in {study.table}")
    heads = list(dict.fromkeys(r[across] for r in study.rows)) if across else [y]
    cells: dict[tuple, dict[str, list[float]]] = {}
    for r in study.rows:
        if r.get(y, "") == "":
            continue
        cells.setdefault(tuple(r[k] for k in keys), {}).setdefault(r[across] if across else y, []).append(float(r[y]))
    lines = [f"# {study.option('title')}", ""] if study.option("title") else []
    lines += ["| " + " | ".join([*keys, *(f"{across} = {h}" if across else h for h in heads)]) + " |"]
    lines += ["|" + "---|" * (len(keys) + len(heads))]
    for key, by_head in cells.items():
        out = []
        for h in heads:
            if h not in by_head:
                out.append("—")
                continue
            m, s = mean_std(by_head[h])
            out.append(f"{m:.{digits}f} ± {s:.{digits}f} (n={len(by_head[h])})")
        lines.append("| " + " | ".join([*key, *out]) + " |")
    if study.option("note"):
        lines += ["", study.option("note")]
    path = study.output("markdown")
    write_text(path, "\n".join(lines) + "\n")
    return [path]


def curve_report(study: Study) -> list[str]:
    """``kind = "curve"``: ``y`` (default ``test_metric``) against ``x`` (default ``epsilon_target``),
    mean ± std over seeds, one line per ``group`` and one panel per ``panel`` (default ``dataset``;
    ``""``: one panel) as ``fedkl plot --kind privacy-utility`` draws them; writes ``figure`` and, if
    named, ``markdown``."""
    kw = {
        "x": study.option("x", "epsilon_target"),
        "y": study.option("y", "test_metric"),
        "group": study.option("group", "algorithm"),
        "panel": study.option("panel", "dataset") or None,
    }
    summary = plot_privacy_utility(
        study.rows, study.output("figure"), title=study.option("title"), log_x=study.option("log_x", True), **kw
    )
    written = [study.output("figure")]
    if study.option("markdown"):
        write_text(study.output("markdown"), markdown_privacy_utility(study.rows, summary, **kw))
        written.append(study.output("markdown"))
    return written


def slope_report(study: Study) -> list[str]:
    """``kind = "slope"``: log-log ``y`` (default ``excess_loss``) against ``x`` (default ``users``)
    per ``group``, fitted slopes and ``theory_slope``; writes ``figure`` and, if named, ``markdown``."""
    kw = {
        "x": study.option("x", "users"),
        "y": study.option("y", "excess_loss"),
        "group": study.option("group", "algorithm"),
    }
    theory = study.option("theory_slope")
    fits = plot_slope(
        study.rows,
        study.output("figure"),
        theory_slope=theory,
        theory_label=study.option("theory_label", "theory"),
        title=study.option("title"),
        **kw,
    )
    written = [study.output("figure")]
    if study.option("markdown"):
        write_text(study.output("markdown"), markdown_slope(fits, theory_slope=theory, **kw))
        written.append(study.output("markdown"))
    return written


BUILTIN_KINDS: dict[str, Callable[[Study], list[str]]] = {
    "table": table_report,
    "curve": curve_report,
    "slope": slope_report,
}


def _records(jsonl: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if os.path.exists(jsonl):
        with open(jsonl) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("run_key") and (rec.get("row") or {}).get("status", "ok") == "ok":
                    out[rec["run_key"]] = rec
    return out


def run_report(path: str, *, table: str | None = None, out_dir: str | None = None) -> list[str]:
    """``fedkl report``: read the study's table and write its report; returns the paths written."""
    spec = load_sweep(path, table=table)
    options = dict(spec.report)
    if not options:
        raise ConfigError(f'{path} has no [report] table (add `kind = ...` or `function = "FILE.py:NAME"`)')
    function, kind = options.pop("function", None), options.pop("kind", None)
    if (function is None) == (kind is None):
        raise ConfigError(f"{path}: [report] needs exactly one of `function` and `kind`")
    if kind is not None and kind not in BUILTIN_KINDS:
        raise ConfigError(f"{path}: [report] kind {kind!r} is not one of {', '.join(BUILTIN_KINDS)}")
    fn = BUILTIN_KINDS[kind] if kind is not None else load_function(function, f"{path}: [report] function")
    if not os.path.exists(spec.table):
        raise ConfigError(f"table {spec.table} not found (run `fedkl sweep {path}` first)")
    rows = read_table(spec.table)
    check_unique(rows, spec.table)
    where = options.get("where", [])
    if not isinstance(where, list):
        raise ConfigError(f"{path}: [report] where must be a list of 'COLUMN=VALUE'")
    rows = filter_rows(rows, where)
    if not rows:
        raise ConfigError(f"table {spec.table} has no ok rows to report")
    study = Study(path, spec.table, rows, _records(spec.jsonl), options, out_dir)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    try:
        return list(fn(study))
    except KeyError as exc:  # a column (or result field) the report reads is not in this table
        raise ConfigError(f"{path}: the report reads {exc} which {spec.table} does not have") from None


__all__ = ["BUILTIN_KINDS", "Study", "load_function", "run_report"]
