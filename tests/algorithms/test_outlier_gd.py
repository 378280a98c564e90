"""noisy-gd-outlier (Asi & Liu-style outlier-removal mean inside noisy GD): the kept weight's sensitivity 3
attained and never exceeded, the weighted mean never moving more than 14 R / W_min on adversarial
replace-one neighbours, the charges of every round (PTR delta, test, mean) and their noise, refusals
before any data, a failed test skipping the step, and convergence (better than noisy-gd when users hold
many records)."""

import math
from statistics import NormalDist
from types import SimpleNamespace

import pytest
import torch
from build_helpers import counting_federation  # tests/build_helpers.py

from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
from fedkl.algorithms.gradient.outlier_gd import (
    OutlierGD,
    OutlierGDParams,
    neighbour_scores,
    outlier_weights,
    weighted_mean,
)
from fedkl.algorithms.nonprivate import nonprivate_minimizer
from fedkl.algorithms.registry import BuildContext
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy.zcdp import zcdp_to_eps
from fedkl.problems import make_problem


def _weight_and_mean(points, radius):
    x = outlier_weights(neighbour_scores(points, radius))
    return float(x.sum()), weighted_mean(points, x)


def test_the_weights_follow_the_scores():
    n = 9
    pts = torch.zeros(n, 2, dtype=torch.float64)
    pts[8] = torch.tensor([10.0, 0.0])  # one far user
    s = neighbour_scores(pts, 1.0)
    assert s.tolist() == [8.0] * 8 + [1.0]
    x = outlier_weights(s)
    assert x[:8] == pytest.approx([(8 - 5) / 4] * 8, rel=1e-15) and float(x[8]) == 0.0  # a = 5, h = 4
    assert weighted_mean(pts, x).tolist() == [0.0, 0.0]  # the outlier is removed


def test_kept_weight_sensitivity_is_attained_and_never_exceeded():
    """|W - W'| <= 3 for any replacement of one user's point (anything: huge, at another cluster, inside);
    attained when every user is close to every other and the replaced one leaves: W = n -> n - 3."""
    g = torch.Generator().manual_seed(0)
    n, R = 41, 1.0
    worst = 0.0
    for trial in range(200):
        pts = torch.randn(n, 3, generator=g, dtype=torch.float64) * (0.2 + 0.3 * (trial % 4))
        other = pts.clone()
        other[trial % n] = torch.randn(3, generator=g, dtype=torch.float64) * 10 ** (trial % 3 - 1)
        diff = abs(_weight_and_mean(pts, R)[0] - _weight_and_mean(other, R)[0])
        assert diff <= 3 * (1 + 1e-12)
        worst = max(worst, diff)
    tight = torch.zeros(n, 3, dtype=torch.float64)
    away = tight.clone()
    away[0] = torch.tensor([100.0, 0.0, 0.0])
    assert _weight_and_mean(tight, R)[0] == n
    assert _weight_and_mean(tight, R)[0] - _weight_and_mean(away, R)[0] == pytest.approx(3.0, rel=1e-12)


def test_weighted_mean_never_moves_more_than_its_bound():
    """||mean(X) - mean(X')|| <= 7 Dm / min(W, W') (Dm = 2R) on adversarial neighbours: a cluster with
    users on the edge of the radius (whose weights the replaced user flips), the replaced user moved
    anywhere (inside, at the edge, far away). The bound is an upper bound: the worst pair found is
    reported against it (not attained: the proof bounds three terms separately)."""
    g = torch.Generator().manual_seed(1)
    n, R = 31, 1.0
    worst = 0.0
    for trial in range(300):
        pts = torch.randn(n, 2, generator=g, dtype=torch.float64)
        pts = 0.5 * R * pts / pts.norm(dim=1, keepdim=True) * torch.rand(n, 1, generator=g, dtype=torch.float64)
        k = trial % 12
        pts[1 : 1 + k, 0] += R * (0.9 + 0.2 * torch.rand(k, generator=g, dtype=torch.float64))  # edge users
        other = pts.clone()
        other[0] = torch.randn(2, generator=g, dtype=torch.float64) * (0.5, 2.0, 50.0)[trial % 3]
        (W, m), (W2, m2) = _weight_and_mean(pts, R), _weight_and_mean(other, R)
        if min(W, W2) <= 0:
            continue
        ratio = float((m - m2).norm()) / (7 * 2 * R / min(W, W2))
        assert ratio <= 1 + 1e-12
        worst = max(worst, ratio)
    assert worst > 0.02  # the pairs do move the mean: the check is not vacuous


