"""noisy-gd-conc (user-level winsorized mean inside noisy GD): both stages' noise calibrated to their
sensitivities (2C, 2 tau), the winsorized sum's sensitivity 2 tau attained and never exceeded on
adversarial replace-one neighbours, the release law exactly the Gaussian mechanism the ledger is
charged for, two charges per round, refusals before any data, and convergence (better than noisy-gd
when users hold many records)."""

import math
from types import SimpleNamespace

import pytest
import torch
from build_helpers import counting_federation  # tests/build_helpers.py

from fedkl.algorithms.gradient.concentrated_gd import ConcentratedGD, ConcentratedGDParams, winsorized_sum
from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
from fedkl.algorithms.nonprivate import nonprivate_minimizer
from fedkl.algorithms.registry import BuildContext
from fedkl.data import load_dataset
from fedkl.data.base import FederatedDataset, UserData
from fedkl.federation.base import GradientsAtPoints
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.charges import GaussianCharge
from fedkl.problems import make_problem


def _setup(tmp_path, n_users=60, d=8, m=20, seed=0, eps=2.0, name="logistic"):
    ds = load_dataset(f"synthetic-{name}", n_users=n_users, m=m, d=d, seed=seed)
    fed = InProcessFederation(make_problem(name, ds), ds)
    ledger = PrivacyLedger(tmp_path / f"ledger-{n_users}-{m}-{seed}-{eps}.sqlite", Budget(eps, 1e-5))
    return ds, fed, ledger


