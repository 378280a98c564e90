"""A failure never makes whether a run completes depend on the data (issue 28 §2).

The NaN-in-one-world client: it answers the solver honestly at some iterates and NaN at others, where
the iterates depend on an honest user's data. So it fails in world x (honest user's records one way)
and answers honestly in world x' (the other way). Before issue 28 the paper-002 releases aborted on
any failed answer: the run's completion then revealed the honest user's data with certainty. Now both
worlds complete and charge the same ledger rows; the failed client is handled inside the privacy
analysis (fedkl/algorithms/output_perturbation/diameter_output_pert.py and exact_output_pert.py, "Failures").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_output_pert import _one_thread  # noqa: F401  (autouse: one torch thread)

from fedkl.algorithms.output_perturbation.diameter_output_pert import (
    DiameterSCOutputPert,
    DiameterTest,
    SelectedDeltaSCOutputPert,
)
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert
from fedkl.data.synthetic import synthetic_logistic
from fedkl.federation.base import Answers, Federation, GradientsAtPoints
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.problems import make_problem

EPS, DELTA, LAM, DIM, M = 8.0, 0.3, 0.5, 2, 40
HONEST, LIAR = 0, 1


class NaNInOneWorld(Federation):
    """Every user honest except LIAR, whose gradient answer at a point theta is NaN when
    ``theta[0] > threshold`` (a fixed function of the point it is asked: it fails or not depending on
    the iterates, i.e. on the other users' data). ``nan_answers`` counts the NaNs it gave."""

    def __init__(self, inner: InProcessFederation, threshold: float) -> None:
        self.inner, self.threshold, self.nan_answers = inner, threshold, 0

    user_ids = property(lambda self: self.inner.user_ids)
    num_params = property(lambda self: self.inner.num_params)

    def compute(self, query, users=None):
        ans = self.inner.compute(query, users)
        rows = list(range(self.num_users)) if users is None else list(users)
        if not isinstance(query, GradientsAtPoints) or LIAR not in rows:
            return ans
        hit = torch.as_tensor(query.points)[:, 0] > self.threshold
        if not bool(hit.any()):
            return ans
        v = ans.values.clone()
        v[rows.index(LIAR), hit] = float("nan")
        self.nan_answers += int(hit.sum())
        return Answers(ans.users, v, ans.failed)


def _world(n: int, outlier: bool):
    """n IID logistic users; in the second world HONEST's records are all at x = e1 with label +1."""
    ds = synthetic_logistic(n, M, DIM, seed=0)
    tr = ds.train
    X, y = tr.X.clone(), tr.y.clone()
    if outlier:
        rec = tr.user_index == HONEST
        X[rec] = torch.tensor([1.0] + [0.0] * (DIM - 1), dtype=X.dtype)
        y[rec] = 1.0
    ds = dataclasses.replace(ds, train=dataclasses.replace(tr, X=X, y=y))
    prob = make_problem("logistic", ds, reg=0.1)
    return InProcessFederation(prob, ds), prob, ds


def _mechanism(kind: str, prob, ds, n: int):
    solver = SCOutputPert.for_problem(
        prob,
        ds.feature_bound,
        torch.zeros(prob.num_params, dtype=torch.float64),
        eps=EPS,
        delta=DELTA,
        Delta=0.5,
        extra_reg=LAM,
        calibration="tight",
    )
    if kind == "exact":
        return solver
    if kind == "sparse-vector":
        return SelectedDeltaSCOutputPert(solver, DiameterTest(test="matching"), 0.25)
    return DiameterSCOutputPert(solver, DiameterTest(test=kind))


def _kept_value(kind, fed, prob, ds, n, center, path):
    """f~ on the set the honest run (noise seed 3) releases from."""
    mech = _mechanism(kind, prob, ds, n)
    if kind == "exact":
        return mech.plan(fed, center).value
    if kind == "sparse-vector":
        with PrivacyLedger(str(path), Budget(2 * EPS, 2 * DELTA)) as ledger:
            res = mech.run(fed, Releaser(ledger, NoiseSource(3)), center)
        mech = mech.candidates[mech.grid.index(res.diagnostics["Delta_selected"])]
    return mech.plan(fed, center)[0].value


CASES = {"exact": 12, "vertex-cover": 16, "matching": 30, "sparse-vector": 30}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_nan_in_one_world_client_cannot_decide_whether_the_run_completes(tmp_path, kind):
    n = CASES[kind]
    feds = {w: _world(n, w == "x'") for w in ("x", "x'")}
    center = torch.zeros(feds["x"][1].num_params, dtype=torch.float64)
    # the threshold lies between the two worlds' released minimizers (the honest runs' kept sets, same
    # noise seed): the liar fails late in the solve of one world only
    clean = [
        _kept_value(kind, f, p, d, n, center, tmp_path / f"clean{i}.sqlite")
        for i, (f, p, d) in enumerate(feds.values())
    ]
    threshold = float(clean[0][0] + clean[1][0]) / 2
    rows, nans = {}, {}
    for w, (fed, prob, ds) in feds.items():
        liar = NaNInOneWorld(fed, threshold)
        ledger = PrivacyLedger(str(tmp_path / f"{w}.sqlite"), Budget(2 * EPS, 2 * DELTA))
        with ledger:
            res = _mechanism(kind, prob, ds, n).run(liar, Releaser(ledger, NoiseSource(3)), center)  # completes
            rows[w] = [(r["label"], r["users"], r["cohort"], r["eps"], r["delta"]) for r in ledger.releases()]
        nans[w] = liar.nan_answers
        assert res.theta is None or bool(torch.isfinite(res.theta).all())
    # the liar failed in exactly one world (the exact test also solves every subset: there, in both)
    assert sorted(v > 0 for v in nans.values()) == ([True, True] if kind == "exact" else [False, True]), nans
    assert rows["x"] == rows["x'"] and len(rows["x"]) == (2 if kind == "sparse-vector" else 1)


def test_a_failed_answer_in_the_solve_gets_the_user_deleted_and_the_rest_unchanged():
    """Diameter test: a client that fails in the solve of the kept set conflicts with everyone, the test is
    redone and the new kept set solved; without failures the plan is bit for bit the plain one."""
    n = 16
    fed, prob, ds = _world(n, False)
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    mech = _mechanism("vertex-cover", prob, ds, n)
    plain, diag = mech.plan(fed, center)
    assert plain.deleted == () and diag["failed_in_solve"] == 0
    liar = NaNInOneWorld(fed, -1e9)  # NaN at every point it is asked (the public centre included)
    plan, diag = mech.plan(liar, center)
    assert LIAR in plan.deleted and diag["failed_in_solve"] + diag["users_conflicting_with_all"] >= 1
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, list(plan.deleted)] = False
    assert torch.equal(plan.value, mech.solver.solve(fed, mask, center)[0])  # the liar's answers never entered


