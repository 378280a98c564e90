"""``fedkl run``: one user-level DP training, end to end, with its result file and ledger.

What is private and what is not (also in the README):
* private (user-level, under the stated relation and budget): every released noisy sum, hence the
  iterates and the final model;
* NOT private, reported for evaluation only: the test metrics (computed on held-out records of the
  same users), the non-private reference model's metrics and the trivial baseline. A deployment
  keeps these off the wire or privatizes them separately.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import math
import os
import random
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fedkl.algorithms.forecast import LEARNS_LITTLE, gradient_forecast
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
from fedkl.data import FederatedDataset, load_dataset
from fedkl.data.files import SCHEMA_SETTINGS, is_data_file, loader_kwargs
from fedkl.data.standin import STANDIN_RECORDS, public_standin
from fedkl.federation.base import Federation
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, BudgetExceeded, LedgerError, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.clients import FEDKL_CLIENTS, TRUST_MODELS, assumption, require_trust
from fedkl.privacy.guarantee import RELATION_TEXT, Guarantee
from fedkl.privacy.journal import JournalError, ReleaseJournal
from fedkl.privacy.release import PREPAY_WINDOW_S
from fedkl.problems import DEFAULT_PROBLEM, make_problem, problem_spec
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


@dataclass(frozen=True)
class Transport:
    """A backend other than in-process, registered by the transport layer above this one
    (:mod:`fedkl.flower.backends`); the run layer never imports a transport.

    ``open(cfg, dataset) -> Federation``: a federation the algorithm trains through here (closed with
    its ``close()``), or ``train(cfg, dataset, out, log[, recover=RUN_DIR]) -> (result, ledger summary)``: a
    run that keeps its ledger, noise and journal elsewhere (a deployment's ServerApp; ``recover``: recover
    that run there); ``result`` has ``.w`` and
    ``.guarantee`` (the algorithm's declared :class:`Guarantee`)."""

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
    shards: int = 2  # --backend ray-shards: Ray actors, each holding a block of users (fedkl.federation.ray_shards)
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
    plan: list[dict] | Callable[[], list[dict]] | None = None,
    journal_header: dict | None = None,
    scratch: bool = False,
    releaser_type: type[Releaser] = Releaser,
):
    """Train through ``federation`` with the ledger, filter and noise in this process, from ``w0``
    (default: the problem's initial parameters). Returns the algorithm's result, the ledger summary
    and the algorithm's declared :class:`Guarantee`.

    ``journal``: a path, where this run's release journal is created (what ``--recover`` needs), or
    an open :class:`ReleaseJournal` of a run whose process died: then this call recovers that run
    (``run_id`` must be its id; :class:`fedkl.privacy.release.Releaser`); ``journal_header``: more
    header entries for a new journal; ``scratch``: ``ledger_path`` is a throw-away ledger (no fsync);
    ``releaser_type``: the Releaser class (the white-box audit's recording one, :mod:`fedkl.audit.whitebox`). ``plan``: the run's planned
    releases (:func:`planned_releases`), or a function that makes them, prepaid in time-bounded batches
    (:meth:`fedkl.privacy.release.Releaser.batch_size`) for an algorithm that declares ``plan_is_public``
    and is not adaptive (the function is called only then: PREPAID_NOTE below)."""
    observer = RUN_OBSERVER.get() or RunObserver()
    recovering = isinstance(journal, ReleaseJournal)
    # a release's noise depends on earlier draws: the journal keeps them (a secret; fedkl.privacy.journal)
    noise_state = algorithm_spec(cfg.algorithm).noise_state
    if recovering and noise_state and not journal.keeps_draws and noise.mode == "secure":
        raise JournalError(
            f"{journal.path}: {cfg.algorithm}'s later noise depends on earlier draws, which this run's journal "
            "did not keep (a run started before fedkl journalled them): with secure noise it cannot be recovered "
            "(nothing was charged)"
        )
    if recovering:  # the run of a process that died: same run id; a refusal leaves that run as it is (not ended here)
        check_recovery_ledger({"ledger": ledger_path, "run_id": run_id})  # never a new ledger
    budget = Budget(cfg.epsilon, delta, cfg.conversion)
    ledger = PrivacyLedger(ledger_path, budget, run_id, cfg.settings(), scratch=scratch, new_run=not recovering)
    if recovering:
        try:
            ledger.take_over(federation.user_ids)
        except BaseException:
            ledger.close()
            raise
    # cfg.kernels in force here too, for callers that train without run_training (the audit, the ServerApp)
    with kernels(cfg.kernels), ledger:
        if recovering:  # its users' budget as it had it
            header = journal.header()
            rho_total, approx_left = header["rho_left"], tuple(header["approx_left"])
        else:
            ledger.reserve(federation.user_ids)  # verifies the ledger; LedgerBusy while another run holds these users
            rho_total, approx_left = ledger.rho_left(federation.user_ids), ledger.approx_left(federation.user_ids)
        observer.started(run_id, ledger_path)
        if rho_total <= 0 and w0 is not None:  # --resume: what it is for, and what to do instead
            raise BudgetExceeded(
                f"--resume: ledger {ledger_path} has nothing left of these users' budget (eps={cfg.epsilon}, "
                f"delta={delta:g}; the built-in algorithms spend all of it): --resume continues a run that left "
                "budget on its ledger; to train more, start a new run with a larger --epsilon on a new --ledger "
                "(a new guarantee: these users' privacy loss is then both runs' together; nothing was charged)"
            )
        if rho_total <= 0:
            raise BudgetExceeded(
                f"ledger {ledger_path}: the users' budget (eps={cfg.epsilon}, delta={delta:g}) "
                "is already spent; nothing to train with"
            )
        if rho_total < ledger.budget.rho * (1 - 1e-9):
            log(f"resuming ledger {ledger_path}: rho {rho_total:.4g} of {ledger.budget.rho:.4g} left")
        left = (rho_total, approx_left)
        alg = build_algorithm(cfg, problem, dataset.feature_bound, federation.user_ids, delta, ledger, left)
        sigma = getattr(alg, "sigma", None)
        declared: Guarantee = alg.guarantee
        if cfg.secagg:  # the server no longer sees (nor bounds) each answer: fedkl/flower/secagg.py
            declared = dataclasses.replace(declared, clients=FEDKL_CLIENTS)
        try:  # a weaker trust model is an explicit opt-in where clients run their own code
            require_trust(
                alg.guarantee.clients, cfg.clients, getattr(federation, "clients_run_own_code", False), cfg.algorithm
            )
        except ValueError:
            ledger.finish_run("refused")
            raise
        if not declared.zcdp:  # zCDP rho, rounds and clip are not what these algorithms use
            how = declared.accountant(cfg.conversion, getattr(cfg.params, "accountant", None))
            log(
                f"budget: user-level ({cfg.neighbouring}) eps={cfg.epsilon}, delta={delta:.3g}, {how}; backend {cfg.backend}"
                + large_delta_note(delta, federation.num_users)
            )
        else:
            shape = [
                f"{cfg.params.rounds} rounds" if hasattr(cfg.params, "rounds") else "",
                f"clip {cfg.params.clip}" if hasattr(cfg.params, "clip") else "",
                f"backend {cfg.backend}",
            ]
            log(
                f"budget: user-level ({cfg.neighbouring}) eps={cfg.epsilon}, delta={delta:.3g} -> "
                f"zCDP rho={rho_total:.5g} ({cfg.conversion}); "
                + ", ".join(x for x in shape if x)
                + (f", noise std on the sum {sigma:.4g}" if isinstance(sigma, float) else "")
                + large_delta_note(delta, federation.num_users)
            )

        progress = ProgressEgress(observer, log)
        if cfg.conversion == "gaussian" and not getattr(alg, "gaussian_releases_only", True):
            ledger.finish_run("refused")
            raise ValueError(
                f"{cfg.algorithm} with these settings makes a zCDP release that is not Gaussian, so the "
                "exact Gaussian conversion does not hold for it: use --conversion cks (nothing was read "
                "or charged)"
            )
        forecast = (
            alg.forecast(federation.num_users, problem.init_params(), federation.user_ids)
            if hasattr(alg, "forecast")
            else None
        )
        if forecast is not None:
            log("forecast (public values, before any data): " + ", ".join(f"{k} {v:.4g}" for k, v in forecast.items()))
            if forecast["noise_over_signal"] > 1 and not cfg.force:
                ledger.finish_run("refused")
                raise ValueError(
                    f"{cfg.algorithm}: its first release's noise (norm ~{forecast['noise_norm']:.3g}) is "
                    f"{forecast['noise_over_signal']:.3g}x the farthest the model can move ({forecast['signal_radius']:.3g}) "
                    f"at this budget and n={federation.num_users}: the model would be noise around its start. Nothing "
                    "was read or charged. noisy-gd learns here (--algorithm noisy-gd; `fedkl plan` ranks every "
                    "algorithm on these settings); --force runs it anyway"
                )
            if forecast["noise_over_signal"] > LEARNS_LITTLE:  # before any budget is spent
                log(
                    f"warning: predicted to learn little: the first release's noise is "
                    f"{forecast['noise_over_signal']:.3g}x the farthest the model can move; such runs can land "
                    "below the majority class: raise eps or users, or see `fedkl plan`"
                )
        grad = gradient_forecast(alg, cfg.params, federation.num_users, problem.num_params, cfg.neighbouring)
        if grad is not None and grad[0] > LEARNS_LITTLE:  # before any budget is spent (`fedkl plan` ranks them)
            log(
                f"warning: predicted to learn little: the noise is {grad[0]:.3g}x the largest signal ({grad[1]}); "
                f"at eps={cfg.epsilon} and n={federation.num_users} such runs score about the majority class: raise "
                "eps, users or rounds, or see `fedkl plan`"
            )
        for line in alg.warnings() if hasattr(alg, "warnings") else ():  # public settings, before any budget is spent
            log(f"warning: {line}")
        try:
            # no run-wide filter for (eps, delta) releases, nor for algorithms whose users each take part in
            # one disjoint cohort (parallel composition: the per-user ledger enforces every user's budget)
            if isinstance(journal, str):
                header = {**(journal_header or {}), "run_id": run_id, "settings": cfg.settings(), "delta": delta}
                header["ledger"] = os.path.abspath(ledger_path)
                journal = ReleaseJournal.create(
                    journal, {**header, "rho_left": rho_total, "approx_left": approx_left}, noise_draws=noise_state
                )
            releaser = releaser_type(
                ledger,
                noise,
                ZCDPFilter(rho_total) if declared.run_wide_filter else None,
                journal=journal,
                replay=recovering,
            )
            if hasattr(releaser, "see_algorithm"):  # the plan's dry run (_ScheduleCut)
                releaser.see_algorithm(alg)
            # PREPAID_NOTE: prepaid only where the plan made before the data is this run's: an algorithm that
            # declares ``plan_is_public`` (its releases' number, order, labels, charge records and cohorts follow
            # from public values) and is not adaptive. Elsewhere a release can differ from the plan (kl-spider
            # stops a phase on a released estimate; sc-phased-sco's charge records carry the privately chosen
            # Delta): the plan is then dropped, but the rows prepaid ahead stay charged and refused a later
            # release the budget was sized for. Those algorithms are charged release by release.
            if plan is not None and not declared.adaptive and getattr(alg, "plan_is_public", False):
                releaser.plan(lambda: _planned(plan, log), window_s=PREPAY_WINDOW_S)
            # every egress flushes the journal first (fedkl.privacy.journal): progress records, a
            # transport's messages to nodes, and (below, and the finally) the end of the run
            progress.flush = federation.before_send = releaser.flush
            start = problem.init_params() if w0 is None else w0
            result = alg.run(federation, releaser, start, progress)
            releaser.finish()
            releaser.flush()
            if recovering:
                log(
                    f"recovered run {run_id}: {releaser.replayed} releases replayed from its journal, none charged twice"
                )
            if not isinstance(result, AlgorithmResult):
                raise TypeError(
                    f"{cfg.algorithm}: run() must return an AlgorithmResult (fedkl.algorithms.registry), "
                    f"got {type(result).__name__}"
                )
            if forecast is not None and isinstance(result.details, dict):
                result.details["forecast"] = forecast  # the price, in result.json's algorithm_details
        except BaseException as e:
            ledger.finish_run(ledger.end_status(e))  # interrupted (Ctrl-C) or failed
            raise
        finally:
            federation.before_send = None
            if journal is not None and not isinstance(journal, str):
                journal.close()  # flushes: every exit path leaves the journal durable
        ledger.finish_run("finished")
        if journal is not None and not isinstance(journal, str):
            journal.purge_secret()  # a finished run cannot be recovered: its noise draws are needed no more
        observer.trained(result.w is not None)
        if scratch:  # a dry run's throw-away ledger: nothing to verify or report
            return result, {}, declared
        ledger.verify()
        summary = ledger.summary()

    return result, summary, declared


