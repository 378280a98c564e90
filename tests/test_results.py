"""Results first (issue 20): result.json is strict JSON, written as soon as the private model exists, and
updated by the non-private reference (cached per data and problem)."""

import json
import math
import os

import pytest

from fedkl import cli, results, runner


def _strict_load(path):
    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")

    with open(path) as f:
        return json.loads(f.read(), parse_constant=refuse)


def test_strict_encodes_non_finite_floats_as_strings_that_float_reads_back():
    value = {"a": math.inf, "b": [-math.inf, math.nan, 1.5], "c": (1, "x", None, True)}
    encoded = results.strict(value)
    assert encoded == {"a": "inf", "b": ["-inf", "nan", 1.5], "c": [1, "x", None, True]}
    assert float(encoded["a"]) == math.inf and math.isnan(float(encoded["b"][1]))
    json.dumps(encoded, allow_nan=False)


def test_result_json_parses_with_a_strict_parser(tmp_path):
    # dp-sgd's settings hold cap = inf (no cap on the second moment): written as the string "inf"
    out = tmp_path / "a"
    argv = ["run", "--dataset", "synthetic-logistic", "--users", "40", "--algorithm", "dp-sgd", "--rounds", "3"]
    assert cli.main([*argv, "--noise-seed", "1", "--lr", "0.5", "--out", str(out), "--no-reference"]) == 0
    saved = _strict_load(out / "result.json")
    assert saved["config"]["cap"] == "inf" and saved["nonprivate_reference"] is None


def test_result_json_is_written_before_the_reference_and_updated_after(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDKL_CACHE_DIR", str(tmp_path / "cache"))
    seen = {}
    reference = runner.reference_metrics

    def spy(evaluator, spec, log, **kw):
        seen["before"] = _strict_load(tmp_path / "a" / "result.json")
        return reference(evaluator, spec, log, **kw)

    monkeypatch.setattr(runner, "reference_metrics", spy)
    logs = []
    cfg = runner.RunConfig(dataset="synthetic-logistic", users=40, out=str(tmp_path / "a"), noise_seed=1)
    payload = runner.run_training(cfg, log=logs.append)
    before, after = seen["before"], _strict_load(tmp_path / "a" / "result.json")
    assert before["nonprivate_reference"] == "pending" and os.path.exists(before["model_path"])
    assert before["test_metrics"] == after["test_metrics"] == payload["test_metrics"]
    assert (
        after["nonprivate_reference"] == payload["nonprivate_reference"] and "accuracy" in after["nonprivate_reference"]
    )
    assert any("L-BFGS iteration 1 " in line for line in logs)  # progress, not silence

    # the same data and problem again: the reference comes from the cache, equal
    logs2 = []
    again = runner.run_training(runner.RunConfig(**{**cfg.__dict__, "out": str(tmp_path / "b")}), log=logs2.append)
    assert again["nonprivate_reference"] == payload["nonprivate_reference"]
    assert any("non-private reference: cached" in line for line in logs2)
    assert not any("L-BFGS iteration" in line for line in logs2)


def test_the_reference_cache_is_keyed_by_the_data_and_the_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDKL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = runner.RunConfig(dataset="synthetic-logistic", users=40)
    dataset, problem, name = runner.load_run_data(cfg)
    from fedkl.federation.inprocess import InProcessFederation
    from fedkl.problems import make_problem, problem_spec

    ev = InProcessFederation(problem, dataset)
    logs = []
    results.reference_metrics(ev, problem_spec(name, dataset, 0.0), logs.append)
    regularized = make_problem(name, dataset, reg=0.1)
    results.reference_metrics(InProcessFederation(regularized, dataset), problem_spec(name, dataset, 0.1), logs.append)
    other, p2, _ = runner.load_run_data(runner.RunConfig(dataset="synthetic-logistic", users=40, seed=1))
    results.reference_metrics(InProcessFederation(p2, other), problem_spec(name, other, 0.0), logs.append)
    assert sum("cached" in line for line in logs) == 0  # three different keys
    results.reference_metrics(ev, problem_spec(name, dataset, 0.0), logs.append)
    assert sum("cached" in line for line in logs) == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_write_json_never_writes_a_non_json_literal(tmp_path, bad):
    results.write_json(str(tmp_path / "r.json"), {"x": bad, "nested": {"y": [bad]}})
    assert _strict_load(tmp_path / "r.json") == {"x": results.strict(bad), "nested": {"y": [results.strict(bad)]}}
