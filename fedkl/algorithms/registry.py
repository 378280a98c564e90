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
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

from fedkl.privacy.guarantee import RELEASED_MODELS, Absence, ClientView, absence_for, check_absence
from fedkl.privacy.ledger import BudgetExceeded

ORIGINS = ("theorem", "heuristic", "safety limit")
# the largest (eps, delta) budget a builder accepts: the calibrations evaluate e^eps (float64 overflows at ~709)
MAX_APPROX_EPSILON = 700.0


def param(
    default: Any, help: str, origin: str = "heuristic", choices: tuple | None = None, positive: bool = False
) -> Any:
    """A hyperparameter field: its default, its one-sentence help, whether the default is the
    theorem's value (``"theorem"``), a tunable choice (``"heuristic"``) or a work cap (``"safety
    limit"``) (a longer note may follow the word, e.g. ``"theorem at 1"``), its choices, and
    whether it must be > 0 (and finite, unless its default is infinite)."""
    if origin.split(" ")[0] not in {o.split(" ")[0] for o in ORIGINS}:
        raise ValueError(f"origin must start with one of {ORIGINS}, got {origin!r}")
    if choices is not None and default is not None and default not in choices:
        raise ValueError(f"default {default!r} is not among the choices {choices}")
    return dataclasses.field(
        default=default, metadata={"help": help, "origin": origin, "choices": choices, "positive": positive}
    )


def _base_type(annotation: Any) -> type:
    """``int`` / ``float`` / ``str`` / ``bool`` of an annotation such as ``int | None``."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.split("|")[0].strip() == name:
            return kind
    raise TypeError(
        f"unsupported hyperparameter annotation {annotation!r} (use int, float, str or bool, optionally | None)"
    )


@dataclass(frozen=True)
class AlgorithmParams:
    """Base of every algorithm's hyperparameters: checks each value's type and choices (one-line
    errors naming the flag); the algorithm's own configuration checks the ranges."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if value is None:
                if f.default is not None:
                    raise ValueError(f"{flag} must be given (no default of 'none')")
                continue
            kind = _base_type(f.type)
            if kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{flag} must be true or false, got {value!r}")
            elif kind is int:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
                    raise ValueError(f"{flag} must be an integer, got {value!r}")
                object.__setattr__(self, f.name, int(value))
            elif kind is float:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                    raise ValueError(f"{flag} must be a number, got {value!r}")
                object.__setattr__(self, f.name, float(value))
            elif not isinstance(value, str):
                raise ValueError(f"{flag} must be a string, got {value!r}")
            if f.metadata.get("positive") and not (value > 0 and (math.isfinite(value) or f.default == math.inf)):
                raise ValueError(
                    f"{flag} must be > 0" + ("" if f.default == math.inf else " and finite") + f", got {value}"
                )
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")


