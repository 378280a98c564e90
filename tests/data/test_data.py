"""Datasets: synthetic generators (reproducibility, known optimum) and the real loaders."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedkl.data import DATASETS, FederatedDataset, load_dataset
from fedkl.data.real import (
    MOVIELENS_GENRES,
    TV16_RACES,
    TV16_SCALES,
    _raw_movielens,
    _raw_tv16,
    load_movielens,
    load_tv16,
    movielens_features,
    split_by_user,
    tv16_features,
)
from fedkl.data.synthetic import synthetic_least_squares, synthetic_logistic
from fedkl.problems import LeastSquares


def _same(a: FederatedDataset, b: FederatedDataset) -> bool:
    return all(
        torch.equal(getattr(x, f), getattr(y, f))
        for x, y in ((a.train, b.train), (a.test, b.test))
        for f in ("X", "y", "user_index")
    ) and torch.equal(a.optimum, b.optimum)


# --- split ---------------------------------------------------------------------------------------
def test_split_by_user_orders_records_as_lexsort_does():
    """split_by_user's two stable argsorts are np.lexsort((r, user_index)): the same mask, ties included."""
    rng = np.random.default_rng(3)
    for n, users in ((1, 1), (50, 7), (5000, 300)):
        user_index = rng.integers(0, users, n)
        r = np.random.default_rng(9).random(n)
        r[::3] = 0.5  # ties in r within users
        starts = np.cumsum(np.bincount(user_index, minlength=users)) - np.bincount(user_index, minlength=users)
        order = np.lexsort((r, user_index))
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n) - starts[user_index[order]]

        class Fixed:
            def random(self, size):
                return r[:size].copy()

        counts = np.bincount(user_index, minlength=users)
        n_test = np.where(counts >= 2, np.minimum(np.maximum(np.rint(0.3 * counts).astype(np.int64), 1), counts - 1), 0)
        assert np.array_equal(split_by_user(user_index, users, 0.3, Fixed()), rank < n_test[user_index])


def test_split_by_user():
    user_index = np.repeat(np.arange(5), [1, 2, 3, 10, 50])
    rng = np.random.default_rng(0)
    user_index = user_index[rng.permutation(len(user_index))]
    test = split_by_user(user_index, 5, 0.2, np.random.default_rng(1))
    n_test = np.bincount(user_index[test], minlength=5)
    n_train = np.bincount(user_index[~test], minlength=5)
    assert n_test.tolist() == [0, 1, 1, 2, 10] and n_train.tolist() == [1, 1, 2, 8, 40]
    assert np.array_equal(test, split_by_user(user_index, 5, 0.2, np.random.default_rng(1)))
    assert not np.array_equal(test, split_by_user(user_index, 5, 0.2, np.random.default_rng(2)))
    assert np.bincount(
        user_index[split_by_user(user_index, 5, 0.2, np.random.default_rng(1), min_test=3)], minlength=5
    ).tolist() == [0, 1, 2, 3, 10]
    assert split_by_user(user_index, 5, 0.0, np.random.default_rng(1), min_test=0).sum() == 0
    with pytest.raises(ValueError):
        split_by_user(user_index, 5, 1.0, np.random.default_rng(1))


# --- synthetic -----------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [synthetic_logistic, synthetic_least_squares])
def test_synthetic_shapes_and_reproducibility(make):
    ds = make(30, 10, 6, heterogeneity=0.5, seed=3)
    assert ds.train.num_users == 30 and ds.train.num_records + ds.test.num_records == 300
    assert ds.train.counts().tolist() == [8] * 30 and ds.test.counts().tolist() == [2] * 30
    assert ds.train.dim == 6 and ds.feature_bound == 1.0 and ds.train.X.dtype == torch.float64
    for part in (ds.train, ds.test):
        assert float(part.X.norm(dim=1).max()) <= 1 + 1e-12
    if ds.task == "binary":
        assert set(ds.train.y.unique().tolist()) == {-1.0, 1.0}
        assert float(ds.optimum.norm()) == pytest.approx(math.sqrt(6))
    else:
        assert float(ds.train.y.abs().max()) <= ds.extra["label_bound"]
        assert float(ds.optimum.norm()) == pytest.approx(1.0)
    assert _same(ds, make(30, 10, 6, heterogeneity=0.5, seed=3))
    assert not _same(ds, make(30, 10, 6, heterogeneity=0.5, seed=4))


def test_least_squares_erm_near_optimum():
    """heterogeneity = 0, all users the same size: the user-level ERM is ordinary least squares, whose
    error has covariance noise_var * S^{-1} / N with S = E[x x^T] = (c/d) I, c = E||x||^2, so
    E||w_hat - w*||^2 = noise_var * d^2 / (c N) (noise_var <= noise^2: the noise is truncated);
    allow 4 times that root-mean-square."""
    n_users, m, d, noise = 400, 50, 10, 0.1
    ds = synthetic_least_squares(n_users, m, d, noise=noise, seed=0)
    erm, N = ds.extra["erm_optimum"], ds.train.num_records
    c = float((ds.train.X**2).sum(1).mean())
    tol = 4 * noise * d / math.sqrt(c * N)
    assert tol < 0.05
    assert float((erm - ds.optimum).norm()) <= tol
    # erm_optimum is the exact minimizer of the user-level train objective
    p = LeastSquares(d, label_bound=ds.extra["label_bound"])
    assert float(p.gradient(erm, ds.train).norm()) < 1e-12
    for u in range(3):  # and the gradient is not trivially small elsewhere
        assert float(p.gradient(erm + 0.1 * torch.eye(d)[u], ds.train).norm()) > 1e-3


