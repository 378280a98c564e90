"""Seams of fedkl tune's search (issue 32 §3): a kill at every trial's charge and score points, then a rerun,
never charges twice and never releases twice; the score release's realised sensitivity against its charge
(white-box), with negative controls."""

import json
import os

import numpy as np
import pytest
import torch

import fedkl.tuning as tuning
from fedkl.audit.tune_audit import score_whitebox
from fedkl.data import load_dataset
from fedkl.privacy import PrivacyLedger
from fedkl.privacy.selection import Stopping
from fedkl.runner import RunConfig
from fedkl.tuning import SEARCH_LABEL, split_users, tune

BASE = dict(dataset="synthetic-logistic", problem="logistic", users=24, seed=1, reference=False, epsilon=4.0)
GRID = {"rounds": ["1", "2"]}
TRIALS = 3.0
NOISE_SEED = 11


class Killed(BaseException):
    """A kill (not an Exception: nothing may catch it on the way out)."""


def _cfg(tmp_path):
    return RunConfig.from_settings(**{**BASE, "noise_seed": NOISE_SEED}, out=str(tmp_path / "run"))


def _k() -> int:
    """The seeded search's K, drawn exactly as tuning._search draws it."""
    rng = np.random.default_rng(np.random.SeedSequence([NOISE_SEED, 2**32 - 1]))
    return Stopping.with_mean("tnb", TRIALS).sample(lambda: float(rng.random()))


def _kill_at(monkeypatch, point: str, trial: int) -> None:
    """Kill the search at ``point`` of trial ``trial``: ``start`` (before its training: its stand-in charge),
    ``train`` (inside its training, after its first query), ``score`` (in its score release, before the noise),
    ``scored`` (after its score is computed, before the search compares it)."""
    calls = {"train": 0, "score": 0, "scored": 0}
    if point == "train":
        original = tuning.train_federation

        def train(*args, **kw):
            calls["train"] += 1
            if calls["train"] == trial:
                raise Killed(point)
            return original(*args, **kw)

        monkeypatch.setattr(tuning, "train_federation", train)
    elif point == "score":

        class Releaser(tuning.Releaser):
            def gaussian(self, value, **kw):
                if kw["label"] == "tune-score":
                    calls["score"] += 1
                    if calls["score"] == trial:
                        raise Killed(point)
                return super().gaussian(value, **kw)

        monkeypatch.setattr(tuning, "Releaser", Releaser)
    elif point == "scored":
        original_trial = tuning.run_trial

        def run_trial(*args, **kw):
            out = original_trial(*args, **kw)
            calls["scored"] += 1
            if calls["scored"] == trial:
                raise Killed(point)
            return out

        monkeypatch.setattr(tuning, "run_trial", run_trial)


def _search_charges(path: str) -> list[dict]:
    with PrivacyLedger(path) as ledger:
        ledger.verify()
        return [r for r in ledger.releases() if r["label"] == SEARCH_LABEL]


POINTS = ("start", "train", "score", "scored")


def test_a_kill_at_every_trial_point_never_charges_or_releases_twice(tmp_path, monkeypatch):
    """For every trial t of the seeded search and every point of it: killed there, the search has made its
    one charge and released nothing (no result.json, no model); the rerun on the same folder finishes on
    that charge (no second charge); a third run is refused (no second release)."""
    k = _k()
    assert k >= 2, "pick a noise seed with at least two trials"
    for t in range(1, k + 1):
        for point in POINTS:
            root = tmp_path / f"{point}-{t}"
            cfg = _cfg(root)
            ledger_path = os.path.join(cfg.out, "ledger.sqlite")
            with monkeypatch.context() as m:
                _kill_at(m, point, t)
                hook = (
                    (lambda i: (_ for _ in ()).throw(Killed("start")) if i == t else None) if point == "start" else None
                )
                with pytest.raises(Killed):
                    tune(cfg, ["noisy-gd"], GRID, trials=TRIALS, log=lambda _: None, before_trial=hook)
            charged = _search_charges(ledger_path)
            assert len(charged) == 1, (point, t)
            assert not os.path.exists(os.path.join(cfg.out, "result.json"))
            assert not os.path.exists(os.path.join(cfg.out, "model.pt"))
            assert json.load(open(os.path.join(cfg.out, tuning.STATE_FILE)))["status"] == "charged"
            lines: list[str] = []
            result = tune(cfg, ["noisy-gd"], GRID, trials=TRIALS, log=lines.append)
            assert any("not charged again" in line for line in lines)
            assert [r["id"] for r in _search_charges(ledger_path)] == [c["id"] for c in charged], (point, t)
            assert result["ledger"]["max_user_epsilon"] <= cfg.epsilon * (1 + 1e-9)
            with pytest.raises(ValueError, match="finished search"):
                tune(cfg, ["noisy-gd"], GRID, trials=TRIALS, log=lambda _: None)
            assert len(_search_charges(ledger_path)) == 1


# --- the score release, white-box ---------------------------------------------------------------------------
def _trial(tmp_path, relation):
    cfg = RunConfig.from_settings(**{**BASE, "neighbouring": relation, "noise_seed": 1}, out=str(tmp_path))
    data = load_dataset("synthetic-logistic", seed=1, n_users=cfg.users)
    train_pos, val_pos = split_users(data.train.user_ids, 1, 0.3)
    part = tuning._part(data, train_pos, "training")
    plan = tuning.plan_search(4.0, 1e-3, Stopping.with_mean("tnb", 2.0))
    trial = tuning._trial_config(cfg, "noisy-gd", {"rounds": 2}, plan, 7)
    return trial, part, data.train.subset(val_pos), plan


@pytest.mark.parametrize("relation", ["replace-one", "add-remove"])
def test_score_release_realised_sensitivity_is_within_its_charge(tmp_path, relation):
    trial, part, val, plan = _trial(tmp_path, relation)
    report = score_whitebox(trial, part, val, plan)
    assert report["verdict"] == "consistent with claim", report["findings"]
    assert report["charged_sensitivity"] == 1.0 and report["charged_rho"] <= plan.rho_trial * (1 + 1e-9)
    assert 0 < report["realised_sensitivity"] <= 1.0  # a neighbour does move the score


def _per_record_sum(problem, w, data, task, bound):
    """Negative control: the score as a sum over RECORDS (no per-user mean): one user with many records
    moves it by their number, while the release still charges sensitivity 1."""
    pred = problem.predict(w, data.to(problem.dtype).X).reshape(-1).to(torch.float64)
    per_record = (pred == data.y.reshape(-1).to(torch.float64)).to(torch.float64)
    return torch.bincount(data.user_index, weights=per_record, minlength=data.num_users), 1.0, True


def _unclipped_loss(problem, w, data, task, bound):
    """Negative control: a mean LOSS per user, not clipped to [0, B]: a huge record moves it without bound."""
    data = data.to(problem.dtype)
    losses = problem.record_losses(w, data).to(torch.float64)
    counts = data.counts().to(torch.float64).clamp(min=1)
    return torch.bincount(data.user_index, weights=losses, minlength=data.num_users) / counts, 1.0, True


@pytest.mark.parametrize("relation", ["replace-one", "add-remove"])
@pytest.mark.parametrize("leaky", [_per_record_sum, _unclipped_loss], ids=["per-record-sum", "unclipped-loss"])
def test_score_whitebox_flags_leaky_scores(tmp_path, relation, leaky):
    trial, part, val, plan = _trial(tmp_path, relation)
    report = score_whitebox(trial, part, val, plan, values=leaky)
    assert report["verdict"] == "VIOLATION" and report["realised_sensitivity"] > 1.0
