"""movielens-sparse: counts, the per-user record rule, row-local one-hot features, refusals, and a private
noisy-fw run on it through the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedkl.cli import main
from fedkl.data import load_dataset
from fedkl.data.movielens_sparse import load_movielens_sparse, movie_buckets
from fedkl.data.real import MOVIELENS_GENRES, _raw_movielens, movielens_genre_matrix

G = len(MOVIELENS_GENRES)


def test_counts_split_and_dimension_at_the_defaults():
    ds = load_dataset("movielens-sparse")
    assert ds is load_movielens_sparse() and ds.name == "movielens-sparse" and ds.task == "binary"
    assert ds.train.num_users == 671 and ds.train.dim == 1 + G + 2048
    assert set(ds.train.counts().tolist()) == {16} and set(ds.test.counts().tolist()) == {4}
    assert ds.train.dim > 3 * ds.train.num_users  # d >> n
    assert load_dataset("movielens-sparse", seed=1).test.num_records == 671 * 4
    with pytest.raises(ValueError, match="fixed set of users"):
        load_dataset("movielens-sparse", n_users=10)


def test_features_are_row_local_one_hots_of_each_users_most_recent_ratings():
    buckets, keep = 64, 5
    ds = load_movielens_sparse(buckets=buckets, max_records=keep)
    raw = _raw_movielens()
    for user in (1, 15, 547):  # recompute a few users' records from their own raw rows only
        mine = raw[raw["userId"] == user].sort_values(["timestamp", "movieId"], ascending=[False, True]).head(keep)
        expected = np.zeros((keep, 1 + G + buckets))
        expected[:, 0] = 1.0
        expected[:, 1 : 1 + G] = movielens_genre_matrix(mine)
        expected[np.arange(keep), 1 + G + movie_buckets(mine["movieId"].to_numpy(), buckets)] = 1.0
        expected /= np.linalg.norm(expected, axis=1, keepdims=True)
        labels = np.where(mine["rating"].to_numpy() >= 4, 1.0, -1.0)
        u = ds.train.user_ids.index(f"movielens:{user}")
        rows = torch.cat([part.X[part.user_index == u] for part in (ds.train, ds.test)]).numpy()
        ys = torch.cat([part.y[part.user_index == u] for part in (ds.train, ds.test)]).numpy()
        got = sorted(zip(map(tuple, rows), ys))
        want = sorted(zip(map(tuple, expected), labels))
        assert len(got) == keep and all(np.allclose(a, b) and c == e for (a, c), (b, e) in zip(got, want))
    X = torch.cat([ds.train.X, ds.test.X])
    torch.testing.assert_close(X.norm(dim=1), torch.ones(len(X), dtype=torch.float64))
    assert set(((X[:, 1 + G :] > 0).sum(1)).tolist()) == {1}  # exactly one movie column per record


def test_movie_hash_is_a_fixed_map_and_bad_arguments_are_refused():
    ids = np.array([1, 2, 3, 164979])
    assert movie_buckets(ids, 2048).tolist() == [(int(i) * 2654435761 % 2**32) % 2048 for i in ids]
    for kw in ({"buckets": 0}, {"max_records": 0}, {"buckets": 1.5}):
        with pytest.raises(ValueError, match="positive integer"):
            load_movielens_sparse(**kw)
    with pytest.raises(ValueError, match="GB of float64"):
        load_movielens_sparse(buckets=10**6, max_records=100)


def test_noisy_fw_runs_on_movielens_sparse(tmp_path):
    out = tmp_path / "run"
    argv = ["run", "--algorithm", "noisy-fw", "--dataset", "movielens-sparse", "--epsilon", "4", "--fw-rounds", "5"]
    assert main([*argv, "--out", str(out), "--no-reference"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["dataset"] == "movielens-sparse" and result["users"] == 671 and result["rounds"] == 5
    assert result["epsilon"] <= 4.0 * (1 + 1e-9) and result["algorithm_details"]["neighbouring"] == "replace-one"
