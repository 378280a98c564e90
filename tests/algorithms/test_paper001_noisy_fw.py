"""Paper 001 (Bassily, Guzmán, Menart), Alg 3 at user level: noisy Frank–Wolfe over an l1 ball / a
polytope with exponential-mechanism vertex selection (``noisy-fw``).

Privacy: every selection's stated sensitivity bounds, and is attained by, the utilities of two
adversarial replace-one neighbours (one user's records all flipped), so a mechanism at the stated
(eps0, Delta) has privacy loss <= eps0 and one at half the scale would not; the ledger holds T
exponential charges of eps0^2/8 per user that add up to the budget; a plan the users cannot afford,
a domain of the wrong dimension and bad flags are refused before any data is read; a Flower client's
answer outside the clamp box is rejected. Utility: on synthetic logistic regression the excess
empirical risk over the l1 ball, against the optimum certified by a projected-gradient solution and
its Frank–Wolfe gap, falls with n at roughly Thm 9's sqrt(log d/(n eps)).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from fedkl import cli
from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.frank_wolfe.noisy_fw import NoisyFrankWolfe, NoisyFWParams, step_size, theorem_rounds
from fedkl.data import load_dataset
from fedkl.data.base import UserData
from fedkl.federation.base import ClampedGradient
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, BudgetExceeded, ExponentialMechanism, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy.filter import ZCDPFilter
from fedkl.problems import make_problem
from fedkl.problems.polytope import L1Ball, Simplex, VertexPolytope
from fedkl.problems.rowwise import kernels
from fedkl.runner import RunConfig


# --------------------------------------------------------------------------------------------------
# the domains
# --------------------------------------------------------------------------------------------------
def _explicit(domain) -> torch.Tensor:
    return torch.stack([domain.vertex(j) for j in range(domain.num_vertices)])


@pytest.mark.parametrize(
    "domain", [L1Ball(5, 1.5), Simplex(4, 2.0), VertexPolytope(torch.randn(7, 3, dtype=torch.float64))]
)
def test_domain_scores_lmo_and_radii_match_the_explicit_vertices(domain):
    V = _explicit(domain)
    c = domain.center
    g = torch.randn(domain.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(domain.scores(g), (V - c) @ g, atol=1e-12)
    assert domain.lmo(g) == int(torch.argmin(V @ g))
    assert domain.l1_radius == pytest.approx(float((V - c).abs().sum(1).max()), rel=1e-12)
    assert domain.l2_bound == pytest.approx(float(V.norm(dim=1).max()), rel=1e-12)
    # the centre is in W: a convex combination of the vertices (the mean for these three)
    assert torch.allclose(c, V.mean(0), atol=1e-12) or isinstance(domain, L1Ball) and torch.equal(c, torch.zeros(5))


def test_domains_refuse_bad_shapes():
    with pytest.raises(ValueError, match="radius"):
        L1Ball(3, 0.0)
    with pytest.raises(ValueError, match="NaN"):
        VertexPolytope(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match="shape"):
        L1Ball(3, 1.0).scores(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="vertex index"):
        Simplex(3).vertex(3)


# --------------------------------------------------------------------------------------------------
# the query: l_inf clipping where the data lives
# --------------------------------------------------------------------------------------------------
def _federation(n: int = 20, d: int = 6, seed: int = 0, m: int = 6):
    ds = load_dataset("synthetic-logistic", n_users=n, m=m, d=d, seed=seed)
    problem = make_problem("logistic", ds)
    return ds, problem, InProcessFederation(problem, ds)


def _fw(problem, rounds: int, clamp: float, rho: float, *, radius: float = 1.0, neighbouring: str = "replace-one"):
    """noisy-fw over the l1 ball of ``radius`` in the problem's dimension, built as `fedkl run` builds it
    (T = ``rounds``, G = ``clamp``) on ``rho`` zCDP left (and a fresh (2, 1e-5) budget's (eps, delta))."""
    params = NoisyFWParams(fw_radius=radius, fw_rounds=rounds, fw_clamp=clamp)
    ctx = BuildContext.fresh(eps=2.0, delta=1e-5, problem=problem, neighbouring=neighbouring)
    return NoisyFrankWolfe(params, dataclasses.replace(ctx, rho_left=rho))


def test_clamped_gradient_is_the_coordinatewise_clamp_of_each_users_gradient():
    ds, problem, fed = _federation()
    w = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    raw = problem.per_user_gradients(w, ds.train)
    ans = fed.compute(ClampedGradient(w, 0.05))
    assert torch.equal(ans.values, raw.clamp(-0.05, 0.05)) and ans.failed == []
    assert float(ans.values.abs().max()) <= 0.05 and bool((raw.abs() > 0.05).any())  # the clamp was active
    with pytest.raises(ValueError, match="exceeds the clamp bound"):
        ClampedGradient(w, 0.05).check_answer(torch.full((6,), 0.06, dtype=torch.float64))


# --------------------------------------------------------------------------------------------------
# privacy: the stated sensitivity on adversarial replace-one neighbours
# --------------------------------------------------------------------------------------------------
def _with_user0(ds, label: float):
    """``ds`` with every train record of user 0 replaced by ``x = e_0`` and label ``label``."""
    tr = ds.train
    X, y = tr.X.clone(), tr.y.clone()
    mine = tr.user_index == 0
    X[mine] = 0.0
    X[mine, 0] = 1.0
    y[mine] = label
    return dataclasses.replace(ds, train=UserData(X, y, tr.user_index, tr.user_ids))


def _first_selection(monkeypatch, ds, alg: NoisyFrankWolfe, tmp_path, tag: str):
    """The utilities, eps and sensitivity of the first selection of ``alg`` on ``ds``."""
    seen: list[dict] = []
    original = Releaser.exponential

    def spy(self, utilities, **kw):
        seen.append({"u": torch.as_tensor(utilities).clone(), **kw})
        return original(self, utilities, **kw)

    monkeypatch.setattr(Releaser, "exponential", spy)
    problem = make_problem("logistic", ds)
    fed = InProcessFederation(problem, ds)
    with PrivacyLedger(tmp_path / f"{tag}.sqlite", Budget(2.0, 1e-5)) as led:
        releaser = Releaser(led, NoiseSource(0), ZCDPFilter(alg.rho_total))
        alg.run(fed, releaser, problem.init_params())
    monkeypatch.undo()
    return seen[0]


@pytest.mark.parametrize("neighbouring", ["replace-one", "add-remove"])
def test_selection_sensitivity_is_attained_by_adversarial_neighbours(monkeypatch, tmp_path, neighbouring):
    ds, problem, _ = _federation(n=15, d=4)
    alg = _fw(problem, rounds=1, clamp=0.25, rho=0.05, radius=2.0, neighbouring=neighbouring)
    domain = alg.domain
    assert isinstance(domain, L1Ball) and domain.radius == 2.0
    if neighbouring == "replace-one":  # user 0's gradient at 0 is -y e_0/2: clamped to -/+ 0.25 e_0
        a = _first_selection(monkeypatch, _with_user0(ds, 1.0), alg, tmp_path, "a")
        b = _first_selection(monkeypatch, _with_user0(ds, -1.0), alg, tmp_path, "b")
    else:  # user 0 present vs absent (its records removed: it answers the zero gradient)
        a = _first_selection(monkeypatch, _with_user0(ds, 1.0), alg, tmp_path, "a")
        tr = ds.train
        keep = tr.user_index != 0
        absent = dataclasses.replace(ds, train=UserData(tr.X[keep], tr.y[keep], tr.user_index[keep], tr.user_ids))
        b = _first_selection(monkeypatch, absent, alg, tmp_path, "b")
    stated = a["sensitivity"]
    assert (
        stated == b["sensitivity"] == pytest.approx(domain.radius * 0.25 * (2 if neighbouring == "replace-one" else 1))
    )
    moved = float((a["u"] - b["u"]).abs().max())
    assert moved <= stated * (1 + 1e-12)  # the stated bound holds...
    assert moved >= stated * (1 - 1e-12)  # ...and is attained: a smaller scale would be wrong
    # the selection law at the stated (eps0, Delta): privacy loss <= eps0 on these neighbours, and
    # the law at half the sensitivity (the add-remove scale under replace-one) exceeds it
    eps0 = a["eps"]
    assert eps0 == pytest.approx(math.sqrt(8 * 0.05 / 1))

    def loss(sens):
        mech = ExponentialMechanism(eps0, sens)
        pa, pb = mech.probabilities(a["u"].numpy()), mech.probabilities(b["u"].numpy())
        return float(np.max(np.abs(np.log(pa) - np.log(pb))))

    assert loss(stated) <= eps0 * (1 + 1e-9)
    assert loss(stated / 2) > eps0


# --------------------------------------------------------------------------------------------------
# the ledger
# --------------------------------------------------------------------------------------------------
def test_every_user_is_charged_every_selection_and_the_charges_add_up(tmp_path):
    out = tmp_path / "run"
    code = cli.main(
        [
            "run",
            "--algorithm",
            "noisy-fw",
            "--dataset",
            "synthetic-logistic",
            "--users",
            "30",
            "--epsilon",
            "2",
            "--fw-rounds",
            "5",
            "--fw-radius",
            "3",
            "--noise-seed",
            "1",
            "--no-reference",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    with PrivacyLedger(out / "ledger.sqlite") as led:
        led.verify()
        rel = led.releases()
        rho = led.budget.rho
        assert len(rel) == 5 and all(r["mechanism"] == "exponential" and r["users"] == 30 for r in rel)
        eps0 = math.sqrt(8 * rho / 5)
        assert all(r["rho"] == pytest.approx(eps0**2 / 8, rel=1e-12) for r in rel)
        assert all(r["sensitivity"] == pytest.approx(2 * 1.0 * 3.0) for r in rel)  # 2 G r, G = L0 R = 1
        ds = load_dataset("synthetic-logistic", n_users=30, seed=0)
        spends = {led.spend(u).rho for u in ds.train.user_ids}
        assert len(spends) == 1 and spends.pop() == pytest.approx(rho, rel=1e-9)


def test_theorem_rounds_and_steps():
    assert theorem_rounds(10_000, 1.0, 1e-6, 200) == int(
        10_000 / (math.log(200) * math.log(10_000) * math.sqrt(math.log(1e6)))
    )
    assert theorem_rounds(3, 0.1, 0.5, 2) == 1  # at least one round
    assert [step_size(t) for t in (1, 2, 4)] == [1.0, 0.75, 0.5]


# --------------------------------------------------------------------------------------------------
# refusals before any data is read
# --------------------------------------------------------------------------------------------------
def test_refusals_happen_before_any_query(tmp_path):
    ds, problem, _ = _federation(n=10, d=4)
    from build_helpers import counting_federation

    fed = counting_federation(problem, ds)
    with PrivacyLedger(tmp_path / "l.sqlite", Budget(1.0, 1e-5)) as led:
        releaser = Releaser(led, NoiseSource(0), ZCDPFilter(10.0))
        five = make_problem("logistic", load_dataset("synthetic-logistic", n_users=4, m=2, d=5, seed=0))
        wrong_dim = _fw(five, 3, 1.0, led.rho_left(fed.user_ids))
        with pytest.raises(ValueError, match="coordinates"):
            wrong_dim.run(fed, releaser, problem.init_params())
        too_much = _fw(problem, 3, 1.0, 2 * led.rho_left(fed.user_ids))
        with pytest.raises(BudgetExceeded, match="the run would take"):  # the runner's check (fedkl.runner._afford)
            led.check(too_much.needs(fed.user_ids))
        assert fed.calls == 0
        # a direct run: the ledger refuses the first charge that does not fit (it may stop half-way)
        with pytest.raises(BudgetExceeded, match="Nothing was charged"):
            too_much.run(fed, Releaser(led, NoiseSource(0)), problem.init_params())
        assert led.num_releases() < 3 and led.max_user_totals()["rho"] <= led.budget.rho * (1 + 1e-12)
    from build_helpers import build

    cfg = RunConfig.from_settings(algorithm="noisy-fw", dataset="synthetic-logistic")
    with pytest.raises(BudgetExceeded):  # a spent budget: refused at build time
        build(cfg, 0.0, problem=problem, dataset=ds, delta=1e-5)
    with pytest.raises(ValueError, match="--fw-radius must be > 0"):
        RunConfig.from_settings(algorithm="noisy-fw", fw_radius=0.0)
    with pytest.raises(ValueError, match="--fw-domain must be one of"):
        RunConfig.from_settings(algorithm="noisy-fw", fw_domain="cube")
    with pytest.raises(ValueError, match="--fw-rounds must be >= 1, got 0"):
        RunConfig.from_settings(algorithm="noisy-fw", fw_rounds=0)
    with pytest.raises(ValueError, match="--fw-clamp must be finite and > 0, got -1"):
        NoisyFWParams(fw_clamp=-1.0)


@pytest.mark.flower
def test_a_flower_answer_outside_the_clamp_box_is_rejected():
    from fedkl.flower import codec, localgrid
    from fedkl.flower.client_app import make_client_app
    from fedkl.flower.federation import FlowerFederation

    spec = codec.ClientSpec.build("synthetic-logistic", "logistic", {"n_users": 8, "m": 4, "d": 3, "seed": 1}, {})
    ds, problem, ref = _federation(n=8, d=3, seed=1, m=4)
    grid = localgrid.LocalGrid(make_client_app(spec), 8, faults={2: localgrid.huge_norm(1.0)})
    fed = FlowerFederation(grid, user_ids=ref.user_ids, wait_for_nodes=0.0)
    w = torch.zeros(3, dtype=torch.float64)
    with kernels("reproducible"):  # bit for bit against the clients: the explicit opt-in (the default is fast)
        b = ref.compute(ClampedGradient(w, 0.1))
    a = fed.compute(ClampedGradient(w, 0.1))
    assert a.failed == [2] and torch.equal(a.values[2], torch.zeros(3, dtype=torch.float64))
    good = [u for u in range(8) if u != 2]
    assert torch.equal(a.values[good], b.values[good])


# --------------------------------------------------------------------------------------------------
# utility: excess empirical risk over the l1 ball against a certified optimum
# --------------------------------------------------------------------------------------------------
def _project_l1(v: torch.Tensor, r: float) -> torch.Tensor:
    """Euclidean projection onto {||w||_1 <= r} (Duchi et al. 2008)."""
    if float(v.abs().sum()) <= r:
        return v
    u = torch.sort(v.abs(), descending=True).values
    css = torch.cumsum(u, 0)
    k = torch.arange(1, len(u) + 1, dtype=v.dtype)
    rho = int(torch.nonzero(u * k > css - r).max())
    theta = (css[rho] - r) / (rho + 1)
    return torch.sign(v) * (v.abs() - theta).clamp_min(0)


def _certified_optimum(problem, data, domain: L1Ball) -> float:
    """min over the l1 ball of the train objective: projected gradient descent (step 1/L1), certified by
    the Frank–Wolfe gap ``<grad F(w), w - v*> >= F(w) - F*``."""
    w = torch.zeros(domain.dim, dtype=torch.float64)
    step = 4.0  # 1/L1 for logistic with ||x|| <= 1
    for _ in range(3000):
        w = _project_l1(w - step * problem.gradient(w, data), domain.radius)
    g = problem.gradient(w, data)
    gap = float(g @ (w - domain.vertex(domain.lmo(g))))
    assert -1e-12 <= gap < 1e-6, gap
    return problem.loss(w, data) - gap


@pytest.mark.statistical
def test_excess_risk_falls_with_n_at_about_the_theorem_rate(tmp_path):
    # eps = 8 at delta = 1e-6 (rho ~ 1.1): at eps ~ 1 these n are pre-asymptotic (Thm 9's T is ~ n eps,
    # so the selection noise per round shrinks only as 1/sqrt(n)); measured slopes -0.4..-0.5 here
    d, radius, eps = 20, 3.0, 8.0
    ns, seeds = (200, 800, 3200), range(4)
    excess = []
    for n in ns:
        vals = []
        for seed in seeds:
            ds, problem, fed = _federation(n=n, d=d, seed=seed)
            domain = L1Ball(d, radius)
            f_star = _certified_optimum(problem, ds.train, domain)
            budget = Budget(eps, 1e-6)
            with PrivacyLedger(tmp_path / f"{n}-{seed}.sqlite", budget) as led:
                T = theorem_rounds(n, eps, budget.delta, domain.num_vertices)
                alg = _fw(problem, T, 1.0, led.rho_left(fed.user_ids), radius=radius)
                w = alg.run(fed, Releaser(led, NoiseSource(seed), ZCDPFilter(alg.rho_total)), problem.init_params()).w
            vals.append(max(problem.loss(w, ds.train) - f_star, 1e-12))
        excess.append(math.exp(np.mean(np.log(vals))))
    slope = np.polyfit(np.log(ns), np.log(excess), 1)[0]
    # Thm 9: sqrt(log d / (n eps)) -> slope -1/2 in n; a method whose error does not shrink has ~0
    assert -1.2 <= slope <= -0.25, (excess, slope)
    assert excess[-1] < excess[0] / 2 and excess[-1] < 0.02, excess


# --------------------------------------------------------------------------------------------------
# other polytopes
# --------------------------------------------------------------------------------------------------
def _run(domain, fed, problem, tmp_path, tag, rounds=6):
    with PrivacyLedger(tmp_path / f"{tag}.sqlite", Budget(2.0, 1e-5)) as led:
        alg = _fw(problem, rounds, 0.3, led.rho_left(fed.user_ids))
        alg.domain = domain  # any polytope of the problem's dimension (research code; the CLI names one)
        return alg.run(fed, Releaser(led, NoiseSource(4), ZCDPFilter(alg.rho_total)), problem.init_params())


def test_a_vertex_polytope_runs_like_the_same_set_given_by_name(tmp_path):
    """The l1 ball given by its 2d vertices (VertexPolytope) has the same centre, scores and l1 radius:
    the same selections and model, bit for bit; the simplex keeps every iterate in the simplex."""
    ds, problem, fed = _federation(n=25, d=5)
    ball = L1Ball(5, 2.0)
    a = _run(ball, fed, problem, tmp_path, "ball")
    b = _run(VertexPolytope(_explicit(ball)), fed, problem, tmp_path, "vertices")
    assert [h["vertex"] for h in a.history] == [h["vertex"] for h in b.history]
    assert torch.equal(a.w, b.w)
    assert float(a.w.abs().sum()) <= 2.0 * (1 + 1e-12)
    s = _run(Simplex(5, 3.0), fed, problem, tmp_path, "simplex").w
    assert bool((s >= 0).all()) and float(s.sum()) == pytest.approx(3.0, rel=1e-12)
