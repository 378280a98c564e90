"""External sweep runners ``paper002-crossover`` (simulations/studies/paper002_crossover_tuning.toml and
paper002_crossover.toml) and ``paper002-delta-selection`` (paper002_delta_selection.toml; at the end).
Paper 002's crossover, measured (issue 13 §4): where does output perturbation beat noisy GD and
DP-FedAvg at EQUAL user-level (epsilon, delta = 1/n^1.1, replace-one) as the records per user m grow?
One point = one training of one algorithm on one (source, m, seed),
or (``phase = "diagnostics"``) the non-private Newton diagnostics of one (source, m, seed).

Point settings: ``fedkl run``'s ``epsilon``, ``seed`` (the noise seed AND the partition / subsample /
split seed), ``reg`` (0.1 for EVERY algorithm) and, for the baselines, ``rounds`` with ``lr`` (noisy-gd)
or ``local_lr`` (dp-fedavg); the runner's own ``source`` (the data, below), ``records`` (m), ``method``
(the fedkl algorithm trained) and ``phase``: ``tune`` (train on a 75/25 validation re-split of the
train records, split seed 1000: the test records are never seen; the "test" metrics are validation
metrics), ``eval`` (train on the train records, metrics on the test records, plus the non-private
diagnostics of the same data) or ``diagnostics``.

Every training goes through the public API only: ``fedkl.train(FederatedDataset, algorithm=method,
epsilon, delta=1/n^1.1, noise_seed=seed, force=True, reg, out=<tmp>, ...)``; the datasets come from
``fedkl.data.load_dataset``.

Data (binary logistic regression, ``||x|| <= 1``; ``source``):

* ``fertility-partition``: AER Fertility dealt at random to n = 1,000 synthetic users of exactly m
  records (the paper's random-permutation model on real records), m in {16, 64, 254} (254 = the
  table's 254,654 rows / n); ``fertility-partition, n=100``: the same at n = 100, m = 2,546 (the
  largest m the table allows).
* ``flights`` (by destination airport, ``departure_delay=True``: without the departure delay the
  task is barely above the majority class) and ``mortgages`` (by birth state): the silos with at least
  1,000 records (``min_records=1000``; flights keeps 58 airports, mortgages 40 states), each capped at
  m records by the loaders' own per-silo subsample (``max_records=m, sample_seed=seed``). So n is fixed
  along the m sweep and every silo holds exactly m records.

Algorithms (``method``): ``noisy-gd`` (clip 1, ``conversion="gaussian"`` so it spends its whole eps) and
``dp-fedavg`` (sampling rate 1, 5 local steps) with the point's rounds / lr / local_lr; paper 002 with no
tuning (the theorem's settings, ``p002_calibration="tight"`` = (4 kappa + 1) Delta and the analytic
Gaussian): ``sc-output-pert`` (Alg 2) with Delta = Delta_uc (Cor 3.7 with its union bound, from public
G = 1, mu = reg, n, m, kappa, beta = 1/(2 n^2 m)); ``phased-sco``, ``sc-phased-sco``, ``sc-phased-erm``,
``phased-erm`` with ``p002_records = m``; ``mean-output-pert`` (Alg 1 on the mean of the local
minimizers) with mean_lam = 1 and the diameter threshold ``mean_rho_fraction = min(0.5, 2/sqrt(m))``, a
public rule fixed before any run, and ``mean_calibration="tight"`` (the committed table's; fedkl's default
became "profile"). Output-perturbation runs are FORCED; the public forecast's
``noise_over_signal`` (result.json's ``algorithm_details.forecast``, or the forecast line of the run log
when the details lack it) is reported next to every result. A configuration the algorithm's public
checks refuse before reading data is an outcome (``status = refused``), not an error.

Metrics (not private, evaluation only): test objective (per-user mean log-loss + reg/2 ||w||^2) and
test accuracy; a ⊥ release has no model: its ``loss_eff`` is the loss of the start point w0 = 0 (log 2).

Non-private diagnostics (numpy Newton solver, not part of any release): the minimizer theta* of the
train objective, its test objective, tr(H_test) and the MEASURED DELETION JUMPS
||theta*(x) - theta*(x_{-u})|| for every user u (one Newton step from theta*: H^{-1} g_u / (n - 1)).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
import time

import numpy as np

import fedkl
from fedkl.algorithms.output_perturbation.exact_output_pert import delta_union_bound
from fedkl.data import load_dataset
from fedkl.experiments import register_runner, runner_result

NAME = "paper002-crossover"
MIN_RECORDS = 1000
SOURCES = {"fertility-partition": 1000, "fertility-partition, n=100": 100, "flights": None, "mortgages": None}
PHASES = ("eval", "tune", "diagnostics")
COLUMNS = (
    "hyper",
    "outcome",
    "loss_eff",
    "test_accuracy",
    "nonprivate_loss",
    "majority_accuracy",
    "bottom",
    "bottom_rate",
    "Delta",
    "deletions",
    "conflict_edges",
    "noise_over_signal",
    "sigma",
    "max_jump",
    "median_jump",
    "trH_test",
    "theta_norm",
    "d",
    "seconds",
    "note",
)


def load(name: str, m: int, seed: int):
    if name.startswith("fertility-partition"):
        n = SOURCES[name]
        return load_dataset("fertility-partition", n_users=n, m=m, partition_seed=seed, split_seed=seed)
    if name == "flights":
        return load_dataset(
            "flights", min_records=MIN_RECORDS, max_records=m, sample_seed=seed, split_seed=seed, departure_delay=True
        )
    if name == "mortgages":
        return load_dataset("mortgages", min_records=MIN_RECORDS, max_records=m, sample_seed=seed, split_seed=seed)
    raise ValueError(f"{NAME}: source must be one of {', '.join(SOURCES)}, got {name!r}")


def hyper_of(s) -> dict:
    """The baselines' tuned settings of a point (what the tables print)."""
    if s.method == "noisy-gd":
        return {"lr": float(s.lr), "rounds": int(s.rounds)}
    if s.method == "dp-fedavg":
        return {"local_lr": float(s.local_lr), "rounds": int(s.rounds)}
    return {}


