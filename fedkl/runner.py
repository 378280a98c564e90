"""``fedkl run``: one user-level DP training, end to end, with its result file and ledger.

What is private and what is not (also docs/concepts/guarantee.md):
* private (user-level, under the stated relation and budget): every released noisy sum, hence the
  iterates and the final model;
* NOT private, reported for evaluation only: the test metrics (computed on held-out records of the
  same users), the non-private reference model's metrics and the trivial baseline. A deployment
  keeps these off the wire or privatizes them separately.

Training through a federation (:func:`train_federation`)
--------------------------------------------------------
It trains through ``federation`` with the ledger, filter and noise in this process, from ``w0``
(default: the problem's initial parameters). Returns the algorithm's result, the ledger summary
and the algorithm's declared :class:`Guarantee`.

``journal``: a path, where this run's release journal is created (what ``--recover`` needs), or
an open :class:`ReleaseJournal` of a run whose process died: then this call recovers that run
(``run_id`` must be its id; :class:`fedkl.privacy.release.Releaser`); ``journal_header``: more
header entries for a new journal; ``scratch``: ``ledger_path`` is a throw-away ledger (no fsync);
``releaser_type``: the Releaser class (the white-box audit's recording one, :mod:`fedkl.audit.whitebox`;
the plan's dry run's, :class:`_ScheduleCut`).

The steps, in order (nothing is read from the users' data and nothing is charged before the last
refusal): :func:`_open_ledger`, :func:`_reserve`, :func:`build_algorithm` (refuses a relation the
guarantee does not cover), :func:`_afford` (the algorithm's declared needs), :func:`_refuse` (trust, conversion, forecast; then the warnings),
:func:`_open_journal` and :func:`_open_releaser`, :func:`_train`, :func:`_close`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from fedkl.algorithms.contract import Clip, PlannedRelease, PoissonSampling, Rounds, StepSize
from fedkl.algorithms.forecast import LEARNS_LITTLE, gradient_forecast, learns_little_threshold, network_step_warning
from fedkl.algorithms.nonprivate import fedavg_plan
from fedkl.algorithms.registry import (
    REGISTRY,
    AlgorithmParams,
    AlgorithmResult,
    BuildContext,
    algorithm_spec,
    algorithms_using,
    builtin_modules,
    hyperparameter_fields,
    listed_default,
)
from fedkl.algorithms.round_log import public_history
from fedkl.data import FederatedDataset, load_dataset
from fedkl.data.files import DATA_SETTINGS, dataset_kwargs, is_data_file
from fedkl.data.standin import STANDIN_RECORDS, public_standin
from fedkl.federation.base import Federation
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, BudgetExceeded, LedgerError, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.charges import to_record
from fedkl.privacy.clients import FEDKL_CLIENTS, TRUST_MODELS, assumption, require_trust
from fedkl.privacy.guarantee import RELATION_TEXT, Guarantee
from fedkl.privacy.journal import JournalError, ReleaseJournal
from fedkl.privacy.ledger import cohort_digest
from fedkl.problems import DEFAULT_PROBLEM, DTYPES, default_dtype, make_problem, problem_spec
from fedkl.problems.rowwise import KERNEL_MODES, kernels
from fedkl.results import reference_metrics, write_json, write_round_metrics
from fedkl.saved_model import SavedModel, check_resume, public_settings

# the built-in algorithms (re-exported), from the catalog file: a run imports only the one it trains
ALGORITHMS = tuple(builtin_modules())
BACKENDS = ("inprocess", "flower-local", "flower-sim", "grpc", "ray-shards")
FAST_BACKENDS = ("inprocess", "ray-shards")  # where --kernels fast runs (the server computes every answer)
KERNEL_SETTINGS = (
    "auto",
    *KERNEL_MODES,
)  # --kernels: auto = fast in-process (and ray-shards), reproducible over Flower
DTYPE_SETTINGS = ("auto", *DTYPES)  # --dtype: auto = problem_dtype's rule


@dataclass(frozen=True)
class Transport:
    """A backend other than in-process, registered by the transport layer above this one
    (:mod:`fedkl.flower.backends`); the run layer never imports a transport.

    ``open(cfg, dataset) -> Federation``: a federation the algorithm trains through here (closed with
    its ``close()``), or ``train(cfg, dataset, out, log[, recover=RUN_DIR]) -> Trained``: a run that keeps
    its ledger, noise and journal elsewhere (a deployment's ServerApp; ``recover``: recover that run there)."""

    open: Callable | None = None
    train: Callable | None = None


TRANSPORTS: dict[str, Transport] = {}


def register_transport(name: str, transport: Transport) -> None:
    if name not in BACKENDS or name == "inprocess":
        raise ValueError(f"{name!r} is not a transport backend; valid: {', '.join(BACKENDS[1:])}")
    TRANSPORTS[name] = transport


def transport_for(backend: str) -> Transport | None:
    """None for in-process; the registered transport otherwise (ValueError when none is)."""
    if backend == "inprocess":
        return None
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if backend not in TRANSPORTS:
        raise ValueError(
            f"backend {backend!r} is provided by fedkl.flower: `import fedkl.flower.backends` first "
            "(fedkl run and fedkl.train do)"
        )
    return TRANSPORTS[backend]


@dataclass(frozen=True)
class RunConfig:
    """One run: the data, the problem, the budget and relation, seeds and paths (run-level fields),
    plus ``params``, the algorithm's own hyperparameters (its registered Params dataclass; None: its
    defaults). :meth:`from_settings` builds one from flat ``fedkl run`` settings."""

    dataset: str = "movielens"
    problem: str | None = None  # None: the task's default (DEFAULT_PROBLEM)
    model: str | None = None  # problem "torch": your network, "package.module:factory" (fedkl.problems.torch_model)
    algorithm: str = "noisy-gd"
    backend: str = "inprocess"
    epsilon: float = 2.0
    delta: float | None = None  # None: 1 / n^1.1 for n users
    force: bool = False  # run even when the algorithm's public forecast says noise would swamp the model
    allow_large_delta: bool = False  # run with delta >= 1/n (refused otherwise: check_delta), said next to epsilon
    reg: float = 0.0
    neighbouring: str = "replace-one"
    conversion: str = "cks"
    seed: int = 0
    noise_seed: int | None = None
    out: str | None = None
    ledger: str | None = None
    reference: bool = True
    users: int | None = None  # synthetic datasets: number of users
    partition: str | None = None  # mnist, fashion-mnist: iid | dirichlet | shards (None: the loader's, iid)
    # --dataset FILE (fedkl.data.files): its user and label columns, features (comma-separated; None: every
    # other numeric column), task, public bounds (None: feature bound 1, no label bound) and refuse|clip
    user_column: str | None = None
    label_column: str | None = None
    feature_columns: str | None = None
    task: str | None = None
    feature_bound: float | None = None
    label_bound: float | None = None
    on_bound: str | None = None
    secagg: bool = False  # Flower backends: sums through SecAgg+ (fedkl.flower.secagg), sum-only algorithms
    # the trust model the operator states for the other clients (fedkl.privacy.clients.TRUST_MODELS): "in-class"
    # is the explicit opt-in a deployed run of an in-class guarantee needs (require_trust)
    clients: str = "any"
    # numeric kernels (fedkl.problems.rowwise): reproducible = batch-invariant, bit for bit what a Flower
    # client computes alone; fast = plain torch, in-process only; auto (the default) = fast in-process and on ray-shards,
    # reproducible on every Flower backend. Resolved here: a RunConfig (its settings, result.json, the
    # ledger, a sweep's run key) always names the kernels that actually ran
    kernels: str = "auto"
    # the float type users' data and per-user computation run in (problem_dtype): auto, float32, float64
    dtype: str = "auto"
    shards: int = 2  # --backend ray-shards: Ray actors, each holding a block of users (fedkl.federation.ray_shards)
    # --backend ray-shards: the Ray cluster to connect to ("HOST:PORT" of a `ray start --head`, or "auto");
    # None: RAY_ADDRESS when set, else a local Ray instance started for the run
    ray_address: str | None = None
    # --backend flower-sim / flower-local: users per simulated Flower node (answers still per user,
    # fedkl.flower.client_app.BlockWorker); 0 = auto (fedkl.flower.backends.users_per_node: flower-sim about one
    # node per CPU core, flower-local one user per node); grpc deployments hold one user per node
    users_per_node: int = 0
    params: AlgorithmParams | None = None

    def __post_init__(self) -> None:
        spec = algorithm_spec(self.algorithm)  # ValueError naming the valid algorithms
        if self.params is None:
            object.__setattr__(self, "params", spec.params())
        elif type(self.params) is not spec.params:
            raise ValueError(f"{self.algorithm} takes {spec.params.__name__}, got {type(self.params).__name__}")
        object.__setattr__(self, "params", spec.resolve(self.params))  # lr None: the algorithm's default
        if self.kernels not in KERNEL_SETTINGS:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_SETTINGS)}, got {self.kernels!r}")
        if self.kernels == "auto":
            object.__setattr__(self, "kernels", "fast" if self.backend in FAST_BACKENDS else "reproducible")
        if self.kernels == "fast" and self.backend not in FAST_BACKENDS:
            raise ValueError(
                "--kernels fast is in-process only (backends inprocess, ray-shards): Flower clients compute with the reproducible kernels, "
                "which is what lets the backends agree bit for bit"
            )
        if self.dtype not in DTYPE_SETTINGS:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_SETTINGS)}, got {self.dtype!r}")
        if self.dtype != "auto" and self.backend != "inprocess":
            raise ValueError(
                f"--dtype {self.dtype} is in-process only; backend {self.backend!r} computes in the problem's own dtype"
            )
        if self.dtype == "float32" and not spec.cls.float32:
            f32 = ", ".join(n for n, s in REGISTRY.items() if s.cls.float32)
            raise ValueError(
                f"--dtype float32: {self.algorithm}'s privacy proof is stated in float64 (its sensitivities are not "
                f"only clipped sums); float32 runs: {f32}"
            )
        if self.secagg and not spec.sums_only(self.params):
            sums = ", ".join(n for n, s in REGISTRY.items() if s.sums_only(s.params()))
            raise ValueError(
                f"--secagg: {self.algorithm} (with these settings) needs per-user answers, which secure aggregation "
                f"hides; it serves algorithms that need only sums: {sums}"
            )
        if self.clients not in TRUST_MODELS:
            raise ValueError(f"--clients must be one of {', '.join(TRUST_MODELS)}, got {self.clients!r}")
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1:
            raise ValueError(f"--shards must be an integer >= 1, got {self.shards!r}")
        upn = self.users_per_node
        if isinstance(upn, bool) or not isinstance(upn, int) or upn < 0:
            raise ValueError(f"--users-per-node must be an integer >= 0 (0: auto), got {upn!r}")
        if upn > 1 and self.backend == "grpc":
            raise ValueError("--users-per-node: a deployment (--backend grpc) holds one user per node")
        if upn > 1 and self.secagg:
            raise ValueError("--secagg needs one user per node (SecAgg+ masks per node): run with --users-per-node 1")

    @classmethod
    def from_settings(cls, *, strict: bool = True, **settings) -> "RunConfig":
        """A RunConfig from flat settings (the ``fedkl run`` flags, TOML keys and sweep axes): the
        run-level fields, and the hyperparameters of ``settings["algorithm"]``.

        A hyperparameter of OTHER algorithms only is an error when ``strict`` and its value is not
        its default (a setting that would silently do nothing); ``strict=False`` drops it (a sweep
        whose base sets, e.g., ``p002_records`` for the paper-002 points of a mixed grid)."""
        run_fields = {f.name for f in dataclasses.fields(cls)} - {"params"}
        algorithm = settings.get("algorithm", cls.algorithm)
        spec = algorithm_spec(algorithm)
        own = {f.name: f for f in dataclasses.fields(spec.params)}
        run_kw, params_kw = {}, {}
        for key, value in settings.items():
            if key in run_fields:
                run_kw[key] = value
            elif key in own:
                params_kw[key] = value
            elif listed_default(key)[0] and _same(value, listed_default(key)[1]):
                continue  # another algorithm's setting at its default (dropped below too), without loading them all
            else:
                users = algorithms_using(key)
                if not users:
                    raise ValueError(f"unknown setting {key!r}")
                default = hyperparameter_default(key)
                if strict and not _same(value, default):
                    raise ValueError(
                        f"{key}={value!r} does not apply to {algorithm} (it is a setting of "
                        f"{', '.join(users)}); remove it"
                    )
        return cls(**run_kw, params=spec.params(**params_kw))

    def settings(self) -> dict:
        """The flat settings of this run (run-level fields and the algorithm's hyperparameters): what
        :meth:`from_settings` takes back, and what result.json, the ledger and sweep rows record."""
        flat = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "params"}
        flat.update(dataclasses.asdict(self.params))
        return flat