def _planned(plan: list[dict] | Callable[[], list[dict]], log: Callable[[str], None]) -> list[dict] | None:
    """The plan to prepay; None (each release charged on its own, the safe way) when the dry run that
    makes it fails: prepaying is an optimisation, never a reason for a run to fail."""
    if not callable(plan):
        return plan
    # made mid-run (fedkl.privacy.release.Releaser.plan): the run's global random states are left as they were
    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    try:
        return plan()
    except Exception as e:  # noqa: BLE001  (any failure of the dry run; Ctrl-C still stops the run)
        log(f"note: no prepaid charges (the plan's dry run failed: {e}); each release is charged on its own")
        return None
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


def planned_releases(cfg: RunConfig, dataset: FederatedDataset, records_per_user: int = STANDIN_RECORDS) -> dict:
    """The releases ``fedkl run`` of ``cfg`` makes on a fresh ledger, in order, from public values
    only: this run's own code on :func:`fedkl.data.standin.public_standin` of ``dataset`` (its user ids
    and shape, zero records) with a temporary ledger (why that is the real run's plan:
    :func:`fedkl.planner.charge_plan`). Returns ``{"users", "delta", "releases": [{label, mechanism,
    charge, users, cohort, members}], "per_user_max": {rho, eps, delta}, "adaptive"}``."""
    standin = public_standin(dataset, records_per_user)
    problem = make_problem(cfg.problem or DEFAULT_PROBLEM[dataset.task], standin, reg=cfg.reg, model=cfg.model)
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
    """The dry run's Releaser. An algorithm whose plan is a schedule declares ``plan_schedule() -> (count,
    label)``: it makes ``count`` releases, release ``k`` labelled ``label(k)``, each with release 0's typed
    charge, mechanism and cohort. Its dry run is then stopped at the draw of its second release (both charged
    on the throw-away ledger, so both are the run's own code's records); :func:`_scheduled` checks the second
    against the schedule and writes out the rest. Planning then costs two rounds, not ``count`` (a 20,000-round
    run's dry run took a minute: issue 31); an algorithm without ``plan_schedule`` runs its whole dry run."""

    schedule: tuple[int, Callable[[int], str]] | None = None
    guarantee: Guarantee | None = None

    def see_algorithm(self, alg) -> None:
        declare = getattr(alg, "plan_schedule", None)
        self.schedule, self.guarantee = (declare() if declare is not None else None), alg.guarantee

    def _emit(self, seq, *args, **kwargs):
        if self.schedule is not None and seq >= 1:
            raise _PlanCut(self.guarantee, self.schedule)
        return super()._emit(seq, *args, **kwargs)