def validation_split(ds):
    """The train records only, re-split 75/25 within each user: tuning never sees the test records."""
    tr = ds.train
    users = np.array(tr.user_ids)[tr.user_index.numpy()]
    return fedkl.from_arrays(
        tr.X.numpy(),
        tr.y.numpy(),
        users,
        task="binary",
        test_fraction=0.25,
        split_seed=1000,
        name=ds.name + "-validation",
    )


# ----------------------------------------------------------------------------- non-private diagnostics
def _weights(data):
    idx = data.user_index.numpy()
    counts = np.bincount(idx, minlength=data.num_users).astype(float)
    has = counts > 0
    return idx, counts, has


def objective(w, data, reg):
    """fedkl's user-level objective: mean over users (with records) of mean log-loss + reg/2 ||w||^2."""
    X, y = data.X.numpy(), data.y.numpy()
    idx, counts, has = _weights(data)
    per_rec = np.logaddexp(0.0, -y * (X @ w))
    per_user = np.bincount(idx, weights=per_rec, minlength=len(counts))[has] / counts[has]
    return float(per_user.mean() + 0.5 * reg * w @ w)


def newton_diagnostics(ds, reg: float) -> dict:
    """theta* of the train objective, its test objective, tr(H_test), and the deletion jumps."""
    tr = ds.train
    X, y = tr.X.numpy().astype(float), tr.y.numpy().astype(float)
    idx, counts, has = _weights(tr)
    nu = int(has.sum())
    wrec = 1.0 / (nu * counts[idx])
    d = X.shape[1]
    w = np.zeros(d)
    for _ in range(50):
        z = y * (X @ w)
        s = 0.5 * (1 - np.tanh(z / 2))  # sigmoid(-z)
        g = -(wrec * y * s) @ X + reg * w
        H = (X * (wrec * s * (1 - s))[:, None]).T @ X + reg * np.eye(d)
        step = np.linalg.solve(H, g)
        w -= step
        if np.linalg.norm(step) < 1e-12:
            break
    z = y * (X @ w)
    s = 0.5 * (1 - np.tanh(z / 2))
    H = (X * (wrec * s * (1 - s))[:, None]).T @ X + reg * np.eye(d)
    rec_g = -(y * s)[:, None] * X
    gu = np.zeros((len(counts), d))
    np.add.at(gu, idx, rec_g)
    gu = gu[has] / counts[has][:, None] + reg * w
    jumps = np.linalg.norm(np.linalg.solve(H, gu.T).T, axis=1) / (nu - 1)
    te = ds.test
    Xt, yt = te.X.numpy().astype(float), te.y.numpy().astype(float)
    it, ct, ht = _weights(te)
    st = 0.5 * (1 - np.tanh(yt * (Xt @ w) / 2))
    wt = 1.0 / (int(ht.sum()) * ct[it])
    Ht = (Xt * (wt * st * (1 - st))[:, None]).T @ Xt + reg * np.eye(d)
    return {
        "nonprivate_loss": objective(w, te, reg),
        "trH_test": float(np.trace(Ht)),
        "d": d,
        "max_jump": float(jumps.max()),
        "median_jump": float(np.median(jumps)),
        "theta_norm": float(np.linalg.norm(w)),
        "majority_accuracy": float(max((te.y > 0).double().mean(), (te.y < 0).double().mean())),
    }


