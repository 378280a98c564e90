"""Privacy of an HONEST user against DISHONEST other clients (issue 13 §1b).

Paper 002's diameter test once took each client's reported local minimizer AND its reported residual
as given. One client that reports a typical minimizer with residual 0, while its gradient answers
(which the solver sums) come from a far-away loss, then stays in the kept set and moves the release
far beyond the sensitivity the noise is calibrated to, between neighbouring datasets that differ in
an honest user. The server now recomputes the residual from the client's gradient at its reported
point (and checks the public bound G0 at the centre), so the liar conflicts with everyone and is
deleted. The checks are EXACT: the released law is an atom at ⊥ plus a Gaussian, whose hockey-stick
divergence has a closed form (tests/algorithms/test_diameter_output_pert.py's ``_hockey_stick``).
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
from test_diameter_output_pert import _hockey_stick
from test_output_pert import _one_thread  # noqa: F401  (autouse: one torch thread)

from fedkl.algorithms.output_perturbation.diameter_output_pert import DiameterSCOutputPert, DiameterTest
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert
from fedkl.data import load_dataset
from fedkl.data.synthetic import synthetic_least_squares
from fedkl.federation.base import (
    Answers,
    CertifiedLocalMinimizer,
    Federation,
    GradientsAtOwnPoints,
    GradientsAtPoints,
)
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy.clients import ANY_CLIENTS, IN_CLASS_CLIENTS
from fedkl.privacy.mechanisms import TruncatedDiscreteLaplace
from fedkl.problems import make_problem
from fedkl.runner import RunConfig, run_training

EPS, DELTA, LAM, DIM, M = 8.0, 0.1, 1.0, 2, 200
HONEST, LIAR, TYPICAL = 0, 1, 5
SHIFT = 20000.0  # the liar's loss is its records' least-squares loss + SHIFT * theta_1: same Hessian (in mu, L)


class LyingClient(Federation):
    """All users honest but LIAR: its gradient answers are those of f_LIAR(theta) + b.theta (a far-away
    loss with the same curvature), while it reports TYPICAL's local minimizer with residual 0."""

    def __init__(self, inner: InProcessFederation, fake_minimizer: torch.Tensor) -> None:
        self.inner, self.fake = inner, fake_minimizer
        self.b = torch.zeros(inner.num_params, dtype=torch.float64)
        self.b[0] = SHIFT

    user_ids = property(lambda self: self.inner.user_ids)
    num_params = property(lambda self: self.inner.num_params)

    def compute(self, query, users=None):
        ans = self.inner.compute(query, users)
        rows = list(range(self.num_users)) if users is None else list(users)
        if LIAR not in rows:
            return ans
        r, v = rows.index(LIAR), ans.values.clone()
        if isinstance(query, CertifiedLocalMinimizer):
            v[r, :-1], v[r, -1] = self.fake, 0.0
        elif isinstance(query, GradientsAtPoints):
            v[r] = v[r] + self.b  # every point
        elif isinstance(query, GradientsAtOwnPoints):
            v[r] = v[r] + self.b
        return Answers(ans.users, v, ans.failed)


class _UncheckedSolver(SCOutputPert):
    """The solver before issue 28: every answer summed as given, the iterates never projected."""

    reach = math.inf

    def answer_bound(self, theta, center):
        return torch.full(theta.shape[:-1], math.inf, dtype=torch.float64)


class TrustingDiameterTest(DiameterSCOutputPert):
    """The OLD behaviour, kept here as the negative control: the reported residual is believed, and the
    solver takes every answer (no in-class bound on the answers, no ball for the iterates)."""

    def __init__(self, solver, test=None):
        fields = {f.name: getattr(solver, f.name) for f in dataclasses.fields(solver) if f.init}
        super().__init__(_UncheckedSolver(**fields), test)

    def checked_local_vectors(self, federation, center):
        t = self.test
        ans = federation.compute(CertifiedLocalMinimizer(center, self.solver.extra_reg, t.local_tol, t.local_max_iter))
        d = federation.num_params
        return ans.values[:, :d], ans.values[:, d] / self.solver.mu, 0


def _federation(n: int, honest_outlier: bool):
    """IID least-squares users; HONEST's records are typical, or (its neighbour) all at x = e1, y = +Y."""
    ds = synthetic_least_squares(n, M, DIM, seed=0, noise=0.1)
    tr = ds.train
    X, y = tr.X.clone(), tr.y.clone()
    if honest_outlier:
        rec = tr.user_index == HONEST
        X[rec] = torch.tensor([1.0] + [0.0] * (DIM - 1), dtype=X.dtype)
        y[rec] = ds.extra["label_bound"]
    ds = dataclasses.replace(ds, train=dataclasses.replace(tr, X=X, y=y))
    prob = make_problem("least-squares", ds)
    fed = InProcessFederation(prob, ds)
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    fake = fed.compute(CertifiedLocalMinimizer(center, LAM)).values[TYPICAL, :-1]
    return LyingClient(fed, fake), prob, ds


