"""Adaptive clipping for DP-FedAvg (Andrew et al. 2021): the count scale a, the sensitivity of the
released vector [sum h_i / C ; a sum (b_i - 1/2)] on adversarial neighbours, the noise std of the
release, the clip tracking the target quantile, the ledger charge, and refusals before data."""

import math
import pathlib

import pytest
import torch
from build_helpers import build
from release_spies import record_schedule_releases

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient import adaptive_clip
from fedkl.algorithms.gradient.dp_fedavg import DPFedAvg, DPFedAvgParams
from fedkl.data import load_dataset
from fedkl.federation.base import ClippedLocalUpdate
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy.accounting import GaussianSchedule, schedule_epsilon
from fedkl.problems import make_problem
from fedkl.runner import RunConfig

RELATIONS = ("add-remove", "replace-one")


def _fed(n_users=30, m=7, d=4, seed=0):
    ds = load_dataset("synthetic-logistic", n_users=n_users, m=m, d=d, seed=seed)
    return ds, InProcessFederation(make_problem("logistic", ds, reg=0.0), ds)


def _adaptive(**kw):
    base = dict(
        rounds=30, clip=1.0, local_steps=1, local_lr=0.5, accountant="rdp", adaptive_clip=True, clip_count_noise=2.0
    )
    return {**base, **kw}


def _alg(cfg, eps, delta, user_ids=()):
    """dp-fedavg at ``cfg`` (DPFedAvgParams, plus ``neighbouring``: add-remove by default) for the (eps, delta) left."""
    params = dict(cfg)
    ctx = BuildContext.fresh(
        eps=eps, delta=delta, user_ids=user_ids, neighbouring=params.pop("neighbouring", "add-remove")
    )
    return DPFedAvg(DPFedAvgParams(**params), ctx)


@pytest.mark.parametrize("neighbouring", RELATIONS)
@pytest.mark.parametrize("z,sigma_b", [(0.3, 0.5), (1.1, 2.0), (0.9, 25.0)])
def test_count_scale_gives_the_count_its_stated_noise(neighbouring, z, sigma_b):
    """The count coordinate's noise z * Delta(a) / a is sigma_b, with Delta the vector's sensitivity;
    the model's noise multiplier z r is Andrew et al.'s z_Delta: 1/z_Delta^2 = 1/z^2 - 1/(2 sigma_b)^2
    (add-remove)."""
    a = adaptive_clip.count_scale(z, sigma_b, neighbouring)
    r = adaptive_clip.norm_bound(a)
    delta = {"add-remove": math.sqrt(1 + a * a / 4), "replace-one": math.sqrt(4 + a * a)}[neighbouring]
    assert delta == pytest.approx(r if neighbouring == "add-remove" else 2 * r, rel=1e-14)
    assert z * delta / a == pytest.approx(sigma_b, rel=1e-12)
    if neighbouring == "add-remove":
        assert (z * r) ** -2 == pytest.approx(z**-2 - (2 * sigma_b) ** -2, rel=1e-12)


def _vector(rows, clip, a, failed=None):
    rows = torch.as_tensor(rows, dtype=torch.float64)
    mask = torch.zeros(len(rows), dtype=torch.bool) if failed is None else torch.tensor(failed)
    return adaptive_clip.contributions(rows, clip, mask, a).sum(0)


@pytest.mark.parametrize("neighbouring", RELATIONS)
def test_sensitivity_holds_and_is_attained_on_adversarial_neighbours(neighbouring):
    """On the worst neighbours (a clipped user against an absent one; a clipped user replaced by one
    pointing the other way just inside the clip), the server's vector moves by exactly the stated
    Delta (up to the tie margin), and never more on random neighbours, oversize answers (re-clipped
    by the server) or failures: a Delta without the count coordinate, or with |c| = 1, fails here."""
    torch.manual_seed(0)
    clip, a = 0.7, adaptive_clip.count_scale(1.3, 2.0, neighbouring)
    r = adaptive_clip.norm_bound(a)
    bound = r if neighbouring == "add-remove" else 2 * r
    others = torch.randn(5, 3, dtype=torch.float64)
    u = torch.tensor([3.0, -4.0, 12.0], dtype=torch.float64)  # norm 13 >> clip: clipped, b = 0
    if neighbouring == "add-remove":
        moved = _vector(torch.cat([others, u[None]]), clip, a) - _vector(others, clip, a)
    else:
        inside = -u / u.norm() * clip * (1 - 4 * adaptive_clip.TIE)  # just inside the ball: b = 1
        moved = _vector(torch.cat([others, u[None]]), clip, a) - _vector(torch.cat([others, inside[None]]), clip, a)
    assert float(moved.norm()) == pytest.approx(bound, rel=10 * adaptive_clip.TIE)
    assert float(moved.norm()) > math.sqrt(bound**2 - a * a / 4) * (1 + 1e-3)  # the count coordinate counts
    for trial in range(200):
        x = torch.randn(6, 3, dtype=torch.float64) * (10.0 ** torch.empty(6, 1).uniform_(-2, 2).double())
        y = x.clone()
        y[0] = torch.randn(3, dtype=torch.float64) * 10.0 ** (trial % 5 - 2)
        failed = [bool(trial % 3 == 0)] + [False] * 5
        if neighbouring == "add-remove":
            gap = _vector(x, clip, a, failed) - _vector(x[1:], clip, a)
        else:
            gap = _vector(x, clip, a, failed) - _vector(y, clip, a)
        assert float(gap.norm()) <= bound * (1 + 1e-12)
    # the indicator is the server's: a non-finite answer counts 0, an oversize one is re-clipped, b = 0
    bad = _vector([[float("nan"), 0.0, 0.0]], clip, a)
    assert torch.equal(bad, torch.zeros(4, dtype=torch.float64))
    big = adaptive_clip.contributions(
        torch.tensor([[0.0, 0.0, 50.0]], dtype=torch.float64), clip, torch.tensor([False]), a
    )
    assert float(big[0, :3].norm()) == pytest.approx(1.0) and float(big[0, 3]) == pytest.approx(-a / 2)


