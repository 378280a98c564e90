"""Ghost clipping for any torch model (fedkl/federation/ghost_clipping.py): the clipped per-user gradient
sum equals the explicit per-record path (per-record gradients summed into users, clipped, summed) for
an MLP, a CNN (Conv1d/Conv2d + GroupNorm), Embedding + LayerNorm and a layer called several times per
record, with users of different record counts inside and outside the clip ball; a non-finite user adds
zero and is reported; what is not covered is refused in one line, and the in-process backend then
answers with the per-record path."""

from __future__ import annotations

import re

import pytest
import torch

from fedkl.data.base import FederatedDataset, UserData
from fedkl.federation import ghost_clipping
from fedkl.federation.base import ClippedGradient
from fedkl.federation.ghost_clipping import ghost_clipped_sum, unsupported_reason
from fedkl.federation.inprocess import GHOST_FLOAT32, InProcessFederation
from fedkl.problems import MLP, TorchModel
from fedkl.problems.rowwise import kernels

COUNTS = [1, 6, 3, 2, 5, 1, 4, 0]  # records per user (the last user has none)
SIDE = 6


class CNN(torch.nn.Module):
    """Conv2d (stride, padding) + GroupNorm, two more Conv2d with many channels on few positions
    (their per-user norms by materialised user gradients and by Gram matrices), Conv1d over the rows
    ('same' padding), a linear head."""

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, stride=2, padding=1)  # 6x6 -> 3x3
        self.norm = torch.nn.GroupNorm(2, 4)
        self.wide = torch.nn.Conv2d(4, 8, 2)  # 3x3 -> 2x2
        self.wider = torch.nn.Conv2d(8, 16, 2)  # 2x2 -> 1x1
        self.conv1 = torch.nn.Conv1d(SIDE, 3, 3, padding="same", bias=False)
        self.head = torch.nn.Linear(16 + 3 * SIDE, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x.view(-1, 1, SIDE, SIDE))))
        h = self.wider(torch.tanh(self.wide(h))).flatten(1)
        r = torch.tanh(self.conv1(x.view(-1, SIDE, SIDE))).flatten(1)
        return self.head(torch.cat([h, r], 1))


class EmbedNorm(torch.nn.Module):
    """Token ids (the features, as integers) -> Embedding (padding_idx 0) -> LayerNorm -> Linear."""

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(7, 5, padding_idx=0)
        self.norm = torch.nn.LayerNorm(5)
        self.head = torch.nn.Linear(5 * dim, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.emb(x.long()))).flatten(1))


