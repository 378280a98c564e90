"""External runners: baselines that are not fedkl algorithms (e.g. Flower's own DP strategy), which
a sweep trains like an algorithm; and plugins, the files or modules that register them.

A plugin (``[sweep] plugins`` of a sweep file) is imported before the sweep's values are checked
and calls :func:`register_runner`; the runner's name is then a valid ``algorithm`` of that sweep.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedkl.experiments.config import ConfigError, run_fields


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

VARIANT = "variant"
"""The key (and table column) of a sweep point's ``[[sweep.variants]]`` name: a label, not a setting."""


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


def flat_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with every other ``fedkl run`` setting at its default: what an external runner reads
    (as attributes) and what identifies a row of one."""
    return {**{name: f.default for name, f in run_fields().items()}, **cfg}


def resolved_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a sweep point resolves to, ``out`` and ``ledger`` excluded: a fedkl algorithm's
    RunConfig (a hyperparameter of other algorithms only is dropped: a sweep's base may set it for
    some of its points), or an external runner's flat settings."""
    from fedkl.runner import RunConfig

    point = {k: v for k, v in cfg.items() if k not in ("out", "ledger", VARIANT)}
    if point.get("algorithm") in EXTERNAL_RUNNERS:
        full = flat_settings(point)
    else:
        full = RunConfig.from_settings(strict=False, **point).settings()
    full.pop("out", None), full.pop("ledger", None)
    return full