def _run(tmp_path, cfg, eps=3.0, delta=1e-5, noise_seed=0, **fed_kw):
    ds, fed = _fed(**fed_kw)
    ledger = PrivacyLedger(pathlib.Path(tmp_path) / "l.sqlite", Budget(eps, delta))
    alg = _alg(cfg, *ledger.approx_left(fed.user_ids), fed.user_ids)
    res = alg.run(fed, Releaser(ledger, NoiseSource(noise_seed)), fed.problem.init_params())
    return fed, ledger, alg, res


@pytest.mark.statistical
@pytest.mark.parametrize("neighbouring", RELATIONS)
def test_released_vector_noise_has_the_stated_scale(tmp_path, monkeypatch, neighbouring):
    """Every coordinate of every release (model part and count) carries noise of std z * Delta, the
    ledger's noise scale, within 5 standard errors; so the count's noise is z Delta / a = sigma_b."""
    pairs = record_schedule_releases(monkeypatch)
    q = 1.0 if neighbouring == "replace-one" else 0.5
    cfg = _adaptive(rounds=40, sampling_rate=q, neighbouring=neighbouring, clip_count_noise=20.0)
    fed, ledger, alg, res = _run(tmp_path, cfg, d=50, n_users=20)
    a, z = alg.count_scale, res.noise_multiplier
    delta = math.sqrt(1 + a * a / 4) * (2 if neighbouring == "replace-one" else 1)
    assert res.sigma == pytest.approx(z * delta, rel=1e-12)
    assert res.sigma / a == pytest.approx(20.0, rel=1e-12)  # the count's effective noise is sigma_b
    (row,) = ledger.releases()
    assert row["sensitivity"] == pytest.approx(delta, rel=1e-12) and row["noise_scale"] == pytest.approx(res.sigma)
    noise = torch.stack([o - v for v, o in pairs])  # (rounds, d + 1)
    assert noise.shape == (40, 51)
    assert abs(float(noise.std()) / res.sigma - 1) < 5 / math.sqrt(2 * noise.numel())
    count = noise[:, -1] / a
    assert abs(float(count.std()) / 20.0 - 1) < 5 / math.sqrt(2 * len(count))


@pytest.mark.parametrize("quantile", [0.5, 0.8])
def test_clip_tracks_the_target_quantile_of_update_norms(tmp_path, quantile):
    """At a large budget, with the model held (server lr 1e-6) so that the update norms stay those
    at w0, the clip moves from 10x too large to the target quantile of the 200 users' update norms:
    over the last 20 rounds the fraction of norms below the clip is gamma within 0.05 (the count's
    noise sigma_b / n = 0.005; one user is 1/n = 0.005; a round moves the clip by <= exp(eta |b - gamma|))."""
    cfg = _adaptive(rounds=120, clip=1.0, server_lr=1e-6, clip_quantile=quantile, clip_count_noise=1.0)
    fed, ledger, alg, res = _run(tmp_path, cfg, eps=700.0, n_users=200)
    w0 = fed.problem.init_params()
    norms = fed.compute(ClippedLocalUpdate(w0, 1e9, 1, 0.5)).values.norm(dim=1)
    first = float((norms <= res.history[0]["clip"]).double().mean())
    assert first == 1.0  # it starts above every norm
    tail = [float((norms <= r["clip"]).double().mean()) for r in res.history[-20:]]
    assert abs(sum(tail) / len(tail) - quantile) < 0.05
    assert res.details["final_clip"] == pytest.approx(
        res.history[-1]["clip"] * math.exp(-alg.params.clip_lr * (res.history[-1]["unclipped_fraction"] - quantile))
    )


