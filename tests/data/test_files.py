"""Your own data file (fedkl.data.files): a user-partitioned file on one machine, one site's file on its node,
checked against a declared schema (refused with a one-line reason, or clipped where asked)."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from fedkl.cli import main
from fedkl.data import load_dataset
from fedkl.data.custom import from_dataframe
from fedkl.data.files import DataError, Schema, load_file, load_site, sites_dataset
from fedkl.problems import make_problem

FEATURES = ("a", "b", "c")


def _frame(n=120, users=12, seed=0, scale=0.4):
    r = np.random.default_rng(seed)
    X = r.normal(size=(n, 3)) * scale
    y = (X @ np.array([1.0, -2.0, 0.5]) > 0).astype(int)
    return pd.DataFrame({"id": r.integers(0, users, n), "a": X[:, 0], "b": X[:, 1], "c": X[:, 2], "y": y})


def _csv(tmp_path, frame, name="d.csv"):
    path = tmp_path / name
    frame.to_csv(path, index=False)
    return str(path)


FILE_KW = dict(user_column="id", label_column="y", task="binary", feature_bound=3.0)


def test_csv_file_is_from_dataframe_of_the_scaled_features(tmp_path):
    frame = _frame()
    ds = load_file(_csv(tmp_path, frame), split_seed=4, **FILE_KW)
    scaled = frame.assign(**{c: frame[c] / 3.0 for c in FEATURES})
    ref = from_dataframe(scaled, user="id", label="y", features=list(FEATURES), split_seed=4)
    assert ds.train.user_ids == ref.train.user_ids and ds.train.num_users == frame["id"].nunique()
    torch.testing.assert_close(ds.train.X, ref.train.X)
    torch.testing.assert_close(ds.test.y, ref.test.y)
    assert ds.feature_bound == 1.0 and "divided by the declared bound 3" in ds.description


def test_npz_and_csv_give_the_same_dataset(tmp_path):
    frame = _frame()
    npz = tmp_path / "d.npz"
    np.savez(npz, **{c: frame[c].to_numpy() for c in frame.columns})
    a = load_dataset(_csv(tmp_path, frame), seed=1, **FILE_KW)  # through load_dataset, seed = split seed
    b = load_dataset(str(npz), seed=1, **FILE_KW)
    torch.testing.assert_close(a.train.X, b.train.X)
    assert a.train.user_ids == b.train.user_ids


def test_parquet_reads_like_csv_or_says_what_it_needs(tmp_path):
    frame = _frame()
    path = tmp_path / "d.parquet"
    try:
        frame.to_parquet(path)
    except ImportError:  # no parquet engine here: the refusal is what matters
        path.write_bytes(b"PAR1")
        with pytest.raises(DataError) as e:
            load_file(str(path), **FILE_KW)
        assert "needs pyarrow" in str(e.value) and "\n" not in str(e.value)
        return
    torch.testing.assert_close(
        load_file(str(path), **FILE_KW).train.X, load_file(_csv(tmp_path, frame), **FILE_KW).train.X
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: f.drop(columns=["b"]), "missing column(s) ['b']"),
        (lambda f: f.rename(columns={"y": "label"}), "missing column(s) ['y']"),
        (lambda f: f.assign(b=f["b"].where(f.index != 7, np.nan)), "row 7, column 'b'"),
        (lambda f: f.assign(c=f["c"].where(f.index != 3, np.inf)), "NaN or infinite features"),
        (lambda f: f.assign(a=f["a"].where(f.index != 5, 10.0)), "above the declared feature bound 3"),
        (lambda f: f.assign(a=f["a"].astype(str) + "kg"), "feature column 'a' is not numeric"),
        (lambda f: f.assign(y=f["y"] + 1), "binary labels must be"),
    ],
)
def test_bad_file_is_refused_with_one_line(tmp_path, change, message):
    path = _csv(tmp_path, change(_frame()))
    with pytest.raises(DataError) as e:
        load_file(path, feature_columns="a,b,c", **FILE_KW)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_clip_is_opt_in_and_counted(tmp_path):
    frame = _frame()
    frame.loc[[2, 9], "a"] = 10.0
    ds = load_file(_csv(tmp_path, frame), on_bound="clip", **FILE_KW)
    assert ds.extra["clipped"] == ["2 record(s) clipped to the feature bound 3"]
    assert float(torch.cat([ds.train.X, ds.test.X]).norm(dim=1).max()) <= 1 + 1e-12


def test_regression_label_bound_refused_or_clipped(tmp_path):
    frame = _frame().assign(y=lambda f: f["a"] * 10)
    kw = {**FILE_KW, "task": "regression", "label_bound": 2.0}
    path = _csv(tmp_path, frame)
    with pytest.raises(DataError, match="beyond the declared label bound 2"):
        load_file(path, **kw)
    ds = load_file(path, on_bound="clip", **kw)
    assert float(ds.train.y.abs().max()) <= 2.0 and "label(s) clipped" in ds.extra["clipped"][0]


def test_site_file_is_one_user_and_matches_the_servers_shape(tmp_path):
    schema = Schema(label_column="y", feature_columns="a,b,c", feature_bound=3.0)
    site = load_site(_csv(tmp_path, _frame().drop(columns=["id"])), schema, "site-7")
    server = sites_dataset("site-0, site-7", label_column="y", feature_columns="a,b,c")
    assert site.train.user_ids == ("site-7",) and server.train.user_ids == ("site-0", "site-7")
    assert server.train.num_records == 0
    assert make_problem("logistic", site).num_params == make_problem("logistic", server).num_params == 3


def test_a_site_file_with_another_schema_is_refused(tmp_path):
    schema = Schema(label_column="y", feature_columns="a,b,c", feature_bound=3.0)
    other = _frame().rename(columns={"c": "d"})
    with pytest.raises(DataError, match=r"missing column\(s\) \['c'\]"):
        load_site(_csv(tmp_path, other), schema, "site-1")
    assert schema.differences({"feature-columns": "a,b,d", "task": "binary"}) == [
        "feature-columns 'a,b,d' (the run's: 'a,b,c')"
    ]
    assert schema.differences({"feature-columns": "a,b,c", "feature-bound": "3"}) == []


def test_cli_trains_on_a_file_and_refuses_a_bad_one_in_one_line(tmp_path, capsys):
    path = _csv(tmp_path, _frame(n=400, users=40))
    out = tmp_path / "out"
    argv = ["run", "--dataset", path, "--user-column", "id", "--label-column", "y", "--task", "binary"]
    assert main([*argv, "--feature-bound", "3", "--out", str(out), "--no-reference", "--noise-seed", "1"]) == 0
    res = json.loads((out / "result.json").read_text())
    assert res["users"] == 40 and res["dataset"] == path and res["config"]["user_column"] == "id"
    capsys.readouterr()
    assert main([*argv, "--out", str(tmp_path / "o2")]) == 2  # default bound 1: these features exceed it
    err = capsys.readouterr().err.strip()
    assert "above the declared feature bound 1" in err and "\n" not in err
    assert main(["run", "--dataset", "synthetic-logistic", "--user-column", "id", "--out", str(tmp_path / "o3")]) == 2
    assert "apply to --dataset FILE" in capsys.readouterr().err
