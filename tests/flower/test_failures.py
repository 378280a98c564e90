"""Visible failures: every user whose answer was not used is recorded per request with the reason
(dropped, non-finite, wrong shape, garbage, beyond the bound, absent), counted, and saved in the run's
result (flower_result / result.json ``failures``)."""

from __future__ import annotations

import json

import pytest
from test_flower import _cfg  # tests/flower/test_flower.py: the small least-squares run of the Flower tests

import fedkl.flower.backends  # noqa: F401  (registers flower-local with the runner)
from fedkl.flower import localgrid
from fedkl.flower.federation import FAILURE_KINDS
from fedkl.flower.server_app import run_flower_simulation
from fedkl.runner import RunConfig, run_training

pytestmark = pytest.mark.flower

FAULTS = {
    0: (localgrid.drop, "no-reply"),
    3: (localgrid.nan_reply, "non-finite"),
    5: (localgrid.wrong_shape, "wrong-shape"),
    7: (localgrid.garbage, "bad-reply"),
    9: (localgrid.huge_norm, "out-of-bound"),
}
ABSENT = 11


def test_each_failure_is_saved_with_its_reason_per_request(tmp_path):
    res = run_flower_simulation(
        _cfg(tmp_path, "faulty", users=16),
        "flower-local",
        log=lambda s: None,
        faults={p: make() for p, (make, _) in FAULTS.items()},
        absent=[ABSENT],
    )
    report = res["failures"]
    expected = {kind: 3 for _, kind in FAULTS.values()} | {"absent": 3}
    assert report["counts"] == expected and report["requests"] == 3
    assert set(report["kinds"]) == set(expected) <= set(FAILURE_KINDS)
    ids = res["user_ids"]
    for rec in report["by_request"]:
        assert rec["query"] == "clipped_gradient" and rec["asked"] == 16
        got = {uid: why.split(":", 1)[0] for uid, why in rec["failed"].items()}
        assert got == {ids[p]: kind for p, (_, kind) in FAULTS.items()} | {ids[ABSENT]: "absent"}
    assert res["failed_users"] == [len(FAULTS) + 1] * 3  # the history's count agrees


def test_result_json_carries_the_failures_of_a_flower_run(tmp_path):
    payload = run_training(
        RunConfig.from_settings(
            **{**_cfg(tmp_path, "clean", users=16, rounds=2).settings(), "backend": "flower-local"}
        ),
        log=lambda s: None,
    )
    saved = json.loads((tmp_path / "clean" / "result.json").read_text())
    handshake = {"waited_s": 0.0, "nodes": 16, "unserved": {}, "refused_nodes": {}}
    assert saved["failures"] == payload["failures"]
    assert saved["failures"] == {"counts": {}, "kinds": {}, "requests": 2, "by_request": [], "handshake": handshake}
