"""The experiment layer: declarative run configs, sweeps into result tables, and plots of those tables.

* ``fedkl run --config FILE.toml`` — a TOML file whose keys are :class:`fedkl.runner.RunConfig`
  field names (``noise-seed`` or ``noise_seed``); a flag given on the command line overrides the
  file. Every value is checked by the same parser as its flag (a bad value or an unknown key exits
  2 with one line). TOML has no null: write ``"none"`` for an optional field's "unset".
* ``fedkl sweep FILE.toml`` — the top-level keys are the base run configuration (as above); the
  ``[sweep]`` table gives lists of values for any RunConfig field, and every point of their
  cartesian product is trained through :func:`fedkl.runner.run_training` (or a registered external
  runner, e.g. the Flower baseline). One line per run reports ``k/N``, the metric and the ETA; each
  result is appended (flushed, fsynced) as one row of a CSV table and one line of a JSON-lines file
  next to it. A rerun skips every point whose ``run_key`` (a hash of its resolved configuration)
  is already in the table, so an interrupted sweep resumes where it stopped. ``[sweep]`` keys:

  ``table`` (required)       the CSV path (the JSON lines go to the same path with ``.jsonl``)
  ``noise_seed_offset``      noise_seed = seed + offset for every run (reproducible, NOT secure
                             noise); absent: the OS CSPRNG (unless ``noise_seed`` is set)
  ``runs_dir``               keep every run's folder (result.json, ledger) under this folder;
                             absent: each run writes to a temporary folder, deleted afterwards
  ``plugins``                Python files or modules to import first; they register external
                             runners with :func:`register_runner` (e.g. ``simulations/flower_dp_baseline.py``)
  ``[[sweep.when]]``         conditional settings: ``match = {algorithm = "dp-fedavg", dataset = "tv16"}``
                             and any RunConfig fields, applied to every point that matches (in order)
  any RunConfig field        a non-empty list of values (an axis of the product)

  Relative paths (``table``, ``runs_dir``, ``plugins``) are relative to the folder ``fedkl sweep``
  runs in (the repository root for the files under ``simulations/configs/``). ``--set FIELD=V1,V2``
  replaces an axis from the command line and ``--table`` the table (``make bench QUICK=1`` uses both).

  The non-private reference (``reference = true``) depends only on (dataset, seed, users, problem,
  reg): the sweep computes it once per such key and reuses it for the other runs (and across a
  resume, from the JSON lines).
* ``fedkl plot TABLE.csv --kind privacy-utility|slope`` — PNG figures (matplotlib, Agg) of a table:
  the test metric against epsilon, mean ± std over seeds, one line per algorithm and one panel per
  dataset (with the non-private reference and the trivial baseline); or a log-log plot of an error
  column (default ``excess_loss``) against ``users``, with the least-squares slope of each line and
  the theory slope drawn. ``--markdown`` writes the numbers as a table.

Metrics in the tables are computed on held-out records for evaluation only: they are NOT private.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import importlib
import importlib.util
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A bad configuration file or value: the CLI prints the message on one line and exits 2."""


# ------------------------------------------------------------------------------------------------
# RunConfig fields, their flags and their validation (shared with `fedkl run`)
# ------------------------------------------------------------------------------------------------
def _run_fields() -> dict[str, dataclasses.Field]:
    from fedkl.runner import settings_fields

    return settings_fields()


def flat_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with every other ``fedkl run`` setting at its default: what an external runner reads
    (as attributes) and what identifies a row of one."""
    return {**{name: f.default for name, f in _run_fields().items()}, **cfg}


def _resolved(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a sweep point resolves to, ``out`` and ``ledger`` excluded: a fedkl algorithm's
    RunConfig (a hyperparameter of other algorithms only is dropped: a sweep's base may set it for
    some of its points), or an external runner's flat settings."""
    from fedkl.runner import RunConfig

    point = {k: v for k, v in cfg.items() if k not in ("out", "ledger")}
    if point.get("algorithm") in EXTERNAL_RUNNERS:
        full = flat_settings(point)
    else:
        full = RunConfig.from_settings(strict=False, **point).settings()
    full.pop("out", None), full.pop("ledger", None)
    return full


def dest_of(field_name: str) -> str:
    """The argparse destination of a RunConfig field in ``fedkl run`` (``reference`` is the negated
    ``--no-reference``)."""
    return "no_reference" if field_name == "reference" else field_name


def _run_actions() -> dict[str, argparse.Action]:
    from fedkl.flags import build_parser

    run = build_parser().subcommands["run"]  # type: ignore[attr-defined]
    return {a.dest: a for a in run._actions if a.dest not in ("help",)}


