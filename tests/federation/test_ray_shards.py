"""``--backend ray-shards``: the vectorized federation over 2 Ray actors (fedkl/federation/ray_shards.py)
against in-process. Per-user answers are equal bit for bit (batch-invariant kernels); sums are the
block sums added in shard order, equal to in-process's one ``values.sum(0)`` to float64 rounding; the
ledger is the same exactly; a shard that dies mid-run fails its users for that request (charged,
zeroed, the reason saved) and is restarted; past ``max_restarts`` the run stops with one line.

One module-scoped local Ray instance (2 CPUs); every federation here uses it and leaves it running."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

ray = pytest.importorskip("ray")

from fedkl.federation.base import (  # noqa: E402
    CertifiedLocalMinimizer,
    ClippedGradient,
    GradientsAtOwnPoints,
    GradientsAtPoints,
    LocalLoss,
)
from fedkl.federation.inprocess import InProcessFederation  # noqa: E402
from fedkl.federation.ray_shards import RayShardFederation, blocks  # noqa: E402
from fedkl.flower.backends import load_shard_data  # noqa: E402  (and registers ray-shards)
from fedkl.privacy import PrivacyLedger  # noqa: E402
from fedkl.problems.rowwise import kernels  # noqa: E402
from fedkl.runner import RunConfig, load_run_data, run_training  # noqa: E402
from fedkl.saved_model import load_model  # noqa: E402

pytestmark = pytest.mark.flower  # a transport: Ray actors

N = 30  # users (synthetic: 20 records each, d = 10)


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(tmp_path=None, name="run", **kw) -> RunConfig:
    base = dict(
        dataset="synthetic-logistic",
        problem="logistic",
        users=N,
        seed=3,
        noise_seed=11,
        reference=False,
        epsilon=2.0,
        out=None if tmp_path is None else str(tmp_path / name),
    )
    return RunConfig.from_settings(strict=False, **{**base, **kw})


@pytest.fixture(scope="class")
def pair():
    """(sharded federation over 2 actors, in-process federation) of the same run configuration; closed
    after its class (Ray has 2 CPUs here, one per actor)."""
    cfg = _cfg()
    dataset, problem, _ = load_run_data(cfg)
    fed = RayShardFederation(functools.partial(load_shard_data, cfg), dataset.train.user_ids, 2, mode="reproducible")
    with kernels("reproducible"):  # bit for bit across blocks: the batch-invariant kernels, on both sides
        yield fed, InProcessFederation(problem, dataset)
    fed.close()


def test_blocks_are_contiguous_and_cover_every_user_once():
    assert blocks(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    with pytest.raises(ValueError, match="shards must be an integer in"):
        blocks(3, 4)


class TestOneShardedFederation:
    """Queries against one federation of 2 shards."""

    def test_per_user_answers_equal_inprocess_bit_for_bit(self, pair):
        fed, ref = pair
        assert fed.user_ids == ref.user_ids and fed.num_params == ref.num_params
        g = torch.Generator().manual_seed(0)
        w = torch.randn(ref.num_params, generator=g, dtype=torch.float64)
        users = [29, 0, 17, 3, 14, 15, 22]  # asked across both blocks, out of order
        points = torch.randn(len(users), ref.num_params, generator=g, dtype=torch.float64)
        queries = [
            ClippedGradient(w, 0.05),
            LocalLoss(w, "test"),
            GradientsAtPoints(torch.stack([w, -w])),
            GradientsAtOwnPoints(points),  # each shard gets its users' rows of points
            CertifiedLocalMinimizer(w, 0.5, 1e-10, 200),
        ]
        for q in queries:
            a, b = fed.compute(q, users), ref.compute(q, users)
            assert a.users == b.users and a.failed == b.failed
            assert torch.equal(a.values, b.values), type(q).__name__

    def test_sums_are_block_sums_equal_to_inprocess_to_rounding(self, pair):
        """The server adds shard 0's sum and shard 1's sum; in-process adds all rows at once: another float
        order, so equal to |err| <= (n - 1) u sum_i |x_i| (u = 2^-53), not asserted bit for bit."""
        fed, ref = pair
        w = torch.linspace(-1, 1, ref.num_params, dtype=torch.float64)
        a, b = fed.sum(ClippedGradient(w, 0.5)), ref.sum(ClippedGradient(w, 0.5))
        assert a.values.shape == (1, ref.num_params) and a.failed == b.failed == []
        rows = ref.compute(ClippedGradient(w, 0.5)).values
        bound = (N - 1) * 2.0**-53 * rows.abs().sum(0)
        assert torch.all((a.total() - b.total()).abs() <= bound)
        assert torch.equal(a.total(), rows[:15].sum(0) + rows[15:].sum(0))  # exactly the two block sums, in order

    def test_a_bad_request_is_refused_on_the_server_with_the_inprocess_error(self, pair):
        fed, ref = pair
        bad = torch.full((ref.num_params,), float("nan"), dtype=torch.float64)
        with pytest.raises(ValueError, match="NaN"):
            fed.sum(ClippedGradient(bad, 1.0))
        with pytest.raises(ValueError, match="one row of 10 per asked user"):
            fed.compute(GradientsAtOwnPoints(torch.zeros(2, ref.num_params, dtype=torch.float64)), [0, 1, 20])
        with pytest.raises(ValueError, match="each user may be asked once"):
            fed.compute(LocalLoss(bad[:0].new_zeros(ref.num_params)), [1, 1])


def test_a_shard_that_dies_fails_its_users_for_that_request_then_is_restarted():
    cfg = _cfg()
    dataset, problem, _ = load_run_data(cfg)
    ref = InProcessFederation(problem, dataset)
    fed = RayShardFederation(functools.partial(load_shard_data, cfg), dataset.train.user_ids, 2, max_restarts=1)
    try:
        w = torch.linspace(-1, 1, ref.num_params, dtype=torch.float64)
        rows = ref.compute(ClippedGradient(w, 0.5)).values
        ray.get(fed.actors[1].crash_on_next_request.remote())
        ans = fed.sum(ClippedGradient(w, 0.5))
        assert ans.failed == list(range(15, N))  # block 1: zero contribution, listed
        assert torch.equal(ans.total(), rows[:15].sum(0))
        again = fed.sum(ClippedGradient(w, 0.5))  # restarted from the same loader
        assert again.failed == [] and torch.equal(again.total(), rows[:15].sum(0) + rows[15:].sum(0))
        report = fed.failure_report()
        assert report["counts"] == {"shard-died": 15} and report["shard_deaths"] == [0, 1]
        assert [r["request"] for r in report["by_request"]] == [0]
        assert all(why.startswith("shard-died: shard 1 of 2") for why in report["by_request"][0]["failed"].values())
        ray.get(fed.actors[1].crash_on_next_request.remote())
        with pytest.raises(
            RuntimeError, match="shard 1 .* died 2 times, more than the 1 restarts allowed; the run stops"
        ):
            fed.sum(ClippedGradient(w, 0.5))
    finally:
        fed.close()
    assert ray.is_initialized()  # a federation leaves alone a Ray instance it did not start


def _same_ledgers(a, b, users=None):
    """The same releases (mechanism, sensitivity, noise scale, rho, users, ...) and every user's spend."""
    paths = [os.path.join(r["out_dir"], "ledger.sqlite") for r in (a, b)]
    with PrivacyLedger(paths[0]) as la, PrivacyLedger(paths[1]) as lb:
        la.verify()
        lb.verify()
        ra, rb = ([{k: r[k] for k in r if k not in ("run_id", "id")} for r in led.releases()] for led in (la, lb))
        assert ra and ra == rb
        spends = la.user_spends()  # every charged user: rho, eps, delta, the number of releases, epsilon
        assert len(spends) == (users or a["config"]["users"]) and spends == lb.user_spends()