# ----------------------------------------------------------------------------- one run
def kappa(eps: float, delta: float) -> int:
    eb = eps / 2
    db = delta / (math.exp(eb) + 2)
    return 1 + math.ceil(math.log(1 / db) / eb)


NOISES = ("tight", "today", "today-lam")


def settings_for(
    alg: str, m: int, n: int, eps: float, delta: float, hyper: dict, reg: float, noise: str = "tight"
) -> dict:
    """The fedkl settings of one training. ``noise = "tight"``: the committed table's (paper002_crossover.csv):
    analytic Gaussian at (4 kappa + 1) Delta, Delta fixed (Delta_uc / the phases' rule), equal phase split.
    ``noise = "today"`` (paper002_crossover_today.toml): the whole-release profile calibration, Delta chosen
    privately by the sparse vector (its cost charged inside the same eps), the optimal phase split (phased-erm,
    sc-phased-erm) and the batched Newton local solver (the mean family) with lam = 1 (``mean_lam_rule = "fixed"``);
    ``noise = "today-lam"`` (paper002_mean_fix.toml): "today" with the mean family's ``predicted-error`` lam rule.
    The baselines do not read it."""
    if noise not in NOISES:
        raise ValueError(f"{NAME}: noise must be one of {', '.join(NOISES)}, got {noise!r}")
    today = noise in ("today", "today-lam")
    if alg == "noisy-gd":
        return {"conversion": "gaussian", "clip": 1.0, **hyper}
    if alg == "dp-fedavg":
        return {"sampling_rate": 1.0, "local_steps": 5, **hyper}
    p002 = (
        {"p002_calibration": "profile", "p002_delta_select": "sparse-vector"}
        if today
        else {"p002_calibration": "tight"}
    )
    if alg == "sc-output-pert":
        try:
            Delta = delta_union_bound(1.0, reg, n, m, kappa(eps, delta), 1.0 / (2 * n * n * m))
        except ValueError:  # n < 4 kappa + 2: Delta_uc is undefined and fedkl refuses the run before reading data
            Delta = 1.0
        return {"stability_delta": Delta, **p002}
    if alg in ("mean-output-pert", "phased-mean-output-pert"):
        mean = {"mean_rho_fraction": min(0.5, 2.0 / math.sqrt(m)), "mean_calibration": "tight"}
        rule = "predicted-error" if noise == "today-lam" else "fixed"
        today_mean = {"mean_calibration": "profile", "mean_local_solver": "newton", "mean_lam_rule": rule}
        return {**mean, **today_mean} if today else mean
    split = {"p002_phase_split": "optimal" if today else "equal"} if alg in ("phased-erm", "sc-phased-erm") else {}
    return {"p002_records": m, **p002, **split}


