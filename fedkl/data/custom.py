"""Your own data as a user-partitioned dataset: from arrays or from a pandas DataFrame with a user column.

One user = one unit of privacy: give every record the id of the person, device or site it belongs
to. fedkl then splits each user's records into train and test (a seeded, per-user split, as for the
built-in datasets) and checks every bound the privacy proofs rely on
(:func:`fedkl.data.base.check_record_bounds`).

Decisions, stated once:

* **Features** are projected onto the unit ball, ``x / max(1, ||x||)`` (``feature_bound = 1``): a
  public per-record map that the problems' Lipschitz and smoothness constants are stated under.
  Scale your columns first (e.g. divide by a public maximum) so the projection rarely bites; a
  projection never uses another record, so it is a function of the record alone.
* **Labels**: ``binary`` accepts {-1, +1}, {0, 1} or booleans (0/False become -1); ``multiclass``
  needs integers 0..k-1; ``regression`` needs finite floats, and ``label_bound`` (public) is
  required where a problem's constants use it (least squares): records beyond it are refused, not
  clipped, so nothing is silently changed.
* **User ids** are the string of each distinct value, in sorted order: stable across runs on the
  same data, which the per-user ledger needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedkl.data.base import FederatedDataset
from fedkl.data.real import make_federated, project_rows, split_by_user

TASKS = ("binary", "multiclass", "regression")


def from_arrays(
    X: Any,
    y: Any,
    users: Sequence[Any] | np.ndarray,
    *,
    task: str = "binary",
    test_fraction: float = 0.2,
    split_seed: int = 0,
    name: str = "custom",
    num_classes: int | None = None,
    label_bound: float | None = None,
) -> FederatedDataset:
    """A :class:`FederatedDataset` from flat arrays: ``X`` (records x features), ``y`` (labels) and
    ``users`` (the owner of every record). See the module docstring for the rules."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y)
    users = np.asarray(users)
    if X.ndim != 2 or X.shape[0] == 0:
        raise ValueError(f"X must be a non-empty 2-D array (records x features), got shape {X.shape}")
    if y.shape != (X.shape[0],) or users.shape != (X.shape[0],):
        raise ValueError(f"y and users must have one entry per record ({X.shape[0]}), got {y.shape} and {users.shape}")
    if not np.isfinite(X).all():
        raise ValueError("X contains NaN or infinite values")
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    user_ids, user_index = user_keys(users)
    y, kw = labels(y, task, num_classes, label_bound)
    test = split_by_user(user_index, len(user_ids), test_fraction, np.random.default_rng(split_seed))
    desc = describe(name, len(user_ids), X.shape, test_fraction, split_seed)
    return make_federated(name, project_rows(X), y, user_index, user_ids, test, task, desc, **kw)


def user_keys(users: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
    """``(user_ids, user_index)``: the distinct users as strings in sorted string order, and each
    record's position among them (int64). Integer ids are made distinct as integers and turned into
    strings once per user (not once per record), then put in the same string order."""
    users = np.asarray(users)
    if users.dtype.kind in "iu":
        values, inverse = np.unique(users, return_inverse=True)
        names = np.array([str(v) for v in values.tolist()])
        order = np.argsort(names, kind="stable")
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        return tuple(names[order].tolist()), rank[inverse.reshape(-1)]
    keys = users if users.dtype.kind == "U" else np.array([str(u) for u in users])
    names, inverse = np.unique(keys, return_inverse=True)
    return tuple(names.tolist()), inverse.reshape(-1).astype(np.int64)


def labels(y: np.ndarray, task: str, num_classes: int | None, label_bound: float | None) -> tuple[np.ndarray, dict]:
    """The labels as the task stores them (binary: -1/+1 floats; multiclass: int64; regression: float64)
    and the dataset keywords they set."""
    kw: dict[str, Any] = {"feature_bound": 1.0, "extra": {}}
    if task == "binary":
        values = set(np.unique(y).tolist())
        if not values <= {-1, 1, 0, True, False}:
            raise ValueError(f"binary labels must be -1/+1, 0/1 or booleans, got values {sorted(map(str, values))[:5]}")
        y = np.where(y.astype(np.float64) > 0, 1.0, -1.0)
    elif task == "multiclass":
        if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
            raise ValueError("multiclass labels must be integers 0..k-1")
        kw["num_classes"] = int(num_classes if num_classes is not None else y.max() + 1)
        y = y.astype(np.int64)
    else:
        y = y.astype(np.float64)
        if label_bound is not None:
            kw["extra"]["label_bound"] = float(label_bound)
    return y, kw


def describe(name: str, n_users: int, shape: tuple[int, int], test_fraction: float, split_seed: int) -> str:
    return (
        f"{name}: {n_users} users, {shape[0]} records, {shape[1]} features (projected onto the unit "
        f"ball); split within each user, test_fraction={test_fraction:g}, split_seed={split_seed}"
    )


def from_dataframe(
    frame: Any, *, user: str, label: str, features: Sequence[str] | None = None, **kw: Any
) -> FederatedDataset:
    """:func:`from_arrays` on a pandas DataFrame: ``user`` and ``label`` name columns; ``features``
    (default: every other numeric column) become X. Other keywords go to :func:`from_arrays`."""
    for col in (user, label, *(features or ())):
        if col not in frame.columns:
            raise ValueError(f"column {col!r} is not in the DataFrame (columns: {list(frame.columns)[:10]})")
    if features is None:
        from pandas.api.types import is_bool_dtype, is_numeric_dtype

        features = [
            c
            for c in frame.columns
            if c not in (user, label) and is_numeric_dtype(frame[c]) and not is_bool_dtype(frame[c])
        ]
        if not features:
            raise ValueError("no numeric feature column: name them with features=[...]")
        unused = [c for c in frame.columns if c not in (user, label, *features)]
        if unused:  # never dropped silently
            import warnings

            warnings.warn(
                f"from_dataframe: column(s) {', '.join(map(repr, unused))} not used (not numeric; only numeric "
                "columns are features unless features=[...] names them)",
                stacklevel=2,
            )
    if frame[list(features)].isna().to_numpy().any() or frame[label].isna().any():
        raise ValueError("the DataFrame has missing values in the feature or label columns: drop or impute them first")
    return from_arrays(
        frame[list(features)].to_numpy(np.float64), frame[label].to_numpy(), frame[user].to_numpy(), **kw
    )


__all__ = ["from_arrays", "from_dataframe"]
