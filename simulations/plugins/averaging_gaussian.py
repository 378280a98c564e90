"""External sweep runner ``averaging+gaussian`` (a reference, NOT a fedkl algorithm), for
simulations/studies/mean_output_pert_movielens.toml (``[sweep] plugins`` loads this file by path).

The mean of the users' local regularized minimizers around w0 (lam = ``mean_lam``), each projected
onto the ball B(w0, G0/lam) that contains every exact local minimizer, plus Gaussian noise for the
replace-one sensitivity 2 G0/(lam n), charged as zCDP (rho of the whole budget, CKS conversion) to a
fresh per-user ledger through ``Releaser.gaussian`` before it is drawn. It shows what
mean-output-pert's deletion test costs."""

from __future__ import annotations

import os

import torch

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.output_perturbation.mean_output_pert import (
    LocalMeanOutputPert,
    MeanOutputPertParams,
    local_radius,
)
from fedkl.experiments import register_runner
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.runner import RunConfig, default_delta, load_run_data

NAME = "averaging+gaussian"


def run(settings, log) -> dict:
    torch.set_num_threads(1)
    flat = {k: v for k, v in vars(settings).items() if k != "algorithm"}
    cfg = RunConfig.from_settings(strict=False, algorithm="noisy-gd", **flat)
    dataset, problem, _ = load_run_data(cfg)
    fed = InProcessFederation(problem, dataset)
    n = fed.num_users
    delta = cfg.delta if cfg.delta is not None else default_delta(n)
    os.makedirs(cfg.out, exist_ok=True)
    ledger = PrivacyLedger(os.path.join(cfg.out, "ledger.sqlite"), Budget(cfg.epsilon, delta))
    lam = float(settings.mean_lam)
    w0 = problem.init_params().to(torch.float64)
    # only its users' local minimizers are read (the default newton solver); the (eps, delta) is never spent
    ctx = BuildContext.fresh(eps=1.0, delta=0.5, problem=problem, feature_bound=dataset.feature_bound)
    alg = LocalMeanOutputPert(MeanOutputPertParams(mean_lam=lam), ctx)
    V, _ = alg.user_vectors(fed, w0)
    R = local_radius(problem, dataset.feature_bound, w0, lam)
    dist = (V - w0).norm(dim=1, keepdim=True)
    V = w0 + (V - w0) * torch.clamp(R / dist.clamp_min(1e-300), max=1.0)  # projection onto B(w0, R)
    rho = ledger.rho_left(fed.user_ids)
    out = Releaser(ledger, NoiseSource(cfg.noise_seed)).gaussian(
        V.mean(0), sensitivity=2 * R / n, rho=rho, user_ids=list(fed.user_ids), label=NAME
    )
    ledger.verify()
    metrics = fed.evaluate(out)  # evaluation only: not a private release
    return {
        "algorithm": NAME,
        "dataset": cfg.dataset,
        "users": n,
        "epsilon": ledger.epsilon(fed.user_ids[0]),
        "delta": delta,
        "test_metric": {"name": "accuracy", "value": metrics["accuracy"]},
        "test_metrics": metrics,
        "nonprivate_reference": None,
        "trivial_baseline": problem.trivial_metrics(dataset.train, dataset.test),
        "seed": cfg.seed,
        "rounds": 1,
        "algorithm_details": {"bottom": False, "lam": lam, "radius": R, "sensitivity": 2 * R / n},
    }


register_runner(NAME, run, description=__doc__.splitlines()[0])
