"""``fedkl tune``: a user-level private hyperparameter search whose whole cost is one ledger charge.

The mechanism (:mod:`fedkl.privacy.selection`; Papernot & Steinke 2022, random stopping). The search
draws ``K`` (truncated negative binomial or Poisson, public law, secret draw) and runs ``K``
independent trials of ONE base mechanism ``Q``; it releases only the best trial's output. One run of
``Q``:

1. draw an (algorithm, settings) point uniformly from the search space (secret randomness);
2. train that algorithm on the TRAINING users only, sized to ``rho_trial`` zCDP (every trial gets the
   same ``rho_trial``, whatever its settings); a dp-accounting schedule (dp-sgd, dp-fedavg, dp-adam, ...:
   guarantee ``schedule``) is sized instead so that its RDP curve is at most ``rho_trial l`` at every
   public order of :data:`fedkl.privacy.selection.TRIAL_GRID` (:func:`schedule_budget`), which makes it,
   and every trial of that search, ``c``-RDP for the step curve ``c(l) = rho_trial g+(l)``; such a search
   is accounted on ``c`` (``curve="grid"``; the derivation is :mod:`fedkl.privacy.selection`'s). Algorithms
   charged in (eps, delta) without an RDP curve (output perturbation, PTR, stability) are refused;
3. score the model on the VALIDATION users: each validation user's mean accuracy (classification) or
   mean record loss clipped to ``[0, B]`` (otherwise; score = minus it) over its own records, clipped
   to ``[0, B]`` (``B = 1`` for accuracy), summed over the validation users, plus Gaussian noise of
   L2 sensitivity ``B`` (replace-one: one user's value moves by at most ``B``; add-remove: one user adds
   or removes a value in ``[0, B]``) at ``rho_trial`` zCDP, divided by the public number of validation
   users. A trial that releases no model scores ``-inf`` (post-processing).

The split. A user is a validation user iff ``sha256(seed, user id) < validation fraction``: a
function of its own public id and the public seed only, so adding or removing one user moves no other
user between the parts, and replacing one user's data keeps its part. ``Q`` is therefore
``rho_trial``-zCDP for every user under the run's relation: a training user's data enters the model
(``rho_trial``, the trial's training is charged per user, on a stand-in ledger, as any fedkl run) and
the score only as post-processing of it; a validation user's data enters the score only
(``rho_trial``). So the budget split is: the whole per-trial ``rho_trial`` to training AND the whole of
it to the score, because they charge disjoint users (parallel composition); ``rho_trial`` is the
largest value (bisection) whose search bound (Theorem 2 or 6, converted at the search's delta) meets
the users' (eps, delta) left on the ledger. :func:`plan_search` prints that split before anything is
spent, and what one trial alone (the chosen model without the search) would have cost.

What the selection reveals, and why the whole search is covered. Released (result.json, model.pt,
the final lines on the console): the best trial's model, its algorithm and settings and its noisy
validation score (the output of ``Q`` that the theorem releases), plus public values (the search's
law, budget and charge). NOT released: ``K``, the losing trials (their settings, models, scores,
released iterates) and the chosen trial's position; the trials' own progress and stand-in ledgers stay
in memory and temporary files and are dropped. Per trial the console shows ``trial t: algorithm
settings`` only (the operator's view on the server, like the ledger; it reveals ``K`` to whoever
watches that console, and with the released settings which trial won, so it is not part of any release: a deployment that publishes its console
must run with ``log=None``). The theorem covers the best output for ANY behaviour of ``Q`` that is
``rho_trial``-zCDP, so the real ledger's one :class:`~fedkl.privacy.charges.SearchCharge` covers
everything the trials release: each trial runs with a real Releaser and real noise, on an in-memory
stand-in ledger whose budget is ``rho_trial`` (it enforces the trial's size; it is not the user's
ledger), and after each trial its stand-in ledger is checked to hold zCDP charges of at most
``rho_trial`` per user, and (``grid`` searches) its recorded schedules' RDP curves within ``rho_trial g`` on
the grid (else the search stops with an error).

The table. What may be published is what the theorem covers: the best trial's output (its model, algorithm,
settings and noisy score: result.json's ``selected``), nothing per losing trial. Releasing every trial's
noisy score and settings would release ``K`` and ``K`` outputs of ``Q``: by the same theorem family that costs
up to ``K`` times one trial (and ``K`` is unbounded), which the search's charge does not cover. So the
per-trial table (:data:`OPERATOR_TABLE`: trial, algorithm, settings, private validation score) and its plot
(``trials.NOT_PUBLIC.png``) are the OPERATOR's view, like the console's trial lines and
``round_log.NOT_PUBLIC``: written on the server next to result.json, marked NOT PUBLIC in their names and
first line / title, never read into result.json or model.pt, rewritten after every trial (progress) and
started afresh by a rerun. They are an explicit opt-in (``operator_view=True``, ``fedkl tune
--operator-view``; default off: a search writes only what may be released, so an output folder shipped whole
leaks nothing), and when on, the console says where they are and that they are not public.

The charge. Before any trial starts (before any query reads a record), every enrolled user (training
and validation) is charged the search's ``(eps, delta)`` as one ``SearchCharge`` (label
``tune-search``) on the real ledger; a search that does not fit every user's remaining budget is
refused then, before any record is read. ``tune_state.json`` names the search's run BEFORE the charge is
made (status ``charging``), so a crash between the charge and any later write cannot cause a second
charge. Rerun on the same ``out`` folder: a search whose charge is made but which did not finish (crash)
is rerun on that charge (found in the ledger by its run; not charged again; nothing of the crashed search
was released, and the rerun's output has the law of one search); a run named but never charged is rerun
as a new search; a finished search, or one whose output files were being written (status ``releasing``,
set before the first file), is refused (a second output would be a second release).

Side channels closed: result.json holds no wall time (it grows with K and the trials' settings); a
validation user's NaN mean loss counts as the worst value ``B`` (a NaN would make the whole sum NaN: an
unbounded change by one user).

Seeded mode (``noise_seed``, tests and reproductions only, like ``fedkl run``): K, the settings draws
and every trial's noise follow the seed; result.json then records the chosen trial's noise seed, so
``fedkl run`` of the chosen settings on the training users reproduces the chosen model bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fedkl.algorithms.registry import BuildContext, algorithm_spec, field_kind
from fedkl.data import FederatedDataset
from fedkl.data.files import SCHEMA_SETTINGS
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, BudgetExceeded, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy.charges import SearchCharge, from_record
from fedkl.privacy.filter import BudgetExhausted
from fedkl.privacy.selection import (
    STOPPING_RULES,
    TRIAL_GRID,
    Stopping,
    schedule_multiplier,
    schedule_rdp,
    search_epsilon,
)
from fedkl.problems import problem_spec
from fedkl.results import write_json
from fedkl.runner import (
    RUN_OBSERVER,
    RunConfig,
    default_delta,
    load_run_dataset,
    problem_dtype,
    quality_metric,
    run_problem,
    train_federation,
)
from fedkl.saved_model import SavedModel, public_settings

DEFAULT_ALGORITHMS = ("noisy-gd",)
# the operator's view (not released; module docstring, "The table"), next to result.json, and its plot (.png)
OPERATOR_TABLE = "trials.NOT_PUBLIC.csv"
SEARCH_LABEL = "tune-search"
STATE_FILE = "tune_state.json"
# the run-level settings a tune passes to every trial (the rest are the trial's drawn hyperparameters)
TRIAL_RUN_SETTINGS = (
    "dataset",
    "problem",
    "model",
    "reg",
    "neighbouring",
    "seed",
    "users",
    "kernels",
    *SCHEMA_SETTINGS,
)


# --- the search space --------------------------------------------------------------------------------
def parse_grid(items: list[str] | dict) -> dict[str, list[str]]:
    """``["lr=0.5,1,2", "clip=0.5,1"]`` -> ``{"lr": ["0.5", "1", "2"], "clip": ["0.5", "1"]}``."""
    if isinstance(items, dict):
        return {k: list(v) if isinstance(v, (list, tuple)) else [v] for k, v in items.items()}
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"--grid takes NAME=V1,V2,...; got {item!r}")
        if key in grid:
            raise ValueError(f"--grid {key} is given twice")
        grid[key.strip()] = [v.strip() for v in values.split(",")]
    return grid


def _typed(field, value):
    if not isinstance(value, str):
        return value
    kind = field_kind(field)
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{field.name} takes true/false, got {value!r}")
        return value.lower() in ("true", "1")
    return kind(value)


DIST_KINDS = ("log", "uniform", "int")


@dataclass(frozen=True)
class Dist:
    """A hyperparameter drawn afresh for every trial: ``log`` (log-uniform on ``[lo, hi]``, ``lo > 0``),
    ``uniform`` (on ``[lo, hi]``) or ``int`` (uniform on the integers ``lo..hi``). Written as a one-value
    grid entry ``NAME=KIND:LO:HI`` (``--grid lr=log:0.1:10``). Its draws use the search's SECRET randomness,
    like the choice of the grid point: the theorem needs i.i.d. trials, and a public (seeded) sequence of
    settings would tell from the released settings which trial won, hence a lower bound on K."""

    kind: str
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise ValueError(f"a distribution is one of {', '.join(DIST_KINDS)}, got {self.kind!r}")
        if not (math.isfinite(self.lo) and math.isfinite(self.hi) and self.lo < self.hi):
            raise ValueError(f"{self}: needs finite lo < hi")
        if self.kind == "log" and not self.lo > 0:
            raise ValueError(f"{self}: a log-uniform range needs lo > 0")
        if self.kind == "int" and (self.lo != int(self.lo) or self.hi != int(self.hi)):
            raise ValueError(f"{self}: an integer range needs integer ends")

    @classmethod
    def parse(cls, text: str) -> "Dist | None":
        """``"log:0.1:10"`` -> Dist; None for a plain value."""
        parts = text.split(":") if isinstance(text, str) else []
        if len(parts) != 3 or parts[0] not in DIST_KINDS:
            return None
        try:
            lo, hi = float(parts[1]), float(parts[2])
        except ValueError:
            raise ValueError(f"{text!r}: a distribution is KIND:LO:HI with numbers LO < HI") from None
        return cls(parts[0], lo, hi)

    def ends(self) -> tuple:
        return (int(self.lo), int(self.hi)) if self.kind == "int" else (self.lo, self.hi)

    def sample(self, uniform: Callable[[], float]):
        u = float(uniform())
        if self.kind == "log":
            return min(self.hi, max(self.lo, math.exp(math.log(self.lo) + u * (math.log(self.hi) - math.log(self.lo)))))
        if self.kind == "uniform":
            return min(self.hi, self.lo + u * (self.hi - self.lo))
        lo, hi = self.ends()
        return lo + min(int(u * (hi - lo + 1)), hi - lo)

    def __str__(self) -> str:
        return f"{self.kind}:{self.lo:g}:{self.hi:g}"


def _concrete(settings: dict) -> list[dict]:
    """The settings with every distribution at its low end, then at its high end (validation, preflight)."""
    if not any(isinstance(v, Dist) for v in settings.values()):
        return [settings]
    return [{k: (v.ends()[i] if isinstance(v, Dist) else v) for k, v in settings.items()} for i in (0, 1)]


def draw_settings(settings: dict, uniform: Callable[[], float]) -> dict:
    """One trial's settings: every distribution drawn (in the point's key order) from ``uniform``."""
    return {k: (v.sample(uniform) if isinstance(v, Dist) else v) for k, v in settings.items()}


def search_space(algorithms: tuple[str, ...] | list[str], grid: dict) -> list[tuple[str, dict]]:
    """Every (algorithm, settings) point: each algorithm times the product of the grid's values of
    ITS hyperparameters (a grid name no listed algorithm has is an error; each point is validated
    by the algorithm's Params now, before any data is read). A one-value entry ``KIND:LO:HI`` is a
    :class:`Dist`, drawn per trial (``int`` for integer hyperparameters, ``log``/``uniform`` for real ones;
    both ends validated)."""
    if not algorithms:
        raise ValueError("the search space needs at least one algorithm")
    grid = parse_grid(grid)
    fields = {name: {f.name: f for f in dataclasses.fields(algorithm_spec(name).params)} for name in algorithms}
    unused = sorted(k for k in grid if not any(k in own for own in fields.values()))
    if unused:
        raise ValueError(f"--grid {unused[0]}: no algorithm of the search ({', '.join(algorithms)}) has it")
    points: list[tuple[str, dict]] = []
    for name in dict.fromkeys(algorithms):
        own = fields[name]
        keys = [k for k in grid if k in own]
        combos: list[dict] = [{}]
        for k in keys:
            values = grid[k]
            dist = Dist.parse(values[0]) if len(values) == 1 else None
            if dist is not None:
                kind = field_kind(own[k])
                if kind not in ((int,) if dist.kind == "int" else (float,)):
                    raise ValueError(
                        f"--grid {k}={dist}: {k} is {kind.__name__}; use int:LO:HI for integers, log/uniform for reals"
                    )
                combos = [{**c, k: dist} for c in combos]
            else:
                combos = [{**c, k: _typed(own[k], v)} for c in combos for v in values]
        for c in combos:
            spec = algorithm_spec(name)
            for concrete in _concrete(c):
                spec.params(**concrete)  # type/range errors now
            points.append((name, c))
    return points


def run_settings_and_grid(settings: dict, algorithms: list[str], grid: list[str] | dict) -> tuple[RunConfig, dict]:
    """Flat ``fedkl tune`` settings -> the base RunConfig (run-level settings, first algorithm) and the
    grid, where a hyperparameter set to a non-default value (``--clip 0.5``) is a one-value grid entry."""
    from fedkl.algorithms.registry import hyperparameter_fields

    hyper = hyperparameter_fields()
    grid = parse_grid(grid)
    run = {k: v for k, v in settings.items() if k not in hyper}
    for key, value in settings.items():
        if key in hyper and key not in grid and value != hyper[key].default:
            grid[key] = [value]
    run["algorithm"] = algorithms[0] if algorithms else run.get("algorithm", "noisy-gd")
    return RunConfig.from_settings(**run), grid


# --- the split -----------------------------------------------------------------------------------------
def split_users(user_ids, seed: int, validation_fraction: float) -> tuple[list[int], list[int]]:
    """Positions of the training and the validation users: a user validates iff the first 8 bytes of
    ``sha256("{seed}:{user id}")`` / 2^64 < ``validation_fraction`` (module docstring). Both parts non-empty."""
    if not 0 < validation_fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1), got {validation_fraction}")
    train, val = [], []
    for i, uid in enumerate(user_ids):
        h = int.from_bytes(hashlib.sha256(f"{seed}:{uid}".encode()).digest()[:8], "big") / 2.0**64
        (val if h < validation_fraction else train).append(i)
    if not train or not val:
        raise ValueError(
            f"the public split of {len(user_ids)} users at validation fraction {validation_fraction:g} left a part empty; "
            "use more users or another fraction"
        )
    return train, val


def _part(dataset: FederatedDataset, users: list[int], tag: str) -> FederatedDataset:
    return dataclasses.replace(
        dataset,
        train=dataset.train.subset(users),
        test=dataset.test.subset(users),
        description=f"{dataset.description} ({tag}: {len(users)} users of the public tuning split)",
    )


# --- the budget ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SearchPlan:
    """The split of one (eps, delta) over a search: ``rho_trial`` per trial (to training and to the
    score, each: they charge disjoint users), the stand-in budget ``eps_trial`` whose zCDP cap is
    exactly ``rho_trial``, and the search's charge."""

    stopping: Stopping
    delta: float
    rho_trial: float
    eps_trial: float
    charge: SearchCharge
    curve: str = "zcdp"

    def lines(self) -> list[str]:
        return [
            f"search: {self.stopping.describe()}; each trial trains on the training users and is scored on the "
            "validation users (disjoint: each part gets the whole per-trial budget)",
            f"budget split: search (eps={self.charge.eps:.4g}, delta={self.delta:.3g}) charged once to every user -> "
            f"per trial rho={self.rho_trial:.5g} zCDP to training and rho={self.rho_trial:.5g} to the score"
            + (
                f" (a dp-accounting schedule: RDP <= rho*l at the {len(TRIAL_GRID)} public orders up to {TRIAL_GRID[-1]:g})"
                if self.curve == "grid"
                else ""
            ),
            f"the chosen model alone (one trial, no search) would have cost eps={self.eps_trial:.4g} at delta={self.delta:.3g}",
        ]


@functools.lru_cache(maxsize=64)  # pure; a search calls it twice, an audit once per world and run
def plan_search(epsilon: float, delta: float, stopping: Stopping, curve: str = "zcdp") -> SearchPlan:
    """The largest per-trial budget whose search is ``(epsilon, delta)``-DP (bisection on the trial's
    stand-in eps; its zCDP cap ``Budget(eps_trial, delta, "cks").rho`` is the trial's rho).
    BudgetExceeded when even a tiny trial does not fit (the stopping rule's own cost, ``ln E[K]/(l-1)``
    and the like, exceeds epsilon). ``curve``: ``"grid"`` for a space holding a dp-accounting schedule
    (:func:`space_curve`; :mod:`fedkl.privacy.selection`)."""

    def rho_of(eps_t: float) -> float:
        return Budget(eps_t, delta, "cks").rho

    lo, hi = min(1e-3, epsilon / 2), epsilon
    if search_epsilon(rho_of(lo), stopping, delta, curve) > epsilon:
        raise BudgetExceeded(
            f"a search with {stopping.describe()} does not fit (eps={epsilon:.4g}, delta={delta:.3g}) even with "
            "trials of almost no budget: raise epsilon, or lower the expected number of trials (nothing was read or charged)"
        )
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if search_epsilon(rho_of(mid), stopping, delta, curve) <= epsilon:
            lo = mid
        else:
            hi = mid
    rho = rho_of(lo)
    charge = SearchCharge(
        eps=epsilon, delta=delta, rho_trial=rho, stopping=stopping.rule, mu=stopping.mu, eta=stopping.eta,
        gamma=stopping.gamma, curve=curve,
    )  # fmt: skip
    return SearchPlan(stopping, delta, rho, lo, charge, curve)


def space_curve(space) -> str:
    """``"grid"`` when some algorithm of the space runs a dp-accounting schedule (its guarantee's charges
    are ``schedule``: an RDP curve, not zCDP), else ``"zcdp"`` (:mod:`fedkl.privacy.selection`)."""
    return "grid" if any(_is_schedule(name) for name, _ in space) else "zcdp"


def _is_schedule(name: str) -> bool:
    return algorithm_spec(name).cls.guarantee.charges == "schedule"


def schedule_budget(plan: SearchPlan, params, neighbouring: str) -> float:
    """The stand-in (eps, delta=plan.delta) budget of a scheduled trial (``params``: its rounds T and
    sampling rate q): the dp-accounting RDP eps of the schedule at the smallest multiplier ``z*`` whose
    curve is at most ``rho_trial g`` on the grid (:func:`fedkl.privacy.selection.schedule_multiplier`).
    The algorithm calibrates (RDP accountant, forced) the smallest ``z`` whose RDP eps is at most that;
    RDP eps strictly decreases in ``z``, so ``z >= z*`` and its curve fits too; :func:`run_trial` re-checks
    the schedule the stand-in ledger recorded."""
    from fedkl.privacy.accounting import GaussianSchedule, schedule_epsilon

    q, steps = float(params.sampling_rate), int(params.rounds)
    z = schedule_multiplier(plan.rho_trial, q, steps)
    relation = "add-remove" if q < 1 else neighbouring
    return schedule_epsilon(GaussianSchedule(z, q, steps, relation), plan.delta, "rdp")


# --- one trial -------------------------------------------------------------------------------------------
def score_values(problem, w: torch.Tensor, data, task: str, bound: float) -> tuple[torch.Tensor, float, bool]:
    """Each user's mean quality over its records, clipped to ``[0, B]``: accuracy for classification
    (``B = 1``), the mean record loss otherwise (``B = bound``; a NaN mean counts as ``B``, the worst). Returns the values,
    ``B`` and whether higher is better. A user without records contributes 0."""
    data = data.to(problem.dtype)
    if task in ("binary", "multiclass"):
        pred = problem.predict(w, data.X).reshape(-1).to(torch.float64)
        per_record = (pred == data.y.reshape(-1).to(torch.float64)).to(torch.float64)
        bound, higher = 1.0, True
    else:
        per_record, higher = problem.record_losses(w, data).to(torch.float64), False
    counts = data.counts().to(torch.float64)
    sums = torch.bincount(data.user_index, weights=per_record, minlength=data.num_users)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    # a NaN mean (one user's records can make its own loss NaN, e.g. 0 * inf) would turn the whole sum NaN:
    # an unbounded change by one user. It counts as the worst value, B: still in [0, B], per user.
    means = torch.where(torch.isnan(means), torch.full_like(means, bound), means)
    return means.clamp(0.0, bound), bound, higher


def _trial_seed(noise_seed: int | None, t: int) -> int | None:
    if noise_seed is None:
        return None
    return int(np.random.SeedSequence([int(noise_seed), int(t)]).generate_state(1)[0])


def run_trial(
    cfg: RunConfig,
    train_ds: FederatedDataset,
    val_data,
    plan: SearchPlan,
    noise: NoiseSource,
    workdir: str,
    tag: str,
    score_bound: float,
):
    """One run of the base mechanism ``Q`` (module docstring): train ``cfg`` on ``train_ds`` sized to
    ``plan.rho_trial`` on a stand-in ledger, check the stand-in ledger, release the private score.
    Returns ``(model or None, noisy score)``."""
    problem, name = run_problem(cfg, train_ds)
    federation = InProcessFederation(problem, train_ds)
    path = os.path.join(workdir, f"{tag}.sqlite")
    token = RUN_OBSERVER.set(None)
    try:
        result, _, _ = train_federation(
            cfg, federation, problem, train_ds, plan.delta, path, tag, noise, lambda _: None, scratch=True
        )
    finally:
        RUN_OBSERVER.reset(token)
    _check_standin(path, plan, cfg.algorithm)
    if result.w is None:
        return None, -math.inf
    w = torch.as_tensor(result.w).to(problem.dtype)
    values, bound, higher = score_values(problem, w, val_data, train_ds.task, score_bound)
    val_ids = list(val_data.user_ids)
    with PrivacyLedger(
        os.path.join(workdir, f"{tag}-score.sqlite"), Budget(plan.eps_trial, plan.delta, "cks"), "score", scratch=True
    ) as ledger:
        noisy = Releaser(ledger, noise).gaussian(
            values.sum().reshape(1), sensitivity=bound, rho=ledger.rho_left(val_ids), user_ids=val_ids,
            label="tune-score",
        )  # fmt: skip
    score = float(noisy[0]) / len(val_ids)
    return result.w, (score if higher else -score)


def _check_standin(path: str, plan: SearchPlan, name: str) -> None:
    """What the trial's stand-in ledger recorded is within the trial's curve: ``rho <= rho_trial`` and no
    (eps, delta) charge (``zcdp`` plans); ``grid`` plans: the zCDP charges plus every recorded schedule's
    dp-accounting RDP curve (re-computed from its multiplier sigma/sensitivity, rate and number of releases)
    at most ``rho_trial g`` on the grid, any other (eps, delta) charge refused. Else RuntimeError: the
    search stops and releases nothing of the trial."""
    with PrivacyLedger(path) as standin:
        spent = standin.max_user_totals()
        rows = standin._db.execute("SELECT charge, details FROM releases").fetchall()
    ok = spent["rho"] <= plan.rho_trial * (1 + 1e-9)
    if plan.curve == "zcdp":
        ok = ok and spent["eps"] == 0 and spent["delta"] == 0
    else:
        schedules = []
        for charge, details in rows:
            rec, det = json.loads(charge or "{}"), json.loads(details or "{}")
            if rec.get("type") in ("GaussianCharge", "ExponentialCharge"):  # zCDP: in spent["rho"]
                continue
            if rec.get("type") != "ApproxDPCharge" or rec.get("mechanism") != "gaussian-schedule":
                ok = False
                continue
            z = float(rec["noise_scale"]) / float(rec["sensitivity"])
            schedules.append((float(det["sampling_rate"]), z, int(det["releases"])))
        g = np.asarray(TRIAL_GRID)
        total = spent["rho"] * g + sum((schedule_rdp(q, z, t) for q, z, t in schedules), np.zeros_like(g))
        ok = ok and bool(np.all(total <= plan.rho_trial * g * (1 + 1e-9)))
    if not ok:
        raise RuntimeError(
            f"{name}: a trial charged more than its rho={plan.rho_trial:.5g} ({plan.curve} curve; {spent}); the "
            "search's charge does not cover it: stopped, nothing of this trial is released"
        )


# --- the search ------------------------------------------------------------------------------------------
def tune(
    cfg: RunConfig,
    algorithms: tuple[str, ...] | list[str] = DEFAULT_ALGORITHMS,
    grid: dict | list[str] | None = None,
    *,
    trials: float = 5.0,
    stopping: str = "tnb",
    eta: float = 0.0,
    validation_fraction: float = 0.3,
    score_bound: float = 1.0,
    log: Callable[[str], None] = print,
    dataset: FederatedDataset | None = None,
    before_trial: Callable[[int], None] | None = None,
    operator_view: bool = False,
) -> dict:
    """Run the private search of ``cfg``'s data, budget (``cfg.epsilon``, ``cfg.delta``) and ledger
    over ``algorithms`` x ``grid`` (module docstring); write ``model.pt`` and ``result.json`` under
    ``cfg.out`` and return the result dict. ``before_trial(t)``: called before trial ``t`` (tests).
    ``operator_view`` (``fedkl tune --operator-view``; default off): also write the operator's NOT PUBLIC table
    and plot of every trial (:data:`OPERATOR_TABLE`), and say so on the console."""
    if cfg.backend != "inprocess" or cfg.secagg:
        raise ValueError("fedkl tune trains its trials in-process (--backend inprocess, no --secagg)")
    if stopping not in STOPPING_RULES:
        raise ValueError(f"--stopping must be one of {', '.join(STOPPING_RULES)}, got {stopping!r}")
    law = Stopping.with_mean(stopping, trials, eta)  # ValueError before any data
    space = search_space(tuple(algorithms), grid or {})
    curve = space_curve(space)
    delta_before = cfg.delta if cfg.delta is not None else _default_delta_before_loading(cfg)
    if delta_before is not None:  # the stopping rule's own cost, refused before the data is even loaded
        plan_search(cfg.epsilon, delta_before, law, curve)
    data = dataset if dataset is not None else load_run_dataset(cfg)  # the enrolment (user ids: public)
    n = data.train.num_users
    delta = cfg.delta if cfg.delta is not None else default_delta(n)
    train_pos, val_pos = split_users(data.train.user_ids, cfg.seed, validation_fraction)
    train_ds, val_ds = _part(data, train_pos, "training"), _part(data, val_pos, "validation")
    users = list(data.train.user_ids)
    out = cfg.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-tune-{cfg.dataset}")
    os.makedirs(out, exist_ok=True)
    ledger_path = cfg.ledger or os.path.join(out, "ledger.sqlite")
    state_path = os.path.join(out, STATE_FILE)
    state = json.load(open(state_path)) if os.path.exists(state_path) else None
    if state is not None and state.get("status") in ("releasing", "finished"):
        raise ValueError(
            f"{out} holds a {'finished' if state['status'] == 'finished' else 'released (its writing cut short)'} "
            f"search ({state['run_id']}): its output may be out; a second search is a second release: use a new --out "
            "(nothing was read or charged)"
        )
    # The state names the run BEFORE its charge is made (status "charging"), so a crash between the charge and
    # the state's update cannot lead to a second charge: the rerun finds the charge in the ledger by its run.
    row = _search_charge_of(ledger_path, state)
    run_id = state["run_id"] if row is not None else time.strftime("%Y%m%d-%H%M%S") + "-tune-" + uuid.uuid4().hex[:6]
    ledger = PrivacyLedger(ledger_path, Budget(cfg.epsilon, delta, cfg.conversion), run_id, {"tune": cfg.settings()})
    charge_id = None
    try:
        log(
            f"fedkl tune {run_id}: {len(space)} settings of {', '.join(dict.fromkeys(algorithms))} on {cfg.dataset} "
            f"({n} users: {len(train_pos)} train, {len(val_pos)} validation by the public split seed={cfg.seed})"
        )
        if row is None:
            ledger.reserve(users)
            eps_left, delta_left = ledger.approx_left(users)
        else:
            ledger.take_over(users)
            stored = from_record(row["charge"])
            eps_left, delta_left = stored.eps, stored.delta
        if eps_left <= 0 or delta_left <= 0:
            raise BudgetExceeded(f"ledger {ledger_path}: these users' budget is spent (nothing was read or charged)")
        plan = plan_search(eps_left, delta_left, law, curve)
        _preflight(cfg, space, train_ds, plan)
        for line in plan.lines():
            log(line)
        state = {"run_id": run_id, "status": "charging", "ledger": os.path.abspath(ledger_path)}
        if row is None:
            write_json(state_path, state)  # before the charge (above)
            charge_id = ledger.charge(users, plan.charge, label=SEARCH_LABEL, details={"space": len(space)})
        else:
            if stored != plan.charge:
                raise ValueError("the rerun's search is not the charged one (different settings?): nothing was charged")
            charge_id = row["id"]
            log(f"rerunning search {run_id} on its charge (release {charge_id}): not charged again")
        state = {**state, "charge_id": charge_id, "status": "charged"}
        write_json(state_path, state)
        view = os.path.join(out, OPERATOR_TABLE) if operator_view else None
        best = _search(cfg, space, law, plan, train_ds, val_ds.train, score_bound, log, before_trial, view)
        ledger.verify()
        payload = _write(cfg, data, train_ds, plan, best, ledger.summary(), run_id, out, ledger_path, log)
        if view is not None:
            log(
                f"operator view (--operator-view): {view} and its .png hold every trial's settings and private score; "
                "NOT PUBLIC (the search's charge covers the selected trial only): keep them on the server"
            )
        ledger.finish_run("finished")
    except BaseException as e:
        ledger.finish_run("refused" if charge_id is None else ledger.end_status(e))
        raise
    finally:
        ledger.close()
    return payload


def _default_delta_before_loading(cfg: RunConfig) -> float | None:
    """The default delta ``1/n^1.1`` (:func:`fedkl.runner.default_delta`) when the configuration alone fixes
    the number of users (a synthetic dataset with ``users``), else None: a file's or a real dataset's user
    count is known only once it is loaded (no cheap count), and the largest default any enrolment could
    have (n = 2) fits every search, so there the check runs after loading, still before any query and any
    charge (pass ``--delta`` to be refused before the data is loaded)."""
    if cfg.users is not None and str(cfg.dataset).startswith("synthetic-"):
        return default_delta(int(cfg.users))
    return None


def _search_charge_of(ledger_path: str, state: dict | None) -> dict | None:
    """The search charge (ledger row) of the run named by ``state``, or None when that run made none (it
    crashed before its charge: rerun as a new search). A state that records a charge the ledger lacks is
    an error (the wrong --ledger?)."""
    if state is None:
        return None
    row = None
    if os.path.exists(ledger_path):
        with PrivacyLedger(ledger_path) as peek:
            row = next((r for r in peek.releases(state["run_id"]) if r["label"] == SEARCH_LABEL), None)
    if row is None and state.get("charge_id") is not None:
        raise ValueError(
            f"{ledger_path} has no search charge {state['charge_id']} of {state['run_id']} (nothing was charged)"
        )
    if row is not None and state.get("charge_id") not in (None, row["id"]):
        raise ValueError(
            f"{ledger_path}: the search charge of {state['run_id']} is {row['id']}, not {state['charge_id']}"
        )
    return row


def _preflight(cfg: RunConfig, space, train_ds: FederatedDataset, plan: SearchPlan) -> None:
    """Build every point of the space on public values (no record read) and refuse, in one line, one
    that is neither zCDP-charged nor a dp-accounting schedule (an RDP curve) under this relation."""
    problem, name = run_problem(cfg, train_ds)
    ctx = BuildContext(
        problem=problem, feature_bound=train_ds.feature_bound, user_ids=tuple(train_ds.train.user_ids),
        delta=plan.delta, rho_left=plan.rho_trial, approx_left=(0.0, 0.0), conversion="cks",
        neighbouring=cfg.neighbouring, seed=cfg.seed,
    )  # fmt: skip
    for name, point in space:
        if _is_schedule(name) and point.get("accountant", "rdp") != "rdp":
            raise ValueError(
                f"{name}: fedkl tune accounts a schedule by its RDP curve and calibrates it with --accountant rdp; "
                "drop --accountant pld (nothing was read or charged)"
            )
        for settings in _concrete(point):
            trial = _trial_config(cfg, name, settings, plan, None)
            schedule = _is_schedule(name) and plan.curve == "grid"
            try:
                alg = algorithm_spec(name).build(
                    trial.params, dataclasses.replace(ctx, approx_left=(trial.epsilon, plan.delta)) if schedule else ctx
                )
            except BudgetExhausted:  # it asked for an (eps, delta) budget, of which a trial offers none
                alg = None
            if alg is None or not (alg.guarantee.zcdp or schedule):
                why = "asks for an (eps, delta) budget" if alg is None else "is not charged in zCDP"
                raise ValueError(
                    f"{name} {why} without an RDP curve; fedkl tune accounts zCDP trials and dp-accounting schedules "
                    "only (nothing was read or charged)"
                )
            alg.guarantee.check_relation(cfg.neighbouring, name)


def _trial_config(cfg: RunConfig, name: str, settings: dict, plan: SearchPlan, noise_seed: int | None) -> RunConfig:
    """One trial's run: a zCDP algorithm on the stand-in budget ``eps_trial`` (zCDP cap ``rho_trial``); a
    scheduled one (``grid`` plans) with ``--accountant rdp`` on the budget :func:`schedule_budget`."""
    base = {k: getattr(cfg, k) for k in TRIAL_RUN_SETTINGS}

    def make(eps: float, extra: dict) -> RunConfig:
        return RunConfig.from_settings(
            **base, algorithm=name, epsilon=eps, delta=plan.delta, conversion="cks", force=True,
            reference=False, noise_seed=noise_seed, **settings, **extra,
        )  # fmt: skip

    if plan.curve != "grid" or not _is_schedule(name):
        return make(plan.eps_trial, {})
    extra = {} if "accountant" in settings else {"accountant": "rdp"}
    params = make(plan.eps_trial, extra).params
    return make(schedule_budget(plan, params, cfg.neighbouring), extra)


def _operator_view(path: str, rows: list[dict]) -> None:
    """The operator's view of the search so far (module docstring, "The table"): one row per finished trial
    (trial, algorithm, settings, private validation score), rewritten after each trial, and its plot; both
    marked NOT PUBLIC in their names and their first line / title."""
    import csv

    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        f.write("# NOT PUBLIC: the operator's view of a fedkl tune search; only the selected trial is released\n")
        w = csv.writer(f)
        w.writerow(["trial", "algorithm", "settings", "private_validation_score"])
        for r in rows:
            w.writerow([r["trial"], r["algorithm"], r["settings"], repr(r["score"])])
    os.replace(tmp, path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(rows) + 2), 3.2))
    finite = [r["score"] if math.isfinite(r["score"]) else 0.0 for r in rows]
    top = max(range(len(rows)), key=lambda i: rows[i]["score"]) if rows else None
    ax.bar(
        [r["trial"] for r in rows], finite,
        color=["tab:orange" if i == top else "tab:blue" for i in range(len(rows))],
    )  # fmt: skip
    ax.set_xlabel("trial (orange: best so far)")
    ax.set_ylabel("private validation score")
    ax.set_title("NOT PUBLIC: operator's view of the search", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=80)
    plt.close(fig)


