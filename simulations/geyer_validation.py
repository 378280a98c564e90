"""Choose the Geyer-table settings per population WITHOUT the test set (docs/how-to/own-model.md).

The first 50,000 of the official training images are dealt to users as label shards (the same shard rule as
``--partition shards``) and the last 10,000 TRAINING images are dealt to the same users as their "test"
records: the accuracy printed is a validation accuracy; the official test set is never read. (For MNIST the
split is the classic pickled split's 50,000 "train" + 10,000 "validation" images, ``fedkl.data.images.raw_mnist``.)
Users per population: 100 x 500, 1,000 x 50, 10,000 x 4 images (shards need an even count: 10,000 x 5 is not
one; the test cell has 6). Each candidate is one run at its cell's privacy (eps 8, the cell's delta,
add-remove, Poisson cohorts, RDP), seed 0; rows are appended to simulations/results/geyer_validation.jsonl,
and ``simulations/geyer_table.py`` runs, for each population, the candidate with the best validation accuracy.

    nice -n 10 python simulations/geyer_validation.py [--users N] [--dataset mnist|fashion-mnist] NAME [NAME ...]
"""

import argparse
import json
import time
from pathlib import Path

import fedkl
from fedkl.data import images

JSONL = Path(__file__).parent / "results" / "geyer_validation.jsonl"
DELTA = {100: 1e-3, 1000: 1e-5, 10_000: 1e-6}  # Geyer et al.'s delta per population
PER_USER = {100: 500, 1000: 50, 10_000: 4}  # shards of the 50,000 validation-train images
RAW = {"mnist": images.raw_mnist, "fashion-mnist": images.raw_fashion_mnist}

BASE = dict(
    epsilon=8.0,
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
LINEAR, MLP50 = "simulations/nets.py:linear", "simulations/nets.py:mlp50"
# candidates per population (users); the 1,000-user names are those of the first study (rows without "users")
CANDIDATES = {
    1000: {
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
        # second round (issue 30 table study): around lr 0.2
        "lr0.2_e5": dict(model=MLP100, lr=0.2, local_epochs=5),
        "lr0.2_q0.2": dict(model=MLP100, lr=0.2, sampling_rate=0.2),
        "lr0.2_q0.2_r50": dict(model=MLP100, lr=0.2, sampling_rate=0.2, rounds=50),
        "mlp50_lr0.2": dict(model=MLP50, lr=0.2),
        # third round (the levers the table's notes left untried): clip, server momentum, adaptive clipping
        "lr0.2_clip0.5": dict(model=MLP100, lr=0.2, clip=0.5),
        "lr0.2_mom0.5": dict(model=MLP100, lr=0.2, server_momentum=0.5),
        "lr0.2_adaclip": dict(model=MLP100, lr=0.2, adaptive_clip=True),
    },
    # 100 users: few users, so few rounds over (nearly) everyone and a network with few coordinates to noise
    100: {
        "mlp_q1_r5": dict(model=MLP100, lr=0.2, sampling_rate=1.0, rounds=5),
        "mlp_q1_r10": dict(model=MLP100, lr=0.2, sampling_rate=1.0, rounds=10),
        "cnn_q1_r5": dict(model=CNN, lr=0.2, sampling_rate=1.0, rounds=5),
        "cnn_q1_r10": dict(model=CNN, lr=0.2, sampling_rate=1.0, rounds=10),
        "cnn_q0.5_r10": dict(model=CNN, lr=0.2, sampling_rate=0.5, rounds=10),
        "mlp_q1_r3": dict(model=MLP100, lr=0.2, sampling_rate=1.0, rounds=3),
        "linear_q1_r5": dict(model=LINEAR, lr=0.2, sampling_rate=1.0, rounds=5),
        "linear_q1_r10": dict(model=LINEAR, lr=0.2, sampling_rate=1.0, rounds=10),
        "linear_q1_r20": dict(model=LINEAR, lr=0.2, sampling_rate=1.0, rounds=20),
        "mlp50_q1_r10": dict(model=MLP50, lr=0.2, sampling_rate=1.0, rounds=10),
    },
    # 10,000 users of 6 images: little noise per round; optimisation (rounds x local steps) is the limit
    10_000: {
        "q0.03_r100": dict(model=MLP100, lr=0.2, sampling_rate=0.03, rounds=100),
        "q0.03_r100_e5": dict(model=MLP100, lr=0.2, sampling_rate=0.03, rounds=100, local_epochs=5),
        "q0.03_r250": dict(model=MLP100, lr=0.2, sampling_rate=0.03, rounds=250),
        "q0.03_r100_slr3": dict(model=MLP100, lr=0.2, sampling_rate=0.03, rounds=100, server_lr=3.0),
    },
}


def validation_split(dataset: str):
    """(50,000 train images, labels, 10,000 held-out training images, labels): the official test set unused."""
    Xtr, ytr, _, _ = RAW[dataset]()
    return Xtr[:50_000], ytr[:50_000], Xtr[50_000:], ytr[50_000:]


def config(users: int, name: str) -> dict:
    """The full run settings of candidate ``name`` for a population of ``users``."""
    return {**BASE, "delta": DELTA[users], **CANDIDATES[users][name]}


def rows() -> list[dict]:
    """Every validation row, each with its population (rows of the first study: mnist, 1,000 users)."""
    out = []
    for line in JSONL.read_text().splitlines():
        r = json.loads(line)
        out.append({"dataset": "mnist", "users": 1000, **r})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=1000, choices=sorted(CANDIDATES))
    ap.add_argument("--dataset", default="mnist", choices=sorted(RAW))
    ap.add_argument("names", nargs="+")
    a = ap.parse_args(argv)
    unknown = [n for n in a.names if n not in CANDIDATES[a.users]]
    if unknown:
        raise SystemExit(f"unknown candidate(s) {unknown} for {a.users} users: {sorted(CANDIDATES[a.users])}")
    data = images._load_images(
        f"{a.dataset}-val", lambda: validation_split(a.dataset), "shards", a.users, PER_USER[a.users], 0.5, 0
    )
    for name in a.names:
        cfg = config(a.users, name)
        t0, c0 = time.time(), time.process_time()
        run = fedkl.train(data, algorithm="dp-fedavg", log=None, **cfg)
        row = dict(
            candidate=name,
            dataset=a.dataset,
            users=a.users,
            **cfg,
            validation_accuracy=run.result["test_metric"]["value"],
            wall_s=round(time.time() - t0, 1),
            cpu_s=round(time.process_time() - c0, 1),
            seed=0,
        )
        print(json.dumps(row), flush=True)
        with JSONL.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
