"""fedkl tune (issue 32): the search's RDP bound against an exact computation, the one charge before any
trial, refusal before any record is read, the printed split, nothing of the losing trials released, the
chosen settings reproducing the chosen model, and a rerun that does not pay twice."""

import json
import math
import os

import numpy as np
import pytest
from scipy import stats
from scipy.special import logsumexp

import fedkl
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import BudgetExhausted, PrivacyLedger
from fedkl.privacy.charges import SearchCharge, from_record, to_record
from fedkl.privacy.selection import Stopping, dp_delta_from_rdp, search_epsilon, search_rdp, search_rdp_zcdp
from fedkl.privacy.zcdp import delta_cks
from fedkl.runner import RunConfig
from fedkl.tuning import search_space, split_users, tune


# --- the bound: an exact, independent computation -------------------------------------------------------
def _renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    """D_order(p || q) of two pmfs on the same finite set, exactly (log-sum-exp); order 1: KL."""
    m = p > 0
    if order == 1:
        return float(np.sum(p[m] * (np.log(p[m]) - np.log(q[m]))))
    return float(logsumexp(order * np.log(p[m]) + (1 - order) * np.log(q[m])) / (order - 1))


def _best_of_k(base: np.ndarray, pk: np.ndarray) -> np.ndarray:
    """The law of the best of K i.i.d. draws of ``base`` (outcomes in increasing order), K ~ ``pk`` (k = 0..):
    [P(K = 0) (output ⊥), P(best = outcome 0), ...], by direct summation over k of F^k."""
    cdf = np.minimum(np.cumsum(base), 1.0)
    below = np.concatenate([[0.0], cdf[:-1]])
    k = np.arange(len(pk))
    best = np.array([np.sum(pk * (hi**k - lo**k)) for lo, hi in zip(below, cdf)])  # term by term: no cancellation
    return np.concatenate([[pk[0]], best])


