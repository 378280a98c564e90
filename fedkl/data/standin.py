"""A public stand-in of a federated dataset: its public shape, no record's value (fedkl plan --charges)."""

from __future__ import annotations

import dataclasses

import torch

from fedkl.data.base import FederatedDataset, UserData

STANDIN_RECORDS = 2  # records per user of the public stand-in (a public constant, not the real counts)


def public_standin(dataset: FederatedDataset, records_per_user: int = STANDIN_RECORDS) -> FederatedDataset:
    """A dataset with ``dataset``'s public shape (user ids, dimension, task, classes, feature bound)
    and public records: every user holds ``records_per_user`` zero feature rows with the task's
    first label (+1, class 0, or 0.0). No value of ``dataset``'s records enters it."""
    ids = dataset.train.user_ids
    n, d = len(ids), dataset.train.dim
    owner = torch.arange(n).repeat_interleave(records_per_user)
    X = torch.zeros(n * records_per_user, d, dtype=dataset.train.X.dtype)
    label = {"binary": 1, "multiclass": 0, "regression": 0.0}[dataset.task]
    y = torch.full((n * records_per_user,), label, dtype=dataset.train.y.dtype)
    split = UserData(X, y, owner, ids)
    return dataclasses.replace(
        dataset,
        name=f"{dataset.name} (public stand-in)",
        train=split,
        test=split,
        description=f"public stand-in: {n} users x {records_per_user} zero records",
        optimum=None,
    )
