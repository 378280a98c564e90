"""A plan that is a schedule costs two rounds of dry run, not one per round (issue 31, Operations: a 20,000-round
run spent a minute in its plan's dry run before round 2, and `fedkl plan --charges` took 56 s). An algorithm that
declares ``plan_schedule`` is dry-run until its second release (or the first step of a schedule charged up
front); the rest of the plan is written from the schedule. Its plan equals the whole dry run's (every declaring
algorithm; dp-ftrl and dp-fedavg under both relations, with Poisson and fixed cohorts), and planning 20,000
rounds queries the stand-in at most twice. Counts, not times. Measured once (nice, 2 shared cores): `charge_plan`
of dp-ftrl at 20,000 rounds (synthetic-logistic, 12 users, banded, b = 2, k = 10,000) took 11.6 s against the whole
dry run's 387 s at load 15-20 (3.7 s at load ~10), the two plans equal; dp-fedavg at 20,000 rounds (its small
setting: q = 0.5, RDP) 12 s instead of 20 s, what is left being dp-accounting's calibration, which the run needs
too."""

from __future__ import annotations

import pytest
from build_helpers import small_config  # tests/build_helpers.py

from fedkl import runner
from fedkl.algorithms.registry import REGISTRY
from fedkl.federation.inprocess import InProcessFederation
from fedkl.planner import charge_plan

# the registered algorithms that declare plan_schedule (the dp-accounting schedules: one up-front charge)
SCHEDULED = (
    "dp-adam", "dp-adambc", "dp-fedadam", "dp-fedavg", "dp-fedyogi", "dp-ftrl", "dp-rmsprop", "dp-sgd", "noisy-fw",
    "noisy-gd",
)  # fmt: skip
# the relations and cohorts each one's plan is checked under besides its small setting
VARIANTS = [
    ("dp-ftrl", {"neighbouring": "replace-one"}),
    ("dp-ftrl", {"factorization": "banded", "max_participations": 3, "rounds": 6}),
    ("dp-fedavg", {"neighbouring": "replace-one", "sampling_rate": 1.0}),  # fixed cohort: everyone
    ("dp-fedavg", {"sampling_rate": 1.0}),  # add-remove, fixed cohort
    ("dp-fedavg", {"adaptive_clip": True, "clip_count_noise": 2.0}),
    ("dp-fedadam", {"neighbouring": "replace-one", "sampling_rate": 1.0}),
]


def _queries(monkeypatch) -> list[int]:
    """A counter of the queries the in-process federation answers (``sum`` or ``compute``; one that the other
    answers through counts once)."""
    calls, depth = [0], [0]
    for method in ("sum", "compute"):
        original = getattr(InProcessFederation, method)

        def counting(self, query, users=None, _original=original):
            calls[0] += depth[0] == 0
            depth[0] += 1
            try:
                return _original(self, query, users)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(InProcessFederation, method, counting)
    return calls


def _whole_dry_run(monkeypatch) -> None:
    """The dry run without the schedule: every round executed (the old plan)."""
    monkeypatch.setattr(runner._ScheduleCut, "see_algorithm", lambda self, alg: None)


def _settings(name: str) -> dict:
    return {"rounds": 4} if name == "dp-ftrl" else {"rounds": 6}  # dp-ftrl's small setting: k b = 4 rounds


@pytest.mark.parametrize(
    "name, extra",
    [(n, {}) for n in SCHEDULED] + VARIANTS,
    ids=[*SCHEDULED, *(f"{n}-" + "-".join(f"{k}={v}" for k, v in e.items()) for n, e in VARIANTS)],
)
def test_a_scheduled_plan_is_the_whole_dry_runs_plan(tmp_path, monkeypatch, name, extra):
    cfg = small_config(name, tmp_path / "run", **{**_settings(name), **extra})
    calls = _queries(monkeypatch)
    scheduled = charge_plan(cfg)
    planning = calls[0]
    assert 0 <= planning <= 2  # at most two rounds of the stand-in, not one per round
    with monkeypatch.context() as m:
        _whole_dry_run(m)
        whole = charge_plan(cfg)
    assert calls[0] - planning > 2  # the whole dry run asks the stand-in every round
    assert scheduled["releases"] == whole["releases"] and len(whole["releases"]) >= 1
    assert scheduled["per_user_max"] == pytest.approx(whole["per_user_max"], rel=1e-12)
    assert scheduled["adaptive"] is whole["adaptive"] is False


