"""The zCDP filter and the Releaser: the order charge -> noise, refusals that leave no trace, and the
noise scale of what is released."""

from __future__ import annotations

import math

import pytest
import torch

from fedkl.privacy import Budget, BudgetExceeded, BudgetExhausted, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.charges import GaussianCharge

K_SE = 6.0
BUDGET = Budget(epsilon=2.0, delta=1e-5)
USERS = [f"user{i}" for i in range(10)]


# --------------------------------------------------------------------------------------------------
# ZCDPFilter
# --------------------------------------------------------------------------------------------------
def test_filter_admits_until_budget():
    f = ZCDPFilter(1.0)
    f.spend(0.4)
    f.spend(0.4)
    assert math.isclose(f.spent, 0.8) and f.steps == 2
    assert not f.admits(0.3)
    with pytest.raises(BudgetExhausted):
        f.spend(0.3)
    assert math.isclose(f.spent, 0.8) and f.steps == 2  # nothing recorded for the refused step
    assert math.isclose(f.remaining, 0.2)
    f.spend(0.2)  # exactly fills it
    assert f.steps == 3
    for rho in (1e-9, 1e-6):  # far above the 1e-12 rounding tolerance
        with pytest.raises(BudgetExhausted):
            f.spend(rho)
    f.spend(0.0)  # a free step is fine
    assert f.remaining == 0.0 and f.steps == 4


@pytest.mark.parametrize("budget", [1.0, 0.37, 0.1082563638, 5e-4])
@pytest.mark.parametrize("T", [1, 3, 7, 10, 49, 1000])
def test_filter_equal_split(budget, T):
    f = ZCDPFilter(budget)
    part = budget / T
    for _ in range(T):
        f.spend(part)
    assert f.steps == T
    assert f.spent <= budget * (1 + 1e-12)
    with pytest.raises(BudgetExhausted):
        f.spend(part)
    assert f.steps == T


def test_filter_invalid():
    for b in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            ZCDPFilter(b)
    f = ZCDPFilter(1.0)
    for rho in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            f.spend(rho)
    assert f.spent == 0.0 and f.steps == 0


# --------------------------------------------------------------------------------------------------
# Releaser
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def ledger(tmp_path):
    led = PrivacyLedger(tmp_path / "ledger.db", BUDGET, run_id="test")
    yield led
    led.close()


def instrument(monkeypatch, releaser: Releaser) -> list[str]:
    """Record, in order, every ledger charge (and whether it returned) and every noise draw."""
    events: list[str] = []
    charge, gaussian = releaser.ledger.charge, releaser.noise.gaussian

    def charge_spy(*args, **kwargs):
        events.append("charge")
        out = charge(*args, **kwargs)
        events.append("charged")
        return out

    def gaussian_spy(*args, **kwargs):
        events.append("noise")
        return gaussian(*args, **kwargs)

    monkeypatch.setattr(releaser.ledger, "charge", charge_spy)
    monkeypatch.setattr(releaser.noise, "gaussian", gaussian_spy)
    return events


def test_charge_before_noise(ledger, monkeypatch):
    f = ZCDPFilter(BUDGET.rho)
    r = Releaser(ledger, NoiseSource(seed=1), f)
    events = instrument(monkeypatch, r)
    out = r.gaussian(torch.zeros(5, dtype=torch.float64), sensitivity=1.0, rho=0.01, user_ids=USERS, label="g")
    assert events == ["charge", "charged", "noise"]
    assert out.shape == (5,)
    assert ledger.num_releases() == 1 and math.isclose(f.spent, 0.01) and f.steps == 1
    for u in USERS:
        assert math.isclose(ledger.spend(u).rho, 0.01, rel_tol=1e-12)


