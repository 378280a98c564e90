"""External sweep runner ``paper002-sc-output-pert`` for simulations/studies/paper002_sc_slopes.toml:
SCOutputPert's error at n users with m records each, one (along, n, m, seed) per point, through the
evaluation harness :func:`certified_release` (below): ``fedkl run --algorithm sc-output-pert`` refuses
n > 24 users before reading data, and the theorem's regime starts at n = 64.

Point settings: ``fedkl run``'s ``users`` (n), ``seed`` (the dataset's AND, hashed with the point, the
noise's), ``epsilon``, ``delta`` and ``reg`` (mu); the runner's own ``records`` (m), ``along`` ("n" or
"m": which sweep of the study; it enters the noise seed), ``d``, ``label_noise``, ``delta_scale`` (a)
and ``test_fraction``. Columns: the threshold, the noise scale, the certificate's bound, the solver
error and the exact errors (what simulations/reports/paper002_sc_slopes.py fits and tabulates).

What is measured
----------------
Synthetic least squares with a planted optimum (:func:`fedkl.data.synthetic_least_squares`: IID
users, heterogeneity 0, ||x|| <= 1, d = 10) and the ridge objective
``F(w) = mean_u mean_k 0.5 (<w, x_k> - y_k)^2 + (mu/2)||w||^2`` (mu = ``reg``). Its exact minimizer
theta* is solved in closed form (normal equations with the loader's user weighting, as
:func:`fedkl.data.erm_least_squares`), so the excess EMPIRICAL risk ``F(theta^) - F(theta*)`` =
``0.5 e^T H e`` (e = theta^ - theta*, H the Hessian of F) is exact. For each (n, m) and each seed
(a new dataset AND new noise per seed) we release SCOutputPert (paper 002 Alg. 2 with App. C's
certificate, :mod:`fedkl.algorithms.output_perturbation.exact_output_pert`) at user-level (eps, delta) = (4, 1e-5),
calibration "tight", with the public deletion threshold

    Delta(n, m) = a G / (mu n sqrt(m)),   a = 1   (the note's "optimistic" Delta, §4 Table 4a)

where G is the loss's Lipschitz constant on the ball ||w|| <= G0/mu that holds every user set's
minimizer (G0 >= every user's gradient norm at the center 0): public constants only, as privacy
requires (any public Delta is private; Delta only decides whether the test passes). Theorem 3.1's
Delta_uc has the same n sqrt(m) scaling times sqrt(ln(n sum_s C(n,s)) + ln 1/beta) n/(n-4kappa-1),
a slowly varying factor (its local n-slope on the grid is printed; about -1.2 at n = 64, -1.05 at
n = 1024).

Theory slopes (Thm 3.1 / Thm 4.3): the released value is theta~ + N(0, sigma^2 I) with
sigma ∝ Delta, so ||theta^ - theta*|| ≈ sigma sqrt(d) ∝ sqrt(d)/(n sqrt(m) eps): slope -1 in n and
-1/2 in m; the strongly convex excess risk 0.5 e^T H e ∝ d/(n^2 m): slopes -2 and -1.

The regime the theorem covers, and why these parameters are in it:
* n >= 8 kappa (Cor. 3.7 needs 4 kappa <= n/2): kappa = 8 at (4, 1e-5), so n >= 64 on every point;
* the noise term sigma sqrt(d) dominates every other term of ||theta^ - theta*||: the solver error
  is certified <= tau = Delta/1000 (SCOutputPert's default) and sigma/Delta ≈ 73 here, so noise /
  solver error >= 7e4; there is no statistical term in the EMPIRICAL excess risk (theta* is the
  empirical minimizer); deletions and ⊥ contribute nothing when the test passes with dist = 0,
  which the certificate proves on every run (the script stops if it ever does not);
* IID users (heterogeneity 0): the deletion stability Dbar_{4 kappa} theta* is then
  O~(G/(mu n sqrt(m))) (Thm 3.6 / Cor. 3.7), which is what lets a Delta ∝ 1/(n sqrt(m)) pass. The
  last panel plots the certificate's data-dependent bound U (>= Dbar_{4 kappa} f~(x); Lemma C.1
  re-derived) against Delta: U is MEASURED, not chosen, and shows the 1/(n sqrt m) stability.

How the private output is obtained: SCOutputPert.run refuses n > 24 users before reading data (its
exact fallback enumerates ~2^n user sets), and the theorem's regime starts at n = 64. So every point
here goes through :func:`certified_release`, an EVALUATION HARNESS, not a private mechanism: it runs
SCOutputPert's own solver and certificate and, when the certificate passes, releases through the
production DelOutputPert.release / Releaser.stability_gaussian path (R1 ~ TDLap, then the Gaussian).
On such a dataset the exact mechanism's output law is exactly theta~ + N(0, sigma^2 I) for every R1
(App. C: the certificate proves dist(x) = 0), so the harness samples the SAME law. Where the
certificate fails it stops ("certified-or-abort" is NOT differentially private, note §6.2); its
charges go to an in-memory recorder, never to a privacy ledger.

"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from fedkl.algorithms.output_perturbation.del_output_pert import DelOutputPert, StabilityPlan
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert
from fedkl.data import synthetic_least_squares
from fedkl.data.base import FederatedDataset
from fedkl.experiments import register_runner, runner_result
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import NoiseSource, Releaser
from fedkl.problems import make_problem
from fedkl.problems.base import Problem

NAME = "paper002-sc-output-pert"
CALIBRATION = "tight"
COLUMNS = (
    "d",
    "reg",
    "label_noise",
    "delta_scale",
    "calibration",
    "m_train",
    "kappa",
    "Delta",
    "sigma",
    "certificate_bound",
    "solver_error",
    "tau",
    "param_error",
    "excess_risk",
    "expected_param_error",
    "expected_excess_risk",
    "released",
)


# --- public constants, exact ERM -----------------------------------------------------------------
@dataclass(frozen=True)
class PublicScale:
    """Public constants of a ridge problem with center 0 (none is computed from the data):
    G0 >= every user's gradient norm at 0, B = G0/mu (every user set's minimizer has ||w|| <= B,
    by strong monotonicity: mu ||w*||^2 <= <-grad F(0), w*>), G = Lipschitz constant on ||w|| <= B."""

    G0: float
    B: float
    G: float


def public_scale(problem: Problem, feature_bound: float) -> PublicScale:
    if not problem.reg > 0:
        raise ValueError("public_scale needs a strongly convex (reg > 0) problem")
    g0 = problem.constants(feature_bound, param_bound=1e-12).lipschitz
    b = g0 / problem.reg
    return PublicScale(g0, b, problem.constants(feature_bound, param_bound=b).lipschitz)


def scaled_delta(scale: PublicScale, mu: float, n: int, m: int, a: float) -> float:
    """Delta = a G / (mu n sqrt(m)): a public function of public quantities."""
    return a * scale.G / (mu * n * math.sqrt(m))


def public_train_records(m: int, test_fraction: float) -> int:
    """Train records per user the loaders leave: m - max(round(test_fraction m), 1) (public)."""
    return m - max(int(np.rint(test_fraction * m)), 1)


def ridge_erm(ds: FederatedDataset, reg: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact minimizer and Hessian of ``mean_u mean_k 0.5(<w,x>-y)^2 + (reg/2)||w||^2`` on ``ds.train``."""
    tr = ds.train
    X, y = tr.X.double().numpy(), tr.y.double().numpy()
    counts = tr.counts().double().numpy()
    wts = 1.0 / (tr.num_users * counts[tr.user_index.numpy()])
    H = X.T @ (wts[:, None] * X) + reg * np.eye(X.shape[1])
    theta = np.linalg.solve(H, X.T @ (wts * y))
    return torch.from_numpy(theta), torch.from_numpy(H)


