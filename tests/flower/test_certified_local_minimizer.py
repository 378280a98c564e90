"""The certified local-minimizer query (:class:`CertifiedLocalMinimizer`): per user ``[v_u, r_u]`` with
``v_u ~ argmin F_u``, ``F_u(v) = f_u(v) + (s/2)||v - c||^2`` and ``r_u = ||grad F_u(v_u)||``.

What is checked, against independent computations (never against the code under test):

* accuracy of the batched Newton solver (binary logistic, least squares) and of the L-BFGS fallback
  (softmax, smoothed hinge): the residual column is the true gradient norm of ``F_u`` at the returned
  point, and the returned point is within the certified radius of a reference minimizer;
* honesty of the certificate when the solver is stopped early (``max_iter`` 1 or 2):
  ``||v_u - v*_u|| <= r_u / (reg + s)`` (``F_u`` is ``(reg + s)``-strongly convex);
* batch invariance: a user's row is bit for bit the same whoever else is asked, and the same as the
  user computing alone (what a Flower client does);
* the wire format (strength 0 accepted only for the certified kind, ``(d + 1,)`` answers) and the
  Flower backend (bitwise equal to in-process; bad strengths refused on the server).

Tolerances (float64, eps = 2.2e-16):
* ``RECOMPUTE_ATOL = 1e-12``: the residual column and our recomputation of ``||grad F_u(v_u)||`` are the
  same mathematical quantity evaluated by two float64 code paths (the solver's own gradient vs the
  problem's ``per_user_gradients``); both round O(1) terms (|x| <= 1, d <= 10, s <= 100) so they differ by
  at most ~100 * d * eps ~ 1e-13 absolute; 1e-12 leaves a margin and is still 100x below the query tol.
* ``CERT_SLACK = 1e-12``: the certificate ``||v - v*|| <= (r + r*) / mu`` is exact in real arithmetic
  (triangle inequality with the reference's own certificate ``r*``); the only slack is the rounding of the
  two norms (~1e-15) divided by mu >= 0.1.
* The reference minimizer ``v*`` is a damped Newton iteration written here (finite-difference Hessian of the
  problem's own ``per_user_gradients``, which affects only the convergence rate, never the fixed point),
  run until ``||grad F_u|| <= 1e-13``; its residual ``r*`` is used in the bounds, so no accuracy is assumed.
"""

from __future__ import annotations

import os

for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"), ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_k, _v)  # as tests/flower/test_flower.py, before flwr is imported

import dataclasses  # noqa: E402
import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from flwr.app import Array, Message  # noqa: E402

# helpers of the Flower tests (same directory, which pytest makes importable)
from test_flower import D, N, PerUserReference, _client_reply, _error_code, _flower, _inprocess, _request  # noqa: E402,E501

from fedkl.data import load_dataset  # noqa: E402
from fedkl.federation.base import CertifiedLocalMinimizer, LocalRegularizedMinimizer, local_strength_ok  # noqa: E402
from fedkl.federation.inprocess import InProcessFederation  # noqa: E402
from fedkl.flower import codec, localgrid  # noqa: E402
from fedkl.problems import make_problem  # noqa: E402

KIND = "certified_local_minimizer"
TOL = 1e-10  # the query's default tol, asserted explicitly below
RECOMPUTE_ATOL = 1e-12  # see the module docstring
CERT_SLACK = 1e-12  # see the module docstring

# (reg, strength): strength 0 only with a strongly convex f_u (reg > 0)
SETTINGS = [(0.0, 0.5), (0.0, 100.0), (0.1, 0.0), (0.1, 0.5), (0.1, 100.0)]
GLM = [("synthetic-logistic", "logistic"), ("synthetic-least-squares", "least-squares")]