def _scheduled(rows: list[dict], totals: dict, count: int, label: Callable[[int], str]) -> tuple[list[dict], dict]:
    """The plan of ``count`` releases from the dry run's first two (``rows``; ``totals``: their most charged
    user's rho, eps and delta): release ``k`` is the first with ``label(k)``, seq ``k`` and the ledger id it
    would get. A second release that is not what the schedule says is a ValueError (no plan is better than a
    wrong one)."""

    def nth(k: int) -> dict:
        return {**rows[0], "id": rows[0]["id"] + k, "seq": k, "label": label(k)}

    if len(rows) != 2 or rows[1] != nth(1):
        raise ValueError(
            f"the algorithm declares its plan a schedule of {count} like releases, but its dry run's release 1 is "
            f"{rows[1]['label'] if len(rows) > 1 else 'missing'}, not {nth(1)['label']} with release 0's charge"
        )
    return [nth(k) for k in range(count)], {k: v / 2 * count for k, v in totals.items()}


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
        releases, per_user_max = _scheduled(releases, per_user_max, *schedule)
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


def prepare_run(cfg: RunConfig, num_users: int, suffix: str = "") -> tuple[float, str, str, str, NoiseSource]:
    """What every run derives from its configuration: delta (default 1/n^1.1), a fresh run id, the
    output folder (created; absolute) the ledger path (absolute) and the noise source."""
    delta = cfg.delta if cfg.delta is not None else default_delta(num_users)
    check_delta(delta, num_users, cfg.allow_large_delta)  # before the run's folder and ledger exist
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    name = os.path.basename(cfg.dataset)  # a data file: its file name (the path may be absolute)
    out = os.path.abspath(cfg.out or os.path.join("runs", f"{run_id}-{cfg.algorithm}-{name}{suffix}"))
    os.makedirs(out, exist_ok=True)
    ledger_path = os.path.abspath(cfg.ledger or os.path.join(out, "ledger.sqlite"))
    return delta, run_id, out, ledger_path, NoiseSource(cfg.noise_seed)