class _Recorder(Releaser):
    """Keeps (exact value, released value, sensitivity, rho) of every Gaussian release."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.releases = []

    def gaussian(self, value, **kw):
        out = super().gaussian(value, **kw)
        self.releases.append((value.clone(), out.clone(), kw["sensitivity"], kw["rho"]))
        return out


def _conc(rho, n, d, relation="replace-one", **params):
    """noisy-gd-conc built for n users, d parameters and a zCDP budget rho (``params``: ConcentratedGDParams)."""
    ctx = BuildContext.fresh(
        rho=rho, user_ids=[f"u{i}" for i in range(n)], problem=SimpleNamespace(num_params=d), neighbouring=relation
    )
    return ConcentratedGD(ConcentratedGDParams(**params), ctx)


def _tau_by_hand(clip, m, beta, n, d, rho_centre, factor, scale=None):
    k = scale if scale is not None else 2 * (1 + math.sqrt(2 * math.log(n / beta)))
    sigma_centre = factor * clip / math.sqrt(2 * rho_centre)
    return k * clip / math.sqrt(m) + sigma_centre * (math.sqrt(d) + math.sqrt(2 * math.log(1 / beta))) / n


def test_tau_is_the_public_formula_and_shrinks_like_one_over_sqrt_m():
    rho, n, d = 0.5, 200, 11
    algs = {m: _conc(rho, n, d, rounds=5, conc_records=m, conc_centre="fresh") for m in (4, 16, 64)}
    for m, alg in algs.items():
        rho_centre = 0.5 * rho / 5
        assert alg.rho_centre == pytest.approx(rho_centre, rel=1e-12)
        assert alg.rho_centre + alg.rho_winsorized == pytest.approx(rho / 5, rel=1e-12)
        assert alg.tau == pytest.approx(_tau_by_hand(1.0, m, 0.05, n, d, rho_centre, 2.0), rel=1e-12)
    # the concentration part halves when m quadruples; the centre-noise part does not depend on m
    e = algs[4].centre_error
    assert (algs[16].tau - e) / (algs[4].tau - e) == pytest.approx(0.5, rel=1e-12)
    assert (algs[64].tau - e) / (algs[16].tau - e) == pytest.approx(0.5, rel=1e-12)
    scaled = _conc(rho, n, d, rounds=5, conc_records=16, conc_scale=1.5)
    assert scaled.tau == pytest.approx(1.5 / 4 + e, rel=1e-12)


@pytest.mark.parametrize("relation,factor", [("replace-one", 2.0), ("add-remove", 1.0)])
@pytest.mark.statistical
def test_noise_of_both_stages_matches_their_sensitivities(tmp_path, relation, factor):
    """Stage 1: std factor*C/sqrt(2 rho1); stage 2: factor*tau/sqrt(2 rho2), tau from the formula by
    hand. 40 rounds x 150 coordinates = 6,000 draws per stage: the sample std's standard error is
    0.9%; 5 of them is far inside the x2 of the wrong relation or a scale computed from C instead of tau."""
    ds, fed, ledger = _setup(tmp_path, d=150)
    rho, rounds, clip, m = ledger.budget.rho, 40, 0.7, 25
    alg = _conc(
        rho,
        fed.num_users,
        fed.num_params,
        relation=relation,
        rounds=rounds,
        lr=0.5,
        clip=clip,
        conc_records=m,
        conc_centre="fresh",
    )
    rho1, rho2 = 0.5 * rho / rounds, 0.5 * rho / rounds
    tau = _tau_by_hand(clip, m, 0.05, fed.num_users, fed.num_params, rho1, factor)
    expected = (factor * clip / math.sqrt(2 * rho1), factor * tau / math.sqrt(2 * rho2))
    assert abs(math.log(tau / clip)) > math.log(2)  # the scales differ: a test confusing them fails
    rel = _Recorder(ledger, NoiseSource(11), ZCDPFilter(rho))
    alg.run(fed, rel, fed.problem.init_params())
    assert len(rel.releases) == 2 * rounds
    for stage, sigma in enumerate(expected):
        stage_releases = rel.releases[stage::2]
        noise = torch.cat([out - exact for exact, out, _, _ in stage_releases])
        N = noise.numel()
        tol = 5 / math.sqrt(2 * N)
        assert abs(float(noise.std()) / sigma - 1) < tol < 0.1
        assert abs(float(noise.mean())) < 5 * sigma / math.sqrt(N)
        assert all(r[2] == pytest.approx(sigma * math.sqrt(2 * r[3]), rel=1e-12) for r in stage_releases)


def _least_squares_with_user0(ds, X0, y0):
    tr = ds.train
    mine = tr.user_index == 0
    X, y = tr.X.clone(), tr.y.clone()
    X[mine], y[mine] = X0, y0
    return FederatedDataset("adv", UserData(X, y, tr.user_index, tr.user_ids), ds.test, ds.task, 1.0, "adv")


def test_winsorized_sum_sensitivity_is_attained_and_never_exceeded(dishonest_records):
    """Replace-one: ||S2(x) - S2(x')|| <= 2 tau for any replacement of user 0's records (even records
    far outside every bound, i.e. any client), and = 2 tau for the pair pulling user 0's gradient far
    to either side of the centre: the noise's sensitivity is exact, not loose."""
    ds = load_dataset("synthetic-least-squares", n_users=25, m=8, d=4, seed=5)
    problem = make_problem("least-squares", ds)
    g = torch.Generator().manual_seed(0)
    tau = 0.3
    mine = ds.train.user_index == 0
    k = int(mine.sum())

    def s2(data, w, centre):
        grads = InProcessFederation(problem, data).compute(GradientsAtPoints(w.unsqueeze(0))).values[:, 0]
        return winsorized_sum(grads, centre, tau)[0]

    worst = 0.0
    for trial in range(20):
        w = torch.randn(problem.num_params, generator=g, dtype=torch.float64)
        centre = torch.randn(problem.num_params, generator=g, dtype=torch.float64) * 0.5
        X0 = torch.randn(k, ds.train.dim, generator=g, dtype=torch.float64) * 10 ** (trial % 4)
        y0 = torch.randn(k, generator=g, dtype=torch.float64) * 1e3
        diff = float((s2(ds, w, centre) - s2(_least_squares_with_user0(ds, X0, y0), w, centre)).norm())
        assert diff <= 2 * tau * (1 + 1e-12)
        # the attaining pair: every record x = v (unit), label +-1e8, so grad f_0 = (<w, v> -+ 1e8) v
        v = torch.randn(ds.train.dim, generator=g, dtype=torch.float64)
        v = v / v.norm()
        plus = _least_squares_with_user0(ds, v.expand(k, -1).clone(), torch.full((k,), 1e8, dtype=torch.float64))
        minus = _least_squares_with_user0(ds, v.expand(k, -1).clone(), torch.full((k,), -1e8, dtype=torch.float64))
        worst = float((s2(plus, w, centre) - s2(minus, w, centre)).norm())
        assert worst == pytest.approx(2 * tau, rel=1e-9)


def test_release_law_is_the_charged_gaussian_mechanism_on_the_worst_pair(tmp_path):
    """The winsorized release is value + N(0, s2^2 I) (noise law: the statistical test above) and the
    worst neighbours move the value by exactly 2 tau (previous test); so the two output laws are
    N(S, s2^2 I) and N(S', s2^2 I) with ||S - S'|| / s2 = sqrt(2 rho2): exactly the rho2-zCDP Gaussian
    mechanism, the charge the ledger holds (GaussianCharge(rho2, 2 tau)) and no less."""
    ds, fed, ledger = _setup(tmp_path)
    rho = ledger.budget.rho
    alg = _conc(rho, fed.num_users, fed.num_params, rounds=3, lr=1.0, conc_records=20, conc_centre="fresh")
    alg.run(fed, Releaser(ledger, NoiseSource(1), ZCDPFilter(rho)), fed.problem.init_params())
    winsorized = [r for r in ledger.releases() if r["label"].endswith("/winsorized")]
    assert len(winsorized) == 3
    for r in winsorized:
        charge = GaussianCharge(r["charge"]["rho"], r["charge"]["sensitivity"])
        assert charge.sensitivity == pytest.approx(2 * alg.tau, rel=1e-12)
        mu = 2 * alg.tau / alg.sigma_winsorized  # the worst pair's mean shift in units of the noise
        assert mu**2 / 2 == pytest.approx(charge.rho, rel=1e-12)


def test_fresh_centres_charge_centre_and_winsorized_mean_every_round_to_every_user(tmp_path):
    ds, fed, ledger = _setup(tmp_path)
    rho, rounds = ledger.budget.rho, 4
    alg = _conc(
        rho, fed.num_users, fed.num_params, rounds=rounds, lr=1.0, clip=0.5, conc_records=20, conc_centre="fresh"
    )
    res = alg.run(fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(rho)), fed.problem.init_params())
    releases = ledger.releases()
    assert [r["label"] for r in releases] == [
        f"noisy-gd-conc/round-{t}/{stage}" for t in range(rounds) for stage in ("centre", "winsorized")
    ]
    for r in releases:
        centre = r["label"].endswith("/centre")
        assert r["charge"]["rho"] == pytest.approx(rho / rounds / 2, rel=1e-12)
        assert r["charge"]["sensitivity"] == pytest.approx(2 * 0.5 if centre else 2 * alg.tau, rel=1e-12)
    for uid in fed.user_ids:
        spend = ledger.spend(uid)
        assert spend.releases == 2 * rounds and spend.rho == pytest.approx(rho, rel=1e-12)
    assert res.rho_spent == pytest.approx(rho, rel=1e-12)
    ledger.verify()