def _w(result) -> torch.Tensor:
    return load_model(result["model_path"]).params


def test_noisy_gd_on_two_shards_equals_inprocess_to_rounding_with_the_same_ledger(tmp_path):
    kw = dict(algorithm="noisy-gd", rounds=4, lr=0.5, clip=0.5)
    ref = run_training(_cfg(tmp_path, "ref", **kw), log=lambda s: None)
    sh = run_training(_cfg(tmp_path, "sh", backend="ray-shards", shards=2, **kw), log=lambda s: None)
    assert sh["backend"] == "ray-shards" and sh["failures"]["counts"] == {}
    torch.testing.assert_close(_w(sh), _w(ref), rtol=0, atol=1e-12)  # 4 rounds of sums in another float order
    _same_ledgers(sh, ref)


def test_phased_erm_on_two_shards_equals_inprocess_bit_for_bit(tmp_path):
    """Paper 002's Phased-ERM asks per-user answers only: the same bits as in-process."""
    kw = dict(
        algorithm="phased-erm",
        users=120,
        epsilon=4.0,
        reg=0.1,
        p002_delta_rule="fixed",
        p002_phases=1,
        p002_lam=0.05,
        force=True,
    )
    ref = run_training(_cfg(tmp_path, "ref", **kw), log=lambda s: None)
    sh = run_training(_cfg(tmp_path, "sh", backend="ray-shards", shards=2, **kw), log=lambda s: None)
    assert torch.equal(_w(sh), _w(ref))
    _same_ledgers(sh, ref)


