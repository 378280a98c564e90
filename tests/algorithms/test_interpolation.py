"""The server's interpolation check of a client's gradient answers (fedkl/algorithms/output_perturbation/interpolation.py):
an honest client (one fixed mu-strongly convex, L-smooth loss) is never rejected; a non-convex, too steep
or too flat answer set is; the pairwise (co-coercivity) condition is not sufficient; and in the diameter
test a client that mimics a typical user at its own point is caught (issue 28 §2)."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_output_pert import _one_thread  # noqa: F401  (autouse: one torch thread)

from fedkl.algorithms.output_perturbation.diameter_output_pert import DiameterSCOutputPert, DiameterTest
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert
from fedkl.algorithms.output_perturbation.interpolation import answer_scale, interpolable, pairwise_interpolable
from fedkl.data.synthetic import synthetic_least_squares, synthetic_logistic
from fedkl.federation.base import Answers, CertifiedLocalMinimizer, Federation, GradientsAtOwnPoints, GradientsAtPoints
from fedkl.federation.inprocess import InProcessFederation
from fedkl.problems import make_problem

MU, L = 0.5, 2.0


def _scale(X, G0=10.0):
    return answer_scale(X, torch.zeros(X.shape[-1], dtype=torch.float64), G0, L)


def _points(seed: int, n: int, k: int, d: int) -> torch.Tensor:
    """Spread points and a gradient-descent-like cluster (nearby points stress the float slack)."""
    g = torch.Generator().manual_seed(seed)
    far = 3 * torch.randn(n, k // 2, d, generator=g, dtype=torch.float64)
    near = far[:, :1] + 1e-7 * torch.randn(n, k - k // 2, d, generator=g, dtype=torch.float64)
    return torch.cat([far, near], dim=1)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), d=st.integers(1, 4), k=st.integers(2, 12))
def test_honest_strongly_convex_quadratics_always_pass(seed, d, k):
    g = torch.Generator().manual_seed(seed)
    n = 4
    U, _ = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))
    ev = MU + (L - MU) * torch.rand(n, d, generator=g, dtype=torch.float64)
    ev[:, 0], ev[:, -1] = MU, L  # the extreme curvatures, where the conditions are tight
    H = U @ torch.diag_embed(ev) @ U.transpose(1, 2)
    b = torch.randn(n, 1, d, generator=g, dtype=torch.float64)
    X = _points(seed, n, k, d)
    G = X @ H + b
    assert interpolable(X, G, MU, L, _scale(X)).all() and pairwise_interpolable(X, G, MU, L, _scale(X)).all()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), k=st.integers(2, 10))
def test_honest_regularized_logistic_losses_always_pass(seed, k):
    """Real client answers: every user's mean logistic loss + (reg/2)||w||^2, mu = reg, L = R^2/4 + reg."""
    ds = synthetic_logistic(5, 8, 3, seed=seed % 1000)
    prob = make_problem("logistic", ds, reg=0.3)
    fed = InProcessFederation(prob, ds)
    c = prob.constants(ds.feature_bound, param_bound=10.0)
    X = _points(seed, 1, k, prob.num_params)[0]
    G = fed.compute(GradientsAtPoints(X)).values.to(torch.float64)  # (users, k, d)
    Xs = X.unsqueeze(0).expand(G.shape[0], -1, -1)
    scale = answer_scale(Xs, torch.zeros(prob.num_params, dtype=torch.float64), c.lipschitz, c.smoothness)
    assert interpolable(Xs, G, c.strong_convexity, c.smoothness, scale).all()


def test_non_convex_too_steep_and_too_flat_answer_sets_are_caught():
    X = _points(1, 1, 6, 2)
    for curvature in (-1.0, 2 * L, MU / 2):  # concave, steeper than L, flatter than mu
        G = curvature * X
        assert not interpolable(X, G, MU, L, _scale(X)).any()
        assert not pairwise_interpolable(X, G, MU, L, _scale(X)).any()
    assert interpolable(X, 1.0 * X, MU, L, _scale(X)).all()  # within [mu, L]: fine
    nan = X.clone()
    nan[0, 2, 0] = float("nan")
    assert not interpolable(X, nan, MU, L, _scale(X)).any()


def test_the_pairwise_condition_is_not_sufficient():
    """Three points on a quarter grid: every pair is co-coercive, yet the difference constraints of Taylor,
    Hendrickx & Glineur's theorem have a positive 3-cycle (margin 0.29 both ways), so no F_{mu,L} function
    has these gradients."""
    X = torch.tensor([[[-1.25, -0.25], [1.0, 0.25], [-1.0, 2.25]]], dtype=torch.float64)
    G = torch.tensor([[[-1.0, -0.75], [1.0, 0.25], [-1.25, 0.75]]], dtype=torch.float64)
    assert pairwise_interpolable(X, G, MU, L, _scale(X)).all()
    assert not interpolable(X, G, MU, L, _scale(X)).any()
    for pair in ((0, 1), (0, 2), (1, 2)):  # two points: pairwise is exact
        assert interpolable(X[:, pair], G[:, pair], MU, L, _scale(X[:, pair])).all()


# --- in the diameter test --------------------------------------------------------------------------
LIAR, TYPICAL, N = 1, 5, 16


