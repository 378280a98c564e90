"""The run layer (issue 29 §2): one result writer for every backend, one data-loading rule, typed reads of the
optional hyperparameters."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from fedkl import results, runner
from fedkl.algorithms.catalog import REGISTRY
from fedkl.algorithms.contract import Clip, PoissonSampling, Rounds
from fedkl.data.files import dataset_kwargs


def _strict_load(path):
    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")

    with open(path) as f:
        return json.loads(f.read(), parse_constant=refuse)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_optional_hyperparameters_are_read_by_type_and_that_type_is_their_only_definition(name):
    """The runner, planner and forecast read rounds, clip, accountant and sampling_rate by their mixin's type
    (isinstance), not by probing attributes: that reads every one of them only if an algorithm has such a field
    exactly when its Params derive from the mixin."""
    fields = {f.name for f in dataclasses.fields(REGISTRY[name].params)}
    for field, mixin in (("rounds", Rounds), ("clip", Clip), ("accountant", PoissonSampling)):
        assert (field in fields) == issubclass(REGISTRY[name].params, mixin), (name, field)


def test_a_deployments_record_gives_the_same_result_json_as_the_run_it_records(tmp_path):
    """The gRPC path (a ServerApp's flower_result.json read back by `fedkl run --backend grpc`) goes through
    Trained.record / from_record and the one writer: strict JSON, and the same result.json as in-process."""
    cfg = runner.RunConfig(dataset="synthetic-logistic", users=12, noise_seed=3, reference=False)
    cfg = dataclasses.replace(cfg, params=dataclasses.replace(cfg.params, rounds=2))
    data = runner.RunData.load(cfg)
    place = runner.prepare_run(dataclasses.replace(cfg, out=str(tmp_path / "a")), data.dataset.train.num_users)
    result, summary, declared = runner.train_federation(
        cfg, data.evaluator, data.problem, data.dataset, place.delta, place.ledger_path, place.run_id,
        place.noise, lambda _: None,
    )  # fmt: skip
    result.sigma = math.inf  # a non-finite value: strict JSON writes it as a string
    trained = runner.Trained(result, summary, declared, None)
    results.write_json(str(tmp_path / "record.json"), trained.record())
    back = runner.Trained.from_record(_strict_load(tmp_path / "record.json"))
    assert torch.equal(back.result.w, result.w) and back.declared == declared and back.summary == summary
    payloads = []
    for i, t in enumerate((trained, back)):
        where = place._replace(out=str(tmp_path / f"out{i}"))
        os.makedirs(where.out)
        runner.write_run_files(cfg, t, data, where, resume=None, started=0.0, log=lambda _: None)
        payloads.append(_strict_load(os.path.join(where.out, "result.json")))
    for p in payloads:
        del p["wall_time_s"], p["out_dir"], p["model_path"]
    assert payloads[0] == payloads[1] and payloads[0]["sigma_sum"] == "inf"


@pytest.mark.parametrize(
    "settings, kwargs",
    [
        ({"dataset": "movielens", "seed": 2}, {"split_seed": 2}),
        ({"dataset": "synthetic-logistic", "seed": 1, "users": 30}, {"seed": 1, "n_users": 30}),
        ({"dataset": "x.csv", "seed": 1, "label_column": "y"}, {"split_seed": 1, "label_column": "y"}),
        (
            {"dataset": "sites", "seed": 0, "sites": "a,b", "task": "binary"},
            {"split_seed": 0, "sites": "a,b", "task": "binary"},
        ),
    ],
)
def test_the_server_and_the_clients_load_a_runs_data_by_one_rule(settings, kwargs):
    from fedkl.flower.codec import ClientSpec

    assert dataset_kwargs(settings) == kwargs
    rc = {"fedkl-" + k.replace("_", "-"): v for k, v in settings.items()}
    assert ClientSpec.from_user_config({**rc, "fedkl-problem": "logistic"}).kwargs[0] == kwargs


@pytest.mark.parametrize(
    "settings",
    [{"dataset": "movielens", "users": 3}, {"dataset": "x.csv", "users": 3}, {"dataset": "tv16", "task": "binary"}],
)
def test_a_data_setting_that_does_not_apply_is_refused_in_one_line(settings):
    with pytest.raises(ValueError, match="applies to synthetic datasets|apply to --dataset FILE"):
        dataset_kwargs({"seed": 0, **settings})