def test_a_shard_killed_mid_run_fails_its_users_that_round_charged_and_the_run_goes_on(tmp_path, monkeypatch):
    kw = dict(algorithm="noisy-gd", rounds=3, lr=0.5, clip=0.5)
    asked = []
    plain_sum = RayShardFederation.sum

    def crash_in_round_2(self, query, users=None):
        asked.append(1)
        if len(asked) == 2:
            ray.get(self.actors[0].crash_on_next_request.remote())
        return plain_sum(self, query, users)

    monkeypatch.setattr(RayShardFederation, "sum", crash_in_round_2)
    sh = run_training(_cfg(tmp_path, "sh", backend="ray-shards", shards=2, **kw), log=lambda s: None)
    ref = run_training(_cfg(tmp_path, "ref", **kw), log=lambda s: None)
    failures = sh["failures"]
    assert failures["counts"] == {"shard-died": 15} and failures["shard_deaths"] == [1, 0]
    assert [r["request"] for r in failures["by_request"]] == [1]
    assert sorted(failures["by_request"][0]["failed"]) == sorted(load_run_data(_cfg())[0].train.user_ids[:15])
    _same_ledgers(sh, ref)  # the failed users were charged like everyone: the same ledger


def test_fedkl_run_backend_ray_shards_on_the_command_line(tmp_path, capsys):
    """``fedkl run --backend ray-shards --shards 2`` (the CLI registers the backend); --shards 0 and
    --secagg (sums through Flower's SecAgg+) are refused with exit 2 before anything starts."""
    from fedkl.cli import main

    base = ["run", "--dataset", "synthetic-logistic", "--users", "30", "--no-reference", "--noise-seed", "1"]
    with pytest.raises(SystemExit) as exc:
        main([*base, "--backend", "ray-shards", "--shards", "0"])
    assert exc.value.code == 2
    assert main([*base, "--backend", "ray-shards", "--secagg", "--out", str(tmp_path / "no")]) == 2
    assert "--secagg aggregates over Flower" in capsys.readouterr().err
    out = tmp_path / "cli"
    assert main([*base, "--backend", "ray-shards", "--shards", "2", "--rounds", "2", "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["backend"] == "ray-shards" and result["config"]["shards"] == 2
    assert result["ledger"]["releases"] == 2 and result["failures"]["shard_deaths"] == [0, 0]


def _write_file(path, users=40, seed=5):
    """A user-partitioned .npz: ``users`` users (integer ids, shuffled records) with 3-9 records each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    user = np.repeat(np.arange(users) * 7 + 3, rng.integers(3, 10, size=users))
    rng.shuffle(user)
    X = rng.normal(size=(len(user), 4)) / 3
    np.savez(
        path,
        user=user,
        y=np.where(X @ np.ones(4) + rng.normal(size=len(user)) > 0, 1, 0),
        **{f"x{j}": X[:, j] for j in range(4)},
    )
    return str(path)


def test_a_file_block_is_the_subset_of_the_whole_file_bit_for_bit(tmp_path):
    """load_file(block=...) keeps only the block's records: the same users, records, order, split and
    bits as the whole file's subset (what a shard used to build by loading everything)."""
    from fedkl.data.files import load_file

    path = _write_file(tmp_path / "d.npz")
    whole = load_file(path, user_column="user", label_column="y", split_seed=4, on_bound="clip")
    for block in (range(0, 13), range(13, 40), range(40, 40)):
        part = load_file(path, user_column="user", label_column="y", split_seed=4, on_bound="clip", block=block)
        for a, b in ((part.train, whole.train.subset(list(block))), (part.test, whole.test.subset(list(block)))):
            assert a.user_ids == b.user_ids and torch.equal(a.user_index, b.user_index)
            assert torch.equal(a.X, b.X) and torch.equal(a.y, b.y)
    with pytest.raises(ValueError, match="block must be a range of user positions"):
        load_file(path, user_column="user", label_column="y", on_bound="clip", block=range(30, 41))


def test_shards_of_a_data_file_hold_only_their_users_and_train_as_inprocess(tmp_path):
    """``fedkl run --backend ray-shards`` on a file: each actor reads only its block (its records are
    the block's, not the file's), and noisy-gd releases what in-process does (sums to rounding)."""
    path = _write_file(tmp_path / "d.npz")
    kw = dict(
        dataset=path, user_column="user", label_column="y", on_bound="clip", users=None, algorithm="noisy-gd", rounds=2
    )
    cfg = _cfg(tmp_path, "blocks", **kw)
    dataset = load_run_data(cfg)[0]
    fed = RayShardFederation(functools.partial(load_shard_data, cfg), dataset.train.user_ids, 2)
    try:
        held = [(h["train"], h["test"]) for h in ray.get([a.stats.remote() for a in fed.actors])]
    finally:
        fed.close()
    for (train, test), b in zip(held, blocks(40, 2)):
        assert (train, test) == (len(dataset.train.subset(list(b)).y), len(dataset.test.subset(list(b)).y))
    assert sum(h[0] for h in held) == len(dataset.train.y) and held[0][0] < len(dataset.train.y)
    ref = run_training(_cfg(tmp_path, "ref", **kw), log=lambda s: None)
    sh = run_training(_cfg(tmp_path, "sh", backend="ray-shards", **kw), log=lambda s: None)
    torch.testing.assert_close(_w(sh), _w(ref), rtol=0, atol=1e-12)
    _same_ledgers(sh, ref, users=40)
