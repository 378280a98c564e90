"""The built-in many-run audit of fedkl tune (issue 32): the search is not flagged; a search that leaks its
trials' exact validation scores is (fedkl.audit.tune_audit)."""

from fedkl.audit.tune_audit import tune_audit, tune_worlds
from fedkl.tuning import split_users

EPS = 0.3  # below what 8 + 8 error-free evaluation runs can show (largest_attainable_bound ~ 0.457)


def test_tune_audit_worlds_put_the_outlier_in_validation():
    w0, w1 = tune_worlds()
    assert w0.train.user_ids == w1.train.user_ids
    _, val = split_users(w0.train.user_ids, 0, 0.3)
    assert [w0.train.user_ids[i] for i in val][-1].startswith("tune-outlier")


def test_tune_is_not_flagged_and_the_leaky_control_is():
    control = tune_audit(EPS, runs=16, leak=True)
    assert control["largest_attainable_bound"] > EPS  # the audit has the power to flag at this size
    assert control["verdict"] == "VIOLATION" and control["epsilon_lower_bound"] > EPS
    honest = tune_audit(EPS, runs=16)
    assert honest["verdict"] == "consistent with claim" and honest["epsilon_lower_bound"] <= EPS


def test_tune_model_path_is_not_flagged():
    """The outlier as a training user on its own coordinate; the statistic is the released model's coordinate."""
    _, val = split_users(tune_worlds(target="model")[0].train.user_ids, 0, 0.3)
    assert all(tune_worlds(target="model")[0].train.user_ids[i].startswith("tune-outlier") for i in val)
    report = tune_audit(EPS, runs=16, target="model")
    assert report["verdict"] == "consistent with claim" and report["epsilon_lower_bound"] <= EPS