def _seeded_uniform(noise_seed: int) -> Callable[[], float]:
    """The search's uniforms in seeded mode (K, then each trial's point and drawn settings, in that order)."""
    rng = np.random.default_rng(np.random.SeedSequence([int(noise_seed), 2**32 - 1]))
    return lambda: float(rng.random())


def _draw_point(space, uniform: Callable[[], float]) -> tuple[str, dict]:
    name, point = space[min(int(uniform() * len(space)), len(space) - 1)]
    return name, draw_settings(point, uniform)


def seeded_trials(noise_seed: int, law: Stopping, space) -> list[tuple[str, dict]]:
    """The trials (algorithm, drawn settings; ``K`` = their number) that a SEEDED search (``noise_seed``, tests
    and reproductions only) runs: the same draws as :func:`tune`'s. A study on public data may report them; a
    search without ``noise_seed`` draws them from secret randomness, and they are not released."""
    uniform = _seeded_uniform(noise_seed)
    return [_draw_point(space, uniform) for _ in range(law.sample(uniform))]


def _search(cfg, space, law, plan, train_ds, val_data, score_bound, log, before_trial, view=None) -> dict | None:
    if cfg.noise_seed is None:
        secret = NoiseSource(None)

        def uniform() -> float:
            return float(secret.uniform(1)[0])
    else:
        uniform = _seeded_uniform(cfg.noise_seed)

    k = law.sample(uniform)
    best: dict | None = None
    rows: list[dict] = []
    if view is not None:  # a rerun after a crash starts its own view
        for stale in (view, os.path.splitext(view)[0] + ".png"):
            if os.path.exists(stale):
                os.remove(stale)
    with tempfile.TemporaryDirectory() as workdir:
        for t in range(1, k + 1):
            name, settings = _draw_point(space, uniform)
            log(f"  trial {t}: {name} " + " ".join(f"{a}={v}" for a, v in settings.items()))
            if before_trial is not None:
                before_trial(t)
            seed_t = _trial_seed(cfg.noise_seed, t)
            trial = _trial_config(cfg, name, settings, plan, seed_t)
            noise = NoiseSource(seed_t) if seed_t is not None else secret
            w, score = run_trial(trial, train_ds, val_data, plan, noise, workdir, f"trial-{t}", score_bound)
            if best is None or score > best["score"]:
                best = {"w": w, "score": score, "config": trial}
            if view is not None:
                settings_text = " ".join(f"{a}={v}" for a, v in settings.items())
                rows.append({"trial": t, "algorithm": name, "settings": settings_text, "score": score})
                _operator_view(view, rows)
    return best


