"""The audit's neighbouring pair follows the run's relation (fedkl/audit/worlds.py): under add-remove the
audited worlds are the outlier (or a canary) present vs absent against the public enrolment count n
(zero-out: it stays enrolled and contributes nothing, as an absent user of the Flower backends does);
under replace-one, present vs replaced by its mirror. Small: one round of noisy-gd, a few runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedkl.audit import audit as audit_module
from fedkl.audit import many_run_audit, one_run_audit
from fedkl.audit.report import noise_seed
from fedkl.federation.base import ClippedGradient

CLIP = 0.1  # the audit's clip (fedkl/audit/settings.py): the outlier's term sits at it


def _capture(monkeypatch) -> list:
    """Every ``released_model`` call of the audits: its arguments (cfg, dataset, seed, federation)."""
    calls: list = []
    real = audit_module.released_model
    monkeypatch.setattr(audit_module, "released_model", lambda *a: calls.append(a) or real(*a))
    return calls


def _clipped_rows(federation, dim: int):
    """Each user's answer at w = 0, and the failed users, as the algorithm would get them (compute and sum)."""
    q = ClippedGradient(torch.zeros(dim, dtype=torch.float64), CLIP)
    answers, total = federation.compute(q), federation.sum(q).total()
    torch.testing.assert_close(total, answers.total(), rtol=0, atol=1e-12)
    return answers.values, set(answers.failed)


def _separation(tmp_path, monkeypatch, relation: str) -> tuple[np.ndarray, list]:
    """The many-run audit of one round of noisy-gd under ``relation`` with the SAME noise in both worlds of
    a run (common random numbers): per run, statistic(D1) - statistic(D0) is the pair's exact separation."""
    monkeypatch.setattr(audit_module, "noise_seed", lambda seed, world, run: noise_seed(seed, 0, run))
    calls = _capture(monkeypatch)
    out = tmp_path / relation
    report = many_run_audit(
        "noisy-gd", 1.0, str(out), runs=4, settings={"neighbouring": relation, "rounds": 1}, log=lambda s: None
    )
    assert report["claimed"]["neighbouring"] == relation
    stats = [json.loads(line) for line in (out / "statistics.jsonl").read_text().splitlines()[1:]]
    by = {(s["world"], s["run"]): s["stat"] for s in stats}
    return np.array([by[(1, r)] - by[(0, r)] for r in range(4)]), calls


def test_the_add_remove_audit_pairs_the_outlier_present_with_it_absent(tmp_path, monkeypatch):
    sep_ar, calls = _separation(tmp_path, monkeypatch, "add-remove")
    world = {}  # world -> (dataset, federation) of its runs
    for cfg, dataset, _, federation in calls:
        world.setdefault(0 if federation is calls[0][3] else 1, (dataset, federation))
    (d0, f0), (d1, f1) = world[0], world[1]
    # one enrolment (n public and equal) and the same records: D0 is D1 with the outlier absent
    assert d0 is d1 and d0.train.num_users == 41
    outlier = d1.train.user_ids.index("outlier")
    rows0, failed0 = _clipped_rows(f0, 4)
    rows1, failed1 = _clipped_rows(f1, 4)
    assert failed0 == {outlier} and failed1 == set() and float(rows0[outlier].abs().sum()) == 0.0
    torch.testing.assert_close(rows1[outlier], torch.tensor([-CLIP, 0, 0, 0], dtype=torch.float64))
    others = [u for u in range(41) if u != outlier]
    torch.testing.assert_close(rows0[others], rows1[others], rtol=0, atol=0)
    # the statistic's separation is the add-remove sensitivity C, half the replace-one pair's 2C
    monkeypatch.undo()
    sep_ro, _ = _separation(tmp_path, monkeypatch, "replace-one")
    assert (sep_ar > 0).all() and (sep_ro > 0).all()
    np.testing.assert_allclose(sep_ar, sep_ro / 2, rtol=1e-9)
    np.testing.assert_allclose(sep_ar, sep_ar[0], rtol=1e-9)  # a deterministic gap: the noise cancels


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_the_one_run_audit_canaries_follow_the_relation(tmp_path, monkeypatch, relation):
    calls = _capture(monkeypatch)
    report = one_run_audit(
        "noisy-gd",
        1.0,
        str(tmp_path),
        canaries=10,
        guesses=2,
        settings={"neighbouring": relation, "rounds": 1},
        log=lambda s: None,
    )
    assert report["claimed"]["neighbouring"] == relation and len(calls) == 1
    cfg, dataset, _, federation = calls[0]
    included = np.random.default_rng([0, 7]).random(10) < 0.5  # the audit's draw (seed 0)
    ids = dataset.train.user_ids
    canaries = [ids.index(f"c{i:05d}") for i in range(10)]
    rows, failed = _clipped_rows(federation, federation.num_params)
    for i, u in enumerate(canaries):
        row = rows[u]
        if included[i]:  # present with labels +1: its term -C e_i
            assert u not in failed and float(row[i]) == pytest.approx(-CLIP)
        elif relation == "add-remove":  # absent: enrolled, contributes nothing
            assert u in failed and float(row.abs().sum()) == 0.0
        else:  # replaced by its mirror (labels -1): +C e_i
            assert u not in failed and float(row[i]) == pytest.approx(CLIP)
