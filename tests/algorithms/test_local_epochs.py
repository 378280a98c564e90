"""Issue 30: DP-FedAvg's local epochs, the label-shard partition and the FedAvg reference of a network."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedkl.algorithms.gradient.dp_adaptive import AdaptiveDPParams as DPSGDParams
from fedkl.algorithms.gradient.dp_fedavg import DPFedAvgParams
from fedkl.algorithms.nonprivate import fedavg_plan, nonprivate_fedavg
from fedkl.data import images
from fedkl.data.base import UserData
from fedkl.data.files import dataset_kwargs
from fedkl.federation.base import ClippedLocalUpdate
from fedkl.problems.base import Problem
from fedkl.problems.logistic import BinaryLogistic
from fedkl.problems.torch_model import TorchModel


def _data(n_users=4, n=23, dim=5, classes=3, seed=0) -> UserData:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, dim, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    users = torch.randint(0, n_users, (n,), generator=g)
    return UserData(X, y, users, tuple(f"u{i}" for i in range(n_users)))


def _net(i: int, o: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(i, 7), torch.nn.Tanh(), torch.nn.Linear(7, o))


def test_torch_local_epochs_equal_the_generic_loop():
    data = _data()
    p = TorchModel(_net, 5, "multiclass", 3, reg=0.01, dtype=torch.float64)
    w = p.init_params()
    fast = p.local_epoch_updates(w, data, 3, 0.3, 2)
    generic = Problem.local_epoch_updates(p, w, data, 3, 0.3, 2)
    torch.testing.assert_close(fast, generic, rtol=1e-12, atol=1e-12)
    assert fast.norm() > 0


def test_one_batch_epochs_are_full_batch_steps():
    """With the batch at least every user's record count, E epochs are E full-batch steps (local_steps E)."""
    data = _data(n_users=3, n=17, classes=2)
    data = UserData(data.X, torch.where(data.y > 0, 1.0, -1.0).double(), data.user_index, data.user_ids)
    p = BinaryLogistic(5, 0.0)
    w = torch.linspace(-0.5, 0.5, 5, dtype=torch.float64)
    torch.testing.assert_close(p.local_epoch_updates(w, data, 4, 0.5, None), p.local_updates(w, data, 4, 0.5, None))


def test_epochs_make_ceil_m_over_b_steps_per_pass():
    """A user with m records and batch B makes E * ceil(m / B) steps; the last batch holds m mod B records."""
    seen = []

    class Spy(BinaryLogistic):
        def epoch_step_gradient(self, w, batch):
            seen.append(batch.num_records)
            return super().epoch_step_gradient(w, batch)

    X = torch.randn(7, 3, dtype=torch.float64)
    one = UserData(X, torch.ones(7, dtype=torch.float64), torch.zeros(7, dtype=torch.int64), ("a",))
    Spy(3, 0.0).local_epoch_updates(torch.zeros(3, dtype=torch.float64), one, 2, 0.1, 3)
    assert seen == [3, 3, 1, 3, 3, 1]


def test_local_epochs_flags_one_rule():
    assert DPFedAvgParams(local_epochs=2, batch_size=10).local_epochs == 2
    with pytest.raises(ValueError, match="--local-steps .* or --local-epochs .* not both"):
        DPFedAvgParams(local_epochs=2, local_steps=3)
    with pytest.raises(ValueError, match="^--local-epochs"):
        DPFedAvgParams(local_epochs=0)


def test_clipped_local_update_carries_epochs_on_the_wire():
    q = ClippedLocalUpdate(torch.zeros(4, dtype=torch.float64), 1.0, 5, 0.1, 10, 3)
    scalars, tensors = q.wire_fields()
    back = ClippedLocalUpdate.from_wire(scalars, tensors, 4)
    assert (back.local_epochs, back.batch_size, back.local_steps) == (3, 10, 5)
    scalars, tensors = ClippedLocalUpdate(torch.zeros(4, dtype=torch.float64), 1.0).wire_fields()
    assert ClippedLocalUpdate.from_wire(scalars, tensors, 4).local_epochs is None