def settings_fields() -> dict[str, dataclasses.Field]:
    """Every flat ``fedkl run`` setting: RunConfig's run-level fields and every registered
    hyperparameter (what flags, TOML keys, sweep axes and Flower run-config keys name)."""
    return {**{f.name: f for f in dataclasses.fields(RunConfig) if f.name != "params"}, **hyperparameter_fields()}


def hyperparameter_default(name: str):
    return hyperparameter_fields()[name].default


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def default_delta(num_users: int) -> float:
    """delta = 1/n^1.1: below 1/n, as a user-level guarantee needs (a delta of 1/n could expose one
    whole user)."""
    return 1.0 / num_users**1.1


def check_delta(delta: float, num_users: int, allow_large: bool = False) -> None:
    """ValueError (one line, in the user's terms; before any data is used or budget charged) when ``delta``
    means nothing for ``num_users`` users: fewer than 2 users (user-level privacy hides each user among
    others), or ``delta >= 1/n``: publishing the whole data of one user chosen uniformly at random is
    (0, 1/n)-DP at user level, so such a guarantee allows exactly that -- unless ``allow_large``
    (``--allow-large-delta``: an explicit opt-in, said next to epsilon)."""
    if num_users < 2:
        raise ValueError(
            f"the data hold {num_users} user(s): user-level privacy hides each user among other users, so it "
            "needs at least 2 (check the user column, --user-column); nothing was charged"
        )
    if delta >= 1.0 / num_users and not allow_large:
        raise ValueError(
            f"delta = {delta:.3g} is at least 1/n = {1 / num_users:.3g} for n = {num_users} users: such a delta "
            "allows publishing one user's data outright; use a delta below 1/n (the default is 1/n^1.1), or "
            "--allow-large-delta to run anyway (said next to epsilon); nothing was charged"
        )


def large_delta_note(delta: float, num_users: int) -> str:
    """What the privacy line adds when ``delta >= 1/n`` was allowed (``--allow-large-delta``), else ''."""
    if delta < 1.0 / num_users:
        return ""
    return f"; WARNING: delta >= 1/n = {1 / num_users:.3g} (--allow-large-delta): one user's data may be published outright"


def quality_metric(metrics: dict) -> str:
    return "accuracy" if "accuracy" in metrics else "mse" if "mse" in metrics else "loss"


def build_algorithm(
    cfg: RunConfig,
    problem,
    feature_bound: float,
    user_ids,
    delta: float,
    ledger: PrivacyLedger,
    left: tuple[float, tuple[float, float]] | None = None,
):
    """``cfg``'s algorithm sized to what ``ledger`` says every listed user can still afford: the budget
    flows one way (ledger -> builder -> algorithm); the algorithm never reads the ledger. ``left``:
    ``(rho_left, approx_left)`` to size it to instead (a recovered run: what its users had left when it
    first started, from its journal)."""
    rho_left, approx_left = left if left is not None else (ledger.rho_left(user_ids), ledger.approx_left(user_ids))
    context = BuildContext(
        problem=problem,
        feature_bound=feature_bound,
        user_ids=tuple(user_ids),
        delta=delta,
        rho_left=rho_left,
        approx_left=tuple(approx_left),
        conversion=ledger.budget.conversion,
        neighbouring=cfg.neighbouring,
        seed=cfg.seed,
    )
    try:
        alg = algorithm_spec(cfg.algorithm).build(cfg.params, context)
    except BudgetExceeded as e:
        raise BudgetExceeded(f"ledger {ledger.path}: {e}") from None
    alg.guarantee.check_relation(cfg.neighbouring, cfg.algorithm)
    return alg


