"""`fedkl audit --method white-box` has power where the sampling audits have little: a 2x noise error
(world D's noise source halves every Gaussian std and Laplace scale and doubles every exponential
mechanism's log-weights, :class:`fedkl.audit.whitebox.ScaledNoise`) is flagged VIOLATION on one algorithm
of each release kind, while the same audit with the real noise passes. `make audit` runs both on every
registered algorithm (both backends, every neighbour kind); this test runs the in-process backend."""

from __future__ import annotations

import pytest

from fedkl.audit.whitebox import white_box_audit

# one algorithm per release kind: Gaussian sums, the exponential mechanism, correlated (matrix-mechanism)
# noise, a dp-accounting schedule, paper 002's stability Gaussian with its deletion budget
CASES = {"noisy-gd": 0.5, "noisy-fw": 0.5, "dp-ftrl": 0.5, "dp-sgd": 0.5, "mean-output-pert": 2.0}


@pytest.mark.parametrize("algorithm", list(CASES))
def test_white_box_audit_catches_a_2x_noise_error(algorithm, tmp_path):
    eps = CASES[algorithm]
    good = white_box_audit(algorithm, eps, str(tmp_path / "good"), backends=("inprocess",), log=lambda s: None)
    assert good["verdict"] == "consistent with claim", good["problems"]
    bad = white_box_audit(
        algorithm, eps, str(tmp_path / "bad"), backends=("inprocess",), noise_scale=0.5, log=lambda s: None
    )
    assert bad["verdict"] == "VIOLATION"
    assert any(" noise" in p for p in bad["problems"]), bad["problems"]
    assert (tmp_path / "bad" / "audit.json").exists()


def test_fedkl_audit_white_box_cli_and_its_negative_control(tmp_path, capsys):
    """`fedkl audit --method white-box` passes noisy-gd (exit 0) and, with `--noise-scale 0.5 --expect
    violation` (make audit's control), exits 0 only because the halved noise is flagged."""
    from fedkl import cli

    base = ["audit", "--algorithm", "noisy-gd", "--method", "white-box", "--users", "12"]
    assert cli.main([*base, "--out", str(tmp_path / "a")]) == 0
    assert "verdict: consistent with claim" in capsys.readouterr().out
    assert cli.main([*base, "--noise-scale", "0.5", "--expect", "violation", "--out", str(tmp_path / "b")]) == 0
    assert "Gaussian std" in capsys.readouterr().out
    assert cli.main([*base, "--noise-scale", "0.5", "--out", str(tmp_path / "c")]) == 1
