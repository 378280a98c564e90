"""Choose the Geyer 1,000-client settings WITHOUT the test set (docs/how-to/own-model.md).

The 60,000 MNIST training images are the classic pickled split's 50,000 "train" + 10,000 "validation"
images (``fedkl.data.images.raw_mnist``). Here users get label shards of the 50,000 only (1,000 users x
50 images, the same shard rule as ``--partition shards``), and the 10,000 held-out TRAINING images are
dealt to them as their "test" records: the accuracy printed is a validation accuracy; the official test
set is never read. Each candidate is one run at the Geyer cell's privacy (eps 8, delta 1e-5,
add-remove, Poisson q = 0.1, RDP), seed 0; results go to simulations/results/geyer_validation.jsonl.

    nice -n 10 python simulations/geyer_validation.py NAME [NAME ...]   # names: CANDIDATES below
"""

import json
import sys
import time
from pathlib import Path

import fedkl
from fedkl.data import images

BASE = dict(
    epsilon=8.0,
    delta=1e-5,
    neighbouring="add-remove",
    sampling_rate=0.1,
    accountant="rdp",
    rounds=100,
    local_epochs=2,
    batch_size=10,
    lr=0.1,
    clip=1.0,
    server_lr=1.0,
    problem="torch",
)
MLP100, GEYER, CNN = "simulations/nets.py:mlp100", "simulations/nets.py:geyer_mlp", "simulations/nets.py:small_cnn"
CANDIDATES = {
    "base": dict(model=MLP100),  # the README setting before this study
    "slr2": dict(model=MLP100, server_lr=2.0),
    "slr3": dict(model=MLP100, server_lr=3.0),
    "lr0.2": dict(model=MLP100, lr=0.2),
    "lr0.3": dict(model=MLP100, lr=0.3),
    "lr0.5": dict(model=MLP100, lr=0.5),
    "slr2_e5": dict(model=MLP100, server_lr=2.0, local_epochs=5),
    "e5": dict(model=MLP100, local_epochs=5),
    "slr2_clip0.5": dict(model=MLP100, server_lr=2.0, clip=0.5),
    "slr2_geyer": dict(model=GEYER, server_lr=2.0),
    "slr3_lr0.2": dict(model=MLP100, server_lr=3.0, lr=0.2),
    "cnn": dict(model=CNN),  # 6,042 parameters: 13x fewer coordinates to noise than mlp100
    "cnn_slr2": dict(model=CNN, server_lr=2.0),
}


def validation_split():
    """(50,000 train images, labels, 10,000 held-out training images, labels): the official test set unused."""
    Xtr, ytr, _, _ = images.raw_mnist()
    return Xtr[:50_000], ytr[:50_000], Xtr[50_000:], ytr[50_000:]


def main(names: list[str]) -> None:
    data = images._load_images("mnist-val", validation_split, "shards", 1000, 50, 0.5, 0)
    out = Path(__file__).parent / "results" / "geyer_validation.jsonl"
    for name in names:
        cfg = {**BASE, **CANDIDATES[name]}
        t0, c0 = time.time(), time.process_time()
        run = fedkl.train(data, algorithm="dp-fedavg", log=None, **cfg)
        row = dict(
            candidate=name,
            **cfg,
            validation_accuracy=run.result["test_metric"]["value"],
            wall_s=round(time.time() - t0, 1),
            cpu_s=round(time.process_time() - c0, 1),
            seed=0,
        )
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
