"""Trust is an explicit opt-in (issue 28 §2): an algorithm whose guarantee assumes in-class clients (the
paper-002 diameter test and Delta selection, the fkt family) refuses a deployed run (clients run their
own code: every Flower backend, `flwr run`'s ServerApp) unless the operator states ``--clients in-class``
(run config ``fedkl-clients``); the refusal is one line, before anything is read or charged; the
printed privacy line says the assumption next to epsilon. A failed client over the LocalGrid (NaN
replies) changes neither whether a paper-002 run completes nor its charges."""

from __future__ import annotations

import pytest
import torch

from fedkl.flower import codec
from fedkl.flower.localgrid import nan_reply
from fedkl.flower.server_app import _run_config_from_user_config, run_flower_simulation
from fedkl.privacy import PrivacyLedger
from fedkl.privacy.clients import ANY_CLIENTS, FEDKL_CLIENTS, IN_CLASS_CLIENTS, assumption, require_trust
from fedkl.runner import RunConfig, run_training

pytestmark = pytest.mark.flower

USERS = 40
P002 = dict(algorithm="sc-output-pert", epsilon=8.0, reg=0.5, p002_test="vertex-cover", stability_delta=0.5)


def _cfg(tmp_path, name, **kw):
    base = dict(
        dataset="synthetic-logistic",
        problem="logistic",
        seed=2,
        noise_seed=5,
        reference=False,
        force=True,
        kernels="reproducible",
        out=str(tmp_path / name),
    )
    return RunConfig.from_settings(**{**base, **P002, **kw})


def _spec():
    return codec.ClientSpec.build(
        "synthetic-logistic", "logistic", {"n_users": USERS, "m": 6, "d": 3, "seed": 2}, {"reg": 0.5}
    )


def _rows(path):
    with PrivacyLedger(path) as ledger:
        return [(r["label"], r["users"], r["cohort"], r["eps"], r["delta"]) for r in ledger.releases()]


def test_an_in_class_guarantee_refuses_a_deployed_run_without_the_opt_in(tmp_path):
    cfg = _cfg(tmp_path, "refused")
    with pytest.raises(ValueError, match="--clients in-class") as err:
        run_flower_simulation(cfg, "flower-local", log=lambda s: None, spec=_spec())
    assert "\n" not in str(err.value) and "nothing was read or charged" in str(err.value)
    assert _rows(tmp_path / "refused" / "ledger.sqlite") == []  # nothing charged
    # with the opt-in it runs, and the same algorithm in-process (the server computes every answer) needs none
    fl = run_flower_simulation(
        _cfg(tmp_path, "fl", clients="in-class"), "flower-local", log=lambda s: None, spec=_spec()
    )
    ref = run_flower_simulation(_cfg(tmp_path, "ref"), "inprocess", log=lambda s: None, spec=_spec())
    assert fl["ledger"]["releases"] == ref["ledger"]["releases"] == 1
    assert (fl["w"] is None) == (ref["w"] is None) and (fl["w"] is None or torch.equal(fl["w"], ref["w"]))
    # an algorithm that holds against any clients needs no opt-in anywhere
    any_cfg = RunConfig.from_settings(
        dataset="synthetic-logistic", problem="logistic", rounds=2, kernels="reproducible", noise_seed=1,
        reference=False, out=str(tmp_path / "any"),
    )  # fmt: skip
    assert run_flower_simulation(any_cfg, "flower-local", log=lambda s: None, spec=_spec())["ledger"]["releases"] == 2


def test_the_opt_in_rule_and_its_run_config_key():
    require_trust(IN_CLASS_CLIENTS, "any", deployed=False, who="x")  # in-process: in class by construction
    require_trust(IN_CLASS_CLIENTS, "in-class", deployed=True, who="x")
    require_trust(ANY_CLIENTS, "any", deployed=True, who="x")
    with pytest.raises(ValueError, match="x's guarantee assumes in-class clients"):
        require_trust(IN_CLASS_CLIENTS, "any", deployed=True, who="x")
    with pytest.raises(ValueError, match="clients must be one of"):
        require_trust(ANY_CLIENTS, "all", deployed=False, who="x")
    with pytest.raises(ValueError, match="--clients must be one of"):
        RunConfig(clients="trusted")
    # flwr run's ServerApp reads the same setting from its run config (fedkl-clients; "" = the default)
    assert _run_config_from_user_config({"fedkl-clients": "in-class"}).clients == "in-class"
    assert _run_config_from_user_config({"fedkl-clients": ""}).clients == "any"
    assert [assumption(m) for m in (ANY_CLIENTS, IN_CLASS_CLIENTS)] == ["any clients", "assumes in-class clients"]
    assert assumption(FEDKL_CLIENTS).startswith("assumes fedkl clients")


def test_the_printed_privacy_line_states_the_assumption_next_to_epsilon(tmp_path):
    for kw, words in (
        (dict(**P002, users=USERS, force=True), "assumes in-class clients"),
        (dict(rounds=2), "any clients"),
    ):
        lines: list[str] = []
        cfg = RunConfig.from_settings(
            dataset="synthetic-logistic", noise_seed=1, reference=False, out=str(tmp_path / words[:3]), **kw
        )
        run_training(cfg, log=lines.append)
        (line,) = [s for s in lines if s.startswith("privacy: ")]
        assert line.startswith(f"privacy: user-level (replace-one; {words}) epsilon = "), line


def test_a_client_answering_nan_over_the_localgrid_changes_neither_completion_nor_charges(tmp_path):
    """The Flower path: a node whose every reply is NaN (the codec refuses it: failed, zero) against the same
    node answering honestly. Both runs complete and charge the same rows."""
    quiet = dict(log=lambda s: None, spec=_spec())
    honest = run_flower_simulation(_cfg(tmp_path, "honest", clients="in-class"), "flower-local", **quiet)
    liar = run_flower_simulation(
        _cfg(tmp_path, "liar", clients="in-class"), "flower-local", faults={1: nan_reply()}, **quiet
    )
    assert liar["failures"]["counts"] and not honest["failures"]["counts"]
    assert _rows(liar["ledger_path"]) == _rows(honest["ledger_path"]) and len(_rows(honest["ledger_path"])) == 1
