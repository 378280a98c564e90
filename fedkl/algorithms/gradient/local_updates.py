"""The clipped local-update query's settings, shared by DP-FedAvg (and its server optimizers), DP-FTRL and the
non-private FedAvg reference of a network (:mod:`fedkl.algorithms.nonprivate`): a module of its own, so that a
run that imports none of those algorithms (noisy-gd) does not import them for this mixin (issue 34)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedkl.algorithms.contract import AlgorithmParams, param
from fedkl.federation.base import ClippedLocalUpdate


def _flag_error(err: ValueError) -> ValueError:
    """A setting's one-line error with the setting named as its flag (``local_steps`` -> ``--local-steps``)."""
    name, rest = str(err).split(" ", 1)
    return ValueError(f"--{name.replace('_', '-')} {rest}")


LOCAL_STEPS_DEFAULT = 5


@dataclass(frozen=True)
class LocalUpdates(AlgorithmParams):
    """The clipped local-update query's settings (DP-FedAvg and DP-FTRL ask the same query)."""

    local_steps: int = param(
        LOCAL_STEPS_DEFAULT,
        "dp-fedavg, dp-ftrl: local SGD steps K per asked user (K = 1 with local lr 1 is DP-FedSGD)",
        "heuristic",
    )
    local_lr: float | None = param(None, "dp-fedavg, dp-ftrl: local step size (default --lr)", "heuristic")
    batch_size: int | None = param(
        None,
        "dp-fedavg, dp-ftrl: records per local step (--local-steps: cyclic mini-batches; --local-epochs: "
        "mini-batches of each pass) (default all records)",
        "heuristic",
    )
    local_epochs: int | None = param(
        None,
        "dp-fedavg, dp-ftrl: local epochs E per asked user: E passes over its records in mini-batches of "
        "--batch-size, one step each (replaces --local-steps; default: --local-steps)",
        "heuristic",
    )
    server_lr: float = param(1.0, "dp-fedavg, dp-ftrl: server step size on the noisy mean delta", "heuristic")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.server_lr > 0 and math.isfinite(self.server_lr)):
            raise ValueError(f"--server-lr must be finite and > 0, got {self.server_lr}")
        # one rule: --local-epochs, when given, sets the local work; --local-steps must then stay at its default
        if self.local_epochs is not None and self.local_steps != LOCAL_STEPS_DEFAULT:
            raise ValueError(
                f"give --local-steps ({self.local_steps}) or --local-epochs ({self.local_epochs}), not both: "
                "--local-epochs replaces the step count"
            )
        try:  # the query checks the local settings with the same rules the clients apply
            self.query(torch.zeros(1), 1.0, self.local_update_lr(1.0))
        except ValueError as e:
            raise _flag_error(e) from None

    def query(self, w: torch.Tensor, clip: float, local_lr: float) -> ClippedLocalUpdate:
        """The round's clipped local-update query at model ``w`` with clip ``clip``."""
        return ClippedLocalUpdate(w, clip, self.local_steps, local_lr, self.batch_size, self.local_epochs)

    def local_details(self) -> dict:
        """How each asked user trains, for the result's details."""
        work = {"local_steps": self.local_steps} if self.local_epochs is None else {"local_epochs": self.local_epochs}
        return {**work, "batch_size": self.batch_size}

    def local_update_lr(self, lr: float | None) -> float:
        """The local step size: ``--local-lr``, else the run's ``lr`` (resolved by the algorithm)."""
        return lr if self.local_lr is None else self.local_lr
