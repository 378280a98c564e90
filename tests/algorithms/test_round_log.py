"""RoundLog (fedkl/algorithms/round_log.py): the one per-round progress record of the round-based
algorithms, its history and its progress call."""

import time

import pytest

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
from fedkl.algorithms.round_log import RoundLog
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.problems import make_problem


def test_records_keep_their_key_order_and_reach_history_and_progress():
    seen = []
    log = RoundLog(4, seen.append)
    start = time.perf_counter()
    a = log.round(1, start, 2, noisy_grad_norm=0.5, rho_spent=0.1)
    b = log.round(2, start, extra={"phase": 3}, t=7, start=1.5)  # fields may be named t / start
    assert list(a) == ["round", "rounds", "noisy_grad_norm", "rho_spent", "failed_users", "seconds"]
    assert list(b) == ["round", "rounds", "t", "start", "seconds", "phase"]  # no failed_users; extra last
    assert (a["round"], a["rounds"], a["failed_users"], b["t"], b["start"], b["phase"]) == (1, 4, 2, 7, 1.5, 3)
    assert 0 <= a["seconds"] <= b["seconds"]
    assert log.history == seen == [a, b] and log.history[0] is a
    assert RoundLog(1).round(1, start)["rounds"] == 1  # no listener


def test_noisy_gd_reports_one_record_per_round_through_the_log(tmp_path):
    ds = load_dataset("synthetic-logistic", n_users=30, m=5, d=3, seed=0)
    problem = make_problem("logistic", ds)
    fed = InProcessFederation(problem, ds)
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(8.0, 1e-5))
    alg = NoisyGradientDescent(NoisyGDParams(rounds=3, lr=1.0, clip=1.0), BuildContext.fresh(rho=0.3))
    seen = []
    res = alg.run(fed, Releaser(ledger, NoiseSource(0)), problem.init_params(), seen.append)
    assert res.history == seen and [r["round"] for r in seen] == [1, 2, 3]
    assert [r["rho_spent"] for r in seen] == pytest.approx([0.1, 0.2, 0.3], rel=1e-12)
    assert all(list(r)[-2:] == ["failed_users", "seconds"] and r["failed_users"] == 0 for r in seen)
