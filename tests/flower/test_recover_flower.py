"""Crash recovery over the Flower transport (`--backend flower-local`: the ServerApp's federation in
this process, clients on the LocalGrid): a run that dies after two journalled releases recovers to
the uninterrupted run's model and ledger, bit for bit."""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fedkl.flower.backends  # noqa: E402,F401  (registers the Flower backends)
from fedkl.privacy import PrivacyLedger  # noqa: E402
from fedkl.privacy.journal import ReleaseJournal  # noqa: E402
from fedkl.runner import RunConfig, recover_run, run_training  # noqa: E402

pytestmark = pytest.mark.flower


class Crash(BaseException):
    pass


def _cfg(out) -> RunConfig:
    return RunConfig.from_settings(dataset="synthetic-logistic", users=6, algorithm="noisy-gd", rounds=4, epsilon=2.0,
                                   seed=3, noise_seed=11, reference=False, backend="flower-local", out=str(out))  # fmt: skip


def _rows(path) -> list[dict]:
    with PrivacyLedger(path) as led:
        return [{k: r[k] for k in ("seq", "label", "charge", "cohort", "state")} for r in led.releases()]


def test_a_flower_run_recovers_bit_for_bit(tmp_path, monkeypatch):
    clean = run_training(_cfg(tmp_path / "clean"), log=lambda s: None)
    original, seen = ReleaseJournal.record, []

    def record(self, *a):
        if len(seen) == 2:
            raise Crash
        seen.append(a[0])
        return original(self, *a)

    with monkeypatch.context() as m:
        m.setattr(ReleaseJournal, "record", record)
        with pytest.raises(Crash):
            run_training(_cfg(tmp_path / "crashed"), log=lambda s: None)
    lines: list[str] = []
    recovered = recover_run(str(tmp_path / "crashed"), log=lines.append)
    assert "2 releases replayed" in " ".join(lines) and recovered["backend"] == "flower-local"
    w = [torch.load(p, weights_only=False)["state_dict"]["w"] for p in (recovered["model_path"], clean["model_path"])]
    assert torch.equal(*w)
    assert _rows(recovered["ledger"]["path"]) == _rows(clean["ledger"]["path"])