@pytest.mark.parametrize(
    "bad",
    [
        {"conc_records": 0},
        {"conc_records": 2.5},
        {"conc_scale": -1.0},
        {"conc_beta": 1.0},
        {"conc_beta": 0.0},
        {"conc_centre_share": 0.0},
        {"conc_centre_share": 1.0},
        {"clip": float("inf")},
        {"neighbouring": "swap"},
        {"conc_centre": "middle"},
    ],
)
def test_bad_settings_are_refused_in_one_line(bad):
    """Each refused in one line naming its flag: the hyperparameters by the Params, the relation by the class."""
    with pytest.raises(ValueError) as err:
        if "neighbouring" in bad:
            _conc(1.0, 10, 3, relation=bad["neighbouring"])
        else:
            ConcentratedGDParams(**bad)
    assert "\n" not in str(err.value)
    assert ("neighbouring" if "neighbouring" in bad else "--" + next(iter(bad)).replace("_", "-")) in str(err.value)


def test_refusals_come_before_any_data_is_read(tmp_path):
    ds, _, _ = _setup(tmp_path)
    problem = make_problem("logistic", ds)
    fed = counting_federation(problem, ds)
    ctx = BuildContext(problem, 1.0, tuple(fed.user_ids), 1e-5, 0.0, (0.0, 0.0), "cks", "replace-one", 0)
    with pytest.raises(ValueError, match="zCDP budget"):  # a spent budget
        ConcentratedGD(ConcentratedGDParams(lr=1.0), ctx)
    with pytest.raises(ValueError, match="no problem"):  # research code that forgot the problem: one line
        ConcentratedGD(ConcentratedGDParams(lr=1.0), BuildContext.fresh(rho=1.0, user_ids=fed.user_ids))
    wrong_n = _conc(1.0, fed.num_users + 1, fed.num_params)
    ledger = PrivacyLedger(tmp_path / "refusals.sqlite", Budget(2.0, 1e-5))
    with pytest.raises(ValueError, match="nothing was read"):
        wrong_n.run(fed, Releaser(ledger, NoiseSource(0)), problem.init_params())
    assert fed.calls == 0 and ledger.num_releases() == 0