def test_ledger_refusal_draws_no_noise(ledger, monkeypatch):
    f = ZCDPFilter(10 * BUDGET.rho)  # the filter would allow it: the ledger is what refuses
    ledger.charge([USERS[3]], GaussianCharge(rho=0.95 * BUDGET.rho), label="earlier run")
    r = Releaser(ledger, NoiseSource(seed=1), f)
    events = instrument(monkeypatch, r)
    with pytest.raises(BudgetExceeded):
        r.gaussian(
            torch.zeros(5, dtype=torch.float64), sensitivity=1.0, rho=0.1 * BUDGET.rho, user_ids=USERS, label="g"
        )
    assert events == ["charge"]  # the charge raised; no noise was drawn
    assert f.spent == 0.0 and f.steps == 0
    assert ledger.num_releases() == 1
    assert ledger.spend(USERS[0]).rho == 0.0


def test_filter_refusal_charges_nothing(ledger, monkeypatch):
    f = ZCDPFilter(0.05)
    r = Releaser(ledger, NoiseSource(seed=1), f)
    events = instrument(monkeypatch, r)
    r.gaussian(torch.zeros(3, dtype=torch.float64), sensitivity=1.0, rho=0.03, user_ids=USERS, label="1")
    events.clear()
    with pytest.raises(BudgetExhausted) as err:
        r.gaussian(torch.zeros(3, dtype=torch.float64), sensitivity=1.0, rho=0.03, user_ids=USERS, label="2")
    assert not isinstance(err.value, BudgetExceeded)  # the filter's refusal, not the ledger's
    assert events == []  # neither charged nor drawn
    assert ledger.num_releases() == 1
    assert math.isclose(ledger.spend(USERS[0]).rho, 0.03, rel_tol=1e-12)
    assert math.isclose(f.spent, 0.03) and f.steps == 1


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([0.0, float("nan")]),
        torch.tensor([float("inf"), 1.0]),
        torch.tensor([[1.0], [-float("inf")]]),
        [0.0, 1.0],
    ],
)
def test_non_finite_value_refused_before_charge(ledger, monkeypatch, bad):
    f = ZCDPFilter(BUDGET.rho)
    r = Releaser(ledger, NoiseSource(seed=1), f)
    events = instrument(monkeypatch, r)
    with pytest.raises(ValueError):
        r.gaussian(bad, sensitivity=1.0, rho=0.01, user_ids=USERS, label="nan")
    assert events == [] and ledger.num_releases() == 0 and f.spent == 0.0


def test_bad_parameters_refused_before_charge(ledger, monkeypatch):
    r = Releaser(ledger, NoiseSource(seed=1), ZCDPFilter(BUDGET.rho))
    events = instrument(monkeypatch, r)
    for sens, rho in ((1.0, 0.0), (0.0, 0.01), (-1.0, 0.01), (1.0, float("nan"))):
        with pytest.raises(ValueError):
            r.gaussian(torch.zeros(2), sensitivity=sens, rho=rho, user_ids=USERS, label="bad")
    assert events == [] and ledger.num_releases() == 0


def test_released_noise_scale_and_ledger_row(ledger):
    """Released noise has std sigma = sensitivity / sqrt(2 rho).

    SE of the sample std of N i.i.d. normals ~ sigma / sqrt(2N) (delta method on Var(s^2) =
    2 sigma^4/(N-1)); with N = 200k a 6-SE bound is ~0.95% of sigma — a sigma 10% off (or the
    sqrt(rho) / 2 rho mix-ups) would be far outside it."""
    n, sens, rho = 200_000, 2.5, 0.02
    sigma = sens / math.sqrt(2 * rho)
    r = Releaser(ledger, NoiseSource(seed=123), ZCDPFilter(BUDGET.rho))
    value = torch.linspace(-1.0, 1.0, n, dtype=torch.float64)
    out = r.gaussian(value, sensitivity=sens, rho=rho, user_ids=USERS, label="long", details={"round": 7})
    noise = (out - value).numpy()
    se = sigma / math.sqrt(2 * n)
    assert abs(noise.std() - sigma) <= K_SE * se
    assert abs(noise.std() - 0.9 * sigma) > K_SE * se  # the bound is tight enough to see 10%
    assert abs(noise.mean()) <= K_SE * sigma / math.sqrt(n)
    (row,) = ledger.releases()
    assert row["mechanism"] == "gaussian" and row["label"] == "long" and row["run_id"] == "test"
    assert math.isclose(row["noise_scale"], sigma, rel_tol=1e-12)
    assert row["sensitivity"] == sens and row["rho"] == rho and row["users"] == len(USERS)
    assert row["eps"] == 0.0 and row["delta"] == 0.0
    ledger.verify()


