"""The warning before spending for networks (fedkl/algorithms/forecast.py): a torch model that cannot learn is
announced before the first release (dp-sgd and dp-fedavg), and the README's Geyer command is not."""

from __future__ import annotations

import re
import shlex
import sqlite3
from pathlib import Path

import pytest
import torch

import fedkl
from fedkl.algorithms.forecast import LEARNS_LITTLE, NETWORK_LEARNS_LITTLE

ROOT = Path(__file__).resolve().parents[2]


class Stop(Exception):
    pass


def tiny(input_dim: int, num_outputs: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(input_dim, 16), torch.nn.ReLU(), torch.nn.Linear(16, num_outputs))


def _until_first_round(data, algorithm, tmp_path, **settings) -> list[str]:
    """The log lines up to the first warning (then nothing must have been charged) or the first round."""
    lines = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("warning"):
            with sqlite3.connect(tmp_path / "ledger.sqlite") as db:  # before spending
                assert db.execute("SELECT COUNT(*) FROM releases").fetchone() == (0,)
        if re.match(r"\s*round\s+1/", line):
            raise Stop

    with pytest.raises(Stop):
        fedkl.train(data, algorithm, model=tiny, log=log, out=str(tmp_path), **settings)
    return lines


def _noise_warning(lines: list[str]) -> float | None:
    hit = [re.search(r"the noise is ([0-9.e+]+)x", line) for line in lines if line.startswith("warning: predicted")]
    return float(hit[0].group(1)) if hit else None


@pytest.mark.parametrize(
    "algorithm, settings",
    [
        ("dp-sgd", dict(lr=0.5)),
        ("dp-fedavg", dict(lr=0.1, local_steps=2)),
    ],
)
def test_a_network_that_cannot_learn_is_announced_before_spending(tmp_path, algorithm, settings):
    """30 users at eps = 0.05: the released mean's noise is far above the clip (ratio > the networks' threshold),
    warned before the first release; at eps = 50 the same network is not warned about."""
    base = dict(users=30, rounds=3, epsilon=0.05, delta=1e-5, problem="torch", neighbouring="add-remove",
                sampling_rate=0.5, accountant="rdp", reference=False, **settings)  # fmt: skip
    ratio = _noise_warning(_until_first_round("synthetic-logistic", algorithm, tmp_path / "a", **base))
    assert ratio is not None and ratio > NETWORK_LEARNS_LITTLE
    quiet = _until_first_round("synthetic-logistic", algorithm, tmp_path / "b", **{**base, "epsilon": 50.0})
    assert not any(line.startswith("warning") for line in quiet), quiet


def test_a_network_at_a_step_size_chosen_on_glms_is_warned_about(tmp_path):
    """dp-sgd's default lr (tuned on GLM data) on a network: warned before spending (the README's CNN at it scored
    below the majority class with no warning); an explicit lr is not."""
    base = dict(users=30, rounds=3, epsilon=50.0, delta=1e-5, problem="torch", reference=False)
    lines = _until_first_round("synthetic-logistic", "dp-sgd", tmp_path / "a", **base)
    assert any(line.startswith("warning: dp-sgd's default step size") for line in lines), lines
    lines = _until_first_round("synthetic-logistic", "dp-sgd", tmp_path / "b", lr=0.5, **base)
    assert not any("default step size" in line for line in lines)


def _readme_geyer_command() -> dict:
    (line,) = [x for x in (ROOT / "README.md").read_text().splitlines() if "Geyer" in x and x.startswith("fedkl run")]
    argv = shlex.split(line.split("#")[0])[2:]
    settings = {}
    for flag, value in zip(argv[::2], argv[1::2]):
        assert flag.startswith("--"), line
        for cast in (int, float, str):
            try:
                settings[flag[2:].replace("-", "_")] = cast(value)
                break
            except ValueError:
                pass
    return settings


def test_the_readme_geyer_command_does_not_warn(tmp_path, monkeypatch):
    """The README's Geyer command (MNIST, 1,000 label-shard users): no warning before its first round (its forecast
    ratio is between the GLM threshold and the networks' one: the GLM rule over-warned such runs)."""
    monkeypatch.chdir(ROOT)  # its --model path is relative to the repository
    settings = _readme_geyer_command()
    data, algorithm, model = settings.pop("dataset"), settings.pop("algorithm"), settings.pop("model")
    lines = []

    def log(line: str) -> None:
        lines.append(line)
        if re.match(r"\s*round\s+1/", line):
            raise Stop

    with pytest.raises(Stop):
        fedkl.train(data, algorithm, model=model, log=log, out=str(tmp_path), reference=False, **settings)
    assert not any(line.startswith("warning") for line in lines), lines
    assert LEARNS_LITTLE < NETWORK_LEARNS_LITTLE