class RunObserver:
    """Watches a run from outside it (``fedkl run``'s progress bar and its Ctrl-C line): set one with
    ``RUN_OBSERVER.set(observer)`` before calling :func:`run_training`. Methods are called in order:
    ``started`` once the ledger has reserved the run's users, ``round`` with each progress record
    (``round``, ``rounds`` ...), ``trained`` when the algorithm has returned (``released``: whether
    it released a model). The defaults do nothing."""

    def started(self, run_id: str, ledger_path: str) -> None: ...

    def round(self, record: dict) -> None: ...

    def trained(self, released: bool) -> None: ...


RUN_OBSERVER: contextvars.ContextVar[RunObserver | None] = contextvars.ContextVar("fedkl_run_observer", default=None)


PROGRESS_EVERY_S = 1.0  # the least time between two progress records of a run (first and last always shown)


class ProgressEgress:
    """The algorithm's ``progress(record)`` callback in a run: hands a record out (the observer's
    ``round`` and a log line with the released ``noisy_grad_norm``/``rho_spent`` and an ETA) for the
    first round, the last, and at most once per ``every_s`` seconds in between (default
    :data:`PROGRESS_EVERY_S`), and calls ``flush``
    (the Releaser's: the journal durable) before each, since a record carries released values
    (:mod:`fedkl.privacy.journal`, egress point 1). ``clock``: monotonic seconds."""

    def __init__(
        self,
        observer: RunObserver,
        log: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        every_s: float | None = None,
    ) -> None:
        self.observer, self.log, self.clock = observer, log, clock
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.flush: Callable[[], None] = lambda: None
        self._start: float | None = None
        self._last: float | None = None

    def __call__(self, rec: dict) -> None:
        now = self.clock()
        if self._start is None:
            self._start = now
        k, total = int(rec["round"]), int(rec["rounds"])
        if self._last is not None and k != total and now - self._last < self.every_s:
            return
        self._last = now
        self.flush()
        self.observer.round(rec)
        extra = "".join(
            f"  {key.replace('_', ' ')} {rec[key]:.4g}"
            for key in ("noisy_grad_norm", "rho_spent")
            if isinstance(rec.get(key), (int, float))
        )
        eta = (now - self._start) / max(k - 1, 1) * (total - k) if k > 1 else None  # rounds after the first
        self.log(f"  round {k:>4}/{total}{extra}" + (f"  ETA {eta:.0f} s" if eta is not None and k < total else ""))


def train_federation(
    cfg: RunConfig,
    federation: Federation,
    problem,
    dataset,
    delta: float,
    ledger_path: str,
    run_id: str,
    noise: NoiseSource,
    log: Callable[[str], None],
    w0=None,
    journal: str | ReleaseJournal | None = None,
    journal_header: dict | None = None,
    scratch: bool = False,
    releaser_type: type[Releaser] = Releaser,
    transport: str | None = None,
):
    """Train through ``federation`` with the ledger, filter and noise in this process; returns the result, the
    ledger summary and the declared :class:`Guarantee` (module docstring, "Training through a federation").
    ``transport``: what the budget line names as the backend (default ``cfg.backend``; a ServerApp that
    ``flwr run`` started says ``flwr-run``, whatever its run config's ``fedkl-backend``)."""
    observer, recovering = RUN_OBSERVER.get() or RunObserver(), isinstance(journal, ReleaseJournal)
    run = _Run(
        cfg, federation, problem, delta, ledger_path, run_id, noise, log, observer, recovering, transport or cfg.backend
    )
    ledger = _open_ledger(run, journal, scratch)
    # cfg.kernels in force here too, for callers that train without run_training (the audit, the ServerApp)
    with kernels(cfg.kernels), ledger:
        left = _reserve(run, ledger, journal, w0)
        alg = build_algorithm(cfg, problem, dataset.feature_bound, federation.user_ids, delta, ledger, left)
        _afford(run, alg, ledger)
        # --secagg: the server no longer sees (nor bounds) each answer (fedkl/flower/secagg.py)
        declared = dataclasses.replace(alg.guarantee, clients=FEDKL_CLIENTS) if cfg.secagg else alg.guarantee
        forecast = _refuse(run, alg, declared, ledger, left[0])
        journal = _open_journal(run, journal, journal_header, left)
        with _ended(run, ledger, journal):
            releaser = _open_releaser(run, alg, declared, ledger, journal, left[0], releaser_type)
            result = _train(run, alg, releaser, w0, forecast)
        return result, _close(run, ledger, journal, result, scratch), declared


@dataclass(frozen=True)
class _Run:
    """The fixed inputs of one :func:`train_federation` call, read by its steps."""

    cfg: RunConfig
    federation: Federation
    problem: object
    delta: float
    ledger_path: str
    run_id: str
    noise: NoiseSource
    log: Callable[[str], None]
    observer: RunObserver
    recovering: bool  # the journal is the open one of a run whose process died
    transport: str  # the backend the budget line names


def _open_ledger(run: _Run, journal: str | ReleaseJournal | None, scratch: bool) -> PrivacyLedger:
    """The run's ledger handle: a new run on it, or (``journal`` open: recovering) the dead run taken over. A
    recovery is refused (JournalError, LedgerError) before anything changes: the dead run is left as it is."""
    cfg, recovering = run.cfg, run.recovering
    # a release's noise depends on earlier draws: the journal keeps them (a secret; fedkl.privacy.journal)
    if (
        recovering
        and algorithm_spec(cfg.algorithm).noise_state
        and not journal.keeps_draws
        and run.noise.mode == "secure"
    ):
        raise JournalError(
            f"{journal.path}: {cfg.algorithm}'s later noise depends on earlier draws, which this run's journal "
            "did not keep (a run started before fedkl journalled them): with secure noise it cannot be recovered "
            "(nothing was charged)"
        )
    if recovering:  # never a new ledger
        check_recovery_ledger({"ledger": run.ledger_path, "run_id": run.run_id})
    budget = Budget(cfg.epsilon, run.delta, cfg.conversion)
    ledger = PrivacyLedger(run.ledger_path, budget, run.run_id, cfg.settings(), scratch=scratch, new_run=not recovering)
    if recovering:
        try:
            ledger.take_over(run.federation.user_ids)
        except BaseException:
            ledger.close()
            raise
    return ledger


def _reserve(run: _Run, ledger: PrivacyLedger, journal, w0) -> tuple[float, tuple[float, float]]:
    """``(rho_left, approx_left)``: what the run's users can afford (a recovered run: what they had when it first
    started, from its journal), once the ledger has reserved them; BudgetExceeded when nothing is left."""
    ids, cfg = run.federation.user_ids, run.cfg
    if run.recovering:  # its users' budget as it had it
        rho_total, approx_left = journal.header()["rho_left"], tuple(journal.header()["approx_left"])
    else:
        ledger.reserve(ids)  # verifies the ledger; LedgerBusy while another run holds these users
        rho_total, approx_left = ledger.rho_left(ids), ledger.approx_left(ids)
    run.observer.started(run.run_id, run.ledger_path)
    if rho_total <= 0 and w0 is not None:  # --resume: what it is for, and what to do instead
        raise BudgetExceeded(
            f"--resume: ledger {run.ledger_path} has nothing left of these users' budget (eps={cfg.epsilon}, "
            f"delta={run.delta:g}; the built-in algorithms spend all of it): --resume continues a run that left "
            "budget on its ledger; to train more, start a new run with a larger --epsilon on a new --ledger "
            "(a new guarantee: these users' privacy loss is then both runs' together; nothing was charged)"
        )
    if rho_total <= 0:
        raise BudgetExceeded(
            f"ledger {run.ledger_path}: the users' budget (eps={cfg.epsilon}, delta={run.delta:g}) "
            "is already spent; nothing to train with"
        )
    if rho_total < ledger.budget.rho * (1 - 1e-9):
        run.log(f"resuming ledger {run.ledger_path}: rho {rho_total:.4g} of {ledger.budget.rho:.4g} left")
    return rho_total, approx_left


