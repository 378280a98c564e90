"""`fedkl plan --charges` (fedkl.planner.charge_plan) lists, before any data is read, exactly the
charges the run then makes: for every registered algorithm, the ledger of a real run equals the
plan (labels, mechanisms, typed charges and the users charged), so a charge that starts to depend on
the records fails here. kl-adaptive-gd chooses later costs from earlier releases (declared
adaptive): its first charge is fixed and the rest stay within the same budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from build_helpers import small_config  # tests/build_helpers.py

from fedkl import cli
from fedkl.algorithms.registry import REGISTRY
from fedkl.algorithms.round_log import NOT_PUBLIC
from fedkl.planner import charge_plan, public_standin
from fedkl.privacy import Budget, PrivacyLedger
from fedkl.runner import RunConfig, load_run_dataset, run_training

KEEP = ("label", "mechanism", "charge", "users", "cohort")


_config = small_config


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_plan_is_the_runs_charges(tmp_path, name):
    _plan_equals_run(_config(name, tmp_path / "run"))


def test_the_plan_is_the_runs_charges_with_adaptive_clipping(tmp_path):
    _plan_equals_run(_config("dp-fedavg", tmp_path / "run", adaptive_clip=True, clip_count_noise=5.0))


def _plan_equals_run(cfg: RunConfig) -> tuple[dict, dict]:
    plan = charge_plan(cfg)
    said: list[str] = []
    result = run_training(cfg, log=said.append)
    _check_round_metrics(Path(result["out_dir"]), said)
    with PrivacyLedger(result["ledger"]["path"]) as ledger:
        real = [{k: r[k] for k in KEEP} for r in ledger.releases()]
    assert real and plan["releases"]
    if plan["adaptive"]:
        assert real[0] == plan["releases"][0]
        assert {r["label"].split("/")[0] for r in real} == {r["label"].split("/")[0] for r in plan["releases"]}
        rho = [sum(r["charge"].get("rho", 0.0) for r in rs) for rs in (real, plan["releases"])]
        assert max(rho) <= Budget(**result["ledger"]["budget"]).rho * (1 + 1e-9)
    else:
        assert real == plan["releases"]
    return plan, result


def _check_round_metrics(out: Path, said: list[str]) -> None:
    """Every algorithm's run writes its per-round metrics without a failure (one JSON object a round, the CSV's
    rows the same, a valid PNG), or, a one-shot release, none of the files (issue 31, Operations)."""
    assert not [line for line in said if "could not write the per-round metrics" in line]
    if not (out / "metrics.jsonl").exists():
        assert not any(line.startswith("wrote ") and "rounds' metrics" in line for line in said)
        return
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all("round" in r and not NOT_PUBLIC & set(r) for r in rows)  # no secret sample size
    assert (out / "metrics.csv").read_text().count("\n") == len(rows) + 1
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(f"wrote {len(rows)} rounds' metrics" in line for line in said)


def test_the_standin_keeps_only_public_shape():
    ds = load_run_dataset(RunConfig.from_settings(dataset="synthetic-logistic", users=7))
    standin = public_standin(ds)
    assert standin.train.user_ids == ds.train.user_ids and standin.train.dim == ds.train.dim
    assert float(standin.train.X.abs().sum()) == 0.0 and bool((standin.train.y == 1).all())
    assert standin.train.num_records == 2 * 7


def test_fedkl_plan_charges_prints_and_writes_json(capsys):
    argv = ["plan", "--charges", "--algorithm", "noisy-gd", "--dataset", "synthetic-logistic", "--users", "9",
            "--rounds", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "noisy-gd/round-0 .. noisy-gd/round-3 (4x): GaussianCharge(" in out and "to 9 users" in out
    assert cli.main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["releases"]) == 4 and plan["releases"][0]["charge"]["type"] == "GaussianCharge"


@pytest.mark.parametrize("name", ["sc-output-pert", "phased-erm", "phased-sco", "sc-phased-erm", "sc-phased-sco"])
def test_private_delta_selection_charges_every_call_twice_within_the_budget(tmp_path, name):
    """--p002-delta-select sparse-vector: each release is preceded by its AboveThreshold charge
    (eps_sel = 1/4 of the call's eps with --p002-select-fraction 0.25, delta 0) and every user's entries compose to at most the budget.
    The plan lists the same entries (labels, mechanisms, (eps, delta), users); only the releases' noise
    scale follows the privately chosen Delta (a private output: the later charge is adaptive)."""
    cfg = _config(
        name, tmp_path / "run", p002_delta_select="sparse-vector", p002_select_fraction=0.25, users=60, epsilon=16.0
    )
    public = ("label", "mechanism", "users", "cohort")
    plan = [({k: r[k] for k in public}, r["charge"]["eps"], r["charge"]["delta"]) for r in charge_plan(cfg)["releases"]]
    result = run_training(cfg, log=lambda s: None)
    with PrivacyLedger(result["ledger"]["path"]) as ledger:
        rows = ledger.releases()
        real = [({k: r[k] for k in public}, r["eps"], r["delta"]) for r in rows]
        spent = [ledger.spend(u).eps for u in load_run_dataset(cfg).train.user_ids]
    assert real and real == plan[: len(real)]  # the SC variants stop after a localisation ⊥ (post-processing)
    assert len(real) == len(plan) or name.startswith("sc-phased")
    assert [r["mechanism"] for r in rows] == ["above-threshold", "stability-gaussian"] * (len(rows) // 2)
    for sel, rel in zip(rows[::2], rows[1::2]):
        assert sel["label"] == rel["label"] + "/select-Delta" and sel["delta"] == 0.0
        assert sel["eps"] == pytest.approx(0.25 * (sel["eps"] + rel["eps"]))
    assert max(spent) <= 16.0 * (1 + 1e-9)
    if len(real) == len(plan):  # the composed total is the budget (sco: for its cohorts' users)
        assert max(spent) == pytest.approx(16.0) and (name.endswith("sco") or min(spent) == pytest.approx(16.0))