def field_name(key: str) -> str:
    return key.replace("-", "_")


def _optional(f: dataclasses.Field) -> bool:
    return "None" in str(f.type)


def coerce_value(name: str, value: Any, *, actions: Mapping[str, argparse.Action] | None = None,
                 fields: Mapping[str, dataclasses.Field] | None = None,
                 extra_algorithms: Iterable[str] = ()) -> Any:
    """``value`` (from TOML) checked and converted exactly as ``fedkl run``'s flag for field
    ``name`` would check and convert its text. Raises :class:`ConfigError`."""
    fields = fields if fields is not None else _run_fields()
    actions = actions if actions is not None else _run_actions()
    flag = "--" + dest_of(name).replace("_", "-")
    if name not in fields:
        import difflib

        close = difflib.get_close_matches(name, list(fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; the keys are fedkl run's options"
        raise ConfigError(f"unknown key {name!r} (not a fedkl run setting{hint})")
    f = fields[name]
    if isinstance(value, (dict, list)):
        raise ConfigError(f"key {name!r}: expected a single value, got {type(value).__name__} {value!r}")
    if isinstance(value, str) and value.strip().lower() == "none":
        if _optional(f):
            return None
        raise ConfigError(f"key {name!r} cannot be none")
    if name == "reference" or str(f.type) == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"key {name!r}: expected true or false, got {value!r}")
        return value
    action = actions.get(dest_of(name))
    if action is None:  # a field without a flag: accept its annotated type only
        raise ConfigError(f"key {name!r} has no `fedkl run` flag and cannot be set from a file")
    if isinstance(value, bool):
        raise ConfigError(f"key {name!r} ({flag}): expected a {str(f.type).split(' ')[0]}, got {value!r}")
    if isinstance(value, float) and math.isinf(value):
        text = "inf" if value > 0 else "-inf"
    else:
        text = str(value)
    if action.type is not None:
        try:
            out = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise ConfigError(f"key {name!r} ({flag}): {exc}") from None
    else:
        if not isinstance(value, str):
            raise ConfigError(f"key {name!r} ({flag}): expected a string, got {value!r}")
        out = value
    choices = action.choices
    if choices is not None and out not in choices and out not in tuple(extra_algorithms):
        raise ConfigError(f"key {name!r} ({flag}): invalid choice {out!r} (choose from {', '.join(map(str, choices))})")
    return out


def read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None


def run_settings(mapping: Mapping[str, Any], where: str, **kw: Any) -> dict[str, Any]:
    """RunConfig field -> checked value, for the plain (non-table) keys of ``mapping``."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = field_name(key)
        if name in out:
            raise ConfigError(f"{where}: key {key!r} is given twice (dashes and underscores name the same field)")
        try:
            out[name] = coerce_value(name, value, **kw)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return out


def load_run_config_file(path: str) -> dict[str, Any]:
    """The RunConfig settings of a ``fedkl run --config`` file (no tables allowed)."""
    data = read_toml(path)
    tables = [k for k, v in data.items() if isinstance(v, dict)]
    if tables:
        raise ConfigError(f"{path}: unexpected table [{tables[0]}] (a run config holds RunConfig keys only; "
                          "[sweep] belongs in a `fedkl sweep` file)")
    return run_settings(data, path)


def explicit_run_dests(argv: Sequence[str]) -> set[str]:
    """Destinations of the ``fedkl run`` options actually present in ``argv`` (abbreviations
    included): the same parser with every default suppressed keeps only what was given."""
    from fedkl.flags import build_parser

    parser = build_parser()
    run = parser.subcommands["run"]  # type: ignore[attr-defined]
    for action in run._actions:
        action.default = argparse.SUPPRESS
    ns = parser.parse_args(list(argv))
    return set(vars(ns)) - {"command"}


def apply_config_file(args: argparse.Namespace, argv: Sequence[str]) -> argparse.Namespace:
    """Fill ``args`` (parsed ``fedkl run`` options) from ``args.config``: a file value replaces the
    default of every option that was not given explicitly on the command line."""
    settings = load_run_config_file(args.config)
    given = explicit_run_dests(argv)
    for name, value in settings.items():
        dest = dest_of(name)
        if dest in given:
            continue
        setattr(args, dest, (not value) if name == "reference" else value)
    return args


# ------------------------------------------------------------------------------------------------
# external runners (baselines that are not fedkl algorithms, e.g. Flower's own DP strategy)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExternalRunner:
    """``fn(settings, log) -> dict``, ``settings`` a namespace with every ``fedkl run`` setting as an
    attribute (:func:`flat_settings`: the point's values, the rest at their defaults), returning a result like ``run_training``'s (at least
    algorithm, dataset, users, epsilon, delta, test_metric, test_metrics, nonprivate_reference,
    trivial_baseline, seed, rounds); ``columns``: extra result keys (``payload["table_extra"]``)
    that become table columns."""

    fn: Callable[..., dict]
    columns: tuple[str, ...] = ()
    description: str = ""


EXTERNAL_RUNNERS: dict[str, ExternalRunner] = {}


def register_runner(name: str, fn: Callable[..., dict], columns: Sequence[str] = (), description: str = "") -> None:
    from fedkl.algorithms.catalog import REGISTRY

    if name in REGISTRY:
        raise ValueError(f"{name!r} is a fedkl algorithm; an external runner needs another name")
    EXTERNAL_RUNNERS[name] = ExternalRunner(fn, tuple(columns), description)


def load_plugin(ref: str) -> None:
    """Import a plugin: a ``.py`` path (relative to the current folder; it imports what it needs
    itself) or an importable module name."""
    if ref.endswith(".py"):
        path = os.path.abspath(ref)
        if not os.path.exists(path):
            raise ConfigError(f"plugin file {ref!r} not found (paths are relative to the current folder {os.getcwd()})")
        name = "fedkl_plugin_" + hashlib.sha1(path.encode()).hexdigest()[:10]
        if name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return
    try:  # a module name: importable as installed or from PYTHONPATH (fedkl never edits sys.path)
        importlib.import_module(ref)
    except ImportError as exc:
        raise ConfigError(f"plugin {ref!r} cannot be imported: {exc}") from None


# ------------------------------------------------------------------------------------------------
# sweeps
# ------------------------------------------------------------------------------------------------
SWEEP_OPTIONS = ("table", "noise_seed_offset", "runs_dir", "plugins", "when")
BASE_COLUMNS = ("run_key", "status", "algorithm", "dataset", "users", "neighbouring", "seed", "noise_seed",
                "epsilon_target", "epsilon", "delta", "metric", "test_metric", "test_loss", "reference_metric",
                "reference_loss", "excess_loss", "trivial_metric", "rounds", "sigma_sum", "noise_multiplier",
                "wall_s", "error")


@dataclass
class SweepSpec:
    path: str
    base: dict[str, Any]
    axes: dict[str, list[Any]]
    when: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    table: str = ""
    noise_seed_offset: int | None = None
    runs_dir: str | None = None
    plugins: list[str] = field(default_factory=list)

    @property
    def jsonl(self) -> str:
        return os.path.splitext(self.table)[0] + ".jsonl"

    def points(self) -> list[dict[str, Any]]:
        """Every resolved run configuration (as RunConfig keyword arguments), in product order."""
        names = list(self.axes)
        out = []
        for combo in itertools.product(*(self.axes[n] for n in names)):
            cfg = {**self.base, **dict(zip(names, combo))}
            for match, settings in self.when:
                if all(cfg.get(k) == v for k, v in match.items()):
                    cfg.update(settings)
            if self.noise_seed_offset is not None and "noise_seed" not in self.axes and "noise_seed" not in self.base:
                cfg["noise_seed"] = int(cfg.get("seed", 0)) + self.noise_seed_offset
            out.append(cfg)
        return out

    def columns(self) -> list[str]:
        extra = []
        for name in self.axes:
            if name not in BASE_COLUMNS and name not in extra:
                extra.append(name)
        for match, settings in self.when:
            for name in settings:
                if name not in BASE_COLUMNS and name not in extra and name not in ("out", "ledger"):
                    extra.append(name)
        algorithms = set(self.axes.get("algorithm", [self.base.get("algorithm")]))
        for alg in sorted(a for a in algorithms if a in EXTERNAL_RUNNERS):
            extra += [c for c in EXTERNAL_RUNNERS[alg].columns if c not in extra and c not in BASE_COLUMNS]
        return list(BASE_COLUMNS) + extra


def _parse_set(items: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE[,VALUE...]")
        key, values = item.split("=", 1)
        out[field_name(key.strip())] = [v.strip() for v in values.split(",") if v.strip()]
        if not out[field_name(key.strip())]:
            raise ConfigError(f"--set {item!r}: no values")
    return out


def _from_text(text: str) -> Any:
    """A --set value as TOML would read it (numbers, booleans, else the string)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_sweep(path: str, *, table: str | None = None, sets: Sequence[str] = ()) -> SweepSpec:
    """Parse and check a sweep file (plugins are imported here, before the values are checked).
    ``sets``: ``FIELD=V1,V2`` overrides of axes (or of base values); ``table``: another table path."""
    data = read_toml(path)
    sweep = data.pop("sweep", None)
    if not isinstance(sweep, dict):
        raise ConfigError(f"{path}: a sweep file needs a [sweep] table (with `table = \"results.csv\"` and lists of values)")
    others = [k for k, v in data.items() if isinstance(v, dict)]
    if others:
        raise ConfigError(f"{path}: unexpected table [{others[0]}] (only [sweep] and RunConfig keys are allowed)")
    sweep = {field_name(k): v for k, v in sweep.items()}
    plugins = sweep.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"{path}: [sweep] plugins must be a list of file paths or module names")
    for ref in plugins:
        load_plugin(ref)
    extra_algs = tuple(EXTERNAL_RUNNERS)
    fields = _run_fields()
    actions = _run_actions()
    kw = {"fields": fields, "actions": actions, "extra_algorithms": extra_algs}
    base = run_settings(data, path, **kw)
    for key in ("out", "ledger"):
        if key in base:
            raise ConfigError(f"{path}: {key!r} cannot be set in a sweep (every run gets its own folder and ledger; "
                              "use [sweep] runs_dir to keep them)")
    axes: dict[str, list[Any]] = {}
    for key, values in sweep.items():
        if key in SWEEP_OPTIONS:
            continue
        if key not in fields:
            raise ConfigError(f"{path}: [sweep] unknown key {key!r} (a RunConfig field with a list of values, or one "
                              f"of {', '.join(SWEEP_OPTIONS)})")
        if key in ("out", "ledger"):
            raise ConfigError(f"{path}: [sweep] {key!r} cannot be swept (every run gets its own folder and ledger)")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: [sweep] {key!r} must be a non-empty list of values, got {values!r}")
        checked = []
        for v in values:
            try:
                checked.append(coerce_value(key, v, **kw))
            except ConfigError as exc:
                raise ConfigError(f"{path}: [sweep] {exc}") from None
        if len(set(map(repr, checked))) != len(checked):
            raise ConfigError(f"{path}: [sweep] {key!r} lists a value twice: {values!r}")
        axes[key] = checked
    for key, values in _parse_set(sets).items():
        if key in ("out", "ledger"):
            raise ConfigError(f"--set {key}: cannot be swept")
        try:
            checked = [coerce_value(key, _from_text(v), **kw) for v in values]
        except ConfigError as exc:
            raise ConfigError(f"--set: {exc}") from None
        if len(checked) == 1 and key not in axes:
            base[key] = checked[0]
        else:
            axes[key] = checked
    when = []
    raw_when = sweep.get("when", [])
    if not isinstance(raw_when, list):
        raise ConfigError(f"{path}: [[sweep.when]] must be an array of tables")
    for i, entry in enumerate(raw_when, 1):
        if not isinstance(entry, dict) or not isinstance(entry.get("match"), dict) or not entry["match"]:
            raise ConfigError(f"{path}: [[sweep.when]] #{i} needs `match = {{field = value, ...}}`")
        match = run_settings(entry["match"], f"{path}: [[sweep.when]] #{i} match", **kw)
        settings = run_settings({k: v for k, v in entry.items() if k != "match"}, f"{path}: [[sweep.when]] #{i}", **kw)
        if not settings:
            raise ConfigError(f"{path}: [[sweep.when]] #{i} sets nothing")
        when.append((match, settings))
    table = table or sweep.get("table")
    if not isinstance(table, str) or not table.endswith(".csv"):
        raise ConfigError(f"{path}: [sweep] table must name a .csv file, got {table!r}")
    offset = sweep.get("noise_seed_offset")
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
        raise ConfigError(f"{path}: [sweep] noise_seed_offset must be an integer, got {offset!r}")
    runs_dir = sweep.get("runs_dir")
    if runs_dir is not None and not isinstance(runs_dir, str):
        raise ConfigError(f"{path}: [sweep] runs_dir must be a folder path, got {runs_dir!r}")
    spec = SweepSpec(path=path, base=base, axes=axes, when=when, table=table, noise_seed_offset=offset,
                     runs_dir=runs_dir, plugins=list(plugins))
    for point in spec.points():  # every point must build (e.g. algorithm names) before anything runs
        alg = point.get("algorithm", "noisy-gd")
        if alg in EXTERNAL_RUNNERS:
            continue
        from fedkl.algorithms.catalog import REGISTRY

        if alg not in REGISTRY:
            raise ConfigError(f"{path}: algorithm {alg!r} is neither a fedkl algorithm nor a registered runner")
    return spec


def run_key(cfg: Mapping[str, Any]) -> str:
    """A short hash of a resolved run configuration (RunConfig defaults filled in; ``out`` and
    ``ledger`` excluded): the identity of a table row, used to resume."""
    text = json.dumps(_resolved(cfg), sort_keys=True, default=repr)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _reference_key(cfg: Mapping[str, Any]) -> str:
    c = _resolved(cfg)
    return json.dumps([c["dataset"], c["seed"], c["users"], c["problem"], c["reg"]])


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


def result_row(cfg: Mapping[str, Any], key: str, payload: dict | None, wall: float, columns: Sequence[str],
               error: str = "") -> dict[str, Any]:
    """One table row from a run's configuration and result (``payload=None``: a failed run)."""
    c = _resolved(cfg)
    row: dict[str, Any] = {col: "" for col in columns}
    row.update({"run_key": key, "status": "ok" if payload is not None else "error", "algorithm": c["algorithm"],
                "dataset": c["dataset"], "neighbouring": c["neighbouring"], "seed": c["seed"],
                "noise_seed": c["noise_seed"], "epsilon_target": c["epsilon"], "wall_s": wall, "error": error.replace("\n", " ")[:500]})
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
    row.update({"users": payload.get("users"), "epsilon": payload.get("epsilon"), "delta": payload.get("delta"),
                "metric": metric, "test_metric": (payload.get("test_metric") or {}).get("value"),
                "test_loss": test.get("loss"), "reference_metric": ref.get(metric) if metric else None,
                "reference_loss": ref.get("loss"), "trivial_metric": trivial.get(metric) if metric else None,
                "rounds": payload.get("rounds"), "sigma_sum": payload.get("sigma_sum"),
                "noise_multiplier": details.get("noise_multiplier") if isinstance(details, dict) else None})
    if row["test_loss"] not in (None, "") and row["reference_loss"] not in (None, ""):
        row["excess_loss"] = float(row["test_loss"]) - float(row["reference_loss"])
    for name, value in (payload.get("table_extra") or {}).items():
        if name in row:
            row[name] = value
    return {k: _fmt(v) for k, v in row.items()}


def _append_line(path: str, text: str) -> None:
    with open(path, "a") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _append_row(path: str, columns: Sequence[str], row: Mapping[str, Any]) -> None:
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns))
        if new:
            writer.writeheader()
        writer.writerow(row)
        fh.flush()
        os.fsync(fh.fileno())


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def describe_point(cfg: Mapping[str, Any], axes: Iterable[str]) -> str:
    return " ".join(f"{k}={cfg.get(k)}" for k in axes) or "(single run)"


