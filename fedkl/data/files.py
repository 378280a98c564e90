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

An ``.npz`` is read without pandas, one column at a time, straight into each split's matrix: one
copy of the data (issue 34).
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


# the flat run settings that say how a run's data is loaded (dataset_kwargs)
DATA_SETTINGS = ("dataset", "seed", "users", "partition", "sites", *SCHEMA_SETTINGS)
PARTITIONED = ("mnist", "fashion-mnist")  # the datasets whose synthetic users come in partitions (fedkl.data.images)


def dataset_kwargs(settings: Mapping[str, Any]) -> dict:
    """The :func:`fedkl.data.load_dataset` keywords of flat run settings (``dataset``, ``seed``, ``users``,
    ``partition``, ``sites`` and the schema settings; absent ones are None): the one rule ``fedkl run``, a Flower ServerApp
    and its ClientApps load a run's data by (here, below both: a ClientApp never imports the runner). A data file and the schema of a ``sites`` deployment (whose
    nodes load their own files) are split by ``seed`` and read with the schema settings; MovieLens and
    TV16 have fixed users split by ``seed``; a synthetic set is drawn with ``seed`` and ``users``.
    ValueError (one line) for a setting that does not apply to the dataset."""
    name, seed, users = settings["dataset"], settings.get("seed") or 0, settings.get("users")
    partition = settings.get("partition")
    if partition is not None and name not in PARTITIONED:
        raise ValueError(f"--partition applies to {', '.join(PARTITIONED)} (synthetic users), not {name}")
    schema = loader_kwargs(settings)
    if is_data_file(name) or name == "sites":
        if users is not None and name != "sites":
            raise ValueError(f"--users applies to synthetic datasets; {name} has the users of its user column")
        return {"split_seed": seed, **({"sites": settings.get("sites")} if name == "sites" else {}), **schema}
    if schema:
        raise ValueError(f"{', '.join(SCHEMA_SETTINGS)} apply to --dataset FILE (a .csv/.npz/.parquet file)")
    if name in ("movielens", "tv16"):
        if users is not None:
            raise ValueError(f"--users applies to synthetic datasets; {name} has a fixed set of users")
        return {"split_seed": seed}
    return {"seed": seed, **({"n_users": users} if users else {}), **({"partition": partition} if partition else {})}


def read_table(path: str) -> Any:
    """A pandas DataFrame from a ``.csv``, ``.npz`` or ``.parquet`` file."""
    import pandas as pd

    if path.lower().endswith(".npz"):
        cols = _table(path)
        return pd.DataFrame({c: cols.get(c) for c in cols.names})
    return _table(path).frame


class _Columns:
    """A data file's columns as 1-D numpy arrays. An ``.npz`` is read without pandas, one column at a
    time when asked (its names, dtypes and lengths come from the array headers); a ``.csv`` or
    ``.parquet`` through a pandas DataFrame (``frame``)."""

    def __init__(self, path: str, frame: Any = None, npz: Any = None, headers: dict | None = None) -> None:
        self.path, self.frame, self._npz, self._headers = path, frame, npz, headers or {}
        self.names = list(frame.columns) if frame is not None else list(self._headers)
        self.rows = len(frame) if frame is not None else next(iter(self._headers.values()))[0][0]

    def get(self, name: str, dtype: Any = None) -> np.ndarray:
        if self.frame is not None:
            return self.frame[name].to_numpy(dtype)
        try:
            shape, dtype_, offset = self._headers[name]
            if offset is not None:  # one copy out of the page cache, no zip stream nor CRC pass (_stored_offset)
                value = np.array(np.memmap(self.path, dtype=dtype_, mode="r", offset=offset, shape=shape))
            else:
                value = self._npz[name]
        except Exception as exc:  # e.g. an object array (allow_pickle=False)
            raise DataError(f"{self.path}: cannot read ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})")
        return value if dtype is None else value.astype(dtype, copy=False)

    def dtype(self, name: str) -> np.dtype:
        return self.frame[name].dtype if self.frame is not None else self._headers[name][1]

    def numeric(self, name: str) -> bool:
        """A numeric, non-boolean column (what may be a feature)."""
        if self.frame is not None:
            from pandas.api.types import is_bool_dtype, is_numeric_dtype

            return is_numeric_dtype(self.frame[name]) and not is_bool_dtype(self.frame[name])
        return self.dtype(name).kind in "iufc"

    def has_missing(self, name: str) -> bool:
        if self.frame is not None:
            return bool(self.frame[name].isna().any())
        value = self.get(name)
        return value.dtype.kind in "fc" and bool(np.isnan(value).any())


