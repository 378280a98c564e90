"""User-partitioned datasets: containers and :func:`load_dataset`."""
from __future__ import annotations

from fedkl.data.base import FederatedDataset, UserData
from fedkl.data.real import load_movielens, load_tv16
from fedkl.data.synthetic import synthetic_least_squares, synthetic_logistic

DATASETS = ("movielens", "tv16", "synthetic-logistic", "synthetic-least-squares")
SYNTHETIC_DEFAULTS = {"n_users": 200, "m": 20, "d": 10}


def load_dataset(name: str, **kw) -> FederatedDataset:
    """Load dataset ``name`` (keyword arguments go to its loader; synthetic sets default to
    ``n_users=200, m=20, d=10``)."""
    if name == "movielens":
        return load_movielens(**kw)
    if name == "tv16":
        return load_tv16(**kw)
    if name in ("synthetic-logistic", "synthetic-least-squares"):
        kw = {**SYNTHETIC_DEFAULTS, **kw}
        return synthetic_logistic(**kw) if name == "synthetic-logistic" else synthetic_least_squares(**kw)
    raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")


__all__ = ["DATASETS", "FederatedDataset", "UserData", "load_dataset", "load_movielens", "load_tv16",
           "synthetic_least_squares", "synthetic_logistic"]