class AlgorithmResult:
    """The one result type: every algorithm's ``run`` returns an instance of a subclass (a dataclass
    with the fields it has). The runner and the transports read only these attributes:

    * ``w`` — the released model (a private output), or None when the algorithm released ⊥;
    * ``rounds`` — federated rounds (queries to the users), ``sigma`` — the noise std of its releases
      (a number or a list), ``rho_spent`` — the zCDP it charged, when it speaks zCDP;
    * ``details`` — public parameters and labelled non-private diagnostics (result.json's
      ``algorithm_details``), ``history`` — per-round records.

    An attribute of this list that a subclass does not define reads as None (through
    ``__getattr__``, so that the subclasses' dataclass fields keep their own defaults)."""

    _OPTIONAL = frozenset({"w", "rounds", "sigma", "rho_spent", "details", "history"})

    def __getattr__(self, name: str):
        if name in AlgorithmResult._OPTIONAL:
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@dataclass(frozen=True)
class BuildContext:
    """What a builder may read besides its Params: public run-level values and the budget left.

    ``rho_left``: the zCDP budget every user can still afford under the run's conversion;
    ``approx_left``: the (eps, delta) every user can still afford (basic composition in the ledger);
    ``conversion``: the budget's zCDP -> (eps, delta) conversion; ``delta``: the run's delta;
    ``neighbouring``: the user-level relation; ``seed``: the run's public seed (cohort hashing)."""

    problem: Any
    feature_bound: float
    user_ids: tuple
    delta: float
    rho_left: float
    approx_left: tuple[float, float]
    conversion: str
    neighbouring: str
    seed: int

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    def approx_budget(self) -> tuple[float, float]:
        """``approx_left``, refusing a spent budget (BudgetExceeded before any data is read) and an
        epsilon above :data:`MAX_APPROX_EPSILON` (ValueError: the calibrations need e^eps)."""
        eps, delta = self.approx_left
        if eps <= 0 or delta <= 0:
            raise BudgetExceeded("the users' (eps, delta) budget is spent; nothing to train with")
        if eps > MAX_APPROX_EPSILON:
            raise ValueError(
                f"epsilon={eps:g} is beyond what the (eps, delta) calibrations compute (e^eps overflows above "
                f"{MAX_APPROX_EPSILON:g}); noise this small gives no meaningful privacy: use a smaller epsilon"
            )
        return eps, delta


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    params: type
    build: Callable[[Any, BuildContext], Any]
    client_view: ClientView | Callable[[Any], ClientView] = RELEASED_MODELS
    step_size: float | None = None  # the default ``lr`` of an algorithm whose Params have one
    # whether the algorithm needs only sums of clipped answers (``--secagg``), or a function of the params
    secagg: bool | Callable[[Any], bool] = False
    # whether a release's noise depends on draws made for earlier releases (register's ``noise_state``)
    noise_state: bool = False
    # how an absent, failed or non-finite user enters each released quantity (register's ``absence``)
    absence: tuple[Absence, ...] = ()

    def absence_rule(self, label: str, relation: str, backend: str) -> Absence:
        """The declared :class:`~fedkl.privacy.guarantee.Absence` of release ``label`` under ``relation``
        on ``backend`` (``"inprocess"`` or ``"flower"``)."""
        return absence_for(self.absence, label, relation, backend)

    def sums_only(self, params: Any) -> bool:
        """Whether a run with ``params`` needs nothing but sums of clipped answers, so that it can
        aggregate through secure aggregation (``--secagg``); False for an algorithm that needs per-user
        values (the deletion tests of paper 002, per-user norms, adaptive clipping's per-user flags)."""
        return self.secagg if isinstance(self.secagg, bool) else bool(self.secagg(params))

    def clients_see(self, params: Any) -> ClientView:
        """What a participating client receives in a run with ``params`` (the one declaration that
        ``--help``, result.json's ``clients_see`` and the README state)."""
        return self.client_view if isinstance(self.client_view, ClientView) else self.client_view(params)

    def resolve(self, params: Any) -> Any:
        """``params`` with the step size left unset (``lr`` None) set to this algorithm's default."""
        if self.step_size is not None and getattr(params, "lr", 0.0) is None:
            return dataclasses.replace(params, lr=self.step_size)
        return params

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


