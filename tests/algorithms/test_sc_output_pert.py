"""sc-output-pert as one class (issue 29): the registered class picks its engine from public values, its
Params are its only configuration (the engine gets the Params' defaults), and a bad combination of flags
is refused when the Params are made, naming the flags."""

import pytest

# the thread fixture (autouse) and the stand-in ledger of the output-perturbation tests
from test_output_pert import _CountingLedger, _one_thread  # noqa: F401

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.output_perturbation.diameter_output_pert import DiameterSCOutputPert, SelectedDeltaSCOutputPert
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert
from fedkl.algorithms.output_perturbation.sc_output_pert import SCOutputPertAlgorithm, SCOutputPertParams
from fedkl.algorithms.registry import REGISTRY
from fedkl.data.synthetic import synthetic_logistic
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import NoiseSource, Releaser
from fedkl.privacy.ledger import BudgetExceeded
from fedkl.problems import make_problem

EPS, DELTA = 8.0, 0.01


def _world(n: int, reg: float = 0.5):
    ds = synthetic_logistic(n, 6, 2, seed=0)
    prob = make_problem("logistic", ds, reg=reg)
    return ds, prob


def _build(n: int, reg: float = 0.5, **params) -> tuple[SCOutputPertAlgorithm, object, object]:
    ds, prob = _world(n, reg)
    ctx = BuildContext.fresh(
        eps=EPS, delta=DELTA, user_ids=ds.train.user_ids, problem=prob, feature_bound=ds.feature_bound
    )
    return SCOutputPertAlgorithm(SCOutputPertParams(**params), ctx), ds, prob


def test_the_registered_class_is_the_algorithm():
    spec = REGISTRY["sc-output-pert"]
    assert spec.cls is SCOutputPertAlgorithm and spec.params is SCOutputPertParams


@pytest.mark.parametrize(
    "n,params,engine,test",
    [
        (12, {}, SCOutputPert, None),  # auto: the paper's exact test up to 20 users
        (40, {}, DiameterSCOutputPert, "vertex-cover"),  # auto: else the diameter test's own auto score
        (40, {"p002_test": "matching"}, DiameterSCOutputPert, "matching"),
        (60, {"p002_delta_select": "sparse-vector", "p002_select_fraction": 0.25}, SelectedDeltaSCOutputPert, None),
    ],
)
def test_the_class_picks_its_engine_with_the_params_values(n, params, engine, test):
    alg, _, prob = _build(n, **params)
    assert type(alg.engine) is engine
    if test is not None:
        assert alg.engine.score(n) == test
    solver = alg.engine if engine is SCOutputPert else alg.engine.solver
    defaults = SCOutputPertParams()
    # the Params are the one configuration: the engine runs at their values, at the budget of the context
    assert (solver.calibration, solver.Delta) == (defaults.p002_calibration, defaults.stability_delta)
    assert (solver.eps, solver.delta, solver.strong_convexity) == (EPS, DELTA, prob.reg)


def test_research_code_runs_the_class_and_the_engine_decides():
    alg, ds, prob = _build(12, stability_delta=3.0)
    fed = InProcessFederation(prob, ds)
    ledger = _CountingLedger()
    res = alg.run(fed, Releaser(ledger, NoiseSource(0)), prob.init_params())
    assert res.theta is not None and res.diagnostics["decided_by"] in ("certificate", "exact")
    assert alg.engine.stats["certificate"] + alg.engine.stats["exact"] == 1
    # one (eps, delta) release, charged at the context's whole budget, labelled by the algorithm's name
    ((charge),) = ledger.charges
    assert (charge["eps"], charge["delta"], charge["label"]) == (EPS, DELTA, "sc-output-pert")


def test_public_refusals_come_before_any_data_is_read():
    with pytest.raises(ValueError, match="strongly convex"):
        _build(12, reg=0.0)
    with pytest.raises(ValueError, match="max_exact_users"):
        _build(25, p002_test="exact")
    with pytest.raises(ValueError, match="diameter test needs"):
        _build(8, p002_test="matching")
    ds, prob = _world(12)
    spent = BuildContext(
        prob, ds.feature_bound, tuple(ds.train.user_ids), DELTA, 0.0, (0.0, 0.0), "cks", "replace-one", 0
    )
    with pytest.raises(BudgetExceeded):
        SCOutputPertAlgorithm(SCOutputPertParams(), spent)


@pytest.mark.parametrize(
    "params,message",
    [
        ({"p002_delta_select": "sparse-vector", "p002_test": "exact"}, "--p002-delta-select sparse-vector uses"),
        ({"p002_delta_select": "sparse-vector", "p002_select_fraction": 1.0}, "--p002-select-fraction must be < 1"),
    ],
)
def test_the_params_refuse_a_bad_combination_naming_the_flags(params, message):
    with pytest.raises(ValueError, match=message):
        SCOutputPertParams(**params)
    fixed = SCOutputPertParams(**{**params, "p002_delta_select": "fixed"})  # the fixed Delta reads neither flag
    assert fixed.p002_delta_select == "fixed"