def _release_law(plan, pmf):
    if plan.dist is None:
        return 1.0, 0.0, None
    p_pass = float(sum(pmf[r] for r in range(plan.dist, len(pmf))))
    return 1.0 - p_pass, p_pass, plan.value.numpy()


def _audit(cls, n: int, test: str, Delta: float):
    """(hockey-stick divergence, both directions' max; release move / sensitivity; the two plans)."""
    fx, prob, ds = _federation(n, False)
    fy, _, _ = _federation(n, True)
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    solver = SCOutputPert.for_problem(
        prob, ds.feature_bound, center, eps=EPS, delta=DELTA, Delta=Delta, extra_reg=LAM, calibration="tight"
    )
    mech = cls(solver, DiameterTest(test=test))
    dop = mech.dop(n)
    px, _ = mech.plan(fx, center)
    py, _ = mech.plan(fy, center)
    pmf = TruncatedDiscreteLaplace(dop.eps_bar, dop.delta_bar).pmf()
    A, B = _release_law(px, pmf), _release_law(py, pmf)
    hs = max(_hockey_stick(*A, *B, dop.sigma, EPS), _hockey_stick(*B, *A, dop.sigma, EPS))
    move = np.linalg.norm(A[2] - B[2]) / dop.sensitivity if A[2] is not None and B[2] is not None else 0.0
    return hs, move, px, py


@pytest.mark.parametrize("n,test", [(16, "vertex-cover"), (30, "matching")])
def test_a_lying_client_cannot_break_an_honest_users_guarantee(n, test):
    # negative control: believing the report, the liar is kept on both sides and the release moves far beyond
    # the sensitivity between the honest user's neighbours: delta is broken by orders of magnitude
    hs_old, move_old, px, py = _audit(TrustingDiameterTest, n, test, 0.05)
    assert LIAR not in (px.deleted or ()) and LIAR not in (py.deleted or ())
    assert move_old > 10 and hs_old > 5 * DELTA
    # the fix: the residual is recomputed from the liar's own gradients, so it conflicts and is deleted
    hs, move, px, py = _audit(DiameterSCOutputPert, n, test, 0.05)
    assert LIAR in px.deleted and LIAR in py.deleted
    assert hs <= DELTA * (1 + 1e-9) and move <= 1.0


def _honest(n=16):
    ds = synthetic_least_squares(n, M, DIM, seed=0, noise=0.1)
    prob = make_problem("least-squares", ds)
    return InProcessFederation(prob, ds), prob, ds


def test_the_reported_residual_is_recomputed_not_believed():
    fed, prob, ds = _honest()
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    solver = SCOutputPert.for_problem(
        prob, ds.feature_bound, center, eps=EPS, delta=DELTA, Delta=0.05, extra_reg=LAM, calibration="paper"
    )
    mech = DiameterSCOutputPert(solver)
    V, err, understated = mech.checked_local_vectors(fed, center)
    assert understated == 0  # honest clients' reports agree with the server's recomputation
    reported = fed.compute(CertifiedLocalMinimizer(center, LAM)).values[:, -1] / solver.mu
    assert torch.allclose(err, reported, rtol=1e-6, atol=1e-15)
    # a client that reports someone else's minimizer with residual 0 gets the residual its gradients imply
    liar = LyingClient(fed, V[TYPICAL])
    liar.b.zero_()  # its gradients are its own records' (in the class): only the report lies
    V2, err2, understated2 = mech.checked_local_vectors(liar, center)
    g = fed.compute(GradientsAtOwnPoints(V2)).values[LIAR] + LAM * (V2[LIAR] - center)
    assert torch.equal(V2[LIAR], V[TYPICAL]) and understated2 == 1
    assert float(err2[LIAR]) == pytest.approx(float(g.norm()) / solver.mu) and float(err2[LIAR]) > 0


