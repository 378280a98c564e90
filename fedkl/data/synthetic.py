"""Synthetic federated data with a known optimum.

Generation (all from ``numpy.random.default_rng(seed)``, so fully reproducible):

* ``w*``: a uniformly random direction scaled to ``||w*|| = w_norm``. Defaults: ``w_norm = sqrt(d)``
  for logistic (the margin ``<w*, x>`` then has standard deviation about 1 whatever d is, so the
  labels carry signal) and ``w_norm = 1`` for least squares.
* user models ``w*_u = w* + heterogeneity * xi_u``, ``xi_u ~ N(0, I/d)`` (so ``||xi_u|| ~ 1``),
  projected onto the ball of radius 3 (``XI_RADIUS``; changes a draw with probability < 3e-3 at
  d = 1 and far less beyond, and keeps ``xi_u`` symmetric: ``E[xi_u] = 0``).
* features ``x ~ N(0, I/d)`` projected onto the unit ball (``x / max(1, ||x||)``): isotropic,
  ``||x|| <= 1 = feature_bound``, independent of the user.
* ``m`` records per user (train + test), split within each user by ``test_fraction``.
* logistic labels: ``+1`` with probability ``sigmoid(<w*_u, x>)``, else ``-1``.
* least-squares labels: ``y = <w*_u, x> + noise * e`` with ``e ~ N(0, 1)`` clipped to [-4, 4], then
  clipped to ``|y| <= Y = w_norm + 3 heterogeneity + 4 noise`` (``extra["label_bound"]``). Since
  ``|<w*_u, x>| <= ||w*_u|| <= Y - 4 noise``, that last clip never changes a label: the model is
  exactly linear, ``E[y | x, u] = <w*_u, x>``.

``optimum = w*``. For least squares this is the population optimum for any heterogeneity: the
population gradient is ``E_u E_{x,e}[x (<w, x> - <w*_u, x> - noise e)] = S (w - E_u[w*_u]) = S (w - w*)``
with ``S = E[x x^T] = c I / d`` (c = E[min(||z||^2, 1)] with ``z ~ N(0, I/d)``, positive definite),
because x is independent of u and e, ``E[e] = 0`` and ``E[xi_u] = 0``; so ``w*`` is the unique
minimizer. For logistic data with heterogeneity > 0 the population optimum is *not* w*: averaging
the sigmoid over the user models flattens the link, and by the isotropy of x and xi the optimum is
parallel to w* but shorter; with heterogeneity = 0 it is w* (a well-specified model).

For least squares, ``extra["erm_optimum"]`` is the exact minimizer over the *train* split of the
user-level objective ``F(w) = mean_u mean_{k in u} 0.5 (<w, x_k> - y_k)^2`` (normal equations with
record weights ``1 / (n_users n_u)``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedkl.data.base import FederatedDataset
from fedkl.data.real import make_federated, project_rows, split_by_user

XI_RADIUS = 3.0
NOISE_CLIP = 4.0


def _synthetic(name, n_users, m, d, heterogeneity, seed, test_fraction, w_norm, task, labels, what, extra):
    """The data of the module docstring: ``w*``, the user models and the features drawn from
    ``default_rng(seed)``, then ``labels(rng, z)`` (z: each record's ``<w*_u, x>``), then the split."""
    if n_users < 1 or m < 1 or d < 1:
        raise ValueError(f"n_users, m and d must be positive, got {n_users}, {m}, {d}")
    if heterogeneity < 0:
        raise ValueError(f"heterogeneity must be non-negative, got {heterogeneity}")
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(d)
    w_star = w_norm * v / np.linalg.norm(v)
    xi = project_rows(rng.standard_normal((n_users, d)) / math.sqrt(d), XI_RADIUS)
    user_models = w_star + heterogeneity * xi
    user_index = np.repeat(np.arange(n_users, dtype=np.int64), m)
    X = project_rows(rng.standard_normal((n_users * m, d)) / math.sqrt(d))
    y = labels(rng, np.einsum("nd,nd->n", X, user_models[user_index]))
    is_test = split_by_user(user_index, n_users, test_fraction, rng)
    desc = (
        f"{what}; {n_users} users x {m} records, d={d}, heterogeneity={heterogeneity:g}, seed={seed}; "
        f"split within each user: {test_fraction:g} to test: {int((~is_test).sum())} train / "
        f"{int(is_test.sum())} test records"
    )
    extra = {"w_norm": w_norm, "heterogeneity": heterogeneity, **extra}
    extra["user_models"] = torch.as_tensor(user_models, dtype=torch.float64)
    ids, optimum = tuple(f"{name}:{u}" for u in range(n_users)), torch.as_tensor(w_star, dtype=torch.float64)
    return make_federated(
        name, X, y, user_index, ids, is_test, task, desc, feature_bound=1.0, optimum=optimum, extra=extra
    )


def synthetic_logistic(
    n_users: int,
    m: int,
    d: int,
    heterogeneity: float = 0.0,
    seed: int = 0,
    test_fraction: float = 0.2,
    w_norm: float | None = None,
) -> FederatedDataset:
    """Binary ±1 labels from per-user logistic models around ``w*`` (``||w*|| = w_norm``, default sqrt(d))."""
    w_norm = math.sqrt(d) if w_norm is None else float(w_norm)

    def labels(rng: np.random.Generator, z: np.ndarray) -> np.ndarray:
        return np.where(rng.random(len(z)) < 1.0 / (1.0 + np.exp(-z)), 1.0, -1.0)

    what = f"synthetic logistic, ||w*|| = {w_norm:g}, x in the unit ball"
    return _synthetic(
        "synthetic-logistic", n_users, m, d, heterogeneity, seed, test_fraction, w_norm, "binary", labels, what, {}
    )


def synthetic_least_squares(
    n_users: int,
    m: int,
    d: int,
    heterogeneity: float = 0.0,
    noise: float = 0.1,
    seed: int = 0,
    test_fraction: float = 0.2,
    w_norm: float = 1.0,
) -> FederatedDataset:
    """Linear labels ``<w*_u, x> + noise e`` around ``w*`` (``||w*|| = w_norm``); see the module docstring."""
    if noise < 0:
        raise ValueError(f"noise must be non-negative, got {noise}")
    w_norm = float(w_norm)
    label_bound = w_norm + XI_RADIUS * heterogeneity + NOISE_CLIP * noise

    def labels(rng: np.random.Generator, z: np.ndarray) -> np.ndarray:
        e = np.clip(rng.standard_normal(len(z)), -NOISE_CLIP, NOISE_CLIP)
        return np.clip(z + noise * e, -label_bound, label_bound)

    what = (
        f"synthetic least squares, ||w*|| = {w_norm:g}, noise = {noise:g}, |y| <= {label_bound:g}, x in the unit ball"
    )
    setting = (n_users, m, d, heterogeneity, seed, test_fraction, w_norm)
    extra = {"noise": noise, "label_bound": label_bound}
    ds = _synthetic("synthetic-least-squares", *setting, "regression", labels, what, extra)
    ds.extra["erm_optimum"] = erm_least_squares(ds)
    return ds


def erm_least_squares(ds: FederatedDataset) -> torch.Tensor:
    """Exact minimizer of ``mean_u mean_{k in u} 0.5 (<w, x_k> - y_k)^2`` over ``ds.train`` (users with
    no train record contribute a constant); minimum-norm solution if the system is singular."""
    train = ds.train
    X, y = train.X.double().numpy(), train.y.double().numpy()
    counts = train.counts().double().numpy()
    weights = 1.0 / (train.num_users * counts[train.user_index.numpy()])
    A = X.T @ (weights[:, None] * X)
    b = X.T @ (weights * y)
    return torch.as_tensor(np.linalg.lstsq(A, b, rcond=None)[0], dtype=torch.float64)
