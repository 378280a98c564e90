"""DP-AdamBC (Tang, Shpilevskiy, Lécuyer 2024): DP-Adam with both bias corrections and the noise
variance (sigma / (q n))^2 subtracted from the second moment, floored at gamma'. Post-processing of
dp-adam's releases: the same schedule and charge."""

import math

import pytest
import torch
from release_spies import record_schedule_releases

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.dp_adaptive import DPAdam, DPAdamBC, DPAdamBCParams
from fedkl.algorithms.nonprivate import nonprivate_minimizer
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.problems import make_problem


def _opt(cls, eps, delta, **params):
    """``cls`` built for the (eps, delta) left, add-remove (``params``: its Params)."""
    return cls(cls.Params(**params), BuildContext.fresh(eps=eps, delta=delta, neighbouring="add-remove"))


def _run(tmp_path, cfg, eps=2.0, n_users=80, d=6, noise_seed=0, name="l"):
    ds = load_dataset("synthetic-logistic", n_users=n_users, m=20, d=d, seed=0)
    fed = InProcessFederation(make_problem("logistic", ds), ds)
    ledger = PrivacyLedger(tmp_path / f"{name}.sqlite", Budget(eps, 1e-5))
    cls, params = cfg
    opt = _opt(cls, *ledger.approx_left(fed.user_ids), **params)
    res = opt.run(fed, Releaser(ledger, NoiseSource(noise_seed)), fed.problem.init_params())
    return ds, fed, ledger, res


def _hand(w0, gs, lr, b1, b2, denominator):
    """Adam with both bias corrections from the released means ``gs``, the step's denominator given
    by ``denominator(v_hat)``: written out coordinate by coordinate in plain floats."""
    w, m, v = list(map(float, w0)), [0.0] * len(w0), [0.0] * len(w0)
    for t, g in enumerate(gs, start=1):
        for j, gj in enumerate(map(float, g)):
            m[j] = b1 * m[j] + (1 - b1) * gj
            v[j] = b2 * v[j] + (1 - b2) * gj * gj
            w[j] -= lr * (m[j] / (1 - b1**t)) / denominator(v[j] / (1 - b2**t))
    return torch.tensor(w, dtype=torch.float64)


@pytest.mark.parametrize("floor", [1e-3, 1e-6])
def test_update_rule_is_adam_minus_the_noise_variance_by_hand(tmp_path, monkeypatch, floor):
    """Each run is rebuilt by hand from its own released sums: dp-adambc's iterate is
    m^ / sqrt(max(v^ - Phi, gamma')) with Phi = (sigma / (q n))^2, dp-adam --bias-correction's is
    m^ / (sqrt(v^) + nu) on the same schedule; and with Phi replaced by 0 the dp-adambc hand rule
    would not match (the correction is what differs)."""
    q, lr, b1, b2 = 0.5, 0.05, 0.8, 0.9
    kw = dict(rounds=6, lr=lr, beta1=b1, beta2=b2, sampling_rate=q, accountant="rdp")
    pairs = record_schedule_releases(monkeypatch)
    ds, fed, ledger, bc = _run(tmp_path, (DPAdamBC, dict(adambc_floor=floor, **kw)), name="bc")
    denom = q * fed.num_users
    gs = [out / denom for _, out in pairs]
    phi = (bc.sigma / denom) ** 2
    assert bc.details["noise_variance"] == pytest.approx(phi, rel=1e-15)
    w0 = fed.problem.init_params()
    expected = _hand(w0, gs, lr, b1, b2, lambda v: math.sqrt(max(v - phi, floor)))
    assert torch.allclose(bc.w, expected, rtol=1e-12, atol=1e-14)
    uncorrected = _hand(w0, gs, lr, b1, b2, lambda v: math.sqrt(max(v, floor)))
    assert not torch.allclose(bc.w, uncorrected, rtol=1e-6, atol=1e-9)

    pairs.clear()
    adam_cfg = (DPAdam, dict(bias_correction=True, nu=1e-3, **kw))
    _, _, ledger_adam, adam = _run(tmp_path, adam_cfg, name="adam")
    gs_adam = [out / denom for _, out in pairs]
    assert torch.allclose(adam.w, _hand(w0, gs_adam, lr, b1, b2, lambda v: math.sqrt(v) + 1e-3), rtol=1e-12)
    # the same schedule and the same charge: the correction is post-processing
    (row_bc,), (row_adam,) = ledger.releases(), ledger_adam.releases()
    for key in ("mechanism", "eps", "delta", "sensitivity", "noise_scale", "users"):
        assert row_bc[key] == row_adam[key], key
    assert row_bc["label"] == "dp-adambc/schedule"
    assert torch.equal(gs[0], gs_adam[0])  # the same first release (same w0, same noise seed)


def test_same_direction_as_bias_corrected_adam_without_noise():
    """With Phi = 0 and a negligible floor / nu, dp-adambc and dp-adam --bias-correction take the same
    step on any gradient sequence; with Phi > 0 dp-adambc's step is larger where v^ is noise-sized."""
    torch.manual_seed(1)
    gs = [torch.randn(5, dtype=torch.float64) * 0.1 for _ in range(5)]
    bc = _opt(DPAdamBC, 1.0, 1e-5, adambc_floor=1e-300)
    adam = _opt(DPAdam, 1.0, 1e-5, bias_correction=True, nu=1e-300)

    def state(phi):
        return {"m": torch.zeros(5, dtype=torch.float64), "psi": torch.zeros(5, dtype=torch.float64), "noise_var": phi}

    s_bc, s_adam, s_phi = state(0.0), state(0.0), state(1e-3)
    for t, g in enumerate(gs, start=1):
        d_bc, d_adam, d_phi = bc.direction(g, s_bc, t), adam.direction(g, s_adam, t), bc.direction(g, s_phi, t)
        assert torch.allclose(d_bc, d_adam, rtol=1e-13)
        assert bool((d_phi.abs() >= d_bc.abs()).all()) and not torch.allclose(d_phi, d_bc)


def test_converges_at_large_epsilon(tmp_path):
    cfg = (DPAdamBC, dict(rounds=60, lr=0.05, sampling_rate=1.0, accountant="rdp"))
    ds, fed, ledger, res = _run(tmp_path, cfg, eps=50.0, n_users=300)
    w_opt = nonprivate_minimizer(fed.problem, ds.train)
    excess = fed.problem.loss(res.w, ds.train) - fed.problem.loss(w_opt, ds.train)
    start = fed.problem.loss(fed.problem.init_params(), ds.train) - fed.problem.loss(w_opt, ds.train)
    assert excess < 0.01 * start


def test_bad_floor_is_refused():
    with pytest.raises(ValueError, match="--adambc-floor must be > 0"):
        DPAdamBCParams(adambc_floor=0.0)
