"""The many-run audit of ``fedkl tune`` (issue 32): an empirical lower bound on the whole search's
user-level epsilon, against the search's claim, with a negative control that leaks the losing trials.

What is audited: :func:`fedkl.tuning.tune` itself, run end to end (its ledger, its plan, its random
stopping, every trial's real training and private score, its result.json), ``runs`` times on each of
two neighbouring worlds. The worlds (:func:`tune_worlds`) put the audit's signal on the part of the
search that ``fedkl run``'s audits do not cover, the private score and the selection:

* training users: ordinary users (:func:`fedkl.audit.worlds._base_users`);
* validation users (ids chosen so that the public split puts them there): ``blank`` users whose records
  are ``x = 0`` (every model predicts +1 on them, label +1: each one's validation value is exactly 1),
  and ONE outlier user, also ``x = 0``: labels +1 in W1 (value 1), -1 in W0 (value 0).

W0 and W1 differ in the outlier's labels only: replace-one neighbours. Its W0 value 0 is also what the
outlier contributes when absent (zero-out against the public enrolment), so the same pair is the
add-remove pair of the score. Every trial's exact score is then a constant of the world
(``(blank + 1) / n_val`` vs ``blank / n_val``) whatever the trained model: the whole privacy of the
outlier rests on the search's noisy score and its selection.

Statistic: the released ``validation_score`` of result.json (⊥, no model: NaN). ``target="model"`` audits
the other path: the outlier is a training user on its own coordinate and the statistic is the released
model's coordinate on it (:func:`tune_worlds`). Negative control
(``leak=True``): the same search where every trial also hands out its EXACT validation score, e.g. a
progress line ``trial t: accuracy 0.8333``; the statistic is then the largest leaked score. A correct
search is flagged with probability at most ``1 - confidence``; the control is flagged whenever the runs
suffice (its statistic separates the worlds exactly: the bound reaches ``largest_attainable_bound``).

White-box (:func:`score_whitebox`): the score release's REALISED sensitivity (the exact sum's move over
adversarial neighbours of a validation user: labels flipped, features blown up, records repeated, the user
absent) against the sensitivity and rho its charge states, as :mod:`fedkl.audit.whitebox` does for the
algorithms' releases; its negative controls (tests/test_tune_seams.py) are scorers without the per-user mean
or without the clip.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from typing import Callable

import numpy as np

from fedkl.audit.bounds import clopper_pearson_upper, epsilon_from_rates, two_sample_bound
from fedkl.audit.report import noise_seed, verdict
from fedkl.audit.worlds import _base_users
from fedkl.data.base import FederatedDataset
from fedkl.data.custom import from_arrays

OUTLIER_PREFIX = "tune-outlier"
TRIAL_SETTINGS = {"rounds": ["1", "2"]}  # the tiny search space: 2 settings of noisy-gd


def _ids_in_part(prefix: str, count: int, seed: int, fraction: float, validation: bool) -> list[str]:
    """``count`` user ids ``prefix-i`` that the public split (:func:`fedkl.tuning.split_users`) puts in
    the validation part (``validation``) or the training part."""
    from fedkl.tuning import split_users

    candidates = [f"{prefix}-{j}" for j in range(64 * count)]
    train, val = split_users(candidates, seed, fraction)
    return [candidates[i] for i in (val if validation else train)][:count]


def tune_worlds(
    base: int = 12,
    blank: int = 3,
    records: int = 4,
    dim: int = 3,
    seed: int = 0,
    fraction: float = 0.3,
    target: str = "score",
) -> tuple[FederatedDataset, FederatedDataset]:
    """``(W0, W1)`` (module docstring). ``target="model"``: the outlier is a TRAINING user instead, all of
    whose records are ``x = e_0`` (labels -1 / +1), the other training users having 0 in coordinate 0, so
    the released model's coordinate 0 carries all of its influence (as :func:`fedkl.audit.worlds.neighbour_pair`)."""
    if target not in ("score", "model"):
        raise ValueError(f"target must be 'score' or 'model', got {target!r}")
    first = 1 if target == "model" else 0
    X, y, owners = _base_users(np.random.default_rng(seed), base, records, dim, first)
    train_ids = _ids_in_part("t", base + 1, seed, fraction, validation=False)
    rename = {f"b{u:05d}": train_ids[u] for u in range(base)}
    owners = [rename[o] for o in owners]
    val_ids = _ids_in_part(OUTLIER_PREFIX, blank + (target == "score"), seed, fraction, validation=True)
    Xv = np.zeros((len(val_ids) * records, dim))
    owners_v = [u for u in val_ids for _ in range(records)]
    worlds = []
    for outlier_label in (-1, 1):
        yv = np.ones(len(val_ids) * records)
        Xt, yt, ot = X, y, owners
        if target == "score":
            yv[blank * records :] = outlier_label
        else:
            x_out = np.zeros((records, dim))
            x_out[:, 0] = 1.0
            Xt, yt = np.vstack([X, x_out]), np.concatenate([y, np.full(records, outlier_label)])
            ot = owners + [train_ids[base]] * records
        worlds.append(
            from_arrays(
                np.vstack([Xt, Xv]), np.concatenate([yt, yv]), ot + owners_v, task="binary",
                test_fraction=0.25, split_seed=seed, name=f"tune-audit-{target}-w{int(outlier_label > 0)}",
            )
        )  # fmt: skip
    return worlds[0], worlds[1]


