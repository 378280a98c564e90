"""The algorithm contract (issue 29): an algorithm is ONE class, declared once and read by the runner,
the CLI, the planner, the audit and the tests (no other table names an algorithm).

* :class:`Algorithm` — the base class. Its class attributes are the declarations: ``name``, ``Params``
  (the ONLY configuration: defaults, help, origin, choices), ``guarantee``, ``absence`` (how an absent,
  failed or non-finite user enters each release), ``clients_see``, ``step_size``, ``sums_only``
  (``--secagg``), ``noise_state``, ``small`` (the fast test setting) and ``audit``
  (the CI audit setting). Its hooks (``needs``, ``forecast``, ``warnings``, ``plan_schedule``, ``sigma``,
  ``gaussian_releases_only``) have defaults, so the runner calls them unconditionally.
  ``Algorithm(params, budget)`` sizes its noise once from the :class:`BuildContext`; it never reads
  the ledger. Research code builds one as the CLI does::

      alg = NoisyGD(NoisyGDParams(rounds=10), BuildContext.fresh(problem, feature_bound, users, eps=2, delta=1e-5))

  and gets the CLI's defaults (``Params`` is the one place they live).
* :class:`AlgorithmParams` — the base of every ``Params`` dataclass, with :func:`param` fields and the
  shared mixins (:class:`Rounds`, :class:`StepSize`, :class:`Clip`, ...): one definition per name.
* :class:`AlgorithmResult`, :class:`BuildContext`, :class:`SmallAudit`, :class:`Need` (what ``needs()`` declares),
  :class:`PlannedRelease` (what ``plan_schedule()`` declares).

:func:`fedkl.algorithms.registry.register` decorates the class and refuses an incomplete one at import.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Mapping, NamedTuple, Sequence, TypeVar

from fedkl.privacy.charges import ApproxDPCharge, Charge, GaussianCharge, Need
from fedkl.privacy.guarantee import RELEASED_MODELS, Absence, ClientView, Guarantee
from fedkl.privacy.ledger import Budget, BudgetExceeded

if TYPE_CHECKING:
    import torch

    from fedkl.federation.base import Federation
    from fedkl.privacy.release import Releaser

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


@dataclass
class ModelResult(AlgorithmResult):
    """The result of an algorithm that reports only :class:`AlgorithmResult`'s attributes: the model ``w``
    and, where the algorithm states them, the others (None where it does not; ``sigma`` a number or a list)."""

    w: torch.Tensor | None
    rounds: int | None = None
    sigma: float | list[float] | None = None
    rho_spent: float | None = None
    details: dict | None = None
    history: list[dict] | None = None


class PlannedRelease(NamedTuple):
    """One ledger release of a run's plan (:meth:`Algorithm.plan_schedule`): its label, typed charge and the
    ids of the users it charges, each as the run's own release will have them."""

    label: str
    charge: Charge
    user_ids: Sequence[str]


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

    @classmethod
    def fresh(
        cls,
        *,
        eps: float | None = None,
        delta: float | None = None,
        rho: float | None = None,
        user_ids: Sequence[str] = (),
        problem: Any = None,
        feature_bound: float = 1.0,
        neighbouring: str = "replace-one",
        conversion: str = "cks",
        seed: int = 0,
    ) -> BuildContext:
        """The context of a fresh budget, for code that builds an algorithm directly (as ``fedkl run`` does
        on a new ledger): ``eps`` and ``delta`` (rho then follows by ``conversion``), or a zCDP ``rho`` alone
        (no (eps, delta) left: for the zCDP algorithms)."""
        if (eps is None) != (delta is None) or (eps is None) == (rho is None):
            raise ValueError("give eps and delta, or rho alone")
        if rho is None:
            rho, approx = Budget(eps, delta, conversion).rho, (float(eps), float(delta))
        else:
            approx, delta = (0.0, 0.0), 0.0
        return cls(problem, feature_bound, tuple(user_ids), delta, float(rho), approx, conversion, neighbouring, seed)

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


@dataclass(frozen=True)
class SmallAudit:
    """One algorithm's small many-run audit (``fedkl audit``, the CI audit of every registered algorithm,
    simulations/studies/audit.toml): claimed ``epsilon``, ``runs`` per dataset, the pair's ``users``
    ordinary users of ``records`` records (+ the outlier), and its own ``settings`` (``fedkl run``
    settings, over :data:`fedkl.audit.settings.AUDIT_DEFAULTS`)."""

    epsilon: float = 0.5
    runs: int = 40
    users: int = 40
    records: int = 10
    settings: Mapping[str, Any] = field(default_factory=dict)


# run-level settings (not hyperparameters) that an algorithm's ``small`` / ``audit`` setting may name
RUN_SETTINGS = frozenset({"users", "reg", "neighbouring", "epsilon", "seed", "rounds", "lr", "clip"})

