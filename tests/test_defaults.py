"""Honest defaults (issue 20): the tuned step sizes are the ones shipped, they beat the majority class on the
default dataset, and a configuration predicted to learn little is announced before any budget is spent."""

import os
import re
import sqlite3

import pytest

from fedkl.algorithms.forecast import LEARNS_LITTLE
from fedkl.algorithms.registry import REGISTRY, algorithm_spec
from fedkl.runner import RunConfig, run_training

# the report of simulations/studies/tune_step_sizes.toml, written by `fedkl report` from the study's committed
# table (tests/test_experiments.py::test_a_committed_study_report_reproduces_its_markdown checks it is)
TUNING = os.path.join(os.path.dirname(__file__), "..", "simulations", "results", "tune_step_sizes.md")


def _chosen() -> dict[str, float]:
    rows = {}
    for line in open(TUNING):
        m = re.match(r"\| ([a-z-]+) \| [^|]+ \| [^|]+ \| ([0-9.]+) \|", line)
        if m:
            rows[m.group(1)] = float(m.group(2))
    return rows


def test_every_step_size_default_is_the_documented_tunings_choice():
    chosen = _chosen()
    assert len(chosen) >= 6
    for name, lr in chosen.items():
        assert algorithm_spec(name).step_size == lr, name
    # every algorithm with a step size has one default, and a run records it (not None)
    for name, spec in REGISTRY.items():
        if any(f == "lr" for f in spec.params.__dataclass_fields__):
            assert spec.step_size > 0 and RunConfig(algorithm=name, dataset="movielens").params.lr == spec.step_size


def test_the_demo_states_that_its_settings_were_tuned_on_its_own_test_data():
    """Issue 32 ("honest defaults"): the defaults were picked on the test sets of tune_step_sizes.toml's
    datasets; when the default dataset (what `make demo` trains and the README reports) is one of them,
    the demo's recipe and the README's demo section say so, and the report re-derives the defaults without it."""
    from fedkl.experiments import load_sweep

    root = os.path.join(os.path.dirname(__file__), "..")
    spec = load_sweep(os.path.join(root, "simulations", "studies", "tune_step_sizes.toml"))
    demo = RunConfig().dataset
    if demo not in spec.axes["dataset"]:
        pytest.skip("the default dataset is not tuning data")
    assert spec.report["demo"] == demo  # the report's last column: the choice without the demo's data
    assert f"chosen without {demo}" in open(TUNING).read()
    make = open(os.path.join(root, "Makefile")).read()
    recipe = make[make.index("\ndemo:") :].split("\n\n")[0]
    assert "fedkl run\n" in recipe and "tune_step_sizes.toml" in recipe and "optimistic" in recipe
    readme = open(os.path.join(root, "README.md")).read()
    section = readme[readme.index("`make demo` runs") : readme.index("## From Python")]
    assert "Leak, stated" in section and "tune_step_sizes" in section


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", sorted(_chosen()))
def test_defaults_beat_the_majority_class_on_the_default_dataset(algorithm, tmp_path):
    res = run_training(
        RunConfig(algorithm=algorithm, noise_seed=0, reference=False, out=str(tmp_path / "run")), log=lambda _: None
    )
    assert res["config"]["dataset"] == "movielens" and res["config"]["lr"] == algorithm_spec(algorithm).step_size
    assert res["test_metrics"]["accuracy"] > res["trivial_baseline"]["accuracy"] + 0.05


class Stop(Exception):
    pass


def test_a_run_predicted_to_learn_little_is_announced_before_any_budget_is_spent(tmp_path):
    """adult at eps = 2 (41 users): the gradient forecast is above LEARNS_LITTLE; the warning comes
    before the first release, so a user who stops there has spent nothing."""
    lines = []

    def log(line):
        lines.append(line)
        if line.startswith("warning: predicted to learn little"):
            raise Stop

    cfg = RunConfig(dataset="adult", algorithm="dp-adam", reference=False, out=str(tmp_path / "a"))
    with pytest.raises(Stop):
        run_training(cfg, log=log)
    ratio = float(re.search(r"the noise is ([0-9.]+)x", lines[-1]).group(1))
    assert ratio > LEARNS_LITTLE
    with sqlite3.connect(tmp_path / "a" / "ledger.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM releases").fetchone() == (0,)
    # MovieLens (671 users) learns: no warning
    quiet = []
    run_training(RunConfig(algorithm="dp-adam", reference=False, out=str(tmp_path / "m")), log=quiet.append)
    assert not any(line.startswith("warning") for line in quiet)
