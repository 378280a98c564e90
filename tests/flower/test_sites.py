"""Sites that load their own data: each node's ClientApp reads the file named by its node-config
``data-path``, checks it against the run's public schema, and answers for its one user; the server
knows only the schema and the enrolment list (dataset ``"sites"``), never a file."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.app import Context, RecordDict
from run_files import check_round_metrics  # tests/run_files.py

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
from fedkl.data import load_dataset
from fedkl.data.base import FederatedDataset, UserData
from fedkl.data.files import Schema, load_site
from fedkl.federation.inprocess import InProcessFederation
from fedkl.flower import client_app, codec, server_app
from fedkl.flower.client_app import make_client_app
from fedkl.flower.federation import FlowerFederation
from fedkl.flower.localgrid import LocalGrid
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.problems import make_problem
from fedkl.saved_model import load_model

pytestmark = pytest.mark.flower

SITES = ("s0", "s1", "s2", "s3", "s4")
SCHEMA = {"label_column": "y", "feature_columns": "a,b,c", "task": "binary", "feature_bound": 3.0}
SPEC = codec.ClientSpec.build("sites", "logistic", {"sites": ",".join(SITES), "split_seed": 2, **SCHEMA})


def _site_files(tmp_path, change=None):
    """One CSV per site (no user column: the whole file is the site's); ``change`` maps a site position
    to a function of its frame (a site with a broken file)."""
    paths = {}
    for p in range(len(SITES)):
        r = np.random.default_rng(p)
        X = r.normal(size=(20 + 3 * p, 3)) * 0.5
        frame = pd.DataFrame({"a": X[:, 0], "b": X[:, 1], "c": X[:, 2], "y": (X[:, 0] - X[:, 1] > 0).astype(int)})
        if change and p in change:
            frame = change[p](frame)
        paths[p] = tmp_path / f"site{p}.csv"
        frame.to_csv(paths[p], index=False)
    return paths


def _grid(paths, extra=None, run_config=None):
    cfg = {p: {"data-path": str(path), **(extra or {}).get(p, {})} for p, path in paths.items()}
    app = make_client_app(None if run_config else SPEC)
    return LocalGrid(app, len(SITES), node_config=cfg, run_config=run_config)


def _one_machine(paths) -> InProcessFederation:
    """The same records in one process: every site's file loaded with the same schema and seed."""
    schema = Schema(**SCHEMA)
    parts = [load_site(str(paths[p]), schema, SITES[p], split_seed=2) for p in range(len(SITES))]

    def cat(split):
        return UserData(
            torch.cat([getattr(d, split).X for d in parts]),
            torch.cat([getattr(d, split).y for d in parts]),
            torch.cat([torch.full((getattr(d, split).num_records,), p) for p, d in enumerate(parts)]),
            SITES,
        )

    ds = FederatedDataset("sites", cat("train"), cat("test"), "binary", 1.0, "one machine")
    return InProcessFederation(make_problem("logistic", ds), ds)


def _noisy_gd(federation, tmp_path, name):
    ledger = PrivacyLedger(tmp_path / f"{name}.sqlite", Budget(8.0, 1e-5))
    rel = Releaser(ledger, NoiseSource(7), ZCDPFilter(0.5))
    res = NoisyGradientDescent(NoisyGDParams(rounds=3, lr=0.5, clip=0.5), BuildContext.fresh(rho=0.5)).run(
        federation, rel, torch.zeros(federation.num_params, dtype=torch.float64)
    )
    return res, ledger


def test_sites_answer_from_their_own_files_like_one_machine(tmp_path):
    paths = _site_files(tmp_path)
    fed = FlowerFederation(_grid(paths), user_ids=SITES, wait_for_nodes=0.0)
    ref = _one_machine(paths)
    assert fed.user_ids == SITES and fed.num_params == ref.num_params == 3
    res, ledger = _noisy_gd(fed, tmp_path, "sites")
    res_ref, ledger_ref = _noisy_gd(ref, tmp_path, "ref")
    assert torch.equal(res.w, res_ref.w)  # same records, same seeds: the same released model
    assert [h["failed_users"] for h in res.history] == [0, 0, 0]
    for uid in SITES:
        assert ledger.spend(uid) == ledger_ref.spend(uid)


@pytest.mark.parametrize(
    "change, extra, message",
    [
        (
            {3: lambda f: f.rename(columns={"c": "d"})},
            None,
            r"site 's3' \(partition-id 3\): .*missing column\(s\) \['c'\]",
        ),
        ({1: lambda f: f.assign(b=np.where(f.index == 4, np.nan, f["b"]))}, None, "row 4, column 'b'"),
        ({2: lambda f: f.assign(a=f["a"] * 100)}, None, "above the declared feature bound 3"),
        (None, {4: {"feature-columns": "a,b,d"}}, "declares another schema: feature-columns 'a,b,d'"),
    ],
    ids=["other-columns", "non-finite", "out-of-bound", "declared-schema"],
)
def test_a_site_whose_data_breaks_the_schema_is_refused_clearly(tmp_path, change, extra, message):
    paths = _site_files(tmp_path, change)
    with pytest.raises(RuntimeError, match="1 node\\(s\\) refused their own data: .*" + message):
        FlowerFederation(_grid(paths, extra), user_ids=SITES, wait_for_nodes=0.0)


def test_a_site_without_a_data_path_says_so():
    grid = LocalGrid(make_client_app(SPEC), len(SITES))
    with pytest.raises(RuntimeError, match="no data-path in the node-config"):
        FlowerFederation(grid, user_ids=SITES, wait_for_nodes=0.0)


def _sites_run_config(out) -> dict:
    return {
        "fedkl-dataset": "sites",
        "fedkl-sites": ",".join(SITES),
        "fedkl-label-column": "y",
        "fedkl-feature-columns": "a,b,c",
        "fedkl-feature-bound": 3.0,
        "fedkl-rounds": 2,
        "fedkl-epsilon": 4.0,
        "fedkl-noise-seed": 5,
        "fedkl-out": str(out),
    }


def test_the_deployed_server_knows_only_the_schema_and_enrolment(tmp_path, monkeypatch, capsys):
    """The ServerApp's main, configured by run-config keys only (``fedkl-dataset = "sites"``,
    ``fedkl-sites``, the schema keys), trains over nodes that load their own files; it never opens one. It
    writes the artefacts of every entry point (issue 31: only flower_result.json and the ledger before):
    model.pt with its receipt, a strict result.json, the ledger and the per-round metrics, and ends with the
    privacy line and a test-metric line saying there is none (the server holds no records)."""
    paths = _site_files(tmp_path)
    rc = _sites_run_config(tmp_path / "deployed")
    assert codec.ClientSpec.from_user_config(rc).kwargs[0]["sites"] == ",".join(SITES)
    server_reads = []
    import fedkl.data.files as files

    real = files._table
    monkeypatch.setattr(files, "_table", lambda path: server_reads.append(path) or real(path))
    grid = _grid(paths, run_config=rc)
    client_app._USERS.clear()
    seen = len(server_reads)
    server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    res = json.loads((tmp_path / "deployed" / "flower_result.json").read_text())
    assert res["users"] == len(SITES) and res["failed_users"] == [0, 0]
    assert sorted(server_reads[seen:]) == sorted(str(p) for p in paths.values())  # each file once, by its node
    assert load_dataset("sites", sites=",".join(SITES), **SCHEMA).train.num_records == 0
    out, said = tmp_path / "deployed", capsys.readouterr().out
    saved = json.loads((out / "result.json").read_text(), parse_constant=lambda c: pytest.fail(f"not strict: {c}"))
    assert saved["backend"] == "flwr-run" and saved["test_metric"] is None and saved["ledger"] == res["ledger"]
    model = load_model(saved["model_path"])
    assert torch.equal(model.params.to(torch.float64), torch.tensor(res["w"], dtype=torch.float64))
    assert model.receipt["epsilon"] == saved["epsilon"] and (out / "ledger.sqlite").is_file()
    check_round_metrics(out, 2)
    assert f"epsilon = {saved['epsilon']:.4f}, delta = {saved['delta']:.3g}" in said
    assert "test metric: none (the server holds no test records" in said and "backend flwr-run" in said


def test_the_docs_node_config_parses_into_what_the_client_reads():
    """docs/how-to/deploy.md step 3's --node-config, parsed by Flower's own parser as a SuperNode does."""
    import re
    from pathlib import Path

    from flwr.common.config import parse_config_args

    page = (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "deploy.md").read_text()
    node_config = parse_config_args([re.search(r'--node-config "([^"]+)"', page).group(1)])
    assert node_config["partition-id"] == 7 and node_config["data-path"] == "/srv/site7/records.csv"
    assert Schema(label_column="y", feature_columns="age,bmi,dose").differences(node_config) == []


def test_a_file_dataset_over_flower_local_is_the_inprocess_run(tmp_path):
    """`fedkl run --dataset FILE --backend flower-local`: every client loads the file with the run's schema
    and keeps its user's records; same seeds give the same released model as in-process."""
    from fedkl.cli import main
    from fedkl.saved_model import load_model

    frame = pd.concat([pd.read_csv(p).assign(id=SITES[i]) for i, p in _site_files(tmp_path).items()], ignore_index=True)
    frame.to_csv(tmp_path / "all.csv", index=False)
    argv = ["run", "--dataset", str(tmp_path / "all.csv"), "--user-column", "id", "--label-column", "y"]
    argv += ["--feature-bound", "3", "--noise-seed", "1", "--no-reference", "--epsilon", "8"]
    argv += ["--kernels", "reproducible"]  # bit for bit (in-process alone defaults to the fast kernels)
    for backend in ("inprocess", "flower-local"):
        assert main([*argv, "--backend", backend, "--out", str(tmp_path / backend)]) == 0
    a, b = (load_model(str(tmp_path / b / "model.pt")).params for b in ("inprocess", "flower-local"))
    assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.deployment
def test_sites_over_grpc_with_tls_load_their_own_files(tmp_path):
    """A loopback deployment (SuperLink with TLS and SuperNode auth, one SuperNode per site started with
    its own ``data-path``, the app submitted with `flwr run`) releases the model the same nodes give over
    the LocalGrid, with the same ledger."""
    from fedkl.flower.deploy import run_grpc

    paths = _site_files(tmp_path)
    rc = _sites_run_config(tmp_path / "grpc-out")
    node_config = {p: {"data-path": str(path)} for p, path in paths.items()}
    res = run_grpc(rc, len(SITES), workdir=str(tmp_path / "grpc"), node_config=node_config, log=print)
    local = _sites_run_config(tmp_path / "local")
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=local)
    server_app._deployed_main(_grid(paths, run_config=local), ctx)
    ref = json.loads((tmp_path / "local" / "flower_result.json").read_text())
    assert res["users"] == len(SITES) and res["failed_users"] == [0, 0] and res["failures"]["counts"] == {}
    assert res["w"] == ref["w"] and res["ledger"]["max_user_rho"] == ref["ledger"]["max_user_rho"]
    assert not (tmp_path / "grpc" / "certs").exists()  # the run's keys are gone
    saved = json.loads((tmp_path / "grpc-out" / "result.json").read_text())  # the files of every entry point
    assert (
        saved["test_metric"] is None
        and saved["ledger"] == res["ledger"]
        and (tmp_path / "grpc-out" / "model.pt").is_file()
    )
