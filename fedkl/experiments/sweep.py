"""Sweeps: ``fedkl sweep FILE.toml`` (the file format is in :mod:`fedkl.experiments`' docstring).

:func:`load_sweep` reads and checks a sweep file into a :class:`SweepSpec` (the cartesian product of
its axes, with the conditional ``[[sweep.when]]`` settings); :func:`run_sweep` trains every point
not yet in the table, identified by :func:`run_key`, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedkl.experiments.config import (
    ConfigError,
    coerce_value,
    field_name,
    read_toml,
    run_actions,
    run_fields,
    run_settings,
)
from fedkl.experiments.runners import (
    EXTERNAL_RUNNERS,
    VARIANT,
    flat_settings,
    load_plugin,
    resolved_settings,
    runner_settings,
)
from fedkl.experiments.table import BASE_COLUMNS, append_line, append_row, read_table, result_row

SWEEP_OPTIONS = ("table", "noise_seed_offset", "runs_dir", "plugins", "when", "variants", "exclude")


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
    variants: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    exclude: list[dict[str, list[Any]]] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def jsonl(self) -> str:
        return os.path.splitext(self.table)[0] + ".jsonl"

    def points(self) -> list[dict[str, Any]]:
        """Every resolved run configuration (as RunConfig keyword arguments), in product order."""
        names = list(self.axes)
        out = []
        for variant, own in self.variants or [(None, {})]:
            for combo in itertools.product(*(self.axes[n] for n in names)):
                cfg = {**self.base, **own, **dict(zip(names, combo))}
                if variant is not None:
                    cfg[VARIANT] = variant
                for match, settings in self.when:
                    if all(cfg.get(k) == v for k, v in match.items()):
                        cfg.update(settings)
                if any(all(cfg.get(k) in vs for k, vs in ex.items()) for ex in self.exclude):
                    continue
                if self.noise_seed_offset is not None and "noise_seed" not in cfg:
                    cfg["noise_seed"] = int(cfg.get("seed", 0)) + self.noise_seed_offset
                out.append(cfg)
        return out

    def columns(self) -> list[str]:
        extra = [VARIANT] if self.variants else []
        set_by = [list(self.axes)] + [list(own) for _, own in self.variants] + [list(s) for _, s in self.when]
        for name in itertools.chain(*set_by):
            if name not in BASE_COLUMNS and name not in extra and name not in ("out", "ledger"):
                extra.append(name)
        algorithms = set(self.axes.get("algorithm", [self.base.get("algorithm")]))
        algorithms |= {own["algorithm"] for _, own in self.variants if "algorithm" in own}
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
    report = data.pop("report", {})
    if not isinstance(report, dict):
        raise ConfigError(f"{path}: report must be a [report] table")
    if not isinstance(sweep, dict):
        raise ConfigError(
            f'{path}: a sweep file needs a [sweep] table (with `table = "results.csv"` and lists of values)'
        )
    others = [k for k, v in data.items() if isinstance(v, dict)]
    if others:
        raise ConfigError(
            f"{path}: unexpected table [{others[0]}] (only [sweep], [report] and RunConfig keys are allowed)"
        )
    sweep = {field_name(k): v for k, v in sweep.items()}
    plugins = sweep.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"{path}: [sweep] plugins must be a list of file paths or module names")
    for ref in plugins:
        load_plugin(ref)
    extra_algs = tuple(EXTERNAL_RUNNERS)
    fields = run_fields()
    actions = run_actions()
    own = runner_settings()
    kw = {"fields": fields, "actions": actions, "extra_algorithms": extra_algs, "extra_settings": own}
    base = run_settings(data, path, **kw)
    for key in ("out", "ledger"):
        if key in base:
            raise ConfigError(
                f"{path}: {key!r} cannot be set in a sweep (every run gets its own folder and ledger; "
                "use [sweep] runs_dir to keep them)"
            )
    axes: dict[str, list[Any]] = {}
    for key, values in sweep.items():
        if key in SWEEP_OPTIONS:
            continue
        if key not in fields and key not in own:
            raise ConfigError(
                f"{path}: [sweep] unknown key {key!r} (a RunConfig field or a plugin runner's setting with a "
                f"list of values, or one of {', '.join(SWEEP_OPTIONS)})"
            )
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
    variants = []
    raw_variants = sweep.get("variants", [])
    if not isinstance(raw_variants, list):
        raise ConfigError(f"{path}: [[sweep.variants]] must be an array of tables")
    for i, entry in enumerate(raw_variants, 1):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise ConfigError(f'{path}: [[sweep.variants]] #{i} needs `name = "..."` (its label in the table)')
        if name in (v[0] for v in variants):
            raise ConfigError(f"{path}: [[sweep.variants]] name {name!r} is given twice")
        where = f"{path}: [[sweep.variants]] {name!r}"
        own = run_settings({k: v for k, v in entry.items() if k != "name"}, where, **kw)
        clash = sorted(set(own) & (set(axes) | {"out", "ledger"}))
        if clash:
            raise ConfigError(f"{where}: {clash[0]!r} is also a [sweep] axis (or cannot be set in a sweep)")
        variants.append((name, own))
    exclude = []
    raw_exclude = sweep.get("exclude", [])
    if not isinstance(raw_exclude, list):
        raise ConfigError(f"{path}: [[sweep.exclude]] must be an array of tables")
    for i, entry in enumerate(raw_exclude, 1):
        if not isinstance(entry, dict) or not entry:
            raise ConfigError(f"{path}: [[sweep.exclude]] #{i} needs `field = value` or `field = [values]`")
        cond = {}
        for key, values in entry.items():
            values = values if isinstance(values, list) else [values]
            if field_name(key) == VARIANT:
                cond[VARIANT] = values
            else:
                where = f"{path}: [[sweep.exclude]] #{i}"
                cond[field_name(key)] = [run_settings({key: v}, where, **kw)[field_name(key)] for v in values]
        exclude.append(cond)
    table = table or sweep.get("table")
    if not isinstance(table, str) or not table.endswith(".csv"):
        raise ConfigError(f"{path}: [sweep] table must name a .csv file, got {table!r}")
    offset = sweep.get("noise_seed_offset")
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
        raise ConfigError(f"{path}: [sweep] noise_seed_offset must be an integer, got {offset!r}")
    runs_dir = sweep.get("runs_dir")
    if runs_dir is not None and not isinstance(runs_dir, str):
        raise ConfigError(f"{path}: [sweep] runs_dir must be a folder path, got {runs_dir!r}")
    spec = SweepSpec(
        path=path,
        base=base,
        axes=axes,
        when=when,
        table=table,
        noise_seed_offset=offset,
        runs_dir=runs_dir,
        plugins=list(plugins),
        variants=variants,
        exclude=exclude,
        report=report,
    )
    if not spec.points():
        raise ConfigError(f"{path}: [[sweep.exclude]] leaves no point to run")
    for point in spec.points():  # every point must build (e.g. algorithm names) before anything runs
        alg = point.get("algorithm", "noisy-gd")
        if alg in EXTERNAL_RUNNERS:
            continue
        from fedkl.algorithms.catalog import REGISTRY

        if alg not in REGISTRY:
            raise ConfigError(f"{path}: algorithm {alg!r} is neither a fedkl algorithm nor a registered runner")
    return spec


def _refuse_rekeyed(
    table: str, existing: list[dict], points: list[dict], keys: list[str], columns: Sequence[str]
) -> None:
    """Refuse to resume a table whose ok rows already hold some of the points to run under other run
    keys (a resolved configuration changed, e.g. a new default): running them would put each run in the
    table twice (issue 20: 300 runs rerun, then a plot averaging n = 7 instead of 5)."""
    ok = [r for r in existing if r.get("status") == "ok"]
    clashes = 0
    for cfg, key in zip(points, keys):
        # the columns a row takes from its configuration (the others are what the run measured)
        ident = ["algorithm", "dataset", "neighbouring", "seed", "noise_seed", "epsilon_target"]
        ident += [c for c in columns if c not in BASE_COLUMNS and c in cfg] + (["users"] if "users" in cfg else [])
        mine = {**result_row(cfg, key, None, 0.0, columns), "users": cfg.get("users")}
        if any(all(str(r.get(c, "")) == str(mine[c]) for c in ident) for r in ok):
            clashes += 1
    if clashes:
        raise ConfigError(
            f"table {table}: {clashes} of the points to run are already in it under another run key (their "
            "resolved configuration changed, e.g. a new default); rerun into a new table (--table NEW.csv) or "
            "--restart"
        )


def run_key(cfg: Mapping[str, Any]) -> str:
    """A short hash of a resolved run configuration (RunConfig defaults filled in; ``out`` and
    ``ledger`` excluded): the identity of a table row, used to resume."""
    text = json.dumps(resolved_settings(cfg), sort_keys=True, default=repr)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _reference_key(cfg: Mapping[str, Any]) -> str:
    c = resolved_settings(cfg)
    return json.dumps([c["dataset"], c["seed"], c["users"], c["problem"], c["reg"]])


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def describe_point(cfg: Mapping[str, Any], axes: Iterable[str]) -> str:
    names = ([VARIANT] if VARIANT in cfg else []) + list(axes)
    return " ".join(f"{k}={cfg.get(k)}" for k in names) or "(single run)"


def run_sweep(
    spec: SweepSpec,
    *,
    log: Callable[[str], None] = print,
    restart: bool = False,
    resume: bool = False,
    dry_run: bool = False,
    verbose: bool = False,
    max_runs: int | None = None,
    retry_errors: bool = False,
) -> dict:
    """Run every point of ``spec`` into its table; returns counts and the rows written.

    A sweep writes a NEW table: one that already holds rows is refused unless ``resume`` (run only
    the points not yet in it; ``retry_errors``: also those whose row records an error, the new row is
    appended and reports read only ``ok`` rows) or ``restart`` (delete it and run every point)."""
    from fedkl.runner import RunConfig, run_training

    own = set(runner_settings()) - set(run_fields())
    if restart and (resume or retry_errors):
        raise ConfigError("--restart deletes the table; --resume/--retry-errors continue it: give one of them")
    columns = spec.columns()
    points = spec.points()
    keys = [run_key(p) for p in points]
    if len(set(keys)) != len(keys):
        raise ConfigError(
            f"{spec.path}: two sweep points resolve to the same configuration (a [[sweep.when]] "
            "overrides a swept field?)"
        )
    if restart and not dry_run:
        for p in (spec.table, spec.jsonl):
            if os.path.exists(p):
                os.remove(p)
    existing = read_table(spec.table)
    stale = os.path.exists(spec.jsonl) and os.path.getsize(spec.jsonl) > 0
    if (existing or stale) and not (resume or retry_errors or dry_run):
        raise ConfigError(
            f"table {spec.table if existing else spec.jsonl} already holds {len(existing) or 'some'} rows: --resume "
            "to continue it, --restart to replace it, or --table NEW.csv"
        )
    if existing:
        with open(spec.table, newline="") as fh:
            header = next(csv.reader(fh))
        if header != columns:
            raise ConfigError(
                f"table {spec.table} has other columns than this sweep writes (was it written by "
                "another config?); give another table (--table) or --restart"
            )
    done = {r["run_key"] for r in existing if not retry_errors or r.get("status") == "ok"}
    todo = [i for i, k in enumerate(keys) if k not in done]
    _refuse_rekeyed(spec.table, existing, [points[i] for i in todo], [keys[i] for i in todo], columns)
    total = len(points)
    log(
        f"fedkl sweep {spec.path}: {total} runs ({len(points) - len(todo)} already in {spec.table}, "
        f"{len(todo)} to run); axes: " + ", ".join(f"{k} x{len(v)}" for k, v in spec.axes.items())
    )
    if dry_run:
        for i, p in enumerate(points, 1):
            log(
                f"  [{i}/{total}] {keys[i - 1]} {'done' if keys[i - 1] in done else 'todo'}  {describe_point(p, spec.axes)}"
            )
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
        run_cfg = {k: v for k, v in cfg.items() if k != VARIANT} | {"out": out, "ledger": None}
        if wants_reference and ref_key in references:
            run_cfg["reference"] = False
        t0 = time.perf_counter()
        payload, error = None, ""
        try:
            if alg in EXTERNAL_RUNNERS:
                settings = argparse.Namespace(**flat_settings(run_cfg))
                payload = EXTERNAL_RUNNERS[alg].fn(settings, log if verbose else (lambda s: None))
            else:
                rc = RunConfig.from_settings(strict=False, **{k: v for k, v in run_cfg.items() if k not in own})
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
        append_line(
            spec.jsonl,
            json.dumps(
                {"run_key": key, "config": {k: v for k, v in cfg.items()}, "row": row, "result": payload}, default=str
            )
            + "\n",
        )
        append_row(spec.table, columns, row)
        rows.append(row)
        elapsed = time.perf_counter() - started
        eta = elapsed / n_done * (len(todo) - n_done)
        k = skipped + n_done
        what = (
            f"{row['metric']} {float(row['test_metric']):.4f}, eps {float(row['epsilon']):.4g}"
            if payload is not None and row["test_metric"] != ""
            else ("no model released" if payload is not None else f"ERROR {error}")
        )
        log(
            f"[{k}/{total}] {describe_point(cfg, spec.axes)}: {what} ({wall:.1f} s; elapsed {_duration(elapsed)}, "
            f"ETA {_duration(eta)})"
        )
    log(
        f"fedkl sweep: {ran} runs in {_duration(time.perf_counter() - started)} ({errors} errors); "
        f"table {spec.table} ({len(read_table(spec.table))} rows), {spec.jsonl}"
    )
    return {"total": total, "skipped": skipped, "ran": ran, "errors": errors, "rows": rows}