@contextlib.contextmanager
def _leaking(leaked: list[float]):
    """The negative control: every trial also hands out its exact (noise-free) validation score."""
    import torch

    import fedkl.tuning as tuning

    original = tuning.run_trial

    def leaky(cfg, train_ds, val_data, plan, noise, workdir, tag, score_bound):
        w, score = original(cfg, train_ds, val_data, plan, noise, workdir, tag, score_bound)
        if w is not None:
            problem = tuning.run_problem(cfg, train_ds)[0]
            w_t = torch.as_tensor(w).to(problem.dtype)
            values, _, _ = tuning.score_values(problem, w_t, val_data, train_ds.task, score_bound)
            leaked.append(float(values.sum()) / len(val_data.user_ids))
        return w, score

    tuning.run_trial = leaky
    try:
        yield
    finally:
        tuning.run_trial = original


def tune_audit(
    epsilon: float,
    *,
    runs: int = 30,
    leak: bool = False,
    target: str = "score",
    trials: float = 2.0,
    confidence: float = 0.95,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict:
    """``runs`` searches per world (module docstring); returns the report (claim, bound, verdict)."""
    from fedkl.runner import RunConfig, default_delta
    from fedkl.saved_model import load_model
    from fedkl.tuning import tune

    if leak and target != "score":
        raise ValueError("the leaky control leaks validation scores: target='score'")
    worlds = tune_worlds(seed=seed, target=target)
    delta = default_delta(worlds[0].train.num_users)
    stats: list[list[float]] = [[], []]
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            for world in (0, 1):
                cfg = RunConfig.from_settings(
                    dataset="custom", problem="logistic", epsilon=epsilon, delta=delta, seed=seed, reference=False,
                    noise_seed=noise_seed(seed, world, run), out=os.path.join(tmp, f"w{world}-r{run}"),
                )  # fmt: skip
                leaked: list[float] = []
                with _leaking(leaked) if leak else contextlib.nullcontext():
                    result = tune(cfg, ["noisy-gd"], TRIAL_SETTINGS, trials=trials, log=lambda _: None,
                                  dataset=worlds[world])  # fmt: skip
                if leak:
                    stats[world].append(max(leaked) if leaked else math.nan)
                elif result["selected"] is None:
                    stats[world].append(math.nan)
                elif target == "score":
                    stats[world].append(float(result["selected"]["validation_score"]))
                else:
                    stats[world].append(float(load_model(result["model_path"]).params[0]))
            if log is not None and (run + 1) % max(1, runs // 5) == 0:
                log(f"  tune audit{' (leaky control)' if leak else ''}: {run + 1}/{runs} runs per world")
    s0, s1 = np.array(stats[0]), np.array(stats[1])
    bound = two_sample_bound(s0, s1, delta, confidence, seed=seed)
    ev = bound["evaluation"]
    return {
        "method": "many-run",
        "mechanism": "fedkl tune" + (" with the losing trials' exact scores leaked (negative control)" if leak else ""),
        "claimed": {
            "epsilon": epsilon,
            "delta": delta,
            "neighbouring": "replace-one (also add-remove: module docstring)",
        },
        "runs_per_world": runs,
        "statistic": "largest leaked exact score"
        if leak
        else ("released validation_score" if target == "score" else "released model's coordinate 0") + " (⊥: NaN)",
        **bound,
        "largest_attainable_bound": epsilon_from_rates(
            clopper_pearson_upper(0, ev["runs_d0"], (1 - confidence) / 2),
            clopper_pearson_upper(0, ev["runs_d1"], (1 - confidence) / 2),
            delta,
        ),
        "verdict": verdict(bound["epsilon_lower_bound"], epsilon),
    }


# --- the white-box check of the score release ----------------------------------------------------------------
SCORE_NEIGHBOURS = {
    "replace-one": ("flipped", "huge", "many"),
    "add-remove": ("absent", "absent-many", "absent-huge"),
}


def _neighbour(data, user: int, kind: str):
    """``(D, D')`` of the validation part ``data`` (a UserData) differing in ``user`` only: ``flipped``
    (its labels negated), ``huge`` (its features times 1e150: logits overflow), ``many`` (its records
    repeated 20 times, labels negated); ``absent`` (D' without its records: zero-out against the public
    enrolment), ``absent-many`` (D with its records repeated 20 times, D' without them) and ``absent-huge``
    (D with its features times 1e150, D' without its records)."""
    import torch

    from fedkl.data.base import UserData

    mine = data.user_index == user
    X, y, idx = data.X, data.y, data.user_index

    def world(X2, y2, idx2):
        return UserData(X2, y2, idx2, data.user_ids)

    def repeated(flip: bool):
        Xm, ym = X[mine].repeat(20, 1), y[mine].repeat(20)
        ym = -ym if flip else ym
        return (
            torch.cat([X[~mine], Xm]), torch.cat([y[~mine], ym]),
            torch.cat([idx[~mine], torch.full((len(ym),), user, dtype=idx.dtype)]),
        )  # fmt: skip

    without = world(X[~mine], y[~mine], idx[~mine])
    if kind == "flipped":
        return data, world(X, torch.where(mine, -y, y), idx)
    if kind == "huge":
        return data, world(torch.where(mine[:, None], X * 1e150, X), y, idx)
    if kind == "many":
        return data, world(*repeated(True))
    if kind == "absent":
        return data, without
    if kind == "absent-many":
        return world(*repeated(False)), without
    if kind == "absent-huge":
        return world(torch.where(mine[:, None], X * 1e150, X), y, idx), without
    raise ValueError(f"unknown neighbour {kind!r}")


def score_whitebox(
    cfg,
    train_ds,
    val_data,
    plan,
    *,
    values: Callable | None = None,
    score_bound: float = 1.0,
    users: int = 3,
) -> dict:
    """Realised sensitivity of the search's score release against its charge (issue 32 §3), white-box.

    One trial (:func:`fedkl.tuning.run_trial`) runs with a recording Releaser: its ``tune-score`` release's
    charged L2 sensitivity and rho. Then, for the trained model and each of the first ``users`` validation
    users and each neighbour of :data:`SCORE_NEIGHBOURS` under ``cfg.neighbouring``, the exact (noise-free)
    released sum is computed on both worlds by the very scorer the trial used (``values``: default
    :func:`fedkl.tuning.score_values`; a test passes a leaky one, the negative control). A move above the
    charged sensitivity (plus float tolerance), or a rho above ``plan.rho_trial``, is a VIOLATION."""
    import torch

    import fedkl.tuning as tuning

    scorer = values or tuning.score_values
    recorded: list[dict] = []

    class Recording(tuning.Releaser):
        def gaussian(self, value, *, sensitivity, rho, user_ids, label, details=None):
            recorded.append({"label": label, "sensitivity": float(sensitivity), "rho": float(rho)})
            return super().gaussian(value, sensitivity=sensitivity, rho=rho, user_ids=user_ids, label=label,
                                    details=details)  # fmt: skip

    originals = (tuning.Releaser, tuning.score_values)
    tuning.Releaser, tuning.score_values = Recording, scorer
    try:
        with tempfile.TemporaryDirectory() as tmp:
            w, _ = tuning.run_trial(cfg, train_ds, val_data, plan, tuning.NoiseSource(0), tmp, "wb", score_bound)
    finally:
        tuning.Releaser, tuning.score_values = originals
    score = [r for r in recorded if r["label"] == "tune-score"]
    if w is None or len(score) != 1:
        raise RuntimeError(f"the trial made {len(score)} score releases (model: {w is not None}); expected one")
    charged = score[0]
    problem = tuning.run_problem(cfg, train_ds)[0]
    w = torch.as_tensor(w).to(problem.dtype)
    findings, realised = [], 0.0
    for user in range(min(users, val_data.num_users)):
        for kind in SCORE_NEIGHBOURS[cfg.neighbouring]:
            d, e = _neighbour(val_data, user, kind)
            a = float(scorer(problem, w, d, train_ds.task, score_bound)[0].sum())
            b = float(scorer(problem, w, e, train_ds.task, score_bound)[0].sum())
            move = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
            realised = max(realised, move)
            tol = 64 * np.finfo(float).eps * (abs(a) + abs(b) + charged["sensitivity"]) * math.sqrt(val_data.num_users)
            if not move <= charged["sensitivity"] + tol:
                findings.append(
                    f"user {user}, {kind}: the score's sum moved {move:.6g} > sensitivity {charged['sensitivity']:g}"
                )
    if charged["rho"] > plan.rho_trial * (1 + 1e-9):
        findings.append(f"the score was charged rho={charged['rho']:g} > rho_trial={plan.rho_trial:g}")
    return {
        "method": "white-box",
        "release": "tune-score",
        "neighbouring": cfg.neighbouring,
        "charged_sensitivity": charged["sensitivity"],
        "charged_rho": charged["rho"],
        "realised_sensitivity": realised,
        "findings": findings,
        "verdict": "VIOLATION" if findings else "consistent with claim",
    }


__all__ = ["SCORE_NEIGHBOURS", "score_whitebox", "tune_audit", "tune_worlds"]
