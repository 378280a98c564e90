"""Problems: gradients against autograd, the stated constants, input checks, make_problem."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedkl.data.base import FederatedDataset, UserData
from fedkl.problems import MLP, PROBLEMS, BinaryLogistic, LeastSquares, SmoothedHinge, SoftmaxRegression, make_problem

D, K, R, B, Y = 5, 3, 1.5, 2.0, 1.2
SIZES = (1, 2, 5, 17, 40, 3)  # uneven users, one with a single record


def make_data(sizes=SIZES, labels="binary", seed=0, dim=D, on_sphere=0.5, shuffle=True) -> UserData:
    """Records with ||x|| <= R (a fraction exactly on the sphere), users interleaved."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    X = torch.randn(n, dim, generator=g, dtype=torch.float64)
    radius = R * torch.rand(n, 1, generator=g, dtype=torch.float64)
    radius[: int(on_sphere * n)] = R
    X = X / X.norm(dim=1, keepdim=True) * radius
    if labels == "binary":
        y = torch.where(torch.rand(n, generator=g) < 0.5, 1.0, -1.0).double()
    elif labels == "multiclass":
        y = torch.randint(0, K, (n,), generator=g)
    else:  # regression, |y| <= Y, half of them at the bound
        y = (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1) * Y
        y[: n // 2] = torch.sign(y[: n // 2]) * Y
    user_index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    perm = torch.randperm(n, generator=g) if shuffle else torch.arange(n)
    return UserData(X[perm], y[perm], user_index[perm], tuple(f"u{i}" for i in range(len(sizes))))


def random_w(p, scale=1.0, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(p.num_params, generator=g, dtype=torch.float64).to(p.dtype)


# --- independent reference losses (per record, no regularizer) ---------------------------------
def ref_logistic(p, w, X, y):
    return F.softplus(-y * (X @ w))


def ref_softmax(p, w, X, y):
    labels = (y > 0).long() if y.is_floating_point() else y
    return F.cross_entropy(X @ w.view(p.num_classes, p.dim).T, labels, reduction="none")


def ref_least_squares(p, w, X, y):
    return 0.5 * (X @ w - y) ** 2


def ref_hinge(p, w, X, y):
    t, h = y * (X @ w), p.smoothing
    return torch.where(t >= 1, torch.zeros_like(t), torch.where(t <= 1 - h, 1 - t - h / 2, (1 - t) ** 2 / (2 * h)))


def ref_mlp(p, w, X, y):
    """The network evaluated by hand from w, laid out like parameters_to_vector (weight, bias per layer)."""
    sizes = (p.dim, *p.hidden, p.num_classes)
    h, offset = X.to(p.dtype), 0
    for i in range(len(sizes) - 1):
        n_in, n_out = sizes[i], sizes[i + 1]
        W = w[offset : offset + n_in * n_out].view(n_out, n_in)
        b = w[offset + n_in * n_out : offset + n_in * n_out + n_out]
        offset += n_in * n_out + n_out
        h = h @ W.T + b
        if i < len(sizes) - 2:
            h = torch.relu(h)
    assert offset == p.num_params
    labels = (y > 0).long() if y.is_floating_point() else y
    return F.cross_entropy(h, labels, reduction="none")


CASES = {  # name: (problem factory, label kind, reference loss, tolerance, weight scale)
    "logistic": (lambda: BinaryLogistic(D, reg=0.3), "binary", ref_logistic, 1e-10, 1.0),
    "softmax": (lambda: SoftmaxRegression(D, K, reg=0.3), "multiclass", ref_softmax, 1e-10, 1.0),
    "softmax-binary": (lambda: SoftmaxRegression(D, 2), "binary", ref_softmax, 1e-10, 1.0),
    "least-squares": (lambda: LeastSquares(D, reg=0.3, label_bound=Y), "regression", ref_least_squares, 1e-10, 1.0),
    "smoothed-hinge": (lambda: SmoothedHinge(D, reg=0.3, smoothing=0.5), "binary", ref_hinge, 1e-10, 1.0),
    "smoothed-hinge-noreg": (lambda: SmoothedHinge(D, smoothing=2.0), "binary", ref_hinge, 1e-10, 1.0),
    "mlp": (lambda: MLP(D, hidden=(8,), num_classes=K, reg=0.1), "multiclass", ref_mlp, 1e-5, 0.5),
    "mlp-float64-chunked": (
        lambda: MLP(D, hidden=(6, 4), num_classes=2, reg=0.1, dtype=torch.float64, chunk_size=7),
        "binary",
        ref_mlp,
        1e-10,
        0.5,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_per_user_gradients_match_autograd(case):
    factory, labels, ref, tol, scale = CASES[case]
    p = factory()
    data = make_data(labels=labels)
    w = random_w(p, scale)
    grads = p.per_user_gradients(w, data)
    assert grads.shape == (data.num_users, p.num_params) and grads.dtype == p.dtype
    losses = p.per_user_losses(w, data)
    for u in range(data.num_users):
        sub = data.subset([u])
        wu = w.detach().clone().requires_grad_(True)
        f_u = ref(p, wu, sub.X.to(p.dtype), sub.y.to(p.dtype) if sub.y.is_floating_point() else sub.y).mean()
        f_u = f_u + 0.5 * p.reg * wu.dot(wu)
        (g_ref,) = torch.autograd.grad(f_u, wu)
        torch.testing.assert_close(grads[u], g_ref, atol=tol, rtol=tol)
        assert abs(float(losses[u]) - float(f_u)) <= tol * max(1.0, abs(float(f_u)))
    torch.testing.assert_close(p.gradient(w, data), grads.mean(0))


def _single_record_users(data: UserData) -> UserData:
    n = data.num_records
    return UserData(data.X, data.y, torch.arange(n), tuple(f"r{i}" for i in range(n)))


CONVEX = {  # name: (factory(reg), label kind)
    "logistic": (lambda reg: BinaryLogistic(D, reg=reg), "binary"),
    "softmax": (lambda reg: SoftmaxRegression(D, K, reg=reg), "multiclass"),
    "least-squares": (lambda reg: LeastSquares(D, reg=reg, label_bound=Y), "regression"),
    "smoothed-hinge": (lambda reg: SmoothedHinge(D, reg=reg, smoothing=0.5), "binary"),
}


def _weights(p, reg, n=60, seed=3):
    """Random parameters: within ||w|| <= B (many on the sphere) when B is needed, else any scale."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(n, p.num_params, generator=g, dtype=torch.float64)
    dirs = dirs / dirs.norm(dim=1, keepdim=True)
    if reg > 0 or isinstance(p, LeastSquares):
        norms = B * torch.rand(n, 1, generator=g, dtype=torch.float64)
        norms[: n // 2] = B
    else:
        norms = torch.tensor([0.1, 1.0, B, 10.0, 100.0], dtype=torch.float64).repeat(n // 5 + 1)[:n, None]
    return dirs * norms


@pytest.mark.parametrize("reg", [0.0, 0.2])
@pytest.mark.parametrize("case", list(CONVEX))
def test_lipschitz_bound(case, reg):
    factory, labels = CONVEX[case]
    p = factory(reg)
    data = _single_record_users(make_data(sizes=(400,), labels=labels, seed=5))
    c = p.constants(R, B)
    worst = 0.0
    for w in _weights(p, reg):
        worst = max(worst, float(p.per_user_gradients(w, data).norm(dim=1).max()))
    if isinstance(p, LeastSquares):  # the extreme point: w = -B x/||x||, y = +Y, ||x|| = R
        x = data.X[0]
        extreme = UserData(x[None], torch.tensor([Y], dtype=torch.float64), torch.zeros(1, dtype=torch.int64), ("e",))
        g = p.per_user_gradients(-B * x / x.norm(), extreme)
        assert float(g.norm()) == pytest.approx(c.lipschitz, rel=1e-12)
    assert worst <= c.lipschitz * (1 + 1e-9)
    assert worst >= 0.5 * c.lipschitz  # the bound is not vacuous


@pytest.mark.parametrize("reg", [0.0, 0.2])
@pytest.mark.parametrize("case", list(CONVEX))
def test_smoothness_and_strong_convexity(case, reg):
    factory, labels = CONVEX[case]
    p = factory(reg)
    data = _single_record_users(make_data(sizes=(300,), labels=labels, seed=6))
    c = p.constants(R, B)
    ws = _weights(p, reg, n=40, seed=7)
    g = torch.Generator().manual_seed(8)
    pairs = [(ws[i], ws[(i + 1) % len(ws)]) for i in range(len(ws))]  # far pairs
    pairs += [(w, w + 1e-3 * torch.randn(w.shape, generator=g, dtype=torch.float64)) for w in ws]  # close pairs
    for w1, w2 in pairs:
        dg = p.per_user_gradients(w1, data) - p.per_user_gradients(w2, data)
        dw = w1 - w2
        assert float(dg.norm(dim=1).max()) <= c.smoothness * float(dw.norm()) * (1 + 1e-9) + 1e-12
        inner = dg @ dw  # per user
        assert float(inner.min()) >= c.strong_convexity * float(dw.dot(dw)) * (1 - 1e-9) - 1e-12
    assert c.strong_convexity == reg


def test_constants_values_and_domain_errors():
    assert SoftmaxRegression(D, K).constants(2.0) == SoftmaxRegression(D, K).constants(2.0, None)
    c = SoftmaxRegression(D, K, reg=0.1).constants(2.0, 3.0)
    assert (c.lipschitz, c.smoothness, c.strong_convexity) == pytest.approx((2 * math.sqrt(2) + 0.3, 2.1, 0.1))
    c = LeastSquares(D, label_bound=1.0).constants(2.0, 3.0)
    assert (c.lipschitz, c.smoothness, c.strong_convexity) == pytest.approx((14.0, 4.0, 0.0))
    c = SmoothedHinge(D, smoothing=0.25).constants(2.0)
    assert (c.lipschitz, c.smoothness, c.strong_convexity) == pytest.approx((2.0, 16.0, 0.0))
    with pytest.raises(ValueError):
        LeastSquares(D, label_bound=1.0).constants(1.0)  # needs param_bound
    with pytest.raises(ValueError):
        LeastSquares(D).constants(1.0, 1.0)  # needs label_bound
    for p in (SoftmaxRegression(D, K, reg=0.1), SmoothedHinge(D, reg=0.1)):
        with pytest.raises(ValueError):
            p.constants(1.0)
    with pytest.raises(ValueError):
        SmoothedHinge(D, smoothing=0.0)
    with pytest.raises(ValueError):
        SoftmaxRegression(D, 1)
    c = MLP(D).constants(1.0, 1.0)
    assert c.lipschitz == float("inf") and c.smoothness is None and c.strong_convexity is None
    assert not MLP(D).convex and SoftmaxRegression(D, K).convex


ALL = {name: CASES[name] for name in ("logistic", "softmax", "least-squares", "smoothed-hinge", "mlp")}


@pytest.mark.parametrize("case", list(ALL))
def test_bad_parameters_raise(case):
    factory, labels, *_ = ALL[case]
    p = factory()
    data = make_data(labels=labels)
    good = p.init_params()
    bad = [torch.zeros(p.num_params + 1, dtype=p.dtype), good.view(1, -1), good.clone().fill_(float("nan"))]
    bad[2][0] = float("nan")
    for w in bad:
        for fn in (p.per_user_gradients, p.record_losses, p.metrics, p.loss):
            with pytest.raises(ValueError):
                fn(w, data)


@pytest.mark.parametrize("case", list(ALL))
def test_metrics(case):
    factory, labels, *_ = ALL[case]
    p = factory()
    train, test = make_data(labels=labels, seed=10), make_data(labels=labels, seed=11)
    m = p.metrics(p.init_params(), test)
    t = p.trivial_metrics(train, test)
    assert "loss" in m and "loss" in t
    key = "mse" if isinstance(p, LeastSquares) else "accuracy"
    assert key in m and key in t
    if key == "accuracy":
        assert 0.0 <= m[key] <= 1.0 and 0.0 <= t[key] <= 1.0


def test_trivial_metrics_values():
    train = make_data(labels="regression", seed=12)
    test = make_data(labels="regression", seed=13)
    t = LeastSquares(D).trivial_metrics(train, test)
    assert t["mse"] == pytest.approx(float(((test.y - train.y.mean()) ** 2).mean()))
    y = torch.tensor([0, 2, 2, 1])
    tr = UserData(torch.zeros(4, D, dtype=torch.float64), y, torch.zeros(4, dtype=torch.int64), ("a",))
    te = UserData(
        torch.zeros(3, D, dtype=torch.float64), torch.tensor([2, 1, 2]), torch.zeros(3, dtype=torch.int64), ("a",)
    )
    assert SoftmaxRegression(D, K).trivial_metrics(tr, te)["accuracy"] == pytest.approx(2 / 3)


def test_mlp_init_and_layout():
    p = MLP(D, hidden=(8,), num_classes=K, seed=3)
    w = p.init_params()
    assert w.dtype == torch.float32 and w.shape == (D * 8 + 8 + 8 * K + K,)
    assert torch.equal(w, MLP(D, hidden=(8,), num_classes=K, seed=3).init_params())
    assert not torch.equal(w, MLP(D, hidden=(8,), num_classes=K, seed=4).init_params())
    w1 = p.init_params(torch.Generator().manual_seed(0))
    assert torch.equal(w1, p.init_params(torch.Generator().manual_seed(0))) and not torch.equal(w1, w)
    # the flat layout is parameters_to_vector's: record losses agree with the module itself
    data = make_data(labels="multiclass")
    with torch.no_grad():
        logits = p.module(data.X.float())
    torch.testing.assert_close(p.record_losses(w, data), F.cross_entropy(logits, data.y, reduction="none"))


def _dataset(task, labels, num_classes=2, extra=None):
    data = make_data(labels=labels)
    return FederatedDataset("toy", data, data, task, R, "toy", num_classes=num_classes, extra=extra or {})


def test_make_problem():
    binary, multi = _dataset("binary", "binary"), _dataset("multiclass", "multiclass", K)
    regression = _dataset("regression", "regression", extra={"label_bound": Y})
    assert isinstance(make_problem("logistic", binary, reg=0.1), BinaryLogistic)
    assert make_problem("logistic", binary, reg=0.1).reg == 0.1
    assert isinstance(make_problem("smoothed-hinge", binary, smoothing=0.3), SmoothedHinge)
    assert make_problem("softmax", multi).num_classes == K and make_problem("softmax", binary).num_classes == 2
    mlp = make_problem("mlp", multi, hidden=(4,), seed=1)
    assert isinstance(mlp, MLP) and mlp.num_classes == K and mlp.dim == D
    ls = make_problem("least-squares", regression)
    assert isinstance(ls, LeastSquares) and ls.label_bound == Y
    assert make_problem("least-squares", regression, label_bound=5.0).label_bound == 5.0
    linear_net = lambda d, k: torch.nn.Linear(d, k)  # noqa: E731  (problem "torch": your own network)
    for name in PROBLEMS:
        kw = {"model": linear_net} if name == "torch" else {}
        assert (
            make_problem(name, regression if name in ("least-squares", "huber", "absolute") else binary, **kw).dim == D
        )
    assert make_problem("torch", regression, model=linear_net).num_params == D + 1
    with pytest.raises(ValueError, match="valid names: logistic, softmax, least-squares, smoothed-hinge, mlp"):
        make_problem("svm", binary)
    with pytest.raises(ValueError, match="binary"):
        make_problem("logistic", multi)
    with pytest.raises(ValueError, match="regression"):
        make_problem("least-squares", binary)
    with pytest.raises(ValueError):
        make_problem("mlp", regression)


def test_nonprivate_reference_is_stationary_with_regularizer():
    """The reference solver differentiates F through autograd: the regularizer must be included."""
    from fedkl.algorithms.nonprivate import nonprivate_minimizer
    from fedkl.data import load_dataset
    from fedkl.problems import make_problem

    ds = load_dataset("synthetic-logistic", n_users=30, m=10, d=5, seed=2)
    problem = make_problem("logistic", ds, reg=0.5)
    w = nonprivate_minimizer(problem, ds.train)
    assert float(problem.gradient(w, ds.train).norm()) < 1e-6


def test_loss_leaves_out_users_without_records():
    """A held-out split where most users have no record: the reported loss is the mean over the
    users that have one, not diluted by zeros."""
    from fedkl.data import load_dataset
    from fedkl.data.base import UserData
    from fedkl.problems import make_problem

    ds = load_dataset("synthetic-logistic", n_users=6, m=4, d=3, seed=0)
    problem = make_problem("logistic", ds)
    w = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64)
    full = ds.train
    keep = full.user_index < 2  # users 2..5 have no records
    sparse = UserData(full.X[keep], full.y[keep], full.user_index[keep], full.user_ids)
    assert sparse.num_users == 6 and int((sparse.counts() > 0).sum()) == 2
    expected = float(problem.per_user_losses(w, sparse)[:2].mean())
    assert problem.loss(w, sparse) == pytest.approx(expected, rel=1e-12)
    assert problem.loss(w, full) == pytest.approx(float(problem.per_user_losses(w, full).mean()), rel=1e-12)