def _afford(run: _Run, alg, ledger: PrivacyLedger) -> None:
    """The one affordability check (issue 29): every user can pay what the algorithm declares it will charge
    them (``alg.needs``), before any data is read; BudgetExceeded, nothing charged. A recovered run is not
    re-checked: its charges so far are on the ledger, and its needs were checked when it first started."""
    if run.recovering:
        return
    try:
        ledger.check(alg.needs(run.federation.user_ids))
    except BudgetExceeded as e:
        raise BudgetExceeded(f"ledger {run.ledger_path}: {e}") from None


def _refuse(run: _Run, alg, declared: Guarantee, ledger: PrivacyLedger, rho_total: float) -> dict | None:
    """The refusals a built algorithm gets before any data is read (its run ended ``refused``): the clients'
    trust model, the exact Gaussian conversion of a non-Gaussian release, a forecast whose noise swamps the
    model. Logs the budget line, then the warnings on public settings; returns the forecast (or None)."""
    cfg, n = run.cfg, run.federation.num_users
    try:  # a weaker trust model is an explicit opt-in where clients run their own code
        require_trust(alg.guarantee.clients, cfg.clients, run.federation.clients_run_own_code, cfg.algorithm)
        run.log(_budget_line(cfg, declared, alg.sigma, run.delta, rho_total, n, run.transport))
        if cfg.conversion == "gaussian" and not alg.gaussian_releases_only:
            raise ValueError(
                f"{cfg.algorithm} with these settings makes a zCDP release that is not Gaussian, so the "
                "exact Gaussian conversion does not hold for it: use --conversion cks (nothing was read "
                "or charged)"
            )
        forecast = alg.forecast(n, run.problem.init_params(), run.federation.user_ids)
        _refuse_forecast(cfg, forecast, n, run.log)
    except ValueError:
        ledger.finish_run("refused")
        raise
    grad = gradient_forecast(alg, cfg.params, n, run.problem.num_params, cfg.neighbouring)
    convex = run.problem.convex
    if grad is not None and grad[0] > learns_little_threshold(convex):  # before any budget is spent
        run.log(
            f"warning: predicted to learn little: the noise is {grad[0]:.3g}x the largest signal ({grad[1]}; "
            f"threshold {learns_little_threshold(convex):g} for {'convex models' if convex else 'networks'}); "
            f"at eps={cfg.epsilon} and n={n} such runs score about the majority class: raise "
            "eps, users or rounds, or see `fedkl plan`"
        )
    if not convex and isinstance(cfg.params, StepSize):
        step = network_step_warning(cfg.algorithm, cfg.params.lr, algorithm_spec(cfg.algorithm).step_size)
        if step is not None:
            run.log(f"warning: {step}")
    for line in alg.warnings():  # public settings, before any budget is spent
        run.log(f"warning: {line}")
    return forecast


def _budget_line(
    cfg: RunConfig, declared: Guarantee, sigma, delta: float, rho_total: float, n: int, backend: str
) -> str:
    """The run's budget as its log says it (zCDP rho, rounds, clip and noise where the algorithm speaks zCDP)."""
    if not declared.zcdp:  # zCDP rho, rounds and clip are not what these algorithms use
        how = accountant(cfg, declared)
        return f"budget: user-level ({cfg.neighbouring}) eps={cfg.epsilon}, delta={delta:.3g}, {how}; backend {backend}" + large_delta_note(delta, n)  # fmt: skip
    shape = [
        f"{cfg.params.rounds} rounds" if isinstance(cfg.params, Rounds) else "",
        f"clip {cfg.params.clip}" if isinstance(cfg.params, Clip) else "",
        f"backend {backend}",
    ]
    return (
        f"budget: user-level ({cfg.neighbouring}) eps={cfg.epsilon}, delta={delta:.3g} -> "
        f"zCDP rho={rho_total:.5g} ({cfg.conversion}); "
        + ", ".join(x for x in shape if x)
        + (f", noise std on the sum {sigma:.4g}" if isinstance(sigma, float) else "")
        + large_delta_note(delta, n)
    )


def accountant(cfg: RunConfig, declared: Guarantee) -> str:
    """The accountant ``declared`` names for this run (a Poisson-sampled schedule's: its ``--accountant``)."""
    return declared.accountant(cfg.conversion, cfg.params.accountant if isinstance(cfg.params, PoissonSampling) else None)  # fmt: skip


def _refuse_forecast(cfg: RunConfig, forecast: dict | None, n: int, log: Callable[[str], None]) -> None:
    """Log an output perturbation's public forecast; refuse it (ValueError) when its first release's noise
    swamps the model (unless ``--force``), warn when the model is predicted to learn little."""
    if forecast is None:
        return
    log("forecast (public values, before any data): " + ", ".join(f"{k} {v:.4g}" for k, v in forecast.items()))
    if forecast["noise_over_signal"] > 1 and not cfg.force:
        raise ValueError(
            f"{cfg.algorithm}: its first release's noise (norm ~{forecast['noise_norm']:.3g}) is "
            f"{forecast['noise_over_signal']:.3g}x the farthest the model can move ({forecast['signal_radius']:.3g}) "
            f"at this budget and n={n}: the model would be noise around its start. Nothing "
            "was read or charged. noisy-gd learns here (--algorithm noisy-gd; `fedkl plan` ranks every "
            "algorithm on these settings); --force runs it anyway"
        )
    if forecast["noise_over_signal"] > LEARNS_LITTLE:  # before any budget is spent
        log(
            f"warning: predicted to learn little: the first release's noise is "
            f"{forecast['noise_over_signal']:.3g}x the farthest the model can move; such runs can land "
            "below the majority class: raise eps or users, or see `fedkl plan`"
        )


def _open_journal(run: _Run, journal, header: dict | None, left: tuple) -> ReleaseJournal | None:
    """The run's release journal: created at ``journal`` (a path) with the run's header, or the open journal
    of the run being recovered, or None (no journal)."""
    if not isinstance(journal, str):
        return journal
    header = {**(header or {}), "run_id": run.run_id, "settings": run.cfg.settings(), "delta": run.delta}
    header["ledger"] = os.path.abspath(run.ledger_path)
    header.update(rho_left=left[0], approx_left=left[1])
    return ReleaseJournal.create(journal, header, noise_draws=algorithm_spec(run.cfg.algorithm).noise_state)


@contextlib.contextmanager
def _ended(run: _Run, ledger: PrivacyLedger, journal: ReleaseJournal | None):
    """Every exit leaves the journal durable (closed: flushed) and no transport hook behind; an exception ends
    the ledger's run first, with its exact status (interrupted, refused or failed)."""
    try:
        yield
    except BaseException as e:
        ledger.finish_run(ledger.end_status(e))
        raise
    finally:
        run.federation.before_send = None
        if journal is not None:
            journal.close()


def _open_releaser(run: _Run, alg, declared: Guarantee, ledger, journal, rho_total: float, releaser_type):
    """The run's Releaser: a run-wide zCDP filter where the guarantee needs one (none for (eps, delta)
    releases, nor where each user takes part in one disjoint cohort: parallel composition, the per-user
    ledger enforces every budget) and the journal (replayed when recovering). It charges each release
    right before its noise is drawn."""
    filt = ZCDPFilter(rho_total) if declared.run_wide_filter else None
    releaser = releaser_type(ledger, run.noise, filt, journal=journal, replay=run.recovering)
    if isinstance(releaser, _ScheduleCut):  # the plan's dry run
        releaser.see_algorithm(alg)
    # every egress flushes the journal first (fedkl.privacy.journal): progress records, a
    # transport's messages to nodes, and the end of the run
    run.federation.before_send = releaser.flush
    return releaser