def test_releaser_without_filter(ledger):
    r = Releaser(ledger, NoiseSource(seed=5))
    part = BUDGET.rho / 4
    for i in range(4):
        r.gaussian(torch.zeros(2), sensitivity=1.0, rho=part, user_ids=USERS, label=f"{i}")
    with pytest.raises(BudgetExceeded):  # the ledger alone still stops it
        r.gaussian(torch.zeros(2), sensitivity=1.0, rho=part, user_ids=USERS, label="5")
    assert ledger.num_releases() == 4


def test_every_release_goes_through_one_typed_path(tmp_path):
    """Releaser.release: a filtered Releaser refuses an (eps, delta) charge, the ledger's refusal or
    the filter's leaves nothing charged and draws nothing, and the sample is drawn only after the
    typed charge is on disk."""
    from fedkl.privacy.charges import ApproxDPCharge

    drawn = []

    def sample():
        drawn.append(ledger.num_releases())  # how many charges were durable when the noise was drawn
        return "value"

    ledger = PrivacyLedger(tmp_path / "l.sqlite", BUDGET)
    filtered = Releaser(ledger, NoiseSource(0), ZCDPFilter(0.05))
    assert filtered.accepts("zcdp") and not filtered.accepts("approx-dp")
    with pytest.raises(ValueError, match="zCDP filter"):
        filtered.release(ApproxDPCharge(0.1, 1e-7, "ptr"), sample, user_ids=USERS, label="ptr")
    with pytest.raises(ValueError, match="zCDP filter"):
        filtered.require("approx-dp", "my-algorithm")
    assert filtered.release(GaussianCharge(0.03, 1.0), sample, user_ids=USERS, label="g") == "value"
    assert drawn == [1] and ledger.releases()[0]["noise_scale"] == 1.0 / math.sqrt(0.06)
    with pytest.raises(BudgetExhausted):  # the filter (0.05) refuses before the ledger is touched
        filtered.release(GaussianCharge(0.03, 1.0), sample, user_ids=USERS, label="g2")
    assert ledger.num_releases() == 1
    plain = Releaser(ledger, NoiseSource(0))
    assert plain.release(ApproxDPCharge(0.2, 1e-7, "ptr"), sample, user_ids=USERS, label="ptr") == "value"
    with pytest.raises(BudgetExceeded):  # the ledger refuses: nothing written, nothing drawn
        plain.release(ApproxDPCharge(BUDGET.epsilon, 0.0, "ptr"), sample, user_ids=USERS, label="too much")
    assert drawn == [1, 2] and ledger.num_releases() == 2
    left_eps, left_delta = ledger.approx_left(USERS)
    assert 0 < left_eps < BUDGET.epsilon and ledger.rho_left(USERS) > 0
    ledger.verify()


def test_the_remembered_charge_record_is_the_stored_form_of_each_charge(ledger):
    """Releaser._record (one JSON round trip per distinct charge) returns exactly the stored form of
    every charge: a repeated charge, an equal one written differently (1 vs 1.0, -0.0 vs 0.0), a changed
    one; a caller changing its copy does not change the next."""
    from fedkl.privacy.charges import to_record
    from fedkl.privacy.release import _canonical

    r = Releaser(ledger, NoiseSource(seed=1))
    for charge in (GaussianCharge(0.5, 2.0), GaussianCharge(0.5, 2.0), GaussianCharge(0.5, 2), GaussianCharge(0.0, 1.0),
                   GaussianCharge(-0.0, 1.0), GaussianCharge(0.25, 2.0)):  # fmt: skip
        got = r._record(charge)
        assert got == _canonical(to_record(charge)) and repr(got) == repr(_canonical(to_record(charge)))
        got["rho"] = 99.0
        assert r._record(charge)["rho"] == charge.rho