def _write(cfg, data, train_ds, plan, best, summary, run_id, out, ledger_path, log) -> dict:
    """The selected model and result.json (no losing trial, no K: module docstring). The state says
    ``releasing`` before the first file is written: a rerun after a crash while writing is refused (part of
    the output may be out; rerunning would release a second search on the same charge)."""
    state_path = os.path.join(out, STATE_FILE)
    write_json(state_path, {**json.load(open(state_path)), "status": "releasing"})
    chosen = None if best is None or best["w"] is None else best["config"]
    problem, problem_name = run_problem(cfg, data)
    spec = problem_spec(problem_name, data, cfg.reg, cfg.model, problem_dtype(cfg, problem_name))
    search = {
        "mechanism": "private selection by random stopping (Papernot & Steinke 2022, fedkl.privacy.selection)",
        "stopping": plan.stopping.describe(),
        "expected_trials": plan.stopping.expected_trials,
        "epsilon": plan.charge.eps,
        "delta": plan.delta,
        "charge": {"type": "SearchCharge", **dataclasses.asdict(plan.charge)},
        "rho_per_trial_training": plan.rho_trial,
        "trial_curve": (
            "rho-zCDP"
            if plan.curve == "zcdp"
            else f"RDP <= rho*g at the public orders g of fedkl.privacy.selection.TRIAL_GRID (up to {TRIAL_GRID[-1]:g})"
        ),
        "rho_per_trial_score": plan.rho_trial,
        "chosen_model_alone_epsilon": plan.eps_trial if chosen is None else chosen.epsilon,
        "split": "validation iff sha256(seed:user_id) < fraction (public)",
    }
    model_path, test, selected = None, {}, None
    if chosen is not None:
        w = torch.as_tensor(best["w"])
        selected = {
            "algorithm": chosen.algorithm,
            "settings": {k: v for k, v in dataclasses.asdict(chosen.params).items()},
            "validation_score": best["score"],
            "validation_score_is_private": True,
        }
        if cfg.noise_seed is not None:
            selected["trial_noise_seed"] = chosen.noise_seed  # seeded mode only (module docstring)
        receipt = {
            "algorithm": chosen.algorithm,
            "run_id": run_id,
            "epsilon": plan.charge.eps,
            "delta": plan.delta,
            "rho": None,
            "budget": {"epsilon": cfg.epsilon, "delta": plan.delta, "conversion": cfg.conversion},
            "neighbouring": cfg.neighbouring,
            "accountant": "private selection (SearchCharge)",
            "ledger": {"path": os.path.abspath(ledger_path), "run_id": run_id},
            "dataset": cfg.dataset,
            "settings": public_settings(chosen.settings()),
            "search": search,
        }
        model_path = os.path.join(out, "model.pt")
        SavedModel(w, spec, receipt).save(model_path)
        test = InProcessFederation(problem, data).evaluate(w, "test")
    payload = {
        "run_id": run_id,
        "command": "tune",
        "dataset": cfg.dataset,
        "users": data.train.num_users,
        "training_users": train_ds.train.num_users,
        "epsilon": plan.charge.eps,
        "delta": plan.delta,
        "neighbouring": cfg.neighbouring,
        "search": search,
        "selected": selected,
        "test_metrics": test,
        "trivial_baseline": problem.trivial_metrics(data.train, data.test),
        "metrics_are_private": False,
        "ledger": summary,
        "config": public_settings(cfg.settings()),
        "model_path": model_path,
        "out_dir": out,
    }  # no wall time: it grows with K and the trials' settings, which are not released (module docstring)
    write_json(os.path.join(out, "result.json"), payload)
    write_json(state_path, {**json.load(open(state_path)), "status": "finished"})
    if selected is None:
        log("selected: no model (no trial released one); the search's charge stands")
    else:
        key = quality_metric(test)
        log(
            f"selected: {selected['algorithm']} "
            + " ".join(f"{k}={v}" for k, v in selected["settings"].items())
            + f"  (private validation score {selected['validation_score']:.4f})"
        )
        log(f"test {key} = {test.get(key, math.nan):.4f} (not private: held-out records of the same users)")
    log(
        f"privacy: user-level ({cfg.neighbouring}) epsilon = {plan.charge.eps:.4f}, delta = {plan.delta:.3g} for the "
        f"whole search (one SearchCharge); wrote {os.path.join(out, 'result.json')} and ledger {ledger_path}"
    )
    return payload


__all__ = [
    "Dist", "SearchPlan", "parse_grid", "plan_search", "run_settings_and_grid", "run_trial", "search_space", "seeded_trials",
    "split_users", "tune",
]  # fmt: skip