def _train(run: _Run, alg, releaser: Releaser, w0, forecast: dict | None) -> AlgorithmResult:
    """The algorithm's run from ``w0`` (default: the problem's initial parameters), its progress handed out."""
    progress = ProgressEgress(run.observer, run.log)
    progress.flush = releaser.flush
    # the server's iterate is float64 whatever the problem's dtype: answers are summed and noised in float64
    # (fedkl.federation.clipping), and the released model is cast to the problem's dtype (post-processing)
    w0 = (run.problem.init_params() if w0 is None else w0).to(torch.float64)
    result = alg.run(run.federation, releaser, w0, progress)
    if torch.is_tensor(result.w) and result.w.dtype != run.problem.dtype:
        try:
            result.w = result.w.to(run.problem.dtype)
        except AttributeError:  # a result whose w is a read-only property: released as computed (float64)
            pass
    releaser.flush()
    if run.recovering:
        run.log(
            f"recovered run {run.run_id}: {releaser.replayed} releases replayed from its journal, none charged twice"
        )
    if not isinstance(result, AlgorithmResult):
        raise TypeError(
            f"{run.cfg.algorithm}: run() must return an AlgorithmResult (fedkl.algorithms.registry), "
            f"got {type(result).__name__}"
        )
    if forecast is not None and isinstance(result.details, dict):
        result.details["forecast"] = forecast  # the price, in result.json's algorithm_details
    return result


def _close(run: _Run, ledger: PrivacyLedger, journal, result: AlgorithmResult, scratch: bool) -> dict:
    """End the trained run on the ledger, forget its noise draws (a finished run cannot be recovered) and
    return the verified ledger summary ({} for a dry run's throw-away ledger)."""
    ledger.finish_run("finished")
    if journal is not None:
        journal.purge_secret()
    run.observer.trained(result.w is not None)
    if scratch:
        return {}
    ledger.verify()
    return ledger.summary()


def planned_releases(cfg: RunConfig, dataset: FederatedDataset, records_per_user: int = STANDIN_RECORDS) -> dict:
    """The releases ``fedkl run`` of ``cfg`` makes on a fresh ledger, in order, from public values
    only: this run's own code on :func:`fedkl.data.standin.public_standin` of ``dataset`` (its user ids
    and shape, zero records) with a temporary ledger (why that is the real run's plan:
    :func:`fedkl.planner.charge_plan`). Returns ``{"users", "delta", "releases": [{label, mechanism,
    charge, users, cohort, members}], "per_user_max": {rho, eps, delta}, "adaptive"}``."""
    standin = public_standin(dataset, records_per_user)
    problem, _ = run_problem(cfg, standin)
    n = len(standin.train.user_ids)
    delta = cfg.delta if cfg.delta is not None else default_delta(n)
    token = RUN_OBSERVER.set(None)  # the dry run is not the run a `fedkl run` observer follows
    try:
        return _dry_run(cfg, standin, problem, n, delta)
    finally:
        RUN_OBSERVER.reset(token)


class _PlanCut(Exception):
    """The dry run stopped where the rest of its plan follows from the algorithm's schedule (``args``: the
    algorithm's declared :class:`Guarantee` and its ``plan_schedule()``)."""


class _ScheduleCut(Releaser):
    """The dry run's Releaser. An algorithm whose plan is a schedule declares it (``plan_schedule()``:
    :meth:`fedkl.algorithms.contract.Algorithm.plan_schedule`). Its dry run is then stopped at the draw of its
    second release (the first step of a schedule charged up front, or release 1 with its charge already on
    the throw-away ledger, so what was charged is the run's own code's record); :func:`_scheduled` checks that
    against the declaration and writes out the rest. Planning then costs one or two rounds, not one per round
    (a 20,000-round run's dry run took a minute: issue 31; dp-ftrl's at 20,000 rounds, 12 users, 387 s -> 11.6 s
    on 2 cores at load 15-20, tests/test_plan_schedule.py); an algorithm without ``plan_schedule`` runs its
    whole dry run."""

    schedule: tuple[int, Callable[[int], str]] | Sequence[PlannedRelease] | None = None
    guarantee: Guarantee | None = None

    def see_algorithm(self, alg) -> None:
        self.schedule, self.guarantee = alg.plan_schedule(), alg.guarantee

    def _emit(self, seq, *args, **kwargs):
        if self.schedule is not None and seq >= 1:
            raise _PlanCut(self.guarantee, self.schedule)
        return super()._emit(seq, *args, **kwargs)


def _planned_rows(first: dict, planned: Sequence[PlannedRelease]) -> tuple[list[dict], dict]:
    """The ledger rows of ``planned`` as :meth:`PrivacyLedger.releases` would list them after ``first``
    (the dry run's release 0: its id and run) and the most charged user's totals (each user's charges added
    in release order, as the ledger adds them: users in the same cohorts have the same totals)."""
    rows, cohorts = [], {}
    for k, (label, charge, user_ids) in enumerate(planned):
        digest = cohort_digest(user_ids)
        if digest not in cohorts:
            cohorts[digest] = sorted(set(map(str, user_ids)))
        rho, eps, delta = charge.cost()
        rows.append(
            {**first, "id": first["id"] + k, "label": label, "mechanism": charge.mechanism,
             "sensitivity": charge.sensitivity, "noise_scale": charge.noise_scale, "rho": rho, "eps": eps,
             "delta": delta, "users": len(cohorts[digest]), "cohort": digest,
             "charge": json.loads(json.dumps(to_record(charge))), "seq": k, "members": cohorts[digest]}
        )  # fmt: skip
    in_cohorts: dict[str, set] = {}  # user -> the cohorts it is charged in
    for digest, members in cohorts.items():
        for u in members:
            in_cohorts.setdefault(u, set()).add(digest)
    totals = {"rho": 0.0, "eps": 0.0, "delta": 0.0}
    for group in {frozenset(c) for c in in_cohorts.values()}:
        spent = [0.0, 0.0, 0.0]
        for r in rows:
            if r["cohort"] in group:
                spent = [spent[0] + r["rho"], spent[1] + r["eps"], spent[2] + r["delta"]]
        totals = {k: max(totals[k], v) for k, v in zip(totals, spent)}
    return rows, totals


def _scheduled(rows: list[dict], totals: dict, schedule) -> tuple[list[dict], dict]:
    """The plan from the dry run's first releases (``rows``: one or two; ``totals``: their most charged user's
    rho, eps and delta) and the algorithm's ``schedule`` (``_ScheduleCut``): ``(count, label)``: release ``k``
    is the first with ``label(k)``, seq ``k`` and the ledger id it would get; a list of
    :class:`PlannedRelease`: each one's row (:func:`_planned_rows`). A dry-run release that is not what the
    schedule says, or a different number of them, is a ValueError (no plan is better than a wrong one)."""
    if isinstance(schedule, tuple) and len(schedule) == 2 and isinstance(schedule[0], int):
        count, label = schedule

        def nth(k: int) -> dict:
            return {**rows[0], "id": rows[0]["id"] + k, "seq": k, "label": label(k)}

        planned = [nth(k) for k in range(count)]
        planned_totals = {k: v / len(rows) * count for k, v in totals.items()}
    else:
        planned, planned_totals = _planned_rows(rows[0], schedule)
    made = planned[: len(rows)]
    if len(rows) != min(len(planned), 2) or rows != made:
        first = next((i for i, (a, b) in enumerate(zip(rows, made)) if a != b), min(len(rows), len(made)))
        raise ValueError(
            f"the algorithm declares its plan a schedule of {len(planned)} releases, but its dry run's release "
            f"{first} is {rows[first]['label'] if first < len(rows) else 'missing'}, not "
            f"{made[first]['label'] + ' with the declared charge' if first < len(made) else 'none'}"
        )
    return planned, planned_totals


