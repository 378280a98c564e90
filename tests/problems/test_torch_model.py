"""Your own torch.nn.Module as the problem (fedkl.problems.torch_model): per-user gradients equal a
per-user autograd reference for a network fedkl does not know (a small CNN defined here), the
built-in MLP is the same code, bad networks are refused in one line, and a network named by a
'file.py:factory' spec trains through fedkl.train, `fedkl run` and Flower (the same ledger and
noise as in-process; the model equal to float rounding)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import fedkl
from fedkl import cli
from fedkl.data.base import UserData
from fedkl.flower.server_app import run_flower_simulation
from fedkl.problems import MLP, TorchModel, make_problem
from fedkl.problems.torch_model import load_factory
from fedkl.runner import RunConfig

SIDE = 4  # 4x4 "images": 16 features


class TinyCNN(torch.nn.Module):
    """A conv layer, GroupNorm and a linear head: layers fedkl's built-in MLP does not have."""

    def __init__(self, input_dim: int, num_outputs: int) -> None:
        super().__init__()
        assert input_dim == SIDE * SIDE
        self.conv = torch.nn.Conv2d(1, 3, kernel_size=3, padding=1)
        self.norm = torch.nn.GroupNorm(1, 3)
        self.head = torch.nn.Linear(3 * SIDE * SIDE, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.conv(x.view(-1, 1, SIDE, SIDE))))
        return self.head(h.flatten(1))


NET_FILE = textwrap.dedent(
    """
    import torch

    def tiny(input_dim, num_outputs):
        return torch.nn.Sequential(torch.nn.Linear(input_dim, 6), torch.nn.Tanh(), torch.nn.Linear(6, num_outputs))

    def with_batchnorm(input_dim, num_outputs):
        return torch.nn.Sequential(torch.nn.Linear(input_dim, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, num_outputs))
    """
)


def _data(n_users: int = 5, records: int = 40, classes: int = 3, seed: int = 0) -> UserData:
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(records, SIDE * SIDE, generator=g) / SIDE
    y = torch.randint(0, classes, (records,), generator=g)
    owner = torch.randint(0, n_users, (records,), generator=g)
    return UserData(X, y, owner, tuple(f"u{i}" for i in range(n_users)))


def test_per_user_gradients_of_a_custom_cnn_equal_per_user_autograd():
    data = _data()
    problem = TorchModel(TinyCNN, SIDE * SIDE, "multiclass", 3, reg=0.05, dtype=torch.float64, chunk_size=7)
    w = problem.init_params()
    got = problem.per_user_gradients(w, data)
    for u in range(data.num_users):
        rows = data.user_index == u
        v = w.clone().requires_grad_(True)
        out = torch.func.functional_call(problem.module, problem._unflatten(v), (data.X[rows].double(),))
        loss = torch.nn.functional.cross_entropy(out, data.y[rows]) + 0.5 * 0.05 * v.dot(v)
        (ref,) = torch.autograd.grad(loss, v)
        torch.testing.assert_close(got[u], ref, rtol=1e-10, atol=1e-12)
    losses = problem.per_user_losses(w, data)
    assert losses.shape == (data.num_users,) and torch.isfinite(losses).all()


def test_the_builtin_mlp_is_the_generic_torch_model_code():
    data = _data()
    mlp = MLP(SIDE * SIDE, (5,), 3, reg=0.1, seed=2)
    same = TorchModel(mlp.module, SIDE * SIDE, "multiclass", 3, reg=0.1)
    w = mlp.init_params()
    assert torch.equal(w, same.init_params())
    assert torch.equal(mlp.per_user_gradients(w, data), same.per_user_gradients(w, data))
    assert mlp.metrics(w, data) == same.metrics(w, data)


def test_a_factory_initialises_under_the_seed_and_regression_has_one_output():
    a = TorchModel(TinyCNN, SIDE * SIDE, "multiclass", 3, seed=1).init_params()
    assert torch.equal(a, TorchModel(TinyCNN, SIDE * SIDE, "multiclass", 3, seed=1).init_params())
    assert not torch.equal(a, TorchModel(TinyCNN, SIDE * SIDE, "multiclass", 3, seed=2).init_params())
    reg = TorchModel(TinyCNN, SIDE * SIDE, "regression")
    data = _data()
    data = UserData(data.X, data.y.double() / 3, data.user_index, data.user_ids)
    w = reg.init_params()
    assert set(reg.metrics(w, data)) == {"loss", "mse"}
    assert reg.predict(w, data.X).shape == (data.num_records,)


