"""The audited datasets: small synthetic federations whose only difference is WHOLE users.

Binary logistic regression on features in the unit ball (the problems' declared bounds, so the
datasets pass :func:`fedkl.data.base.check_record_bounds` like any honest client's data).

The audited pair follows the run's neighbouring relation (:data:`fedkl.privacy.guarantee.RELATION_TEXT`),
so that the lower bound is compared with the claim it can refute:

* ``replace-one``: the special user's records replaced by others (its mirror image);
* ``add-remove``: the special user present vs absent, against the public enrolment count n (zero-out):
  absent, it stays enrolled (n, hence every public denominator and the claimed delta, is the same in both
  worlds) and contributes nothing: every answer of it is the zero row of a failed user, exactly what the
  Flower backends make of an enrolled user with no node ("absent"). A :class:`World` carries the
  absent users; :class:`fedkl.audit.release.AuditFederation` serves them so.

* :func:`neighbour_pair` — the worst-case pair of the many-run audit under the replace-one relation:
  ``base`` ordinary users whose features have 0 in coordinate 0, plus ONE outlier user all of whose
  records are ``x = e_0``. In D1 the outlier's labels are +1, in D0 they are -1 (its mirror image):
  the two datasets differ in that one user, whose whole gradient lies on e_0 where no other user
  contributes, so the model's coordinate 0 (the audit's statistic) carries all of the outlier's
  influence. :func:`neighbour_worlds` gives it as worlds, or under add-remove D1 and D1 with the
  outlier absent.
* :func:`canary_world` — the one-run audit's federation: ``m`` canary users, canary i holding
  records ``x = e_i`` with label +1 (``included[i]``) or, when excluded, its mirror (-1, replace-one) or
  nothing (absent, add-remove), plus ``base`` ordinary users on the remaining coordinates. Flipping one
  canary is one neighbour under the relation, which is what Steinke et al.'s theorem needs of each canary.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedkl.data.base import FederatedDataset
from fedkl.data.custom import from_arrays
from fedkl.privacy.guarantee import check_relation

OUTLIER = "outlier"  # the user id of neighbour_pair's outlier


class World(NamedTuple):
    """One side of an audited pair: the enrolled users' records and the enrolled users ``absent`` from it
    (ids; they contribute nothing: the add-remove relation's zero-out, module docstring)."""

    dataset: FederatedDataset
    absent: tuple[str, ...] = ()


def _base_users(rng: np.random.Generator, users: int, records: int, d_total: int, first: int, last: int | None = None):
    """Ordinary users: features on coordinates ``first..last-1`` only (default: to the end), a noisy
    linear label."""
    last = d_total if last is None else last
    d = last - first
    w_true = rng.normal(size=d)
    X = np.zeros((users * records, d_total))
    X[:, first:last] = rng.normal(size=(users * records, d)) / (2 * np.sqrt(d))
    y = np.where(X[:, first:last] @ w_true + 0.3 * rng.normal(size=users * records) > 0, 1, -1)
    owners = [f"b{u:05d}" for u in range(users) for _ in range(records)]
    return X, y, owners


def neighbour_pair(
    base: int = 40, records: int = 10, dim: int = 4, seed: int = 0, outlier_records: int | None = None
) -> tuple:
    """``(D0, D1)`` (module docstring); ``dim`` counts coordinate 0; the outlier holds
    ``outlier_records`` records (default ``records``: a user-level guarantee covers a user whatever
    their number of records, so a heavy outlier is a legitimate worst case too)."""
    if base < 1 or records < 2 or dim < 2:
        raise ValueError("need base >= 1 users, records >= 2 and dim >= 2")
    X, y, owners = _base_users(np.random.default_rng(seed), base, records, dim, 1)
    records = records if outlier_records is None else outlier_records
    out = np.zeros((records, dim))
    out[:, 0] = 1.0
    pair = []
    for label in (-1, 1):
        pair.append(
            from_arrays(
                np.vstack([X, out]),
                np.concatenate([y, np.full(records, label)]),
                owners + [OUTLIER] * records,
                task="binary",
                split_seed=seed,
                name=f"audit-pair-{'d1' if label > 0 else 'd0'}",
            )
        )
    return pair[0], pair[1]


def neighbour_worlds(
    neighbouring: str,
    base: int = 40,
    records: int = 10,
    dim: int = 4,
    seed: int = 0,
    outlier_records: int | None = None,
) -> tuple[World, World]:
    """The many-run audit's ``(W0, W1)`` under ``neighbouring`` (module docstring): W1 is
    :func:`neighbour_pair`'s D1 (the outlier present, labels +1); W0 is D0 (its mirror) under replace-one,
    D1 with the outlier absent under add-remove."""
    check_relation(neighbouring)
    d0, d1 = neighbour_pair(base=base, records=records, dim=dim, seed=seed, outlier_records=outlier_records)
    if neighbouring == "add-remove":
        return World(d1, (OUTLIER,)), World(d1)
    return World(d0), World(d1)


def canary_world(
    included: np.ndarray,
    base: int = 40,
    records: int = 10,
    base_dim: int = 3,
    seed: int = 0,
    neighbouring: str = "replace-one",
) -> World:
    """The one-run federation for the canaries' inclusion vector ``included`` (module docstring): an
    excluded canary holds its mirror (replace-one) or is absent (add-remove)."""
    check_relation(neighbouring)
    included = np.asarray(included, dtype=bool)
    absent = neighbouring == "add-remove"
    m = len(included)
    dim = m + base_dim
    X, y, owners = _base_users(np.random.default_rng(seed), base, records, dim, m)
    Xc = np.zeros((m * records, dim))
    Xc[np.arange(m * records), np.repeat(np.arange(m), records)] = 1.0
    yc = np.repeat(np.where(included | absent, 1, -1), records)
    ids = [f"c{i:05d}" for i in range(m)]
    dataset = from_arrays(
        np.vstack([X, Xc]),
        np.concatenate([y, yc]),
        owners + [c for c in ids for _ in range(records)],
        task="binary",
        split_seed=seed,
        name="audit-canaries",
    )
    return World(dataset, tuple(c for c, inside in zip(ids, included) if absent and not inside))


def random_direction_canaries(
    directions: np.ndarray, base: int = 40, records: int = 10, base_dim: int = 3, seed: int = 0
) -> FederatedDataset:
    """The one-shot estimate's federation (Andrew et al. 2023): one canary user per row of
    ``directions`` (unit vectors in the last coordinates), all its records ``x = direction`` with label
    +1, so its gradient lies along its direction; ``base`` ordinary users on the first ``base_dim``."""
    k, d = directions.shape
    X, y, owners = _base_users(np.random.default_rng(seed), base, records, base_dim + d, 0, base_dim)
    Xc = np.zeros((k * records, base_dim + d))
    Xc[:, base_dim:] = np.repeat(directions, records, axis=0)
    return from_arrays(
        np.vstack([X, Xc]),
        np.concatenate([y, np.ones(k * records)]),
        owners + [f"c{i:05d}" for i in range(k) for _ in range(records)],
        task="binary",
        split_seed=seed,
        name="audit-random-canaries",
    )