def _setup(tmp_path, n_users=400, d=8, m=20, seed=0, eps=4.0):
    ds = load_dataset("synthetic-logistic", n_users=n_users, m=m, d=d, seed=seed)
    fed = InProcessFederation(make_problem("logistic", ds), ds)
    ledger = PrivacyLedger(tmp_path / f"ledger-{n_users}-{m}-{seed}-{eps}.sqlite", Budget(eps, 1e-5))
    return ds, fed, ledger


def _alg(fed, ledger, **cfg):
    params = OutlierGDParams(**{"lr": 1.0, **cfg})
    ids = tuple(fed.user_ids)
    b = ledger.budget
    ctx = BuildContext(
        fed.problem, 1.0, ids, b.delta, ledger.rho_left(ids), ledger.approx_left(ids), "cks", "replace-one", 0
    )
    return OutlierGD(params, ctx)


class _Recorder(Releaser):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.releases = []

    def gaussian(self, value, **kw):
        out = super().gaussian(value, **kw)
        self.releases.append((kw["label"], value.clone(), out.clone(), kw["sensitivity"], kw["rho"]))
        return out


def test_public_values_are_the_docstring_formulas(tmp_path):
    ds, fed, ledger = _setup(tmp_path)
    alg = _alg(fed, ledger, rounds=5, conc_records=16, conc_scale=2.0)
    eps, delta = ledger.approx_left(tuple(fed.user_ids))
    rho = alg.rho_total
    assert alg.delta_ptr_total == pytest.approx(0.5 * delta, rel=1e-12)
    assert zcdp_to_eps(rho, delta - alg.delta_ptr_total) == pytest.approx(eps, rel=1e-6)
    s_q = 3 / math.sqrt(2 * 0.2 * rho / 5)
    z = NormalDist().inv_cdf
    w_min = 400 - 3 - s_q * (z(1 - 0.5 * delta / 5) + z(0.95))
    assert alg.sigma_test == pytest.approx(s_q, rel=1e-12)
    assert alg.min_weight == pytest.approx(w_min, rel=1e-12)
    assert alg.radius == pytest.approx(2.0 / 4, rel=1e-12)
    assert alg.sensitivity == pytest.approx(14 * 0.5 / w_min, rel=1e-12)
    assert alg.sigma_mean == pytest.approx(alg.sensitivity / math.sqrt(2 * 0.8 * rho / 5), rel=1e-12)


def test_every_round_charges_ptr_test_and_mean_to_every_user_within_budget(tmp_path):
    ds, fed, ledger = _setup(tmp_path)
    rounds = 4
    alg = _alg(fed, ledger, rounds=rounds, conc_records=16, conc_scale=2.0)
    res = alg.run(fed, Releaser(ledger, NoiseSource(0)), fed.problem.init_params())
    releases = ledger.releases()
    assert [r["label"] for r in releases] == [
        f"noisy-gd-outlier/round-{t}/{stage}" for t in range(rounds) for stage in ("ptr", "test", "mean")
    ]
    for r in releases:
        stage = r["label"].rsplit("/", 1)[1]
        c = r["charge"]
        if stage == "ptr":
            assert c["eps"] == 0.0 and c["delta"] == pytest.approx(alg.delta_ptr, rel=1e-12)
        else:
            rho = alg.rho_test if stage == "test" else alg.rho_mean
            assert c["rho"] == pytest.approx(rho, rel=1e-12)
            assert c["sensitivity"] == pytest.approx(3.0 if stage == "test" else alg.sensitivity, rel=1e-12)
    for uid in fed.user_ids:
        spend = ledger.spend(uid)
        assert spend.rho == pytest.approx(alg.rho_total, rel=1e-12)
        assert spend.delta == pytest.approx(alg.delta_ptr_total, rel=1e-9)
        assert ledger.epsilon(uid) <= ledger.budget.epsilon * (1 + 1e-9)
    assert res.details["passed_rounds"] == rounds  # 20 IID records each: concentrated at radius 2/sqrt(16)
    ledger.verify()