class Recurrent(torch.nn.Module):
    """One Linear cell applied at every step: a layer called several times per record."""

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.cell = torch.nn.Linear(3 + 4, 4)
        self.head = torch.nn.Linear(4, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 4)
        for t in range(x.shape[1] // 3):
            h = torch.tanh(self.cell(torch.cat([x[:, 3 * t : 3 * t + 3], h], 1)))
        return self.head(h)


def _data(dim: int, classes: int, tokens: bool = False, seed: int = 0, counts=COUNTS, grouped=False) -> UserData:
    g = torch.Generator().manual_seed(seed)
    idx = torch.cat([torch.full((c,), u) for u, c in enumerate(counts)])
    if not grouped:
        idx = idx[torch.randperm(len(idx), generator=g)]  # records not grouped by user
    if tokens:
        X = torch.randint(0, 7, (len(idx), dim), generator=g).double()
    else:
        X = torch.randn(len(idx), dim, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (len(idx),), generator=g)
    return UserData(X, y, idx, tuple(f"u{u}" for u in range(len(counts))))


def _per_record_clipped_sum(problem, w, data, clip):
    grads = problem.per_user_gradients(w, data)  # per-record gradients summed into users (vmap(grad))
    norms = grads.norm(dim=1)
    return (grads * torch.clamp(clip / norms.clamp_min(1e-300), max=1.0).unsqueeze(1)).sum(0), norms


MODELS = {
    "mlp": lambda dtype: (MLP(40, (32, 6), 4, seed=3, dtype=dtype), _data(40, 4)),
    "cnn": lambda dtype: (TorchModel(CNN, SIDE * SIDE, "multiclass", 3, dtype=dtype), _data(SIDE * SIDE, 3)),
    "embedding": lambda dtype: (TorchModel(EmbedNorm, 6, "multiclass", 3, dtype=dtype), _data(6, 3, tokens=True)),
    "inplace-relu": lambda dtype: (TorchModel(InPlace, 10, "multiclass", 3, dtype=dtype), _data(10, 3)),
    "recurrent": lambda dtype: (TorchModel(Recurrent, 9, "regression", dtype=dtype), _data(9, 3)),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_ghost_sum_equals_the_per_record_path(model, dtype, tol):
    problem, data = MODELS[model](dtype)
    assert unsupported_reason(problem) is None
    w = problem.init_params(torch.Generator().manual_seed(1))
    _, norms = _per_record_clipped_sum(problem, w, data, 1.0)
    nonempty = norms[torch.tensor(COUNTS) > 0]
    # every user clipped, about half clipped, none clipped
    for clip in (float(nonempty.min()) / 10, float(nonempty.median()), float(nonempty.max()) * 10):
        expected, _ = _per_record_clipped_sum(problem, w, data, clip)
        got, bad = ghost_clipped_sum(problem, w, data, clip)
        assert not bad.any()
        assert got.dtype == dtype and got.shape == (problem.num_params,)
        assert float((got - expected).norm() / expected.norm()) < tol


class Sqrt(torch.nn.Module):
    """Finite for features x_0 > -100, NaN below."""

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(dim, 5)
        self.norm = torch.nn.LayerNorm(5)
        self.head = torch.nn.Linear(5, k)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.fc(x))) * torch.sqrt(x[:, :1] + 100))


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_small_blocks_and_grouped_equal_users_give_the_same_sum(model, monkeypatch):
    problem, _ = MODELS[model](torch.float64)
    dim = problem.dim
    w = problem.init_params()
    for data in (_data(dim, 3, counts=[4] * 6, grouped=True), _data(dim, 3)):  # slices; gathered padded blocks
        expected, norms = _per_record_clipped_sum(problem, w, data, 1.0)
        clip = float(norms[norms > 0].median())
        expected, _ = _per_record_clipped_sum(problem, w, data, clip)
        whole, _ = ghost_clipped_sum(problem, w, data, clip)
        monkeypatch.setattr(ghost_clipping, "BLOCK_ELEMENTS", 64)  # one user / one record per block
        blocks, _ = ghost_clipped_sum(problem, w, data, clip)
        monkeypatch.undo()
        torch.testing.assert_close(whole, expected, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(blocks, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("counts,grouped", [(COUNTS, False), ([3] * 8, True)])  # per record; per user
def test_a_non_finite_user_adds_zero_and_is_reported(counts, grouped):
    problem, data = (
        TorchModel(Sqrt, 10, "multiclass", 3, dtype=torch.float64),
        _data(10, 3, counts=counts, grouped=grouped),
    )
    w = problem.init_params()
    X = data.X.clone()
    X[(data.user_index == 1).nonzero()[0, 0], 0] = -1000.0  # one record of user 1: its output is NaN
    poisoned = UserData(X, data.y, data.user_index, data.user_ids)
    assert torch.isfinite(problem.per_user_gradients(w, poisoned)).all(1).tolist() == [u != 1 for u in range(8)]
    got, bad = ghost_clipped_sum(problem, w, poisoned, 0.5)
    assert bad.tolist() == [u == 1 for u in range(len(counts))]
    rest = [u for u in range(len(counts)) if u != 1]
    expected, _ = _per_record_clipped_sum(problem, w, data.subset(rest), 0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


class WithPReLU(torch.nn.Module):
    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(dim, 5), torch.nn.PReLU(), torch.nn.Linear(5, k))

    def forward(self, x):
        return self.body(x)


class Functional(torch.nn.Module):
    """Uses its layer's weight outside the layer's call (hooks cannot see that use)."""

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, k)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) + x @ self.fc.weight)


class Positions(torch.nn.Module):
    """Calls a layer with positions folded into the batch axis."""

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 3)
        self.head = torch.nn.Linear(3 * dim // 2, k)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x.reshape(-1, 2))).reshape(x.shape[0], -1))


class InPlace(torch.nn.Module):
    """ReLU(inplace=True) overwrites the first Linear layer's output (the hooks still see its gradient)."""

    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(dim, 5), torch.nn.ReLU(inplace=True), torch.nn.Linear(5, k))

    def forward(self, x):
        return self.body(x)


def _federation(net) -> tuple[InProcessFederation, InProcessFederation]:
    data = _data(10, 3)
    ds = FederatedDataset("toy", data, data, "multiclass", float(data.X.norm(dim=1).max()), "toy", num_classes=3)
    problem = TorchModel(net, 10, "multiclass", 3, dtype=torch.float64)
    return InProcessFederation(problem, ds), InProcessFederation(problem, ds, ghost=False)


@pytest.mark.parametrize(
    "net,message",
    [
        (WithPReLU, "ghost clipping does not cover this model: layer body.1 (PReLU) has parameters; covered: Linear,"),
        (Positions, "layer fc (Linear) is called on (110, 2), not on the 22 records"),
    ],
)
def test_an_uncovered_model_is_refused_in_one_line_and_the_backend_falls_back(net, message):
    fed, stock = _federation(net)
    w = fed.problem.init_params()
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        ghost_clipped_sum(fed.problem, w, fed._train, 1.0)
    assert "\n" not in str(err.value)
    got = fed.sum(ClippedGradient(w, 0.3))
    assert fed.clipped_sum_path.startswith("per-record (") and message.split(": ")[-1][:20] in fed.clipped_sum_path
    torch.testing.assert_close(got.total(), stock.sum(ClippedGradient(w, 0.3)).total())