def load_run_dataset(cfg: RunConfig) -> FederatedDataset:
    """The dataset of a run configuration (real datasets: split by ``seed``; synthetic ones: drawn
    with ``seed`` and ``users``; a data file: split by ``seed``, read with its schema settings)."""
    schema = loader_kwargs({k: getattr(cfg, k, None) for k in SCHEMA_SETTINGS})  # cfg may be a plugin's namespace
    if is_data_file(cfg.dataset):
        if cfg.users is not None:
            raise ValueError(f"--users applies to synthetic datasets; {cfg.dataset} has the users of its user column")
        return load_dataset(cfg.dataset, split_seed=cfg.seed, **schema)
    if schema:
        raise ValueError(f"{', '.join(SCHEMA_SETTINGS)} apply to --dataset FILE (a .csv/.npz/.parquet file)")
    if cfg.dataset in ("movielens", "tv16"):
        if cfg.users is not None:
            raise ValueError(f"--users applies to synthetic datasets; {cfg.dataset} has a fixed set of users")
        return load_dataset(cfg.dataset, split_seed=cfg.seed)
    return load_dataset(cfg.dataset, seed=cfg.seed, **({"n_users": cfg.users} if cfg.users else {}))


def load_run_data(cfg: RunConfig) -> tuple:
    """``(dataset, problem, problem name)`` of a run configuration (:func:`load_run_dataset`)."""
    dataset = load_run_dataset(cfg)
    problem_name = cfg.problem or DEFAULT_PROBLEM[dataset.task]
    return dataset, make_problem(problem_name, dataset, reg=cfg.reg, model=cfg.model), problem_name