def register(
    name: str,
    params: type,
    client_view: ClientView | Callable[[Any], ClientView] = RELEASED_MODELS,
    *,
    step_size: float | None = None,
    secagg: bool | Callable[[Any], bool] = False,
    noise_state: bool = False,
    absence: Absence | tuple[Absence, ...] | None = None,
) -> Callable:
    """Decorator: register ``build(params, ctx)`` as algorithm ``name`` with hyperparameters
    ``params`` (an :class:`AlgorithmParams` dataclass) and what a participating client sees
    (``client_view``: a :class:`~fedkl.privacy.guarantee.ClientView`, or a function of the params;
    default: the released models only). Refuses a second algorithm of the same name and a
    hyperparameter name already defined differently by another algorithm's Params.

    ``step_size``: the algorithm's default ``lr`` (required when its Params have the shared
    :class:`StepSize` field, whose own default None means "the algorithm's"); each algorithm's value
    was chosen by simulations/studies/tune_step_sizes.toml on public tuning data.

    ``secagg``: True (or a function of the params) when the algorithm asks the federation only for
    sums of clipped answers (``federation.sum`` and ``Answers.total()``), so ``--secagg`` may serve it
    (:meth:`AlgorithmSpec.sums_only`).

    ``noise_state``: True when a release's noise depends on the noise drawn for earlier releases, not only
    through the values released (a correlated-noise generator: dp-ftrl's tree, banded and BLT noise).
    Crash recovery must then rebuild the generator from the very draws the first process made: the run's
    journal keeps them as a secret and the Releaser plays them back (:mod:`fedkl.privacy.journal`,
    :class:`~fedkl.privacy.release.Releaser`); recovery with re-drawn noise would correlate later noise with
    draws that were never released. An algorithm whose state depends on earlier draws only through released
    values (and charges computed from them) needs nothing: those are journalled before any ledger write.

    ``absence`` (required): how an absent, failed or non-finite user enters each released quantity, per
    relation and backend (:class:`~fedkl.privacy.guarantee.Absence`; the white-box sensitivity search,
    :mod:`fedkl.audit.whitebox`, reads it for every registered algorithm)."""
    if absence is None:
        raise TypeError(
            f"{name}: register(..., absence=Absence(...)) is required: say how an absent, failed or "
            "non-finite user enters each released quantity (fedkl.privacy.guarantee.Absence)"
        )
    absence = check_absence(absence, name)
    has_lr = any(f.name == "lr" for f in dataclasses.fields(params)) if dataclasses.is_dataclass(params) else False
    if has_lr != (step_size is not None) or (step_size is not None and not step_size > 0):
        raise TypeError(f"{name}: give register(..., step_size=lr > 0) exactly when its Params have a step size lr")
    if not (isinstance(params, type) and issubclass(params, AlgorithmParams) and dataclasses.is_dataclass(params)):
        raise TypeError(f"{name}: params must be a frozen dataclass deriving from AlgorithmParams, got {params!r}")
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

    def decorate(build: Callable) -> Callable:
        if name in REGISTRY and REGISTRY[name].build is not build:
            raise ValueError(f"algorithm {name!r} is already registered")
        REGISTRY[name] = AlgorithmSpec(
            name, params, build, client_view, step_size, secagg, absence=absence, noise_state=noise_state
        )
        for f in dataclasses.fields(params):
            _FIELDS.setdefault(f.name, f)
        return build

    return decorate


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


# ---- hyperparameters shared by several algorithms: one definition each ----


@dataclass(frozen=True)
class Rounds(AlgorithmParams):
    rounds: int = param(10, "federated rounds", "heuristic", positive=True)


@dataclass(frozen=True)
class StepSize(AlgorithmParams):
    lr: float | None = param(
        None,
        "step size (default: the algorithm's own, chosen on public tuning data by simulations/studies/tune_step_sizes.toml; "
        "`fedkl run --algorithm NAME --help` shows it)",
        "heuristic",
        positive=True,
    )


@dataclass(frozen=True)
class Clip(AlgorithmParams):
    clip: float = param(1.0, "per-user gradient clip norm C", "heuristic", positive=True)


@dataclass(frozen=True)
class PoissonSampling(AlgorithmParams):
    sampling_rate: float = param(1.0, "Poisson user sampling rate q (1: everyone every round)", "heuristic")
    accountant: str = param(
        "pld", "dp-accounting accountant of the sampled Gaussian schedule", "theorem", choices=("pld", "rdp")
    )


@dataclass(frozen=True)
class StabilityDelta(AlgorithmParams):
    stability_delta: float = param(
        0.5,
        "paper-002 deletion-stability threshold Delta (sc-output-pert; the phased "
        "algorithms with --p002-delta-rule fixed: Delta_1)",
        "heuristic",
        positive=True,
    )


@dataclass(frozen=True)
class Domain(AlgorithmParams):
    radius: float | None = param(
        None,
        "paper-002 phased, paper-003 and gll-phased-sgd: the domain K = {||w|| <= RADIUS}; iterates and released "
        "centres are projected onto K (paper 002's default: G0/reg when --reg > 0, the ball that holds every "
        "phase minimizer, else 10 for a loss Lipschitz on all of R^d; needed where the loss is Lipschitz only "
        "on a bounded domain, e.g. least squares without --reg)",
        "theorem",
    )
    distance: float | None = param(
        None,
        "paper-002 phased, paper-003 and gll-phased-sgd: a public bound D >= ||w0 - w*|| (paper 002: in lambda*; "
        "paper 003: the step sizes) (default RADIUS + ||w0||)",
        "theorem",
    )


__all__ = [
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
