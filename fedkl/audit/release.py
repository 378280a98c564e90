"""One audited training run: the algorithm exactly as ``fedkl run`` trains it (builder, forecast,
ledger, releaser: :func:`fedkl.runner.train_federation`), on a given dataset with a given noise seed,
returning only the released model (None for ⊥). Every run charges its own throw-away ledger."""

from __future__ import annotations

import os
import tempfile

import torch

from fedkl.data.base import FederatedDataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import NoiseSource
from fedkl.problems import DEFAULT_PROBLEM, make_problem
from fedkl.runner import RunConfig, default_delta, train_federation

# the throw-away ledgers live in memory where the system offers a RAM disk (their fsyncs are most of a
# small run's time); elsewhere in the default temporary folder
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def audit_config(algorithm: str, epsilon: float, settings: dict | None = None) -> RunConfig:
    """The run configuration of an audit: ``settings`` are ``fedkl run`` settings (hyperparameters,
    ``reg``, ``delta``, ``conversion``, ...). The utility forecast's refusal is overridden (``force``):
    it guards accuracy, not privacy, and the audit needs the release the algorithm would make."""
    settings = dict(settings or {})
    settings.setdefault("force", True)
    return RunConfig.from_settings(algorithm=algorithm, epsilon=epsilon, reference=False, **settings)


def claimed_delta(cfg: RunConfig, dataset: FederatedDataset) -> float:
    return cfg.delta if cfg.delta is not None else default_delta(dataset.train.num_users)


def released_model(cfg: RunConfig, dataset: FederatedDataset, noise_seed: int) -> torch.Tensor | None:
    """Train ``cfg`` on ``dataset`` with privacy noise seeded by ``noise_seed``; the released model."""
    problem = make_problem(cfg.problem or DEFAULT_PROBLEM[dataset.task], dataset, reg=cfg.reg)
    federation = InProcessFederation(problem, dataset)
    with tempfile.TemporaryDirectory(prefix="fedkl-audit-", dir=_SCRATCH) as tmp:
        result, _, _ = train_federation(
            cfg,
            federation,
            problem,
            dataset,
            claimed_delta(cfg, dataset),
            os.path.join(tmp, "ledger.sqlite"),
            f"audit-{noise_seed}",
            NoiseSource(noise_seed),
            lambda _: None,
        )
    return None if result.w is None else torch.as_tensor(result.w).detach().to(torch.float64)
