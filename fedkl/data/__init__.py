"""User-partitioned datasets: containers and :func:`load_dataset`."""
from __future__ import annotations

from fedkl.data.adult import load_adult
from fedkl.data.base import FederatedDataset, UserData
from fedkl.data.images import DataNotInstalled, load_fashion_mnist, load_mnist
from fedkl.data.real import load_movielens, load_tv16
from fedkl.data.shakespeare import load_shakespeare
from fedkl.data.synthetic import synthetic_least_squares, synthetic_logistic

DATASETS = ("movielens", "tv16", "synthetic-logistic", "synthetic-least-squares", "adult", "shakespeare", "mnist",
            "fashion-mnist")
SYNTHETIC_DEFAULTS = {"n_users": 200, "m": 20, "d": 10}
# loaders whose seed is the partition/split seed ``split_seed`` (``seed=`` is accepted as its alias)
_SPLIT_SEEDED = {"adult": load_adult, "shakespeare": load_shakespeare, "mnist": load_mnist,
                 "fashion-mnist": load_fashion_mnist}


def load_dataset(name: str, **kw) -> FederatedDataset:
    """Load dataset ``name`` (keyword arguments go to its loader; synthetic sets default to
    ``n_users=200, m=20, d=10``). For adult, shakespeare, mnist and fashion-mnist ``seed`` is an
    alias of the loader's ``split_seed`` (the seed of the synthetic partition and the per-user
    split), so that a caller can seed every dataset the same way."""
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
        if name == "shakespeare" and kw.get("n_users") is not None:
            raise ValueError("shakespeare has a fixed set of users (one per speaking part); n_users does not apply")
        return _SPLIT_SEEDED[name](**kw)
    raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")


__all__ = ["DATASETS", "DataNotInstalled", "FederatedDataset", "UserData", "load_adult", "load_dataset",
           "load_fashion_mnist", "load_mnist", "load_movielens", "load_shakespeare", "load_tv16",
           "synthetic_least_squares", "synthetic_logistic"]