def run_training(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    dataset: FederatedDataset | None = None,
    model: Callable | torch.nn.Module | None = None,
    resume: str | None = None,
    prepay: bool = True,
    recover: ReleaseJournal | None = None,
) -> dict:
    """Train with ``cfg.kernels`` in force (:func:`fedkl.problems.rowwise.kernels`) and its paths absolute
    (:func:`absolute_paths`); see :func:`_run_training`."""
    cfg = absolute_paths(cfg)
    resume = None if resume is None else os.path.abspath(resume)  # recorded (journal, receipt): absolute
    with kernels(cfg.kernels):
        return _run_training(cfg, log, dataset, model, resume, prepay, recover)


JOURNAL_FILE = "journal.sqlite"  # in the run folder: the release journal (fedkl.privacy.journal)


def open_recovery(run_dir: str, cfg: RunConfig | None = None) -> ReleaseJournal:
    """The open journal of ``run_dir``'s run, to recover it (close it). JournalError (one line, nothing
    charged) unless ``cfg`` (default: the settings in the journal, rebuilt) has exactly that run's settings."""
    journal = ReleaseJournal.open(os.path.join(run_dir, JOURNAL_FILE))
    try:
        check_recovery_ledger(journal.header())
        settings = journal.header()["settings"]
        ours = json.loads(json.dumps((cfg or RunConfig.from_settings(**settings)).settings(), default=str))
        differ = sorted(k for k in set(settings) | set(ours) if settings.get(k) != ours.get(k))
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


