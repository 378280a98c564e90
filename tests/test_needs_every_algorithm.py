"""Affordability is checked once (issue 29 §1): the runner checks every algorithm's declared ``needs()``
against the ledger right after building it and before any data is read (``fedkl.runner._afford``,
``PrivacyLedger.check``). For every registered algorithm at its small setting:

* refused: when one user's budget was partly spent after the algorithm was sized (so that what it declares
  for that user no longer fits), the run ends with BudgetExceeded before any query, and nothing is charged;
* honest: on a fresh ledger, what the run charges each user in all equals what ``needs()`` declared, within
  the ledger's one tolerance, so that ``needs()`` cannot drift from the run.
"""

from __future__ import annotations

import pytest
from build_helpers import SMALL, small_config

from fedkl import runner
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy.charges import ApproxDPCharge, GaussianCharge, Need
from fedkl.privacy.ledger import _REL_TOL, Budget, BudgetExceeded, PrivacyLedger

NAMES = sorted(SMALL)
# needs() is a bound, checked one way (charged <= declared): kl-spider's adaptive stop only removes releases
# (it declares the budget it is sized to).
UPPER_BOUND = {"kl-spider"}


def _totals(needs) -> dict[str, tuple[float, float, float]]:
    out: dict[str, tuple[float, float, float]] = {}
    for users, charge in needs:
        for u in users:
            out[str(u)] = tuple(a + b for a, b in zip(out.get(str(u), (0.0, 0.0, 0.0)), charge.cost()))
    return out


@pytest.fixture
def queries(monkeypatch):
    """Counts every query any in-process federation answers."""
    calls = []
    compute = InProcessFederation.compute
    monkeypatch.setattr(InProcessFederation, "compute", lambda self, q, users=None: calls.append(q) or compute(self, q, users))  # fmt: skip
    return calls


def _hook(monkeypatch, before=None):
    """Wraps the runner's affordability step: records the built algorithm's needs, runs ``before(ledger, needs)``."""
    seen = {}
    afford = runner._afford

    def wrapped(run, alg, ledger):
        seen["needs"] = tuple(alg.needs(run.federation.user_ids))
        if before is not None:
            before(ledger, seen["needs"])
        return afford(run, alg, ledger)

    monkeypatch.setattr(runner, "_afford", wrapped)
    return seen


@pytest.mark.parametrize("name", NAMES)
def test_needs_that_do_not_fit_are_refused_before_any_query(name, tmp_path, monkeypatch, queries):
    spent = {}

    def spend_part(ledger, needs):  # one user, with its largest declared need, spends all but half of it
        user, (rho, eps, delta) = max(_totals(needs).items(), key=lambda kv: kv[1])
        b = ledger.budget
        charge = GaussianCharge(ledger.rho_left([user]) - rho / 2) if rho > 0 else ApproxDPCharge(b.epsilon - eps / 2, 0.0, "test")  # fmt: skip
        ledger.charge([user], charge, label="another study")
        spent["user"] = user

    _hook(monkeypatch, spend_part)
    path = tmp_path / "l.sqlite"
    with pytest.raises(
        BudgetExceeded, match=r"the run would take 1 user\(s\).*nothing was charged|Nothing was charged"
    ):
        runner.run_training(small_config(name, tmp_path, ledger=str(path)), log=lambda s: None)
    assert spent and not queries
    with PrivacyLedger(path) as ledger:
        assert [r["label"] for r in ledger.releases()] == ["another study"]


@pytest.mark.parametrize("name", NAMES)
def test_the_run_charges_each_user_what_needs_declared(name, tmp_path, monkeypatch):
    seen = _hook(monkeypatch)
    path = tmp_path / "l.sqlite"
    runner.run_training(small_config(name, tmp_path, ledger=str(path)), log=lambda s: None)
    declared = _totals(seen["needs"])
    with PrivacyLedger(path) as ledger:
        charged = {u["user_id"]: (u["rho"], u["eps"], u["delta"]) for u in ledger.user_spends()}
        users = set(declared) | set(charged)
        for u in users:
            got, want = charged.get(u, (0.0, 0.0, 0.0)), declared.get(u, (0.0, 0.0, 0.0))
            for g, w, what in zip(got, want, ("rho", "eps", "delta")):
                slack = 1e-9 * abs(w) + _REL_TOL  # float sums over the run's releases
                assert (g <= w + slack) if name in UPPER_BOUND else abs(g - w) <= slack, (u, what, g, w)


def test_check_sums_needs_per_user_with_one_tolerance(tmp_path):
    with PrivacyLedger(tmp_path / "l.sqlite", Budget(1.0, 1e-5), "r") as ledger:
        rho = ledger.budget.rho
        ledger.check([Need(["a", "b"], GaussianCharge(rho / 2)), Need(["b"], GaussianCharge(rho / 2))])
        with pytest.raises(BudgetExceeded, match=r"the run would take 1 user\(s\) \(e.g. 'b'\)"):
            ledger.check([Need(["a", "b"], GaussianCharge(rho / 2)), Need(["b"], GaussianCharge(rho * 0.51))])
        assert ledger.num_releases() == 0
