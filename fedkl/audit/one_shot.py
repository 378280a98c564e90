"""The one-shot empirical privacy ESTIMATE for federated learning (Andrew, Kairouz, Oh, Oprea,
McMahan, Suriyakumar 2023): ``canaries`` canary users whose gradients point along random unit
directions are all included in ONE training; the cosine of the released model with each canary's
direction is compared with its cosine with as many fresh random directions that were never inserted.
With both samples fitted by Gaussians, ``mu = (mean_in - mean_out) / std_out`` and the estimate is
the eps at delta of mu-GDP (:func:`fedkl.audit.bounds.gaussian_epsilon`).

This is an ESTIMATE (no confidence level, an equal-variance Gaussian fit): unlike the many-run and
one-run bounds it is not a valid lower bound, and it never yields a VIOLATION verdict (the report
says "estimate above claim" instead). It is cheap and tracks the noise level, which is what it is for.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from fedkl.audit.bounds import gaussian_epsilon
from fedkl.audit.release import audit_config, claimed_delta, released_model
from fedkl.audit.report import FAILED, Statistics, audited_settings, histogram, noise_seed, refused, write_report
from fedkl.audit.settings import small_settings
from fedkl.audit.worlds import random_direction_canaries


def one_shot_estimate(
    algorithm: str,
    epsilon: float,
    out: str,
    *,
    canaries: int = 100,
    canary_dim: int = 200,
    settings: dict | None = None,
    seed: int = 0,
    base: int = 40,
    records: int = 10,
    log: Callable[[str], None] = print,
) -> dict:
    """The estimate (module docstring); ``canary_dim``: the dimension the canary directions live in."""
    cfg = audit_config(algorithm, epsilon, small_settings(algorithm, settings))
    rng = np.random.default_rng([seed, 11])
    directions = rng.normal(size=(2 * canaries, canary_dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    world = random_direction_canaries(directions[:canaries], base=base, records=records, seed=seed)
    delta = claimed_delta(cfg, world)
    report = {
        "method": "one-shot",
        "algorithm": algorithm,
        "claimed": {"epsilon": epsilon, "delta": delta, "neighbouring": cfg.neighbouring},
        "setting": {"users": world.train.num_users, "canaries": canaries, "canary_dim": canary_dim, "seed": seed},
        "settings": audited_settings(cfg),
        "statistic": "cosine of the released model with each inserted canary's direction vs with unused directions",
    }
    stats = Statistics(out, {k: report[k] for k in ("method", "algorithm", "claimed", "setting", "settings")})
    if (0, 0) not in stats.done:
        try:
            w = released_model(cfg, world, noise_seed(seed, 0, 0))
        except ValueError as e:
            return refused(out, report, str(e), log)
        except Exception as e:  # an algorithm's crash is reported as such
            return refused(out, report, f"{type(e).__name__}: {e}", log, verdict=FAILED)
        if w is None:
            cos = np.full(2 * canaries, math.nan)
        else:
            v = w.numpy()[-canary_dim:]
            cos = directions @ v / max(float(np.linalg.norm(v)), 1e-300)
        for i, c in enumerate(cos):
            stats.add(i // canaries, i % canaries, float(c))
    inside = np.array([stats.done[(0, i)] for i in range(canaries)])
    unused = np.array([stats.done[(1, i)] for i in range(canaries)])
    if np.isnan(inside).all():
        mu, est = math.nan, math.nan
    else:
        gap, spread = float(inside.mean() - unused.mean()), float(unused.std(ddof=1))
        # a model with nothing in the canaries' subspace: every cosine 0, the canaries invisible
        mu = gap / spread if spread > 0 else (0.0 if gap == 0 else math.copysign(math.inf, gap))
        est = gaussian_epsilon(mu, delta)
    report.update(
        epsilon_estimate=est,
        gdp_mu=mu,
        epsilon_lower_bound=None,
        verdict="no model released (⊥)"
        if math.isnan(est)
        else "estimate above claim"
        if est > epsilon
        else "estimate below claim",
    )
    histogram(
        os.path.join(out, "histogram.png"),
        {"inserted canaries": inside, "unused directions": unused},
        "cosine with the released model",
        f"{algorithm}: claimed eps={epsilon:g}, one-shot estimate {est:.3g} (Andrew et al. 2023)",
    )
    write_report(out, report)
    return report