P = TypeVar("P", bound=AlgorithmParams)


class Algorithm(ABC, Generic[P]):
    """One private algorithm (module docstring). Subclasses declare the class attributes below (``name``,
    ``Params``, ``guarantee``, ``absence``, ``small``, ``audit`` are required: ``@register`` refuses a
    class without them), call ``super().__init__(params, ctx)`` and implement :meth:`run`."""

    name: ClassVar[str]
    Params: ClassVar[type]
    guarantee: ClassVar[Guarantee]
    # how an absent, failed or non-finite user enters each released quantity, per relation and backend
    absence: ClassVar[Absence | tuple[Absence, ...]]
    small: ClassVar[Mapping[str, Any]]  # a small fast `fedkl run` setting (tests: every query and release kind)
    audit: ClassVar[SmallAudit]  # the CI audit's setting
    clients_see: ClassVar[ClientView | Callable[[Any], ClientView]] = RELEASED_MODELS
    step_size: ClassVar[float | None] = None  # the default lr, exactly when Params has StepSize's lr
    # True (or a function of the params) when only sums of clipped answers are asked for (--secagg)
    sums_only: ClassVar[bool | Callable[[Any], bool]] = False
    # a release's noise depends on draws made for earlier releases (recovery replays them; register's doc)
    noise_state: ClassVar[bool] = False
    # its proof holds when users compute in float32: every sensitivity comes from L2-clipped answers
    # (clip_rows enforces the bound exactly in float32) added and noised in float64 at the server, whose
    # iterate is float64. --dtype float32 is refused otherwise, and a torch model then runs float64
    # (fedkl.runner.problem_dtype)
    float32: ClassVar[bool] = False
    # every zCDP release is Gaussian (the exact Gaussian conversion applies); an instance may say otherwise
    gaussian_releases_only: bool = True
    # the noise std of its releases when one number says it (the budget line, the forecast), else None
    sigma: Any = None

    def __init__(self, params: P, ctx: BuildContext) -> None:
        if not isinstance(params, self.Params):
            raise TypeError(f"{self.name}: params must be {self.Params.__name__}, got {type(params).__name__}")
        self.params: P = self.resolve(params)
        self.ctx = ctx

    def needs(self, user_ids: Sequence[str]) -> Sequence[Need]:
        """What the run on ``user_ids`` will charge each cohort in all (:class:`Need`), from public values only:
        :func:`fedkl.runner.train_federation` checks it once against the ledger (``PrivacyLedger.check``)
        before any data is read. A research run that calls :meth:`run` directly skips that check: the ledger
        still refuses every over-budget charge when it is made, so such a run may stop half-way.
        Default: the budget it was built with (``ctx``), to every user; an algorithm that charges some users
        less, or not at all, says so here (tests/test_needs_every_algorithm.py compares it with the run's
        charges); an adaptive one states the bound it is sized to."""
        if self.guarantee.charges == "zcdp":
            return (Need(tuple(user_ids), GaussianCharge(self.ctx.rho_left)),)
        return (Need(tuple(user_ids), ApproxDPCharge(*self.ctx.approx_left, mechanism="declared-needs")),)

    @classmethod
    def resolve(cls, params: P) -> P:
        """``params`` with the step size left unset (``lr`` None: StepSize's "the algorithm's own") set to the
        declared ``step_size`` (``@register`` checked that Params have an lr exactly when it is declared)."""
        if cls.step_size is not None and params.lr is None:
            return dataclasses.replace(params, lr=cls.step_size)
        return params

    def forecast(self, n: int, w0: torch.Tensor, user_ids: Sequence[str] | None = None) -> dict | None:
        """The first release's public noise-to-signal forecast (output perturbation), or None."""
        return None

    def warnings(self) -> Sequence[str]:
        """Warnings about public settings, printed before any budget is spent."""
        return ()

    def plan_schedule(self) -> tuple[int, Callable[[int], str]] | Sequence[PlannedRelease] | None:
        """The run's ledger releases from public values, when they follow a schedule (the plan's dry run then
        stops at its second release and checks what it made against this, fedkl.runner._ScheduleCut), else
        None (the whole dry run). Either ``(count, label)``: ``count`` releases, release ``k`` labelled
        ``label(k)`` with release 0's charge and cohort (``count`` 1: the run charges once, before its first
        step of a schedule charged up front, :meth:`fedkl.privacy.release.Releaser.scheduled_step`); or every
        release in order as :class:`PlannedRelease` (the charges and cohorts may differ: dp-ftrl). A claim
        the run's own code does not keep is a test failure (tests/test_plan_schedule.py)."""
        return None

    @abstractmethod
    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> AlgorithmResult:
        """Train through ``federation``, releasing only through ``releaser``."""
