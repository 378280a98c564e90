"""External sweep runner ``p001-sparse-logistic`` for simulations/studies/p001_sparse_fw.toml: one fedkl
algorithm (``method``: ``noisy-fw`` or ``noisy-gd``) trained through ``fedkl.train`` (the ledger, the
releaser, replace-one, the point's eps, delta = 1/n^1.1) on one draw of paper 001's use case, a sparse
high-dimensional logistic model (d >> n).

Data (drawn here from ``seed``, which is also the noise seed): d = 2000 features, a 5-sparse ``w*`` with
entries +-40 (so <w*, x> has std ~ 2 for x ~ N(0, I/d), projected onto the unit ball by
``fedkl.from_arrays``), labels ~ Bernoulli(sigmoid(<w*, x>)), m = 4 records per user, ``users`` = n users,
20% of each user's records held out. Not a ``fedkl run`` dataset (``fedkl run`` has no such family),
hence a runner; every training is a real private run (its own ledger in a temporary folder).

Its own setting: ``method``. The method's public hyperparameters are the point's ``fedkl run`` settings,
passed to ``fedkl.train`` as the study's grid gives them (HYPERPARAMETERS; the others at the
algorithm's defaults): noisy-fw's l1 radius and l_inf clamp (its rounds: Thm 9's T), noisy-gd's rounds,
lr and clip. Table columns: test accuracy (``test_metric``), ``test_loss`` and the majority class
(``trivial_metric``).
"""

from __future__ import annotations

import math
import shutil
import tempfile

import numpy as np

import fedkl
from fedkl.experiments import register_runner, runner_result

NAME = "p001-sparse-logistic"
D, SPARSITY, SCALE, RECORDS = 2000, 5, 40.0, 4
HYPERPARAMETERS = {"noisy-fw": ("fw_radius", "fw_clamp"), "noisy-gd": ("rounds", "lr", "clip")}


def sparse_logistic(n: int, seed: int) -> fedkl.FederatedDataset:
    rng = np.random.default_rng(seed)
    w = np.zeros(D)
    support = rng.choice(D, SPARSITY, replace=False)
    w[support] = SCALE * rng.choice([-1.0, 1.0], SPARSITY)
    X = rng.standard_normal((n * RECORDS, D)) / math.sqrt(D)
    p = 1.0 / (1.0 + np.exp(-(X @ w)))
    y = np.where(rng.random(len(p)) < p, 1.0, -1.0)
    users = np.repeat(np.arange(n), RECORDS)
    return fedkl.from_arrays(X, y, users, split_seed=seed, name=f"sparse-logistic-{n}-{seed}")


def run(settings, log) -> dict:
    method, n, seed = settings.method, int(settings.users), int(settings.seed)
    if method not in HYPERPARAMETERS:
        raise ValueError(f"{NAME}: method must be one of {', '.join(HYPERPARAMETERS)}, got {method!r}")
    grid = {k: getattr(settings, k) for k in HYPERPARAMETERS[method]}
    out = tempfile.mkdtemp(prefix="p001-")
    try:
        r = fedkl.train(
            sparse_logistic(n, seed), method, epsilon=settings.epsilon, noise_seed=seed, log=None, out=out, **grid
        )
    finally:
        shutil.rmtree(out, ignore_errors=True)
    acc, loss = r.metrics["accuracy"], r.metrics["loss"]
    log(f"{method} n={n} seed={seed} {grid}: accuracy {acc:.4f}, loss {loss:.4f}")
    return runner_result(
        NAME,
        f"sparse-logistic-d{D}",
        n,
        r.epsilon,
        r.delta,
        seed,
        r.result.get("rounds"),
        {},
        test_metric={"name": "accuracy", "value": acc},
        test_metrics={"accuracy": acc, "loss": loss},
        trivial_baseline={"accuracy": r.baseline["accuracy"]},
    )


register_runner(NAME, run, description=__doc__.splitlines()[0], settings={"method": "noisy-fw"})