def test_least_squares_heterogeneous_optimum_is_w_star():
    """With heterogeneity h the ERM estimates mean_u w*_u = w* + h mean_u xi_u (rms h/sqrt(n)) with the
    users' deviation acting as extra noise of variance h^2 E<xi, x>^2 ~ h^2 c/d: the error is at most
    about h/sqrt(n) + sqrt(noise^2 + h^2 c/d) d/sqrt(c N); allow 4 times that."""
    n_users, m, d, noise, h = 2000, 10, 5, 0.1, 1.0
    ds = synthetic_least_squares(n_users, m, d, heterogeneity=h, noise=noise, seed=1)
    c, N = float((ds.train.X**2).sum(1).mean()), ds.train.num_records
    tol = 4 * (h / math.sqrt(n_users) + math.sqrt(noise**2 + h * h * c / d) * d / math.sqrt(c * N))
    assert tol < 0.2
    assert float((ds.extra["erm_optimum"] - ds.optimum).norm()) <= tol
    assert ds.extra["label_bound"] == pytest.approx(1.0 + 3 * h + 4 * noise)
    assert float(ds.train.y.abs().max()) <= ds.extra["label_bound"]


def test_logistic_mle_near_optimum():
    """heterogeneity = 0 is a well-specified logistic model: the MLE (Newton) is within 4 times its
    asymptotic rms error sqrt(trace(H^{-1}) / N), H the empirical Fisher information, of w*."""
    ds = synthetic_logistic(500, 40, 5, seed=2)
    X, y = ds.train.X, ds.train.y
    w = torch.zeros(5, dtype=torch.float64)
    for _ in range(25):
        s = torch.sigmoid(-y * (X @ w))
        grad = -(X * (y * s)[:, None]).mean(0)
        H = (X * (s * (1 - s))[:, None]).T @ X / len(y)
        w = w - torch.linalg.solve(H, grad)
    assert float(grad.norm()) < 1e-10
    tol = 4 * math.sqrt(float(torch.linalg.inv(H).trace()) / len(y))
    assert tol < 0.6
    assert float((w - ds.optimum).norm()) <= tol


def test_load_dataset():
    assert DATASETS[:4] == ("movielens", "tv16", "synthetic-logistic", "synthetic-least-squares")
    assert set(DATASETS[4:]) == {
        "adult",
        "shakespeare",
        "mnist",
        "fashion-mnist",
        "flights",
        "mortgages",
        "fertility-partition",
        "movielens-heavy",
        "movielens-sparse",
    }
    ds = load_dataset("synthetic-logistic")
    assert ds.train.num_users == 200 and ds.train.dim == 10 and ds.train.num_records + ds.test.num_records == 4000
    assert load_dataset("synthetic-least-squares", d=3, seed=5).train.dim == 3
    assert load_dataset("tv16") is load_tv16()  # cached
    with pytest.raises(ValueError, match="valid names: movielens, tv16, synthetic-logistic, synthetic-least-squares"):
        load_dataset("emnist")


# --- MovieLens -----------------------------------------------------------------------------------
def test_movielens():
    ds = load_movielens()
    assert ds is load_movielens() and ds.name == "movielens" and ds.task == "binary" and ds.feature_bound == 1.0
    assert ds.train.num_users == 671 and ds.train.num_records + ds.test.num_records == 100_004
    assert int(ds.train.counts().min()) >= 1 and int(ds.test.counts().min()) >= 1
    assert ds.train.dim == 37 and ds.train.X.dtype == torch.float64
    assert load_movielens(profile=False).train.dim == 35
    assert ds.train.user_ids[0].startswith("movielens:") and "movielens:12" in ds.train.user_ids
    for part in (ds.train, ds.test):
        assert float(part.X.norm(dim=1).max()) <= 1 + 1e-12
        assert set(part.y.unique().tolist()) == {-1.0, 1.0}
    y = torch.cat([ds.train.y, ds.test.y])
    assert float((y > 0).double().mean()) == pytest.approx(0.516, abs=0.001)
    assert "671 users" in ds.description and "100004 records" in ds.description
    other = load_movielens(split_seed=1)
    assert other.test.num_records == ds.test.num_records and not torch.equal(other.test.X, ds.test.X)