def _excess(tmp_path, algorithm, n_users, m, eps, seeds=2, root=False):
    out = []
    for s in range(seeds):
        ds, fed, ledger = _setup(
            tmp_path if root else tmp_path / algorithm, n_users=n_users, m=m, d=10, seed=200 + s, eps=eps
        )
        w_opt = nonprivate_minimizer(fed.problem, ds.train)
        rho = ledger.budget.rho
        if algorithm == "noisy-gd":
            alg = NoisyGradientDescent(NoisyGDParams(rounds=30, lr=16.0), BuildContext.fresh(rho=rho))
        else:
            alg = _conc(
                rho,
                fed.num_users,
                fed.num_params,
                rounds=30,
                lr=16.0,
                conc_records=int(0.8 * m),
                conc_scale=2.0,
                conc_centre=algorithm,
            )
        res = alg.run(fed, Releaser(ledger, NoiseSource(s), ZCDPFilter(rho)), fed.problem.init_params())
        out.append(fed.problem.loss(res.w, ds.train) - fed.problem.loss(w_opt, ds.train))
    return sum(out) / len(out)


def test_converges_and_beats_noisy_gd_when_users_hold_many_records(tmp_path):
    """n = 1000 users of m = 500 records (400 train; the declared m is the train count), eps = 1, d = 10,
    30 rounds at lr 16 (noiseless GD reaches 1e-5 there: the noise is the error), k = 2: the projection
    radius ~ C/sqrt(m) + the centre's error cuts the noise below noisy-gd's at the same (eps, delta);
    the previous-estimate centre (one release per round, tau -> ~0.18) more than the fresh one (two
    releases, tau ~ 0.45). Measured (2 seeds): noisy-gd ~0.10, fresh ~0.03, previous ~0.003."""
    for name in ("noisy-gd", "fresh", "previous"):
        (tmp_path / name).mkdir()
    gd = _excess(tmp_path, "noisy-gd", 1000, 500, 1.0)
    fresh = _excess(tmp_path, "fresh", 1000, 500, 1.0)
    previous = _excess(tmp_path, "previous", 1000, 500, 1.0)
    assert previous < 0.3 * fresh < 0.3 * 0.5 * gd, (previous, fresh, gd)
    assert previous < 0.01


def test_previous_centre_radii_follow_the_public_schedule():
    rho, n, d, T, m = 0.5, 300, 7, 6, 25
    for relation, factor in (("replace-one", 2.0), ("add-remove", 1.0)):
        alg = _conc(rho, n, d, relation=relation, rounds=T, clip=0.8, conc_records=m, conc_scale=2.0)
        a = factor * (math.sqrt(d) + math.sqrt(2 * math.log(1 / 0.05))) / (n * math.sqrt(2 * rho / T))
        expected = [0.8]
        for _ in range(T - 1):
            expected.append(2.0 * 0.8 / 5 + a * expected[-1])
        assert alg.radii == pytest.approx(expected, rel=1e-12)
        assert expected[-1] == pytest.approx(2.0 * 0.8 / 5 / (1 - a), rel=1e-3)  # the fixed point


