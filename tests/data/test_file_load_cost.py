"""Loading a user-partitioned file costs one copy of its matrix, no pandas for an .npz, no per-record
strings for integer user ids, one isfinite pass; and gives the dataset the loader gave before (issue 34)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from fedkl.data import custom
from fedkl.data.files import Schema, load_file, load_site
from fedkl.data.real import make_federated, project_rows, split_by_user

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _old_load(frame, user_column, label, task, B, on_bound, features, test_fraction=0.2, split_seed=0, name="f"):
    """The pipeline before issue 34, frozen: a pandas frame -> column-major matrix -> clip -> / B ->
    strings of every user id -> np.unique -> project_rows -> boolean-mask split."""
    X = frame[list(features)].to_numpy(np.float64)
    y = frame[label].to_numpy()
    norms = np.linalg.norm(X, axis=1)
    over = norms > B
    if over.any():
        assert on_bound == "clip"
        X = X * np.minimum(1.0, B / np.where(over, norms, B))[:, None]
    X = X / B
    keys = np.array([str(u) for u in frame[user_column].to_numpy()])
    user_ids, user_index = np.unique(keys, return_inverse=True)
    kw = {"feature_bound": 1.0, "extra": {}}
    if task == "binary":
        y = np.where(y.astype(np.float64) > 0, 1.0, -1.0)
    elif task == "multiclass":
        kw["num_classes"] = int(y.max() + 1)
        y = y.astype(np.int64)
    else:
        y = y.astype(np.float64)
    test = split_by_user(user_index, len(user_ids), test_fraction, np.random.default_rng(split_seed))
    return make_federated(
        name, project_rows(X), y, user_index.astype(np.int64), tuple(user_ids.tolist()), test, task, "", **kw
    )


def _write(path, n_users, m, d, *, ints=True, seed=0, scale=0.2, task="binary"):
    rng = np.random.default_rng(seed)
    N = n_users * m
    cols = {f"x{i}": rng.normal(size=N) * scale for i in range(d)}
    uid = np.repeat(np.arange(n_users) * 7 + 3, m)[rng.permutation(N)]  # ids whose string order != numeric order
    cols["uid"] = uid if ints else np.array([f"u{u}" for u in uid])
    cols["y"] = rng.integers(0, 2 if task == "binary" else 4, N) if task != "regression" else rng.normal(size=N)
    if path.endswith(".npz"):
        np.savez(path, **cols)
    else:
        import pandas as pd

        pd.DataFrame(cols).to_csv(path, index=False)
    return cols


def _same(a, b):
    assert a.train.user_ids == b.train.user_ids and a.test.user_ids == b.test.user_ids
    for part in ("train", "test"):
        pa, pb = getattr(a, part), getattr(b, part)
        for f in ("X", "y", "user_index"):
            ta, tb = getattr(pa, f), getattr(pb, f)
            assert ta.dtype == tb.dtype and ta.shape == tb.shape and ta.is_contiguous() == tb.is_contiguous()
            assert torch.equal(ta, tb), (part, f)  # bit for bit


@pytest.mark.parametrize(
    "fmt,d,ints,task,B,on_bound",
    [
        (".npz", 10, True, "binary", 1.0, "clip"),  # d >= 8: numpy's pairwise sums differ by layout
        (".npz", 3, False, "multiclass", 0.5, "clip"),
        (".npz", 12, True, "regression", 2.0, "refuse"),
        (".npz", 43, True, "binary", 1.0, "clip"),  # five full blocks of 8 columns and a last one of 3
        (".npz", 13, True, "binary", 1.0, "clip"),  # blocks of 2, the last of 1
        (".csv", 9, True, "binary", 1.0, "clip"),
    ],
)
def test_dataset_equals_the_old_loader(tmp_path, fmt, d, ints, task, B, on_bound):
    import pandas as pd

    path = str(tmp_path / f"f{fmt}")
    cols = _write(path, 300, 7, d, ints=ints, task=task)
    features = [f"x{i}" for i in range(d)]
    ref = _old_load(pd.DataFrame(cols), "uid", "y", task, B, on_bound, features, name=os.path.basename(path))
    ds = load_file(path, user_column="uid", label_column="y", task=task, feature_bound=B, on_bound=on_bound)
    _same(ds, ref)
    assert ds.num_classes == ref.num_classes and ds.extra.get("label_bound") == ref.extra.get("label_bound")


def test_a_stored_npz_is_read_straight_from_its_bytes_and_a_compressed_one_through_zlib(tmp_path, monkeypatch):
    """np.savez's members are stored: read by memory-mapping their array data (no zip stream nor CRC pass);
    np.savez_compressed's through numpy's reader; the same dataset either way (and a third file with a long
    zip extra field in its local headers, which the central directory does not repeat, reads the same)."""
    import zipfile

    from fedkl.data import files

    cols = _write(str(tmp_path / "stored.npz"), 200, 5, 11)
    np.savez_compressed(tmp_path / "zipped.npz", **cols)
    with zipfile.ZipFile(tmp_path / "stored.npz") as src, zipfile.ZipFile(tmp_path / "extra.npz", "w") as dst:
        for info in src.infolist():
            copy = zipfile.ZipInfo(info.filename, info.date_time)
            copy.extra = b"\xfe\xca\x05\x00hello"  # an unknown 5-byte extra block in the local header
            dst.writestr(copy, src.read(info), compress_type=zipfile.ZIP_STORED)
    read = {"numpy": 0}
    real = np.lib.npyio.NpzFile.__getitem__

    def counted(self, key):
        read["numpy"] += 1
        return real(self, key)

    monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", counted)
    kw = dict(user_column="uid", label_column="y", feature_bound=1.0, on_bound="clip")
    stored = load_file(str(tmp_path / "stored.npz"), **kw)
    extra = load_file(str(tmp_path / "extra.npz"), **kw)
    assert read["numpy"] == 0  # every column of both from the file's bytes
    zipped = load_file(str(tmp_path / "zipped.npz"), **kw)
    assert read["numpy"] > 0
    for other in (extra, zipped):
        _same(other, stored)
    assert files._npz_columns(str(tmp_path / "zipped.npz"))._headers["x0"][2] is None


def test_site_file_equals_the_old_loader(tmp_path):
    import pandas as pd

    path = str(tmp_path / "site.npz")
    cols = _write(path, 1, 40, 4)
    frame = pd.DataFrame(cols).assign(uid="s7")
    ref = _old_load(frame, "uid", "y", "binary", 1.0, "clip", [f"x{i}" for i in range(4)])
    schema = Schema(label_column="y", feature_columns=tuple(f"x{i}" for i in range(4)), on_bound="clip")
    _same(load_site(path, schema, "s7"), ref)


@pytest.mark.parametrize("d,bound", [(10, 2.0), (20, 1.6)])
def test_npz_load_peak_is_about_one_matrix(tmp_path, d, bound):
    """20k users x 10 records x d features: the numpy memory traced while loading peaks below ``bound``
    times the matrix's bytes: the train + test matrices (1x), plus per-record vectors (ids, labels,
    split, one column being read: ~10 of them, 10/d of the matrix); the loader before issue 34 peaked
    at 5.3x (d=10) and 4.6x (d=20): frame, matrix, scaled, projected, split copies."""
    path = str(tmp_path / "big.npz")
    _write(path, 20_000, 10, d)
    matrix = 20_000 * 10 * d * 8
    tracemalloc.start()
    try:
        ds = load_file(path, user_column="uid", label_column="y", feature_bound=1.0, on_bound="clip")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ds.train.num_records + ds.test.num_records == 200_000
    assert peak <= bound * matrix, f"peak {peak / matrix:.2f}x the matrix"


def test_integer_ids_are_not_stringified_per_record_and_x_is_checked_once(tmp_path, monkeypatch):
    path = str(tmp_path / "f.npz")
    _write(path, 500, 6, 5)
    N, d = 3000, 5
    seen = {"unique": [], "finite": 0}
    real_unique, np_finite, torch_finite = np.unique, np.isfinite, torch.isfinite

    def unique(a, *args, **kw):
        seen["unique"].append((np.asarray(a).dtype.kind, np.asarray(a).size))
        return real_unique(a, *args, **kw)

    def np_isfinite(a, *args, **kw):
        seen["finite"] += np.asarray(a).size
        return np_finite(a, *args, **kw)

    def t_isfinite(a):
        seen["finite"] += a.numel()
        return torch_finite(a)

    monkeypatch.setattr(np, "unique", unique)
    monkeypatch.setattr(np, "isfinite", np_isfinite)
    monkeypatch.setattr(torch, "isfinite", t_isfinite)
    ds = load_file(path, user_column="uid", label_column="y", feature_bound=1.0, on_bound="clip")
    assert ds.train.num_users == 500
    assert not [u for u in seen["unique"] if u[0] in "UO" and u[1] == N], "a string per record"
    assert seen["finite"] <= N * d + 2 * N, f"isfinite over {seen['finite'] / (N * d):.1f}x the matrix"
    # a cohort drawn from checked data is not re-checked
    seen["finite"] = 0
    ds.train.subset(list(range(0, 500, 2)))
    ds.train.subset([3])
    assert seen["finite"] == 0
    # nor is it re-checked when a federation casts it to the dtype it already has (InProcessFederation)
    assert ds.train.to(ds.train.X.dtype) is ds.train and seen["finite"] == 0
    narrow = ds.train.to(torch.float32)  # a narrowing cast checks once (a finite value may overflow) ...
    assert narrow.X.dtype == torch.float32 and seen["finite"] >= narrow.X.numel()
    checked = seen["finite"]
    assert narrow.to(torch.float64).X.dtype == torch.float64 and seen["finite"] == checked  # ... widening never


def test_a_cast_that_overflows_is_refused_in_one_line():
    from fedkl.data.base import UserData

    data = UserData(torch.tensor([[1e300, 0.0]], dtype=torch.float64), torch.tensor([1]), torch.tensor([0]), ("a",))
    with pytest.raises(ValueError, match="the data overflows torch.float32"):
        data.to(torch.float32)


def test_subset_still_refuses_repeated_users(tmp_path):
    path = str(tmp_path / "f.npz")
    _write(path, 5, 4, 3)
    ds = load_file(path, user_column="uid", label_column="y", feature_bound=1.0, on_bound="clip")
    with pytest.raises(ValueError, match="unique"):
        ds.train.subset([1, 1])


def test_int_user_order_matches_string_order():
    ids, index = custom.user_keys(np.array([10, 2, 33, 2, 10, 100]))
    assert ids == ("10", "100", "2", "33")
    assert index.tolist() == [0, 2, 3, 2, 0, 1]


def test_npz_run_never_imports_pandas_or_scipy(tmp_path):
    """A noisy-gd ``fedkl run`` on an .npz in a fresh interpreter: no pandas, no scipy in sys.modules."""
    path = str(tmp_path / "f.npz")
    _write(path, 40, 5, 3)
    code = f"""
import sys, json
from fedkl.cli import main
sys.argv = ["fedkl", "run", "--dataset", {path!r}, "--user-column", "uid", "--label-column", "y",
            "--on-bound", "clip", "--rounds", "2", "--no-reference", "--out", {str(tmp_path / "out")!r}]
try:
    main()
finally:
    print("MODULES", json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & {{"pandas", "scipy"}})))
"""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("MODULES")][-1]
    assert json.loads(line.split(" ", 1)[1]) == []