def _dry_run(cfg: RunConfig, standin: FederatedDataset, problem, n: int, delta: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.sqlite")
        noise = NoiseSource(cfg.noise_seed if cfg.noise_seed is not None else 0)
        federation = InProcessFederation(problem, standin)
        schedule = None
        try:
            _, _, declared = train_federation(
                cfg, federation, problem, standin, delta, path, "plan", noise, lambda _: None, scratch=True,
                releaser_type=_ScheduleCut,
            )  # fmt: skip
        except _PlanCut as cut:
            declared, schedule = cut.args
        with PrivacyLedger(path) as ledger:
            cohorts = ledger.cohorts()
            releases = [{**r, "members": cohorts[r["cohort"]]} for r in ledger.releases()]
            per_user_max = ledger.max_user_totals()
    if schedule is not None:
        releases, per_user_max = _scheduled(releases, per_user_max, schedule)
    return {
        "users": n,
        "delta": delta,
        "releases": releases,
        "per_user_max": per_user_max,
        "adaptive": declared.adaptive,
    }


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with every path it holds (``out``, ``ledger``, a data file ``dataset``) absolute, resolved
    against this process's working directory: done before a run starts, so that what the user typed means
    the same in every process of the run (a deployment's ServerApp and ClientApps run in a temporary work
    folder, which is deleted: a relative ledger there was deleted with it) and in the run's records."""
    paths = {k: getattr(cfg, k) for k in ("out", "ledger")}
    if is_data_file(cfg.dataset):
        paths["dataset"] = cfg.dataset
    changed = {k: os.path.abspath(v) for k, v in paths.items() if v is not None and not os.path.isabs(v)}
    return dataclasses.replace(cfg, **changed) if changed else cfg


class RunPlace(NamedTuple):
    """Where a run is recorded: its delta, id, folder and ledger (absolute paths) and its noise source."""

    delta: float
    run_id: str
    out: str
    ledger_path: str
    noise: NoiseSource


def prepare_run(cfg: RunConfig, num_users: int, suffix: str = "", recover: ReleaseJournal | None = None) -> RunPlace:
    """What every run derives from its configuration: delta (default 1/n^1.1), a fresh run id, the
    output folder (created; absolute) the ledger path (absolute) and the noise source; ``recover``: the
    journal of a run to recover, whose own place it is (a recovery creates no folder of its own)."""
    if recover is not None:
        h = recover.header()
        return RunPlace(h["delta"], h["run_id"], h["out"], h["ledger"], NoiseSource(cfg.noise_seed))
    delta = cfg.delta if cfg.delta is not None else default_delta(num_users)
    check_delta(delta, num_users, cfg.allow_large_delta)  # before the run's folder and ledger exist
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    name = os.path.basename(cfg.dataset)  # a data file: its file name (the path may be absolute)
    out = os.path.abspath(cfg.out or os.path.join("runs", f"{run_id}-{cfg.algorithm}-{name}{suffix}"))
    os.makedirs(out, exist_ok=True)
    ledger_path = os.path.abspath(cfg.ledger or os.path.join(out, "ledger.sqlite"))
    return RunPlace(delta, run_id, out, ledger_path, NoiseSource(cfg.noise_seed))


def load_run_dataset(cfg: RunConfig) -> FederatedDataset:
    """The dataset of a run configuration, by :func:`fedkl.data.files.dataset_kwargs` (the rule every
    backend's server and client load by)."""
    return load_dataset(cfg.dataset, **dataset_kwargs({k: getattr(cfg, k, None) for k in DATA_SETTINGS}))


def load_run_data(cfg: RunConfig, dataset: FederatedDataset | None = None, model=None) -> tuple:
    """``(dataset, problem, problem name)`` of a run configuration (:func:`load_run_dataset`); ``dataset``,
    ``model``: your own dataset and network objects instead (a network's problem is ``torch``)."""
    dataset = load_run_dataset(cfg) if dataset is None else dataset
    return (dataset, *run_problem(cfg, dataset, model))


def run_problem(cfg: RunConfig, dataset: FederatedDataset, model=None) -> tuple:
    """``(problem, name)``: the problem run ``cfg`` trains on ``dataset``, in the float type it computes in
    (:func:`problem_dtype`) -- the one rule for the run, its plan, ``fedkl tune``'s trials and the audits.
    ``model``: your own network object instead of ``cfg.model`` (its problem is ``torch``)."""
    name = cfg.problem or ("torch" if model is not None else DEFAULT_PROBLEM[dataset.task])
    model = cfg.model if model is None else model
    return make_problem(name, dataset, reg=cfg.reg, model=model, dtype=problem_dtype(cfg, name)), name


def problem_dtype(cfg: RunConfig, name: str) -> str:
    """The float type problem ``name`` computes in for run ``cfg``: ``--dtype`` when given (float32 only
    for an algorithm that declares ``float32``: RunConfig refuses the others), else the problem's own
    (:func:`fedkl.problems.default_dtype`: float64, float32 for torch models), except that a torch model
    trained by an algorithm whose proof is stated in float64 (no ``float32`` declaration) runs in float64
    wherever the server computes the answers (:data:`FAST_BACKENDS`: in-process and the Ray shards, which
    build their problem here too); Flower clients build their own, in the problem's dtype. Whatever the
    dtype, the server's iterate, the sums and the noise are float64 (:func:`_train`)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    own = default_dtype(name)
    if own == "float32" and cfg.backend in FAST_BACKENDS and not algorithm_spec(cfg.algorithm).cls.float32:
        return "float64"
    return own


def run_training(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    dataset: FederatedDataset | None = None,
    model: Callable | torch.nn.Module | None = None,
    resume: str | None = None,
    recover: ReleaseJournal | None = None,
) -> dict:
    """Train with ``cfg.kernels`` in force (:func:`fedkl.problems.rowwise.kernels`) and its paths absolute
    (:func:`absolute_paths`), write ``model.pt`` (the released model with its privacy receipt, when there is one:
    ``model_path``, else None; :mod:`fedkl.saved_model`), ``result.json`` (as soon as the model
    exists; rewritten when the non-private reference is done) and the ledger under ``cfg.out``;
    return the result dict.

    ``dataset``: your own :class:`FederatedDataset` (``fedkl.from_arrays``) instead of the one
    ``cfg.dataset`` names; ``model``: your own network as a factory or a ``torch.nn.Module``
    (problem ``torch``) instead of ``cfg.model``'s import spec. Both train in-process only (a
    Flower client builds its data and network from names).
    ``resume``: a run folder (or its model.pt) whose released model this run starts from, on that
    run's ledger and with its settings (:func:`fedkl.saved_model.check_resume`); not a setting of
    the run, so a resumed run's settings (and a sweep's row keys) are those of a fresh one.
    ``recover``: the journal of a run to recover (:func:`recover_run`).
    A run trained in this process keeps its release journal in ``out/journal.sqlite``."""
    cfg = absolute_paths(cfg)
    resume = None if resume is None else os.path.abspath(resume)  # recorded (journal, receipt): absolute
    with kernels(cfg.kernels):
        return _run_training(cfg, log, dataset, model, resume, recover)


# settings that say where a run's workers are, not what it computes: a recovery may name new ones (a Ray
# cluster restarted at another address); every other setting must be the recovered run's own
WHERE = frozenset({"ray_address"})
JOURNAL_FILE = "journal.sqlite"  # in the run folder: the release journal (fedkl.privacy.journal)


def open_recovery(run_dir: str, cfg: RunConfig | None = None) -> ReleaseJournal:
    """The open journal of ``run_dir``'s run, to recover it (close it). JournalError (one line, nothing
    charged) unless ``cfg`` (default: the settings in the journal, rebuilt) has exactly that run's settings."""
    journal = ReleaseJournal.open(os.path.join(run_dir, JOURNAL_FILE))
    try:
        check_recovery_ledger(journal.header())
        settings = journal.header()["settings"]
        ours = json.loads(json.dumps((cfg or RunConfig.from_settings(**settings)).settings(), default=str))
        differ = sorted(k for k in (set(settings) | set(ours)) - WHERE if settings.get(k) != ours.get(k))
        if differ:
            raise JournalError(
                f"{journal.path}: these settings are not the recovered run's ({', '.join(differ)} differ); "
                "a recovery runs with the run's own settings (nothing was charged)"
            )
    except BaseException:
        journal.close()
        raise
    return journal


def check_recovery_ledger(header: dict) -> None:
    """LedgerError (one line; nothing created, nothing charged) when the ledger of the run a journal
    ``header`` describes is missing: a recovery never creates a ledger (a fresh one in its place would
    stand for what the run spent, with nothing of it)."""
    if not os.path.exists(header["ledger"]):
        raise LedgerError(
            f"the ledger of run {header['run_id']}, {header['ledger']}, is missing: it holds what the run spent "
            "(a recovery never creates one); put it back from a copy and recover again (nothing was created or charged)"
        )