@pytest.mark.statistical
def test_previous_centre_noise_and_charges_follow_the_radii(tmp_path):
    """One release per round at the whole round's rho, sensitivity 2 tau_t (tau_0 = C: noisy-gd's round);
    the released noise divided by 2 tau_t/sqrt(2 rho_t) is N(0, 1): 30 rounds x 150 coordinates."""
    ds, fed, ledger = _setup(tmp_path, d=150)
    rho, rounds, clip = ledger.budget.rho, 30, 0.7
    alg = _conc(rho, fed.num_users, fed.num_params, rounds=rounds, lr=0.5, clip=clip, conc_records=25, conc_scale=2.0)
    radii = alg.radii
    assert radii[0] == clip and abs(math.log(radii[-1] / clip)) > math.log(2)
    rel = _Recorder(ledger, NoiseSource(3), ZCDPFilter(rho))
    alg.run(fed, rel, fed.problem.init_params())
    sigmas = [2 * tau / math.sqrt(2 * rho / rounds) for tau in radii]
    noise = torch.cat([(out - exact) / s for (exact, out, _, _), s in zip(rel.releases, sigmas, strict=True)])
    tol = 5 / math.sqrt(2 * noise.numel())
    assert abs(float(noise.std()) - 1) < tol < 0.1
    releases = ledger.releases()
    assert [r["label"] for r in releases] == [f"noisy-gd-conc/round-{t}/winsorized" for t in range(rounds)]
    for r, tau in zip(releases, radii, strict=True):
        assert r["charge"]["sensitivity"] == pytest.approx(2 * tau, rel=1e-12)
        assert r["charge"]["rho"] == pytest.approx(rho / rounds, rel=1e-12)
    assert ledger.spend(fed.user_ids[0]).rho == pytest.approx(rho, rel=1e-12)


def test_fresh_centres_plan_equals_the_run(tmp_path):
    """The SMALL setting (default centre) is checked by tests/test_charge_plan.py; this is the other one."""
    from test_charge_plan import _config, _plan_equals_run

    _plan_equals_run(_config("noisy-gd-conc", tmp_path / "run", conc_centre="fresh"))


@pytest.mark.flower
def test_fresh_centres_over_flower_equal_inprocess(tmp_path):
    from test_algorithm_registry import _flower_equals_inprocess

    _flower_equals_inprocess(tmp_path, "noisy-gd-conc", {"conc_records": 20, "conc_centre": "fresh"})


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--conc-centre-share", "1.5"], "--conc-centre-share"),
        (["--conc-records", "0"], "--conc-records"),
        (["--conc-centre", "middle"], "--conc-centre"),
    ],
)
def test_fedkl_run_refuses_bad_settings_in_one_line_before_any_charge(tmp_path, capsys, flags, message):
    from fedkl.cli import main

    out = tmp_path / "run"
    argv = ["run", "--algorithm", "noisy-gd-conc", "--dataset", "synthetic-logistic", "--users", "20", *flags]
    try:
        code = main([*argv, "--out", str(out), "--no-reference"])
    except SystemExit as exit_:  # argparse's own range check
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (out / "ledger.sqlite").exists() or PrivacyLedger(out / "ledger.sqlite").num_releases() == 0


# --conc-centre histogram (Levy et al.'s coarse centre: fedkl/algorithms/gradient/histogram_centre.py)


def test_the_rotation_is_orthogonal_and_public():
    from fedkl.algorithms.gradient.histogram_centre import padded_dim, rotate, rotation_signs, unrotate

    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 11, generator=g, dtype=torch.float64)
    signs = rotation_signs(11, 123)
    assert padded_dim(11) == 16 and signs.numel() == 16 and torch.equal(signs, rotation_signs(11, 123))
    z = rotate(x, signs)
    assert torch.allclose(z.norm(dim=1), x.norm(dim=1), rtol=1e-12)
    assert torch.allclose(unrotate(z, signs, 11), x, rtol=0, atol=1e-12)
    assert not torch.allclose(z[:, :11], x)  # it does rotate