def test_label_shards_partition():
    labels = np.repeat(np.arange(10), 600)  # 6,000 images, 600 per label
    rng = np.random.default_rng(0)
    rows, users = images.label_shards(labels, 100, 60, rng)
    assert sorted(rows.tolist()) == list(range(6000))  # every image exactly once
    assert np.array_equal(users, np.repeat(np.arange(100), 60))
    per_user_labels = [len(np.unique(labels[rows[users == u]])) for u in range(100)]
    assert max(per_user_labels) <= 2  # shards of 30 inside labels of 600: one label per shard
    assert sum(k == 1 for k in per_user_labels) < 50  # two random shards rarely share a label
    # a user's records are mixed, not its two shards one after the other
    first = rows[users == 0]
    assert labels[first[:30]].tolist() != sorted(labels[first[:30]].tolist()) or len(set(labels[first])) == 1
    with pytest.raises(ValueError, match="even"):
        images._check_partition("shards", 10, 7, 0.5)
    assert images.resolve_per_user("shards", 1000, None) == 60
    assert images.resolve_per_user("iid", 1000, None) == 10


def test_partition_setting_reaches_the_image_loaders_only():
    assert dataset_kwargs({"dataset": "mnist", "users": 1000, "partition": "shards"})["partition"] == "shards"
    assert "partition" not in dataset_kwargs({"dataset": "mnist"})
    with pytest.raises(ValueError, match="--partition applies to mnist, fashion-mnist"):
        dataset_kwargs({"dataset": "movielens", "partition": "shards"})


def test_fedavg_reference_plan_and_one_round():
    plan = fedavg_plan(DPFedAvgParams(rounds=7, local_epochs=2, batch_size=4, sampling_rate=0.5, lr=0.3), seed=3)
    assert plan == {
        "rounds": 7,
        "sampling_rate": 0.5,
        "local_steps": 5,
        "local_epochs": 2,
        "batch_size": 4,
        "local_lr": 0.3,
        "server_lr": 1.0,
        "seed": 3,
    }
    other = fedavg_plan(DPSGDParams(rounds=4, lr=0.2))
    assert (other["rounds"], other["local_steps"], other["local_epochs"], other["local_lr"]) == (4, 1, None, 0.2)
    data = _data()
    p = TorchModel(_net, 5, "multiclass", 3, dtype=torch.float64)
    w0 = p.init_params()
    one = {**plan, "rounds": 1, "sampling_rate": 1.0}
    want = w0 + p.local_epoch_updates(w0, data, 2, 0.3, 4).mean(0)
    torch.testing.assert_close(nonprivate_fedavg(p, data, one, w0), want)


def test_network_reference_is_fedavg_not_lbfgs(monkeypatch):
    from fedkl import results
    from fedkl.federation.inprocess import InProcessFederation

    def no_lbfgs(*a, **k):
        raise AssertionError("L-BFGS on a network")

    monkeypatch.setattr(results, "nonprivate_minimizer", no_lbfgs)
    from fedkl.data.base import FederatedDataset

    tr, te = _data(seed=1), _data(seed=2)
    ds = FederatedDataset("toy", tr, te, "multiclass", 10.0, "toy", num_classes=3)
    p = TorchModel(_net, 5, "multiclass", 3, dtype=torch.float64)
    lines = []
    plan = fedavg_plan(DPFedAvgParams(rounds=3, local_epochs=1, lr=0.2))
    metrics = results.reference_metrics(InProcessFederation(p, ds), {"toy": 1}, lines.append, False, plan)
    assert "accuracy" in metrics
    assert sum("FedAvg round" in s for s in lines) == 3


@pytest.mark.parametrize("algorithm", ["dp-fedavg", "dp-fedadam", "dp-fedyogi"])
def test_server_optimizers_train_a_network_with_local_epochs(tmp_path, algorithm):
    """The FedAvg family on a torch network with local epochs, end to end (in-process), with its FedAvg reference."""
    import fedkl

    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 4)) / 2
    y = (X[:, 0] - X[:, 1] > 0).astype(int)
    data = fedkl.from_arrays(X, y, rng.integers(0, 40, size=240), task="multiclass")
    extra = {"server_eta": 0.1} if algorithm != "dp-fedavg" else {}
    run = fedkl.train(
        data,
        algorithm,
        epsilon=4.0,
        model=_net,
        log=None,
        rounds=3,
        local_epochs=2,
        batch_size=2,
        sampling_rate=0.5,
        accountant="rdp",
        neighbouring="add-remove",
        lr=0.2,
        reference=True,
        out=str(tmp_path / "r"),
        **extra,
    )
    details = run.result["algorithm_details"]
    assert details["local_epochs"] == 2 and "local_steps" not in details
    assert 0 <= run.metrics["accuracy"] <= 1
    assert 0 <= run.result["nonprivate_reference"]["accuracy"] <= 1
