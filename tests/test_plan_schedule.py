"""A plan that is a schedule costs two rounds of dry run, not one per round (issue 31, Operations: a 20,000-round
run spent a minute in its plan's dry run before round 2, and `fedkl plan --charges` took 56 s). An algorithm that
declares ``plan_schedule`` is dry-run until its second release; the rest of the plan is written from the
schedule. Its plan equals the whole dry run's (every declaring algorithm), and planning 20,000 rounds queries
the stand-in twice. Counts, not times."""

from __future__ import annotations

import pytest
from build_helpers import small_config  # tests/build_helpers.py

from fedkl import runner
from fedkl.algorithms.registry import REGISTRY
from fedkl.federation.inprocess import InProcessFederation
from fedkl.planner import charge_plan

SCHEDULED = ("noisy-fw", "noisy-gd")  # the registered algorithms that declare plan_schedule


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


@pytest.mark.parametrize("name", SCHEDULED)
def test_a_scheduled_plan_is_the_whole_dry_runs_plan(tmp_path, monkeypatch, name):
    cfg = small_config(name, tmp_path / "run", rounds=6)
    calls = _queries(monkeypatch)
    scheduled = charge_plan(cfg)
    assert 1 <= calls[0] <= 2  # two rounds of the stand-in, not one per release
    with monkeypatch.context() as m:
        _whole_dry_run(m)
        whole = charge_plan(cfg)
    assert calls[0] - 2 >= len(whole["releases"]) > 2
    assert scheduled["releases"] == whole["releases"]
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


def test_only_the_declared_algorithms_have_a_schedule():
    """SCHEDULED is every registered algorithm whose class overrides plan_schedule (so the test above covers each), and a
    false declaration is caught by its own dry run: no wrong plan."""
    from fedkl.algorithms.contract import Algorithm

    declared = {name for name, spec in REGISTRY.items() if spec.cls.plan_schedule is not Algorithm.plan_schedule}
    assert tuple(sorted(declared)) == SCHEDULED and set(SCHEDULED) <= set(REGISTRY)
    row = {"id": 1, "seq": 0, "label": "a/round-0", "charge": {"rho": 0.1}, "cohort": "c", "members": ["u"]}
    other = {**row, "id": 2, "seq": 1, "label": "a/round-1", "charge": {"rho": 0.2}}
    with pytest.raises(ValueError, match="declares its plan a schedule of 5"):
        runner._scheduled([row, other], {"rho": 0.3}, 5, lambda k: f"a/round-{k}")