def recover_run(run_dir: str, log: Callable[[str], None] = print, before: Callable | None = None) -> dict:
    """``fedkl run --recover RUN_DIR``: finish the run of ``RUN_DIR`` whose process died (kill -9,
    power loss, OOM ...), from its release journal and its ledger, without charging any release twice
    (:class:`fedkl.privacy.release.Releaser`). The run is re-executed with its own settings, seed and
    data; what it released before the crash is returned from the journal. Not ``--resume`` (a new run
    warm-started from a finished run's released model). ``before(cfg)``: called with the run's
    configuration before it trains (``fedkl run`` registers a Flower backend there)."""
    run_dir = os.path.abspath(run_dir)
    journal = open_recovery(run_dir)
    try:
        header = journal.header()
        cfg = RunConfig.from_settings(**header["settings"])
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
    prepay: bool = True,
    recover: ReleaseJournal | None = None,
) -> dict:
    """Train, write ``model.pt`` (the released model with its privacy receipt, when there is one:
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
    ``prepay`` (default): charge the run's planned releases (:func:`planned_releases`, a dry run on a
    public stand-in, made only for an algorithm that declares ``plan_is_public``) in time-bounded batches, one
    ledger transaction each (False: one transaction per release); ``recover``: the journal of a run to recover (:func:`recover_run`).
    A run trained in this process keeps its release journal in ``out/journal.sqlite``."""
    started = time.time()
    if cfg.secagg and cfg.backend in ("inprocess", "ray-shards"):
        raise ValueError("--secagg aggregates over Flower: use --backend flower-local, flower-sim or grpc")
    for what, given in (("a dataset", dataset), ("a model", model)):
        if given is not None and cfg.backend != "inprocess":
            raise ValueError(
                f"{what} given as an object trains in-process only (backend {cfg.backend!r} builds its "
                "clients from names: use a dataset name and --model package.module:factory)"
            )
    if dataset is None and model is None:
        dataset, problem, problem_name = load_run_data(cfg)
    else:
        dataset = dataset if dataset is not None else load_run_dataset(cfg)
        problem_name = cfg.problem or ("torch" if model is not None else DEFAULT_PROBLEM[dataset.task])
        problem = make_problem(problem_name, dataset, reg=cfg.reg, model=model if model is not None else cfg.model)
    spec = problem_spec(problem_name, dataset, cfg.reg, model if model is not None else cfg.model)
    evaluator = InProcessFederation(problem, dataset)  # non-private evaluation (research use)
    transport = transport_for(cfg.backend)
    w0 = None
    if resume is not None:
        if transport is not None and transport.train is not None:
            raise ValueError(f"--resume trains through the ledger of this process; backend {cfg.backend} keeps its own")
        ledger = cfg.ledger or os.path.join(cfg.out or "", "ledger.sqlite")
        w0 = check_resume(resume, cfg.settings(), ledger, spec).to(problem.dtype)
    # the federation the algorithm trains through; a deployment (transport.train) trains elsewhere
    federation = evaluator if transport is None or transport.open is None else transport.open(cfg, dataset)
    n = federation.num_users
    if recover is None:
        delta, run_id, out, ledger_path, noise = prepare_run(cfg, n)
    else:  # the recovered run's own id, folder and ledger (a recovery creates no folder of its own)
        header = recover.header()
        run_id, out, ledger_path, delta = header["run_id"], header["out"], header["ledger"], header["delta"]
        noise = NoiseSource(cfg.noise_seed)
    log(
        f"fedkl run {run_id}: {cfg.algorithm} on {cfg.dataset} ({n} users, "
        f"{dataset.train.num_records} train records, {problem.num_params} parameters); "
        f"noise: {noise.mode}" + (f"; resuming the released model of {resume}" if w0 is not None else "")
    )
    for note in dataset.extra.get("notes", ()):  # what reading a data file did (columns left out, records clipped)
        log(f"note: {os.path.basename(cfg.dataset)}: {note}")

    if transport is not None and transport.train is not None:  # ledger + noise live in the deployment's ServerApp
        # recovering: the ServerApp recovers the run of the folder holding the journal (fedkl-recover)
        # (with the run's own fedkl-out, cfg.out: that run's ServerApp settings, which its recovery must repeat)
        recovering = {} if recover is None else {"recover": os.path.dirname(os.path.abspath(recover.path))}
        result, summary = transport.train(cfg, dataset, (recover is not None and cfg.out) or out, log, **recovering)
        declared = result.guarantee
        failures = getattr(result, "failures", None)
    else:
        try:
            journal = recover if recover is not None else os.path.join(out, JOURNAL_FILE)
            plan = (lambda: planned_releases(cfg, dataset)["releases"]) if prepay and recover is None else None
            result, summary, declared = train_federation(
                cfg,
                federation,
                problem,
                dataset,
                delta,
                ledger_path,
                run_id,
                noise,
                log,
                w0,
                journal,
                plan,
                journal_header={"out": os.path.abspath(out), "resumed_from": resume},
            )
        finally:
            failures = federation.failure_report()  # per request, per user: why (Flower backends)
            close = getattr(federation, "close", None)
            if close is not None:
                close()  # stops Ray for flower-sim

    return write_run_files(
        cfg, result, summary, declared, dataset=dataset, problem=problem, problem_name=problem_name, spec=spec,
        evaluator=evaluator, run_id=run_id, delta=delta, out=out, ledger_path=ledger_path, noise=noise,
        failures=failures, resume=resume, started=started, log=log, n=n,
    )  # fmt: skip


