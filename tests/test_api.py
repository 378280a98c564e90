"""The public Python API: fedkl.train on a dataset name or on your own arrays / DataFrame."""

import doctest
import json
import os

import numpy as np
import pandas as pd
import pytest
import torch

import fedkl
from fedkl import api
from fedkl.data import custom


def test_the_api_docstring_example_runs(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the example writes runs/<id>/ like `fedkl run`
    torch.set_num_threads(1)
    res = doctest.testmod(api, optionflags=doctest.ELLIPSIS)
    assert res.attempted >= 8 and res.failed == 0


def _arrays(n_users=60, m=30, seed=1):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n_users * m, 3)) / 2
    users = np.repeat([f"site-{u}" for u in range(n_users)], m)
    y = (X[:, 0] > 0).astype(int)
    return X, y, users


def test_train_returns_the_model_the_budget_and_writes_the_model_file(tmp_path):
    X, y, users = _arrays()
    data = fedkl.from_arrays(X, y, users, task="binary", split_seed=3)
    assert data.train.num_users == 60 and set(data.train.y.tolist()) <= {-1.0, 1.0}
    ledger = tmp_path / "l.sqlite"
    run = fedkl.train(
        data, "noisy-gd", epsilon=1.0, noise_seed=4, out=str(tmp_path / "a"), ledger=str(ledger), rounds=5, log=None
    )
    assert run.epsilon <= 1.0 * (1 + 1e-9) and run.delta == pytest.approx(1 / 60**1.1)
    assert torch.equal(fedkl.load_model(run.result["model_path"]).params, run.model)
    saved = json.load(open(os.path.join(run.result["out_dir"], "result.json")))
    assert saved["dataset"] == "custom" and saved["model_path"] == run.result["model_path"]
    assert "model" not in saved  # result.json names the model by path
    assert run.result["ledger"]["users_charged"] == 60 and run.result["ledger"]["path"] == str(ledger)
    # the same seed gives the same model (reproducible), another seed another one
    again = fedkl.train(data, "noisy-gd", epsilon=1.0, noise_seed=4, out=str(tmp_path / "b"), rounds=5, log=None)
    other = fedkl.train(data, "noisy-gd", epsilon=1.0, noise_seed=5, out=str(tmp_path / "c"), rounds=5, log=None)
    assert torch.equal(again.model, run.model) and not torch.equal(other.model, run.model)


def test_train_refuses_bad_settings_and_data():
    X, y, users = _arrays(10, 5)
    data = fedkl.from_arrays(X, y, users)
    with pytest.raises(TypeError, match="unknown setting"):
        fedkl.train(data, rounds=2, learning_rate=0.1, log=None)
    with pytest.raises(TypeError, match="FederatedDataset"):
        fedkl.train(X, log=None)
    with pytest.raises(ValueError, match="in-process"):
        fedkl.train(data, backend="flower-local", log=None)


def test_from_dataframe_and_the_data_rules():
    X, y, users = _arrays(8, 6)
    frame = pd.DataFrame({"user": users, "a": X[:, 0] * 10, "b": X[:, 1], "label": y, "note": "x"})
    ds = fedkl.from_dataframe(frame, user="user", label="label")  # numeric columns a, b
    assert ds.train.dim == 2 and ds.train.num_users == 8
    assert float(torch.linalg.vector_norm(ds.train.X, dim=1).max()) <= 1 + 1e-12  # projected onto the unit ball
    assert ds.train.user_ids == tuple(sorted(set(users)))  # stable ids: sorted distinct values
    with pytest.raises(ValueError, match="not in the DataFrame"):
        fedkl.from_dataframe(frame, user="uid", label="label")
    with pytest.raises(ValueError, match="binary labels"):
        custom.from_arrays(X, np.full(len(y), 2), users)
    with pytest.raises(ValueError, match="one entry per record"):
        custom.from_arrays(X, y[:-1], users)
    with pytest.raises(ValueError, match="NaN"):
        custom.from_arrays(np.full_like(X, np.nan), y, users)
    reg = custom.from_arrays(X, X[:, 0] * 3, users, task="regression", label_bound=5.0)
    assert reg.extra["label_bound"] == 5.0
    with pytest.raises(ValueError, match="label_bound"):
        custom.from_arrays(X, X[:, 0] * 100, users, task="regression", label_bound=5.0)
    multi = custom.from_arrays(X, np.arange(len(y)) % 3, users, task="multiclass")
    assert multi.num_classes == 3
