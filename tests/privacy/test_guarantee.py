"""The declared guarantee (fedkl.privacy.guarantee) decides the run-wide filter and the accountant text."""

import pytest

from fedkl.privacy.clients import ANY_CLIENTS, IN_CLASS_CLIENTS
from fedkl.privacy.guarantee import Guarantee
from fedkl.runner import RunConfig, run_training


def test_filter_and_text_follow_the_declaration():
    assert Guarantee("zcdp").run_wide_filter
    assert not Guarantee("zcdp", "parallel").run_wide_filter  # the per-user ledger holds each cohort
    assert not Guarantee("approx-dp").run_wide_filter and not Guarantee("schedule").zcdp
    assert "cks" in Guarantee("zcdp").accountant("cks", "pld")
    assert Guarantee("schedule").accountant("cks", "pld").startswith("PLD (dp-accounting)")
    assert "basic composition" in Guarantee("approx-dp").accountant("cks", "pld")
    approx_zcdp = Guarantee("approx-zcdp")  # Gaussian charges plus PTR deltas: no zCDP filter can hold them
    assert not approx_zcdp.zcdp and not approx_zcdp.run_wide_filter
    assert "approximate zCDP" in approx_zcdp.accountant("bun_steinke", None)
    assert "bun_steinke conversion" in approx_zcdp.accountant("bun_steinke", None)
    g = Guarantee("approx-dp", "parallel", IN_CLASS_CLIENTS)
    assert Guarantee.from_dict(g.to_dict()) == g
    with pytest.raises(ValueError):
        Guarantee("renyi")
    with pytest.raises(ValueError):
        Guarantee("zcdp", "sometimes")


@pytest.mark.parametrize(
    "algorithm,charges,composition,clients",
    [
        ("noisy-gd", "zcdp", "sequential", ANY_CLIENTS),
        ("fkt-phased-sgd", "zcdp", "parallel", IN_CLASS_CLIENTS),
    ],
)
def test_result_json_reports_the_declared_guarantee(tmp_path, algorithm, charges, composition, clients):
    res = run_training(
        RunConfig.from_settings(
            strict=False,
            dataset="synthetic-logistic",
            users=40,
            algorithm=algorithm,
            rounds=2,
            radius=5.0,
            reference=False,
            noise_seed=1,
            out=str(tmp_path / algorithm),
        ),
        log=lambda _: None,
    )
    assert res["guarantee"] == Guarantee(charges, composition, clients).to_dict()
    assert res["clients_assumed"] == clients.describe()
    assert res["accountant"] == Guarantee(charges).accountant("cks", "pld")