def test_one_schedule_charged_to_everyone_up_front(tmp_path):
    cfg = _adaptive(rounds=6, sampling_rate=0.4)
    fed, ledger, alg, res = _run(tmp_path, cfg)
    eps = schedule_epsilon(GaussianSchedule(res.noise_multiplier, 0.4, 6), res.delta, "rdp")
    assert res.epsilon == pytest.approx(eps, rel=1e-12) and eps == pytest.approx(3.0, rel=1e-3)
    (row,) = ledger.releases()
    assert row["mechanism"] == "gaussian-schedule" and row["users"] == 30 and row["label"] == "dp-fedavg/schedule"
    assert row["sensitivity"] == pytest.approx(adaptive_clip.norm_bound(alg.count_scale))
    ledger.verify()
    clips = [r["clip"] for r in res.history]
    assert clips[0] == cfg["clip"] and len(set(clips)) == len(clips)  # it adapts every round


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"clip_count_noise": 0.05}, "count noise 0.05 must exceed z/2"),
        ({"clip_count_noise": 0.05, "neighbouring": "replace-one"}, "must exceed z ="),
        ({"clip_quantile": 1.0}, "--clip-quantile"),
        ({"clip_count_noise": -1.0}, "--clip-count-noise"),
        ({"clip_lr": 10.0, "rounds": 100}, "float range"),
    ],
)
def test_refusals_before_data(tmp_path, kw, message):
    """Refused with one line before the federation is asked anything and before any charge."""
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(3.0, 1e-5))
    with pytest.raises(ValueError, match=message):
        _alg(_adaptive(**{"rounds": 5, **kw}), *ledger.approx_left(["u0", "u1"]), ["u0", "u1"])
    assert ledger.num_releases() == 0


def test_replace_one_needs_more_count_noise_than_add_remove(tmp_path):
    """Between z/2 and z the count noise has a scale under add-remove and none under replace-one."""
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(3.0, 1e-5))
    eps, delta = ledger.approx_left(["u0"])
    z = _alg(_adaptive(rounds=5, sampling_rate=1.0), eps, delta).schedule().noise_multiplier
    _alg(_adaptive(rounds=5, sampling_rate=1.0, clip_count_noise=0.75 * z), eps, delta)
    with pytest.raises(ValueError, match="must exceed z ="):
        _alg(_adaptive(rounds=5, neighbouring="replace-one", clip_count_noise=0.75 * z), eps, delta)


def test_builder_default_count_noise_is_the_expected_cohort_over_20(tmp_path):
    """The registered flags: --adaptive-clip off by default; the default count noise is q n / 20, and a
    population too small for it at this budget is refused by the builder (before any data)."""
    ds, fed = _fed(n_users=400)
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(3.0, 1e-5))
    assert RunConfig.from_settings(algorithm="dp-fedavg").params.adaptive_clip is False
    cfg = RunConfig.from_settings(
        algorithm="dp-fedavg",
        adaptive_clip=True,
        sampling_rate=0.5,
        accountant="rdp",
        rounds=5,
        epsilon=3.0,
        neighbouring="add-remove",
    )
    kw = dict(problem=fed.problem, dataset=ds, delta=1e-5, ledger=ledger)
    alg = build(cfg, 0.0, user_ids=fed.user_ids, **kw)
    assert alg.clip_count_noise == pytest.approx(0.5 * 400 / 20)
    with pytest.raises(ValueError, match="must exceed z/2"):
        build(cfg, 0.0, user_ids=fed.user_ids[:20], **kw)  # q n / 20 = 0.5
    assert ledger.num_releases() == 0


def test_cli_refuses_a_cohort_too_small_for_the_default_count_noise(tmp_path, capsys):
    """`fedkl run --adaptive-clip` on 20 users at q = 0.5: q n / 20 = 0.5 <= z/2, exit 2 with one line,
    nothing charged."""
    from fedkl import cli

    out = tmp_path / "run"
    argv = ["run", "--dataset", "synthetic-logistic", "--users", "20", "--algorithm", "dp-fedavg"]
    argv += ["--adaptive-clip", "--neighbouring", "add-remove", "--sampling-rate", "0.5", "--accountant", "rdp"]
    assert cli.main([*argv, "--no-reference", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "count noise 0.5 must exceed z/2" in err and len(err.strip().splitlines()) == 1
    with PrivacyLedger(out / "ledger.sqlite") as ledger:
        assert ledger.num_releases() == 0
