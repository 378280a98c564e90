"""The float32 seam, for EVERY registered algorithm that declares ``float32`` (``Algorithm.float32``):
a ``--dtype float32`` run is privacy-wise the float64 run. With the same seeds, and one user that answers
honestly, out of bound (a raw answer a million times too large, which the clip must bring back), NaN,
fails every query (the federation's failure contract), or is absent from the data:

* the ledger is the float64 run's, row for row (labels, mechanisms, sensitivities, noise scales, costs,
  cohorts, users);
* every noise draw (:class:`~fedkl.privacy.rng.NoiseSource`) is the float64 run's, bit for bit (same
  draws at the same sigma), and every released tensor (``Releaser._emit``, where every release, each step
  of a charged schedule included, is drawn) is float64 and within float32 rounding of the float64 run's (so the
  out-of-bound user's row entered clipped, as in float64);
* the federation reports the same users failed at every request, the NaN and the failing user in every
  request that asks them, the out-of-bound user in none.

Small per algorithm (its SMALL setting, in-process: a float32 run is in-process only). The float32 clip's
exact-arithmetic bound is tests/federation/test_float32.py's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from build_helpers import small_config

from fedkl.algorithms.catalog import REGISTRY
from fedkl.federation.base import Answers, Federation
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import PrivacyLedger, Releaser
from fedkl.privacy.rng import NoiseSource
from fedkl.runner import RunConfig, load_run_data, prepare_run, problem_dtype, train_federation

FLOAT32 = sorted(n for n, s in REGISTRY.items() if s.cls.float32)
TARGET = 1  # the misbehaving user's position
FAULTS = ("honest", "huge", "nan", "failing", "absent")


class _Recording(Federation):
    """Forwards every request; records each answer's ``failed`` (and the asked users); ``failing``: TARGET
    fails every query (its row zero and listed in ``failed``, what every backend makes of a dropout)."""

    def __init__(self, inner: InProcessFederation, failing: bool) -> None:
        self.inner, self.failing, self.calls = inner, failing, []

    user_ids = property(lambda self: self.inner.user_ids)
    num_params = property(lambda self: self.inner.num_params)

    def _record(self, ans: Answers) -> Answers:
        if self.failing and TARGET in ans.users and len(ans.values) == len(ans.users):
            v = ans.values.clone()
            v[ans.users.index(TARGET)] = 0
            ans = Answers(ans.users, v, sorted(set(ans.failed) | {TARGET}))
        self.calls.append((list(ans.users), sorted(ans.failed)))
        return ans

    def compute(self, query, users=None):
        return self._record(self.inner.compute(query, users))

    def sum(self, query, users=None):
        if self.failing:  # per-user rows, so that TARGET's can be zeroed
            return self.compute(query, users)
        return self._record(self.inner.sum(query, users))


def _tamper(problem, target_id: str, fault: str, monkeypatch) -> list:
    """The raw (pre-clip) per-user rows of user ``target_id`` made huge (x 1e6) or NaN, in every kernel an
    answer of these algorithms starts from (gradients, local updates): the client's own computation goes
    wrong, the server's clip and finiteness check must do the rest. Returns the list of the kernels'
    names each time one was tampered with."""
    hits: list[str] = []
    for name in ("per_user_gradients", "local_updates", "local_epoch_updates"):
        original = getattr(problem, name)

        def wrapped(*args, _original=original, _name=name, **kw):
            rows = _original(*args, **kw)
            data = next(a for a in (*args, *kw.values()) if hasattr(a, "user_ids"))
            if target_id in data.user_ids:
                rows = rows.clone()
                k = list(data.user_ids).index(target_id)
                rows[k] = rows[k] * 1e6 if fault == "huge" else float("nan")
                hits.append(_name)
            return rows

        monkeypatch.setattr(problem, name, wrapped)
    return hits


def _run(tmp_path, monkeypatch, name: str, dtype: str, fault: str, kernels: str = "auto", **settings) -> dict:
    cfg = small_config(name, tmp_path / f"{dtype}-{fault}", dtype=dtype, kernels=kernels, **settings)
    dataset, problem, _ = load_run_data(cfg)
    assert problem.dtype == getattr(torch, dtype)
    target_id = dataset.train.user_ids[TARGET]
    if fault == "absent":  # the add-remove neighbour without TARGET
        keep = [u for u in range(dataset.train.num_users) if u != TARGET]
        dataset = dataclasses.replace(dataset, train=dataset.train.subset(keep), test=dataset.test.subset(keep))
        dataset, problem, _ = load_run_data(cfg, dataset=dataset)
    draws: list[tuple] = []  # (kind, shape, scale, the draw)
    released: list = []  # every release's output
    tampered: list[str] = []
    with monkeypatch.context() as m:
        if fault in ("huge", "nan"):
            tampered = _tamper(problem, target_id, fault, m)
        for kind in ("gaussian", "laplace"):
            original = getattr(NoiseSource, kind)

            def draw(source, shape, scale, _original=original, _kind=kind):
                out = _original(source, shape, scale)
                draws.append((_kind, tuple(out.shape), scale, out.clone()))
                return out

            m.setattr(NoiseSource, kind, draw)
        emit = Releaser._emit  # every release, a scheduled one's steps included, is drawn here

        def release(self, seq, label, record, cohort, sample):
            def recorded():
                out = sample()
                released.append((label, out.clone() if torch.is_tensor(out) else out))
                return out

            return emit(self, seq, label, record, cohort, recorded)

        m.setattr(Releaser, "_emit", release)
        fed = _Recording(InProcessFederation(problem, dataset), fault == "failing")
        delta, run_id, _, ledger_path, noise = prepare_run(cfg, fed.num_users)
        train_federation(cfg, fed, problem, dataset, delta, ledger_path, run_id, noise, lambda _: None)
    with PrivacyLedger(ledger_path) as ledger:
        ledger.verify()
        rows = [
            (r["label"], r["mechanism"], r["sensitivity"], r["noise_scale"], r["rho"], r["eps"], r["delta"])
            + (r["users"], r["cohort"])
            for r in ledger.releases()
        ]
        spend = [(u, ledger.spend(u)) for u in fed.user_ids]
    return {
        "ledger": rows,
        "spend": spend,
        "draws": draws,
        "released": released,
        "calls": fed.calls,
        "tampered": tampered,
    }


CASES = [(f, "auto") for f in FAULTS] + [(f, "reproducible") for f in ("huge", "nan")]


@pytest.mark.parametrize("fault,kernels", CASES, ids=[f if k == "auto" else f"{f}-{k}" for f, k in CASES])
@pytest.mark.parametrize("name", FLOAT32)
def test_a_float32_run_charges_releases_and_fails_users_as_the_float64_run(tmp_path, monkeypatch, name, fault, kernels):
    """``kernels``: auto is the fast in-process path (a sum of clipped rows in one step); reproducible clips
    each user's row, then sums (both float32 clip paths of fedkl.federation.clipping)."""
    f64 = _run(tmp_path, monkeypatch, name, "float64", fault, kernels)
    f32 = _run(tmp_path, monkeypatch, name, "float32", fault, kernels)
    _check_alike(f64, f32, fault)


