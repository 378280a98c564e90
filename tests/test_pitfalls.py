"""The DP-training pitfalls (jax_privacy's "Common pitfalls in DP training", McKenna & McMahan) that
the pitfall table (docs/concepts/pitfalls.md) maps to tests; the two that had no direct test live here.

* A data-dependent denominator: DP-SGD/DP-FedAvg divide the released sum by the public q n, never by
  the realised number of sampled users (which would make the update's scale a function of the
  sample and break the amplification analysis).
* Zero-user rounds: a Poisson round that samples nobody still makes its (charged) release, of noise
  only, instead of skipping it (a skipped round would reveal that the sample was empty)."""

from __future__ import annotations

import numpy as np
import pytest

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.dp_adaptive import DPSGD, AdaptiveDPParams
from fedkl.data.custom import from_arrays
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.problems import make_problem


def _identical_users(n: int):
    """n users with the same four records: every clipped gradient is the same vector of norm C."""
    X = np.tile([[0.5, 0.0, 0.0]], (4 * n, 1))
    ds = from_arrays(X, np.ones(4 * n), np.repeat(np.arange(n), 4), task="binary", test_fraction=0.25)
    return InProcessFederation(make_problem("logistic", ds), ds)


def _run(tmp_path, n, q, rounds, eps, lr=1e-4, clip=0.1):
    fed = _identical_users(n)
    params = AdaptiveDPParams(rounds=rounds, sampling_rate=q, lr=lr, clip=clip, accountant="rdp")
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(eps, 1e-5))
    eps_left, delta_left = ledger.approx_left(fed.user_ids)
    opt = DPSGD(params, BuildContext.fresh(eps=eps_left, delta=delta_left, neighbouring="add-remove"))
    return opt.run(fed, Releaser(ledger, NoiseSource(3)), fed.problem.init_params()), ledger, fed


def test_the_released_mean_divides_by_the_public_q_n_not_the_sample(tmp_path):
    n, q, clip = 60, 0.5, 0.1
    res, _, _ = _run(tmp_path, n, q, rounds=12, eps=700.0, clip=clip)  # the largest eps a run accepts
    sampled = np.array([h["sampled"] for h in res.history], dtype=float)
    norms = np.array([h["noisy_grad_norm"] for h in res.history])
    assert sampled.min() < sampled.max()  # the samples differ in size ...
    # ... and the released mean scales with them: |S_t| C / (q n) (plus noise of std sigma/(q n) per
    # coordinate, sqrt(3) sigma/(q n) in norm); dividing by |S_t| would make every norm C
    noise = 5 * np.sqrt(3) * res.sigma / (q * n)
    assert np.all(np.abs(norms - sampled * clip / (q * n)) < noise)
    assert noise < 0.1 * clip * (sampled.max() - sampled.min()) / (q * n)  # the check can tell them apart


def test_a_round_that_samples_nobody_is_still_released_and_charged(tmp_path):
    n, rounds = 10, 30
    res, ledger, fed = _run(tmp_path, n, 0.02, rounds, eps=2.0)
    empty = [h for h in res.history if h["sampled"] == 0]
    assert len(res.history) == rounds and len(empty) >= 10  # P(empty) = 0.98^10 = 0.82 per round
    assert all(h["noisy_grad_norm"] > 0 for h in empty)  # noise was released, not skipped
    rows = ledger.releases()
    assert len(rows) == 1 and rows[0]["users"] == n  # the whole schedule, charged to everyone up front
    assert ledger.spend(fed.user_ids[0]).eps == pytest.approx(res.epsilon)
