"""External sweep runner ``conc-gd-synthetic`` for simulations/studies/concentrated_gd.toml: one fedkl
algorithm (``method``: ``noisy-gd`` or ``noisy-gd-conc``) trained through ``fedkl.train`` (its own ledger
in a temporary folder, replace-one, the point's eps, delta = 1/n^1.1) on one draw of the IID
synthetic logistic family (fedkl.data.synthetic, heterogeneity 0) with ``user_records`` = m records per user,
20% held out, d = 10.

Its own settings: ``method``, ``user_records`` (m) and ``conc_k`` (noisy-gd-conc's ``--conc-scale``; 0: the
theorem's default); noisy-gd-conc also takes the point's ``conc_centre``. noisy-gd-conc declares ``--conc-records`` = the per-user train count, 0.8 m: a
public design fact of the family (checked here against the draw). Both methods: the point's rounds, lr
and clip. Table columns: ``excess`` = F(w) - F(w_opt) on the train records (the user-level empirical
objective; w_opt the non-private minimizer), ``tau`` (noisy-gd-conc's projection radius, public), test
accuracy.
"""

from __future__ import annotations

import shutil
import tempfile

import torch

import fedkl
from fedkl.algorithms.nonprivate import nonprivate_minimizer
from fedkl.data import load_dataset
from fedkl.experiments import register_runner, runner_result
from fedkl.problems import make_problem

NAME = "conc-gd-synthetic"
D = 10
METHODS = ("noisy-gd", "noisy-gd-conc")


def run(settings, log) -> dict:
    torch.set_num_threads(1)
    method, n, m, seed = settings.method, int(settings.users), int(settings.user_records), int(settings.seed)
    if method not in METHODS:
        raise ValueError(f"{NAME}: method must be one of {', '.join(METHODS)}, got {method!r}")
    ds = load_dataset("synthetic-logistic", n_users=n, m=m, d=D, seed=seed)
    grid = {"rounds": settings.rounds, "lr": settings.lr, "clip": settings.clip}
    if method == "noisy-gd-conc":
        declared = int(0.8 * m)
        if int(ds.train.counts().min()) < declared:
            raise ValueError(f"{NAME}: a user holds fewer than the declared {declared} train records")
        grid["conc_records"] = declared
        grid["conc_centre"] = settings.conc_centre
        if float(settings.conc_k) > 0:
            grid["conc_scale"] = float(settings.conc_k)
    out = tempfile.mkdtemp(prefix="conc-gd-")
    try:
        r = fedkl.train(ds, method, epsilon=settings.epsilon, noise_seed=seed, log=None, out=out, **grid)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    problem = make_problem("logistic", ds)
    w_opt = nonprivate_minimizer(problem, ds.train)
    excess = float(problem.loss(r.model, ds.train) - problem.loss(w_opt, ds.train))
    tau = (r.result.get("algorithm_details") or {}).get("tau")  # previous centres: the last round's
    acc = r.metrics["accuracy"]
    log(f"{method} n={n} m={m} seed={seed} {grid}: excess {excess:.5f}, accuracy {acc:.4f}")
    return runner_result(
        NAME,
        f"synthetic-logistic-d{D}",
        n,
        r.epsilon,
        r.delta,
        seed,
        r.result.get("rounds"),
        {"excess": excess, "tau": tau if tau is not None else ""},
        test_metric={"name": "accuracy", "value": acc},
        test_metrics={"accuracy": acc},
        trivial_baseline={"accuracy": r.baseline["accuracy"]},
    )


register_runner(
    NAME,
    run,
    columns=("excess", "tau"),
    description=__doc__.splitlines()[0],
    settings={"method": "noisy-gd", "user_records": 20, "conc_k": 0.0},
)
