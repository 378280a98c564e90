"""One audited training run: the algorithm exactly as ``fedkl run`` trains it (builder, forecast,
ledger, releaser: :func:`fedkl.runner.train_federation`), on a given dataset with a given noise seed,
returning only the released model (None for ⊥). Every run charges its own throw-away ledger.

Many runs on one dataset share one :class:`AuditFederation`, which remembers the answers to the
local-minimizer queries (the expensive part of the output-perturbation and phased algorithms). That is
sound because those answers are a deterministic function of the dataset and the query (the same
L-BFGS from the same centre on the same records, no randomness): a repeated query, e.g. the first
phase's solve from the public start, gets the bit-identical answer a fresh federation computes, and a
query at a noise-dependent centre simply misses. The noise is drawn afresh in every run
(tests/audit/test_audit_run.py checks the released models are bit-identical with and without it).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

import torch

from fedkl.data.base import FederatedDataset
from fedkl.federation.base import Answers, LocalRegularizedMinimizer, Query
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import NoiseSource
from fedkl.runner import RunConfig, default_delta, run_problem, train_federation

# the throw-away ledgers live in memory where the system offers a RAM disk (their fsyncs are most of a
# small run's time); elsewhere in the default temporary folder
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
# queries whose in-process answer is a deterministic function of (data, query, users) and costly
_REMEMBERED = (LocalRegularizedMinimizer,)  # and its subclass CertifiedLocalMinimizer


class AuditFederation(InProcessFederation):
    """:class:`InProcessFederation` that remembers its local-minimizer answers (module docstring), and
    serves the enrolled users ``absent`` (ids) of an add-remove world (:mod:`fedkl.audit.worlds`): every
    answer of an absent user is a zero row and lists it as failed, in :meth:`compute` and :meth:`sum` alike."""

    def __init__(self, problem, dataset: FederatedDataset, absent: Sequence[str] = ()) -> None:
        super().__init__(problem, dataset)
        self._memo: dict[tuple, Answers] = {}
        ids = dataset.train.user_ids
        unknown = sorted(set(absent) - set(ids))
        if unknown:
            raise ValueError(f"absent users {unknown} are not enrolled in the dataset")
        self.absent = frozenset(ids.index(u) for u in absent)  # positions

    def sum(self, query: Query, users=None) -> Answers:
        # the one-row sums (ghost clipping, fast kernels) would see the absent users' records
        return self.compute(query, users) if self.absent else super().sum(query, users)

    def compute(self, query: Query, users=None) -> Answers:
        got = self._answer(query, users)
        if not self.absent or not self.absent.intersection(got.users):
            return got
        out = torch.tensor([u in self.absent for u in got.users])
        values = got.values.clone()
        values[out] = 0
        failed = set(got.failed) | self.absent
        return Answers(users=list(got.users), values=values, failed=[u for u in got.users if u in failed])

    def _answer(self, query: Query, users=None) -> Answers:
        if not isinstance(query, _REMEMBERED):
            return super().compute(query, users)
        scalars, tensors = query.wire_fields()
        key = (
            type(query),
            tuple(sorted(scalars.items())),
            tuple(
                (k, str(t.dtype), tuple(t.shape), t.detach().cpu().numpy().tobytes())
                for k, t in sorted(tensors.items())
            ),
            None if users is None else tuple(users),
        )
        if key not in self._memo:
            self._memo[key] = super().compute(query, users)
        got = self._memo[key]
        return Answers(users=list(got.users), values=got.values.clone(), failed=list(got.failed))


def audit_config(algorithm: str, epsilon: float, settings: dict | None = None) -> RunConfig:
    """The run configuration of an audit: ``settings`` are ``fedkl run`` settings (hyperparameters,
    ``reg``, ``delta``, ``conversion``, ...). The utility forecast's refusal is overridden (``force``):
    it guards accuracy, not privacy, and the audit needs the release the algorithm would make."""
    settings = dict(settings or {})
    settings.setdefault("force", True)
    return RunConfig.from_settings(algorithm=algorithm, epsilon=epsilon, reference=False, **settings)


def claimed_delta(cfg: RunConfig, dataset: FederatedDataset) -> float:
    return cfg.delta if cfg.delta is not None else default_delta(dataset.train.num_users)


def audit_federation(cfg: RunConfig, dataset: FederatedDataset, absent: Sequence[str] = ()) -> AuditFederation:
    """The federation of ``cfg``'s runs on ``dataset`` with the enrolled users ``absent`` (one per world,
    shared by its runs)."""
    problem, _ = run_problem(cfg, dataset)  # as fedkl run computes
    return AuditFederation(problem, dataset, absent)


def released_model(
    cfg: RunConfig, dataset: FederatedDataset, noise_seed: int, federation: AuditFederation | None = None
) -> torch.Tensor | None:
    """Train ``cfg`` on ``dataset`` with privacy noise seeded by ``noise_seed``; the released model.
    ``federation``: the dataset's shared :func:`audit_federation` (default: a fresh one)."""
    federation = federation or audit_federation(cfg, dataset)
    if federation.dataset is not dataset:
        raise ValueError("the federation serves another dataset")
    with tempfile.TemporaryDirectory(prefix="fedkl-audit-", dir=_SCRATCH) as tmp:
        result, _, _ = train_federation(
            cfg,
            federation,
            federation.problem,
            dataset,
            claimed_delta(cfg, dataset),
            os.path.join(tmp, "ledger.sqlite"),
            f"audit-{noise_seed}",
            NoiseSource(noise_seed),
            lambda _: None,
        )
    return None if result.w is None else torch.as_tensor(result.w).detach().to(torch.float64)
