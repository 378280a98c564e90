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
from dataclasses import dataclass, field
from typing import Any

from fedkl.experiments.config import ConfigError, run_fields


@dataclass(frozen=True)
class ExternalRunner:
    """``fn(settings, log) -> dict``, ``settings`` a namespace with every ``fedkl run`` setting as an
    attribute (:func:`flat_settings`: the point's values, the rest at their defaults), returning a result like ``run_training``'s (at least
    algorithm, dataset, users, epsilon, delta, test_metric, test_metrics, nonprivate_reference,
    trivial_baseline, seed, rounds); ``columns``: extra result keys (``payload["table_extra"]``)
    that become table columns; ``settings``: the runner's own settings beyond ``fedkl run``'s, name ->
    default (an int, float, str or bool; a value is checked against the default's type), which a sweep
    accepts as keys and axes for this runner's points (e.g. a simulated family's records per user)."""

    fn: Callable[..., dict]
    columns: tuple[str, ...] = ()
    description: str = ""
    settings: Mapping[str, Any] = field(default_factory=dict)


EXTERNAL_RUNNERS: dict[str, ExternalRunner] = {}

VARIANT = "variant"
"""The key (and table column) of a sweep point's ``[[sweep.variants]]`` name: a label, not a setting."""


def register_runner(
    name: str,
    fn: Callable[..., dict],
    columns: Sequence[str] = (),
    description: str = "",
    settings: Mapping[str, Any] | None = None,
) -> None:
    from fedkl.algorithms.catalog import REGISTRY

    if name in REGISTRY:
        raise ValueError(f"{name!r} is a fedkl algorithm; an external runner needs another name")
    settings = dict(settings or {})
    fields = run_fields()
    for key, default in settings.items():
        if key in fields or key == VARIANT:
            raise ValueError(f"runner {name!r}: setting {key!r} is already a fedkl run setting")
        if not isinstance(default, (int, float, str, bool)):
            raise ValueError(f"runner {name!r}: setting {key!r} needs an int, float, str or bool default")
    EXTERNAL_RUNNERS[name] = ExternalRunner(fn, tuple(columns), description, settings)


def runner_result(
    algorithm: str,
    dataset: str,
    users: int,
    epsilon: float | None,
    delta: float | None,
    seed: int,
    rounds: int | None,
    table_extra: Mapping[str, Any],
    **more: Any,
) -> dict:
    """An external runner's result with run_training's keys and, unless ``more`` gives them, no test
    metric, non-private reference or trivial baseline (a measurement that is not a trained model: an
    accounting, a sampled law, an evaluation harness); ``table_extra`` becomes table columns, ``more``
    adds or overrides keys (e.g. ``test_metric``, a learning curve kept in the JSON lines)."""
    return {
        "algorithm": algorithm,
        "dataset": dataset,
        "users": users,
        "epsilon": epsilon,
        "delta": delta,
        "test_metric": None,
        "test_metrics": {},
        "nonprivate_reference": None,
        "trivial_baseline": {},
        "seed": seed,
        "rounds": rounds,
        "table_extra": dict(table_extra),
        **more,
    }


def runner_settings() -> dict[str, Any]:
    """Every registered runner's own settings, name -> default (the keys a sweep accepts beyond
    ``fedkl run``'s)."""
    out: dict[str, Any] = {}
    for runner in EXTERNAL_RUNNERS.values():
        out.update(runner.settings)
    return out


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
    """``cfg`` with every other ``fedkl run`` setting, and every other setting of its runner, at its
    default: what an external runner reads (as attributes) and what identifies a row of one."""
    runner = EXTERNAL_RUNNERS.get(cfg.get("algorithm"))
    own = dict(runner.settings) if runner is not None else {}
    return {**{name: f.default for name, f in run_fields().items()}, **own, **cfg}


def resolved_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a sweep point resolves to, ``out`` and ``ledger`` excluded: a fedkl algorithm's
    RunConfig (a hyperparameter of other algorithms only is dropped: a sweep's base may set it for
    some of its points), or an external runner's flat settings."""
    from fedkl.runner import RunConfig

    point = {k: v for k, v in cfg.items() if k not in ("out", "ledger", VARIANT)}
    if point.get("algorithm") in EXTERNAL_RUNNERS:
        full = flat_settings(point)
    else:  # another runner's own settings (in a sweep's base) do not apply to a fedkl algorithm
        fields = run_fields()
        full = RunConfig.from_settings(strict=False, **{k: v for k, v in point.items() if k in fields}).settings()
    full.pop("out", None), full.pop("ledger", None)
    if full.get("dtype") == "auto":  # the default (issue 33): run keys of tables made before --dtype stay valid
        full.pop("dtype")
    return full
