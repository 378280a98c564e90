"""External sweep runner ``paper002-mean-family`` for simulations/studies/paper002_slopes.toml and
paper002_compare.toml: paper 002's phased algorithms (Alg 3-6), one output perturbation (Alg 2) and
fedkl's noisy clipped-gradient descent on the mean-estimation family, one method on one draw of the
users per point. No ``fedkl run`` dataset or problem is this family (user means drawn exactly from
N(theta_pop, I/m), m up to 1e12), so its points are not ``fedkl run`` runs.

Point settings: ``fedkl run``'s ``users`` (n), ``seed``, ``epsilon``, ``delta`` and, for noisy GD,
``clip`` and ``rounds``; the runner's own ``method`` (one of METHODS), ``records`` (m), ``along`` ("n"
or "m": which sweep of a study the point belongs to) and ``stream`` ("slopes" or "compare": which
study's random streams). The data of (stream, along, n, m, seed) and the noise of (stream, method,
along, n, m, seed) come from fixed hashes (:func:`seed_of`), so every point is reproducible on its own
and the same data serves every method of a (stream, along, n, m, seed). Columns: ``outcome``
(released, ⊥, or refused: the public n is below 4 kappa + 2 for some call, nothing is read), the
exact excess risks, the prediction of the noise recursion, the derived convex bound and the regime
diagnostics (noisy GD: the excess risks only).

Noisy GD is :class:`fedkl.algorithms.gradient.noisy_gd.NoisyGradientDescent` (per-user clipping to C, Gaussian
noise on the sum with replace-one sensitivity 2C, lr = 1 = 1/smoothness, iterates projected onto K),
rho = Budget(eps, delta).rho (the CKS conversion the ledger uses), enforced by a ZCDPFilter. Charges go
to in-memory recorders (the repetitions would exhaust a real ledger); the ledger tests are in
tests/algorithms/test_phased_output_pert.py and tests/algorithms/test_noisy_gd.py.

The family (docs/derivations/paper-002.md §7 T6(a); :mod:`fedkl.problems.quadratic_mean`)
----------------------------------------------------------------
``l(theta; x) = 0.5 ||theta - x||^2`` in d = 4, records ``x ~ N(theta_pop, I)``, user means drawn
exactly from ``N(theta_pop, I/m)`` (so m up to 1e12 costs nothing), theta* = the mean of the user means
(empirical optimum, exact), theta_pop the population optimum. Excess risks are exact:
``L(theta^; x) - L(theta*; x) = 0.5 ||theta^ - theta*||^2`` and ``L(theta^; D) - L(theta_pop; D) =
0.5 ||theta^ - theta_pop||^2``. Public constants: K = B(0, 3) (holds theta_pop, ||theta_pop|| = 1.15),
w0 = 0, D = 3, G = 3 + X with X = 10 a public bound on the record norms (G enters only lambda*/lambda_SCO
and R_i, never a privacy parameter).

Mechanisms: the algorithms are fedkl's :class:`PhasedERM`, :class:`PhasedSCO`, :class:`SCPhasedERM`,
:class:`SCPhasedSCO` with their theorem schedules (T = ceil(ln nm) / floor(log2(n/N0)), lambda* /
lambda_SCO, beta = 1/(nm) or 1/(2n^2 m), ⊥ keeps the centre, centres clipped and projected), at
user-level (eps, delta) = (4, 1e-5), replace-one, calibration "tight" (DelOutputPert's (4 kappa + 1)
Delta recount with the analytic Gaussian, proved in fedkl/algorithms/output_perturbation/del_output_pert.py). Their inner
release is :class:`~fedkl.algorithms.output_perturbation.mean_type_inner.MeanTypeInner`: paper 002's DelOutputPert of the EXACT
phase minimizer with an exact, hereditary and sound test predicate (the diameter of the user means;
proof in that module), which runs at any n; fedkl's SCOutputPert enumeration stops at 20 users. The
threshold is the public rule :func:`~fedkl.algorithms.output_perturbation.mean_type_inner.gaussian_users_rule`
(Delta = 2 s (sqrt d + sqrt(2 ln(n/beta))) / (sqrt(m) mu (n - 4 kappa - 1)): the test passes w.p. 1 - beta
for users drawn from the public model). "Alg 2" is one such release at the full (eps, delta) with no
regularizer (the SCOutputPert step of Alg 5/6 on its own). Charges go to an in-memory recorder (a
real ledger would be exhausted by the repetitions); tests/algorithms/test_phased_output_pert.py checks the
ledger charges of the same code with real ledgers.

The regime the theorems cover (checked per run, column ``theorem_regime``): every call has
n_call >= 8 kappa(eps_call, delta_call) users (Cor 3.7 needs 4 kappa <= n/2; Phased-ERM's kappa' is
~T times kappa: about 200-300 here, so n >= 2000), and the bounds are non-vacuous (n sqrt(m) >> c sqrt(d)).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
from fedkl.algorithms.output_perturbation.mean_type_inner import MeanTypeInner, gaussian_users_rule
from fedkl.algorithms.output_perturbation.phased_common import PhaseCall, kappa, setting_for_problem
from fedkl.algorithms.output_perturbation.phased_erm import PhasedERM, PhasedParams
from fedkl.algorithms.output_perturbation.phased_sco import PhasedSCO
from fedkl.algorithms.output_perturbation.sc_phased import SCPhasedERM, SCPhasedSCO
from fedkl.experiments import register_runner, runner_result
from fedkl.federation.means import MeanFederation
from fedkl.privacy import Budget, NoiseSource, Releaser, ZCDPFilter
from fedkl.problems.quadratic_mean import QuadraticMean, draw_user_means

NAME = "paper002-mean-family"
THETA_POP = (1.0, -0.5, 0.25, 0.0)
ALGORITHMS = ("alg2-output-pert", "phased-erm", "sc-phased-erm", "phased-sco", "sc-phased-sco")
SCO = ("phased-sco", "sc-phased-sco")
METHODS = (*ALGORITHMS, "noisy-gd")
STREAMS = {"slopes": "", "compare": "compare-"}
"""The prefix of a stream's seed keys (paper002_compare drew its own users and noise)."""
COLUMNS = (
    "d",
    "calibration",
    "outcome",
    "phases",
    "bottoms",
    "lam",
    "noise_constant_c",
    "derived_bound",
    "min_users_over_8kappa",
    "theorem_regime",
    "clean",
    "max_kappa",
    "dist_emp",
    "excess_emp",
    "excess_pop",
    "predicted_sq",
)


