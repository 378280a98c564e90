"""A minimal existing Flower app (Message API: a ClientApp that trains, a ServerApp running FedAvg) given
fedkl's user-level DP by two changes: the strategy is wrapped in
:class:`fedkl.flower.dropin.UserLevelDPStrategy`, and the ClientApp declares its node's user
(:func:`fedkl.flower.dropin.declare_user`; the ledger never keys on Flower's node ids, which the simulation
engine draws anew each run).

Each node is one user holding a few (x, y) records of a linear model; it trains locally and replies
with its model. Run it on Flower's simulation engine::

    python simulations/flower_dropin_app.py --nodes 6 --rounds 3 --epsilon 2 --ledger /tmp/dropin.sqlite

Then ``fedkl ledger users /tmp/dropin.sqlite`` lists each user's charges (``user-0``, ...). A second run on
the same ledger is the same users again, whatever node ids Flower draws: with the same budget it is refused,
their budget being spent (``tests/flower/test_dropin.py`` runs the app and checks the ledger and the noise).
"""

from __future__ import annotations

import argparse
import os

for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"), ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_k, _v)

import numpy as np  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedkl.flower.dropin import declare_user  # noqa: E402

DIM = 5
client_app = ClientApp()


def user_id(context: Context) -> str:
    """The node's user. In a deployment: the node config's ``user-id`` (``flower-supernode --node-config
    'user-id="alice"'``, ``declare_user``'s default); the simulation engine gives a node only its partition,
    so here the user is the owner of partition p."""
    return f"user-{context.node_config['partition-id']}"


declare_user(client_app, user_id)


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Five local gradient steps of least squares on this node's own records."""
    w = local_model(msg.content["arrays"]["w"].numpy(), int(context.node_config["partition-id"]))
    reply = RecordDict({"arrays": ArrayRecord({"w": Array(w)}), "metrics": MetricRecord({"num-examples": 20})})
    return Message(reply, reply_to=msg)


def local_model(w: np.ndarray, partition: int) -> np.ndarray:
    """The model after five local gradient steps of least squares from ``w`` on partition ``partition``'s 20 records."""
    rng = np.random.default_rng(partition)
    x = rng.standard_normal((20, DIM))
    y = x @ np.arange(1.0, DIM + 1) + 0.1 * rng.standard_normal(20)
    w = np.array(w, dtype=np.float64)
    for _ in range(5):
        w -= 0.1 * x.T @ (x @ w - y) / len(y)
    return w


def make_server_app(*, ledger: str, epsilon: float, delta: float, clip: float, rounds: int, noise_seed=None, out=None):
    """The app's ServerApp: FedAvg over every node, wrapped in fedkl's user-level DP. ``out`` (a dict)
    receives the strategy and the final model, for tests."""
    from fedkl.flower.dropin import UserLevelDPStrategy

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        with UserLevelDPStrategy(  # ends the run in the ledger (finished, refused, failed) on exit
            FedAvg(fraction_train=1.0, fraction_evaluate=0.0),  # the app's own strategy, unchanged
            ledger_path=ledger,
            epsilon=epsilon,
            delta=delta,
            clip=clip,
            rounds=rounds,
            noise_seed=noise_seed,
        ) as strategy:
            result = strategy.start(
                grid, ArrayRecord({"w": Array(np.zeros(DIM))}), num_rounds=rounds, train_config=ConfigRecord()
            )
        if out is not None:
            out.update(strategy=strategy, w=result.arrays["w"].numpy(), nodes=sorted(grid.get_node_ids()))

    return app


def run(nodes: int, rounds: int, epsilon: float, ledger: str, clip: float = 1.0, noise_seed=None) -> dict:
    from flwr.simulation import run_simulation

    out: dict = {}
    run_simulation(
        server_app=make_server_app(
            ledger=ledger,
            epsilon=epsilon,
            delta=1.0 / nodes**1.1,
            clip=clip,
            rounds=rounds,
            noise_seed=noise_seed,
            out=out,
        ),
        client_app=client_app,
        num_supernodes=nodes,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"include_dashboard": False},
        },
    )
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--ledger", default="dropin-ledger.sqlite")
    a = ap.parse_args()
    res = run(a.nodes, a.rounds, a.epsilon, a.ledger, a.clip)
    print("released model:", np.round(res["w"], 3))