def _walk(obj, key):
    """Every value of ``key`` anywhere in a nested dict/list."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v, key)


def _nums(values):
    out = []
    for v in values:
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            out.append(float(v))
        elif isinstance(v, list):
            out.extend(_nums(v))
    return out


def summarize_details(det: dict, log_lines: list[str]) -> dict:
    det = det or {}
    fc = det.get("forecast")
    if fc is None:
        for line in log_lines:
            if line.startswith("forecast"):
                fc = {k: float(v) for k, v in re.findall(r"(\w+) ([-+0-9.eE]+(?:e[-+]?\d+)?)", line.split(":", 1)[1])}
    bottoms = []
    if "bottom" in det and isinstance(det["bottom"], bool):
        bottoms = [det["bottom"]]
    elif isinstance(det.get("schedule"), list):
        bottoms = [bool(s.get("bottom")) for s in det["schedule"]]
    elif "bottom_rate" in det:
        bottoms = [det["bottom_rate"] > 0]
    Deltas = _nums(_walk(det, "Delta"))
    dels = _nums(_walk(det.get("nonprivate_diagnostics", {}), "deleted_users"))
    dels += _nums(_walk(det.get("phases", []), "deleted_users"))
    edges = _nums(_walk(det, "conflict_edges"))
    sig = det.get("sigma", (fc or {}).get("sigma", (fc or {}).get("sigma_1")))
    return {
        "noise_over_signal": (fc or {}).get("noise_over_signal"),
        "bottom_rate": float(np.mean(bottoms)) if bottoms else 0.0,
        "Delta": Deltas[0] if Deltas else None,
        "deletions": int(max(dels)) if dels else None,
        "conflict_edges": int(max(edges)) if edges else None,
        "sigma": sig,
        "aborted": det.get("aborted"),
    }


def is_refusal(msg: str) -> bool:
    """fedkl's public pre-data refusals (too few users for the deletion depth, Delta_uc undefined, ...)."""
    return bool(re.search(r"nothing was read|refus|needs at least|needs n >=", msg, re.I))


def run_one(data, alg, eps, delta, seed, extra, reg: float) -> dict:
    lines: list[str] = []
    out = tempfile.mkdtemp(prefix="p002x-")
    t0 = time.time()
    try:
        r = fedkl.train(
            data,
            algorithm=alg,
            epsilon=eps,
            delta=delta,
            noise_seed=seed,
            seed=seed,
            log=lines.append,
            force=True,
            reg=reg,
            out=out,
            reference=False,
            **extra,
        )
        det = summarize_details(r.result.get("algorithm_details"), lines)
        bottom = r.model is None
        loss = None if bottom else r.metrics.get("loss")
        row = {
            "status": "bottom" if bottom else "ok",
            "test_loss": loss,
            "loss_eff": math.log(2.0) if bottom else loss,
            "test_accuracy": None if bottom else r.metrics.get("accuracy"),
            "eps_spent": r.epsilon,
            "bottom": int(bottom),
            "note": det.pop("aborted") or "",
        }
        if bottom and not det["bottom_rate"]:
            det["bottom_rate"] = 1.0
        row.update(det)
    except ValueError as e:
        msg = str(e)
        det = summarize_details({}, lines)
        det.pop("aborted")
        row = {"status": "refused" if is_refusal(msg) else "error", "note": msg[:300], **det}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    row["seconds"] = round(time.time() - t0, 2)
    return row


def run(s, log) -> dict:
    if s.phase not in PHASES:
        raise ValueError(f"{NAME}: phase must be one of {', '.join(PHASES)}, got {s.phase!r}")
    m, seed, eps, reg = int(s.records), int(s.seed), float(s.epsilon), float(s.reg)
    if s.source not in SOURCES or s.dataset != s.source.split(",")[0]:
        raise ValueError(f"{NAME}: source {s.source!r} needs dataset = {s.source.split(',')[0]!r} (got {s.dataset!r})")
    ds = load(s.source, m, seed)
    n = ds.train.num_users
    delta = 1.0 / n**1.1
    extra: dict = {"hyper": json.dumps(hyper_of(s), sort_keys=True)}
    if s.phase == "diagnostics":
        dg = newton_diagnostics(ds, reg)
        extra.update({k: dg[k] for k in ("nonprivate_loss", "majority_accuracy", "max_jump", "median_jump")})
        extra.update({"trH_test": dg["trH_test"], "theta_norm": dg["theta_norm"], "d": dg["d"], "outcome": "ok"})
        eps_spent = None
    else:
        data = validation_split(ds) if s.phase == "tune" else ds
        row = run_one(
            data, s.method, eps, delta, seed, settings_for(s.method, m, n, eps, delta, hyper_of(s), reg, s.noise), reg
        )
        if s.phase == "eval":
            dg = newton_diagnostics(ds, reg)
            row.update({k: dg[k] for k in ("nonprivate_loss", "majority_accuracy", "max_jump", "median_jump")})
        row["outcome"] = row.pop("status")
        eps_spent, test_loss = row.pop("eps_spent", None), row.pop("test_loss", None)
        extra.update(row)  # with the training's seconds
    log(f"{NAME} {s.phase} {s.source} m={m} eps={eps:g} seed={seed} {s.method}: {extra}")
    return runner_result(
        NAME,
        s.dataset,
        n,
        eps_spent,
        delta,
        seed,
        None,
        extra,
        test_metrics={} if s.phase == "diagnostics" or test_loss is None else {"loss": test_loss},
    )