def _table(path: str) -> _Columns:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    low = path.lower()
    try:
        if low.endswith(".csv"):
            import pandas as pd

            return _Columns(path, frame=pd.read_csv(path))
        if low.endswith(".npz"):
            return _npz_columns(path)
        if low.endswith(".parquet"):
            import pandas as pd

            return _Columns(path, frame=pd.read_parquet(path))
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


def _stored_offset(archive: Any, info: Any, start: int, fortran: bool, dtype: np.dtype) -> int | None:
    """Where in the file an ``.npz`` member's array data begins, when it can be memory-mapped: stored
    uncompressed (``np.savez``; ``savez_compressed`` is read through zlib), a plain dtype. Read from the
    member's local header (its extra field may differ from the central directory's)."""
    import zipfile

    if info.compress_type != zipfile.ZIP_STORED or dtype.hasobject or fortran:
        return None
    archive.fp.seek(info.header_offset)
    local = archive.fp.read(30)
    if local[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len + start


def _npz_columns(path: str) -> _Columns:
    """The columns of an ``.npz`` from its array headers (no array is read here)."""
    z = np.load(path, allow_pickle=False)
    headers = {}
    for name in z.files:
        info = z.zip.getinfo(name + ".npy")
        with z.zip.open(info) as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            start = f.tell()
        headers[name] = (shape, dtype, _stored_offset(z.zip, info, start, fortran, dtype))
    bad = [k for k, (shape, *_) in headers.items() if len(shape) != 1]
    if bad:
        raise DataError(f"{path}: array {bad[0]!r} is not 1-D (an .npz holds one 1-D array per column)")
    if len({shape for shape, *_ in headers.values()}) > 1:
        raise DataError(f"{path}: the arrays have different lengths")
    if not headers:
        raise DataError(f"{path}: no records")
    return _Columns(path, npz=z, headers=headers)


def _features(cols: _Columns, schema: Schema, source: str, extra_columns: Sequence[str]) -> tuple[str, ...]:
    """The feature columns, checked: present, numeric; and the file has records."""
    features = schema.feature_columns
    if features is None:
        features = tuple(c for c in cols.names if c not in (schema.label_column, *extra_columns) and cols.numeric(c))
        if not features:
            raise DataError(f"{source}: no numeric feature column; name them (--feature-columns)")
    missing = [c for c in (*features, schema.label_column, *extra_columns) if c not in cols.names]
    if missing:
        raise DataError(f"{source}: missing column(s) {missing} (file has {cols.names[:10]})")
    if cols.rows == 0:
        raise DataError(f"{source}: no records")
    for c in features:
        if not cols.numeric(c):
            raise DataError(f"{source}: feature column {c!r} is not numeric (dtype {cols.dtype(c)})")
    return features


def _check_features(cols: _Columns, features: Sequence[str], schema: Schema, source: str) -> tuple:
    """``(factor, notes)`` after one pass over the feature columns, one column in memory at a time:
    every value finite, every record within the feature bound (or the per-record clip factor, when
    ``on_bound="clip"``; None when nothing is clipped).

    The squared norms are summed column by column, left to right: the order numpy's ``norm(X, axis=1)``
    adds them in on the column-major matrix the loader built before issue 34, so every record's norm,
    hence the clipped and projected features, are the same bits."""
    sumsq = None
    for j, c in enumerate(features):
        v = cols.get(c, np.float64)
        finite = np.isfinite(v)
        if not finite.all():
            bad = np.zeros(cols.rows, dtype=bool)
            for name in features:
                bad |= ~np.isfinite(cols.get(name, np.float64))
            r = int(np.flatnonzero(bad)[0])
            col = next(name for name in features if not np.isfinite(cols.get(name, np.float64)[r]))
            raise DataError(
                f"{source}: {int(bad.sum())} record(s) have NaN or infinite features (first: row {r}, column {col!r})"
            )
        sumsq = v * v if sumsq is None else np.add(sumsq, v * v, out=sumsq)
        del v, finite
    norms = np.sqrt(sumsq, out=sumsq)
    B = float(schema.feature_bound)
    over = norms > B
    if not over.any():
        return None, []
    if schema.on_bound == "refuse":
        raise DataError(
            f"{source}: {int(over.sum())} record(s) have ||x|| above the declared feature bound {B:g} "
            f"(largest {norms.max():.4g}, row {int(norms.argmax())}); scale the columns or clip (on_bound=clip)"
        )
    return np.minimum(1.0, B / np.where(over, norms, B)), [
        f"{int(over.sum())} record(s) clipped to the feature bound {B:g}"
    ]


def _feature_matrices(cols: _Columns, features: Sequence[str], B: float, factor: Any, parts: Sequence) -> list:
    """The projected feature matrix of each row set in ``parts`` (C-ordered float64), filled column by
    column: each record clipped (``factor``), divided by ``B``, projected onto the unit ball. The only
    copy of the data: one matrix row per record, plus a block of up to ``_BLOCK`` columns (at most a fifth of
    the matrix) at a time.

    The columns are gathered into a column-major block and written ``_BLOCK`` at a time (8 float64: one
    64-byte cache line of each row): writing one column of a row-major matrix touches a cache line per row
    for 8 bytes (issue 34: at 100,000 users x 25 records x 50 features the column-at-a-time fill was over half
    of the load). Every value, and every norm's summation order (the columns left to right), is what the
    column-at-a-time fill gave."""
    out = [np.empty((len(rows), len(features))) for rows in parts]
    sumsq = [np.zeros(len(rows)) for rows in parts]
    width = max(1, min(_BLOCK, len(features) // 5))  # the block at most a fifth of the matrix
    blocks = [np.empty((len(rows), width), order="F") for rows in parts]
    for j, c in enumerate(features):
        v = cols.get(c, np.float64)
        v = v * factor if factor is not None else v / B  # a new array (never the file's own), then in place
        if factor is not None:
            v /= B
        k = j % width
        for rows, s, block in zip(parts, sumsq, blocks):
            tmp = block[:, k]
            np.take(v, rows, out=tmp)
            if j:
                s += tmp * tmp
            else:
                np.multiply(tmp, tmp, out=s)
        del v
        if k == width - 1 or j == len(features) - 1:
            for X, block in zip(out, blocks):
                X[:, j - k : j + 1] = block[:, : k + 1]
    del blocks
    for X, s in zip(out, sumsq):  # project_rows: x / max(1, ||x||)
        X /= np.maximum(1.0, np.sqrt(s, out=s))[:, None]
    return out


_BLOCK = 8  # the most columns written at a time by _feature_matrices


def _unused_note(cols: _Columns, taken: Sequence[str]) -> list[str]:
    """The columns other than ``taken`` that the default feature selection (every other numeric,
    non-boolean column) leaves out: text, dates, booleans ... (named to the user, never dropped silently)."""
    unused = [c for c in cols.names if c not in taken and not cols.numeric(c)]
    if not unused:
        return []
    return [f"column(s) {', '.join(map(repr, unused))} not used (not numeric; only numeric columns "
            "are features unless --feature-columns names them)"]  # fmt: skip


def _check_labels(y: np.ndarray, schema: Schema, source: str, notes: list[str]) -> np.ndarray:
    what = f"{source}: label column {schema.label_column!r}"
    if y.dtype.kind not in "biufc":
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
    block: range | None = None,
    **schema: Any,
) -> FederatedDataset:
    """A user-partitioned file as a :class:`FederatedDataset` (``fedkl run --dataset FILE``): the
    ``user_column`` names each record's user; ``schema`` holds the :class:`Schema` fields
    (``label_column``, ``task``, ``feature_columns``, ``feature_bound``, ``label_bound``, ``on_bound``).
    ``block``: keep only the users at these positions (a Ray shard's block,
    :mod:`fedkl.federation.ray_shards`): the same records, bits and split as
    ``load_file(path).train.subset(block)`` (and ``.test``), but the feature matrices hold the block's
    records only (the whole file passes one column at a time: the checks, the users and the split).

    One pass over the feature columns checks them; the split is drawn from the users; a second pass
    writes each record straight into its train or test matrix (:func:`_load`). The dataset is the one
    ``fedkl.from_arrays`` made of the column-major matrix before issue 34 (same users, order, split, bits)."""
    if not user_column:
        raise DataError(f"{path}: a user-partitioned file needs its user column (--user-column)")
    sch = Schema.from_settings(schema)
    name = os.path.basename(path)
    return _load(_table(path), sch, path, user_column, None, split_seed, test_fraction, name, block)


def load_site(
    path: str, schema: Schema, user_id: str, *, split_seed: int = 0, test_fraction: float = 0.2
) -> FederatedDataset:
    """One site's (one user's) own file, checked against the run's ``schema``: a one-user dataset.
    Any user column in the file is ignored: the whole file belongs to ``user_id``."""
    if schema.feature_columns is None:
        raise DataError("a site's schema must name its feature columns (the server fixes the model's shape)")
    return _load(_table(path), schema, path, None, str(user_id), split_seed, test_fraction, f"site {user_id}")


def _load(
    cols: _Columns,
    sch: Schema,
    source: str,
    user_column: str | None,
    user_id: str | None,
    split_seed: int,
    test_fraction: float,
    name: str,
    block: range | None = None,
) -> FederatedDataset:
    import torch

    from fedkl.data.base import UserData
    from fedkl.data.custom import describe, labels, user_keys
    from fedkl.data.real import split_by_user

    features = _features(cols, sch, source, (user_column,) if user_column else ())
    factor, notes = _check_features(cols, features, sch, source)
    y = _check_labels(cols.get(sch.label_column), sch, source, notes)
    if user_column:
        if sch.feature_columns is None:  # never dropped silently: said where the run says what it trains on
            notes = [*notes, *_unused_note(cols, (sch.label_column, user_column))]
        if cols.has_missing(user_column):
            raise DataError(f"{source}: the user column {user_column!r} has missing values")
        user_ids, user_index = user_keys(cols.get(user_column))
    else:
        user_ids, user_index = (user_id,), np.zeros(cols.rows, dtype=np.int64)
    y, kw = labels(y, sch.task, sch.num_classes, sch.label_bound)
    is_test = split_by_user(user_index, len(user_ids), test_fraction, np.random.default_rng(split_seed))
    parts = (np.flatnonzero(~is_test), np.flatnonzero(is_test))
    del is_test
    if block is not None:  # the block's records only, in file order (what UserData.subset keeps)
        if not (block.step == 1 and 0 <= block.start <= block.stop <= len(user_ids)):
            raise ValueError(f"block must be a range of user positions within 0..{len(user_ids)}, got {block!r}")
        parts = tuple(rows[(user_index[rows] >= block.start) & (user_index[rows] < block.stop)] for rows in parts)
        user_ids, user_index = user_ids[block.start : block.stop], user_index - block.start
    matrices = _feature_matrices(cols, features, float(sch.feature_bound), factor, parts)
    # every value was checked finite (clipping, dividing and projecting keep it so); the ids are distinct
    train, test = (
        UserData._checked(
            torch.from_numpy(X), torch.as_tensor(y[rows]), torch.from_numpy(user_index[rows]), user_ids, unique=True
        )
        for X, rows in zip(matrices, parts)
    )
    desc = describe(name, len(user_ids), (cols.rows, len(features)), test_fraction, split_seed)
    ds = FederatedDataset(name=name, train=train, test=test, task=sch.task, description=desc, **kw)
    return _noted(ds, sch, notes)


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
    "DATA_SETTINGS",
    "DataError",
    "Schema",
    "dataset_kwargs",
    "is_data_file",
    "load_file",
    "loader_kwargs",
    "load_site",
    "read_table",
    "sites_dataset",
]