@pytest.mark.parametrize("bad", ["nan", "missing", "huge"])
def test_the_solver_never_aborts_and_an_in_class_run_is_unchanged(bad):
    n = 12
    fed, prob, ds = _world(n, False)
    center = torch.zeros(prob.num_params, dtype=torch.float64)
    alg = _mechanism("exact", prob, ds, n)
    masks = torch.ones(3, n, dtype=torch.bool)
    masks[1, LIAR] = False
    masks[2, :5] = False

    class Broken(NaNInOneWorld):
        def compute(self, query, users=None):
            ans = self.inner.compute(query, users)
            if not isinstance(query, GradientsAtPoints):
                return ans
            v = ans.values.clone()
            if bad == "missing":
                v[LIAR] = 0.0
                return Answers(ans.users, v, sorted(set(ans.failed) | {LIAR}))
            v[LIAR] = float("nan") if bad == "nan" else 1e300
            return Answers(ans.users, v, ans.failed)

    failed: set[int] = set()
    theta = alg.solve(Broken(fed, 0.0), masks, center, failed)
    assert failed == {LIAR} and bool(torch.isfinite(theta).all())
    # the liar's answers count as zero gradients: the sets without it are exactly the honest solve
    honest = alg.solve(fed, masks, center)
    assert torch.equal(theta[1], honest[1]) and not torch.equal(theta[0], honest[0])
    # honest users never fail the in-class bound, and the ball never moves their iterates
    none: set[int] = set()
    assert torch.equal(alg.solve(fed, masks, center, none), honest) and not none


# --- every registered algorithm --------------------------------------------------------------------
class AlwaysFailing(Federation):
    """USER fails every query (its row zero and listed in ``failed``: the federations' contract, what a
    dropout, a NaN or a malformed reply becomes on every backend)."""

    def __init__(self, inner: Federation, user: int) -> None:
        self.inner, self.user = inner, user

    user_ids = property(lambda self: self.inner.user_ids)
    num_params = property(lambda self: self.inner.num_params)

    def compute(self, query, users=None):
        ans = self.inner.compute(query, users)
        rows = list(range(self.num_users)) if users is None else list(users)
        if self.user not in rows:
            return ans
        v = ans.values.clone()
        v[rows.index(self.user)] = 0
        return Answers(ans.users, v, sorted(set(ans.failed) | {self.user}))


def _train(tmp_path, name: str, failing: bool):
    """(ledger rows, declared guarantee) of ``name``'s small run in-process, with user 1 failing every query."""
    from build_helpers import small_config

    from fedkl.runner import load_run_data, prepare_run, train_federation

    cfg = small_config(name, tmp_path / ("failing" if failing else "honest"))
    dataset, problem, _ = load_run_data(cfg)
    fed = InProcessFederation(problem, dataset)
    fed = AlwaysFailing(fed, 1) if failing else fed
    delta, run_id, _, ledger_path, noise = prepare_run(cfg, fed.num_users)
    _, _, declared = train_federation(cfg, fed, problem, dataset, delta, ledger_path, run_id, noise, lambda _: None)
    with PrivacyLedger(ledger_path) as ledger:
        rows = [(r["label"], r["users"], r["cohort"], r["eps"], r["delta"], r["rho"]) for r in ledger.releases()]
    return rows, declared


def _small_algorithms():
    from build_helpers import SMALL

    from fedkl.runner import ALGORITHMS

    return sorted(set(ALGORITHMS) & set(SMALL))


@pytest.mark.parametrize("name", _small_algorithms())
def test_a_user_failing_every_query_changes_neither_completion_nor_charges(tmp_path, name):
    """The extreme NaN-in-one-world client, for every registered algorithm: it fails every query in one world
    and answers honestly in the other. Both runs complete; a non-adaptive algorithm charges the same rows."""
    honest, declared = _train(tmp_path, name, False)
    failing, _ = _train(tmp_path, name, True)
    assert honest and failing
    if not declared.adaptive:
        assert failing == honest
