"""Containers for user-partitioned data.

The user is the unit of privacy in fedkl. A :class:`UserData` holds the records of many users in
flat ("ragged") form: ``X[k]`` and ``y[k]`` are record ``k`` and ``user_index[k]`` says which user
owns it. Per-user reductions are one ``index_add_`` over the flat arrays, so users with very
different record counts (MovieLens: 20 to 2,391 ratings) cost no padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

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
        self._check(finite=True, unique=True)

    @classmethod
    def _checked(
        cls, X: torch.Tensor, y: torch.Tensor, user_index: torch.Tensor, user_ids: tuple[str, ...], *, unique: bool
    ) -> "UserData":
        """A :class:`UserData` whose features the caller KNOWS are finite (rows of a checked one, or a
        matrix the file loader checked column by column), and whose ids are known distinct when
        ``unique``: the cheap checks (shapes, dtype, index range) still run, the full ``isfinite`` pass
        over ``X`` and the set of every user id do not (issue 34: they ran for every cohort and user)."""
        obj = cls.__new__(cls)
        for name, value in (("X", X), ("y", y), ("user_index", user_index), ("user_ids", user_ids)):
            object.__setattr__(obj, name, value)
        obj._check(finite=False, unique=not unique)
        return obj

    def _check(self, *, finite: bool, unique: bool) -> None:
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
        if finite and not torch.isfinite(self.X).all():
            raise ValueError("X contains NaN or infinite values")
        if unique and len(set(self.user_ids)) != len(self.user_ids):
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

    @cached_property
    def _records_by_user(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(order, starts)``: record positions grouped by user (record order kept within a user) and
        each user's offset into them, ``starts[u]:starts[u + 1]``. Built once (O(N log N)) so that
        :meth:`subset` costs O(its records), not a scan of all N records per call."""
        order = torch.argsort(self.user_index, stable=True)
        starts = torch.zeros(self.num_users + 1, dtype=torch.int64)
        starts[1:] = torch.cumsum(self.counts(), 0)
        return order, starts

    def subset(self, users: torch.Tensor | list[int]) -> "UserData":
        """The records of the given users (positions 0..num_users-1), users renumbered in that order.
        Records keep their relative order (the per-user reductions add them in the same order)."""
        users = torch.as_tensor(users, dtype=torch.int64).reshape(-1)
        if len(users) and (int(users.min()) < 0 or int(users.max()) >= self.num_users):
            raise ValueError(f"user positions must be in 0..{self.num_users - 1}")
        order, starts = self._records_by_user
        lo, lens = starts[users], starts[users + 1] - starts[users]
        offsets = torch.cumsum(lens, 0) - lens
        within = torch.arange(int(lens.sum())) - torch.repeat_interleave(offsets, lens)
        rec, perm = order[torch.repeat_interleave(lo, lens) + within].sort()
        # rows of this (checked) data are finite; distinct positions give distinct ids
        distinct = len(users) <= 1 or len(torch.unique(users)) == len(users)
        return UserData._checked(
            self.X[rec],
            self.y[rec],
            torch.repeat_interleave(torch.arange(len(users)), lens)[perm],
            tuple(self.user_ids[int(u)] for u in users),
            unique=distinct,
        )

    def to(self, dtype: torch.dtype) -> "UserData":
        """Same data with features (and float labels) cast to ``dtype``: ``self`` when already of it; no
        second pass over checked data (issue 34) unless the cast narrows, where a finite value may overflow."""
        y = self.y.to(dtype) if self.y.is_floating_point() else self.y
        if self.X.dtype == dtype and y is self.y:
            return self
        X = self.X.to(dtype)
        if torch.finfo(dtype).max < torch.finfo(self.X.dtype).max and not (
            torch.isfinite(X).all() and y.isfinite().all()
        ):
            raise ValueError(f"the data overflows {dtype} (a value beyond {torch.finfo(dtype).max:.3g}): use float64")
        return UserData._checked(X, y, self.user_index, self.user_ids, unique=True)


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
        description: the user unit, counts and the split, for result files and the docs.
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
        for split, data in (("train", self.train), ("test", self.test)):
            check_record_bounds(
                data,
                self.task,
                self.feature_bound,
                self.num_classes,
                self.extra.get("label_bound"),
                f"{self.name} {split}",
            )


# Relative float slack on the feature bound: loaders normalise x / max(1, ||x||), whose float64 norm can
# exceed 1 by a few ulps. The problems' constants are stated for ||x|| <= R; a record at R (1 + 1e-12)
# moves a Lipschitz or smoothness constant by at most that relative amount.
FEATURE_BOUND_SLACK = 1e-12


def check_record_bounds(
    data: UserData, task: str, feature_bound: float, num_classes: int, label_bound: float | None, what: str
) -> None:
    """ValueError unless every record satisfies the bounds the problems' constants rely on.

    The privacy proofs that use a loss's Lipschitz, smoothness or strong-convexity constants
    (paper 002's tests, paper 003's amplification, the certificate) assume every record has
    ``||x|| <= feature_bound``, a valid label (binary: exactly -1 or +1; multiclass: an integer in
    [0, num_classes); regression: finite, and ``|y| <= label_bound`` when the dataset declares one).
    The check runs wherever data enters fedkl: every :class:`FederatedDataset`, hence every loader and
    every ClientApp (which builds its one-user dataset from one), refuses records that break them.
    """
    if not (feature_bound > 0 and math.isfinite(feature_bound)):
        raise ValueError(f"{what}: feature_bound must be finite and > 0, got {feature_bound}")
    if data.num_records:
        norms = torch.linalg.vector_norm(data.X.to(torch.float64), dim=1)
        worst = float(norms.max())
        if not worst <= feature_bound * (1 + FEATURE_BOUND_SLACK):
            k = int(norms.argmax())
            raise ValueError(
                f"{what}: record {k} of user {data.user_ids[int(data.user_index[k])]!r} has ||x|| = "
                f"{worst:.6g} > feature_bound {feature_bound:g}"
            )
    y = data.y
    if task == "binary":
        if not bool(((y == 1) | (y == -1)).all()):
            raise ValueError(f"{what}: binary labels must be exactly -1 or +1")
    elif task == "multiclass":
        if y.dtype != torch.int64 or (data.num_records and not bool(((y >= 0) & (y < num_classes)).all())):
            raise ValueError(f"{what}: multiclass labels must be int64 in [0, {num_classes})")
    else:
        if not bool(torch.isfinite(y).all()):
            raise ValueError(f"{what}: labels contain NaN or inf")
        if label_bound is not None and data.num_records and not float(y.abs().max()) <= float(label_bound):
            raise ValueError(f"{what}: a label exceeds the declared label_bound {label_bound:g}")