@pytest.mark.statistical
def test_test_and_mean_noise_match_their_sensitivities(tmp_path):
    """Test noise std 3/sqrt(2 rho_q), mean noise std B/sqrt(2 rho_w): 40 rounds; the mean's >= 30 x 100
    draws give a std with standard error 1.1%, 5 of them well inside a wrong factor 2; the test's 40
    draws only catch gross errors (tolerance 5/sqrt(80) = 56%)."""
    ds, fed, ledger = _setup(tmp_path, d=100, n_users=400)
    rounds = 40
    alg = _alg(fed, ledger, rounds=rounds, conc_records=16, conc_scale=2.0, lr=0.1)
    rel = _Recorder(ledger, NoiseSource(5))
    alg.run(fed, rel, fed.problem.init_params())
    for stage, sigma in (("test", alg.sigma_test), ("mean", alg.sigma_mean)):
        rs = [r for r in rel.releases if r[0].endswith("/" + stage)]
        assert len(rs) == rounds if stage == "test" else len(rs) >= 30  # a failed test releases no mean
        noise = torch.cat([(out - exact).flatten() for _, exact, out, _, _ in rs])
        tol = 5 / math.sqrt(2 * noise.numel())
        assert abs(float(noise.std()) / sigma - 1) < tol, (stage, float(noise.std()), sigma)


def test_a_failed_test_skips_the_step_and_is_charged(tmp_path):
    """Users declared to hold 10,000 records but holding 20: at radius 2/100 nobody is close to anybody,
    W = 0, the test fails every round (w stays w0), and every round is charged all the same."""
    ds, fed, ledger = _setup(tmp_path)
    alg = _alg(fed, ledger, rounds=3, conc_records=10_000, conc_scale=2.0)
    w0 = fed.problem.init_params()
    res = alg.run(fed, Releaser(ledger, NoiseSource(0)), w0)
    assert res.details["passed_rounds"] == 0 and torch.equal(res.w, w0)
    assert ledger.num_releases() == 9
    assert ledger.spend(fed.user_ids[0]).rho == pytest.approx(alg.rho_total, rel=1e-12)


def test_refusals_come_before_any_data_is_read(tmp_path):
    ds = load_dataset("synthetic-logistic", n_users=40, m=10, d=4, seed=0)
    problem = make_problem("logistic", ds)
    fed = counting_federation(problem, ds)
    ledger = PrivacyLedger(tmp_path / "small.sqlite", Budget(0.5, 1e-5))
    with pytest.raises(ValueError, match="nothing was read"):  # 40 users at eps 0.5: the test cannot pass
        _alg(fed, ledger, rounds=10, conc_records=10)
    ids = tuple(fed.user_ids)
    spent = BuildContext(problem, 1.0, ids, 1e-5, 0.0, (0.0, 0.0), "cks", "replace-one", 0)
    with pytest.raises(Exception, match="spent"):
        OutlierGD(OutlierGDParams(lr=1.0), spent)
    big = PrivacyLedger(tmp_path / "big.sqlite", Budget(50.0, 1e-5))
    wrong_ids = [*ids, "one-more"]
    wrong_n = OutlierGD(
        OutlierGDParams(), BuildContext.fresh(eps=50.0, delta=1e-5, user_ids=wrong_ids, problem=problem)
    )
    with pytest.raises(ValueError, match="nothing was read"):
        wrong_n.run(fed, Releaser(big, NoiseSource(0)), problem.init_params())
    assert fed.calls == 0 and ledger.num_releases() == 0 and big.num_releases() == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"conc_records": 0},
        {"conc_scale": -1.0},
        {"conc_beta": 1.0},
        {"outlier_test_share": 0.0},
        {"outlier_delta_share": 1.0},
        {"neighbouring": "swap"},
    ],
)
def test_bad_settings_are_refused_in_one_line(bad):
    """Each refused in one line naming its flag: the hyperparameters by the Params, the relation by the class."""
    with pytest.raises(ValueError) as err:
        if "neighbouring" in bad:
            ids = [f"u{i}" for i in range(400)]
            ctx = BuildContext.fresh(
                eps=4.0, delta=1e-5, user_ids=ids, problem=SimpleNamespace(num_params=3), neighbouring="swap"
            )
            OutlierGD(OutlierGDParams(), ctx)
        else:
            OutlierGDParams(**bad)
    assert "\n" not in str(err.value)
    assert ("neighbouring" if "neighbouring" in bad else "--" + next(iter(bad)).replace("_", "-")) in str(err.value)


