"""DP-FTRL with correlated noise (fedkl/algorithms/gradient/dp_ftrl.py): the (b, k) participation scheduler,
the noise scale against enumerated sensitivity, adversarial neighbours, per-participation ledger
charges that add up to the mechanism's rho, refusals before data, Flower bit for bit, MovieLens."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from build_helpers import SMALL
from test_algorithm_registry import _flower_equals_inprocess  # tests/algorithms: the shared Flower check

from fedkl import cli
from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.dp_ftrl import DPFTRL, DPFTRLParams, ParticipationScheduler
from fedkl.data import load_dataset
from fedkl.data.base import FederatedDataset, UserData
from fedkl.federation.base import ClippedLocalUpdate
from fedkl.federation.clipping import clip_rows
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy import matrix_mechanism as mm
from fedkl.privacy.zcdp import eps_gaussian
from fedkl.problems import make_problem


def _ftrl(rho, user_ids, neighbouring="add-remove", seed=0, **params):
    """dp-ftrl for ``user_ids`` with zCDP ``rho`` left (``params``: DPFTRLParams)."""
    ctx = BuildContext.fresh(rho=rho, user_ids=user_ids, neighbouring=neighbouring, seed=seed)
    return DPFTRL(DPFTRLParams(**params), ctx)


IDS = [f"u{i}" for i in range(12)]


def _fed(n_users=12, m=6, d=4, seed=0):
    ds = load_dataset("synthetic-logistic", n_users=n_users, m=m, d=d, seed=seed)
    return ds, InProcessFederation(make_problem("logistic", ds), ds)


def test_scheduler_enforces_min_separation_and_max_participations():
    ids = [f"u{i}" for i in range(10)]
    s = ParticipationScheduler(ids, rounds=6, min_separation=3, max_participations=2, seed=1)
    seen: dict[int, list[int]] = {}
    for t in range(6):
        for u in s.admit(t, s.planned(t)):
            seen.setdefault(u, []).append(t)
    assert set(seen) == set(range(10))  # every user has a residue < b, and T >= b
    for rounds in seen.values():
        assert len(rounds) <= 2 and all(q - p >= 3 for p, q in zip(rounds, rounds[1:]))
        assert len({t % 3 for t in rounds}) == 1
    assert s.planned(6) == []  # t // b = 2 >= k: nobody is scheduled after k b rounds
    # a user that would violate b or k is not asked
    s2 = ParticipationScheduler(ids, rounds=6, min_separation=3, max_participations=2, seed=1)
    assert s2.admit(0, [0, 1]) == [0, 1]
    assert s2.admit(2, [0, 2]) == [2]  # user 0 only 2 rounds later (< b)
    assert s2.admit(3, [0]) == [0] and s2.admit(7, [0]) == []  # a third participation (> k)
    # the residues are a public function of the ids and the seed
    again = ParticipationScheduler(ids, rounds=6, min_separation=3, max_participations=2, seed=1)
    other = ParticipationScheduler(ids, rounds=6, min_separation=3, max_participations=2, seed=2)
    assert again.residue == s.residue and other.residue != s.residue


@pytest.mark.parametrize(
    "n, rounds, b, k, msg",
    [
        (4, 6, 5, 2, "more than the 4 users"),
        (12, 7, 3, 2, "the later rounds would ask nobody"),
        (12, 4, 0, 2, "b must"),
    ],
)
def test_schedules_that_would_ask_nobody_are_refused(n, rounds, b, k, msg):
    with pytest.raises(ValueError, match=msg):
        ParticipationScheduler.check(n, rounds, b, k)


@pytest.mark.parametrize("relation, factor", [("add-remove", 1.0), ("replace-one", 2.0)])
@pytest.mark.parametrize(
    "factorization, band", [("tree", None), ("banded", 2), ("banded", 5), ("blt", None), ("blt-opt", None)]
)
def test_noise_std_is_the_enumerated_worst_pattern_over_sqrt_2rho(relation, factor, factorization, band):
    # T = 9 rounds, b = 3, k = 3 (a schedule that asks someone every round: T <= k b)
    alg = _ftrl(0.3, IDS, relation, rounds=9, clip=0.7, factorization=factorization, band=band, min_separation=3,
                max_participations=3, local_lr=0.5)  # fmt: skip
    brute = mm.brute_force_max(alg.factor.matrix(), 3, 3)
    expected = factor * 0.7 * math.sqrt(max(brute)) / math.sqrt(2 * 0.3)
    assert alg.noise_std == pytest.approx(expected, rel=1e-12)
    # the charges of one user's j participations add up to Delta_j^2 / (2 sigma^2); at k: the budget
    total = 0.0
    for j in (1, 2, 3):
        total += alg.charge(j).rho
        assert alg.charge(j).noise_scale == pytest.approx(alg.noise_std, rel=1e-12)
        assert total == pytest.approx((factor * 0.7) ** 2 * max(brute[:j]) / (2 * alg.noise_std**2), rel=1e-12)
    assert total == pytest.approx(0.3, rel=1e-12)


class _DrawRecorder(NoiseSource):
    def __init__(self, seed):
        super().__init__(seed)
        self.draws = []

    def gaussian(self, shape, std):
        out = super().gaussian(shape, std)
        self.draws.append((std, out.clone()))
        return out


@pytest.mark.statistical
@pytest.mark.parametrize("factorization", ["tree", "banded", "blt", "blt-opt"])
def test_run_draws_the_calibrated_noise_and_charges_each_participation(tmp_path, factorization):
    """The Z rows drawn have std sigma (5 standard errors of the sample std; the wrong relation's scale,
    x2 or x0.5, is far outside); each release is charged to exactly its cohort; each user's ledger
    total is Delta_j^2 / (2 sigma^2) for its j participations, the budget at most, and the ledger's
    exact conversion of it is the mu-GDP profile of Delta_j / sigma."""
    ds, fed = _fed(n_users=12, d=400)  # 8 rounds x 401 coordinates of Z
    ledger = PrivacyLedger(tmp_path / "l.sqlite", Budget(2.0, 1e-5, "gaussian"))
    rho = ledger.budget.rho
    alg = _ftrl(rho, fed.user_ids, seed=4, rounds=8, clip=0.5, factorization=factorization, min_separation=3,
                max_participations=3, local_lr=0.5)  # fmt: skip
    noise = _DrawRecorder(3)
    alg.run(fed, Releaser(ledger, noise), fed.problem.init_params())
    Z = torch.stack([z for _, z in noise.draws])
    assert {s for s, _ in noise.draws} == {alg.noise_std} and Z.shape == (8, fed.problem.num_params)
    tol = 5 / math.sqrt(2 * Z.numel())
    assert abs(float(Z.std()) / alg.noise_std - 1) < tol < 0.1
    sched = ParticipationScheduler(fed.user_ids, 8, 3, 3, seed=4)
    releases = ledger.releases()
    assert [r["label"] for r in releases] == [f"dp-ftrl/round-{t}" for t in range(8)]
    assert [r["users"] for r in releases] == [len(sched.planned(t)) for t in range(8)]
    sq = alg.sensitivity_squares
    for i, uid in enumerate(fed.user_ids):
        j = sum(1 for t in range(8) if i in sched.planned(t))
        spend = ledger.spend(uid)
        assert spend.releases == j  # charged at each of its participations, nowhere else
        assert spend.rho == pytest.approx(0.25 * sq[j - 1] / (2 * alg.noise_std**2), rel=1e-12)
        assert spend.rho <= rho * (1 + 1e-12)
    assert max(ledger.spend(u).rho for u in fed.user_ids) == pytest.approx(rho, rel=1e-12)
    assert eps_gaussian(rho, 1e-5) <= 2.0
    ledger.verify()


def test_adversarial_neighbours_stay_within_the_calibrated_sensitivity(dishonest_records):
    """One user's records replaced by records far outside every bound (or the user removed): at any
    sequence of models, the round sums of the two streams differ only in that user's rounds, and
    ||C (x - x')||_F <= Delta = sigma sqrt(2 rho): the clip and the schedule bound it, not the data."""
    ds, fed = _fed(n_users=12, d=4, seed=5)
    tr = ds.train
    g = torch.Generator().manual_seed(0)
    for factorization, relation in (
        ("tree", "replace-one"),
        ("banded", "replace-one"),
        ("blt", "replace-one"),
        ("blt-opt", "replace-one"),
        ("tree", "add-remove"),
    ):
        alg = _ftrl(0.5, fed.user_ids, relation, seed=1, rounds=8, clip=0.3, factorization=factorization, band=3,
                    min_separation=2, max_participations=4, local_steps=2, local_lr=0.5)  # fmt: skip
        cfg = alg.params
        C = alg.factor.matrix()
        sched = ParticipationScheduler(fed.user_ids, 8, 2, 4, seed=1)
        cohorts = [sched.planned(t) for t in range(8)]
        worst = 0.0
        for victim in range(12):
            mine = tr.user_index == victim
            X, y = tr.X.clone(), tr.y.clone()
            X[mine] = torch.randn(int(mine.sum()), tr.dim, generator=g, dtype=torch.float64) * 1e3
            y[mine] = -y[mine]
            adv = FederatedDataset("adv", UserData(X, y, tr.user_index, tr.user_ids), ds.test, "binary", 1.0, "adv")
            fed_adv = InProcessFederation(make_problem("logistic", adv), adv)
            diff = []
            for t in range(8):
                w = torch.randn(fed.problem.num_params, generator=g, dtype=torch.float64)
                q = ClippedLocalUpdate(w, cfg.clip, cfg.local_steps, alg.local_lr)
                users = cohorts[t]
                a = clip_rows(fed.compute(q, users).values, cfg.clip)[0].sum(0)
                others = [u for u in users if u != victim] if relation == "add-remove" else users
                fb = fed if relation == "add-remove" else fed_adv
                b = clip_rows(fb.compute(q, others).values, cfg.clip)[0].sum(0) if others else torch.zeros_like(a)
                diff.append((a - b).numpy())
            D = np.stack(diff)
            worst = max(worst, float(np.linalg.norm(C @ D)))
            assert np.linalg.norm(C @ D) <= alg.sensitivity * (1 + 1e-9)
        assert alg.sensitivity == pytest.approx(alg.noise_std * math.sqrt(2 * 0.5), rel=1e-12)
        # the adversary gets close: a scale for fewer participations (e.g. k = 1) would fail above
        assert worst >= 0.6 * alg.sensitivity > alg.answer_bound * math.sqrt(alg.factor.sensitivity_squares(2, 1)[0])


def test_dp_ftrl_over_flower_equals_inprocess_for_every_factorization(tmp_path):
    for factorization in ("tree", "banded", "blt", "blt-opt"):
        ref = _flower_equals_inprocess(
            tmp_path / factorization, "dp-ftrl", {**SMALL["dp-ftrl"], "factorization": factorization}
        )
        assert ref["w"] is not None


@pytest.mark.parametrize("factorization", ["banded", "blt-opt"])
def test_fedkl_run_on_movielens_learns_and_reports_the_exact_conversion(tmp_path, capsys, factorization):
    out = tmp_path / "run"
    argv = ["run", "--algorithm", "dp-ftrl", "--dataset", "movielens", "--epsilon", "2", "--rounds", "20",
            "--min-separation", "4", "--factorization", factorization, "--conversion", "gaussian", "--noise-seed", "0",
            "--no-reference", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    res = json.loads((out / "result.json").read_text())
    assert res["test_metrics"]["accuracy"] > res["trivial_baseline"]["accuracy"] + 0.05
    details = res["algorithm_details"]
    assert (
        details["factorization"] == factorization
        and details["min_separation"] == 4
        and details["max_participations"] == 5
    )
    if factorization == "blt-opt":  # the public C, recomputable from (T, b, k, m)
        omegas, decays = mm.optimized_blt_parameters(20, 4, 5, 4)
        assert details["blt_parameters"] == {"omega": omegas.tolist(), "theta": decays.tolist()}
    rho = details["mu_gdp"] ** 2 / 2
    assert res["epsilon"] == pytest.approx(eps_gaussian(rho, res["delta"]), rel=1e-9) and res["epsilon"] <= 2.0


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--min-separation", "20"], "more than the 12 users"),
        (["--min-separation", "3", "--max-participations", "2", "--rounds", "7"], "the later rounds would ask nobody"),
    ],
)
def test_fedkl_run_refuses_a_schedule_in_one_line_before_any_charge(tmp_path, capsys, extra, msg):
    out = tmp_path / "run"
    argv = ["run", "--algorithm", "dp-ftrl", "--dataset", "synthetic-logistic", "--users", "12", "--no-reference",
            "--out", str(out), *extra]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]
    if (out / "ledger.sqlite").exists():
        with PrivacyLedger(out / "ledger.sqlite") as ledger:
            assert ledger.releases() == []
