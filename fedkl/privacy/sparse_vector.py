"""AboveThreshold (the sparse vector technique with one positive answer), with its exact output law.

Given queries ``q_1, ..., q_k`` that each change by at most ``sensitivity`` between neighbouring
datasets (any direction, each query independently), a public threshold ``T`` and ``eps``:

    rho ~ Lap(2 sensitivity / eps);  for i = 1..k: nu_i ~ Lap(4 sensitivity / eps);
    output the first i with q_i + nu_i >= T + rho, or None if there is none.

Guarantee: **eps-DP** (pure) for the output index, whatever k (Dwork & Roth 2014, Thm 3.23; Lyu, Su
& Li 2017, Alg. 1 with c = 1, eps_1 = eps_2 = eps/2). Proof sketch (the standard one): fix the
query noises of the indices before i and condition on them; the event "output i" is
{max_{j<i} (q_j + nu_j) < T + rho <= q_i + nu_i}. Shifting rho by sensitivity (density ratio
e^{eps/2}) makes the first inequality hold on the neighbour, and shifting nu_i by 2 sensitivity
(density ratio e^{eps/2}) the second; both shifts are measure-preserving bijections, so
Pr[i | x] <= e^eps Pr[i | x']. The event None is the same argument with the second step absent.
The candidates' ORDER and the threshold must be public; the queries may depend on the data only
through values of bounded sensitivity.

:meth:`AboveThreshold.law` computes the exact output distribution for given query values by
integrating over rho (piecewise-exponential integrand, Gauss-Legendre on each smooth piece, ~1e-14
accuracy): tests audit ``Pr[i | x] <= e^eps Pr[i | x']`` on neighbouring query vectors with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fedkl.privacy.rng import NoiseSource


def _laplace_cdf(x: np.ndarray, b: float) -> np.ndarray:
    return np.where(x < 0, 0.5 * np.exp(np.minimum(x, 0) / b), 1.0 - 0.5 * np.exp(-np.maximum(x, 0) / b))


@dataclass(frozen=True)
class AboveThreshold:
    eps: float
    threshold: float
    sensitivity: float = 1.0

    def __post_init__(self) -> None:
        for name in ("eps", "sensitivity"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and > 0, got {v}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be finite, got {self.threshold}")

    @property
    def threshold_scale(self) -> float:
        return 2.0 * self.sensitivity / self.eps

    @property
    def query_scale(self) -> float:
        return 4.0 * self.sensitivity / self.eps

    def _queries(self, queries: Sequence[float]) -> np.ndarray:
        q = np.asarray(queries, dtype=np.float64)
        if q.ndim != 1 or q.size == 0 or not np.isfinite(q).all():
            raise ValueError("queries must be a non-empty 1-D sequence of finite numbers")
        return q

    def select(self, queries: Sequence[float], noise: NoiseSource) -> int | None:
        """The first index whose noisy query reaches the noisy threshold, or None."""
        q = self._queries(queries)
        rho = float(noise.laplace(1, self.threshold_scale)[0])
        nu = noise.laplace(q.size, self.query_scale).double().numpy()
        above = np.nonzero(q + nu >= self.threshold + rho)[0]
        return int(above[0]) if above.size else None

    def law(self, queries: Sequence[float], nodes: int = 64) -> np.ndarray:
        """``[Pr[0], ..., Pr[k-1], Pr[None]]`` for these query values, by exact quadrature over rho."""
        q = self._queries(queries)
        b_rho, b_nu = self.threshold_scale, self.query_scale
        # the integrand's kinks: rho = 0 (its density) and rho = q_i - T (a query's cdf); tails to 80 scales
        span = 80.0 * max(b_rho, b_nu)
        kinks = np.concatenate(([0.0], q - self.threshold))
        points = np.unique(np.concatenate((kinks, [kinks.min() - span, kinks.max() + span])))
        segments = []
        for lo, hi in zip(points[:-1], points[1:]):  # split long pieces so each is smooth and short
            pieces = max(1, int(math.ceil((hi - lo) / (0.5 * min(b_rho, b_nu)))))
            edges = np.linspace(lo, hi, pieces + 1)
            segments.extend(zip(edges[:-1], edges[1:]))
        x, w = np.polynomial.legendre.leggauss(nodes)
        lo = np.array([s[0] for s in segments])[:, None]
        hi = np.array([s[1] for s in segments])[:, None]
        r = (0.5 * (hi - lo) * x[None, :] + 0.5 * (hi + lo)).ravel()
        weight = (0.5 * (hi - lo) * w[None, :]).ravel() * np.exp(-np.abs(r) / b_rho) / (2.0 * b_rho)
        below = _laplace_cdf(self.threshold + r[None, :] - q[:, None], b_nu)  # Pr[q_i + nu_i < T + r]
        before = np.cumprod(np.vstack((np.ones_like(r), below)), axis=0)  # Pr[all earlier below]
        out = np.empty(q.size + 1)
        out[:-1] = (before[:-1] * (1.0 - below) * weight).sum(axis=1)
        out[-1] = (before[-1] * weight).sum()
        return out


__all__ = ["AboveThreshold"]
