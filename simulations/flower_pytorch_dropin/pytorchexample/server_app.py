"""pytorchexample: the ServerApp of Flower's PyTorch quickstart; fedkl's diff is the two lines marked ``# fedkl``
(FedAvg wrapped: every user's update clipped, the sum noised and charged in the ledger; the run ends in the
ledger and the privacy line is logged when ``start`` returns)."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedkl.flower.dropin import UserLevelDPStrategy  # fedkl
from pytorchexample.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedAvg for the configured rounds and save the final model."""
    fraction_train = context.run_config["fraction-train"]
    num_rounds = context.run_config["num-server-rounds"]
    lr = context.run_config["lr"]

    arrays = ArrayRecord(Net().state_dict())
    strategy = FedAvg(fraction_train=fraction_train)
    strategy = UserLevelDPStrategy(strategy, ledger_path="ledger.sqlite", epsilon=2.0, delta=1e-5, clip=1.0, rounds=num_rounds)  # fedkl  # fmt: skip
    result = strategy.start(
        grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"lr": lr}), num_rounds=num_rounds
    )

    print("\nSaving final model to disk...")
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