def test_a_parameter_used_outside_its_layer_is_caught_by_the_check():
    fed, stock = _federation(Functional)
    w = fed.problem.init_params()
    assert unsupported_reason(fed.problem) is None  # structurally fine: only the comparison can tell
    got = fed.sum(ClippedGradient(w, 0.3), [0, 1, 2, 4])
    assert fed.clipped_sum_path.startswith("per-record (its gradient norms differ from the per-record path")
    torch.testing.assert_close(got.total(), stock.sum(ClippedGradient(w, 0.3), [0, 1, 2, 4]).total())


def test_the_inprocess_sum_is_ghost_clipping_by_default():
    fed, stock = _federation(Recurrent)
    w = fed.problem.init_params()
    users = [0, 1, 3, 4, 7]
    got = fed.sum(ClippedGradient(w, 0.05), users)
    assert fed.clipped_sum_path == "ghost" and got.values.shape == (1, fed.num_params) and got.users == users
    with kernels("reproducible"):  # the per-user rows (fast kernels would sum them in one step)
        ref = stock.sum(ClippedGradient(w, 0.05), users)
    assert stock.clipped_sum_path == "per-record (ghost clipping off)" and ref.values.shape[0] == len(users)
    torch.testing.assert_close(got.total(), ref.total(), rtol=1e-12, atol=1e-14)
    # per-user answers (what a Flower client sends) stay the per-record path
    assert fed.compute(ClippedGradient(w, 0.05), users).values.shape == (len(users), fed.num_params)


class Tied(torch.nn.Module):
    def __init__(self, dim: int, k: int) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.b.weight = self.a.weight
        self.head = torch.nn.Linear(dim, k)

    def forward(self, x):
        return self.head(self.b(torch.tanh(self.a(x))))


@pytest.mark.parametrize(
    "net,reg,reason",
    [
        (Tied, 0.0, "layer b (Linear) shares a parameter with layer a"),
        (
            lambda d, k: torch.nn.Sequential(
                torch.nn.Unflatten(1, (2, 5)),
                torch.nn.Conv1d(2, 4, 3, groups=2),
                torch.nn.Flatten(),
                torch.nn.Linear(12, k),
            ),
            0.0,
            "layer 1 (Conv1d): Conv1d with groups=2",
        ),  # fmt: skip
        (
            lambda d, k: torch.nn.Sequential(
                torch.nn.Unflatten(1, (1, 10)),
                torch.nn.Conv1d(1, 2, 2, padding="same"),
                torch.nn.Flatten(),
                torch.nn.Linear(20, k),
            ),
            0.0,
            "layer 1 (Conv1d): Conv1d with asymmetric 'same' padding",
        ),  # fmt: skip
        (lambda d, k: torch.nn.Sequential(torch.nn.Linear(d, k)), 0.1, "a regularised problem (reg != 0)"),
    ],
)
def test_what_is_not_covered_is_named(net, reg, reason):
    assert unsupported_reason(TorchModel(net, 10, "multiclass", 3, reg=reg)) == reason


@pytest.mark.slow
def test_a_dp_sgd_run_with_ghost_clipping_equals_the_per_record_run(tmp_path, monkeypatch):
    """Through the runner (float64: a float32 run never takes the ghost path, below): the same sampling,
    noise and ledger; the model equal to rounding."""
    from fedkl.runner import RunConfig, run_training  # the run layer, above this one: only the test uses it
    from fedkl.saved_model import load_model

    settings = dict(dataset="synthetic-logistic", users=16, algorithm="dp-sgd", rounds=3, lr=0.5, problem="mlp",
                    noise_seed=3, reference=False, dtype="float64")  # fmt: skip
    ghost = run_training(RunConfig.from_settings(**settings, out=str(tmp_path / "ghost")), log=lambda s: None)
    used = []
    monkeypatch.setattr(InProcessFederation, "_ghost_covers", lambda self, w: used.append(1) and False)
    stock = run_training(RunConfig.from_settings(**settings, out=str(tmp_path / "stock")), log=lambda s: None)
    assert used  # the second run asked for clipped sums and got the per-record path
    w_ghost, w_stock = (load_model(r["model_path"]).params for r in (ghost, stock))
    torch.testing.assert_close(w_ghost, w_stock, rtol=1e-10, atol=1e-12)
    assert {**ghost["ledger"], "path": None} == {**stock["ledger"], "path": None}


def test_a_float32_model_sums_on_the_per_record_path_whose_clip_is_proven():
    """Ghost clipping fuses every user's scaled gradient in one float32 backward pass, whose rounding no
    per-user proof bounds: below float64 the sum is the per-record path (clip_rows' proven margin)."""
    fed, _ = _federation(Recurrent)
    fed32 = InProcessFederation(TorchModel(Recurrent, 10, "multiclass", 3, dtype=torch.float32), fed.dataset)
    w = fed32.problem.init_params()
    got = fed32.sum(ClippedGradient(w, 0.05), [0, 1, 3])
    assert fed32.clipped_sum_path == f"per-record ({GHOST_FLOAT32})" and got.users == [0, 1, 3]