def run_sweep(spec: SweepSpec, *, log: Callable[[str], None] = print, restart: bool = False, dry_run: bool = False,
              verbose: bool = False, max_runs: int | None = None, retry_errors: bool = False) -> dict:
    """Run every point of ``spec`` not yet in its table (``retry_errors``: also those whose row
    records an error; the new row is appended, plots read only ``ok`` rows); returns counts and the
    rows written."""
    from fedkl.runner import RunConfig, run_training

    columns = spec.columns()
    points = spec.points()
    keys = [run_key(p) for p in points]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{spec.path}: two sweep points resolve to the same configuration (a [[sweep.when]] "
                          "overrides a swept field?)")
    if restart and not dry_run:
        for p in (spec.table, spec.jsonl):
            if os.path.exists(p):
                os.remove(p)
    existing = read_table(spec.table)
    if existing:
        with open(spec.table, newline="") as fh:
            header = next(csv.reader(fh))
        if header != columns:
            raise ConfigError(f"table {spec.table} has other columns than this sweep writes (was it written by "
                              "another config?); give another table (--table) or --restart")
    done = {r["run_key"] for r in existing if not retry_errors or r.get("status") == "ok"}
    todo = [i for i, k in enumerate(keys) if k not in done]
    total = len(points)
    log(f"fedkl sweep {spec.path}: {total} runs ({len(points) - len(todo)} already in {spec.table}, "
        f"{len(todo)} to run); axes: " + ", ".join(f"{k} x{len(v)}" for k, v in spec.axes.items()))
    if dry_run:
        for i, p in enumerate(points, 1):
            log(f"  [{i}/{total}] {keys[i - 1]} {'done' if keys[i - 1] in done else 'todo'}  {describe_point(p, spec.axes)}")
        return {"total": total, "skipped": total - len(todo), "ran": 0, "errors": 0, "rows": []}
    os.makedirs(os.path.dirname(os.path.abspath(spec.table)), exist_ok=True)
    references: dict[str, dict] = {}
    if os.path.exists(spec.jsonl):
        with open(spec.jsonl) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                ref = (rec.get("result") or {}).get("nonprivate_reference")
                if ref and rec.get("config"):
                    references.setdefault(_reference_key(rec["config"]), ref)
    rows = []
    errors = 0
    started = time.perf_counter()
    ran = 0
    skipped = total - len(todo)
    if max_runs is not None:
        todo = todo[:max_runs]
    for n_done, i in enumerate(todo, 1):
        cfg = dict(points[i])
        key = keys[i]
        alg = cfg.get("algorithm", "noisy-gd")
        ref_key = _reference_key(cfg)
        wants_reference = cfg.get("reference", True)
        tmp = None
        if spec.runs_dir:
            out = os.path.join(spec.runs_dir, f"{key}-{time.strftime('%Y%m%d-%H%M%S')}")
        else:
            tmp = tempfile.mkdtemp(prefix="fedkl-sweep-")
            out = os.path.join(tmp, "run")
        run_cfg = {**cfg, "out": out, "ledger": None}
        if wants_reference and ref_key in references:
            run_cfg["reference"] = False
        t0 = time.perf_counter()
        payload, error = None, ""
        try:
            if alg in EXTERNAL_RUNNERS:
                settings = argparse.Namespace(**flat_settings(run_cfg))
                payload = EXTERNAL_RUNNERS[alg].fn(settings, log if verbose else (lambda s: None))
            else:
                rc = RunConfig.from_settings(strict=False, **run_cfg)
                if rc.backend != "inprocess":
                    import fedkl.flower.backends  # noqa: F401  (registers the Flower backends)
                payload = run_training(rc, log=log if verbose else (lambda s: None))
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded in the table, the sweep goes on
            error = f"{type(exc).__name__}: {exc}"
            errors += 1
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        wall = time.perf_counter() - t0
        ran += 1
        if payload is not None and wants_reference:
            if payload.get("nonprivate_reference"):
                references.setdefault(ref_key, payload["nonprivate_reference"])
            elif ref_key in references:
                payload["nonprivate_reference"] = references[ref_key]
                payload["nonprivate_reference_reused"] = True
        row = result_row(cfg, key, payload, wall, columns, error)
        _append_line(spec.jsonl, json.dumps({"run_key": key, "config": {k: v for k, v in cfg.items()},
                                             "row": row, "result": payload}, default=str) + "\n")
        _append_row(spec.table, columns, row)
        rows.append(row)
        elapsed = time.perf_counter() - started
        eta = elapsed / n_done * (len(todo) - n_done)
        k = skipped + n_done
        what = (f"{row['metric']} {float(row['test_metric']):.4f}, eps {float(row['epsilon']):.4g}"
                if payload is not None and row["test_metric"] != "" else
                ("no model released" if payload is not None else f"ERROR {error}"))
        log(f"[{k}/{total}] {describe_point(cfg, spec.axes)}: {what} ({wall:.1f} s; elapsed {_duration(elapsed)}, "
            f"ETA {_duration(eta)})")
    log(f"fedkl sweep: {ran} runs in {_duration(time.perf_counter() - started)} ({errors} errors); "
        f"table {spec.table} ({len(read_table(spec.table))} rows), {spec.jsonl}")
    return {"total": total, "skipped": skipped, "ran": ran, "errors": errors, "rows": rows}