DELTA_SELECTION = "paper002-delta-selection"
DELTA_SELECTION_COLUMNS = ("test_accuracy", "Delta", "sigma", "deletions", "scores")


def run_delta_selection(s, log) -> dict:
    """``paper002-delta-selection`` (simulations/studies/paper002_delta_selection.toml): sc-output-pert with
    the crossover's settings (Delta_uc, calibration ``calibration``, forced) and fedkl's
    ``p002_delta_select`` (e.g. "sparse-vector": Delta chosen privately), or dp-fedavg with the point's
    rounds / local_lr; the Delta the release used, its sigma, and the test's deletions and scores."""
    m, seed, eps, reg = int(s.records), int(s.seed), float(s.epsilon), float(s.reg)
    if s.method not in ("sc-output-pert", "dp-fedavg") or s.dataset != s.source.split(",")[0]:
        raise ValueError(f"{DELTA_SELECTION}: method sc-output-pert or dp-fedavg, dataset = the source's loader")
    ds = load(s.source, m, seed)
    n = len(ds.train.user_ids)
    delta = 1.0 / n**1.1
    if s.method == "dp-fedavg":
        settings = {"rounds": int(s.rounds), "local_steps": int(s.local_steps), "local_lr": float(s.local_lr)}
    else:  # the crossover's settings (tight noise), then the point's
        settings = {**settings_for(s.method, m, n, eps, delta, {}, reg), "p002_calibration": s.calibration}
        if s.p002_delta_select != "fixed":
            settings["p002_delta_select"] = s.p002_delta_select
        settings["force"] = True
    out = tempfile.mkdtemp(prefix="p002-dsel-")
    try:
        r = fedkl.train(
            ds, algorithm=s.method, epsilon=eps, delta=delta, noise_seed=seed, seed=seed, log=None, reg=reg, out=out,
            **settings,
        )  # fmt: skip
    finally:
        shutil.rmtree(out, ignore_errors=True)
    d = r.result["algorithm_details"]
    diag = d.get("nonprivate_diagnostics") or {}
    extra = {
        "test_accuracy": None if r.model is None else r.metrics["accuracy"],
        "Delta": d.get("Delta"),
        "sigma": d.get("sigma"),
        "deletions": diag.get("dist"),
        "scores": None if diag.get("nonprivate_scores") is None else str(diag["nonprivate_scores"]),
    }
    log(f"{DELTA_SELECTION} m={m} eps={eps:g} seed={seed} {s.method}: {extra}")
    return runner_result(
        DELTA_SELECTION,
        s.dataset,
        n,
        r.epsilon,
        delta,
        seed,
        None,
        extra,
        test_metrics={} if r.model is None else {"loss": r.metrics["loss"]},
    )


OWN = {"source": "fertility-partition", "records": 64, "method": "noisy-gd"}
register_runner(
    DELTA_SELECTION,
    run_delta_selection,
    columns=DELTA_SELECTION_COLUMNS,
    description=run_delta_selection.__doc__.splitlines()[0],
    settings={**OWN, "calibration": "tight"},
)
register_runner(
    NAME,
    run,
    columns=COLUMNS,
    description=__doc__.splitlines()[0],
    settings={**OWN, "phase": "eval", "noise": "tight"},
)