def write_run_files(
    cfg: RunConfig,
    result,
    summary: dict,
    declared: Guarantee,
    *,
    dataset: FederatedDataset,
    problem,
    problem_name: str,
    spec: dict,
    evaluator: InProcessFederation,
    run_id: str,
    delta: float,
    out: str,
    ledger_path: str,
    noise: NoiseSource,
    failures,
    resume: str | None,
    started: float,
    log: Callable[[str], None],
    n: int,
    backend: str | None = None,
) -> dict:
    """What every entry point writes once a run has trained (``result``: its ``.w``, ``.rounds``, ``.sigma``,
    ``.details``; ``summary``: the ledger's): ``model.pt`` with its privacy receipt, ``result.json`` (strict; the
    non-private reference added when ``cfg.reference``), and the summary lines (privacy, test metric, files)
    through ``log``; returns result.json's payload. ``backend``: the label result.json gives (default
    ``cfg.backend``; the deployed ServerApp of ``flwr run`` says ``flwr-run``)."""
    trivial = problem.trivial_metrics(dataset.train, dataset.test)
    test = {} if result.w is None else evaluator.evaluate(result.w, "test")
    key = quality_metric(test or trivial)  # an algorithm may release "no output" (e.g. a failed stability test)
    eps = summary.get("max_user_epsilon_exact", summary["max_user_epsilon"])  # a deployment's older ServerApp: bound
    receipt = {
        "algorithm": cfg.algorithm,
        "run_id": run_id,
        "epsilon": eps,
        "delta": delta,
        "rho": summary["max_user_rho"],
        "budget": {"epsilon": cfg.epsilon, "delta": delta, "conversion": cfg.conversion},
        "neighbouring": cfg.neighbouring,
        "accountant": declared.accountant(cfg.conversion, getattr(cfg.params, "accountant", None)),
        "guarantee": declared.to_dict(),
        "clients_assumed": declared.clients.describe(),
        "clients_see": algorithm_spec(cfg.algorithm).clients_see(cfg.params).describe(),
        "ledger": {"path": os.path.abspath(summary.get("path") or ledger_path), "run_id": run_id},
        "dataset": cfg.dataset,
        "resumed_from": resume,
        "settings": public_settings(cfg.settings()),
    }
    model_path = None
    if result.w is not None:  # the released model only (a private output): never the reference
        model_path = os.path.join(out, "model.pt")
        SavedModel(torch.as_tensor(result.w), spec, receipt).save(model_path)
    payload = {
        "run_id": run_id,
        "algorithm": cfg.algorithm,
        "dataset": cfg.dataset,
        "dataset_description": dataset.description,
        "problem": problem_name,
        "users": n,
        "epsilon": eps,
        "epsilon_by_budget_conversion": summary["max_user_epsilon"],
        "delta": delta,
        "rho": summary["max_user_rho"],
        "neighbouring": cfg.neighbouring,
        "neighbouring_means": RELATION_TEXT[cfg.neighbouring],
        "clients_assumed": receipt["clients_assumed"],
        "clients_see": receipt["clients_see"],
        "accountant": receipt["accountant"],
        "guarantee": receipt["guarantee"],
        "budget": {"epsilon": cfg.epsilon, "delta": delta},
        "backend": backend or cfg.backend,
        "test_metric": {"name": key, "value": test.get(key)},
        "test_metrics": test,
        "nonprivate_reference": "pending" if cfg.reference else None,
        "trivial_baseline": trivial,
        "seed": cfg.seed,
        **noise.describe(),
        "rounds": result.rounds,
        "sigma_sum": result.sigma,
        "algorithm_details": result.details or {},
        "failures": failures,
        "ledger": summary,
        "config": cfg.settings(),
        "wall_time_s": time.time() - started,
        "metrics_are_private": False,
        "out_dir": out,
        "model_path": model_path,
        "resumed_from": resume,
    }
    result_path = os.path.join(out, "result.json")
    write_json(result_path, payload)  # the private result first: an evaluation below cannot lose it
    how = (
        receipt["accountant"]
        if not declared.zcdp
        else f"zCDP rho = {summary['max_user_rho']:.5g}; exact Gaussian conversion, {cfg.conversion} gives "
        f"{summary['max_user_epsilon']:.4f}"
        if eps < summary["max_user_epsilon"]
        else f"zCDP rho = {summary['max_user_rho']:.5g}, {cfg.conversion}"
    )
    log(
        f"privacy: user-level ({cfg.neighbouring}; {assumption(declared.clients)}) epsilon = {eps:.4f}, "
        f"delta = {delta:.3g} ({how})" + large_delta_note(delta, n)
    )
    got = f"{test[key]:.4f}" if key in test else "n/a (the algorithm released no model)"
    log(f"test {key} = {got}   (trivial baseline {trivial.get(key, math.nan):.4f})")
    log(f"wrote {result_path}" + (f", {model_path}" if model_path else "") + f" and ledger {ledger_path}")
    try:  # after result.json: a figure that cannot be drawn never fails a trained, charged run
        line = write_round_metrics(out, getattr(result, "history", None), f"{cfg.algorithm} on {cfg.dataset}")
    except Exception as exc:  # noqa: BLE001  (one line; the run's outcome is result.json)
        line = f"note: could not write the per-round metrics ({type(exc).__name__}: {exc})"
    if line:
        log(line)
    if cfg.reference:
        payload["nonprivate_reference"] = reference_metrics(evaluator, spec, log)
        payload["wall_time_s"] = time.time() - started
        write_json(result_path, payload)
        log(
            f"non-private reference {key} = {payload['nonprivate_reference'].get(key, math.nan):.4f}; updated {result_path}"
        )
    log(f"done in {payload['wall_time_s']:.1f} s")
    return payload