def test_the_exact_gaussian_conversion_is_refused_before_any_charge(tmp_path):
    from fedkl.runner import RunConfig, run_training

    out = tmp_path / "run"
    cfg = RunConfig.from_settings(strict=False, dataset="synthetic-logistic", problem="logistic",
                                  algorithm="noisy-gd-outlier", users=400, epsilon=4.0, rounds=2, conc_records=16,
                                  conversion="gaussian", reference=False, force=True, out=str(out))  # fmt: skip
    with pytest.raises(ValueError, match="conversion"):
        run_training(cfg, log=lambda s: None)
    assert PrivacyLedger(out / "ledger.sqlite").num_releases() == 0


def test_result_reports_the_ledgers_approximate_zcdp_accounting(tmp_path):
    """result.json's accountant says what the ledger composes (approximate zCDP: the Gaussian charges' rho
    converted by the budget's CKS at delta less the PTR deltas) and its epsilon is exactly that; the exact
    Gaussian conversion, which does not hold for approximate zCDP, would report less."""
    from fedkl.privacy.guarantee import Guarantee
    from fedkl.runner import RunConfig, run_training

    out = tmp_path / "run"
    cfg = RunConfig.from_settings(strict=False, dataset="synthetic-logistic", problem="logistic",
                                  algorithm="noisy-gd-outlier", users=400, epsilon=4.0, rounds=2, conc_records=16,
                                  reference=False, force=True, out=str(out))  # fmt: skip
    lines = []
    res = run_training(cfg, log=lines.append)
    assert res["guarantee"]["charges"] == "approx-zcdp"
    assert res["accountant"] == Guarantee("approx-zcdp").accountant("cks", None)
    assert "approximate zCDP" in res["accountant"] and "basic composition" not in res["accountant"]
    assert any(line.startswith("privacy:") and res["accountant"] in line for line in lines)
    ledger = PrivacyLedger(out / "ledger.sqlite")
    spends = {(r["rho"], r["eps"], r["delta"]) for r in ledger.user_spends()}
    assert len(spends) == 1  # every user: the same charges
    ((rho, eps, delta_ptr),) = spends
    assert eps == 0.0 and delta_ptr == pytest.approx(0.5 * res["delta"], rel=1e-9)  # the PTR deltas
    expected = zcdp_to_eps(rho, res["delta"] - delta_ptr, "cks")
    assert res["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert res["epsilon"] == res["epsilon_by_budget_conversion"] == ledger.summary()["max_user_epsilon"]
    assert zcdp_to_eps(rho, res["delta"] - delta_ptr, "gaussian") < 0.95 * res["epsilon"]


@pytest.mark.slow
def test_converges_and_beats_noisy_gd_when_users_hold_many_records(tmp_path):
    """n = 1000, d = 10, eps = 4, 30 rounds at lr 16, k = 2: the outlier-removal mean's noise ~ 14 R / W_min
    with R = 2/sqrt(m_train) falls with m; measured (seed 200): m = 100 -> 0.031, m = 1000 -> 0.0031,
    noisy-gd 0.0058."""
    out = {}
    for m in (100, 1000):
        ds, fed, ledger = _setup(tmp_path, n_users=1000, d=10, m=m, seed=200)
        w_opt = nonprivate_minimizer(fed.problem, ds.train)
        alg = _alg(fed, ledger, rounds=30, lr=16.0, conc_records=int(0.8 * m), conc_scale=2.0)
        res = alg.run(fed, Releaser(ledger, NoiseSource(0)), fed.problem.init_params())
        out[m] = float(fed.problem.loss(res.w, ds.train) - fed.problem.loss(w_opt, ds.train))
    gd_ledger = PrivacyLedger(tmp_path / "gd.sqlite", Budget(4.0, 1e-5))
    gd = NoisyGradientDescent(NoisyGDParams(rounds=30, lr=16.0), BuildContext.fresh(rho=gd_ledger.budget.rho))
    res = gd.run(fed, Releaser(gd_ledger, NoiseSource(0)), fed.problem.init_params())
    gd_excess = float(fed.problem.loss(res.w, ds.train) - fed.problem.loss(w_opt, ds.train))
    assert out[1000] < 0.7 * gd_excess and out[1000] < 0.3 * out[100], (out, gd_excess)