@dataclass(frozen=True)
class FamilyConfig:
    """The public constants of the family and the privacy target (every point of both studies)."""

    d: int = 4
    s: float = 1.0
    feature_bound: float = 10.0
    radius: float = 3.0
    eps: float = 4.0
    delta: float = 1e-5
    calibration: str = "tight"


class Recorder:
    """Stands in for the ledger: records what each release charges (evaluation only)."""

    def __init__(self) -> None:
        self.charges: list[dict] = []

    def charge(self, user_ids, charge, **kw) -> int:
        _, eps, delta = charge.cost()
        self.charges.append({"users": len(user_ids), "eps": eps, "delta": delta})
        return len(self.charges)


def seed_of(*key) -> int:
    digest = hashlib.sha256("\x1f".join(map(str, key)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


@dataclass
class Family:
    """The public side of the experiment: problem, setting, threshold rule, algorithms."""

    cfg: FamilyConfig

    def __post_init__(self) -> None:
        c = self.cfg
        self.problem = QuadraticMean(c.d)
        self.setting = setting_for_problem(self.problem, c.feature_bound, radius=c.radius)
        self.rule = gaussian_users_rule(c.s, c.d)
        self.inner = MeanTypeInner(base_mu=1.0, calibration=c.calibration)
        self.pop = torch.tensor(THETA_POP[: c.d] + (0.0,) * max(0, c.d - len(THETA_POP)), dtype=torch.float64)

    def params(self, m: int) -> PhasedParams:
        # the equal split: the committed tables' (the default is optimal since issue 13)
        return PhasedParams(p002_records=m, p002_calibration=self.cfg.calibration, p002_phase_split="equal")

    def algorithm(self, name: str, m: int):
        cls = {
            "phased-erm": PhasedERM,
            "sc-phased-erm": SCPhasedERM,
            "phased-sco": PhasedSCO,
            "sc-phased-sco": SCPhasedSCO,
        }[name]
        c = self.cfg  # Phased-SCO's cohort hash: seed 0
        ctx = BuildContext.fresh(eps=c.eps, delta=c.delta, problem=self.problem, feature_bound=c.feature_bound)
        return cls(self.params(m), ctx, setting=self.setting, inner=self.inner, delta_rule=self.rule)

    def output_pert(self, fed: MeanFederation, m: int, noise: NoiseSource) -> dict:
        """Alg 2 alone: one release at (eps, delta), Delta by the rule with beta = 1/(nm), projected onto K."""
        c, n = self.cfg, fed.num_users
        Delta = self.rule(self.setting.lipschitz, 1.0, n, m, kappa(c.eps, c.delta), 1.0 / (n * m))
        start = self.setting.project(torch.zeros(c.d, dtype=torch.float64))
        out = self.inner(fed, Releaser(Recorder(), noise), PhaseCall("alg2", 0, c.eps, c.delta, Delta, 0.0, start))
        w = None if out.theta is None else self.setting.project(out.theta)
        hist = [
            {
                "phase": 0,
                "users": n,
                "eps": c.eps,
                "delta": c.delta,
                "lam": 0.0,
                "sigma": out.sigma,
                "bottom": out.theta is None,
                "clipped": False,
                "projected": w is not None and not torch.equal(w, out.theta),
            }
        ]
        return {"w": w, "history": hist, "phases": 1, "bottoms": int(out.theta is None)}


def predicted_sq_error(name: str, history: list[dict], e0_sq: float, d: int, target: str, m: int) -> float:
    """E||theta^ - target||^2 from the exact noise recursion of the quadratic family (every test at
    dist = 0, nothing clipped or projected): e_i = a_i e_{i-1} + (1 - a_i) zeta_i + xi_i with
    a_i = lam_i/(1 + lam_i), xi_i ~ N(0, sigma_i^2 I), zeta_i the call data's deviation from the target
    (0 for the empirical target with all users; N(0, I/(n_i m)) for the population target)."""
    v = e0_sq
    for h in history:
        a = h["lam"] / (1.0 + h["lam"])
        stat = 0.0 if target == "empirical" else d / (h["users"] * m)
        v = a * a * v + (1 - a) ** 2 * stat + d * h["sigma"] ** 2
    return v


def derived_bound(fam: Family, name: str, n: int, m: int, details: dict | None) -> float:
    """The explicit upper bound on E[excess] that sets lambda (fedkl/algorithms/output_perturbation/phased_common.py),
    for the convex algorithms (the ideal noisy process M' of the proof of Thm 4.1; the last phase's
    G sqrt(d) sigma_T term is added): Phased-ERM (8/sqrt 3) c D G sqrt(d)/(n sqrt m), Phased-SCO
    2 sqrt(2 D^2 G^2 (16 + 8 (T-1) d c^2/n)/(n m)). NaN for the others (their bounds are O~ only)."""
    if name not in ("phased-erm", "phased-sco") or details is None:
        return math.nan
    st, d = fam.setting, fam.cfg.d
    G, D, c, T = st.lipschitz, details["distance_D"], details["noise_constant_c"], details["phases"]
    last = G * math.sqrt(d) * details["schedule"][-1]["sigma"]
    if name == "phased-erm":
        return 8 / math.sqrt(3) * c * D * G * math.sqrt(d) / (n * math.sqrt(m)) + last
    return 2 * math.sqrt(2 * D * D * G * G * (16 + 8 * (T - 1) * d * c * c / n) / (n * m)) + last


def draw(fam: Family, stream: str, sweep: str, n: int, m: int, seed: int) -> MeanFederation:
    c = fam.cfg
    return MeanFederation(
        draw_user_means(n, m, c.d, fam.pop, c.s, seed_of(STREAMS[stream] + "data", sweep, n, m, seed))
    )


def noisy_gd(fam: Family, fed: MeanFederation, key: tuple, clip: float, rounds: int) -> dict:
    """fedkl's noisy GD at (eps, delta) with clip C and T rounds, from w0 = 0: its excess empirical risk (as
    `fedkl run` trains it: no projection; the noisy-gd config's radius went with issue 29)."""
    c = fam.cfg
    rho = Budget(c.eps, c.delta).rho
    gd = NoisyGradientDescent(NoisyGDParams(rounds=rounds, lr=1.0, clip=clip), BuildContext.fresh(rho=rho))
    filt = ZCDPFilter(rho)
    res = gd.run(
        fed, Releaser(Recorder(), NoiseSource(seed_of(*key, clip, rounds)), filt), torch.zeros(c.d, dtype=torch.float64)
    )
    if res.rho_spent > rho * (1 + 1e-9):
        raise RuntimeError("noisy GD overspent its budget")
    e = res.w - fed.means.mean(0)
    return {"outcome": "released", "phases": rounds, "dist_emp": float(e.norm()), "excess_emp": 0.5 * float(e @ e)}


def run_method(fam: Family, name: str, sweep: str, n: int, m: int, seed: int, stream: str = "slopes") -> dict:
    """One algorithm on the users of (stream, sweep, n, m, seed): its excess risks, their predictions and
    its regime."""
    c = fam.cfg
    fed = draw(fam, stream, sweep, n, m, seed)
    theta_star = fed.means.mean(0)
    # paper002_compare named Alg 2 "alg2" in its noise keys
    key_name = "alg2" if stream == "compare" and name == "alg2-output-pert" else name
    noise = NoiseSource(seed_of(STREAMS[stream] + "noise", key_name, sweep, n, m, seed))
    details = None
    if name == "alg2-output-pert":
        out = fam.output_pert(fed, m, noise)
        w, hist, phases, bottoms, lam, const = out["w"], out["history"], 1, out["bottoms"], 0.0, None
    else:
        res = fam.algorithm(name, m).run(fed, Releaser(Recorder(), noise), torch.zeros(c.d, dtype=torch.float64))
        w, hist, phases, bottoms, details = res.w, res.history, res.phases, res.bottoms, res.details
        lam, const = details.get("lam"), details.get("noise_constant_c")
    regime = min(h["users"] / (8 * kappa(h["eps"], h["delta"])) for h in hist)
    row = {
        "outcome": "released" if w is not None else "⊥",
        "phases": phases,
        "bottoms": bottoms,
        "lam": lam,
        "noise_constant_c": const,
        "derived_bound": derived_bound(fam, name, n, m, details),
        "min_users_over_8kappa": regime,
        "theorem_regime": regime >= 1.0,
        "clean": bottoms == 0 and not any(h["clipped"] or h["projected"] for h in hist),
        "max_kappa": max(kappa(h["eps"], h["delta"]) for h in hist),
    }
    if w is None:
        return row | {"dist_emp": math.nan, "excess_emp": math.nan, "excess_pop": math.nan, "predicted_sq": math.nan}
    e = w - theta_star
    row.update(
        dist_emp=float(e.norm()), excess_emp=0.5 * float(e @ e), excess_pop=0.5 * float((w - fam.pop) @ (w - fam.pop))
    )
    if name in SCO:
        row["predicted_sq"] = predicted_sq_error(name, hist, float(fam.pop @ fam.pop), c.d, "population", m)
    elif name == "sc-phased-erm":  # theta0 = theta* + N(0, sigma0^2 I), then the phases
        row["predicted_sq"] = predicted_sq_error(name, hist[1:], c.d * hist[0]["sigma"] ** 2, c.d, "empirical", m)
    elif name == "phased-erm":
        row["predicted_sq"] = predicted_sq_error(name, hist, float(theta_star @ theta_star), c.d, "empirical", m)
    else:
        row["predicted_sq"] = c.d * hist[0]["sigma"] ** 2
    return row


def run(settings, log) -> dict:
    torch.set_num_threads(1)
    if settings.method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {settings.method!r}")
    if settings.along not in ("n", "m") or settings.stream not in STREAMS:
        raise ValueError(f"along must be n or m and stream one of {', '.join(STREAMS)}")
    if settings.delta is None:
        raise ValueError("this family needs an explicit delta")
    fam = Family(FamilyConfig(eps=float(settings.epsilon), delta=float(settings.delta)))
    n, m, seed, stream = int(settings.users), int(settings.records), int(settings.seed), settings.stream
    if settings.method == "noisy-gd":
        key = (STREAMS[stream] + "gd", settings.along, n, m, seed)
        row = noisy_gd(fam, draw(fam, stream, settings.along, n, m, seed), key, settings.clip, int(settings.rounds))
    else:
        try:
            row = run_method(fam, settings.method, settings.along, n, m, seed, stream)
        except ValueError as exc:  # public n below 4 kappa + 2 for some call: refused, nothing read
            if "4 kappa" not in str(exc):
                raise
            row = {"outcome": "refused", "phases": 0}
    log(f"{settings.method} along {settings.along}: n={n} m={m:.0e} seed={settings.seed}: {row}")
    return runner_result(
        NAME,
        settings.dataset,
        n,
        fam.cfg.eps,
        fam.cfg.delta,
        settings.seed,
        row["phases"],
        {"d": fam.cfg.d, "calibration": fam.cfg.calibration, **row},
    )


register_runner(
    NAME,
    run,
    columns=COLUMNS,
    description=__doc__.splitlines()[0],
    settings={"method": "phased-erm", "records": 10**8, "along": "n", "stream": "slopes"},
)
