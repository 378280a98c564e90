"""Property-based checks (hypothesis) of the invariants every release relies on."""

import math
import tempfile

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedkl.federation.inprocess import clip_rows
from fedkl.privacy import Budget, BudgetExceeded, PrivacyLedger, rho_for_eps_delta, zcdp_to_eps
from fedkl.privacy.charges import GaussianCharge

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(finite, min_size=3, max_size=3), min_size=1, max_size=8),
    clip=st.floats(min_value=1e-6, max_value=1e3),
)
def test_clipping_bounds_every_contribution(rows, clip):
    values = torch.tensor(rows, dtype=torch.float64)
    clipped, bad = clip_rows(values, clip)
    assert not bad.any()
    assert (clipped.norm(dim=1) <= clip * (1 + 1e-12)).all()
    # a row inside the ball is untouched (margin: two norm computations may differ by an ulp)
    inside = values.norm(dim=1) <= clip * (1 - 1e-9)
    assert torch.equal(clipped[inside], values[inside])


@settings(max_examples=25, deadline=None)
@given(
    charges=st.lists(
        st.tuples(st.sets(st.integers(0, 5), min_size=1, max_size=6), st.floats(min_value=0.0, max_value=0.2)),
        min_size=1,
        max_size=15,
    )
)
def test_ledger_never_lets_a_user_exceed_the_budget(charges):
    budget = Budget(1.0, 1e-5)
    with tempfile.TemporaryDirectory() as d, PrivacyLedger(f"{d}/l.sqlite", budget) as ledger:
        accepted = {u: 0.0 for u in range(6)}
        for users, rho in charges:
            ids = [f"u{u}" for u in sorted(users)]
            try:
                ledger.charge(ids, GaussianCharge(rho=rho), label="t")
            except BudgetExceeded:
                # refused only if some user really would exceed the budget
                assert max(accepted[u] + rho for u in users) > budget.rho
                continue
            for u in users:
                accepted[u] += rho
        for u, rho in accepted.items():
            spend = ledger.spend(f"u{u}")
            assert math.isclose(spend.rho, rho, rel_tol=1e-12, abs_tol=1e-15)
            assert spend.epsilon(budget.delta) <= budget.epsilon * (1 + 1e-9)
        ledger.verify()


@settings(max_examples=50, deadline=None)
@given(eps=st.floats(min_value=0.05, max_value=20.0), log_delta=st.floats(min_value=-14.0, max_value=-2.0))
def test_rho_for_eps_delta_is_conservative(eps, log_delta):
    delta = 10.0**log_delta
    for conversion in ("cks", "bun_steinke"):
        rho = rho_for_eps_delta(eps, delta, conversion)
        assert zcdp_to_eps(rho, delta, conversion) <= eps * (1 + 1e-12)
        assert zcdp_to_eps(rho * 1.001, delta, conversion) > eps * 0.999