# --- the evaluation harness ----------------------------------------------------------------------
class EvaluationRecorder:
    """Stands in for the ledger inside :func:`certified_release`: records what WOULD be charged.

    The harness is not a DP mechanism (it aborts where the certificate fails), so nothing it does
    may reach a privacy ledger."""

    def __init__(self) -> None:
        self.charges: list[dict] = []

    def charge(self, user_ids, charge, **kw) -> int:
        rho, eps, delta = charge.cost()
        self.charges.append(
            {
                "users": len(user_ids),
                "mechanism": charge.mechanism,
                "rho": rho,
                "eps": eps,
                "delta": delta,
                "sensitivity": charge.sensitivity,
                "noise_scale": charge.noise_scale,
                **kw,
            }
        )
        return len(self.charges)


class Undetermined(RuntimeError):
    """The certificate did not settle the exact test; the exact mechanism's output on this dataset
    cannot be evaluated above SCOutputPert's enumeration limit."""


@dataclass
class CertifiedOutcome:
    theta: torch.Tensor | None  # the released value (None: ⊥, impossible when certified)
    solver_value: torch.Tensor  # f~(x), the exact solver's output (NOT private)
    bound: float  # U + 2 tau, the certificate's bound on Dbar_{4 kappa} f~(x) (NOT private)
    sigma: float