def test_movielens_features_are_record_local():
    raw = _raw_movielens()
    assert list(MOVIELENS_GENRES) == sorted(MOVIELENS_GENRES)
    assert set(MOVIELENS_GENRES) == {g for s in raw["genres"] for g in s.split("|")}
    full = movielens_features(raw)
    keep = raw["userId"].isin([1, 7, 500]).to_numpy()  # everyone else's ratings removed
    np.testing.assert_array_equal(movielens_features(raw[keep]), full[keep])
    for i in (0, int(np.flatnonzero(raw["year"].isna().to_numpy())[0])):  # one row alone, incl. a missing year
        np.testing.assert_array_equal(movielens_features(raw.iloc[[i]]), full[[i]])
    # the loaded records are exactly these rows' features (rows of user 1 in original order)
    ds = load_movielens(profile=False)
    user1 = raw["userId"].to_numpy() == 1
    loaded = torch.cat([ds.train.X[ds.train.user_index == 0], ds.test.X[ds.test.user_index == 0]])
    expected = torch.as_tensor(full[user1])
    assert sorted(map(tuple, loaded.tolist())) == sorted(map(tuple, expected.tolist()))


def test_movielens_profile_features_are_client_local_and_leak_no_label():
    from fedkl.data.real import movielens_genre_matrix, movielens_profile_features, split_by_user

    raw = _raw_movielens()
    uids, ui = np.unique(raw["userId"].to_numpy(), return_inverse=True)
    y = raw["rating"].to_numpy() >= 4
    is_test = split_by_user(ui, len(uids), 0.2, np.random.default_rng(0))
    G = movielens_genre_matrix(raw)
    full = movielens_profile_features(G, y, ui, ~is_test, len(uids))
    # computed by user 1's client alone (everyone else removed): identical
    mine = ui == 0
    alone = movielens_profile_features(G[mine], y[mine], np.zeros(mine.sum(), dtype=np.int64), ~is_test[mine], 1)
    np.testing.assert_allclose(alone, full[mine], rtol=0, atol=1e-15)
    # a record's own label never enters its own features (leave-one-out on train, train-only for test)
    for k in (int(np.flatnonzero(~is_test)[3]), int(np.flatnonzero(is_test)[3])):
        flipped = y.copy()
        flipped[k] = not flipped[k]
        other = movielens_profile_features(G, flipped, ui, ~is_test, len(uids))
        np.testing.assert_array_equal(other[k], full[k])
    # test labels never enter any feature
    flipped = np.where(is_test, ~y, y)
    np.testing.assert_array_equal(movielens_profile_features(G, flipped, ui, ~is_test, len(uids)), full)


# --- TV16 ----------------------------------------------------------------------------------------
def test_tv16():
    ds = load_tv16()
    assert ds.train.num_users == 51 and ds.train.num_records + ds.test.num_records == 37_813
    assert "tv16:Ohio" in ds.train.user_ids and "tv16:District of Columbia" in ds.train.user_ids
    assert int(ds.train.counts().min()) >= 1 and int(ds.test.counts().min()) >= 1
    assert ds.train.dim == 19
    for part in (ds.train, ds.test):
        assert float(part.X.norm(dim=1).max()) <= 1 + 1e-12
        assert set(part.y.unique().tolist()) == {-1.0, 1.0}


def test_tv16_fixed_scales_and_locality():
    raw = _raw_tv16()
    assert set(raw["racef"].unique()) == set(TV16_RACES) and list(TV16_RACES) == sorted(TV16_RACES)
    for col, top in TV16_SCALES.items():  # the hard-coded maxima cover the data
        assert 0 <= raw[col].min() and raw[col].max() <= top
    full = tv16_features(raw)
    keep = raw["state"].isin(["Ohio", "Vermont"]).to_numpy()
    np.testing.assert_array_equal(tv16_features(raw[keep]), full[keep])
    np.testing.assert_array_equal(tv16_features(raw.iloc[[5]]), full[[5]])


def test_subset_equals_a_scan_of_all_records():
    """UserData.subset reads a per-user index (O(its records)); it returns exactly what scanning every
    record for the chosen users returns: same records in the same order, users renumbered."""
    from fedkl.data.base import UserData

    def scanned(data, users):
        users = torch.as_tensor(users, dtype=torch.int64)
        remap = torch.full((data.num_users,), -1, dtype=torch.int64)
        remap[users] = torch.arange(len(users))
        keep = remap[data.user_index] >= 0
        return data.X[keep], data.y[keep], remap[data.user_index[keep]]

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, N = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(0, 200, (1,), generator=g))
        data = UserData(
            torch.randn(N, 3, generator=g), torch.randn(N, generator=g), torch.randint(0, n, (N,), generator=g),
            tuple(f"u{i}" for i in range(n)),
        )  # fmt: skip
        users = torch.randperm(n, generator=g)[: int(torch.randint(0, n + 1, (1,), generator=g))].tolist()
        got = data.subset(users)
        for a, b in zip((got.X, got.y, got.user_index), scanned(data, users)):
            assert torch.equal(a, b)
        assert got.user_ids == tuple(f"u{u}" for u in users)
    with pytest.raises(ValueError, match="user positions"):
        data.subset([n])