class Mimic(Federation):
    """LIAR holds an outlier's records; it reports TYPICAL's minimizer with residual 0 and, asked at that point,
    answers TYPICAL's gradient there; everywhere else its own gradients (each answer of an in-class loss,
    but not of one loss)."""

    def __init__(self, inner: InProcessFederation) -> None:
        self.inner = inner

    user_ids = property(lambda self: self.inner.user_ids)
    num_params = property(lambda self: self.inner.num_params)

    def compute(self, query, users=None):
        ans = self.inner.compute(query, users)
        v = ans.values.clone()
        if isinstance(query, CertifiedLocalMinimizer):
            v[LIAR] = ans.values[TYPICAL]
            v[LIAR, -1] = 0.0
        elif isinstance(query, GradientsAtOwnPoints):
            point = torch.as_tensor(query.points)[LIAR : LIAR + 1]
            v[LIAR] = self.inner.compute(GradientsAtPoints(point)).values[TYPICAL, 0]
        return Answers(ans.users, v, ans.failed)


def test_a_client_mimicking_a_typical_user_at_its_own_point_is_caught():
    ds = synthetic_least_squares(N, 200, 2, seed=0, noise=0.1)
    tr = ds.train
    X, y = tr.X.clone(), tr.y.clone()
    X[tr.user_index == LIAR] = torch.tensor([1.0, 0.0], dtype=X.dtype)
    y[tr.user_index == LIAR] = ds.extra["label_bound"]
    ds = dataclasses.replace(ds, train=dataclasses.replace(tr, X=X, y=y))
    prob = make_problem("least-squares", ds)
    fed = InProcessFederation(prob, ds)
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    solver = SCOutputPert.for_problem(
        prob, ds.feature_bound, center, eps=8.0, delta=0.1, Delta=0.05, extra_reg=1.0, calibration="tight"
    )
    mech = DiameterSCOutputPert(solver, DiameterTest(test="vertex-cover"))
    honest, diag = mech.plan(fed, center)
    assert LIAR in honest.deleted and diag["interpolation_failed"] == []  # honest: never flagged
    caught, diag = mech.plan(Mimic(fed), center)
    assert LIAR in caught.deleted and diag["interpolation_failed"] == [LIAR]  # the reason saved
    # without the check the mimic passes every other check and stays in the kept set
    mech.in_class = lambda points, grads, c: torch.ones(points.shape[0], dtype=torch.bool)
    kept, _ = mech.plan(Mimic(fed), center)
    assert LIAR not in kept.deleted


def test_an_out_of_class_answer_in_the_solve_is_caught():
    """A client honest at the centre and at its own point, whose answers along the solve are steeper than L:
    the solve's interpolation check flags it and the test is redone without it."""
    ds = synthetic_logistic(N, 40, 2, seed=0)
    prob = make_problem("logistic", ds, reg=0.1)
    fed = InProcessFederation(prob, ds)
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    solver = SCOutputPert.for_problem(
        prob, ds.feature_bound, center, eps=8.0, delta=0.3, Delta=0.5, extra_reg=0.5, calibration="tight"
    )
    mech = DiameterSCOutputPert(solver, DiameterTest(test="vertex-cover"))

    class Steep(Federation):
        user_ids = property(lambda self: fed.user_ids)
        num_params = property(lambda self: fed.num_params)

        def compute(self, query, users=None):
            ans = fed.compute(query, users)
            if type(query) is not GradientsAtPoints or torch.equal(torch.as_tensor(query.points)[0], center):
                return ans
            v = ans.values.clone()
            v[LIAR] = v[LIAR] + 5 * solver.smoothness * (torch.as_tensor(query.points) - center)  # too steep
            return Answers(ans.users, v, ans.failed)

    plain, diag = mech.plan(fed, center)
    assert plain.deleted == () and diag["interpolation_failed"] == []
    plan, diag = mech.plan(Steep(), center)
    assert diag["interpolation_failed"] == [LIAR] and LIAR in plan.deleted


def test_the_certificate_is_only_believed_on_in_class_answers(monkeypatch):
    """SCOutputPert's Lemma C.1 certificate bounds the deletion jumps of in-class answers only: when the full
    solve's and the certificate's answers are not one in-class function's, the exact enumeration decides
    (stubbed here: which path decides is what is checked)."""
    from fedkl.algorithms.output_perturbation import exact_output_pert
    from fedkl.algorithms.output_perturbation.del_output_pert import StabilityPlan

    monkeypatch.setattr(
        exact_output_pert, "exact_stability", lambda f, n, dop: StabilityPlan(n, None, None, None, "exact")
    )

    n = 16
    ds = synthetic_least_squares(n, 200, 2, seed=0, noise=0.1)
    prob = make_problem("least-squares", ds)
    fed = InProcessFederation(prob, ds)
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    release = dict(eps=8.0, delta=0.1, Delta=0.5, extra_reg=1.0, calibration="paper")

    def engine() -> SCOutputPert:
        return SCOutputPert.for_problem(prob, ds.feature_bound, center, **release)

    class Flipped(Federation):  # LIAR's answer at the public centre points the wrong way (same norm)
        user_ids = property(lambda self: fed.user_ids)
        num_params = property(lambda self: fed.num_params)

        def compute(self, query, users=None):
            ans = fed.compute(query, users)
            points = torch.as_tensor(query.points)
            if not (points == center).all(dim=1).any():
                return ans
            v = ans.values.clone()
            v[LIAR, (points == center).all(dim=1)] *= -1
            return Answers(ans.users, v, ans.failed)

    assert engine().plan(fed, center).decided_by == "certificate"
    assert engine().plan(Flipped(), center).decided_by == "exact"
    monkeypatch.setattr(SCOutputPert, "answers_in_class", lambda self, record, c: True)  # the check skipped
    assert engine().plan(Flipped(), center).decided_by == "certificate"
