"""User-partitioned datasets: containers and :func:`load_dataset`."""

from __future__ import annotations

from fedkl.data.adult import load_adult
from fedkl.data.base import FederatedDataset, UserData
from fedkl.data.files import DataError, is_data_file, load_file, sites_dataset
from fedkl.data.flights import load_flights
from fedkl.data.images import DataNotInstalled, load_fashion_mnist, load_mnist
from fedkl.data.mortgages import load_mortgages
from fedkl.data.movielens_sparse import load_movielens_sparse
from fedkl.data.partition import load_fertility_partition
from fedkl.data.real import load_movielens, load_movielens_heavy, load_tv16
from fedkl.data.shakespeare import load_shakespeare
from fedkl.data.synthetic import synthetic_least_squares, synthetic_logistic

DATASETS = (
    "movielens",
    "tv16",
    "synthetic-logistic",
    "synthetic-least-squares",
    "adult",
    "shakespeare",
    "mnist",
    "fashion-mnist",
    "flights",
    "mortgages",
    "fertility-partition",
    "movielens-heavy",
    "movielens-sparse",
)
SYNTHETIC_DEFAULTS = {"n_users": 200, "m": 20, "d": 10}
# loaders whose seed is the partition/split seed ``split_seed`` (``seed=`` is accepted as its alias)
_SPLIT_SEEDED = {
    "adult": load_adult,
    "shakespeare": load_shakespeare,
    "mnist": load_mnist,
    "fashion-mnist": load_fashion_mnist,
    "flights": load_flights,
    "mortgages": load_mortgages,
    "fertility-partition": load_fertility_partition,
    "movielens-heavy": load_movielens_heavy,
    "movielens-sparse": load_movielens_sparse,
}
# datasets whose users are fixed by the data (``n_users`` does not apply)
_FIXED_USERS = {
    "shakespeare": "one per speaking part",
    "flights": "one per destination airport",
    "mortgages": "one per birth state",
    "movielens-heavy": "the raters with >= min_records ratings",
    "movielens-sparse": "one per rater",
}


def load_dataset(name: str, **kw) -> FederatedDataset:
    """Load dataset ``name`` (keyword arguments go to its loader; synthetic sets default to
    ``n_users=200, m=20, d=10``). For adult, shakespeare, mnist, fashion-mnist, flights, mortgages,
    fertility-partition, movielens-heavy and movielens-sparse ``seed`` is an alias of the loader's ``split_seed`` (the
    seed of the per-user split, for mnist and fashion-mnist also of their synthetic partition; adult's
    hashed partition and fertility-partition's permutation have their own ``partition_seed``, the
    flights and mortgages per-user subsample its own ``sample_seed``), so that a caller can seed every
    dataset the same way."""
    if is_data_file(name):  # your own user-partitioned file (fedkl.data.files)
        if "seed" in kw:
            kw["split_seed"] = kw.pop("seed")
        return load_file(name, **kw)
    if name == "sites":  # a deployment whose nodes load their own files: the schema, no records
        return sites_dataset(**kw)
    if name == "movielens":
        return load_movielens(**kw)
    if name == "tv16":
        return load_tv16(**kw)
    if name in ("synthetic-logistic", "synthetic-least-squares"):
        kw = {**SYNTHETIC_DEFAULTS, **kw}
        return synthetic_logistic(**kw) if name == "synthetic-logistic" else synthetic_least_squares(**kw)
    if name in _SPLIT_SEEDED:
        if "seed" in kw:
            if "split_seed" in kw:
                raise ValueError("give seed or split_seed, not both (seed is an alias of split_seed)")
            kw["split_seed"] = kw.pop("seed")
        if name in _FIXED_USERS and kw.get("n_users") is not None:
            raise ValueError(f"{name} has a fixed set of users ({_FIXED_USERS[name]}); n_users does not apply")
        return _SPLIT_SEEDED[name](**kw)
    raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}, or a .csv/.npz/.parquet file")


__all__ = [
    "DATASETS",
    "DataError",
    "DataNotInstalled",
    "FederatedDataset",
    "UserData",
    "load_adult",
    "load_dataset",
    "load_fashion_mnist",
    "load_fertility_partition",
    "load_flights",
    "load_mnist",
    "load_mortgages",
    "load_movielens",
    "load_movielens_heavy",
    "load_movielens_sparse",
    "load_shakespeare",
    "load_tv16",
    "synthetic_least_squares",
    "synthetic_logistic",
]