def _check_alike(f64: dict, f32: dict, fault: str) -> None:
    # the same charges, to the same users
    assert f64["ledger"] and f32["ledger"] == f64["ledger"]
    assert f32["spend"] == f64["spend"]
    # the float64 run's noise, bit for bit (the same draws at the same scales)
    assert len(f32["draws"]) == len(f64["draws"]) > 0
    for (k32, s32, sd32, z32), (k64, s64, sd64, z64) in zip(f32["draws"], f64["draws"], strict=True):
        assert (k32, s32, sd32) == (k64, s64, sd64) and torch.equal(z32, z64)
    # every release float64, the float64 run's to float32 rounding (relative to the clip-scale sums)
    assert [label for label, _ in f32["released"]] == [label for label, _ in f64["released"]]
    for (_, r32), (label, r64) in zip(f32["released"], f64["released"], strict=True):
        if not torch.is_tensor(r64):  # a schedule's handle, an index, None (the output ⊥)
            assert not torch.is_tensor(r32), label
            continue
        assert r32.dtype == r64.dtype == torch.float64, (r32.dtype, r64.dtype)
        scale = max(1.0, float(r64.abs().max()))
        assert float((r32 - r64).abs().max()) <= 1e-3 * scale, (r32, r64)
    assert (len(f32["tampered"]) > 0) == (fault in ("huge", "nan")) and f32["tampered"] == f64["tampered"]
    # the same users failed at every request; the misbehaving one as its fault says
    assert f32["calls"] == f64["calls"] and f32["calls"]
    asked = [failed for users, failed in f32["calls"] if TARGET in users]
    if fault in ("nan", "failing"):
        assert asked and all(TARGET in failed for failed in asked)
    if fault in ("honest", "huge"):
        assert not any(failed for _, failed in f32["calls"])


ADAPTIVE = sorted(n for n in FLOAT32 if "adaptive_clip" in {f.name for f in dataclasses.fields(REGISTRY[n].params)})


@pytest.mark.parametrize("name", ADAPTIVE)
def test_adaptive_clipping_in_float32_counts_clipped_updates_as_float64_does(tmp_path, monkeypatch, name):
    """--adaptive-clip: the released count of updates below the clip is the float64 run's. At clip 0.01 most
    honest updates are clipped; a float32 row is clipped a proven margin INSIDE the ball (up to 4 x 2.4e-7 relative),
    which the count's tie band (once 1e-9 relative) took for an update below the clip: every clipped float32
    update was counted unclipped, and the clip shrank every round whatever the data."""
    settings = {"adaptive_clip": True, "clip": 0.01, "clip_count_noise": 5.0}
    f64 = _run(tmp_path, monkeypatch, name, "float64", "honest", **settings)
    f32 = _run(tmp_path, monkeypatch, name, "float32", "honest", **settings)
    _check_alike(f64, f32, "honest")


@pytest.mark.parametrize("backend", ["inprocess", "ray-shards"])
def test_a_torch_model_computes_in_float32_only_for_an_algorithm_that_declares_it(backend):
    """Where the server computes every answer (in-process, and the Ray shards, which build their problem from
    the run config), a torch model (float32 by default) runs float64 for every algorithm whose proof is stated
    in float64 (contract.Algorithm.float32). The Ray shards once ran it in float32 (only in-process was
    excepted): kl-adaptive-gd, kl-prox-point, noisy-gd-conc and noisy-gd-outlier train an MLP."""
    for name, spec in sorted(REGISTRY.items()):
        cfg = RunConfig(dataset="synthetic-logistic", problem="mlp", algorithm=name, backend=backend)
        assert problem_dtype(cfg, "mlp") == ("float32" if spec.cls.float32 else "float64"), name
        assert problem_dtype(cfg, "logistic") == "float64", name
