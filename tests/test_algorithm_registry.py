"""Every algorithm is reachable from ``fedkl run``: its hyperparameters are RunConfig fields with the
defaults of the module that reads them, each has a CLI flag, and every registered algorithm trains
over the Flower backend (the real ServerApp/ClientApp pair on the deterministic LocalGrid) to the
same model, bit for bit, and the same ledger as in-process."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fedkl import cli
from fedkl.flower import codec
from fedkl.flower.server_app import run_flower_simulation
from fedkl.privacy import PrivacyLedger
from fedkl.runner import ALGORITHMS, RunConfig


def test_run_config_defaults_are_the_modules_defaults():
    d = RunConfig()
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    table = cli.algorithm_hyperparameters()
    assert set(table) <= fields
    for name, (default, text, origin) in table.items():
        assert getattr(d, name) == default, name
        assert text and origin


def test_cli_flags_reach_the_run_config(monkeypatch):
    seen = {}

    def fake_run(cfg, log):
        seen["cfg"] = cfg
        return {}

    monkeypatch.setattr("fedkl.runner.run_training", fake_run)
    assert cli.main(["run", "--algorithm", "kl-spider", "--kl-gamma", "0.5", "--kl-phases", "3", "--fkt-solver",
                     "one-shot", "--radius", "4", "--local-steps", "2", "--server-momentum", "0.9",
                     "--kl-select", "exponential", "--kl-f0", "none"]) in (0, None)
    cfg = seen["cfg"]
    assert (cfg.algorithm, cfg.kl_gamma, cfg.kl_phases, cfg.fkt_solver, cfg.radius) == ("kl-spider", 0.5, 3,
                                                                                          "one-shot", 4.0)
    assert (cfg.local_steps, cfg.server_momentum, cfg.kl_select, cfg.kl_f0) == (2, 0.9, "exponential", None)
    assert isinstance(cfg.kl_phases, int) and isinstance(cfg.radius, float)


@pytest.mark.parametrize("args,message", [(["--kl-phases", "2.5"], "expected a int"),
                                          (["--fkt-solver", "newton"], "invalid choice"),
                                          (["--radius", "nan"], "must be finite")])
def test_bad_hyperparameters_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# small, fast settings per algorithm (the schedules the theorems set are data-independent, so a
# short run exercises every query and release kind the algorithm makes). The dp-accounting schedules
# use RDP here: PLD calibration at the tiny populations of this test takes a minute per run.
# "users": the population when 12 users are too few for the algorithm's plan.
SCHEDULED = {"neighbouring": "add-remove", "sampling_rate": 0.5, "accountant": "rdp"}
SMALL = {
    "noisy-gd": {},
    "dp-sgd": SCHEDULED,
    "dp-rmsprop": {**SCHEDULED, "lr": 0.05},
    "dp-adam": {**SCHEDULED, "lr": 0.05},
    "dp-fedavg": {**SCHEDULED, "local_steps": 2, "batch_size": 3},
    "sc-output-pert": {"reg": 0.5},
    "phased-erm": {"reg": 0.1, "p002_delta_rule": "fixed", "p002_phases": 2, "p002_lam": 0.05},
    "phased-sco": {"reg": 0.1, "p002_delta_rule": "fixed", "p002_phases": 1, "p002_min_cohort": 4, "p002_lam": 0.05},
    "sc-phased-erm": {"reg": 0.5, "p002_delta_rule": "scaled", "p002_phases": 1},
    "sc-phased-sco": {"reg": 0.5, "p002_delta_rule": "scaled", "p002_phases": 1, "p002_min_cohort": 4},
    "mean-output-pert": {"users": 40, "mean_rho_fraction": 0.5},
    "phased-mean-output-pert": {"users": 60, "mean_rho_fraction": 0.5},
    "kl-adaptive-gd": {"reg": 0.1, "kl_max_rounds": 3},
    "kl-spider": {"reg": 0.1, "kl_max_rounds": 4, "kl_contraction_constant": 1.0, "kl_floor_constant": 1.0},
    "kl-prox-point": {"reg": 0.1, "kl_prox_steps": 2, "rounds": 2},
    "fkt-snowball": {"radius": 2.0},
    "fkt-snowball-sc": {"radius": 2.0, "reg": 0.1},
    "fkt-phased-sgd": {"radius": 2.0},
    "fkt-phased-erm": {"radius": 2.0},
    "fkt-sc-reduction": {"radius": 2.0, "reg": 0.1, "users": 48},
    "fkt-sc-localization": {"radius": 2.0, "reg": 0.1},
}


def test_every_registered_algorithm_has_a_small_setting():
    assert set(ALGORITHMS) <= set(SMALL), set(ALGORITHMS) - set(SMALL)


@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) & set(SMALL)))
def test_algorithm_over_flower_equals_inprocess(tmp_path, name):
    _flower_equals_inprocess(tmp_path, name, SMALL[name])


# paper 002 through the polynomial-time diameter test (CertifiedLocalMinimizer answers over Flower);
# 60 users > 8 kappa at these budgets
DIAMETER = {
    "phased-erm/matching": ("phased-erm", {"users": 60, "epsilon": 8.0, "reg": 0.1, "p002_phases": 2,
                                           "p002_test": "matching", "p002_delta_rule": "scaled",
                                           "p002_delta_scale": 50.0}),
    "sc-output-pert/vertex-cover": ("sc-output-pert", {"users": 40, "epsilon": 8.0, "reg": 0.5,
                                                       "p002_test": "vertex-cover", "stability_delta": 0.5}),
}


@pytest.mark.parametrize("case", sorted(DIAMETER))
def test_diameter_test_over_flower_equals_inprocess(tmp_path, case):
    name, kw = DIAMETER[case]
    out = _flower_equals_inprocess(tmp_path, name, kw)
    assert out["w"] is not None  # the settings release a model (not only ⊥)


def _flower_equals_inprocess(tmp_path, name, kw):
    kw = dict(kw)
    users = kw.pop("users", 12)
    spec = codec.ClientSpec.build("synthetic-logistic", "logistic", {"n_users": users, "m": 6, "d": 3, "seed": 2},
                                  {"reg": kw.get("reg", 0.0)})
    base = {**dict(dataset="synthetic-logistic", problem="logistic", algorithm=name, epsilon=3.0, rounds=3, lr=0.5,
                   clip=1.0, seed=2, noise_seed=5, reference=False,
                   force=True), **kw}  # tiny populations test the plumbing, not utility: skip the noise forecast
    quiet = dict(log=lambda s: None, spec=spec)
    ref = run_flower_simulation(RunConfig(**base, out=str(tmp_path / "ref")), "inprocess", **quiet)
    fl = run_flower_simulation(RunConfig(**base, out=str(tmp_path / "fl")), "flower-local", **quiet)
    assert fl["user_ids"] == ref["user_ids"]
    assert (fl["w"] is None) == (ref["w"] is None)
    if ref["w"] is not None:
        assert torch.equal(fl["w"], ref["w"])
    views = []
    for out in (ref, fl):
        with PrivacyLedger(out["ledger_path"]) as led:
            led.verify()
            views.append([(u, led.spend(u)) for u in out["user_ids"]])
    assert views[0] == views[1]
    assert ref["ledger"]["releases"] == fl["ledger"]["releases"] >= 1
    return ref


def test_new_query_kinds_over_flower_sim_ray(tmp_path):
    """DP-FedAvg's ClippedLocalUpdate and KL-Spider's GradientDifference through Flower's Ray
    simulation engine (one virtual SuperNode per user) release the in-process model bit for bit."""
    spec = codec.ClientSpec.build("synthetic-logistic", "logistic", {"n_users": 6, "m": 5, "d": 3, "seed": 1},
                                  {"reg": 0.1})
    quiet = dict(log=lambda s: None, spec=spec)
    for name in ("dp-fedavg", "kl-spider"):
        base = {**dict(dataset="synthetic-logistic", problem="logistic", algorithm=name, epsilon=3.0, rounds=2,
                       lr=0.5, seed=1, noise_seed=3, reference=False, reg=0.1), **SMALL[name]}
        base.pop("users", None)
        ref = run_flower_simulation(RunConfig(**base, out=str(tmp_path / f"{name}-ref")), "inprocess", **quiet)
        sim = run_flower_simulation(RunConfig(**base, out=str(tmp_path / f"{name}-sim")), "flower-sim", **quiet)
        assert sim["user_ids"] == ref["user_ids"] and torch.equal(sim["w"], ref["w"]), name
        assert sim["ledger"]["releases"] == ref["ledger"]["releases"] >= 1