def test_planning_20000_rounds_queries_the_standin_twice(tmp_path, monkeypatch):
    cfg = small_config("noisy-gd", tmp_path / "run", rounds=20_000)
    calls = _queries(monkeypatch)
    plan = charge_plan(cfg)
    assert calls[0] == 2 and len(plan["releases"]) == 20_000
    assert [r["label"] for r in plan["releases"][-2:]] == ["noisy-gd/round-19998", "noisy-gd/round-19999"]
    assert len({(r["charge"]["rho"], r["cohort"]) for r in plan["releases"]}) == 1
    assert plan["per_user_max"]["rho"] == pytest.approx(cfg.params.rounds * plan["releases"][0]["charge"]["rho"])


@pytest.mark.parametrize(
    "name, rounds, extra",
    [("dp-ftrl", 20_000, {"factorization": "banded", "max_participations": 10_000}), ("dp-fedavg", 500, {})],
)
def test_planning_many_rounds_of_a_varying_or_prepaid_schedule_trains_at_most_one_round(
    tmp_path, monkeypatch, name, rounds, extra
):
    """dp-ftrl: cohorts and charges vary by round (the public schedule replayed); dp-fedavg: one charge up front
    (500 rounds: what costs here is dp-accounting's calibration, which the run needs too)."""
    cfg = small_config(name, tmp_path / "run", rounds=rounds, **extra)
    calls = _queries(monkeypatch)
    plan = charge_plan(cfg)
    assert calls[0] <= 2
    releases = plan["releases"]
    if name == "dp-ftrl":
        assert len(releases) == rounds and releases[-1]["label"] == f"dp-ftrl/round-{rounds - 1}"
        assert len({r["cohort"] for r in releases}) == 2  # b = 2 residue classes
        assert plan["per_user_max"]["rho"] == pytest.approx(sum(r["charge"]["rho"] for r in releases[::2]))
    else:
        assert [r["label"] for r in releases] == ["dp-fedavg/schedule"] and releases[0]["users"] == 12


def test_a_false_declaration_is_caught_by_the_dry_run(tmp_path, monkeypatch):
    """A declared plan whose first releases differ from what the run's code charges is refused: no wrong plan."""
    from fedkl.algorithms.gradient.dp_ftrl import DPFTRL

    cfg = small_config("dp-ftrl", tmp_path / "run", rounds=4)
    declared = DPFTRL.plan_schedule
    monkeypatch.setattr(DPFTRL, "plan_schedule", lambda self: declared(self)[::-1])
    with pytest.raises(ValueError, match="declares its plan a schedule of 4 releases, but its dry run's release 0"):
        charge_plan(cfg)


def test_only_the_declared_algorithms_have_a_schedule():
    """SCHEDULED is every registered algorithm whose class overrides plan_schedule (so the test above covers each), and a
    false declaration is caught by its own dry run: no wrong plan."""
    from fedkl.algorithms.contract import Algorithm

    declared = {name for name, spec in REGISTRY.items() if spec.cls.plan_schedule is not Algorithm.plan_schedule}
    assert tuple(sorted(declared)) == SCHEDULED and set(SCHEDULED) <= set(REGISTRY)
    row = {"id": 1, "seq": 0, "label": "a/round-0", "charge": {"rho": 0.1}, "cohort": "c", "members": ["u"]}
    other = {**row, "id": 2, "seq": 1, "label": "a/round-1", "charge": {"rho": 0.2}}
    with pytest.raises(ValueError, match="declares its plan a schedule of 5"):
        runner._scheduled([row, other], {"rho": 0.3}, (5, lambda k: f"a/round-{k}"))
