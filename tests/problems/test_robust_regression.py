"""The robust regression GLLs (huber, absolute through its Moreau envelope): gradients against autograd, the
closed-form oracle against a numerically computed Moreau envelope, the constants, and private runs that
learn a synthetic regression with a known optimum (gll-phased-sgd and noisy-fw, API and CLI)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import minimize_scalar

import fedkl
from fedkl.cli import main
from fedkl.data import load_dataset
from fedkl.data.base import UserData
from fedkl.problems import AbsoluteLoss, Huber, make_problem
from fedkl.problems.robust_regression import absolute_prox, moreau_gradient

D, R = 5, 1.5


def make_data(sizes=(1, 3, 8, 20), seed=0) -> UserData:
    """Records with ||x|| <= R (half on the sphere), labels in [-2, 2], users interleaved."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    X = torch.randn(n, D, generator=g, dtype=torch.float64)
    radius = R * torch.rand(n, 1, generator=g, dtype=torch.float64)
    radius[: n // 2] = R
    X = X / X.norm(dim=1, keepdim=True) * radius
    y = 4 * torch.rand(n, generator=g, dtype=torch.float64) - 2
    user_index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[torch.randperm(n, generator=g)]
    return UserData(X, y, user_index, tuple(f"u{i}" for i in range(len(sizes))))


def random_w(scale: float, seed: int) -> torch.Tensor:
    return scale * torch.randn(D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def ref_huber(delta, w, X, y):
    """torch's Huber loss (``0.5 r^2`` inside, ``delta (|r| - delta/2)`` outside) divided by delta."""
    return F.huber_loss(X @ w, y, delta=delta, reduction="none") / delta


def numeric_envelope(m: float, y: float, beta: float) -> tuple[float, float]:
    """``(min_u |u - y| + (beta/2)(u - m)^2, argmin)`` by bounded Brent, independent of the closed form: on
    each side of the kink u = y the objective is smooth, so minimise on both pieces of [m - 2/beta, m + 2/beta]
    (the prox lies within 1/beta of m) that exist and keep the better."""
    lo, hi = m - 2 / beta, m + 2 / beta
    best = (abs(y - y) + 0.5 * beta * (y - m) ** 2, y) if lo <= y <= hi else (math.inf, math.nan)
    for a, b in ((lo, min(hi, y)), (max(lo, y), hi)):
        if a < b:
            res = minimize_scalar(
                lambda u: abs(u - y) + 0.5 * beta * (u - m) ** 2,
                bounds=(a, b),
                method="bounded",
                options={"xatol": 1e-12},
            )
            best = min(best, (float(res.fun), float(res.x)))
    return best


@pytest.mark.parametrize("problem", [Huber(D, delta=0.3), Huber(D, reg=0.2), AbsoluteLoss(D, moreau_beta=4.0)])
def test_gradients_match_autograd(problem):
    data = make_data()
    delta = problem.delta
    for seed, scale in ((1, 0.1), (2, 1.0), (3, 5.0)):  # residuals inside, across and outside the threshold
        w = random_w(scale, seed).requires_grad_(True)
        per_record = ref_huber(delta, w, data.X, data.y)
        torch.testing.assert_close(problem.record_losses(w.detach(), data), per_record.detach())
        reg = 0.5 * problem.reg * w.dot(w)
        for u in range(data.num_users):
            mask = data.user_index == u
            (g,) = torch.autograd.grad(per_record[mask].mean() + reg, w, retain_graph=True)
            torch.testing.assert_close(problem.per_user_gradients(w.detach(), data)[u], g)


def test_absolute_oracle_is_the_moreau_envelope_gradient():
    """Closed-form prox and envelope gradient (Alg 1 with alpha = 0) against a numerically minimised envelope
    and its central difference; the envelope is the Huber loss with delta = 1/beta, within 1/(2 beta) below |r|."""
    beta, y, h = 4.0, 0.7, 1e-3
    kink = 1.0 / beta
    ms = [y + r for r in (-3.0, -1.0, -0.3, -0.2, -0.05, 0.0, 0.1, 0.2, 0.3, 0.9, 2.5)]
    assert all(abs(abs(m - y) - kink) > 10 * h for m in ms)  # central differences away from the kink
    for m in ms:
        value, u = numeric_envelope(m, y, beta)
        mt, yt = torch.tensor([m], dtype=torch.float64), torch.tensor([y], dtype=torch.float64)
        assert float(absolute_prox(mt, yt, beta)) == pytest.approx(u, abs=1e-7)
        slope = (numeric_envelope(m + h, y, beta)[0] - numeric_envelope(m - h, y, beta)[0]) / (2 * h)
        assert float(moreau_gradient(mt, yt, beta)) == pytest.approx(slope, abs=1e-5)
        huber = Huber(1, delta=1.0 / beta)
        assert float(huber.score_loss(mt, yt)) == pytest.approx(value, abs=1e-9)
        assert float(huber.score_derivative(mt, yt)) == pytest.approx(float(moreau_gradient(mt, yt, beta)), abs=1e-12)
        assert value - 1e-12 <= abs(m - y) <= value + 1 / (2 * beta) + 1e-9  # Lemma 3's sandwich


def test_constants_need_no_label_bound_and_refuse_bad_parameters():
    c = Huber(D, delta=0.5).constants(R)
    assert (c.lipschitz, c.smoothness, c.strong_convexity) == (R, R * R / 0.5, 0.0)
    a = AbsoluteLoss(D, moreau_beta=8.0).constants(R)
    assert (a.lipschitz, a.smoothness) == (R, 8.0 * R * R)
    # the stated L0 bounds every per-user gradient, at any w and any (even huge) label
    data = make_data()
    data.y.mul_(1e6)
    for p in (Huber(D, delta=0.5), AbsoluteLoss(D, moreau_beta=8.0)):
        g = p.per_user_gradients(random_w(50.0, 4), data)
        assert float(g.norm(dim=1).max()) <= p.constants(R).lipschitz * (1 + 1e-12)
    with pytest.raises(ValueError, match="bounded domain"):
        Huber(D, reg=0.1).constants(R)
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="threshold"):
            Huber(D, delta=bad)
        with pytest.raises(ValueError, match="moreau_beta"):
            AbsoluteLoss(D, moreau_beta=bad)


def test_make_problem_refuses_classification_and_keeps_the_label_bound():
    reg = load_dataset("synthetic-least-squares", n_users=10, m=4, d=3)
    p = make_problem("absolute", reg, moreau_beta=3.0)
    assert isinstance(p, AbsoluteLoss) and p.moreau_beta == 3.0 and p.label_bound == reg.extra["label_bound"]
    assert isinstance(make_problem("huber", reg), Huber)
    with pytest.raises(ValueError, match="regression"):
        make_problem("huber", load_dataset("synthetic-logistic", n_users=10, m=4, d=3))


# A run learns: symmetric noise and isotropic x make w* the population minimizer of both losses (the
# subgradient E[psi(<w - w*, x> + e) x] vanishes at w* for odd psi), so the private model must close most of
# the gap between the best constant predictor (the median label) and w*.
@pytest.mark.parametrize("problem", ["absolute", "huber"])
@pytest.mark.parametrize("algorithm,settings", [("gll-phased-sgd", {}), ("noisy-fw", {"fw_radius": 3.0})])
def test_private_run_learns_a_regression_with_known_optimum(problem, algorithm, settings):
    ds = load_dataset("synthetic-least-squares", n_users=1000, m=10, d=D, noise=0.1, seed=0)
    assert float(ds.optimum.abs().sum()) <= 3.0  # w* lies in noisy-fw's l1 ball
    p = make_problem(problem, ds)
    at_optimum = p.metrics(ds.optimum, ds.test)["loss"]
    trivial = p.trivial_metrics(ds.train, ds.test)["loss"]
    r = fedkl.train(ds, algorithm, problem=problem, epsilon=4.0, noise_seed=0, log=None, **settings)
    assert r.metrics["loss"] - at_optimum <= 0.1 * (trivial - at_optimum)


def test_cli_runs_absolute_with_gll_phased_sgd(tmp_path):
    out = tmp_path / "run"
    argv = ["run", "--algorithm", "gll-phased-sgd", "--problem", "absolute", "--dataset", "synthetic-least-squares"]
    assert main([*argv, "--users", "200", "--epsilon", "4", "--out", str(out), "--no-reference"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["problem"] == "absolute" and result["test_metrics"]["mae"] < result["trivial_baseline"]["mae"]