@pytest.mark.parametrize("relation,factor", [("replace-one", 2.0), ("add-remove", 1.0)])
def test_histogram_sensitivity_is_attained_and_never_exceeded(relation, factor):
    """Every user adds one count per rotated coordinate, so replacing user 0's vector by ANY other
    (huge, non-finite, anywhere) changes the table by <= sqrt(2 D) (zero-out: sqrt(D)); the pair that
    sends user 0 to opposite end bins on every coordinate attains it."""
    from fedkl.algorithms.gradient.histogram_centre import (
        histogram_counts,
        histogram_sensitivity,
        rotation_signs,
        unrotate,
    )

    n, d, clip, width = 30, 11, 1.0, 0.3
    D = 16
    bound = histogram_sensitivity(d, relation)
    assert bound == pytest.approx(math.sqrt(factor * D), rel=1e-15)
    g = torch.Generator().manual_seed(9)
    signs = rotation_signs(d, 77)
    rows = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.2
    base = histogram_counts(rows, signs, clip, width)
    assert torch.equal(base.sum(1), torch.full((D,), float(n), dtype=torch.float64))
    for trial in range(40):
        other = rows.clone()
        other[0] = torch.randn(d, generator=g, dtype=torch.float64) * 10 ** (trial % 5 - 1)
        if trial % 7 == 0:
            other[0, trial % d] = float("inf") if trial % 2 else float("nan")
        if relation == "replace-one":
            diff = histogram_counts(other, signs, clip, width) - base
        else:  # zero-out: the absent user adds no count
            diff = histogram_counts(other, signs, clip, width) - histogram_counts(rows[1:], signs, clip, width)
        assert float(diff.norm()) <= bound * (1 + 1e-12)
    # the attaining pair: rotated coordinates all +5 (top bin) vs all -5 (bottom bin)
    # a vector whose rotation is all +-5 needs d = D: the attaining pair lives in R^16
    ones = torch.full((1, D), 5.0, dtype=torch.float64)
    signs16 = rotation_signs(D, 77)
    rows16 = torch.randn(n, D, generator=g, dtype=torch.float64) * 0.2
    plus, minus = rows16.clone(), rows16.clone()
    plus[0], minus[0] = unrotate(ones, signs16, D)[0], unrotate(-ones, signs16, D)[0]
    if relation == "replace-one":
        diff = histogram_counts(plus, signs16, clip, width) - histogram_counts(minus, signs16, clip, width)
    else:
        diff = histogram_counts(plus, signs16, clip, width) - histogram_counts(rows16[1:], signs16, clip, width)
    assert float(diff.norm()) == pytest.approx(histogram_sensitivity(D, relation), rel=1e-12)


def test_histogram_centre_is_within_its_error_bound_of_concentrated_users():
    """Users within r of their mean: the noiseless table's centre lies within sqrt(D) w = 2 r L of the mean
    (the module's bound), far inside the clip."""
    from fedkl.algorithms.gradient.histogram_centre import (
        bin_width,
        centre_from_counts,
        histogram_counts,
        rotation_signs,
    )

    n, d, clip, r = 400, 10, 1.0, 0.05
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(d, generator=g, dtype=torch.float64)
    mean = 0.5 * mean / mean.norm()
    dev = torch.randn(n, d, generator=g, dtype=torch.float64)
    rows = mean + r * dev / dev.norm(dim=1, keepdim=True) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    w = bin_width(r, n, d, 0.05)
    signs = rotation_signs(d, 5)
    centre = centre_from_counts(histogram_counts(rows, signs, clip, w), signs, clip, w, d)
    err = float((centre - rows.mean(0)).norm())
    assert err <= 4 * w  # sqrt(D) w = 4 w
    assert err < 0.5


def test_histogram_centres_charge_histogram_and_winsorized_mean_every_round(tmp_path):
    ds, fed, ledger = _setup(tmp_path)
    rho, rounds = ledger.budget.rho, 3
    alg = _conc(
        rho, fed.num_users, fed.num_params, rounds=rounds, lr=1.0, clip=0.5, conc_records=20, conc_centre="histogram"
    )
    r = alg.scale * 0.5 / math.sqrt(20)
    D = 8  # d = 8 is a power of two
    L = math.sqrt(2 * math.log(2 * fed.num_users * D / 0.05))
    assert alg.bin_width == pytest.approx(2 * r * L / math.sqrt(D), rel=1e-12)
    assert alg.tau_histogram == pytest.approx(r * (1 + 2 * L), rel=1e-12)
    rel = _Recorder(ledger, NoiseSource(0), ZCDPFilter(rho))
    res = alg.run(fed, rel, fed.problem.init_params())
    releases = ledger.releases()
    assert [x["label"] for x in releases] == [
        f"noisy-gd-conc/round-{t}/{stage}" for t in range(rounds) for stage in ("histogram", "winsorized")
    ]
    for x in releases:
        hist = x["label"].endswith("/histogram")
        assert x["charge"]["rho"] == pytest.approx(rho / rounds / 2, rel=1e-12)
        assert x["charge"]["sensitivity"] == pytest.approx(
            math.sqrt(2 * D) if hist else 2 * alg.tau_histogram, rel=1e-12
        )
    counts = rel.releases[0][0]
    assert counts.shape[0] == D and torch.equal(
        counts.sum(1), torch.full((D,), float(fed.num_users), dtype=counts.dtype)
    )
    for uid in fed.user_ids:
        assert ledger.spend(uid).rho == pytest.approx(rho, rel=1e-12)
    assert res.rho_spent == pytest.approx(rho, rel=1e-12)
    ledger.verify()


