"""External sweep runner ``conc-gd-synthetic`` for simulations/studies/concentrated_gd.toml: one fedkl
algorithm (``method``: ``noisy-gd`` or ``noisy-gd-conc``) trained through ``fedkl.train`` (its own ledger
in a temporary folder, replace-one, the point's eps, delta = 1/n^1.1) on one draw of the IID
synthetic logistic family (fedkl.data.synthetic, heterogeneity 0) with ``user_records`` = m records per user,
20% held out, d = 10.

Its own settings: ``method``, ``user_records`` (m) and ``conc_k`` (noisy-gd-conc's and noisy-gd-outlier's
``--conc-scale``; 0: the theorem's default); noisy-gd-conc also takes the point's ``conc_centre``; the
``tau`` column holds noisy-gd-outlier's neighbourhood radius R. Both concentration methods declare ``--conc-records`` = the per-user train count, 0.8 m: a
public design fact of the family (checked here against the draw). Both methods: the point's rounds, lr
and clip. Table columns: ``excess`` = F(w) - F(w_opt) on the train records (the user-level empirical
objective; w_opt the non-private minimizer), ``tau`` (noisy-gd-conc's projection radius, public), test
accuracy.

Paper 002's output perturbation (simulations/studies/concentrated_vs_p002.toml): ``sc-output-pert`` (one
release of the regularized ERM minimizer, the point's ``reg`` > 0, Delta = ``sc_delta_a``/(reg n sqrt(m_train)),
a public rule) and ``mean-output-pert`` (the point's ``mean_lam``); both with ``force`` (the public forecast
refuses them: the study measures exactly that). A ⊥ release leaves the public initial model w0 = 0 (what
the server holds), scored as such. Their columns: ``bottom`` (1 if ⊥), ``sigma`` and ``Delta`` (the release's
noise and threshold, public), ``reg_floor`` (sc-output-pert: the excess of the NON-private regularized
minimizer, the bias its reg costs; a server-side diagnostic, not private).
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
METHODS = ("noisy-gd", "noisy-gd-conc", "noisy-gd-outlier", "sc-output-pert", "mean-output-pert")
P002 = ("sc-output-pert", "mean-output-pert")


def run(settings, log) -> dict:
    torch.set_num_threads(1)
    method, n, m, seed = settings.method, int(settings.users), int(settings.user_records), int(settings.seed)
    if method not in METHODS:
        raise ValueError(f"{NAME}: method must be one of {', '.join(METHODS)}, got {method!r}")
    ds = load_dataset("synthetic-logistic", n_users=n, m=m, d=D, seed=seed)
    grid = {"rounds": settings.rounds, "lr": settings.lr, "clip": settings.clip}
    if method == "sc-output-pert":
        reg = float(settings.reg)
        if reg <= 0:
            raise ValueError(f"{NAME}: sc-output-pert needs reg > 0")
        m_train = int(0.8 * m)
        grid = {"reg": reg, "force": True, "stability_delta": float(settings.sc_delta_a) / (reg * n * m_train**0.5)}
    elif method == "mean-output-pert":
        grid = {"reg": float(settings.reg), "force": True, "mean_lam": float(settings.mean_lam)}
    if method in ("noisy-gd-conc", "noisy-gd-outlier"):
        declared = int(0.8 * m)
        if int(ds.train.counts().min()) < declared:
            raise ValueError(f"{NAME}: a user holds fewer than the declared {declared} train records")
        grid["conc_records"] = declared
        if method == "noisy-gd-conc":
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
    details = r.result.get("algorithm_details") or {}
    model = r.model if r.model is not None else problem.init_params()  # ⊥: the server keeps w0
    excess = float(problem.loss(model, ds.train) - problem.loss(w_opt, ds.train))
    tau = details.get("tau", details.get("radius"))  # previous centres: the last round's; outlier: its radius R
    acc = r.metrics["accuracy"] if r.model is not None else problem.metrics(model, ds.test)["accuracy"]
    extra = {"excess": excess, "tau": tau if tau is not None else ""}
    if method in P002:
        floor = ""
        if method == "sc-output-pert":
            reg_problem = make_problem("logistic", ds, reg=grid["reg"])
            floor = float(
                problem.loss(nonprivate_minimizer(reg_problem, ds.train), ds.train) - problem.loss(w_opt, ds.train)
            )
        extra.update(
            bottom=int(bool(details.get("bottom"))),
            sigma=details.get("sigma"),
            Delta=details.get("Delta"),
            reg_floor=floor,
        )
    log(f"{method} n={n} m={m} seed={seed} {grid}: excess {excess:.5f}, accuracy {acc:.4f}")
    return runner_result(
        NAME,
        f"synthetic-logistic-d{D}",
        n,
        r.epsilon,
        r.delta,
        seed,
        r.result.get("rounds"),
        extra,
        test_metric={"name": "accuracy", "value": acc},
        test_metrics={"accuracy": acc},
        trivial_baseline={"accuracy": r.baseline["accuracy"]},
    )


register_runner(
    NAME,
    run,
    columns=("excess", "tau", "bottom", "sigma", "Delta", "reg_floor"),
    description=__doc__.splitlines()[0],
    settings={"method": "noisy-gd", "user_records": 20, "conc_k": 0.0, "sc_delta_a": 16.0},
)