def recover_run(
    run_dir: str, log: Callable[[str], None] = print, before: Callable | None = None, ray_address: str | None = None
) -> dict:
    """``fedkl run --recover RUN_DIR``: finish the run of ``RUN_DIR`` whose process died (kill -9,
    power loss, OOM ...), from its release journal and its ledger, without charging any release twice
    (:class:`fedkl.privacy.release.Releaser`). The run is re-executed with its own settings, seed and
    data; what it released before the crash is returned from the journal. Not ``--resume`` (a new run
    warm-started from a finished run's released model). ``before(cfg)``: called with the run's
    configuration before it trains (``fedkl run`` registers a Flower backend there). ``ray_address``: the
    Ray cluster to use now, where the recorded one is gone (:data:`WHERE`)."""
    run_dir = os.path.abspath(run_dir)
    journal = open_recovery(run_dir)
    try:
        header = journal.header()
        cfg = RunConfig.from_settings(**header["settings"])
        if ray_address is not None:
            cfg = dataclasses.replace(cfg, ray_address=ray_address)
        if header.get("deployed") and cfg.backend != "grpc":
            raise JournalError(
                f"{run_dir} is the run of a ServerApp started by `flwr run`: recover it the same way, "
                f"flwr run . --run-config 'fedkl-recover=\"{os.path.abspath(run_dir)}\"' (nothing was charged)"
            )
        if before is not None:
            before(cfg)
    except BaseException:
        journal.close()
        raise
    try:
        return run_training(cfg, log, resume=header.get("resumed_from"), recover=journal)
    finally:
        journal.close()


def _run_training(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    dataset: FederatedDataset | None = None,
    model: Callable | torch.nn.Module | None = None,
    resume: str | None = None,
    recover: ReleaseJournal | None = None,
) -> dict:
    """:func:`run_training`'s steps: load, place, train here or over a transport, write the run's files."""
    started = time.time()
    _refuse_backend(cfg, dataset, model)
    data = RunData.load(cfg, dataset, model)
    transport = transport_for(cfg.backend)
    w0 = _resumed_model(cfg, resume, transport, data)
    # the federation the algorithm trains through; a deployment (transport.train) trains elsewhere
    federation = data.evaluator if transport is None or transport.open is None else transport.open(cfg, data.dataset)
    place = prepare_run(cfg, federation.num_users, recover=recover)
    _log_start(cfg, data, place, federation.num_users, resume if w0 is not None else None, log)
    if transport is not None and transport.train is not None:  # ledger + noise live in the deployment's ServerApp
        # recovering: the ServerApp recovers the run of the folder holding the journal (fedkl-recover), with the
        # run's own fedkl-out (cfg.out: that run's ServerApp settings, which its recovery must repeat)
        recovering = {} if recover is None else {"recover": os.path.dirname(os.path.abspath(recover.path))}
        trained = transport.train(cfg, data.dataset, (recover is not None and cfg.out) or place.out, log, **recovering)
    else:
        trained = _train_here(cfg, data, federation, place, w0, resume, recover, log)
    return write_run_files(cfg, trained, data, place, resume=resume, started=started, log=log)


def _refuse_backend(cfg: RunConfig, dataset, model) -> None:
    """What the backend cannot do, refused before anything is read: SecAgg without Flower, objects over a transport."""
    if cfg.secagg and cfg.backend in ("inprocess", "ray-shards"):
        raise ValueError("--secagg aggregates over Flower: use --backend flower-local, flower-sim or grpc")
    for what, given in (("a dataset", dataset), ("a model", model)):
        if given is not None and cfg.backend != "inprocess":
            raise ValueError(
                f"{what} given as an object trains in-process only (backend {cfg.backend!r} builds its "
                "clients from names: use a dataset name and --model package.module:factory)"
            )


def _resumed_model(cfg: RunConfig, resume: str | None, transport: Transport | None, data: RunData):
    """The released model a ``--resume`` run starts from (checked against its run: check_resume), else None."""
    if resume is None:
        return None
    if transport is not None and transport.train is not None:
        raise ValueError(f"--resume trains through the ledger of this process; backend {cfg.backend} keeps its own")
    ledger = cfg.ledger or os.path.join(cfg.out or "", "ledger.sqlite")
    return check_resume(resume, cfg.settings(), ledger, data.spec)


def _log_start(cfg: RunConfig, data: RunData, place: RunPlace, n: int, resumed: str | None, log) -> None:
    log(
        f"fedkl run {place.run_id}: {cfg.algorithm} on {cfg.dataset} ({n} users, "
        f"{data.dataset.train.num_records} train records, {data.problem.num_params} parameters); "
        f"noise: {place.noise.mode}" + (f"; resuming the released model of {resumed}" if resumed else "")
    )
    for note in data.dataset.extra.get("notes", ()):  # what reading a data file did (columns left out, records clipped)
        log(f"note: {os.path.basename(cfg.dataset)}: {note}")


def _train_here(cfg, data: RunData, federation, place: RunPlace, w0, resume, recover, log) -> Trained:
    """:func:`train_federation` in this process, with the run's journal; the federation's
    failure report kept and the federation closed (Ray stopped for flower-sim) on every exit."""
    try:
        journal = recover if recover is not None else os.path.join(place.out, JOURNAL_FILE)
        result, summary, declared = train_federation(
            cfg, federation, data.problem, data.dataset, place.delta, place.ledger_path, place.run_id, place.noise,
            log, w0, journal, journal_header={"out": os.path.abspath(place.out), "resumed_from": resume},
        )  # fmt: skip
    finally:
        failures = federation.failure_report()  # per request, per user: why (Flower backends)
        close = getattr(federation, "close", None)
        if close is not None:
            close()
    return Trained(result, summary, declared, failures)


@dataclass
class RunData:
    """A run's data and problem, as every backend's server side holds them: ``dataset``, ``problem``, its
    ``name`` and ``spec`` (what model.pt records, :func:`fedkl.problems.problem_spec`), and ``evaluator``,
    the in-process federation over them (the in-process backend trains through it; the NOT private
    evaluation and reference read it)."""

    dataset: FederatedDataset
    problem: object
    name: str
    spec: dict

    @classmethod
    def load(cls, cfg: RunConfig, dataset: FederatedDataset | None = None, model=None) -> "RunData":
        """``cfg``'s data and problem (:func:`load_run_data`; ``dataset``, ``model``: your own objects)."""
        dataset, problem, name = load_run_data(cfg, dataset, model)
        model = cfg.model if model is None else model
        return cls(dataset, problem, name, problem_spec(name, dataset, cfg.reg, model, problem_dtype(cfg, name)))

    @functools.cached_property
    def evaluator(self) -> InProcessFederation:
        return InProcessFederation(self.problem, self.dataset)


@dataclass
class Released(AlgorithmResult):
    """An algorithm's result read back from a deployment's record (:meth:`Trained.from_record`)."""

    w: torch.Tensor | None = None
    rounds: int | None = None
    sigma: object = None
    rho_spent: float | None = None
    details: dict = dataclasses.field(default_factory=dict)
    history: list = dataclasses.field(default_factory=list)


@dataclass
class Trained:
    """What a training returned, wherever it ran (this process, or a deployment's ServerApp): the algorithm's
    ``result``, the ledger ``summary``, the ``declared`` guarantee and the transport's ``failures`` report.
    :func:`write_run_files` writes a run's files from it; :meth:`record` is its strict-JSON form, the one a
    deployed ServerApp hands back (``flower_result.json``), read back by :meth:`from_record`."""

    result: AlgorithmResult
    summary: dict
    declared: Guarantee
    failures: dict | None = None

    def record(self) -> dict:
        """The JSON form: the released model as a list (None: no output), the public round records only
        (never a secret sample's size, :data:`fedkl.algorithms.round_log.NOT_PUBLIC`)."""
        r = self.result
        return {
            "w": None if r.w is None else [float(x) for x in r.w],
            "rounds": r.rounds,
            "sigma": r.sigma,
            "rho_spent": r.rho_spent,
            "details": r.details or {},
            "history": public_history(r.history),
            "ledger": self.summary,
            "guarantee": self.declared.to_dict(),
            "failures": self.failures,
        }

    @classmethod
    def from_record(cls, rec: dict) -> "Trained":
        """The Trained of a :meth:`record` (an older ServerApp's record may lack the optional entries)."""
        w = None if rec.get("w") is None else torch.tensor(rec["w"], dtype=torch.float64)
        get = rec.get
        result = Released(w, get("rounds"), get("sigma"), get("rho_spent"), get("details") or {}, get("history") or [])
        return cls(result, rec["ledger"], Guarantee.from_dict(rec["guarantee"]), get("failures"))


