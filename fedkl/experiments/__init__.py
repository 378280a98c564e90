"""The experiment layer: declarative run configs, sweeps into result tables, and plots of those tables.

* ``fedkl run --config FILE.toml`` — a TOML file whose keys are :class:`fedkl.runner.RunConfig`
  field names; a flag given on the command line overrides the file (:mod:`fedkl.experiments.config`
  documents the format and checks every value with the same parser as its flag).
* ``fedkl sweep FILE.toml`` — the top-level keys are the base run configuration (as above); the
  ``[sweep]`` table gives lists of values for any RunConfig field, and every point of their
  cartesian product is trained through :func:`fedkl.runner.run_training` (or a registered external
  runner, e.g. the Flower baseline). One line per run reports ``k/N``, the metric and the ETA; each
  result is appended (flushed, fsynced) as one row of a CSV table and one line of a JSON-lines file
  next to it. A sweep writes a NEW table: a table that already holds rows is refused (one line)
  unless ``--resume`` (skip every point whose ``run_key``, a hash of its resolved configuration, is
  already in the table: an interrupted sweep continues where it stopped; a point whose configuration
  columns match an ok row under another key, i.e. the same run re-keyed after a default changed, is
  refused rather than run twice) or ``--restart`` (start over). ``[sweep]`` keys:

  ``table`` (required)       the CSV path (the JSON lines go to the same path with ``.jsonl``)
  ``noise_seed_offset``      noise_seed = seed + offset for every run (reproducible, NOT secure
                             noise); absent: the OS CSPRNG (unless ``noise_seed`` is set)
  ``runs_dir``               keep every run's folder (result.json, ledger) under this folder;
                             absent: each run writes to a temporary folder, deleted afterwards
  ``plugins``                Python files or modules to import first; they register external
                             runners with :func:`register_runner` (e.g. ``simulations/flower_dp_baseline.py``)
  ``[[sweep.when]]``         conditional settings: ``match = {algorithm = "dp-fedavg", dataset = "tv16"}``
                             and any RunConfig fields, applied to every point that matches (in order)
  ``[[sweep.variants]]``     named configurations, one more axis of the product: ``name = "label"``
                             and any RunConfig fields (the name is the table's ``variant`` column)
  ``[[sweep.exclude]]``      drop every point that matches: ``algorithm = ["a", "b"]``, ``problem =
                             "mlp"`` (a list: any of its values; ``variant`` names a variant)
  any RunConfig field        a non-empty list of values (an axis of the product)

  A plugin runner may declare its own settings (``register_runner(..., settings={name: default})``,
  e.g. a simulated family's records per user): they are keys and axes of a sweep like RunConfig
  fields, checked against the default's type, and part of the run key of that runner's points.

  A ``[report]`` table makes the sweep file a study: ``fedkl report FILE.toml`` writes its markdown
  and figures from the table (:mod:`fedkl.experiments.report`).

  Relative paths (``table``, ``runs_dir``, ``plugins``) are relative to the folder ``fedkl sweep``
  runs in (the repository root for the files under ``simulations/``). ``--set FIELD=V1,V2``
  replaces an axis from the command line and ``--table`` the table (``make bench QUICK=1`` uses both).

  The non-private reference (``reference = true``) depends only on (dataset, seed, users, problem,
  reg): the sweep computes it once per such key and reuses it for the other runs (and across a
  resume, from the JSON lines).
* ``fedkl report STUDY.toml`` — a study's report from its table: a built-in kind (``table``,
  ``curve``, ``slope``) or a report function loaded by file path (:mod:`fedkl.experiments.report`).
* A table in which two ok rows are the same run (same run key, or the same configuration columns)
  is refused by ``fedkl plot`` and ``fedkl report``: summaries never average duplicates.
* ``fedkl plot TABLE.csv --kind privacy-utility|slope`` — PNG figures of a table: the test metric
  against epsilon per algorithm and dataset, or a log-log plot of an error column against ``users``
  with fitted and theory slopes (:mod:`fedkl.experiments.plot`); ``--markdown`` writes the numbers
  as a table.

Metrics in the tables are computed on held-out records for evaluation only: they are NOT private.

The modules, each importing only those listed before it:

* :mod:`fedkl.experiments.config` — :class:`ConfigError`, checking a TOML value as its ``fedkl run``
  flag would, reading TOML, ``fedkl run --config``;
* :mod:`fedkl.experiments.runners` — external runners (:func:`register_runner`,
  :data:`EXTERNAL_RUNNERS`, their results :func:`runner_result`), plugin loading (:func:`load_plugin`), a point's resolved settings;
* :mod:`fedkl.experiments.table` — the result table: its columns, one row per run, durable appends;
* :mod:`fedkl.experiments.sweep` — sweep files (:func:`load_sweep`), run keys (:func:`run_key`),
  running a sweep (:func:`run_sweep`);
* :mod:`fedkl.experiments.plot` — figures and markdown summaries of a table (:func:`plot_table`);
* :mod:`fedkl.experiments.report` — study reports (:func:`run_report`, :class:`Study`).
"""

from __future__ import annotations

from fedkl.experiments.config import ConfigError, apply_config_file
from fedkl.experiments.plot import plot_table
from fedkl.experiments.report import run_report
from fedkl.experiments.runners import EXTERNAL_RUNNERS, load_plugin, register_runner, runner_result
from fedkl.experiments.sweep import load_sweep, run_key, run_sweep

__all__ = [
    "EXTERNAL_RUNNERS",
    "ConfigError",
    "apply_config_file",
    "load_plugin",
    "load_sweep",
    "plot_table",
    "register_runner",
    "run_key",
    "run_report",
    "run_sweep",
    "runner_result",
]