@pytest.mark.statistical
def test_histogram_noise_matches_its_sensitivity(tmp_path):
    """The released table's noise has std sqrt(2 D)/sqrt(2 rho_centre): 20 rounds x 32 x ~20 cells; the
    sample std's standard error is < 1%, 5 of them far inside the sqrt(2) of the wrong relation."""
    ds, fed, ledger = _setup(tmp_path, d=30)
    rho, rounds = ledger.budget.rho, 20
    alg = _conc(
        rho,
        fed.num_users,
        fed.num_params,
        rounds=rounds,
        lr=0.5,
        conc_records=25,
        conc_scale=0.3,
        conc_centre="histogram",
        clip=1.0,
    )  # ~20 bins
    rel = _Recorder(ledger, NoiseSource(8), ZCDPFilter(rho))
    alg.run(fed, rel, fed.problem.init_params())
    sigma = math.sqrt(2 * 32) / math.sqrt(2 * rho / rounds / 2)
    noise = torch.cat([(out - exact).flatten() for exact, out, _, _ in rel.releases[0::2]])
    tol = 5 / math.sqrt(2 * noise.numel())
    assert abs(float(noise.std()) / sigma - 1) < tol < 0.1


@pytest.mark.slow
def test_histogram_centre_beats_noisy_gd_once_users_hold_many_records(tmp_path):
    """n = 1000, d = 10, eps = 4, 30 rounds, k = 2: tau = r (1 + 2L) with L ~ 5.2 shrinks like 1/sqrt(m)
    but starts above the clip; measured (2 seeds): m = 500 -> 0.020 (noisy-gd 0.0086), m = 2000 -> 0.0035."""
    for name in ("noisy-gd", "histogram-500", "histogram-2000"):
        (tmp_path / name).mkdir()
    gd = _excess(tmp_path / "noisy-gd", "noisy-gd", 1000, 2000, 4.0, seeds=1, root=True)
    h500 = _excess(tmp_path / "histogram-500", "histogram", 1000, 500, 4.0, seeds=1, root=True)
    h2000 = _excess(tmp_path / "histogram-2000", "histogram", 1000, 2000, 4.0, seeds=1, root=True)
    assert h2000 < 0.6 * gd and h2000 < 0.4 * h500, (h2000, gd, h500)


@pytest.mark.parametrize(
    "algorithm,centre", [("noisy-gd-conc", "previous"), ("noisy-gd-conc", "histogram"), ("noisy-gd-outlier", None)]
)
def test_conc_records_left_at_one_is_warned_before_any_budget_is_spent(tmp_path, algorithm, centre):
    """--conc-records 1 (the default) claims no concentration (tau or R > C: a noisier noisy-gd): fedkl run
    says so before the first release, for both concentration methods; a declared m says nothing."""
    from fedkl.runner import RunConfig, run_training

    for records, warned in ((1, True), (20, False)):
        out = tmp_path / f"{centre}-{records}"
        extra = {"conc_centre": centre} if centre else {"users": 400, "epsilon": 4.0}
        base = dict(dataset="synthetic-logistic", problem="logistic", algorithm=algorithm, users=30)
        cfg = RunConfig.from_settings(strict=False, **{**base, **extra}, rounds=2, conc_records=records,
                                      reference=False, force=True, out=str(out))  # fmt: skip
        lines: list[str] = []
        charged_at_warning = []

        def log(line, out=out):
            if line.startswith(f"warning: {algorithm} with --conc-records 1"):
                with PrivacyLedger(out / "ledger.sqlite") as ledger:
                    charged_at_warning.append(ledger.num_releases())
            lines.append(line)

        run_training(cfg, log)
        assert len(charged_at_warning) == int(warned) and all(c == 0 for c in charged_at_warning), lines


def test_histogram_centres_plan_equals_the_run(tmp_path):
    from test_charge_plan import _config, _plan_equals_run

    _plan_equals_run(_config("noisy-gd-conc", tmp_path / "run", conc_centre="histogram"))


@pytest.mark.flower
def test_histogram_centres_over_flower_equal_inprocess(tmp_path):
    from test_algorithm_registry import _flower_equals_inprocess

    _flower_equals_inprocess(tmp_path, "noisy-gd-conc", {"conc_records": 20, "conc_centre": "histogram"})
