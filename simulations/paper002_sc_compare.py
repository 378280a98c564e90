"""Paper 002 evidence: user-level output perturbation (SCOutputPert) against noisy clipped-gradient
descent at the same user-level (eps, delta), on synthetic data as m grows and on MovieLens.

    .venv/bin/python -m simulations.paper002_sc_compare            # about 3-5 min on 2 cores
    .venv/bin/python -m simulations.paper002_sc_compare --quick    # about 1 min (smaller grids, 2 seeds)

(from the repository root: it imports the sc-output-pert plugin and the slopes report as modules).

Writes ``simulations/results/paper002_sc_compare{,_quick}.{csv,json,md,png}`` (the markdown file holds
the tables and the conclusion paragraph). (The phased algorithms against noisy GD on the
mean-estimation family: simulations/studies/paper002_compare.toml.)

Methods, all at the same user-level (eps, delta), replace-one, n public:

* ``sc-output-pert``: paper 002 Alg. 2 (SCOutputPert, calibration "tight") with the public threshold
  Delta = a G/(mu n sqrt(m)) (synthetic; a in a small public grid) or Delta = b G/(mu n) (MovieLens,
  whose users hold different numbers of records). n is far above SCOutputPert.run's exact-fallback
  limit (24 users), so it is evaluated through :func:`simulations.plugins.paper002_sc_output_pert.certified_release`
  (SCOutputPert's own solver, certificate and release path; exact output law wherever the
  certificate passes, "undetermined" where it does not; an evaluation harness, not a DP mechanism:
  see that module's docstring).
* ``noisy-gd``: :class:`fedkl.algorithms.noisy_gd.NoisyGradientDescent` (per-user clipping to C,
  Gaussian noise on the sum, zCDP with rho converted from (eps, delta) by CKS), a real private run:
  a PrivacyLedger, a Releaser with a zCDP filter, a seeded NoiseSource. On MovieLens through
  ``fedkl.runner.run_training`` (writes result.json + ledger.sqlite per run, kept under --keep-runs).
* ``global-sens-law`` (reference, not a fedkl algorithm): the classic user-level output perturbation
  theta* + N(0, s^2 I), s = analytic Gaussian at (eps, delta) for the replace-one sensitivity
  2G/(mu n) + 2 tau of the (tau-accurate) ridge minimizer; its output LAW is sampled (no release).

Hyperparameters come from small public grids; the tables report every configuration and the best
one per setting. Choosing the best after seeing the results is NOT private (it is what a tuning
budget would buy) and favours both methods equally.

Synthetic setting: least squares, IID users (heterogeneity 0), d = 10, ridge mu = 0.1, n = 128,
(eps, delta) = (4, 1e-5) (n >= 8 kappa = 64: the theorem's regime), m in {16, ..., 4096}; metric:
excess empirical risk F(theta^) - F(theta*) of the ridge objective (exact theta*). MovieLens: 671
raters, logistic regression, delta = 1/n^1.1, eps in {2, 8}; metric: test accuracy.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from fedkl.algorithms.noisy_gd import NoisyGDConfig, NoisyGradientDescent
from fedkl.algorithms.sc_output_pert import SCOutputPert, SCOutputPertConfig
from fedkl.data import load_dataset, synthetic_least_squares
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.mechanisms import GaussianMechanism
from fedkl.problems import make_problem
from fedkl.runner import RunConfig, default_delta, run_training
from simulations.plugins.paper002_sc_output_pert import (
    EvaluationRecorder,
    Undetermined,
    certified_release,
    noise_seed,
    public_scale,
    public_train_records,
    ridge_erm,
    scaled_delta,
)
from simulations.reports.paper002_slopes import fit_slope

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(frozen=True)
class CompareConfig:
    m_grid: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    n: int = 128
    d: int = 10
    reg: float = 0.1
    label_noise: float = 0.1
    eps: float = 4.0
    delta: float = 1e-5
    seeds: int = 3
    a_grid: tuple[float, ...] = (1.0, 0.3, 0.1)
    clip_grid: tuple[float, ...] = (1.0, 0.1, 0.01)
    rounds_grid: tuple[int, ...] = (10, 30, 100)
    test_fraction: float = 0.2
    # MovieLens
    ml_eps: tuple[float, ...] = (2.0, 8.0)
    ml_reg: float = 0.1
    ml_b_grid: tuple[float, ...] = (1.0, 0.3)
    ml_gd_grid: tuple[tuple[float, int, float], ...] = ((1.0, 10, 4.0), (0.3, 30, 4.0))  # (clip, rounds, lr)
    ml_seeds: int = 3
    tag: str = "full"


FULL = CompareConfig()
QUICK = CompareConfig(
    m_grid=(16, 256, 4096),
    seeds=2,
    rounds_grid=(10, 30),
    ml_eps=(8.0,),
    ml_seeds=2,
    ml_gd_grid=((1.0, 10, 4.0),),
    tag="quick",
)


def _scratch_dir() -> str:
    """Ledgers of the synthetic noisy-GD runs: tmpfs when available (they fsync every charge)."""
    return tempfile.mkdtemp(prefix="paper002-compare-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


# --- synthetic -----------------------------------------------------------------------------------
def noisy_gd_private(
    problem, fed, eps: float, delta: float, config: NoisyGDConfig, seed: int, folder: str, label: str
) -> torch.Tensor:
    """A real private noisy-GD run: its own ledger with budget (eps, delta), rho by CKS, zCDP filter."""
    path = os.path.join(folder, label.replace("/", "_") + ".sqlite")
    with PrivacyLedger(path, Budget(eps, delta)) as ledger:
        rho = ledger.rho_left(fed.user_ids)
        releaser = Releaser(ledger, NoiseSource(seed), ZCDPFilter(rho))
        res = NoisyGradientDescent(config, rho).run(fed, releaser, torch.zeros(problem.num_params, dtype=torch.float64))
        ledger.verify()
        spent = ledger.summary()["max_user_rho"]
    if spent > rho * (1 + 1e-9):
        raise RuntimeError(f"noisy GD spent rho {spent} > budget {rho}")
    return res.w


def synthetic_point(cfg: CompareConfig, m: int, seed: int, folder: str) -> list[dict]:
    n = cfg.n
    ds = synthetic_least_squares(
        n, m, cfg.d, heterogeneity=0.0, noise=cfg.label_noise, seed=seed, test_fraction=cfg.test_fraction
    )
    m_train = public_train_records(m, cfg.test_fraction)
    problem = make_problem("least-squares", ds, reg=cfg.reg)
    fed = InProcessFederation(problem, ds)
    scale = public_scale(problem, ds.feature_bound)
    theta_star, H = ridge_erm(ds, cfg.reg)
    center = torch.zeros(cfg.d, dtype=torch.float64)

    def metrics(w: torch.Tensor | None) -> dict:
        if w is None:
            return {"excess_risk": math.nan, "param_error": math.nan}
        e = w.to(torch.float64) - theta_star
        return {"excess_risk": float(0.5 * e @ H @ e), "param_error": float(e.norm())}

    base = {
        "setting": "synthetic",
        "n": n,
        "m": m,
        "m_train": m_train,
        "seed": seed,
        "eps": cfg.eps,
        "delta": cfg.delta,
    }
    rows = []
    tol = scaled_delta(scale, cfg.reg, n, m_train, min(cfg.a_grid)) / 1000.0  # one solver for every a
    for a in cfg.a_grid:
        Delta = scaled_delta(scale, cfg.reg, n, m_train, a)
        alg = SCOutputPert(
            SCOutputPertConfig.for_problem(
                problem,
                ds.feature_bound,
                center,
                eps=cfg.eps,
                delta=cfg.delta,
                Delta=Delta,
                tol=tol,
                calibration="tight",
            )
        )
        rel = Releaser(EvaluationRecorder(), NoiseSource(noise_seed("sc", m, seed, a)))
        try:
            out = certified_release(alg, fed, center, rel, f"compare/sc/m{m}/a{a}/s{seed}")
            status, w, sigma, bound = "certified", out.theta, out.sigma, out.bound
        except Undetermined:
            status, w, sigma, bound = "undetermined", None, alg.config.dop.sigma, math.nan
        rows.append(
            {
                **base,
                "method": "sc-output-pert",
                "config": f"a={a:g}",
                "status": status,
                "sigma": sigma,
                "Delta": Delta,
                "certificate_bound": bound,
                **metrics(w),
            }
        )
    # the classic global-sensitivity output perturbation, sampled from its law (reference)
    sens = 2 * scale.G / (cfg.reg * n) + 2 * tol
    s_b = GaussianMechanism.analytic(sens, cfg.eps, cfg.delta).sigma
    w_b = theta_star + NoiseSource(noise_seed("gs", m, seed)).gaussian((cfg.d,), s_b)
    rows.append(
        {
            **base,
            "method": "global-sens-law",
            "config": "",
            "status": "law",
            "sigma": s_b,
            "Delta": math.nan,
            "certificate_bound": math.nan,
            **metrics(w_b),
        }
    )
    lr = 1.0 / problem.constants(ds.feature_bound, param_bound=scale.B).smoothness  # 1/beta, public
    for clip in cfg.clip_grid:
        for rounds in cfg.rounds_grid:
            gd = NoisyGDConfig(rounds=rounds, lr=lr, clip=clip)
            w = noisy_gd_private(
                problem,
                fed,
                cfg.eps,
                cfg.delta,
                gd,
                noise_seed("gd", m, seed, clip, rounds),
                folder,
                f"gd-m{m}-s{seed}-C{clip}-T{rounds}",
            )
            sigma = NoisyGradientDescent(gd, Budget(cfg.eps, cfg.delta).rho).sigma
            rows.append(
                {
                    **base,
                    "method": "noisy-gd",
                    "config": f"C={clip:g},T={rounds}",
                    "status": "private run",
                    "sigma": sigma,
                    "Delta": math.nan,
                    "certificate_bound": math.nan,
                    **metrics(w),
                }
            )
    return rows


def best_by_config(rows: list[dict], method: str, m: int, key: str = "excess_risk") -> tuple[str, float, float] | None:
    """(config, mean, sd) of the method's best configuration at m over the seeds; configurations with
    an undetermined seed are skipped (their mean is unknown)."""
    best = None
    for conf in sorted({r["config"] for r in rows if r["method"] == method}):
        sel = [r for r in rows if r["method"] == method and r["m"] == m and r["config"] == conf]
        if not sel or any(r["status"] == "undetermined" for r in sel):
            continue
        v = np.array([r[key] for r in sel])
        if best is None or v.mean() < best[1]:
            best = (conf, float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0)
    return best


def synthetic(cfg: CompareConfig, log=print) -> list[dict]:
    folder = _scratch_dir()
    rows = []
    try:
        for m in cfg.m_grid:
            start = time.perf_counter()
            for seed in range(cfg.seeds):
                rows.extend(synthetic_point(cfg, m, seed, folder))
            sc, gd = best_by_config(rows, "sc-output-pert", m), best_by_config(rows, "noisy-gd", m)
            log(
                f"  synthetic m={m:5d}: sc-output-pert best {sc[0] if sc else 'none certified'} "
                f"{sc[1] if sc else math.nan:.4g} | noisy-gd best {gd[0]} {gd[1]:.4g}  ({time.perf_counter() - start:.0f} s)"
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


# --- MovieLens -----------------------------------------------------------------------------------
def movielens(cfg: CompareConfig, keep_runs: str | None, log=print) -> tuple[list[dict], dict]:
    ds = load_dataset("movielens", split_seed=0)
    n = ds.train.num_users
    delta = default_delta(n)
    problem = make_problem("logistic", ds, reg=cfg.ml_reg)
    fed = InProcessFederation(problem, ds)
    scale = public_scale(problem, ds.feature_bound)
    center = torch.zeros(problem.num_params, dtype=torch.float64)
    rows, refs = [], {}
    runs_dir = keep_runs or tempfile.mkdtemp(prefix="paper002-ml-")
    try:
        for eps in cfg.ml_eps:
            base = {"setting": "movielens", "n": n, "m": math.nan, "m_train": math.nan, "eps": eps, "delta": delta}
            tol = min(cfg.ml_b_grid) * scale.G / (cfg.ml_reg * n) / 1000.0
            for b in cfg.ml_b_grid:
                Delta = b * scale.G / (cfg.ml_reg * n)
                alg = SCOutputPert(
                    SCOutputPertConfig.for_problem(
                        problem,
                        ds.feature_bound,
                        center,
                        eps=eps,
                        delta=delta,
                        Delta=Delta,
                        tol=tol,
                        calibration="tight",
                    )
                )
                for seed in range(cfg.ml_seeds):
                    rel = Releaser(EvaluationRecorder(), NoiseSource(noise_seed("ml-sc", eps, b, seed)))
                    try:
                        out = certified_release(alg, fed, center, rel, f"compare/ml/sc/eps{eps}/b{b}/s{seed}")
                        status, acc, sigma, bound = (
                            "certified",
                            fed.evaluate(out.theta, "test")["accuracy"],
                            out.sigma,
                            out.bound,
                        )
                    except Undetermined:
                        status, acc, sigma, bound = "undetermined", math.nan, alg.config.dop.sigma, math.nan
                    rows.append(
                        {
                            **base,
                            "seed": seed,
                            "method": "sc-output-pert",
                            "config": f"mu={cfg.ml_reg:g},b={b:g}",
                            "status": status,
                            "sigma": sigma,
                            "Delta": Delta,
                            "certificate_bound": bound,
                            "test_accuracy": acc,
                        }
                    )
            theta_np = SCOutputPert(
                SCOutputPertConfig.for_problem(
                    problem, ds.feature_bound, center, eps=eps, delta=delta, Delta=tol * 1000, tol=tol
                )
            ).solve(fed, torch.ones(1, n, dtype=torch.bool), center)[0]
            refs[f"ridge_mu{cfg.ml_reg:g}_nonprivate_accuracy"] = fed.evaluate(theta_np, "test")["accuracy"]
            s_b = GaussianMechanism.analytic(2 * scale.G / (cfg.ml_reg * n) + 2 * tol, eps, delta).sigma
            for seed in range(cfg.ml_seeds):
                w_b = theta_np + NoiseSource(noise_seed("ml-gs", eps, seed)).gaussian((problem.num_params,), s_b)
                rows.append(
                    {
                        **base,
                        "seed": seed,
                        "method": "global-sens-law",
                        "config": f"mu={cfg.ml_reg:g}",
                        "status": "law",
                        "sigma": s_b,
                        "Delta": math.nan,
                        "certificate_bound": math.nan,
                        "test_accuracy": fed.evaluate(w_b, "test")["accuracy"],
                    }
                )
            for clip, rounds, lr in cfg.ml_gd_grid:
                for seed in range(cfg.ml_seeds):
                    out = os.path.join(runs_dir, f"noisy-gd-eps{eps:g}-C{clip:g}-T{rounds}-s{seed}")
                    res = run_training(
                        RunConfig.from_settings(
                            dataset="movielens",
                            algorithm="noisy-gd",
                            epsilon=eps,
                            clip=clip,
                            rounds=rounds,
                            lr=lr,
                            seed=0,
                            noise_seed=seed,
                            out=out,
                            reference="nonprivate_accuracy" not in refs,
                        ),
                        log=lambda s: None,
                    )
                    if res["nonprivate_reference"]:
                        refs["nonprivate_accuracy"] = res["nonprivate_reference"]["accuracy"]
                    refs["majority_baseline"] = res["trivial_baseline"]["accuracy"]
                    rows.append(
                        {
                            **base,
                            "seed": seed,
                            "method": "noisy-gd",
                            "config": f"C={clip:g},T={rounds},lr={lr:g}",
                            "status": "private run (run_training)",
                            "sigma": res["sigma_sum"],
                            "Delta": math.nan,
                            "certificate_bound": math.nan,
                            "test_accuracy": res["test_metric"]["value"],
                            "epsilon_spent": res["epsilon"],
                        }
                    )
            log(
                f"  movielens eps={eps:g}: "
                + "; ".join(
                    f"{meth} {conf}: {np.nanmean([r['test_accuracy'] for r in rows if r['eps'] == eps and r['method'] == meth and r['config'] == conf]):.4f}"
                    for meth, conf in sorted({(r["method"], r["config"]) for r in rows if r["eps"] == eps})
                )
            )
    finally:
        if keep_runs is None:
            shutil.rmtree(runs_dir, ignore_errors=True)
    refs["users"] = n
    refs["delta"] = delta
    refs["sigma_over_Delta"] = {
        str(eps): SCOutputPertConfig.for_problem(
            problem, ds.feature_bound, center, eps=eps, delta=delta, Delta=1.0, calibration="tight"
        ).dop.sigma
        for eps in cfg.ml_eps
    }
    return rows, refs


# --- analysis and outputs ------------------------------------------------------------------------
def crossover(rows: list[dict], cfg: CompareConfig) -> dict:
    """Fit log excess vs log m for sc-output-pert at a = 1 and extrapolate where it meets the best
    noisy-GD value at the largest m (noisy GD's error does not fall with m: its noise is set by C)."""
    sel = [r for r in rows if r["method"] == "sc-output-pert" and r["config"] == "a=1" and r["status"] == "certified"]
    f = fit_slope([r["m"] for r in sel], [r["excess_risk"] for r in sel])
    gd = best_by_config(rows, "noisy-gd", max(cfg.m_grid))
    gs = [r for r in rows if r["method"] == "global-sens-law" and r["m"] == max(cfg.m_grid)]
    out = {
        "sc_a1_slope_in_m": f["slope"],
        "sc_a1_slope_se": f["se"],
        "noisy_gd_best_at_max_m": gd[1],
        "noisy_gd_best_config": gd[0],
    }
    out["m_star_vs_noisy_gd"] = (
        math.exp((math.log(gd[1]) - f["intercept"]) / f["slope"]) if f["slope"] < 0 else math.inf
    )
    gsv = float(np.mean([r["excess_risk"] for r in gs]))
    out["m_star_vs_global_sens"] = (
        math.exp((math.log(gsv) - f["intercept"]) / f["slope"]) if f["slope"] < 0 else math.inf
    )
    gd_sel = [r for r in rows if r["method"] == "noisy-gd" and r["config"] == gd[0]]
    out["noisy_gd_best_config_slope_in_m"] = fit_slope([r["m"] for r in gd_sel], [r["excess_risk"] for r in gd_sel])[
        "slope"
    ]
    return out


def summarize(rows: list[dict], metric: str, keys=("setting", "eps", "m", "method", "config")) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for k, sel in groups.items():
        ok = [r for r in sel if r["status"] != "undetermined"]
        v = np.array([r[metric] for r in ok], float)
        out.append(
            {
                **dict(zip(keys, k)),
                "runs": len(sel),
                "determined": len(ok),
                "mean": float(v.mean()) if len(ok) == len(sel) else math.nan,
                "sd": float(v.std(ddof=1)) if len(ok) == len(sel) and len(v) > 1 else math.nan,
                "sigma": float(np.mean([r["sigma"] for r in sel])),
            }
        )
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    syn, ml, refs = result["synthetic"], result["movielens"], result["movielens_refs"]
    L = [
        f"# Paper 002: output perturbation vs noisy clipped-gradient descent ({cfg['tag']} run)",
        "",
        "Regenerate: `.venv/bin/python -m simulations.paper002_sc_compare"
        + (" --quick" if cfg["tag"] == "quick" else "")
        + "`. All methods at the same user-level (ε, δ), replace-one. Hyperparameters from small public grids; "
        "'best' = best mean over seeds (tuning is not private; it favours both methods equally).",
        "",
        f"## Synthetic least squares (IID users, n = {cfg['n']}, d = {cfg['d']}, μ = {cfg['reg']}, "
        f"(ε, δ) = ({cfg['eps']}, {cfg['delta']:g}), {cfg['seeds']} seeds)",
        "",
        "Excess empirical risk F(θ̂) − F(θ*) of the ridge objective (mean ± sd over seeds).",
        "",
        "| m | sc-output-pert a=1 | sc-output-pert best (a) | noisy-gd best (C, T) | noisy-gd C=1 best T | "
        "global-sens law | winner |",
        "|---|---|---|---|---|---|---|",
    ]
    s = summarize(syn, "excess_risk")
    for m in cfg["m_grid"]:

        def pick(method, conf=None, prefix=None):
            cands = [
                x
                for x in s
                if x["m"] == m
                and x["method"] == method
                and (conf is None or x["config"] == conf)
                and (prefix is None or x["config"].startswith(prefix))
            ]
            cands = [x for x in cands if not math.isnan(x["mean"])]
            return min(cands, key=lambda x: x["mean"]) if cands else None

        def fmt(x, show=False):
            if x is None:
                return "undetermined"
            return f"{x['mean']:.3g} ± {x['sd']:.2g}" + (f" ({x['config']})" if show else "")

        a1, sc, gd, gd1, gs = (
            pick("sc-output-pert", "a=1"),
            pick("sc-output-pert"),
            pick("noisy-gd"),
            pick("noisy-gd", prefix="C=1,"),
            pick("global-sens-law"),
        )
        contenders = {"sc-output-pert": sc, "noisy-gd": gd, "global-sens law": gs}
        winner = min((k for k, v in contenders.items() if v), key=lambda k: contenders[k]["mean"])
        L.append(f"| {m} | {fmt(a1)} | {fmt(sc, True)} | {fmt(gd, True)} | {fmt(gd1, True)} | {fmt(gs)} | {winner} |")
    L += [
        "",
        "Certificate outcomes of sc-output-pert (certified runs / runs):",
        "",
        "| m | " + " | ".join(f"a={a:g}" for a in cfg["a_grid"]) + " |",
        "|---|" + "---|" * len(cfg["a_grid"]),
    ]
    for m in cfg["m_grid"]:
        cells = []
        for a in cfg["a_grid"]:
            x = [r for r in syn if r["m"] == m and r["method"] == "sc-output-pert" and r["config"] == f"a={a:g}"]
            cells.append(f"{sum(r['status'] == 'certified' for r in x)}/{len(x)}")
        L.append(f"| {m} | " + " | ".join(cells) + " |")
    ridge_acc = refs.get("ridge_mu%g_nonprivate_accuracy" % cfg["ml_reg"], math.nan)
    L += [
        "",
        "## MovieLens (671 raters, logistic regression, test accuracy, mean ± sd over noise seeds)",
        "",
        f"δ = 1/n^1.1 = {refs['delta']:.3g}. Non-private: unregularized {refs.get('nonprivate_accuracy', math.nan):.4f}, "
        f"ridge μ = {cfg['ml_reg']} {ridge_acc:.4f}; "
        f"majority class {refs['majority_baseline']:.4f}. σ/Δ of sc-output-pert: "
        + ", ".join(f"{v:.1f} at ε = {k}" for k, v in refs["sigma_over_Delta"].items())
        + ".",
        "",
        "| ε | method | configuration | test accuracy | certified | noise σ |",
        "|---|---|---|---|---|---|",
    ]
    for x in sorted(summarize(ml, "test_accuracy"), key=lambda x: (x["eps"], x["method"], x["config"])):
        acc = "undetermined" if math.isnan(x["mean"]) else f"{x['mean']:.4f} ± {x['sd']:.4f}"
        cert = f"{x['determined']}/{x['runs']}" if x["method"] == "sc-output-pert" else "–"
        L.append(f"| {x['eps']:g} | {x['method']} | {x['config']} | {acc} | {cert} | {x['sigma']:.3g} |")
    L += ["", "## Who wins where, and why", "", conclusion(result), ""]
    return "\n".join(L)


def conclusion(result: dict) -> str:
    cfg, cross = result["config"], result["crossover"]
    syn = result["synthetic"]
    ratio = np.mean([r["sigma"] / r["Delta"] for r in syn if r["method"] == "sc-output-pert"])
    ml = summarize(result["movielens"], "test_accuracy")

    def best_ml(method, eps):
        c = [x for x in ml if x["method"] == method and x["eps"] == eps and not math.isnan(x["mean"])]
        return max(c, key=lambda x: x["mean"]) if c else None

    ml_txt = []
    for eps in cfg["ml_eps"]:
        sc, gd, gs = best_ml("sc-output-pert", eps), best_ml("noisy-gd", eps), best_ml("global-sens-law", eps)
        ml_txt.append(
            f"at ε = {eps:g}: noisy GD {gd['mean']:.3f}, global-sensitivity output perturbation "
            f"{gs['mean']:.3f}, SCOutputPert {sc['mean']:.3f}"
            if sc
            else f"at ε = {eps:g}: noisy GD {gd['mean']:.3f}, SCOutputPert undetermined"
        )
    return (
        f"**Synthetic (IID users).** SCOutputPert's error falls with m as theory says: with a = 1 its excess risk has "
        f"slope {cross['sc_a1_slope_in_m']:.2f} ± {cross['sc_a1_slope_se']:.2f} in m (theory −1, i.e. ‖θ̂−θ*‖ ∝ "
        f"1/√m), because its threshold Δ ∝ G/(μn√m) is justified by deletion stability (the measured certificate "
        f"bound falls like 1/√m). Noisy GD's noise is set by the clip C, not by m: its best configuration "
        f"({cross['noisy_gd_best_config']}) has slope {cross['noisy_gd_best_config_slope_in_m']:.2f} in m. Yet noisy "
        f"GD wins at every m we can afford here, by orders of magnitude: SCOutputPert pays σ/Δ ≈ {ratio:.0f} "
        f"(the TDLap deletion budget κ = 8 enters the sensitivity as (4κ+1)Δ, then the Gaussian at (ε/2, δ̄)), and "
        f"Δ must use the worst-case Lipschitz constant G of the ridge problem, while noisy GD's clip can sit at the "
        f"users' actual gradient scale and its noise is averaged over n users and damped by the step. Extrapolating "
        f"the a = 1 fit, SCOutputPert would match the best noisy GD at m ≈ {cross['m_star_vs_noisy_gd']:.2g} records "
        f"per user and the classic global-sensitivity output perturbation (θ* + N(0, s²I), sensitivity 2G/(μn)) at "
        f"m ≈ {cross['m_star_vs_global_sens']:.2g}; a smaller public a (0.3, 0.1) shrinks the noise but the "
        f"certificate then fails at small m (table above: 'undetermined' = the exact test would have to decide, "
        f"which is infeasible at n = {cfg['n']}). The brief's expectation that noisy GD stops improving once its "
        f"clip binds is borne out only in the sense that its error is flat in m; clipping does not bind here "
        f"because IID users' gradients shrink towards the optimum, so noisy GD is never hurt by it. "
        f"**MovieLens (heterogeneous raters, median 57 ratings).** "
        + "; ".join(ml_txt)
        + ". Heterogeneous users make the deletion stability Θ(G/(μn)) with no √m gain "
        "(note §6.13), so SCOutputPert keeps its κ-inflated noise without the benefit; it needs b ≳ 0.3 for "
        "the certificate to pass at all. Noisy GD (and, at large ε, plain output perturbation) win on real "
        "user-partitioned data. The deletion-based mechanism is a large-m, IID-users tool: it wins only beyond "
        "the extrapolated crossover, consistent with the note's §4 estimate (m* of order 1e3–1e6 items per user)."
    )


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, syn, ml = result["config"], result["synthetic"], result["movielens"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    ax = axes[0]
    s = summarize(syn, "excess_risk")
    ms = np.array(cfg["m_grid"], float)
    for i, a in enumerate(cfg["a_grid"]):
        y = np.array([next(x["mean"] for x in s if x["m"] == m and x["config"] == f"a={a:g}") for m in cfg["m_grid"]])
        ax.loglog(ms, y, "o-", color=f"C{i}", label=f"SCOutputPert a={a:g} (missing = certificate failed)")
    for j, clip in enumerate(cfg["clip_grid"]):
        y = []
        for m in cfg["m_grid"]:
            c = [
                x["mean"]
                for x in s
                if x["m"] == m and x["method"] == "noisy-gd" and x["config"].startswith(f"C={clip:g},")
            ]
            y.append(min(c))
        ax.loglog(ms, y, "s--", color=f"C{j + 4}", label=f"noisy GD C={clip:g} (best T)")
    y = [next(x["mean"] for x in s if x["m"] == m and x["method"] == "global-sens-law") for m in cfg["m_grid"]]
    ax.loglog(ms, y, "^:", color="k", label="global-sensitivity output pert. (law)")
    ax.set_xlabel("records per user m")
    ax.set_ylabel("excess empirical risk F(θ̂) − F(θ*)")
    ax.set_title(f"synthetic least squares, n = {cfg['n']}, (ε, δ) = ({cfg['eps']}, {cfg['delta']:g})", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    sm = summarize(ml, "test_accuracy")
    labels = sorted({(x["method"], x["config"]) for x in sm})
    width = 0.8 / len(cfg["ml_eps"])
    for k, eps in enumerate(cfg["ml_eps"]):
        vals = []
        for meth, conf in labels:
            x = next(x for x in sm if x["eps"] == eps and x["method"] == meth and x["config"] == conf)
            vals.append(0.0 if math.isnan(x["mean"]) else x["mean"])
        ax.barh(np.arange(len(labels)) + k * width, vals, height=width, label=f"ε = {eps:g}")
    refs = result["movielens_refs"]
    ax.axvline(refs.get("nonprivate_accuracy", math.nan), color="k", ls="--", lw=1, label="non-private")
    ax.axvline(refs["majority_baseline"], color="gray", ls=":", lw=1, label="majority class")
    ax.set_yticks(np.arange(len(labels)) + width * (len(cfg["ml_eps"]) - 1) / 2)
    ax.set_yticklabels([f"{meth}\n{conf}" for meth, conf in labels], fontsize=7)
    ax.set_xlim(0.45, 0.72)
    ax.set_xlabel("test accuracy (0 = undetermined)")
    ax.set_title(f"MovieLens, {refs['users']} users, δ = {refs['delta']:.2g}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller grids, 2 seeds")
    p.add_argument("--out", default=RESULTS, help="output folder (default simulations/results)")
    p.add_argument("--keep-runs", default=None, help="keep the MovieLens run folders (result.json + ledger) here")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    start = time.perf_counter()
    print(
        f"paper 002 comparison ({cfg.tag}): synthetic n={cfg.n}, m in {cfg.m_grid}, (eps, delta) = "
        f"({cfg.eps}, {cfg.delta:g}); MovieLens eps in {cfg.ml_eps}"
    )
    syn = synthetic(cfg)
    ml, refs = movielens(cfg, args.keep_runs)
    result = {"config": asdict(cfg), "synthetic": syn, "movielens": ml, "movielens_refs": refs}
    result["crossover"] = crossover(syn, cfg)
    result["seconds"] = time.perf_counter() - start
    base = os.path.join(args.out, "paper002_sc_compare" + ("_quick" if cfg.tag == "quick" else ""))
    os.makedirs(args.out, exist_ok=True)
    fields = sorted({k for r in syn + ml for k in r})
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(syn + ml)
    with open(base + ".json", "w") as f:
        json.dump(
            {k: v for k, v in result.items() if k not in ("synthetic", "movielens")}
            | {"synthetic_summary": summarize(syn, "excess_risk"), "movielens_summary": summarize(ml, "test_accuracy")},
            f,
            indent=2,
            default=str,
        )
    with open(base + ".md", "w") as f:
        f.write(markdown(result))
    plot(result, base + ".png")
    print(conclusion(result))
    print(f"wrote {base}.{{csv,json,md,png}} ({result['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
