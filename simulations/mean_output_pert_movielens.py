"""MeanOutputPert (note §5(c)) on MovieLens: test accuracy and ⊥ rate at user-level (eps, delta).

    OMP_NUM_THREADS=1 .venv/bin/python simulations/mean_output_pert_movielens.py            # ~5 min
    OMP_NUM_THREADS=1 .venv/bin/python simulations/mean_output_pert_movielens.py --seeds 2  # ~2 min

Every method is a real private run: a fresh PrivacyLedger per (method, seed) with the user-level
budget (eps, delta = 1/n^1.1, fedkl's default), a seeded NoiseSource (seed = noise seed), and the
release path of the algorithm (charge, then draw). Methods:

* ``mean-output-pert``: :class:`~fedkl.algorithms.mean_output_pert.LocalMeanOutputPert` built by
  ``build_mean_output_pert`` (one release of the mean of the users' local minimizers around w0 = 0).
* ``phased-mean-output-pert``: ``build_phased_mean_output_pert`` (T phases at (eps/T, delta/T)).
* ``averaging+gaussian`` (a reference, NOT a fedkl algorithm): the same mean of local minimizers,
  each projected onto the ball B(w0, G0/lam) that contains every exact local minimizer, plus
  Gaussian noise for the replace-one sensitivity 2 G0/(lam n), charged as zCDP (rho of the budget,
  CKS conversion) through ``Releaser.gaussian``. It shows what the deletion test costs.
* ``noisy-gd``: ``fedkl run``'s default (``fedkl.runner.run_training`` with RunConfig defaults and
  the noise seed).

The (lam, rho_fraction) grid is small and public; picking the best row after seeing test accuracy is
NOT private (a tuning budget would pay for it). Writes simulations/results/mean_output_pert_movielens.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedkl.algorithms.mean_output_pert import (  # noqa: E402
    LocalMeanOutputPert,
    LocalMeanOutputPertConfig,
    local_radius,
)
from fedkl.data import load_dataset  # noqa: E402
from fedkl.federation.inprocess import InProcessFederation  # noqa: E402
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser  # noqa: E402
from fedkl.problems import make_problem  # noqa: E402
from fedkl.runner import RunConfig, build_algorithm, default_delta, run_training  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _cfg(**kw):
    base = dict(
        mean_lam=1.0, mean_rho_fraction=0.25, mean_phases=2, mean_calibration="tight", mean_max_vc_calls=4_000_000
    )
    base.update(kw)
    return base


def run_mean(kind, cfg, seed, eps, delta, problem, dataset, fed, tmp):
    ledger = PrivacyLedger(os.path.join(tmp, f"{kind}-{seed}-{time.time_ns()}.sqlite"), Budget(eps, delta))
    run_cfg = RunConfig.from_settings(strict=False, algorithm=kind, epsilon=eps, delta=delta, **cfg)
    alg = build_algorithm(run_cfg, problem, dataset.feature_bound, fed.user_ids, delta, ledger)
    start = time.perf_counter()
    res = alg.run(fed, Releaser(ledger, NoiseSource(seed)), problem.init_params())
    secs = time.perf_counter() - start
    ledger.verify()
    spent = ledger.spend(fed.user_ids[0])
    if kind == "mean-output-pert":
        bottoms, phases = int(res.theta is None), 1
        deleted = [res.diagnostics["deleted_users"]]
        w = res.theta
    else:
        bottoms, phases = res.bottoms, res.phases
        deleted = res.details["nonprivate_diagnostics"]["deleted_users"]
        w = res.w
    acc = fed.evaluate(w)["accuracy"] if w is not None else None
    return {
        "method": kind,
        "seed": seed,
        "lam": cfg.mean_lam,
        "rho_fraction": cfg.mean_rho_fraction,
        "phases": phases,
        "accuracy": acc,
        "bottoms": bottoms,
        "deleted_users": deleted,
        "eps_spent": spent.eps,
        "delta_spent": spent.delta,
        "releases_per_user": spent.releases,
        "seconds": secs,
    }


def run_averaging(lam, seed, eps, delta, problem, dataset, fed, tmp):
    """Reference: projected mean of local minimizers + Gaussian, replace-one sensitivity 2 R / n."""
    ledger = PrivacyLedger(os.path.join(tmp, f"avg-{seed}-{time.time_ns()}.sqlite"), Budget(eps, delta))
    w0 = problem.init_params().to(torch.float64)
    alg = LocalMeanOutputPert(LocalMeanOutputPertConfig(1.0, 0.5, lam), problem, dataset.feature_bound)
    V, _ = alg.user_vectors(fed, w0)
    R = local_radius(problem, dataset.feature_bound, w0, lam)
    dist = (V - w0).norm(dim=1, keepdim=True)
    V = w0 + (V - w0) * torch.clamp(R / dist.clamp_min(1e-300), max=1.0)  # projection onto B(w0, R)
    n = fed.num_users
    rho = ledger.rho_left(fed.user_ids)
    out = Releaser(ledger, NoiseSource(seed)).gaussian(
        V.mean(0), sensitivity=2 * R / n, rho=rho, user_ids=list(fed.user_ids), label="averaging+gaussian"
    )
    ledger.verify()
    return {
        "method": "averaging+gaussian",
        "seed": seed,
        "lam": lam,
        "accuracy": fed.evaluate(out)["accuracy"],
        "bottoms": 0,
        "eps_spent": ledger.epsilon(fed.user_ids[0]),
    }


def run_noisy_gd(seed, eps, tmp):
    out = run_training(
        RunConfig.from_settings(epsilon=eps, noise_seed=seed, out=os.path.join(tmp, f"ngd-{seed}"), reference=False),
        log=lambda s: None,
    )
    return {
        "method": "noisy-gd",
        "seed": seed,
        "accuracy": out["test_metric"]["value"],
        "bottoms": 0,
        "eps_spent": out["epsilon"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--eps", type=float, default=2.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dataset = load_dataset("movielens")
    problem = make_problem("logistic", dataset)
    fed = InProcessFederation(problem, dataset)
    n = fed.num_users
    delta = default_delta(n)
    grid = [
        ("mean-output-pert", _cfg(mean_lam=1.0, mean_rho_fraction=0.25)),
        ("mean-output-pert", _cfg(mean_lam=3.0, mean_rho_fraction=0.2)),
        ("phased-mean-output-pert", _cfg(mean_lam=1.0, mean_rho_fraction=0.25, mean_phases=2)),
        ("phased-mean-output-pert", _cfg(mean_lam=0.25, mean_rho_fraction=0.2, mean_phases=2)),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for kind, cfg in grid:
                rows.append(run_mean(kind, cfg, seed, args.eps, delta, problem, dataset, fed, tmp))
                print(rows[-1], flush=True)
            rows.append(run_averaging(1.0, seed, args.eps, delta, problem, dataset, fed, tmp))
            print(rows[-1], flush=True)
            rows.append(run_noisy_gd(seed, args.eps, tmp))
            print(rows[-1], flush=True)
    summary = {}
    for r in rows:
        key = (r["method"], r.get("lam"), r.get("rho_fraction"), r.get("phases"))
        summary.setdefault(key, []).append(r)
    table = []
    for (method, lam, frac, phases), rs in summary.items():
        accs = [r["accuracy"] for r in rs if r["accuracy"] is not None]
        releases = sum(r.get("phases") or 1 for r in rs)
        table.append(
            {
                "method": method,
                "lam": lam,
                "rho_fraction": frac,
                "phases": phases,
                "runs": len(rs),
                "accuracy_mean": float(np.mean(accs)) if accs else None,
                "accuracy_std": float(np.std(accs)) if accs else None,
                "bottom_rate": sum(r["bottoms"] for r in rs) / releases,
                "deleted_users": [r.get("deleted_users") for r in rs],
            }
        )
    trivial = problem.trivial_metrics(dataset.train, dataset.test)["accuracy"]
    os.makedirs(RESULTS, exist_ok=True)
    payload = {
        "eps": args.eps,
        "delta": delta,
        "users": n,
        "seeds": args.seeds,
        "trivial_accuracy": trivial,
        "rows": rows,
        "table": table,
    }
    with open(os.path.join(RESULTS, "mean_output_pert_movielens.json"), "w") as f:
        json.dump(payload, f, indent=2, default=str)
    lines = [
        f"# MeanOutputPert on MovieLens ({n} users, logistic), eps = {args.eps:g}, delta = {delta:.3g}, "
        f"{args.seeds} noise seeds",
        "",
        "| method | lam | rho_fraction | T | test accuracy (mean ± std) | ⊥ rate (per release) "
        "| deleted users (non-private) |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in table:
        acc = "n/a" if t["accuracy_mean"] is None else f"{t['accuracy_mean']:.4f} ± {t['accuracy_std']:.4f}"
        lines.append(
            f"| {t['method']} | {t['lam']} | {t['rho_fraction']} | {t['phases']} | {acc} | "
            f"{t['bottom_rate']:.2f} | {t['deleted_users']} |"
        )
    lines += ["", f"Trivial (majority) accuracy: {trivial:.4f}."]
    with open(os.path.join(RESULTS, "mean_output_pert_movielens.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
