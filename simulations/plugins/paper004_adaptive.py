"""External sweep runners for simulations/studies/paper004_repro.toml (paper 004, Zhou et al., DP adaptive
optimizers, Section 6): ``paper004-adaptive`` trains one DP-SGD / DP-RMSProp / DP-Adam run of an MNIST
784-128-128-10 MLP at clip 1, noise multiplier ``sigma``, delta = 1e-5, on MNIST or Fashion-MNIST (in place
of the paper's missing second task), at record level (as the paper) or at user level (fedkl's unit of
privacy), and returns its LEARNING CURVE in its result (``result["curve"]``: one entry per evaluation
point, kept in the table's JSON lines, where the report reads it); ``paper004-kernel-timing`` times one
round's clipped per-user gradient sum with fedkl's stock kernel and with ghost clipping.

Point settings of ``paper004-adaptive``: ``fedkl run``'s ``dataset`` ("mnist" or "fashion-mnist"),
``users`` (none: the level's 60,000 one-image users or 6,000 ten-image users), ``rounds`` (T steps),
``lr`` and ``seed`` (split order, initialisation; with the dataset, level and sigma it fixes the noise
seed, so the three optimizers of a (dataset, level, sigma, seed) share their sampled users and noise);
the runner's own ``level``, ``optimizer``, ``sigma``, ``batch`` (expected batch / cohort: q = batch/n),
``evals`` (evaluation points after step 0), ``train_eval`` (training records of the train metrics),
``test_eval`` (test records; 0 = all 10,000), ``features`` and ``kernel``.

What runs (fedkl's code path)
-----------------------------
Every run is fedkl's ``dp-<optimizer>`` class (:mod:`fedkl.algorithms.gradient.dp_adaptive`: Poisson user
sampling at rate q with secure-or-seeded randomness, clipped per-user gradient sum, Gaussian noise of
multiplier z on the sum, fixed denominator q n, then the SGD/RMSProp/Adam step), charged up front to a
real :class:`~fedkl.privacy.PrivacyLedger` through a :class:`~fedkl.privacy.Releaser`: the epsilon
reported for a run is the ledger's ``max_user_epsilon``, i.e. dp-accounting's PLD epsilon of the schedule
(z, q, T) actually run. The optimizer calibrates z from the ledger's budget; the budget is set to the PLD
epsilon of sigma for this (q, T), so z = sigma (to 1e-6).

* record level (the paper): fedkl's IID partition with ``n_users=60000, per_user=1`` -- every training
  image is its own user, so user-level DP with one record per user IS record-level DP, q = 128/60000;
* user level: 6,000 users x 10 images (IID, fedkl's default partition), q = 128/6000 (expected cohort
  of 128 users = 1,280 images), the same sigma; the user's gradient is the mean over its 10 images,
  clipped to 1 as a whole.

Features (``features``): ``zscore`` (default) is the paper's preprocessing -- pixels/255 z-scored by one
public scalar (MNIST 0.1307/0.3081, Fashion 0.2860/0.3530) -- on exactly the rows and users of fedkl's
loaders (:func:`fedkl.data.images.load_zscored`; tests/test_paper004_repro.py checks the partition is
identical); ``fedkl`` uses ``load_mnist``/``load_fashion_mnist`` as they are (pixels/255, every row scaled
to unit norm: inputs ~30x smaller than z-scored ones, which slows the first layer of plain SGD in
particular). Both are per-record maps with public constants: no privacy cost.

Optimizers as pyvacy + torch.optim ran them (docs/derivations/paper-004.md §2): DP-SGD (plain), DP-RMSProp = torch
RMSprop (beta2 = 0.99, nu = 1e-8, no bias correction, no cap), DP-Adam = torch Adam (0.9, 0.999,
nu = 1e-8, bias-corrected, no cap).

Calibration: fedkl's schedule calibration is memoised per (eps, delta, q, T) (a pure function:
:func:`fedkl.algorithms.gradient.poisson_schedule.calibrate`), since runs share schedules.

Gradient kernel (``kernel``): ``ghost`` (default) computes the clipped per-user gradient sum with
:func:`fedkl.federation.ghost_clipping.ghost_clipped_sum` (fedkl's InProcessFederation default, what
``fedkl run`` does; same mathematics, ~1e-7 relative float32 difference, about 50x faster here);
``stock`` uses ``InProcessFederation(..., ghost=False)``: per-record gradients (MLP.per_user_gradients).

Evaluation: the iterate after every T/evals steps (and the last one) on a fixed subsample of
``train_eval`` training records and on the test set; post-processing of released noisy sums, but the
evaluation itself is NOT private, as in the paper.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time

import numpy as np
import torch

from fedkl.algorithms.catalog import REGISTRY
from fedkl.algorithms.contract import BuildContext
from fedkl.data.base import UserData
from fedkl.data.images import load_fashion_mnist, load_mnist, load_zscored
from fedkl.experiments import register_runner, runner_result
from fedkl.federation.base import ClippedGradient, Federation
from fedkl.federation.ghost_clipping import record_metrics
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy.accounting import GaussianSchedule, schedule_epsilon
from fedkl.problems.mlp import MLP

NAME = "paper004-adaptive"
TIMING = "paper004-kernel-timing"
DELTA = 1e-5
CLIP = 1.0
HIDDEN = (128, 128)
OPT_KW = {
    "sgd": {},
    "rmsprop": {"beta2": 0.99, "nu": 1e-8, "bias_correction": False},
    "adam": {"beta1": 0.9, "beta2": 0.999, "nu": 1e-8, "bias_correction": True},
}
LOADERS = {"mnist": load_mnist, "fashion-mnist": load_fashion_mnist}
LEVELS = {"record": (60_000, 1), "user": (6_000, 10)}
FEATURES = ("zscore", "fedkl")
KERNELS = ("ghost", "stock")
COLUMNS = (
    "level",
    "per_user",
    "optimizer",
    "sigma",
    "lr",
    "sampling_rate",
    "steps",
    "evals",
    "train_eval",
    "test_eval",
    "features",
    "kernel",
    "noise_seed",
    "noise_multiplier",
    "test_accuracy",
    "train_loss",
)
TIMING_COLUMNS = ("records", "stock_s", "ghost_s", "rel_diff")


class EvalHook(Federation):
    """Delegates to ``inner``; before answering the first ClippedGradient sum of a round whose number of
    completed rounds is an evaluation point, evaluates that iterate (post-processing: the iterate is a
    function of released noisy sums; the evaluation itself is NOT private, as in the paper)."""

    def __init__(self, inner: Federation, points: set[int], evaluate) -> None:
        self.inner = inner
        self.points = points
        self.evaluate = evaluate
        self.rounds_done = 0
        self.seen: set[int] = set()

    @property
    def user_ids(self):
        return self.inner.user_ids

    @property
    def num_params(self):
        return self.inner.num_params

    def compute(self, query, users=None):
        return self.inner.compute(query, users)

    def sum(self, query, users=None):
        if isinstance(query, ClippedGradient) and self.rounds_done in self.points and self.rounds_done not in self.seen:
            self.seen.add(self.rounds_done)
            self.evaluate(self.rounds_done, query.w)
        return self.inner.sum(query, users)

    def progress(self, rec: dict) -> None:
        self.rounds_done = int(rec["round"])


def eval_points(steps: int, evals: int) -> list[int]:
    return sorted({int(round(steps * k / evals)) for k in range(evals + 1)})


@functools.lru_cache(maxsize=4)
def load(dataset: str, n_units: int, per_user: int, seed: int, features: str):
    """The dataset (cached: the runs of a sweep share it) and the MLP."""
    if features == "zscore":
        ds = load_zscored(dataset, n_units, per_user, seed)
    else:
        ds = LOADERS[dataset]("iid", n_units, per_user, split_seed=seed)
    return ds, MLP(784, HIDDEN, 10, seed=seed)


def eval_sets(ds, seed: int, train_eval: int, test_eval: int) -> tuple[UserData, UserData]:
    """Fixed evaluation subsets (records, not users): ``train_eval`` training records, ``test_eval`` test
    records (0: the whole 10,000-image test set)."""
    g = torch.Generator().manual_seed(1234 + seed)
    tr = ds.train
    k = min(train_eval, tr.num_records)
    rows = torch.randperm(tr.num_records, generator=g)[:k]
    train = UserData(tr.X[rows], tr.y[rows], torch.zeros(k, dtype=torch.int64), ("eval",))
    te = ds.test
    if test_eval and test_eval < te.num_records:
        rows = torch.randperm(te.num_records, generator=g)[:test_eval]
        te = UserData(te.X[rows], te.y[rows], torch.zeros(len(rows), dtype=torch.int64), ("eval",))
    test = UserData(te.X, te.y, torch.zeros(te.num_records, dtype=torch.int64), ("eval",))
    return train, test


def noise_seed_for(dataset: str, level: str, sigma: float, seed: int) -> int:
    """One noise seed per (dataset, level, sigma, seed), shared by the three optimizers."""
    return 1000 * seed + 100 * list(LOADERS).index(dataset) + 10 * list(LEVELS).index(level) + int(round(sigma))


def step_size(s) -> float:
    """The point's ``lr``, or (none given) fedkl's default step size of dp-<optimizer>."""
    return float(s.lr) if s.lr is not None else float(REGISTRY[f"dp-{s.optimizer}"].step_size)


def run_one(s, n: int, per_user: int, noise_seed: int, ledger_dir: str) -> tuple[list[dict], dict]:
    """One run: its curve (one entry per evaluation point) and its summary."""
    sigma, T, q = float(s.sigma), int(s.rounds), s.batch / n
    lr = step_size(s)
    ds, problem = load(s.dataset, n, per_user, int(s.seed), s.features)
    eval_train, eval_test = eval_sets(ds, int(s.seed), int(s.train_eval), int(s.test_eval))
    fed = InProcessFederation(problem, ds, ghost=s.kernel != "stock")
    # the budget that makes fedkl's calibration return z = sigma for this schedule (dp-accounting PLD)
    eps_budget = schedule_epsilon(GaussianSchedule(sigma, q, T), DELTA, "pld")
    ledger_path = os.path.join(ledger_dir, "ledger.sqlite")
    ledger = PrivacyLedger(
        ledger_path,
        Budget(eps_budget, DELTA),
        run_id=f"{s.dataset}-{s.level}-{s.optimizer}-{sigma:g}-{lr:g}",
        run_config={"optimizer": s.optimizer, "sigma": sigma, "lr": lr, "steps": T, "q": q},
    )
    eps_left, delta_left = ledger.approx_left(fed.user_ids)
    cls = REGISTRY[f"dp-{s.optimizer}"].cls
    params = cls.Params(rounds=T, lr=lr, clip=CLIP, sampling_rate=q, accountant="pld", **OPT_KW[s.optimizer])
    alg = cls(params, BuildContext.fresh(eps=eps_left, delta=delta_left, neighbouring="add-remove"))
    evals: dict[int, dict] = {}
    t0 = time.perf_counter()

    def evaluate(step: int, w: torch.Tensor) -> None:
        evals[step] = {
            "test": record_metrics(problem, w, eval_test),
            "train": record_metrics(problem, w, eval_train),
            "seconds": time.perf_counter() - t0,
        }

    hook = EvalHook(fed, set(eval_points(T, int(s.evals))), evaluate)
    res = alg.run(hook, Releaser(ledger, NoiseSource(noise_seed)), problem.init_params(), hook.progress)
    evaluate(T, res.w)
    ledger.finish_run("finished")
    ledger.verify()
    summary = ledger.summary()
    ledger.close()
    curve = [
        {
            "step": step,
            "epoch": step * q,
            "test_accuracy": e["test"]["accuracy"],
            "test_loss": e["test"]["loss"],
            "train_accuracy": e["train"]["accuracy"],
            "train_loss": e["train"]["loss"],
            "seconds": e["seconds"],
        }
        for step, e in sorted(evals.items())
    ]
    return curve, {
        "epsilon": summary["max_user_epsilon"],
        "noise_multiplier": res.noise_multiplier,
        "sampled_users_mean": float(np.mean([h["sampled"] for h in res.history])),
        "failed_users": int(sum(h["failed_users"] for h in res.history)),
    }


def run(settings, log) -> dict:
    s = settings
    if s.dataset not in LOADERS or s.level not in LEVELS or s.optimizer not in OPT_KW:
        raise ValueError(
            f"{NAME}: dataset in {list(LOADERS)}, level in {list(LEVELS)}, optimizer in {list(OPT_KW)} "
            f"(got {s.dataset!r}, {s.level!r}, {s.optimizer!r})"
        )
    if s.neighbouring != "add-remove":
        raise ValueError(f"{NAME} accounts add/remove neighbours (neighbouring = 'add-remove')")
    if s.features not in FEATURES or s.kernel not in KERNELS:
        raise ValueError(f"{NAME}: features in {FEATURES}, kernel in {KERNELS}")
    n_default, per_user = LEVELS[s.level]
    n = int(s.users) if s.users else n_default
    noise_seed = noise_seed_for(s.dataset, s.level, float(s.sigma), int(s.seed))
    with tempfile.TemporaryDirectory(prefix="paper004-ledger-") as ledger_dir:
        curve, summary = run_one(s, n, per_user, noise_seed, ledger_dir)
    last = curve[-1]
    log(
        f"{s.dataset} {s.level} sigma={s.sigma:g} (z={summary['noise_multiplier']:.6f}) {s.optimizer} lr={step_size(s):g}: "
        f"T={s.rounds} eps={summary['epsilon']:.4f} test acc {last['test_accuracy']:.4f} "
        f"train loss {last['train_loss']:.4f}"
    )
    extra = {
        "per_user": per_user,
        "sampling_rate": s.batch / n,
        "steps": int(s.rounds),
        "noise_seed": noise_seed,
        "noise_multiplier": summary["noise_multiplier"],
        "test_accuracy": last["test_accuracy"],
        "train_loss": last["train_loss"],
    }
    return runner_result(
        NAME,
        s.dataset,
        n,
        summary["epsilon"],
        DELTA,
        s.seed,
        int(s.rounds),
        extra,
        test_metric={"name": "accuracy", "value": last["test_accuracy"]},
        test_metrics={"accuracy": last["test_accuracy"], "loss": last["test_loss"]},
        algorithm_details={"noise_multiplier": summary["noise_multiplier"]},
        curve=curve,
        sampled_users_mean=summary["sampled_users_mean"],
        failed_users=summary["failed_users"],
    )


def time_kernel(settings, log) -> dict:
    """Median time of one round's clipped sum (128 users, seeded sample), fedkl's stock path vs ghost
    clipping, at ``level`` on MNIST; and the largest relative difference of the two sums."""
    n, per = LEVELS[settings.level]
    ds = load_mnist("iid", n, per, split_seed=0)
    problem = MLP(784, HIDDEN, 10, seed=0)
    stock, ghost = InProcessFederation(problem, ds, ghost=False), InProcessFederation(problem, ds)
    w = problem.init_params()
    rng = np.random.default_rng(0)
    ts, tg, diff = [], [], 0.0
    for _ in range(3):
        users = sorted(rng.choice(n, 128, replace=False).tolist())
        t = time.perf_counter()
        a = stock.sum(ClippedGradient(w, CLIP), users).total()
        ts.append(time.perf_counter() - t)
        t = time.perf_counter()
        b = ghost.sum(ClippedGradient(w, CLIP), users).total()
        tg.append(time.perf_counter() - t)
        diff = max(diff, float((a - b).norm() / a.norm()))
    row = {"records": 128 * per, "stock_s": float(np.median(ts)), "ghost_s": float(np.median(tg)), "rel_diff": diff}
    log(f"{TIMING} {settings.level}: {row}")
    return runner_result(TIMING, "mnist", n, None, None, 0, 1, row)


SETTINGS = {
    "level": "record",
    "optimizer": "sgd",
    "sigma": 2.0,
    "batch": 128,
    "evals": 10,
    "train_eval": 10_000,
    "test_eval": 0,
    "features": "zscore",
    "kernel": "ghost",
}
register_runner(NAME, run, columns=COLUMNS, description=__doc__.splitlines()[0], settings=SETTINGS)
register_runner(
    TIMING,
    time_kernel,
    columns=TIMING_COLUMNS,
    description=time_kernel.__doc__.splitlines()[0],
    settings={"level": "record"},
)