def write_run_files(
    cfg: RunConfig,
    trained: Trained,
    data: RunData,
    place: RunPlace,
    *,
    resume: str | None,
    started: float,
    log: Callable[[str], None],
    backend: str | None = None,
) -> dict:
    """What every entry point writes once a run has trained (``trained``: the algorithm's result, the ledger
    summary, the declared guarantee, the failures), whatever the backend: ``model.pt`` with its privacy receipt,
    ``result.json`` (strict; the non-private reference added when ``cfg.reference``), and the summary lines
    (privacy, test metric, files) through ``log``; returns result.json's payload. ``backend``: the label
    result.json gives (default ``cfg.backend``; the deployed ServerApp of ``flwr run`` says ``flwr-run``).
    A server holding no records (sites that load their own files, dataset ``sites``) has no test metric, trivial
    baseline or reference to compute: result.json says ``null`` for them and the log says there is none."""
    result, receipt = trained.result, _receipt(cfg, trained, place, resume)
    held = data.dataset.test.num_records > 0  # the server's own test data (none where sites keep their records)
    trivial = data.problem.trivial_metrics(data.dataset.train, data.dataset.test) if held else {}
    test = {} if result.w is None or not held else data.evaluator.evaluate(result.w, "test")
    key = quality_metric(test or trivial)  # an algorithm may release "no output" (e.g. a failed stability test)
    model_path = None
    if result.w is not None:  # the released model only (a private output): never the reference
        model_path = os.path.join(place.out, "model.pt")
        SavedModel(torch.as_tensor(result.w), data.spec, receipt).save(model_path)
    payload = _payload(cfg, trained, data, place, receipt, backend)
    payload["test_metric"], payload["test_metrics"] = {"name": key, "value": test.get(key)}, test
    payload.update(trivial_baseline=trivial, wall_time_s=time.time() - started, model_path=model_path)
    if not held:
        payload.update(test_metric=None, test_metrics=None, trivial_baseline=None, nonprivate_reference=None)
    result_path = os.path.join(place.out, "result.json")
    write_json(result_path, payload)  # the private result first: an evaluation below cannot lose it
    log(_privacy_line(cfg, trained, place, receipt, payload["users"]))
    if not held:
        log("test metric: none (the server holds no test records: where sites keep their own data, they evaluate it)")
    else:
        got = f"{test[key]:.4f}" if key in test else "n/a (the algorithm released no model)"
        log(f"test {key} = {got}   (trivial baseline {trivial.get(key, math.nan):.4f})")
    log(f"wrote {result_path}" + (f", {model_path}" if model_path else "") + f" and ledger {place.ledger_path}")
    try:  # after result.json: a figure that cannot be drawn never fails a trained, charged run
        line = write_round_metrics(place.out, result.history, f"{cfg.algorithm} on {cfg.dataset}")
    except Exception as exc:  # noqa: BLE001  (one line; the run's outcome is result.json)
        line = f"note: could not write the per-round metrics ({type(exc).__name__}: {exc})"
    if line:
        log(line)
    if cfg.reference and held:
        # a network's reference is FedAvg without clip or noise under the run's plan, never L-BFGS (fedkl.algorithms.nonprivate)
        plan = None if data.problem.convex else fedavg_plan(cfg.params, cfg.seed)
        payload["nonprivate_reference"] = reference_metrics(data.evaluator, data.spec, log, plan=plan)
        payload["wall_time_s"] = time.time() - started
        write_json(result_path, payload)
        ref = payload["nonprivate_reference"].get(key, math.nan)
        log(f"non-private reference {key} = {ref:.4f}; updated {result_path}")
    log(f"done in {payload['wall_time_s']:.1f} s")
    return payload


def _receipt(cfg: RunConfig, trained: Trained, place: RunPlace, resume: str | None) -> dict:
    """The privacy receipt model.pt carries (and result.json repeats): the guarantee and what it rests on."""
    summary, declared = trained.summary, trained.declared
    return {
        "algorithm": cfg.algorithm,
        "run_id": place.run_id,
        "epsilon": summary.get("max_user_epsilon_exact", summary["max_user_epsilon"]),  # an older ServerApp: bound
        "delta": place.delta,
        "rho": summary["max_user_rho"],
        "budget": {"epsilon": cfg.epsilon, "delta": place.delta, "conversion": cfg.conversion},
        "neighbouring": cfg.neighbouring,
        "accountant": accountant(cfg, declared),
        "guarantee": declared.to_dict(),
        "clients_assumed": declared.clients.describe(),
        "clients_see": algorithm_spec(cfg.algorithm).clients_see(cfg.params).describe(),
        "ledger": {"path": os.path.abspath(summary.get("path") or place.ledger_path), "run_id": place.run_id},
        "dataset": cfg.dataset,
        "resumed_from": resume,
        "settings": public_settings(cfg.settings()),
    }


def _payload(cfg: RunConfig, trained: Trained, data: RunData, place: RunPlace, receipt: dict, backend) -> dict:
    """result.json's fields (its test metrics, trivial baseline, wall time and model path: placeholders here)."""
    summary, result = trained.summary, trained.result
    return {
        "run_id": place.run_id,
        "algorithm": cfg.algorithm,
        "dataset": cfg.dataset,
        "dataset_description": data.dataset.description,
        "problem": data.name,
        "users": data.dataset.train.num_users,
        "partition": data.dataset.extra.get("partition"),
        "epsilon": receipt["epsilon"],
        "epsilon_by_budget_conversion": summary["max_user_epsilon"],
        "delta": place.delta,
        "rho": summary["max_user_rho"],
        "neighbouring": cfg.neighbouring,
        "neighbouring_means": RELATION_TEXT[cfg.neighbouring],
        **{k: receipt[k] for k in ("clients_assumed", "clients_see", "accountant", "guarantee")},
        "budget": {"epsilon": cfg.epsilon, "delta": place.delta},
        "backend": backend or cfg.backend,
        "test_metric": None,
        "test_metrics": None,
        "nonprivate_reference": "pending" if cfg.reference else None,
        "trivial_baseline": None,
        "seed": cfg.seed,
        **place.noise.describe(),
        "rounds": result.rounds,
        "sigma_sum": result.sigma,
        "algorithm_details": result.details or {},
        "failures": trained.failures,
        "ledger": summary,
        "config": cfg.settings(),
        "wall_time_s": None,
        "metrics_are_private": False,
        "out_dir": place.out,
        "model_path": None,
        "resumed_from": receipt["resumed_from"],
    }


def _privacy_line(cfg: RunConfig, trained: Trained, place: RunPlace, receipt: dict, n: int) -> str:
    """The run's guarantee as its log says it (epsilon, delta, and how they were computed)."""
    summary, eps, delta = trained.summary, receipt["epsilon"], place.delta
    how = (
        receipt["accountant"]
        if not trained.declared.zcdp
        else f"zCDP rho = {summary['max_user_rho']:.5g}; exact Gaussian conversion, {cfg.conversion} gives "
        f"{summary['max_user_epsilon']:.4f}"
        if eps < summary["max_user_epsilon"]
        else f"zCDP rho = {summary['max_user_rho']:.5g}, {cfg.conversion}"
    )
    return (
        f"privacy: user-level ({cfg.neighbouring}; {assumption(trained.declared.clients)}) epsilon = {eps:.4f}, "
        f"delta = {delta:.3g} ({how})" + large_delta_note(delta, n)
    )
