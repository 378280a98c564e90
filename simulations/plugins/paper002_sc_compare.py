"""External sweep runner ``paper002-sc-compare`` for simulations/studies/paper002_sc_compare.toml: one
method at one configuration and seed, on synthetic least squares or on MovieLens, for the comparison of
user-level output perturbation (SCOutputPert) with noisy clipped-gradient descent at the same user-level
(eps, delta), replace-one, n public.

Methods (the runner's own setting ``method``):

* ``sc-output-pert``: paper 002 Alg. 2 (SCOutputPert, calibration "tight") with the public threshold
  Delta = a G/(mu n sqrt(m_train)) (synthetic) or Delta = a G/(mu n) (MovieLens, whose users hold
  different numbers of records); a = ``delta_scale``. n is far above SCOutputPert.run's exact-fallback
  limit (24 users), so it goes through the evaluation harness ``certified_release`` of
  simulations/plugins/paper002_sc_output_pert.py (SCOutputPert's own solver, certificate and release
  path; exact output law wherever the certificate passes, outcome "undetermined" where it does not;
  charges to an in-memory recorder, never a ledger: NOT a private run).
* ``global-sens-law`` (reference, not a fedkl algorithm): the classic user-level output perturbation
  theta* + N(0, s^2 I), s = analytic Gaussian at (eps, delta) for the replace-one sensitivity
  2G/(mu n) + 2 tau of the (tau-accurate) ridge minimizer; its output LAW is sampled (no release).
* ``noisy-gd`` (synthetic only; on MovieLens the study runs fedkl's own ``noisy-gd`` through
  ``fedkl.runner``): :class:`fedkl.algorithms.gradient.noisy_gd.NoisyGradientDescent` with ``fedkl run``'s
  ``clip`` and ``rounds`` and the public step 1/beta, a real private run: its own PrivacyLedger with
  budget (eps, delta) in a scratch folder, a Releaser with a zCDP filter, a seeded NoiseSource.
* ``nonprivate-ridge`` (MovieLens reference): the accuracy of the ridge minimizer (reg = mu) that
  ``global-sens-law`` perturbs; no release.

The solver tolerance is a public setting of each point: tau = Delta(``tol_delta_scale``)/1000, where
``tol_delta_scale`` is the SMALLEST a of the study's grid (written in the study), so every threshold
of a (setting, m) and the global-sensitivity reference share one solver; sigma and the certificate of
``sc-output-pert`` do not depend on it beyond tau.

Point settings: ``fedkl run``'s ``dataset`` ("synthetic-least-squares" or "movielens"), ``users`` (n,
synthetic), ``seed`` (the data's: synthetic draw or MovieLens split; hashed with the point into the
noise seed), ``epsilon``, ``delta`` (MovieLens: none = 1/n^1.1, fedkl's default), ``reg`` (mu),
``clip``, ``rounds``; the runner's own ``method``, ``records`` (m, synthetic), ``delta_scale``,
``tol_delta_scale``, ``d``, ``label_noise`` and ``test_fraction``.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

import torch

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert
from fedkl.data import load_dataset, synthetic_least_squares
from fedkl.experiments import register_runner, runner_result
from fedkl.experiments.report import load_function
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.mechanisms import GaussianMechanism
from fedkl.problems import make_problem
from fedkl.runner import default_delta

NAME = "paper002-sc-compare"
METHODS = ("sc-output-pert", "global-sens-law", "noisy-gd", "nonprivate-ridge")
COLUMNS = (
    "method",
    "reg",
    "d",
    "outcome",
    "m_train",
    "Delta",
    "tau",
    "sigma",
    "certificate_bound",
    "excess_risk",
    "param_error",
    "test_accuracy",
)


def _harness(name: str):
    """A name of the sc-output-pert plugin (its certified-law harness and public constants), loaded
    by path as fedkl loads plugins."""
    here = os.path.dirname(os.path.abspath(__file__))
    return load_function(os.path.join(here, f"paper002_sc_output_pert.py:{name}"), f"{NAME} plugin")


certified_release = _harness("certified_release")
EvaluationRecorder = _harness("EvaluationRecorder")
Undetermined = _harness("Undetermined")
noise_seed = _harness("noise_seed")
public_scale = _harness("public_scale")
public_train_records = _harness("public_train_records")
ridge_erm = _harness("ridge_erm")
scaled_delta = _harness("scaled_delta")


def _private_noisy_gd(problem, fed, eps: float, delta: float, config: NoisyGDParams, seed: int) -> tuple:
    """A real private noisy-GD run: its own ledger with budget (eps, delta), rho by CKS, zCDP filter
    (in a scratch folder, tmpfs when available: the ledger fsyncs every charge)."""
    folder = tempfile.mkdtemp(prefix="paper002-compare-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        with PrivacyLedger(os.path.join(folder, "ledger.sqlite"), Budget(eps, delta)) as ledger:
            rho = ledger.rho_left(fed.user_ids)
            releaser = Releaser(ledger, NoiseSource(seed), ZCDPFilter(rho))
            alg = NoisyGradientDescent(config, BuildContext.fresh(rho=rho))
            res = alg.run(fed, releaser, torch.zeros(problem.num_params, dtype=torch.float64))
            ledger.verify()
            spent = ledger.summary()["max_user_rho"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if spent > rho * (1 + 1e-9):
        raise RuntimeError(f"noisy GD spent rho {spent} > budget {rho}")
    return res.w, alg.sigma


def _sc_release(problem, ds, fed, center, eps, delta, Delta, tol, seed: int, label: str) -> dict:
    alg = SCOutputPert.for_problem(
        problem, ds.feature_bound, center, eps=eps, delta=delta, Delta=Delta, tol=tol, calibration="tight"
    )
    try:
        out = certified_release(alg, fed, center, Releaser(EvaluationRecorder(), NoiseSource(seed)), label)
    except Undetermined:
        return {"outcome": "undetermined", "w": None, "sigma": alg.dop.sigma, "certificate_bound": math.nan}
    return {"outcome": "certified", "w": out.theta, "sigma": out.sigma, "certificate_bound": out.bound}


def synthetic_point(s) -> dict:
    n, m, seed, d, reg = int(s.users), int(s.records), int(s.seed), int(s.d), float(s.reg)
    eps, delta, a = float(s.epsilon), float(s.delta), float(s.delta_scale)
    ds = synthetic_least_squares(
        n, m, d, heterogeneity=0.0, noise=s.label_noise, seed=seed, test_fraction=s.test_fraction
    )
    m_train = public_train_records(m, s.test_fraction)
    problem = make_problem("least-squares", ds, reg=reg)
    fed = InProcessFederation(problem, ds)
    scale = public_scale(problem, ds.feature_bound)
    theta_star, H = ridge_erm(ds, reg)
    tol = scaled_delta(scale, reg, n, m_train, s.tol_delta_scale) / 1000.0
    out = {"d": d, "m_train": m_train, "tau": tol, "Delta": math.nan, "certificate_bound": math.nan}
    if s.method == "sc-output-pert":
        out["Delta"] = scaled_delta(scale, reg, n, m_train, a)
        rel = _sc_release(
            problem, ds, fed, torch.zeros(d, dtype=torch.float64), eps, delta, out["Delta"], tol,
            noise_seed("sc", m, seed, a), f"compare/sc/m{m}/a{a}/s{seed}",
        )  # fmt: skip
        w = rel.pop("w")
        out.update(rel)
    elif s.method == "global-sens-law":
        sigma = GaussianMechanism.analytic(2 * scale.G / (reg * n) + 2 * tol, eps, delta).sigma
        w = theta_star + NoiseSource(noise_seed("gs", m, seed)).gaussian((d,), sigma)
        out.update(outcome="law", sigma=sigma)
    else:  # noisy-gd, a real private run at the public step 1/beta
        lr = 1.0 / problem.constants(ds.feature_bound, param_bound=scale.B).smoothness
        config = NoisyGDParams(rounds=int(s.rounds), lr=lr, clip=float(s.clip))
        w, sigma = _private_noisy_gd(
            problem, fed, eps, delta, config, noise_seed("gd", m, seed, float(s.clip), int(s.rounds))
        )
        out.update(outcome="private run", sigma=sigma)
    if w is None:
        out.update(excess_risk=math.nan, param_error=math.nan)
    else:
        e = w.to(torch.float64) - theta_star
        out.update(excess_risk=float(0.5 * e @ H @ e), param_error=float(e.norm()))
    return out


def movielens_point(s) -> dict:
    seed, reg, eps, a = int(s.seed), float(s.reg), float(s.epsilon), float(s.delta_scale)
    ds = load_dataset("movielens", split_seed=seed)
    n = ds.train.num_users
    delta = default_delta(n) if s.delta is None else float(s.delta)
    problem = make_problem("logistic", ds, reg=reg)
    fed = InProcessFederation(problem, ds)
    scale = public_scale(problem, ds.feature_bound)
    center = torch.zeros(problem.num_params, dtype=torch.float64)
    tol = s.tol_delta_scale * scale.G / (reg * n) / 1000.0
    out = {"users": n, "delta": delta, "tau": tol, "Delta": math.nan, "certificate_bound": math.nan, "sigma": math.nan}
    if s.method == "sc-output-pert":
        out["Delta"] = a * scale.G / (reg * n)
        rel = _sc_release(
            problem, ds, fed, center, eps, delta, out["Delta"], tol,
            noise_seed("ml-sc", eps, a, seed), f"compare/ml/sc/eps{eps}/b{a}/s{seed}",
        )  # fmt: skip
        w = rel.pop("w")
        out.update(rel)
    else:  # the tau-accurate ridge minimizer: the reference itself, or perturbed by the classic law
        solver = SCOutputPert.for_problem(
            problem, ds.feature_bound, center, eps=eps, delta=delta, Delta=tol * 1000, tol=tol, calibration="paper"
        )
        w = solver.solve(fed, torch.ones(1, n, dtype=torch.bool), center)[0]
        if s.method == "global-sens-law":
            sigma = GaussianMechanism.analytic(2 * scale.G / (reg * n) + 2 * tol, eps, delta).sigma
            w = w + NoiseSource(noise_seed("ml-gs", eps, seed)).gaussian((problem.num_params,), sigma)
            out.update(outcome="law", sigma=sigma)
        else:
            out["outcome"] = "nonprivate"
    out["test_accuracy"] = math.nan if w is None else fed.evaluate(w, "test")["accuracy"]
    return out


def run(settings, log) -> dict:
    torch.set_num_threads(1)
    if settings.method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {settings.method!r}")
    if not settings.reg > 0:
        raise ValueError("reg (mu) must be > 0: the thresholds and the reference are ridge quantities")
    if settings.dataset == "synthetic-least-squares":
        if settings.method == "nonprivate-ridge" or settings.delta is None:
            raise ValueError("synthetic points need an explicit delta and a private method")
        row = synthetic_point(settings)
        users, delta = int(settings.users), float(settings.delta)
    elif settings.dataset == "movielens":
        if settings.method == "noisy-gd":
            raise ValueError("noisy GD on MovieLens is fedkl's own algorithm: algorithm = 'noisy-gd' in the study")
        row = movielens_point(settings)
        users, delta = row.pop("users"), row.pop("delta")
    else:
        raise ValueError(f"{NAME} runs on synthetic-least-squares or movielens, not {settings.dataset!r}")
    row = {
        "method": settings.method,
        "reg": float(settings.reg),
        "d": "",
        "m_train": "",
        "sigma": math.nan,
        "test_accuracy": math.nan,
        **row,
    }
    row.setdefault("excess_risk", math.nan), row.setdefault("param_error", math.nan)
    log(f"{NAME} {settings.dataset} {settings.method} seed={settings.seed}: {row}")
    return runner_result(
        NAME,
        settings.dataset,
        users,
        float(settings.epsilon),
        delta,
        settings.seed,
        int(settings.rounds) if settings.method == "noisy-gd" else 1,
        row,
    )


register_runner(
    NAME,
    run,
    columns=COLUMNS,
    description=__doc__.splitlines()[0],
    settings={
        "method": "sc-output-pert",
        "records": 64,
        "delta_scale": 1.0,
        "tol_delta_scale": 1.0,
        "d": 10,
        "label_noise": 0.1,
        "test_fraction": 0.2,
    },
)
