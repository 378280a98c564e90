"""Data from a file: a user-partitioned table on one machine, or one site's own records on its node.

Two uses, one set of checks:

* ``fedkl run --dataset records.csv --user-column id --label-column y --task binary`` -- a researcher's
  file with a user column becomes a :class:`FederatedDataset` (:func:`load_file`, through
  :func:`fedkl.data.custom.from_dataframe`);
* a Flower SuperNode started with ``--node-config "partition-id=7 data-path=/srv/site7/records.csv"``
  answers for ONE user from its own file (:func:`load_site`); the server only knows the run's public
  :class:`Schema` and the enrolment list (:func:`sites_dataset`: the shape, no records).

Formats: ``.csv`` (a header row), ``.npz`` (one 1-D array per column, named by the column) and
``.parquet`` (when pyarrow is installed).

The schema is public and declared, never learnt from the data: the feature columns, the label column,
the task, the feature bound ``B`` (``||x||_2 <= B`` for every record) and, for regression, the label
bound. Every file is checked against it and refused with a one-line :class:`DataError` naming the first
problem: a missing column, a non-numeric feature, a NaN or infinite value, a label outside the task's
set, a record beyond a bound. ``on_bound="clip"`` (documented, opt-in) instead clips records beyond a
bound (features onto the ball of radius ``B``, regression labels to ``[-L, L]``) and says how many.
Features are then divided by ``B``, so the problems see ``feature_bound = 1`` (a public, per-record map:
apply the same division when you use the model).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedkl.data.base import FederatedDataset

SUFFIXES = (".csv", ".npz", ".parquet")
ON_BOUND = ("refuse", "clip")
TASKS = ("binary", "multiclass", "regression")
# the flat run settings (``fedkl run`` flags, run-config keys) that make up a schema
SCHEMA_SETTINGS = ("user_column", "label_column", "feature_columns", "task", "feature_bound", "label_bound", "on_bound")


class DataError(ValueError):
    """A data file that does not match its declared schema (a one-line reason)."""


def is_data_file(name: str) -> bool:
    """Whether a dataset name is a path to a data file (by its suffix)."""
    return isinstance(name, str) and name.lower().endswith(SUFFIXES)


@dataclass(frozen=True)
class Schema:
    """The public description of a data file (see the module docstring)."""

    label_column: str
    task: str = "binary"
    feature_columns: tuple[str, ...] | None = None  # None: every other numeric column (one-machine files only)
    feature_bound: float = 1.0
    label_bound: float | None = None
    on_bound: str = "refuse"
    num_classes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.feature_columns, str):
            cols = tuple(c.strip() for c in self.feature_columns.split(",") if c.strip())
            object.__setattr__(self, "feature_columns", cols or None)
        elif self.feature_columns is not None:
            object.__setattr__(self, "feature_columns", tuple(self.feature_columns))
        if self.task not in TASKS:
            raise DataError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not (isinstance(self.feature_bound, (int, float)) and 0 < self.feature_bound < float("inf")):
            raise DataError(f"feature_bound must be finite and > 0, got {self.feature_bound!r}")
        if self.label_bound is not None and not 0 < self.label_bound < float("inf"):
            raise DataError(f"label_bound must be finite and > 0, got {self.label_bound!r}")
        if self.on_bound not in ON_BOUND:
            raise DataError(f"on_bound must be one of {', '.join(ON_BOUND)}, got {self.on_bound!r}")
        if self.label_column in (self.feature_columns or ()):
            raise DataError(f"the label column {self.label_column!r} is also a feature column")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "Schema":
        """From flat settings (``label_column``, ``task``, ...; absent or None keys take the defaults)."""
        if not settings.get("label_column"):
            raise DataError("a data file needs its label column (--label-column)")
        kw = {k: settings.get(k) for k in ("task", "feature_columns", "feature_bound", "label_bound", "on_bound")}
        kw = {k: v for k, v in kw.items() if v is not None}
        unknown = set(settings) - set(SCHEMA_SETTINGS) - {"num_classes"}
        if unknown:
            raise DataError(f"unknown data-file setting(s) {sorted(unknown)}; valid: {', '.join(SCHEMA_SETTINGS)}")
        return cls(label_column=str(settings["label_column"]), num_classes=settings.get("num_classes"), **kw)

    def differences(self, declared: Mapping[str, str]) -> list[str]:
        """What a node's own declaration (node-config keys ``label-column``, ``feature-columns``, ``task``,
        ``feature-bound``) says differently from this schema."""
        out = []
        mine = {
            "label-column": self.label_column,
            "feature-columns": ",".join(self.feature_columns or ()),
            "task": self.task,
            "feature-bound": self.feature_bound,
        }
        for key, value in mine.items():
            if key in declared:
                theirs = declared[key]
                same = float(theirs) == float(value) if key == "feature-bound" else str(theirs) == str(value)
                if not same:
                    out.append(f"{key} {theirs!r} (the run's: {value!r})")
        return out


def loader_kwargs(settings: Mapping[str, Any]) -> dict:
    """The :func:`load_file` keywords set in flat run settings (``fedkl run`` flags, run-config keys)."""
    return {k: settings[k] for k in SCHEMA_SETTINGS if settings.get(k) is not None}


def read_table(path: str) -> Any:
    """A pandas DataFrame from a ``.csv``, ``.npz`` or ``.parquet`` file."""
    import pandas as pd

    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    low = path.lower()
    try:
        if low.endswith(".csv"):
            return pd.read_csv(path)
        if low.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                cols = {k: z[k] for k in z.files}
            bad = [k for k, v in cols.items() if v.ndim != 1]
            if bad:
                raise DataError(f"{path}: array {bad[0]!r} is not 1-D (an .npz holds one 1-D array per column)")
            if len({len(v) for v in cols.values()}) > 1:
                raise DataError(f"{path}: the arrays have different lengths")
            return pd.DataFrame(cols)
        if low.endswith(".parquet"):
            return pd.read_parquet(path)
    except DataError:
        raise
    except ImportError:  # pandas needs an engine for parquet
        raise DataError(
            f"{path}: reading .parquet needs pyarrow (pip install pyarrow), or save the file as .csv"
        ) from None
    except Exception as exc:
        why = " ".join(str(exc).split())[:300]  # one line
        raise DataError(f"{path}: cannot read ({type(exc).__name__}: {why})") from None
    raise DataError(f"{path}: unknown format; use one of {', '.join(SUFFIXES)}")


def check_frame(frame: Any, schema: Schema, source: str, extra_columns: Sequence[str] = ()) -> tuple:
    """``(X, y, notes)``: the feature matrix divided by the feature bound, the labels, and what was clipped
    (``notes``: one line per clip). :class:`DataError` with the first problem otherwise."""
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    features = schema.feature_columns
    if features is None:
        features = tuple(
            c
            for c in frame.columns
            if c not in (schema.label_column, *extra_columns)
            and is_numeric_dtype(frame[c])
            and not is_bool_dtype(frame[c])
        )
        if not features:
            raise DataError(f"{source}: no numeric feature column; name them (--feature-columns)")
    missing = [c for c in (*features, schema.label_column, *extra_columns) if c not in frame.columns]
    if missing:
        raise DataError(f"{source}: missing column(s) {missing} (file has {list(frame.columns)[:10]})")
    if len(frame) == 0:
        raise DataError(f"{source}: no records")
    for c in features:
        if not is_numeric_dtype(frame[c]) or is_bool_dtype(frame[c]):
            raise DataError(f"{source}: feature column {c!r} is not numeric (dtype {frame[c].dtype})")
    X = frame[list(features)].to_numpy(np.float64)
    bad = ~np.isfinite(X)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise DataError(
            f"{source}: {int(bad.any(axis=1).sum())} record(s) have NaN or infinite features "
            f"(first: row {r}, column {features[c]!r})"
        )
    y = frame[schema.label_column].to_numpy()
    notes = []
    B = float(schema.feature_bound)
    norms = np.linalg.norm(X, axis=1)
    over = norms > B
    if over.any():
        if schema.on_bound == "refuse":
            raise DataError(
                f"{source}: {int(over.sum())} record(s) have ||x|| above the declared feature bound {B:g} "
                f"(largest {norms.max():.4g}, row {int(norms.argmax())}); scale the columns or clip (on_bound=clip)"
            )
        X = X * np.minimum(1.0, B / np.where(over, norms, B))[:, None]
        notes.append(f"{int(over.sum())} record(s) clipped to the feature bound {B:g}")
    y = _check_labels(y, schema, source, notes)
    return X / B, y, notes


def unused_columns(frame: Any, taken: Sequence[str]) -> list[str]:
    """The columns of ``frame`` other than ``taken`` that the default feature selection (every other
    numeric, non-boolean column) leaves out: text, dates, booleans ... (named to the user, never dropped
    silently)."""
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    return [c for c in frame.columns if c not in taken and (not is_numeric_dtype(frame[c]) or is_bool_dtype(frame[c]))]


def _check_labels(y: np.ndarray, schema: Schema, source: str, notes: list[str]) -> np.ndarray:
    from pandas.api.types import is_numeric_dtype

    what = f"{source}: label column {schema.label_column!r}"
    if not (is_numeric_dtype(y.dtype) or y.dtype == bool):
        raise DataError(f"{what} is not numeric (dtype {y.dtype})")
    yf = y.astype(np.float64)
    if not np.isfinite(yf).all():
        raise DataError(f"{what}: {int((~np.isfinite(yf)).sum())} NaN or infinite label(s)")
    if schema.task == "binary":
        if not np.isin(yf, (-1.0, 0.0, 1.0)).all():
            raise DataError(f"{what}: binary labels must be -1/+1, 0/1 or booleans")
        return y
    if schema.task == "multiclass":
        k = schema.num_classes
        if (yf != np.round(yf)).any() or yf.min() < 0 or (k is not None and yf.max() >= k):
            raise DataError(f"{what}: multiclass labels must be integers 0..{'k-1' if k is None else k - 1}")
        return yf.astype(np.int64)
    L = schema.label_bound
    if L is not None and (np.abs(yf) > L).any():
        n = int((np.abs(yf) > L).sum())
        if schema.on_bound == "refuse":
            raise DataError(f"{what}: {n} label(s) beyond the declared label bound {L:g}; clip with on_bound=clip")
        notes.append(f"{n} label(s) clipped to [-{L:g}, {L:g}]")
        yf = np.clip(yf, -L, L)
    return yf


def load_file(
    path: str,
    *,
    user_column: str | None = None,
    split_seed: int = 0,
    test_fraction: float = 0.2,
    **schema: Any,
) -> FederatedDataset:
    """A user-partitioned file as a :class:`FederatedDataset` (``fedkl run --dataset FILE``): the
    ``user_column`` names each record's user; ``schema`` holds the :class:`Schema` fields
    (``label_column``, ``task``, ``feature_columns``, ``feature_bound``, ``label_bound``, ``on_bound``)."""
    from fedkl.data.custom import from_arrays

    if not user_column:
        raise DataError(f"{path}: a user-partitioned file needs its user column (--user-column)")
    sch = Schema.from_settings(schema)
    frame = read_table(path)
    X, y, notes = check_frame(frame, sch, path, extra_columns=(user_column,))
    unused = unused_columns(frame, (sch.label_column, user_column)) if sch.feature_columns is None else []
    if unused:  # never dropped silently: said where the run says what it trains on
        notes = [*notes, f"column(s) {', '.join(map(repr, unused))} not used (not numeric; only numeric columns "
                 "are features unless --feature-columns names them)"]  # fmt: skip
    if frame[user_column].isna().any():
        raise DataError(f"{path}: the user column {user_column!r} has missing values")
    ds = from_arrays(
        X,
        y,
        frame[user_column].to_numpy(),
        task=sch.task,
        test_fraction=test_fraction,
        split_seed=split_seed,
        name=os.path.basename(path),
        num_classes=sch.num_classes,
        label_bound=sch.label_bound,
    )
    return _noted(ds, sch, notes)


def load_site(
    path: str, schema: Schema, user_id: str, *, split_seed: int = 0, test_fraction: float = 0.2
) -> FederatedDataset:
    """One site's (one user's) own file, checked against the run's ``schema``: a one-user dataset.
    Any user column in the file is ignored: the whole file belongs to ``user_id``."""
    from fedkl.data.custom import from_arrays

    if schema.feature_columns is None:
        raise DataError("a site's schema must name its feature columns (the server fixes the model's shape)")
    X, y, notes = check_frame(read_table(path), schema, path)
    ds = from_arrays(
        X,
        y,
        np.full(len(y), str(user_id), dtype=object),
        task=schema.task,
        test_fraction=test_fraction,
        split_seed=split_seed,
        name=f"site {user_id}",
        num_classes=schema.num_classes,
        label_bound=schema.label_bound,
    )
    return _noted(ds, schema, notes)


def parse_sites(sites: Sequence[str] | str | None) -> tuple[str, ...]:
    """The enrolment list of a sites deployment: comma-separated ids or a sequence, in partition order."""
    if sites is None:
        return ()
    ids = tuple(s.strip() for s in sites.split(",")) if isinstance(sites, str) else tuple(str(s) for s in sites)
    return tuple(s for s in ids if s)


def sites_dataset(sites: Sequence[str] | str, split_seed: int = 0, **schema: Any) -> FederatedDataset:
    """What the server of a deployment whose sites load their own files knows: the enrolment list
    (``sites``, comma-separated or a sequence, in partition order) and the schema; no records.
    (``split_seed`` is the sites' train/test split seed; nothing to split here.)"""
    import torch

    from fedkl.data.base import UserData

    ids = parse_sites(sites)
    if len(set(ids)) != len(ids):
        raise DataError("the enrolment list (sites) repeats an id")
    if not ids:
        raise DataError("the enrolment list (sites) is empty")
    sch = Schema.from_settings(schema)
    if sch.feature_columns is None:
        raise DataError("a deployment's schema must name its feature columns (feature_columns)")
    if sch.task == "multiclass" and sch.num_classes is None:
        raise DataError("a multiclass deployment's schema must declare num_classes")
    y = torch.zeros(0, dtype=torch.int64 if sch.task == "multiclass" else torch.float64)
    empty = UserData(
        torch.zeros(0, len(sch.feature_columns), dtype=torch.float64), y, torch.zeros(0, dtype=torch.int64), ids
    )
    return FederatedDataset(
        name="sites",
        train=empty,
        test=empty,
        task=sch.task,
        feature_bound=1.0,
        description=f"sites: {len(ids)} users, each loading its own file ({len(sch.feature_columns)} features)",
        num_classes=sch.num_classes or 2,
        extra={"label_bound": sch.label_bound} if sch.label_bound is not None else {},
    )


def _noted(ds: FederatedDataset, schema: Schema, notes: list[str]) -> FederatedDataset:
    import dataclasses

    desc = ds.description + f"; features divided by the declared bound {schema.feature_bound:g}"
    if notes:
        desc += "; " + "; ".join(notes)
    clipped = [n for n in notes if "clipped" in n]
    return dataclasses.replace(ds, description=desc, extra={**ds.extra, "clipped": clipped, "notes": notes})


__all__ = [
    "DataError",
    "Schema",
    "is_data_file",
    "load_file",
    "loader_kwargs",
    "load_site",
    "read_table",
    "sites_dataset",
]