def test_a_gradient_that_breaks_the_public_G0_conflicts_with_everyone():
    fed, prob, ds = _honest()
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    solver = SCOutputPert.for_problem(
        prob, ds.feature_bound, center, eps=EPS, delta=DELTA, Delta=0.05, extra_reg=LAM, calibration="paper"
    )
    liar = LyingClient(fed, torch.zeros(prob.num_params, dtype=torch.float64))
    liar.b[0] = 2 * solver.start_grad_bound  # ||grad f_u(c)|| > G0: no record within the bounds does that
    mech = DiameterSCOutputPert(solver)
    _, err, _ = mech.checked_local_vectors(liar, center)
    assert math.isinf(float(err[LIAR])) and torch.isfinite(torch.cat([err[:LIAR], err[LIAR + 1 :]])).all()
    edges = mech.conflict_edges(*mech.local_vectors(liar, center), mech.rho(16))
    assert {w for e in edges if LIAR in e for w in e} == set(range(16))


def test_the_certificate_norms_are_computed_from_gradients_by_the_server():
    """SCOutputPert's Lemma C.1 certificate: gamma is the server's norm of each user's gradient at theta~
    (the solver's oracle), so a client has no norm to under-report."""
    fed, prob, ds = _honest(16)
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    alg = SCOutputPert.for_problem(
        prob, ds.feature_bound, center, eps=EPS, delta=DELTA, Delta=0.5, extra_reg=LAM, calibration="paper"
    )
    theta = alg.solve(fed, torch.ones(1, 16, dtype=torch.bool), center)[0]
    passed, bound = alg.certify(fed, theta, center)
    g = fed.compute(GradientsAtPoints(theta.unsqueeze(0))).values[:, 0] + LAM * (theta - center)
    gamma = float(g.norm(dim=1).max()) + alg.beta * alg.tau
    assert passed and bound == pytest.approx(alg.certificate_bound(16, gamma) + 2 * alg.tau, rel=1e-12)
    # one client whose gradient at theta~ is far from the others' makes the certificate fail (the exact
    # enumeration then decides): there is no reported norm it could shrink instead
    liar = LyingClient(fed, torch.zeros(prob.num_params, dtype=torch.float64))
    assert not alg.certify(liar, theta, center)[0]


@pytest.mark.parametrize("bad", ["feature", "binary-label", "nan-label", "label-bound"])
def test_records_outside_the_declared_bounds_are_refused_where_data_enters(bad):
    ds = load_dataset(
        "synthetic-least-squares" if bad in ("nan-label", "label-bound") else "synthetic-logistic",
        n_users=5,
        m=4,
        d=3,
        seed=0,
    )
    tr = ds.train
    X, y = tr.X.clone(), tr.y.clone()
    if bad == "feature":
        X[2] = X[2] * 0 + 1.0  # ||x|| = sqrt(3) > 1
    elif bad == "binary-label":
        y[0] = 0.5
    elif bad == "nan-label":
        y[0] = float("nan")
    else:
        y[0] = 2 * ds.extra["label_bound"]
    with pytest.raises(ValueError, match="feature_bound|labels|label_bound"):
        dataclasses.replace(ds, train=dataclasses.replace(tr, X=X, y=y))


def test_every_algorithm_declares_what_it_assumes_of_clients(tmp_path):
    from fedkl.algorithms.gradient import dp_adaptive, dp_fedavg, noisy_gd
    from fedkl.algorithms.kl import kl_adaptive_gd, kl_spider, prox_point
    from fedkl.algorithms.localization import fkt_phased, fkt_reduction, fkt_snowball
    from fedkl.algorithms.output_perturbation import mean_output_pert, phased_erm, sc_phased

    classes = [
        noisy_gd.NoisyGradientDescent,
        dp_adaptive.AdaptiveDP,
        dp_fedavg.DPFedAvg,
        kl_adaptive_gd.AdaptiveKLGD,
        kl_spider.KLSpider,
        prox_point.PrivateProxPoint,
        mean_output_pert.LocalMeanOutputPert,
        mean_output_pert.PhasedMeanOutputPert,
        fkt_snowball.SnowballSGD,
        fkt_phased.PhasedSGD,
        fkt_reduction.SCReduction,
        SCOutputPert,
        DiameterSCOutputPert,
        phased_erm.PhasedERM,
        sc_phased.SCPhasedERM,
    ]
    assert all(c.guarantee.clients in (ANY_CLIENTS, IN_CLASS_CLIENTS) for c in classes)
    # the proofs that use every user's convexity/smoothness declare it; the clipped sums do not need it
    assert noisy_gd.NoisyGradientDescent.guarantee.clients == ANY_CLIENTS
    assert DiameterSCOutputPert.guarantee.clients == fkt_snowball.SnowballSGD.guarantee.clients == IN_CLASS_CLIENTS
    res = run_training(
        RunConfig.from_settings(
            dataset="synthetic-logistic", users=30, rounds=2, reference=False, noise_seed=1, out=str(tmp_path / "r")
        ),
        log=lambda _: None,
    )
    assert res["clients_assumed"] == ANY_CLIENTS.describe()