@pytest.mark.parametrize(
    "model, message",
    [
        (torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3)), "buffers"),
        (torch.nn.Linear(16, 5), r"needs \(B, 3\)"),
        (torch.nn.ReLU(), "no parameters"),
        (lambda d, k: "not a module", "must return a torch.nn.Module"),
        ("no_such_module_xyz:net", "cannot load"),
        ("missing_file.py:net", "cannot load"),
        ("torch:no_such_factory", "no callable"),
        ("no-colon", "is 'package.module:factory'"),
    ],
)
def test_bad_networks_are_refused_in_one_line(model, message):
    with pytest.raises(ValueError, match=message):
        TorchModel(model, 16, "multiclass", 3)


def test_make_problem_needs_a_model_exactly_for_torch():
    ds = fedkl.data.load_dataset("synthetic-logistic", n_users=6, m=5, d=4, seed=0)
    with pytest.raises(ValueError, match="needs a model"):
        make_problem("torch", ds)
    with pytest.raises(ValueError, match="is not 'torch'"):
        make_problem("logistic", ds, model="x.py:f")


@pytest.fixture()
def net_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nets.py").write_text(NET_FILE)
    return "nets.py"


def test_a_model_file_trains_with_fedkl_train_and_fedkl_run(net_file, tmp_path, capsys):
    settings = dict(rounds=3, clip=1.0, lr=0.5, users=30, noise_seed=0, log=None)
    by_spec = fedkl.train("synthetic-logistic", "dp-sgd", model=f"{net_file}:tiny", out=str(tmp_path / "a"), **settings)
    factory = load_factory(f"{net_file}:tiny")
    by_object = fedkl.train("synthetic-logistic", "dp-sgd", model=factory, out=str(tmp_path / "b"), **settings)
    assert by_spec.result["problem"] == "torch" and by_spec.result["config"]["model"] == "nets.py:tiny"
    assert torch.equal(by_spec.model, by_object.model)  # same network, seed and noise: the same release
    assert by_spec.model.numel() == TorchModel(factory, _dim(), "binary").num_params
    argv = ["run", "--dataset", "synthetic-logistic", "--users", "30", "--algorithm", "dp-sgd", "--rounds", "3",
            "--lr", "0.5", "--problem", "torch", "--model", f"{net_file}:tiny", "--noise-seed", "0",
            "--out", str(tmp_path / "c"), "--no-reference"]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "c" / "result.json").read_text())
    saved = fedkl.load_model(result["model_path"])  # the spec is in the file: the network is rebuilt
    assert torch.equal(saved.params, by_spec.model) and saved.problem_spec["model"] == "nets.py:tiny"
    X = torch.zeros(3, _dim())
    assert saved.predict(X).shape == (3,)
    assert cli.main([*argv[:-3], "--model", f"{net_file}:with_batchnorm", "--out", str(tmp_path / "d")]) == 2
    assert "buffers" in capsys.readouterr().err


def _dim(users: int = 30) -> int:
    return fedkl.data.load_dataset("synthetic-logistic", n_users=users, seed=0).train.dim


@pytest.mark.flower
def test_a_model_file_over_flower_equals_inprocess(net_file, tmp_path):
    base = dict(dataset="synthetic-logistic", users=12, algorithm="dp-sgd", rounds=2, lr=0.5, problem="torch",
                model=f"{net_file}:tiny", noise_seed=3, reference=False, kernels="reproducible")  # fmt: skip
    quiet = {"log": lambda s: None}
    ref = run_flower_simulation(RunConfig.from_settings(**base, out=str(tmp_path / "ref")), "inprocess", **quiet)
    fl = run_flower_simulation(RunConfig.from_settings(**base, out=str(tmp_path / "fl")), "flower-local", **quiet)
    # the same noise and ledger; the answers agree to float32 rounding, not bit for bit: a client
    # runs the network on its own records only, and BLAS rounds a row differently in another batch size
    torch.testing.assert_close(torch.as_tensor(fl["w"]), torch.as_tensor(ref["w"]), rtol=1e-5, atol=1e-6)
    assert not torch.equal(
        torch.as_tensor(ref["w"]), TorchModel(load_factory(f"{net_file}:tiny"), _dim(12), "binary").init_params()
    )
    assert {**ref["ledger"], "path": None} == {**fl["ledger"], "path": None}