# --- helpers --------------------------------------------------------------------------------------
def _fed(
    dataset: str, problem: str, reg: float, *, n_users: int = 8, m: int = 12, d: int = 5, seed: int = 4
) -> InProcessFederation:
    ds = load_dataset(dataset, n_users=n_users, m=m, d=d, seed=seed)
    return InProcessFederation(make_problem(problem, ds, reg=reg), ds)


def _center(p: int, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(p, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _user(fed: InProcessFederation, u: int):
    return fed.dataset.train.subset([u])


def _grad_F(fed, u, v, center, s) -> torch.Tensor:
    """grad F_u(v) from the problem's own per-user gradient on user u's records only."""
    return fed.problem.per_user_gradients(v, _user(fed, u))[0] + s * (v - center)


def _reference_minimizer(fed, u, center, s, gtol=1e-13, iters=100):
    """argmin F_u by damped Newton with a central-difference Hessian of the problem's gradient
    (independent of the code under test). Returns (v*, ||grad F_u(v*)||)."""
    problem, data = fed.problem, _user(fed, u)
    P = problem.num_params

    def F(v):
        return float(problem.per_user_losses(v, data)[0]) + 0.5 * s * float((v - center) @ (v - center))

    v = center.clone()
    g = _grad_F(fed, u, v, center, s)
    eye = torch.eye(P, dtype=torch.float64)
    for _ in range(iters):
        if float(g.norm()) <= gtol:
            break
        h = 1e-6
        H = torch.stack(
            [(_grad_F(fed, u, v + h * e, center, s) - _grad_F(fed, u, v - h * e, center, s)) / (2 * h) for e in eye]
        )
        p = -torch.linalg.solve(0.5 * (H + H.T), g)
        f0, slope, t = F(v), float(g @ p), 1.0
        while t > 1e-12:
            trial = v + t * p
            gt = _grad_F(fed, u, trial, center, s)
            # Armijo, or (near the optimum, where F's rounding hides the decrease) a smaller gradient
            if F(trial) <= f0 + 1e-4 * t * slope or float(gt.norm()) < float(g.norm()):
                break
            t *= 0.5
        v, g = trial, gt
    return v, float(g.norm())


def _check_rows(fed, users, values, center, s):
    """Every row: residual column == recomputed ||grad F_u||, and v within the certified radius of v*."""
    P, mu = fed.num_params, fed.problem.reg + s
    assert values.shape == (len(users), P + 1) and values.dtype == torch.float64
    for row, u in enumerate(users):
        v, r = values[row, :P], float(values[row, P])
        assert math.isfinite(r) and r >= 0
        assert abs(r - float(_grad_F(fed, u, v, center, s).norm())) <= RECOMPUTE_ATOL, (u, r)
        v_star, r_star = _reference_minimizer(fed, u, center, s)
        assert r_star <= 1e-12, (u, r_star)  # the reference itself converged
        dist = float((v - v_star).norm())
        assert dist <= (r + r_star) / mu + CERT_SLACK, (u, dist, r / mu)


# --- 1. accuracy of the batched Newton answer ------------------------------------------------------
@pytest.mark.parametrize("reg,s", SETTINGS)
@pytest.mark.parametrize("dataset,problem", GLM, ids=["logistic", "least-squares"])
def test_newton_answer_is_accurate_and_its_residual_is_the_true_gradient_norm(dataset, problem, reg, s):
    fed = _fed(dataset, problem, reg)
    center = _center(fed.num_params)
    q = CertifiedLocalMinimizer(center, s)
    assert q.tol == TOL
    ans = fed.compute(q)
    assert ans.users == list(range(fed.num_users)) and ans.failed == []
    P = fed.num_params
    assert ans.values.shape == (fed.num_users, P + 1)
    assert (ans.values[:, P] <= TOL).all(), ans.values[:, P]  # converged to the query tol
    _check_rows(fed, ans.users, ans.values, center, s)
    if s > 0:  # and agrees with the plain (L-BFGS) kind, within both answers' certified radii
        plain = fed.compute(LocalRegularizedMinimizer(center, s)).values
        assert plain.shape == (fed.num_users, P)
        assert (ans.values[:, :P] - plain).abs().max() <= 1e-6
        for u in range(fed.num_users):
            r_plain = float(_grad_F(fed, u, plain[u], center, s).norm())
            gap = float((ans.values[u, :P] - plain[u]).norm())
            assert gap <= (float(ans.values[u, P]) + r_plain) / (reg + s) + CERT_SLACK


def test_strength_zero_only_for_the_certified_kind():
    c = torch.zeros(3, dtype=torch.float64)
    assert local_strength_ok(CertifiedLocalMinimizer(c, 0.0)) and local_strength_ok(CertifiedLocalMinimizer(c, 2))
    assert not local_strength_ok(LocalRegularizedMinimizer(c, 0.0))
    for bad in (-1.0, -0.0 - 1e-300, math.nan, math.inf, -math.inf):
        assert not local_strength_ok(CertifiedLocalMinimizer(c, bad)), bad
        assert not local_strength_ok(LocalRegularizedMinimizer(c, bad)), bad
    fed = _fed("synthetic-logistic", "logistic", 0.1)
    w = torch.zeros(fed.num_params, dtype=torch.float64)
    with pytest.raises(ValueError):
        fed.compute(LocalRegularizedMinimizer(w, 0.0))
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            fed.compute(CertifiedLocalMinimizer(w, bad))
    assert fed.compute(CertifiedLocalMinimizer(w, 0.0)).values.shape == (fed.num_users, fed.num_params + 1)


# --- 2. the certificate is honest when the solver is stopped early ---------------------------------
# (strength 100: F_u is nearly quadratic and 2 Newton steps already reach 1e-13, so only 1 step there)
EARLY = [(reg, s, it) for reg, s in SETTINGS for it in (1, 2) if not (s == 100.0 and it == 2)]


@pytest.mark.parametrize("reg,s,max_iter", EARLY)
def test_early_stopped_logistic_certificate_is_honest(reg, s, max_iter):
    fed = _fed("synthetic-logistic", "logistic", reg)
    center = _center(fed.num_params, seed=2, scale=2.0)
    early = fed.compute(CertifiedLocalMinimizer(center, s, max_iter=max_iter)).values
    full = fed.compute(CertifiedLocalMinimizer(center, s)).values
    P = fed.num_params
    # the solver really was stopped before the tol (else this test would not test anything)
    assert float(early[:, P].max()) > TOL
    assert float(early[:, P].max()) > float(full[:, P].max())
    _check_rows(fed, list(range(fed.num_users)), early, center, s)


def test_least_squares_one_newton_step_is_exact():
    """F_u is quadratic: the first (full, t = 1) Newton step is the minimizer up to rounding."""
    fed = _fed("synthetic-least-squares", "least-squares", 0.1)
    center = _center(fed.num_params, seed=2, scale=3.0)
    one = fed.compute(CertifiedLocalMinimizer(center, 0.5, max_iter=1)).values
    assert (one[:, -1] <= 1e-12).all(), one[:, -1]
    _check_rows(fed, list(range(fed.num_users)), one, center, 0.5)


# --- 3. batch invariance ---------------------------------------------------------------------------
BATCH_CASES = [
    ("synthetic-logistic", "logistic", 0.1, 0.5, {}, 500),
    ("synthetic-logistic", "logistic", 0.1, 0.0, {}, 500),
    ("synthetic-logistic", "logistic", 0.0, 100.0, {}, 2),  # early-stopped rows too
    ("synthetic-least-squares", "least-squares", 0.0, 0.5, {}, 500),
    # d = 150: the Hessian is accumulated in chunks of (1 << 22) // d^2 = 186 records, so a user's
    # records fall in different chunks depending on who else is asked (user 3, records 144..191 of the
    # full call, straddles the first chunk boundary; alone, or first in a subset, it does not)
    ("synthetic-logistic", "logistic", 0.1, 0.5, {"n_users": 4, "m": 60, "d": 150}, 500),
]


@pytest.mark.parametrize(
    "dataset,problem,reg,s,size,max_iter",
    BATCH_CASES,
    ids=["logistic", "logistic-s0", "logistic-early", "least-squares", "logistic-d150"],
)
def test_rows_are_bitwise_independent_of_the_batch(dataset, problem, reg, s, size, max_iter):
    fed = _fed(dataset, problem, reg, **size)
    n, P = fed.num_users, fed.num_params
    q = CertifiedLocalMinimizer(_center(P, seed=3), s, max_iter=max_iter)
    full = fed.compute(q).values
    assert full.shape == (n, P + 1) and torch.isfinite(full).all()
    if P == 150:  # the chunk boundary really falls inside user 3's records
        counts = fed.dataset.train.counts()
        assert int(counts[:3].sum()) < (1 << 22) // P**2 < int(counts[:4].sum())
    for u in range(n):  # asked alone, in the same federation
        assert torch.equal(fed.compute(q, [u]).values[0], full[u]), u
    for users in ([7, 2, 5, 0], [0, 5, 2, 7], [n - 1, 1]) if n >= 8 else ([3, 1, 0], [2, 3], [1, 0]):
        assert torch.equal(fed.compute(q, users).values, full[users]), users
    # a federation holding only that user's records (exactly what a Flower client runs)
    ds = fed.dataset
    for u in (0, n - 1):
        one = InProcessFederation(
            fed.problem, dataclasses.replace(ds, train=ds.train.subset([u]), test=ds.test.subset([u]))
        )
        assert torch.equal(one.compute(q, [0]).values[0], full[u]), u


# --- 4. wire format --------------------------------------------------------------------------------
def _reply(kind: str, value) -> Message:
    req = Message(
        codec.encode_request(CertifiedLocalMinimizer(torch.zeros(D, dtype=torch.float64), 0.0)),
        1,
        codec.MESSAGE_TYPE,
        group_id="t",
    )
    return Message(codec.encode_answer(kind, value), reply_to=req)


@pytest.mark.parametrize("strength", [0.0, 0.5, 100.0])
def test_codec_round_trips_certified_requests(strength):
    center = _center(D, seed=5)
    q = CertifiedLocalMinimizer(center, strength, 1e-9, 7)
    assert codec.kind_of(q) == KIND
    content = codec.encode_request(q)
    assert content["fedkl"]["kind"] == KIND
    back = codec.decode_request(content, D)
    assert type(back) is CertifiedLocalMinimizer
    assert torch.equal(back.center, center)
    assert (back.strength, back.tol, back.max_iter) == (strength, 1e-9, 7)
    # the plain kind keeps its own kind on the wire (not decoded as the certified one)
    plain = codec.decode_request(codec.encode_request(LocalRegularizedMinimizer(center, 0.5)), D)
    assert type(plain) is LocalRegularizedMinimizer


def _minimizer_request(kind, strength, tol=1e-10, max_iter=50):
    return _request(
        kind=kind,
        scalars={"strength": strength, "tol": tol, "max_iter": max_iter},
        tensors={"center": Array(np.zeros(D))},
    )


@pytest.mark.parametrize(
    "kind,strength,tol,max_iter",
    [
        ("local_minimizer", 0.0, 1e-10, 50),  # strength 0 only for the certified kind
        ("local_minimizer", -1.0, 1e-10, 50),
        (KIND, -1.0, 1e-10, 50),
        (KIND, -1e-300, 1e-10, 50),
        (KIND, math.nan, 1e-10, 50),
        (KIND, math.inf, 1e-10, 50),
        (KIND, 0.0, 0.0, 50),  # tol must be > 0
        (KIND, 0.0, 1e-10, 0),  # max_iter in [1, 100000]
        (KIND, 0.0, 1e-10, 100_001),
    ],
    ids=["plain-s0", "plain-neg", "neg", "tiny-neg", "nan", "inf", "tol0", "iter0", "iter-big"],
)
def test_codec_refuses_bad_minimizer_requests(kind, strength, tol, max_iter):
    with pytest.raises(codec.CodecError):
        codec.decode_request(_minimizer_request(kind, strength, tol, max_iter), D)
    # ... and a ClientApp answers it with an error reply, not an exception
    assert _error_code(_client_reply(_minimizer_request(kind, strength, tol, max_iter))) == codec.ERR_BAD_REQUEST


def test_codec_answers_are_d_plus_one_and_strict():
    center = torch.zeros(D, dtype=torch.float64)
    certified, plain = CertifiedLocalMinimizer(center, 0.0), LocalRegularizedMinimizer(center, 1.0)
    assert codec.answer_shape(certified, D) == (D + 1,)
    assert codec.answer_shape(plain, D) == (D,)
    v = torch.cat([_center(D, seed=6), torch.tensor([3.5e-11], dtype=torch.float64)])
    got = codec.decode_answer(_reply(KIND, v), certified, D)
    assert got.shape == (D + 1,) and torch.equal(got, v)
    for wrong in (v[:D], torch.cat([v, v[:1]]), v[:1]):  # the plain length, one too many, a scalar
        with pytest.raises(codec.CodecError):
            codec.decode_answer(_reply(KIND, wrong), certified, D)
    bad = v.clone()
    bad[D] = math.nan  # a NaN residual is not an answer
    with pytest.raises(codec.CodecError):
        codec.decode_answer(_reply(KIND, bad), certified, D)
    with pytest.raises(codec.CodecError):  # a certified reply does not answer a plain request
        codec.decode_answer(_reply(KIND, v), plain, D)


# --- 5. Flower -------------------------------------------------------------------------------------
def _spec(dataset, problem, reg=0.1):
    return codec.ClientSpec.build(dataset, problem, {"n_users": N, "m": 12, "d": D, "seed": 4}, {"reg": reg})


@pytest.mark.parametrize("dataset,problem", GLM, ids=["logistic", "least-squares"])
@pytest.mark.flower
def test_flower_equals_inprocess_bitwise(dataset, problem):
    spec = _spec(dataset, problem)
    fed, grid = _flower(spec)
    ref, per_user = _inprocess(spec), PerUserReference(spec)
    center = _center(D, seed=7, scale=2.0)
    queries = [
        CertifiedLocalMinimizer(center, 0.0),
        CertifiedLocalMinimizer(center, 0.5),
        CertifiedLocalMinimizer(center, 100.0, max_iter=1),
    ]
    for q in queries:
        for users in ([5, 0, 11, 3], None):
            a, b, p = fed.compute(q, users), ref.compute(q, users), per_user.compute(q, users)
            n = N if users is None else len(users)
            assert a.values.shape == (n, D + 1) and a.values.dtype == torch.float64
            assert a.users == b.users and a.failed == b.failed == [] and fed.last_errors == {}
            assert torch.equal(a.values, b.values) and torch.equal(a.values, p.values), q
    assert any(kind == codec.MESSAGE_TYPE for _, kind in grid.calls)


@pytest.mark.flower
def test_flower_refuses_bad_strengths_before_sending():
    fed, grid = _flower(_spec("synthetic-logistic", "logistic"))
    w = torch.zeros(D, dtype=torch.float64)
    before = len(grid.calls)
    for q in (
        CertifiedLocalMinimizer(w, -1.0),
        CertifiedLocalMinimizer(w, math.nan),
        CertifiedLocalMinimizer(w, math.inf),
        LocalRegularizedMinimizer(w, 0.0),
        CertifiedLocalMinimizer(torch.zeros(D + 1, dtype=torch.float64), 0.5),
        CertifiedLocalMinimizer(torch.full((D,), math.nan, dtype=torch.float64), 0.5),
    ):
        with pytest.raises(ValueError):
            fed.compute(q)
    assert len(grid.calls) == before  # nothing was sent
    assert fed.compute(CertifiedLocalMinimizer(w, 0.0), [1]).failed == []
    assert len(grid.calls) == before + 1


@pytest.mark.flower
def test_flower_user_with_a_plain_length_answer_fails_and_contributes_zero():
    spec = _spec("synthetic-logistic", "logistic")
    fed, _ = _flower(spec, faults={2: localgrid.wrong_shape(-1), 9: localgrid.nan_reply()})
    q = CertifiedLocalMinimizer(_center(D, seed=8), 0.5)
    a, b = fed.compute(q), _inprocess(spec).compute(q)
    assert a.failed == [2, 9] and set(fed.last_errors) == {2, 9}
    assert torch.equal(a.values[[2, 9]], torch.zeros(2, D + 1, dtype=torch.float64))
    good = [u for u in range(N) if u not in (2, 9)]
    assert torch.equal(a.values[good], b.values[good])


def test_client_answers_strength_zero_certified_request_like_inprocess():
    spec = _spec("synthetic-least-squares", "least-squares")
    q = CertifiedLocalMinimizer(_center(D, seed=9), 0.0, 1e-10, 30)
    got = codec.decode_answer(_client_reply(codec.encode_request(q), spec=spec, pid=6), q, D)
    assert got.shape == (D + 1,)
    assert torch.equal(got, _inprocess(spec).compute(q, [6]).values[0])


@pytest.mark.parametrize("tol,max_iter", [(0.0, 50), (math.nan, 50), (1e-10, 0)], ids=["tol0", "tol-nan", "iter0"])
def test_backends_agree_on_bad_tol_or_max_iter(tol, max_iter):
    spec = _spec("synthetic-logistic", "logistic")
    fed, _ = _flower(spec)
    q = CertifiedLocalMinimizer(_center(D, seed=10), 0.5, tol, max_iter)
    results = []
    for backend in (fed, _inprocess(spec)):
        try:
            results.append(backend.compute(q, [1, 4]))
        except ValueError:
            results.append(None)
    a, b = results
    assert (a is None) == (b is None)
    if a is not None:
        assert a.failed == b.failed and torch.equal(a.values, b.values)


# --- 6. problems without the Newton path: per-user L-BFGS + residual column --------------------------
FALLBACK = [
    ("softmax", 0.1, 0.5),
    ("softmax", 0.0, 0.5),
    ("softmax", 0.1, 0.0),
    ("smoothed-hinge", 0.1, 0.5),
    ("smoothed-hinge", 0.1, 0.0),
]


@pytest.mark.parametrize("problem,reg,s", FALLBACK)
def test_lbfgs_fallback_has_shape_d_plus_one_and_an_honest_residual(problem, reg, s):
    fed = _fed("synthetic-logistic", problem, reg, n_users=6)
    P = fed.num_params
    assert type(fed.problem).__name__ not in ("BinaryLogistic", "LeastSquares")
    center = _center(P, seed=11)
    ans = fed.compute(CertifiedLocalMinimizer(center, s))
    assert ans.failed == [] and ans.values.shape == (fed.num_users, P + 1)
    _check_rows(fed, ans.users, ans.values, center, s)
    if s > 0:  # the same L-BFGS run as the plain kind: identical minimizer columns
        assert torch.equal(ans.values[:, :P], fed.compute(LocalRegularizedMinimizer(center, s)).values)
    # stopped after 2 L-BFGS iterations: a larger residual, still an honest certificate
    early = fed.compute(CertifiedLocalMinimizer(center, s, max_iter=2)).values
    assert float(early[:, P].max()) > TOL
    _check_rows(fed, ans.users, early, center, s)
    # and each row is what the user computes alone
    for u in (0, fed.num_users - 1):
        assert torch.equal(fed.compute(CertifiedLocalMinimizer(center, s), [u]).values[0], ans.values[u])
