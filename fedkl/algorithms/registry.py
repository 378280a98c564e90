"""The algorithm contract: every private algorithm fedkl runs is one registered entry.

An entry is ``(name, Params, build)``:

* ``Params`` — a frozen dataclass of the algorithm's user-facing hyperparameters, built from
  :class:`AlgorithmParams`; each field is declared with :func:`param` (default, ``--help`` text,
  whether the value is the theorem's or a heuristic, and its choices). It is the ONLY place a
  hyperparameter's default lives: the ``fedkl run`` flags, the TOML keys, the sweep axes and
  :class:`fedkl.runner.RunConfig` are generated from it. Algorithms that share a hyperparameter
  (``rounds``, ``radius``, ...) inherit the same field from one mixin class; :func:`register`
  refuses two different definitions of one name.
* ``build(params, context) -> algorithm`` — the algorithm object for one run: it has the class
  attribute ``guarantee`` (:class:`fedkl.privacy.guarantee.Guarantee`), optionally
  ``forecast(n, w0, user_ids)`` (public values only) and ``run(federation, releaser, w0, progress)``
  whose result has ``.w`` (None: the algorithm released "no output").
  :class:`BuildContext` holds the run-level, public values a builder may use (problem constants,
  the population, the run's seed and relation) and the budget the users can still afford, read
  from the ledger by the runner: algorithms never read the ledger.

Adding an algorithm is one module with a ``Params`` class and a decorated builder, plus its import
line in :mod:`fedkl.algorithms.catalog` (then ``python -m fedkl.flags``: the catalog file names the module
that registers each algorithm, which a run imports alone; see :class:`_Registry`)::

    @dataclass(frozen=True)
    class MyParams(Rounds, StepSize, Clip):
        momentum: float = param(0.0, "server momentum", "heuristic")

    @register("my-gd", MyParams, step_size=1.0)  # StepSize's lr: each algorithm names its default
    def build(params: MyParams, ctx: BuildContext):
        return MyGD(params, ctx.rho_left)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from fedkl.algorithms.contract import (
    MAX_APPROX_EPSILON,
    ORIGINS,
    RUN_SETTINGS,
    Algorithm,
    AlgorithmParams,
    AlgorithmResult,
    BuildContext,
    Clip,
    Domain,
    PoissonSampling,
    Rounds,
    SmallAudit,
    StabilityDelta,
    StepSize,
    _base_type,
    param,
)
from fedkl.privacy.guarantee import Absence, ClientView, Guarantee, absence_for, check_absence


@dataclass(frozen=True)
class AlgorithmSpec:
    """The registry's view of one :class:`~fedkl.algorithms.contract.Algorithm` class: every value is read from
    the class's declarations (nothing is copied), plus its ``absence`` rules as ``register`` checked and
    normalised them (a tuple of :class:`~fedkl.privacy.guarantee.Absence`)."""

    cls: type
    absence: tuple[Absence, ...]

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def params(self) -> type:
        """The Params class (the only configuration)."""
        return self.cls.Params

    @property
    def build(self) -> Callable[[Any, BuildContext], Any]:
        """``build(params, ctx)``: the class itself."""
        return self.cls

    @property
    def client_view(self) -> ClientView | Callable[[Any], ClientView]:
        return self.cls.clients_see

    @property
    def step_size(self) -> float | None:
        """The default ``lr`` of an algorithm whose Params have one."""
        return self.cls.step_size

    @property
    def noise_state(self) -> bool:
        """Whether a release's noise depends on draws made for earlier releases (register's doc)."""
        return self.cls.noise_state

    @property
    def small(self) -> dict:
        """The class's fast test setting."""
        return dict(self.cls.small)

    @property
    def audit(self) -> SmallAudit:
        """The class's CI audit setting."""
        return self.cls.audit

    @property
    def guarantee(self) -> Guarantee:
        """The algorithm's declared :class:`~fedkl.privacy.guarantee.Guarantee` (its class attribute)."""
        return self.cls.guarantee

    def absence_rule(self, label: str, relation: str, backend: str) -> Absence:
        """The declared :class:`~fedkl.privacy.guarantee.Absence` of release ``label`` under ``relation``
        on ``backend`` (``"inprocess"`` or ``"flower"``)."""
        return absence_for(self.absence, label, relation, backend)

    def sums_only(self, params: Any) -> bool:
        """Whether a run with ``params`` needs nothing but sums of clipped answers, so that it can
        aggregate through secure aggregation (``--secagg``); False for an algorithm that needs per-user
        values (the deletion tests of paper 002, per-user norms, adaptive clipping's per-user flags)."""
        declared = self.cls.sums_only
        return declared if isinstance(declared, bool) else bool(declared(params))

    def clients_see(self, params: Any) -> ClientView:
        """What a participating client receives in a run with ``params`` (the one declaration that
        ``--help``, result.json's ``clients_see`` and the README state)."""
        return self.client_view if isinstance(self.client_view, ClientView) else self.client_view(params)

    def resolve(self, params: Any) -> Any:
        """``params`` with the step size left unset (``lr`` None) set to this algorithm's default
        (:meth:`fedkl.algorithms.contract.Algorithm.resolve`, the rule the class's constructor applies)."""
        return self.cls.resolve(params)

    @property
    def summary(self) -> str:
        doc = (self.build.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


_CATALOG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flags_catalog.json")


@functools.lru_cache(maxsize=1)
def _catalog() -> dict:
    try:
        with open(_CATALOG) as f:
            return json.load(f)
    except (OSError, ValueError):  # no catalog file (being rewritten): every lookup loads all
        return {}


def builtin_modules() -> dict[str, str]:
    """Every built-in algorithm's name -> the module that registers it, from ``fedkl/flags_catalog.json``
    (written from the code by ``python -m fedkl.flags``; tests/test_flags_catalog.py keeps it equal)."""
    entries = _catalog().get("algorithms", {})
    return {name: entry["module"] for name, entry in entries.items() if "module" in entry}


def listed_default(name: str) -> tuple[bool, Any]:
    """``(True, default)`` of a built-in hyperparameter as the catalog file lists it, without importing
    any algorithm; ``(False, None)`` when the file does not list it."""
    entry = _catalog().get("hyperparameters", {}).get(name)
    return (False, None) if entry is None else (True, entry["default"])


class _Registry(dict):
    """``REGISTRY``: algorithm name -> :class:`AlgorithmSpec`, filled on demand (issue 34). Looking up one
    built-in name (``REGISTRY[name]``, ``name in REGISTRY``, ``get``) imports only the module that registers
    it, so a run imports the one algorithm it trains; reading the whole registry (iterating, ``len``,
    ``keys``, ``values``, ``items``) first imports every algorithm (:func:`load_all`), so registry-wide
    readers (``--all`` audits, the planner, the tests) see everything, as before."""

    def _lookup(self, name: object) -> None:
        if dict.__contains__(self, name) or not isinstance(name, str):
            return
        module = builtin_modules().get(name)
        if module is not None:
            importlib.import_module(module)
        else:  # not a built-in the catalog file names (a plug-in's, a typo): look everywhere
            load_all()

    def __getitem__(self, name):
        self._lookup(name)
        return dict.__getitem__(self, name)

    def __contains__(self, name) -> bool:
        self._lookup(name)
        return dict.__contains__(self, name)

    def get(self, name, default=None):
        self._lookup(name)
        return dict.get(self, name, default)

    def __iter__(self):
        load_all()
        return dict.__iter__(self)

    def __len__(self) -> int:
        load_all()
        return dict.__len__(self)

    def keys(self):
        load_all()
        return dict.keys(self)

    def values(self):
        load_all()
        return dict.values(self)

    def items(self):
        load_all()
        return dict.items(self)

    def copy(self) -> dict:
        load_all()
        return dict(dict.items(self))


def load_all() -> None:
    """Import every built-in algorithm (each module the catalog file names; importing
    :mod:`fedkl.algorithms.catalog` does the same from its import list): what a reader of the whole
    registry needs. Looking up one algorithm by name does not."""
    for module in dict.fromkeys(builtin_modules().values()):
        importlib.import_module(module)


def unlisted() -> list[str]:
    """Registered algorithms that are not built in (registered by a plug-in or a test), without loading any."""
    return [name for name in dict.keys(REGISTRY) if name not in builtin_modules()]


REGISTRY: dict[str, AlgorithmSpec] = _Registry()
_FIELDS: dict[str, dataclasses.Field] = {}  # every registered hyperparameter: one definition per name


def register(cls: type) -> type:
    """Class decorator: register an :class:`~fedkl.algorithms.contract.Algorithm` subclass under its
    ``name``, refusing an incomplete declaration at import (:func:`_check_class`), a name already taken, and
    a hyperparameter name already defined differently by another algorithm's Params::

        @register
        class NoisyGD(Algorithm[NoisyGDParams]):
            name = "noisy-gd"
            Params = NoisyGDParams
            ...

    The declarations it reads (fedkl.algorithms.contract.Algorithm): ``step_size`` is the default ``lr``
    (given exactly when Params have :class:`StepSize`'s lr; chosen by simulations/studies/tune_step_sizes.toml
    on public tuning data); ``sums_only``: True (or a function of the params) when the algorithm asks the
    federation only for sums of clipped answers, so ``--secagg`` may serve it; ``noise_state``: True when a
    release's noise depends on the noise drawn for earlier releases, not only through the values released
    (a correlated-noise generator: dp-ftrl's tree, banded and BLT noise) -- crash recovery must then rebuild
    the generator from the very draws the first process made: the run's journal keeps them as a secret and
    the Releaser plays them back (:mod:`fedkl.privacy.journal`); ``absence``: how an absent, failed or
    non-finite user enters each released quantity, per relation and backend (the white-box sensitivity
    search, :mod:`fedkl.audit.whitebox`, reads it for every registered algorithm)."""
    _check_class(cls)
    _add(AlgorithmSpec(cls, check_absence(cls.absence, cls.name)))
    return cls


def _check_params(name: str, params: Any, step_size: float | None) -> None:
    """``params`` is a frozen :class:`AlgorithmParams` dataclass whose every field is a :func:`param`, whose
    lr exists exactly when ``step_size`` is given, and whose hyperparameter names mean what they mean in
    every other registered algorithm."""
    if not (isinstance(params, type) and issubclass(params, AlgorithmParams) and dataclasses.is_dataclass(params)):
        raise TypeError(f"{name}: Params must be a frozen dataclass deriving from AlgorithmParams, got {params!r}")
    has_lr = any(f.name == "lr" for f in dataclasses.fields(params))
    if has_lr != (step_size is not None) or (step_size is not None and not step_size > 0):
        raise TypeError(f"{name}: declare step_size = lr > 0 exactly when its Params have a step size lr")
    for f in dataclasses.fields(params):
        if "help" not in f.metadata:
            raise TypeError(f"{name}: hyperparameter {f.name} is not declared with param(default, help, ...)")
        _base_type(f.type)
        known = _FIELDS.get(f.name)
        if known is not None and known is not f:
            raise ValueError(
                f"{name}: hyperparameter {f.name!r} is already defined by another algorithm's Params; "
                "inherit the same field (a shared mixin) instead of redefining it"
            )


def _check_class(cls: type) -> None:
    """Refuse an incomplete :class:`Algorithm` subclass at import, with one line naming what is missing."""
    label = getattr(cls, "name", cls.__name__)
    if not issubclass(cls, Algorithm):
        raise TypeError(f"{label}: @register decorates a subclass of fedkl.algorithms.contract.Algorithm")
    missing = [a for a in ("name", "Params", "guarantee", "absence", "small", "audit") if a not in dir(cls)]
    if missing:
        raise TypeError(f"{label}: an Algorithm must declare {', '.join(missing)} (fedkl.algorithms.contract)")
    if not isinstance(cls.name, str) or not cls.name:
        raise TypeError(f"{cls.__name__}: name must be a non-empty string")
    if not isinstance(cls.guarantee, Guarantee):
        raise TypeError(f"{label}: guarantee must be a fedkl.privacy.guarantee.Guarantee")
    if not isinstance(cls.audit, SmallAudit):
        raise TypeError(f"{label}: audit must be a fedkl.algorithms.contract.SmallAudit")
    if cls.__abstractmethods__:
        raise TypeError(f"{label}: implement {', '.join(sorted(cls.__abstractmethods__))}")
    _check_params(label, cls.Params, cls.step_size)
    own = {f.name for f in dataclasses.fields(cls.Params)} | RUN_SETTINGS
    for what, setting in (("small", cls.small), ("audit.settings", cls.audit.settings)):
        unknown = sorted(set(setting) - own)
        if unknown:
            raise TypeError(f"{label}: {what} names {unknown}, which are not settings of {cls.Params.__name__}")


def _add(spec: AlgorithmSpec) -> None:
    if dict.__contains__(REGISTRY, spec.name) and dict.__getitem__(REGISTRY, spec.name).cls is not spec.cls:
        raise ValueError(f"algorithm {spec.name!r} is already registered")
    REGISTRY[spec.name] = spec
    for f in dataclasses.fields(spec.params):
        _FIELDS.setdefault(f.name, f)


def unregister(name: str) -> None:
    """Remove ``name`` (tests that register a toy algorithm clean up with this)."""
    spec = REGISTRY.pop(name)
    still = {f.name for s in REGISTRY.values() for f in dataclasses.fields(s.params)}
    for f in dataclasses.fields(spec.params):
        if f.name not in still:
            _FIELDS.pop(f.name, None)


def algorithm_spec(name: str) -> AlgorithmSpec:
    if name not in REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def hyperparameter_fields() -> dict[str, dataclasses.Field]:
    """Every registered hyperparameter, by name (one definition each; loads every algorithm)."""
    load_all()
    return dict(_FIELDS)


def algorithms_using(name: str) -> list[str]:
    return [s.name for s in REGISTRY.values() if name in {f.name for f in dataclasses.fields(s.params)}]


def field_kind(f: dataclasses.Field) -> type:
    return _base_type(f.type)


__all__ = [
    "MAX_APPROX_EPSILON",
    "Algorithm",
    "AlgorithmParams",
    "AlgorithmResult",
    "AlgorithmSpec",
    "BuildContext",
    "Clip",
    "Domain",
    "ORIGINS",
    "PoissonSampling",
    "REGISTRY",
    "Rounds",
    "SmallAudit",
    "StabilityDelta",
    "StepSize",
    "algorithm_spec",
    "algorithms_using",
    "field_kind",
    "hyperparameter_fields",
    "load_all",
    "param",
    "register",
    "unregister",
]