# ------------------------------------------------------------------------------------------------
# plots and summary tables
# ------------------------------------------------------------------------------------------------
def _num(v: Any) -> float | None:
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def filter_rows(rows: list[dict], where: Sequence[str] = ()) -> list[dict]:
    """Rows with status ok (or no status column) matching every ``KEY=VALUE`` of ``where``."""
    conds = []
    for item in where:
        if "=" not in item:
            raise ConfigError(f"--where {item!r}: expected COLUMN=VALUE")
        k, v = item.split("=", 1)
        conds.append((k.strip(), v.strip()))
    if rows:
        for k, _ in conds:
            if k not in rows[0]:
                raise ConfigError(f"--where: no column {k!r} in the table (columns: {', '.join(rows[0])})")
    out = []
    for r in rows:
        if r.get("status", "ok") != "ok":
            continue
        if all(r.get(k) == v or (_num(r.get(k)) is not None and _num(v) is not None and _num(r.get(k)) == _num(v))
               for k, v in conds):
            out.append(r)
    return out


def _order(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(rows: list[dict], x: str, y: str, group: str, panel: str | None) -> dict:
    """``{panel: {group: [(x, mean, std, count), ...]}}`` over the rows with numeric x and y."""
    out: dict[str, dict[str, list[tuple[float, float, float, int]]]] = {}
    panels = _order(r.get(panel, "") for r in rows) if panel else [""]
    for p in panels:
        sub = [r for r in rows if not panel or r.get(panel, "") == p]
        groups = _order(r.get(group, "") for r in sub)
        out[p] = {}
        for g in groups:
            pts: dict[float, list[float]] = {}
            for r in sub:
                if r.get(group, "") != g:
                    continue
                xv, yv = _num(r.get(x)), _num(r.get(y))
                if xv is None or yv is None:
                    continue
                pts.setdefault(xv, []).append(yv)
            out[p][g] = [(xv, *mean_std(vs), len(vs)) for xv, vs in sorted(pts.items())]
    return out


def _panel_constant(rows: list[dict], panel: str | None, p: str, column: str) -> float | None:
    vals = [_num(r.get(column)) for r in rows if (not panel or r.get(panel, "") == p)]
    vals = [v for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_privacy_utility(rows: list[dict], out: str, *, x: str = "epsilon_target", y: str = "test_metric",
                         group: str = "algorithm", panel: str | None = "dataset", title: str | None = None,
                         log_x: bool = True) -> dict:
    """Test metric vs epsilon: mean ± std over the rows at each x (the seeds), one line per group,
    one panel per ``panel`` value, with the mean non-private reference and trivial baseline."""
    if not rows:
        raise ConfigError("no rows to plot (empty table, or every row filtered out / failed)")
    summary = summarize(rows, x, y, group, panel)
    plt = _pyplot()
    panels = list(summary)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
    metric = _order(r.get("metric", "") for r in rows)
    ylabel = f"test {metric[0]}" if y == "test_metric" and len(metric) == 1 and metric[0] else y
    for ax, p in zip(axes[0], panels):
        for g, pts in summary[p].items():
            if not pts:
                continue
            ax.errorbar([q[0] for q in pts], [q[1] for q in pts], yerr=[q[2] for q in pts], marker="o", capsize=3,
                        label=g)
        if y == "test_metric":
            ref = _panel_constant(rows, panel, p, "reference_metric")
            if ref is not None:
                ax.axhline(ref, color="k", ls="--", lw=1, label="non-private")
            triv = _panel_constant(rows, panel, p, "trivial_metric")
            if triv is not None:
                ax.axhline(triv, color="grey", ls=":", lw=1, label="trivial baseline")
        if log_x:
            ax.set_xscale("log", base=2)
            ticks = sorted({q[0] for pts in summary[p].values() for q in pts if q[0] > 0})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel("user-level ε" if x.startswith("epsilon") else x)
        users = _order(r.get("users", "") for r in rows if not panel or r.get(panel, "") == p)
        ax.set_title(f"{p} ({users[0]} users)" if p and len(users) == 1 and users[0] else (p or title or ""))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _savefig(fig, out)
    plt.close(fig)
    return summary


def fit_loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``log y = a + b log x``: returns (b, a). Needs two or more distinct x > 0, y > 0."""
    pts = [(math.log(a), math.log(b)) for a, b in zip(xs, ys) if a > 0 and b > 0]
    if len({p[0] for p in pts}) < 2:
        raise ConfigError("a slope needs positive values at two or more distinct x")
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    return b, my - b * mx


def plot_slope(rows: list[dict], out: str, *, x: str = "users", y: str = "excess_loss", group: str = "algorithm",
               theory_slope: float | None = None, theory_label: str = "theory", title: str | None = None) -> dict:
    """Log-log plot of mean ``y`` (over seeds) against ``x`` per group, with the fitted slope of each
    line and the theory slope drawn through the data's log-centroid. Returns
    ``{group: {"slope", "intercept", "points": [(x, mean, std, n)], "dropped": k}}``: a point with a
    non-positive mean cannot be drawn on log axes and is dropped (and counted)."""
    if not rows:
        raise ConfigError("no rows to plot (empty table, or every row filtered out / failed)")
    summary = summarize(rows, x, y, group, None)[""]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 4.0))
    fits: dict[str, dict] = {}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for idx, (g, pts) in enumerate(summary.items()):
        good = [q for q in pts if q[0] > 0 and q[1] > 0]
        if len({q[0] for q in good}) < 2:
            continue
        b, a = fit_loglog_slope([q[0] for q in good], [q[1] for q in good])
        fits[g] = {"slope": b, "intercept": a, "points": pts, "dropped": len(pts) - len(good)}
        color = colors[idx % len(colors)]
        ax.errorbar([q[0] for q in good], [q[1] for q in good], yerr=[min(q[2], q[1] * 0.999) for q in good],
                    fmt="o", color=color, capsize=3)
        xs = [min(q[0] for q in good), max(q[0] for q in good)]
        ax.plot(xs, [math.exp(a) * v**b for v in xs], "-", color=color, label=f"{g}: fitted slope {b:.2f}")
        if theory_slope is not None:
            lx = statistics.fmean(math.log(q[0]) for q in good)
            ly = statistics.fmean(math.log(q[1]) for q in good)
            ax.plot(xs, [math.exp(ly + theory_slope * (math.log(v) - lx)) for v in xs], "--", color=color, alpha=0.6,
                    label=f"{theory_label} slope {theory_slope:g}")
    if not fits:
        raise ConfigError(f"no group has positive mean {y!r} at two or more {x!r} values: nothing to fit")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    _savefig(fig, out)
    plt.close(fig)
    return fits


def _savefig(fig, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)


def markdown_privacy_utility(rows: list[dict], summary: dict, *, x: str = "epsilon_target", y: str = "test_metric",
                             group: str = "algorithm", panel: str | None = "dataset", digits: int = 3) -> str:
    """The privacy-utility numbers as a markdown table: one row per (panel, group), one column per x."""
    xs = sorted({q[0] for groups in summary.values() for pts in groups.values() for q in pts})
    head = f"| {panel or ''} | {group} | " + " | ".join(f"ε = {v:g}" if x.startswith("epsilon") else f"{x} = {v:g}"
                                                          for v in xs) + " |"
    lines = [head, "|" + "---|" * (2 + len(xs))]
    for p, groups in summary.items():
        users = _order(r.get("users", "") for r in rows if not panel or r.get(panel, "") == p)
        label = f"{p} ({users[0]} users)" if p and len(users) == 1 and users[0] else p
        for g, pts in groups.items():
            by_x = {q[0]: q for q in pts}
            cells = [f"{by_x[v][1]:.{digits}f} ± {by_x[v][2]:.{digits}f} (n={by_x[v][3]})" if v in by_x else "—"
                     for v in xs]
            lines.append(f"| {label} | {g} | " + " | ".join(cells) + " |")
        if y == "test_metric":
            for name, col in (("non-private reference", "reference_metric"), ("trivial baseline", "trivial_metric")):
                vals = [_num(r.get(col)) for r in rows if not panel or r.get(panel, "") == p]
                vals = [v for v in vals if v is not None]
                if vals:
                    m, s = mean_std(vals)
                    lines.append(f"| {label} | {name} | " + " | ".join([f"{m:.{digits}f}"] * len(xs)) + " |")
    return "\n".join(lines) + "\n"


def plot_table(table: str, kind: str, out: str, *, x: str | None = None, y: str | None = None, group: str = "algorithm",
               panel: str | None = "dataset", where: Sequence[str] = (), theory_slope: float | None = None,
               theory_label: str = "theory", title: str | None = None, markdown: str | None = None) -> dict:
    """``fedkl plot``: read the table, filter, draw; optionally write the markdown numbers."""
    if not os.path.exists(table):
        raise ConfigError(f"table {table!r} not found")
    rows = read_table(table)
    if not rows:
        raise ConfigError(f"table {table!r} has no rows")
    for col in [c for c in (x, y, group, panel if kind == "privacy-utility" else None) if c]:
        if col not in rows[0]:
            raise ConfigError(f"no column {col!r} in {table} (columns: {', '.join(rows[0])})")
    rows = filter_rows(rows, where)
    if kind == "privacy-utility":
        summary = plot_privacy_utility(rows, out, x=x or "epsilon_target", y=y or "test_metric", group=group,
                                       panel=panel, title=title)
        if markdown:
            text = markdown_privacy_utility(rows, summary, x=x or "epsilon_target", y=y or "test_metric",
                                            group=group, panel=panel)
            _write_text(markdown, text)
        return summary
    if kind == "slope":
        fits = plot_slope(rows, out, x=x or "users", y=y or "excess_loss", group=group, theory_slope=theory_slope,
                          theory_label=theory_label, title=title)
        if markdown:
            lines = [f"| {group} | fitted slope of {y or 'excess_loss'} vs {x or 'users'} | theory slope | points |",
                     "|---|---|---|---|"]
            for g, fit in fits.items():
                pts = ", ".join(f"{q[0]:g}: {q[1]:.3g}" for q in fit["points"])
                lines.append(f"| {g} | {fit['slope']:.3f} | {theory_slope if theory_slope is not None else '—'} | {pts} |")
            _write_text(markdown, "\n".join(lines) + "\n")
        return fits
    raise ConfigError(f"unknown plot kind {kind!r} (privacy-utility or slope)")


def _write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)
