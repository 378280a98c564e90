"""Containers for user-partitioned data.

The user is the unit of privacy in fedkl. A :class:`UserData` holds the records of many users in
flat ("ragged") form: ``X[k]`` and ``y[k]`` are record ``k`` and ``user_index[k]`` says which user
owns it. Per-user reductions are one ``index_add_`` over the flat arrays, so users with very
different record counts (MovieLens: 20 to 2,391 ratings) cost no padding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class UserData:
    """Records of ``num_users`` users, stored flat.

    Attributes:
        X: ``(N, d)`` float features of all records.
        y: ``(N,)`` labels (float for regression / ±1 binary tasks, int64 for multiclass).
        user_index: ``(N,)`` int64, the user (0..num_users-1) that owns each record.
        user_ids: external identifiers of the users, ``len == num_users``. Ledger charges are
            keyed by these, so they must be stable across runs on the same data.
    """

    X: torch.Tensor
    y: torch.Tensor
    user_index: torch.Tensor
    user_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.X.dim() != 2:
            raise ValueError(f"X must be 2-D (records x features), got shape {tuple(self.X.shape)}")
        n_rec = self.X.shape[0]
        if self.y.shape[0] != n_rec or self.user_index.shape[0] != n_rec:
            raise ValueError(
                f"X, y and user_index must have the same number of records: "
                f"{n_rec}, {self.y.shape[0]}, {self.user_index.shape[0]}"
            )
        if self.user_index.dtype != torch.int64:
            raise ValueError("user_index must be int64")
        if n_rec and (int(self.user_index.min()) < 0 or int(self.user_index.max()) >= len(self.user_ids)):
            raise ValueError("user_index out of range of user_ids")
        if not torch.isfinite(self.X).all():
            raise ValueError("X contains NaN or infinite values")
        if len(set(self.user_ids)) != len(self.user_ids):
            raise ValueError("user_ids must be unique")

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_records(self) -> int:
        return int(self.X.shape[0])

    @property
    def dim(self) -> int:
        return int(self.X.shape[1])

    def counts(self) -> torch.Tensor:
        """Records per user, ``(num_users,)`` int64."""
        return torch.bincount(self.user_index, minlength=self.num_users)

    def subset(self, users: torch.Tensor | list[int]) -> "UserData":
        """The records of the given users (positions 0..num_users-1), users renumbered in that order."""
        users = torch.as_tensor(users, dtype=torch.int64)
        remap = torch.full((self.num_users,), -1, dtype=torch.int64)
        remap[users] = torch.arange(len(users))
        keep = remap[self.user_index] >= 0
        return UserData(
            X=self.X[keep],
            y=self.y[keep],
            user_index=remap[self.user_index[keep]],
            user_ids=tuple(self.user_ids[int(u)] for u in users),
        )

    def to(self, dtype: torch.dtype) -> "UserData":
        """Same data with features (and float labels) cast to ``dtype``."""
        y = self.y.to(dtype) if self.y.is_floating_point() else self.y
        return UserData(self.X.to(dtype), y, self.user_index, self.user_ids)


@dataclass(frozen=True)
class FederatedDataset:
    """A train/test pair split *within* each user, plus what describes the task.

    Attributes:
        name: dataset name as used on the command line.
        train, test: the per-user split; both have the same ``user_ids`` in the same order.
        task: ``"binary"`` (labels in {-1, +1}), ``"multiclass"`` (int64 labels 0..k-1) or
            ``"regression"``.
        num_classes: for multiclass tasks.
        feature_bound: an upper bound R on ``||x||_2`` over all records (enforced by the loader),
            which the problems' Lipschitz constants are stated under.
        description: the user unit, counts and the split, for result files and the README.
        optimum: for synthetic data, the known population optimum (else None).
    """

    name: str
    train: UserData
    test: UserData
    task: str
    feature_bound: float
    description: str
    num_classes: int = 2
    optimum: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.train.user_ids != self.test.user_ids:
            raise ValueError("train and test must list the same users in the same order")
        if self.task not in ("binary", "multiclass", "regression"):
            raise ValueError(f"unknown task {self.task!r}")
