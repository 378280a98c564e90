"""DP-FedAdam and DP-FedYogi: DP-FedAvg with an adaptive server optimizer (Reddi, Charles, Zaheer,
Garrett, Rush, Konečný, Kumar, McMahan 2021, "Adaptive Federated Optimization", Algorithm 2).

Round t: exactly DP-FedAvg's round (:mod:`fedkl.algorithms.gradient.dp_fedavg`: Poisson-sampled users,
clipped local updates, one release of their noisy sum over the public q n) up to the released noisy mean
update Delta_t; then the server treats -Delta_t as a pseudo-gradient:

    m_t = beta1 m_(t-1) + (1 - beta1) Delta_t
    v_t = beta2 v_(t-1) + (1 - beta2) Delta_t^2                        (dp-fedadam)
    v_t = v_(t-1) - (1 - beta2) Delta_t^2 sign(v_(t-1) - Delta_t^2)    (dp-fedyogi)
    w_(t+1) = w_t + eta m_t / (sqrt(v_t) + tau)                        (coordinate-wise)

from m_(-1) = 0 and v_(-1) = tau^2 (the paper's initialisation: v_(-1) >= tau^2; no bias correction,
as in the paper). Yogi's v stays > 0: where v > Delta^2 it drops by less than Delta^2 < v, elsewhere it grows.

Privacy: everything after the release of the noisy sum is a function of released values and public
settings only (post-processing), so the guarantee, the neighbouring relations, the calibration and
accounting of the (eps, delta) schedule, the up-front charge to every enrolled user, the absence rule
and what clients see are DP-FedAvg's, word for word: the classes below subclass
:class:`~fedkl.algorithms.gradient.dp_fedavg.DPFedAvg` and override only its server step. (Adaptive
clipping, ``--adaptive-clip``, composes unchanged: its clip is a function of earlier releases.)

Settings: the server optimizer's hyperparameters are ``--server-eta``, ``--server-beta1``,
``--server-beta2`` and ``--server-tau``; beta1 = 0.9, beta2 = 0.99 and tau = 1e-3 are the paper's
recommended values, eta = 0.01 the low end of its tuned server learning rates (the paper tunes eta per
task: tune it). DP-FedAvg's own server step (``--server-lr``, ``--server-momentum``) is refused away from
its defaults here rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedkl.algorithms.contract import SmallAudit, param
from fedkl.algorithms.gradient.dp_fedavg import DPFedAvg, DPFedAvgParams
from fedkl.algorithms.registry import register


@dataclass(frozen=True)
class DPFedOptParams(DPFedAvgParams):
    """DP-FedAvg's settings plus the adaptive server optimizer's (module docstring)."""

    server_eta: float = param(
        0.01, "dp-fedadam, dp-fedyogi: server learning rate eta of the adaptive step", "heuristic", positive=True
    )
    server_beta1: float = param(0.9, "dp-fedadam, dp-fedyogi: server first-moment decay beta1", "heuristic")
    server_beta2: float = param(0.99, "dp-fedadam, dp-fedyogi: server second-moment decay beta2", "heuristic")
    server_tau: float = param(
        1e-3, "dp-fedadam, dp-fedyogi: adaptivity tau (the step's denominator offset)", "heuristic", positive=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("server_beta1", "server_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.server_lr != 1.0 or self.server_momentum != 0.0:
            raise ValueError(
                "--server-lr and --server-momentum set dp-fedavg's server step; the adaptive server step takes "
                "--server-eta, --server-beta1, --server-beta2 and --server-tau"
            )


@register
class DPFedAdam(DPFedAvg):
    """DP-FedAdam (Reddi et al. 2021): DP-FedAvg's releases, an Adam server step on the noisy mean update."""

    name = "dp-fedadam"
    Params = DPFedOptParams
    small = {**DPFedAvg.small, "server_eta": 0.1}
    audit = SmallAudit()

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        """v_t from v_(t-1) and Delta_t^2 (Adam)."""
        beta2 = self.params.server_beta2
        return beta2 * v + (1 - beta2) * square

    def server_state(self, w: torch.Tensor) -> dict:
        return {"m": torch.zeros_like(w), "v": torch.full_like(w, self.params.server_tau**2)}

    def server_step(self, w: torch.Tensor, delta_t: torch.Tensor, state: dict) -> torch.Tensor:
        p = self.params
        state["m"] = p.server_beta1 * state["m"] + (1 - p.server_beta1) * delta_t
        state["v"] = self.second_moment(state["v"], delta_t * delta_t)
        return w + p.server_eta * state["m"] / (torch.sqrt(state["v"]) + p.server_tau)

    def server_details(self) -> dict:
        p = self.params
        return {
            "server_optimizer": self.name.removeprefix("dp-fed"),
            "server_eta": p.server_eta,
            "server_beta1": p.server_beta1,
            "server_beta2": p.server_beta2,
            "server_tau": p.server_tau,
        }


@register
class DPFedYogi(DPFedAdam):
    """DP-FedYogi (Reddi et al. 2021): DP-FedAvg's releases, a Yogi server step on the noisy mean update."""

    name = "dp-fedyogi"
    small = {**DPFedAvg.small, "server_eta": 0.1}
    audit = SmallAudit()

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        """v_t from v_(t-1) and Delta_t^2 (Yogi: additive, at most (1 - beta2) Delta_t^2 per round)."""
        return v - (1 - self.params.server_beta2) * square * torch.sign(v - square)


__all__ = ["DPFedAdam", "DPFedOptParams", "DPFedYogi"]