def certified_release(
    alg: SCOutputPert, federation, center: torch.Tensor, releaser: Releaser, label: str
) -> CertifiedOutcome:
    """Sample SCOutputPert's output law on a dataset where App. C's certificate proves dist(x) = 0.

    Mirrors :meth:`SCOutputPert.plan` + :meth:`SCOutputPert.run` without the n <= max_exact_users
    guard: solve f~(x), certify, build the plan the certificate gives, release it through
    :meth:`DelOutputPert.release`. Raises :class:`Undetermined` when the certificate fails (never
    returns ⊥ in its place: "certificate or ⊥" is not DP). EVALUATION ONLY (module docstring).
    """
    if not isinstance(releaser.ledger, EvaluationRecorder):
        raise ValueError(
            "certified_release is an evaluation harness, not a DP mechanism: give it a Releaser over "
            "an EvaluationRecorder, never over a privacy ledger"
        )
    n = federation.num_users
    full = torch.ones(1, n, dtype=torch.bool)
    theta = alg.solve(federation, full, center)[0]
    passed, bound = alg.certify(federation, theta, center)
    if not passed:
        raise Undetermined(f"certificate bound {bound:.4g} > Delta {alg.Delta:.4g} at n={n}")
    plan = StabilityPlan(n, 0, (), theta, "certificate")
    out = DelOutputPert(alg.dop).release(plan, releaser, federation.ids_of(list(range(n))), label)
    return CertifiedOutcome(out, theta, bound, alg.dop.sigma)


def noise_seed(*key) -> int:
    """A fixed noise seed per (sweep, n, m, seed): distinct points never share their Gaussian draws
    (shared draws would make the fitted slopes artificially exact)."""
    digest = hashlib.sha256("\x1f".join(map(str, key)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


# --- one point -----------------------------------------------------------------------------------
def run_point(settings) -> dict:
    n, m, seed, sweep = int(settings.users), int(settings.records), int(settings.seed), settings.along
    d, reg, eps, delta = int(settings.d), float(settings.reg), float(settings.epsilon), float(settings.delta)
    ds = synthetic_least_squares(
        n, m, d, heterogeneity=0.0, noise=settings.label_noise, seed=seed, test_fraction=settings.test_fraction
    )
    m_train = public_train_records(m, settings.test_fraction)
    if not bool((ds.train.counts() == m_train).all()):
        raise RuntimeError("the loader's per-user train count differs from the public formula")
    problem = make_problem("least-squares", ds, reg=reg)
    fed = InProcessFederation(problem, ds)
    scale = public_scale(problem, ds.feature_bound)
    Delta = scaled_delta(scale, reg, n, m_train, settings.delta_scale)
    center = torch.zeros(d, dtype=torch.float64)
    alg = SCOutputPert.for_problem(
        problem, ds.feature_bound, center, eps=eps, delta=delta, Delta=Delta, calibration=CALIBRATION
    )
    theta_star, H = ridge_erm(ds, reg)
    noise = NoiseSource(noise_seed(sweep, n, m, seed))  # independent noise at every point and seed
    outcome = certified_release(
        alg, fed, center, Releaser(EvaluationRecorder(), noise), f"slopes/{sweep}/n{n}/m{m}/s{seed}"
    )
    if outcome.theta is None:
        raise RuntimeError("a certified release returned ⊥: impossible, the harness is broken")
    e = outcome.theta - theta_star
    return {
        "d": d,
        "reg": reg,
        "label_noise": settings.label_noise,
        "delta_scale": settings.delta_scale,
        "calibration": CALIBRATION,
        "m_train": m_train,
        "kappa": alg.dop.kappa,
        "Delta": Delta,
        "sigma": outcome.sigma,
        "certificate_bound": outcome.bound,
        "solver_error": float((outcome.solver_value - theta_star).norm()),
        "tau": alg.tau,
        "param_error": float(e.norm()),
        "excess_risk": float(0.5 * e @ H @ e),
        "expected_param_error": outcome.sigma * math.sqrt(d),
        "expected_excess_risk": 0.5 * outcome.sigma**2 * float(torch.trace(H)),
        "released": True,
    }


def run(settings, log) -> dict:
    torch.set_num_threads(1)
    if settings.along not in ("n", "m") or settings.delta is None or not settings.reg > 0:
        raise ValueError("along must be n or m, delta explicit and reg > 0")
    if settings.dataset != "synthetic-least-squares":
        raise ValueError(f"{NAME} draws synthetic least squares (dataset = 'synthetic-least-squares')")
    row = run_point(settings)
    log(f"SCOutputPert along {settings.along}: n={settings.users} m={settings.records} seed={settings.seed}: {row}")
    return runner_result(
        NAME,
        settings.dataset,
        int(settings.users),
        float(settings.epsilon),
        float(settings.delta),
        settings.seed,
        1,
        row,
    )


register_runner(
    NAME,
    run,
    columns=COLUMNS,
    description=__doc__.splitlines()[0],
    settings={"records": 64, "along": "n", "d": 10, "label_noise": 0.1, "delta_scale": 1.0, "test_fraction": 0.2},
)