def _exact_curve(p, q):
    """The base's exact RDP curve (both directions), vectorized over orders (order 1: KL)."""

    def one_way(x, y, a):
        terms = a[:, None] * np.log(x)[None, :] + (1 - a[:, None]) * np.log(y)[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            d = logsumexp(terms, axis=1) / (a - 1)
        return np.where(a == 1, np.sum(x * (np.log(x) - np.log(y))), d)

    def curve(orders):
        a = np.atleast_1d(np.asarray(orders, dtype=float))
        return np.maximum(one_way(p, q, a), one_way(q, p, a))

    return curve


def _base_mechanisms():
    """eps0-DP mechanisms on two neighbouring inputs, outputs ordered by score: randomized response over
    2 outcomes and a 3-level one; each is (eps0^2 / 2)-zCDP (Bun & Steinke 2016, Prop. 1.4)."""
    e0 = 0.8
    rr = np.array([1.0, math.exp(e0)]) / (1 + math.exp(e0))
    three = np.array([1.0, math.exp(e0 / 2), math.exp(e0)])
    three_q = np.array([math.exp(e0), math.exp(e0 / 2), 1.0])
    return e0, [(rr, rr[::-1].copy()), (three / three.sum(), three_q / three_q.sum())]


LAWS = [
    ("poisson", lambda k: stats.poisson(4.0).pmf(k), Stopping("poisson", mu=4.0)),
    ("log", lambda k: np.where(k > 0, stats.logser(1 - 0.1).pmf(np.maximum(k, 1)), 0.0), Stopping("tnb", eta=0.0, gamma=0.1)),
    (
        "negbin",
        lambda k: np.where(k > 0, stats.nbinom(1.5, 0.3).pmf(k) / (1 - stats.nbinom(1.5, 0.3).pmf(0)), 0.0),
        Stopping("tnb", eta=1.5, gamma=0.3),
    ),
]  # fmt: skip


@pytest.mark.parametrize("name,pmf,law", LAWS, ids=[x[0] for x in LAWS])
def test_search_bound_holds_against_exact_divergence(name, pmf, law):
    """The implemented Theorem 2 / Theorem 6 bound (for the base's zCDP rho, and for its exact RDP curve)
    is at least the exact Renyi divergence of the best-of-K output, both directions, at several orders.
    K's law comes from scipy (not from fedkl.privacy.selection), and so does the mean it implies."""
    e0, mechanisms = _base_mechanisms()
    rho = e0**2 / 2
    k = np.arange(0, 400)
    pk = pmf(k)
    assert abs(pk.sum() - 1) < 1e-9
    assert abs(np.sum(k * pk) - law.expected_trials) < 1e-6 * law.expected_trials
    for p, q in mechanisms:
        a, b = _best_of_k(p, pk), _best_of_k(q, pk)
        curve = _exact_curve(p, q)
        for order in (1.5, 2.0, 4.0, 8.0, 16.0, 32.0):
            exact = max(_renyi(a, b, order), _renyi(b, a, order))
            assert exact <= search_rdp(order, curve, law) + 1e-12
            assert exact <= search_rdp_zcdp(order, rho, law) + 1e-12
            assert curve(order)[0] <= rho * order  # the base really is rho-zCDP here
    # a tight base (a discrete Gaussian shifted by one, scores = its values): the bound for its exact curve
    # is within a small factor of the exact divergence somewhere, so a dropped term shows
    j = np.arange(-6, 8)
    p = np.exp(-(j**2) / 2.0) / np.exp(-(j**2) / 2.0).sum()
    q = np.exp(-((j - 1) ** 2) / 2.0) / np.exp(-((j - 1) ** 2) / 2.0).sum()
    a, b = _best_of_k(p, pk), _best_of_k(q, pk)
    curve = _exact_curve(p, q)
    ratios = []
    for order in (1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0):
        exact = max(_renyi(a, b, order), _renyi(b, a, order))
        bound = search_rdp(order, curve, law)
        assert exact <= bound + 1e-12
        ratios.append(exact / bound)
    assert max(ratios) > 0.2, ratios


def test_bound_reduces_to_one_trial_and_reuses_the_cks_profile():
    """eta -> -1: K = 1 almost surely, and the bound tends to one trial's RDP rho * l; Poisson's delta_hat
    for zCDP is the CKS profile (fedkl.privacy.zcdp.delta_cks), never below it."""
    rho = 0.3
    law = Stopping("tnb", eta=-1 + 1e-9, gamma=0.5)
    assert abs(law.expected_trials - 1) < 1e-6
    for order in (1.5, 3.0, 10.0):
        assert search_rdp_zcdp(order, rho, law) == pytest.approx(rho * order, abs=1e-6)
    for eps in (0.1, 0.7, 2.0):
        ours, cks = dp_delta_from_rdp(lambda a: rho * a, eps), delta_cks(rho, eps)
        assert cks <= ours <= cks * (1 + 1e-3)
    # a Poisson search with mu -> 0 costs nothing but ln(mu)/(l-1) < 0 at every order: eps -> 0
    assert search_epsilon(rho, Stopping("poisson", mu=1e-6), 1e-5) < search_epsilon(
        rho, Stopping("poisson", mu=1.0), 1e-5
    )
    assert search_epsilon(rho, Stopping("tnb", eta=-1 + 1e-9, gamma=0.5), 1e-5) == pytest.approx(
        search_epsilon(rho, Stopping("tnb", eta=-1 + 1e-6, gamma=0.5), 1e-5), rel=1e-3
    )


@pytest.mark.parametrize("law", [x[2] for x in LAWS] + [Stopping("tnb", eta=-0.5, gamma=0.05)])
def test_zcdp_closed_form_is_the_general_bound(law):
    """The closed form for rho-zCDP trials (l_hat at sqrt(ln(1/gamma)/rho)) equals the general bound on the
    curve rho * l, minimized over a grid (never above it, and within the grid's resolution)."""
    for rho in (0.01, 0.3, 5.0):
        for order in (1.2, 2.0, 9.0, 100.0):
            closed, grid = search_rdp_zcdp(order, rho, law), search_rdp(order, lambda a: rho * a, law)
            assert closed <= grid + 1e-12 and grid - closed <= 1e-5 * max(1.0, abs(grid))


def test_search_charge_is_reverified():
    law = Stopping.with_mean("tnb", 4.0)
    eps = search_epsilon(0.05, law, 1e-5)
    charge = SearchCharge(eps=eps, delta=1e-5, rho_trial=0.05, stopping="tnb", eta=law.eta, gamma=law.gamma)
    assert from_record(to_record(charge)) == charge and charge.cost() == (0.0, eps, 1e-5)
    with pytest.raises(ValueError, match="more than the charge's eps"):
        SearchCharge(eps=eps * 0.99, delta=1e-5, rho_trial=0.05, stopping="tnb", eta=law.eta, gamma=law.gamma)


# --- the search ---------------------------------------------------------------------------------------------
USERS = 36
BASE = dict(dataset="synthetic-logistic", problem="logistic", users=USERS, seed=1, reference=False, epsilon=4.0)


def _cfg(tmp_path, sub="run", **kw):
    return RunConfig.from_settings(**{**BASE, "noise_seed": 3, **kw}, out=str(tmp_path / sub))


GRID = {"lr": ["0.5", "1.0"], "rounds": ["2", "3"]}


def test_one_charge_before_any_trial_and_nothing_of_the_losers(tmp_path, monkeypatch):
    import fedkl.tuning as tuning

    cfg = _cfg(tmp_path)
    ledger_path = str(tmp_path / "run" / "ledger.sqlite")
    seen: dict = {"queries": 0, "scores": [], "lines": []}
    original_sum, original_trial = InProcessFederation.sum, tuning.run_trial

    def spy_sum(self, query, users=None):
        if seen["queries"] == 0:  # the first query of the first trial: the search is already charged, once
            with PrivacyLedger(ledger_path) as ledger:
                rows = ledger.releases()
            assert [r["mechanism"] for r in rows] == ["private-selection"] and rows[0]["users"] == USERS
        seen["queries"] += 1
        return original_sum(self, query, users)

    def spy_trial(*args, **kw):
        w, score = original_trial(*args, **kw)
        seen["scores"].append(score)
        return w, score

    def log(line):
        if line.startswith("budget split"):  # printed before anything is spent
            with PrivacyLedger(ledger_path) as ledger:
                assert ledger.num_releases() == 0
        seen["lines"].append(line)

    monkeypatch.setattr(InProcessFederation, "sum", spy_sum)
    monkeypatch.setattr(tuning, "run_trial", spy_trial)
    result = tune(cfg, ["noisy-gd"], GRID, trials=4.0, log=log)
    assert seen["queries"] > 0 and len(seen["scores"]) >= 2, "pick a seed with at least two trials"
    assert sum(line.startswith("  trial") for line in seen["lines"]) == len(seen["scores"])
    with PrivacyLedger(ledger_path) as ledger:
        ledger.verify()
        assert [r["mechanism"] for r in ledger.releases()] == ["private-selection"]
        charge = from_record(ledger.releases()[0]["charge"])
    assert charge == SearchCharge(**{k: v for k, v in result["search"]["charge"].items() if k != "type"})
    assert result["ledger"]["max_user_epsilon"] <= cfg.epsilon
    best = max(seen["scores"])
    assert result["selected"]["validation_score"] == best
    text = open(os.path.join(cfg.out, "result.json")).read() + "\n".join(seen["lines"])
    for score in seen["scores"]:
        if score != best:  # a losing trial's score leaves the server neither in result.json nor on stdout
            assert repr(score) not in text and f"{score:.4f}" not in text and f"{score:.3f}" not in text
    assert "trials_run" not in text and "K =" not in text
    # a finished search is not run again on the same folder (a second output would be a second release)
    with pytest.raises(ValueError, match="finished search"):
        tune(cfg, ["noisy-gd"], GRID, trials=4.0, log=None or (lambda _: None))


def test_chosen_settings_reproduce_the_chosen_model(tmp_path):
    data = load_dataset("synthetic-logistic", seed=1, n_users=USERS)
    run = fedkl.tune(data, ["noisy-gd"], GRID, trials=3.0, log=None, **{k: v for k, v in BASE.items() if k not in ("dataset", "reference", "epsilon", "users")}, epsilon=4.0, noise_seed=3, out=str(tmp_path / "t"))  # fmt: skip
    sel, search = run.result["selected"], run.result["search"]
    train_pos, _ = split_users(data.train.user_ids, BASE["seed"], 0.3)
    part = type(data)(**{**data.__dict__, "train": data.train.subset(train_pos), "test": data.test.subset(train_pos)})
    again = fedkl.train(
        part, sel["algorithm"], epsilon=search["chosen_model_alone_epsilon"], delta=run.delta, conversion="cks",
        noise_seed=sel["trial_noise_seed"], seed=BASE["seed"], problem="logistic", force=True, log=None,
        out=str(tmp_path / "again"), **sel["settings"],
    )  # fmt: skip
    assert again.model is not None and bool((again.model == run.model).all())


def test_refused_before_any_record_is_read(tmp_path, monkeypatch):
    def no_read(*a, **k):
        raise AssertionError("a record was read")

    monkeypatch.setattr(InProcessFederation, "sum", no_read)
    monkeypatch.setattr(InProcessFederation, "evaluate", no_read)
    # the stopping rule alone does not fit: ln E[K] / (l - 1) and the like exceed a tiny epsilon
    with pytest.raises(BudgetExhausted, match="does not fit"):
        tune(_cfg(tmp_path, epsilon=0.02), ["noisy-gd"], GRID, trials=50.0, log=lambda _: None)
    assert not os.path.exists(tmp_path / "run" / "ledger.sqlite")  # --users fixes n: refused before loading
    # a ledger whose users already spent their budget on a search
    ledger = str(tmp_path / "shared.sqlite")
    monkeypatch.undo()
    tune(_cfg(tmp_path, "first", ledger=ledger), ["noisy-gd"], GRID, trials=2.0, log=lambda _: None)
    monkeypatch.setattr(InProcessFederation, "sum", no_read)
    with pytest.raises(BudgetExhausted):
        tune(_cfg(tmp_path, "second", ledger=ledger), ["noisy-gd"], GRID, trials=2.0, log=lambda _: None)
    with PrivacyLedger(ledger) as led:
        assert led.num_releases() == 1


def test_refuses_non_zcdp_algorithms_and_bad_grids(tmp_path):
    with pytest.raises(ValueError, match="without an RDP curve"):
        tune(_cfg(tmp_path), ["noisy-gd", "phased-erm"], {}, trials=2.0, log=lambda _: None)
    with pytest.raises(ValueError, match="no algorithm of the search"):
        search_space(["noisy-gd"], {"kl_gamma": ["1"]})
    with pytest.raises(ValueError):
        search_space(["noisy-gd"], {"rounds": ["-1"]})


def test_crashed_search_is_rerun_on_its_charge(tmp_path):
    cfg = _cfg(tmp_path)

    def crash(t):
        raise RuntimeError("power loss")

    with pytest.raises(RuntimeError, match="power loss"):
        tune(cfg, ["noisy-gd"], GRID, trials=3.0, log=lambda _: None, before_trial=crash)
    lines: list[str] = []
    result = tune(cfg, ["noisy-gd"], GRID, trials=3.0, log=lines.append)
    assert any("not charged again" in line for line in lines)
    with PrivacyLedger(os.path.join(cfg.out, "ledger.sqlite")) as ledger:
        assert ledger.num_releases() == 1
        ledger.verify()
    assert json.load(open(os.path.join(cfg.out, "tune_state.json")))["status"] == "finished"
    assert result["selected"] is not None


def test_cli_tune(tmp_path, capsys):
    from fedkl.cli import main

    out = str(tmp_path / "cli")
    rc = main(["tune", "--dataset", "synthetic-logistic", "--users", "30", "--epsilon", "4", "--grid", "lr=0.5,1",
               "--rounds", "2", "--trials", "2", "--noise-seed", "0", "--no-reference", "--out", out])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.index("budget split") < text.index("  trial 1") < text.index("selected:")
    assert json.load(open(os.path.join(out, "result.json")))["selected"]["settings"]["rounds"] == 2
    assert not [f for f in os.listdir(out) if "NOT_PUBLIC" in f]  # the operator view is opt-in
    assert "NOT PUBLIC" not in text
    rc = main(["tune", "--dataset", "synthetic-logistic", "--users", "30", "--grid", "nope=1", "--out", out + "2"])
    assert rc == 2


def test_cli_tune_on_a_users_file(tmp_path, capsys):
    """`fedkl tune` on the user's own CSV (docs/how-to/tune.md): the same one charge on every user of the file,
    a selected model and its settings."""
    import numpy as np

    from fedkl.cli import main
    from fedkl.privacy.ledger import PrivacyLedger

    rng = np.random.default_rng(0)
    users = np.repeat([f"u{i}" for i in range(40)], 10)
    x = rng.normal(size=(len(users), 3))
    path = tmp_path / "records.csv"
    with open(path, "w") as f:
        f.write("id,a,b,c,y\n")
        for u, row in zip(users, x):
            f.write(f"{u},{row[0]:.6f},{row[1]:.6f},{row[2]:.6f},{int(row.sum() > 0)}\n")
    out = str(tmp_path / "file")
    rc = main(["tune", "--dataset", str(path), "--user-column", "id", "--label-column", "y", "--task", "binary",
               "--feature-bound", "10", "--epsilon", "4", "--delta", "1e-3", "--grid", "lr=0.5,1", "--rounds", "2",
               "--trials", "2", "--noise-seed", "0", "--no-reference", "--out", out])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert json.load(open(os.path.join(out, "result.json")))["selected"]["settings"]["lr"] in (0.5, 1.0)
    with PrivacyLedger(os.path.join(out, "ledger.sqlite")) as ledger:
        (search,) = ledger.releases()  # one typed charge: the whole search
        spends = ledger.user_spends()
    assert search["users"] == 40 and len(spends) == 40
    assert {(s["releases"], s["epsilon"]) for s in spends} == {(1, spends[0]["epsilon"])} and spends[0]["epsilon"] > 0


def test_cli_tune_operator_view_is_an_explicit_opt_in(tmp_path, capsys):
    """--operator-view writes every trial's settings and private score (trials.NOT_PUBLIC.csv/.png), marked
    NOT PUBLIC in the names, the table's first line and the console line that announces them."""
    from fedkl.cli import main
    from fedkl.tuning import OPERATOR_TABLE

    out = str(tmp_path / "view")
    rc = main(["tune", "--dataset", "synthetic-logistic", "--users", "30", "--epsilon", "4", "--grid", "lr=0.5,1",
               "--rounds", "2", "--trials", "2", "--noise-seed", "0", "--no-reference", "--out", out,
               "--operator-view"])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    table = os.path.join(out, OPERATOR_TABLE)
    assert os.path.exists(table) and os.path.exists(os.path.splitext(table)[0] + ".png")
    lines = open(table).read().splitlines()
    trials = sum(line.startswith("  trial") for line in text.splitlines())
    assert lines[0].startswith("# NOT PUBLIC") and len(lines) == 2 + trials  # comment, header, one row per trial
    (announce,) = [line for line in text.splitlines() if OPERATOR_TABLE in line]
    assert "NOT PUBLIC" in announce and "--operator-view" in announce
    result = open(os.path.join(out, "result.json")).read()
    assert "NOT_PUBLIC" not in result  # never read into the release


def test_refused_before_the_data_is_loaded_when_delta_is_given(tmp_path, monkeypatch):
    import fedkl.tuning as tuning

    def no_load(*a, **k):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr(tuning, "load_run_dataset", no_load)
    with pytest.raises(BudgetExhausted, match="does not fit"):
        tune(_cfg(tmp_path, epsilon=0.001, delta=1e-6), ["noisy-gd"], GRID, trials=50.0, log=lambda _: None)
    assert not os.path.exists(tmp_path / "run" / "ledger.sqlite")


def test_the_ledger_reverifies_the_search_charge(tmp_path):
    """A search charge whose recorded eps is below the theorem's (a tampered or miscomputed row) fails verify."""
    import sqlite3

    cfg = _cfg(tmp_path)
    tune(cfg, ["noisy-gd"], GRID, trials=2.0, log=lambda _: None)
    path = os.path.join(cfg.out, "ledger.sqlite")
    db = sqlite3.connect(path)
    (record,) = db.execute("SELECT charge FROM releases").fetchone()
    record = json.loads(record)
    db.execute(
        "UPDATE releases SET charge = ?, eps = ?", (json.dumps({**record, "eps": record["eps"] / 2}), record["eps"] / 2)
    )
    db.execute("UPDATE users SET eps = ?", (record["eps"] / 2,))
    db.commit()
    db.close()
    with PrivacyLedger(path) as ledger, pytest.raises(ValueError, match="more than the charge's eps"):
        ledger.verify()


def _algorithms():
    import fedkl.algorithms.catalog  # noqa: F401  (every built-in algorithm registered)
    from fedkl.algorithms.registry import REGISTRY

    return sorted(REGISTRY)


@pytest.mark.parametrize("name", _algorithms())
def test_every_algorithm_is_refused_in_one_line_or_fits_its_trial(name, tmp_path):
    """The seam, over every registered algorithm: the preflight (public values only) refuses it with a
    one-line ValueError, or it is zCDP (or a dp-accounting schedule, on the grid curve) and one trial of it at
    its small setting stays within its trial curve on its stand-in ledger (what the search's charge covers;
    run_trial raises otherwise)."""
    import dataclasses

    from build_helpers import SMALL

    import fedkl.tuning as tuning
    from fedkl.algorithms.registry import algorithm_spec

    small = dict(SMALL.get(name, {}))
    own = {f.name for f in dataclasses.fields(algorithm_spec(name).params)}
    settings = {k: v for k, v in small.items() if k in own}
    run = {k: v for k, v in small.items() if k not in own}
    cfg = RunConfig.from_settings(
        strict=False, **{**BASE, "rounds": 2, "users": 30, **run, "noise_seed": 1}, algorithm=name, out=str(tmp_path)
    )
    data = load_dataset("synthetic-logistic", seed=1, n_users=cfg.users)
    plan = tuning.plan_search(4.0, 1e-3, Stopping.with_mean("tnb", 2.0), tuning.space_curve([(name, settings)]))
    try:
        tuning._preflight(cfg, [(name, settings)], data, plan)
    except ValueError as e:
        assert "\n" not in str(e)
        assert not tuning._is_schedule(name), f"a dp-accounting schedule is searchable (grid curve): {e}"
        return
    trial = tuning._trial_config(cfg, name, settings, plan, 7)
    train_pos, val_pos = split_users(data.train.user_ids, 1, 0.3)
    part = type(data)(**{**data.__dict__, "train": data.train.subset(train_pos), "test": data.test.subset(train_pos)})
    w, score = tuning.run_trial(
        trial, part, data.train.subset(val_pos), plan, tuning.NoiseSource(7), str(tmp_path), "t", 1.0
    )
    assert w is None or math.isfinite(score)


# --- review fixes ---------------------------------------------------------------------------------------------
def test_one_users_nan_loss_moves_the_score_by_at_most_the_bound():
    """A user whose own records make its loss NaN counts as the worst value B: the sum stays finite and
    within B of its neighbour's (a NaN sum would be an unbounded change by one user)."""
    import torch

    from fedkl.tuning import score_values

    data = load_dataset("synthetic-logistic", seed=1, n_users=6).train

    class Fake:
        dtype = torch.float64

        def __init__(self, bad_user):
            self.bad_user = bad_user

        def record_losses(self, w, d):
            losses = torch.full((d.X.shape[0],), 0.25, dtype=torch.float64)
            if self.bad_user is not None:
                losses[d.user_index == self.bad_user] = float("nan")
            return losses

    honest, _, _ = score_values(Fake(None), torch.zeros(1), data, "regression", 2.0)
    nan, bound, higher = score_values(Fake(3), torch.zeros(1), data, "regression", 2.0)
    assert not higher and bound == 2.0 and bool(torch.isfinite(nan).all())
    assert float(nan[3]) == 2.0 and abs(float(nan.sum() - honest.sum())) <= bound


def test_result_json_does_not_depend_on_the_number_of_trials(tmp_path, monkeypatch):
    """K is not released: two searches whose first trial wins, with K = 1 and K = 3, write the same
    result.json up to their run's own names (no wall time, no count)."""
    import fedkl.tuning as tuning

    original = tuning.run_trial

    def first_wins(cfg, train_ds, val_data, plan, noise, workdir, tag, score_bound):
        w, _ = original(cfg, train_ds, val_data, plan, noise, workdir, tag, score_bound)
        return w, (1.0 if tag == "trial-1" else 0.0)

    monkeypatch.setattr(tuning, "run_trial", first_wins)
    results = []
    for k in (1, 3):
        monkeypatch.setattr(Stopping, "sample", lambda self, uniform, k=k: k)
        cfg = _cfg(tmp_path, f"k{k}")
        tune(cfg, ["noisy-gd"], {"lr": ["0.5"]}, trials=3.0, log=lambda _: None)
        text = open(os.path.join(cfg.out, "result.json")).read()
        results.append(
            json.loads(
                text.replace(f"k{k}", "OUT").replace(
                    json.load(open(os.path.join(cfg.out, "tune_state.json")))["run_id"], "RUN"
                )
            )
        )
    assert results[0] == results[1]


def test_refused_before_loading_at_the_default_delta_of_a_known_enrolment(tmp_path, monkeypatch):
    """Without --delta, a synthetic dataset's --users fixes the default delta 1/n^1.1: a search that cannot
    fit it is refused before the data is loaded."""
    import fedkl.tuning as tuning

    assert load_dataset("synthetic-logistic", seed=1, n_users=USERS).train.num_users == USERS  # n is exact

    def no_load(*a, **k):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr(tuning, "load_run_dataset", no_load)
    with pytest.raises(BudgetExhausted, match="does not fit"):
        tune(_cfg(tmp_path, epsilon=0.01), ["noisy-gd"], GRID, trials=50.0, log=lambda _: None)
    assert not os.path.exists(tmp_path / "run" / "ledger.sqlite")


def test_a_crash_between_the_charge_and_the_state_does_not_charge_twice(tmp_path, monkeypatch):
    import fedkl.tuning as tuning

    cfg = _cfg(tmp_path)
    ledger_path = os.path.join(cfg.out, "ledger.sqlite")
    real = tuning.write_json

    def fail_after_the_charge(path, payload):
        if path.endswith("tune_state.json") and payload.get("charge_id") is not None:
            raise OSError("disk full")  # the charge is made; recording it fails
        return real(path, payload)

    monkeypatch.setattr(tuning, "write_json", fail_after_the_charge)
    with pytest.raises(OSError, match="disk full"):
        tune(cfg, ["noisy-gd"], GRID, trials=2.0, log=lambda _: None)
    with PrivacyLedger(ledger_path) as ledger:
        assert ledger.num_releases() == 1
    monkeypatch.undo()
    lines: list[str] = []
    result = tune(cfg, ["noisy-gd"], GRID, trials=2.0, log=lines.append)
    assert any("not charged again" in line for line in lines)
    with PrivacyLedger(ledger_path) as ledger:
        assert ledger.num_releases() == 1
        ledger.verify()
    assert result["search"]["charge"]["eps"] <= cfg.epsilon


def test_a_crash_in_the_charge_is_rerun_as_a_new_search(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)

    def power_loss(self, *a, **k):
        raise RuntimeError("power loss")  # before the charge commits: nothing charged

    monkeypatch.setattr(PrivacyLedger, "charge", power_loss)
    with pytest.raises(RuntimeError, match="power loss"):
        tune(cfg, ["noisy-gd"], GRID, trials=2.0, log=lambda _: None)
    monkeypatch.undo()
    tune(cfg, ["noisy-gd"], GRID, trials=2.0, log=lambda _: None)
    with PrivacyLedger(os.path.join(cfg.out, "ledger.sqlite")) as ledger:
        assert ledger.num_releases() == 1
        assert [r["status"] for r in ledger.runs()] == ["refused", "finished"]


def test_distributions_are_drawn_per_trial_within_their_ranges():
    from fedkl.tuning import Dist, draw_settings

    rng = np.random.default_rng(0)
    n = 4000
    log = [Dist.parse("log:0.1:10").sample(rng.random) for _ in range(n)]
    ints = [Dist.parse("int:2:5").sample(rng.random) for _ in range(n)]
    assert all(0.1 <= v <= 10 for v in log) and set(ints) == {2, 3, 4, 5}
    tol = 4 * math.sqrt(0.25 / n)  # 4 standard errors of a proportion
    assert abs(np.mean(np.array(log) < 1.0) - 0.5) < tol  # log-uniform: half below the geometric midpoint
    for k in (2, 3, 4, 5):
        assert abs(ints.count(k) / n - 0.25) < 4 * math.sqrt(0.25 * 0.75 / n)
    assert Dist.parse("0.5") is None
    drawn = draw_settings({"lr": Dist.parse("uniform:1:2"), "rounds": 3}, rng.random)
    assert 1 <= drawn["lr"] <= 2 and drawn["rounds"] == 3


def test_search_space_validates_distributions_before_any_data():
    points = search_space(["noisy-gd"], {"lr": ["log:0.1:10"], "rounds": ["2", "3"]})
    assert len(points) == 2 and str(points[0][1]["lr"]) == "log:0.1:10"
    with pytest.raises(ValueError, match="int:LO:HI"):
        search_space(["noisy-gd"], {"rounds": ["log:1:5"]})
    with pytest.raises(ValueError):
        search_space(["noisy-gd"], {"rounds": ["int:0:5"]})  # rounds 0 refused by the Params, at the low end
    with pytest.raises(ValueError, match="lo > 0"):
        search_space(["noisy-gd"], {"lr": ["log:0:1"]})


def test_tune_draws_settings_from_a_distribution(tmp_path):
    lines: list[str] = []
    result = tune(_cfg(tmp_path), ["noisy-gd"], {"lr": ["log:0.1:3"], "rounds": ["int:1:3"]}, trials=3.0,
                  log=lines.append)  # fmt: skip
    sel = result["selected"]["settings"]
    assert 0.1 <= sel["lr"] <= 3 and sel["rounds"] in (1, 2, 3)
    trial_lines = [line for line in lines if line.startswith("  trial")]
    assert trial_lines and all("log:" not in line for line in trial_lines)  # drawn values, not the law
    assert any(f"lr={sel['lr']}" in line and f"rounds={sel['rounds']}" in line for line in trial_lines)
    # a seeded search's trials are seeded_trials' (what a study on public data reports: K and the draws)
    from fedkl.tuning import seeded_trials

    grid = {"lr": ["log:0.1:3"], "rounds": ["int:1:3"]}
    drawn = seeded_trials(3, Stopping.with_mean("tnb", 3.0, 0.0), search_space(["noisy-gd"], grid))
    assert [line.split(": ", 1)[1] for line in trial_lines] == [
        f"{name} " + " ".join(f"{k}={v}" for k, v in settings.items()) for name, settings in drawn
    ]


@pytest.mark.parametrize("relation", ["replace-one", "add-remove"])
def test_score_noise_is_calibrated_to_the_bound_under_both_relations(tmp_path, relation):
    """The score's release: sensitivity B (values in [0, B]: replacing one user's value, or zeroing it out,
    moves the sum by at most B), noise std B / sqrt(2 rho_trial)."""
    import torch

    import fedkl.tuning as tuning
    from fedkl.privacy import NoiseSource
    from fedkl.problems import make_problem

    data = load_dataset("synthetic-logistic", seed=1, n_users=USERS)
    train_pos, val_pos = split_users(data.train.user_ids, 1, 0.3)
    train_ds, val_ds = tuning._part(data, train_pos, "t"), tuning._part(data, val_pos, "v")
    plan = tuning.plan_search(4.0, 1e-3, Stopping.with_mean("tnb", 2.0))
    cfg = tuning._trial_config(_cfg(tmp_path, neighbouring=relation), "noisy-gd", {"rounds": 2}, plan, 5)
    w, _ = tuning.run_trial(cfg, train_ds, val_ds.train, plan, NoiseSource(5), str(tmp_path), "t1", 1.0)
    with PrivacyLedger(str(tmp_path / "t1-score.sqlite")) as ledger:
        (row,) = ledger.releases()
    assert row["sensitivity"] == 1.0 and math.isclose(row["noise_scale"], 1.0 / math.sqrt(2 * plan.rho_trial))
    # every validation user's value lies in [0, B]: replacing it (replace-one) or zeroing it out (add-remove
    # against the public enrolment: an absent user contributes 0) moves the sum by at most B
    problem = make_problem("logistic", train_ds)
    values, bound, _ = tuning.score_values(problem, torch.as_tensor(w).to(problem.dtype), val_ds.train, "binary", 1.0)
    assert bound == 1.0 and bool(((values >= 0) & (values <= bound)).all()) and len(values) == len(val_pos)


def test_a_crash_while_writing_the_output_is_not_rerun(tmp_path, monkeypatch):
    """model.pt is out, result.json fails: a rerun would release a second search on the same charge: refused."""
    import fedkl.tuning as tuning

    cfg = _cfg(tmp_path)
    real = tuning.write_json

    def fail_result(path, payload):
        if path.endswith("result.json"):
            raise OSError("disk full")
        return real(path, payload)

    monkeypatch.setattr(tuning, "write_json", fail_result)
    with pytest.raises(OSError, match="disk full"):
        tune(cfg, ["noisy-gd"], GRID, trials=2.0, log=lambda _: None)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="second release"):
        tune(cfg, ["noisy-gd"], GRID, trials=2.0, log=lambda _: None)
    with PrivacyLedger(os.path.join(cfg.out, "ledger.sqlite")) as ledger:
        assert ledger.num_releases() == 1


@pytest.mark.parametrize("law", [x[2] for x in LAWS] + [Stopping("tnb", eta=-0.5, gamma=0.05)])
def test_search_epsilon_is_the_conversion_of_the_per_order_bound(law):
    """search_epsilon's vectorized TNB curve is search_rdp_zcdp at every order (converted the same way)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    from fedkl.privacy.selection import ORDERS

    for rho in (1e-4, 0.05, 1.0):
        curve = [search_rdp_zcdp(o, rho, law) for o in ORDERS]
        expected = rdp_lib.compute_epsilon(list(ORDERS), curve, 1e-5)[0]
        assert search_epsilon(rho, law, 1e-5) == pytest.approx(expected, rel=1e-12, abs=1e-12)
