"""The share of a release's eps spent choosing its Delta privately (issue 13 §2): a public rule.

:class:`~fedkl.algorithms.output_perturbation.diameter_output_pert.SelectedDeltaSCOutputPert` spends eps_sel = f eps on
AboveThreshold over the ascending grid Delta_max / r^k (queries -score_j, threshold -kappa/2, noises
rho ~ Lap(2/eps_sel) once and nu_j ~ Lap(4/eps_sel) per query; kappa that of the release) and
releases at Delta_chosen with eps - eps_sel. Privacy holds for EVERY f in (0, 1) (adaptive basic
composition, proof there); f only decides utility, and it must be chosen from public values.

The trade-off. The release's noise is sigma = ratio(eps (1 - f), delta) Delta_chosen: a larger f
raises ratio (ratio ~ eps^-p, p ~ 1-2.5) but brings Delta_chosen closer to the smallest grid value
the data pass. How close depends on the data only through where the deletion scores drop, so the rule
takes the idealised profile of IID users (the case the selection is for): scores capped at 2 kappa + 1
below an unknown jump Delta* and 0 from it on, with Delta* at the grid's middle position L (public). Then, exactly for that profile
(AboveThreshold's law by quadrature over rho), with a = Pr[nu >= rho + 1.5 kappa + 1] (a premature
stop at a capped score) and b = Pr[nu >= rho - kappa/2] (a stop at a passing score) given rho:

* the selection stops at Delta* r^k (k = 0..M-1, M = size - L grid values from Delta* on) with
  probability E_rho[(1 - a)^L (1 - b)^k b]; its noise is ratio r^k Delta*;
* it stops early (probability E_rho[1 - (1 - a)^L]; the release then outputs ⊥: the score
  is beyond the test's depth) or never (it falls back to the largest grid value, r^(M-1) Delta*):
  both are charged the largest grid value's noise ratio r^(M-1) Delta* (⊥ loses the phase; counted as
  no better than not selecting at all).

:func:`ranked_shares` ranks the f of the public grid :data:`SHARES` that minimises this expected
noise J(f) / Delta* = ratio(eps (1 - f)) E[r^K]. ratio and kappa at eps (1 - f) are interpolated
log-linearly from their exact values at eps and eps/2 (the calibrations are costly; both are
power laws in eps to within their integer rounding); the rule is a function of (eps, delta, r, size,
the calibration) only; :func:`release_share` takes the best-ranked share whose release the caller's
public check accepts at its n (a smaller release eps deepens the test). The margin kappa eps_sel / 8 of a passing score is about
ln(1/delta) f / (4 (1 - f)) whatever eps, so the rule's f depends mostly on delta and the grid.
Tests: tests/algorithms/test_delta_share.py (the expectation against a Monte-Carlo run of the
selection on the idealised profile; the chosen f is the grid minimiser; the old fixed 1/4 is kept by
``--p002-select-fraction 0.25``). The rule is the default of ``--p002-select-fraction``: with sc-output-pert's
sqrt(2) grid its share has the least predicted E[sigma^2] on fertility-partition's real scores in every
(m, eps) cell measured (AboveThreshold's exact law; README, "The selection's share of eps").
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np

from fedkl.algorithms.output_perturbation.del_output_pert import DeletionRelease
from fedkl.privacy.sparse_vector import AboveThreshold

SHARES = tuple(float(f) for f in np.round(np.arange(0.05, 0.801, 0.025), 3))


def expected_overshoot(eps_sel: float, kappa: float, grid_ratio: float, grid_size: int, position: int) -> float:
    """E[r^K] of the module docstring's idealised profile (K = grid steps above Delta*; an early stop
    or no stop counts as the largest grid value, K = size - position - 1), from AboveThreshold's exact
    law (:meth:`~fedkl.privacy.sparse_vector.AboveThreshold.law`) on the queries -score_j."""
    if not (eps_sel > 0 and kappa > 0 and grid_ratio > 1 and 0 <= position < grid_size):
        raise ValueError("need eps_sel > 0, kappa > 0, grid_ratio > 1, 0 <= position < grid_size")
    M = grid_size - position
    queries = [-(2.0 * kappa + 1.0)] * position + [0.0] * M
    law = AboveThreshold(eps_sel, -kappa / 2.0).law(queries)
    worst = grid_ratio ** (M - 1)
    cost = [worst] * position + [grid_ratio**k for k in range(M)] + [worst]
    return float(np.dot(law, cost))


def ranked_shares(
    eps: float,
    ratio: Callable[[float], float],
    kappa: Callable[[float], float],
    grid_ratio: float = 2.0,
    grid_size: int = 12,
    position: int | None = None,
) -> tuple[float, ...]:
    """:data:`SHARES` ordered by the expected noise ratio(eps (1 - f)) E[r^K] (module docstring), least
    first; ``ratio(e)``, ``kappa(e)``: sigma/Delta and kappa of the release at eps e (public). A caller
    whose release refuses the best share at its n takes the first one it accepts (still public)."""
    L = grid_size // 2 if position is None else int(position)
    r0, r1 = ratio(eps), ratio(eps / 2)
    k0, k1 = kappa(eps), kappa(eps / 2)
    p_r, p_k = math.log(r1 / r0) / math.log(2.0), math.log(k1 / k0) / math.log(2.0)
    return _ranked(eps, r0, p_r, k0, p_k, float(grid_ratio), int(grid_size), L)


@functools.lru_cache(maxsize=512)
def _ranked(
    eps: float, r0: float, p_r: float, k0: float, p_k: float, grid_ratio: float, size: int, L: int
) -> tuple[float, ...]:
    def cost(f: float) -> float:
        scale = (1.0 - f) ** -p_r
        return r0 * scale * expected_overshoot(f * eps, k0 * (1.0 - f) ** -p_k, grid_ratio, size, L)

    return tuple(sorted(SHARES, key=cost))


@functools.lru_cache(maxsize=512)
def release_shares(
    eps: float, delta: float, calibration: str, test: str, grid_ratio: float = 2.0, grid_size: int = 12
) -> tuple[float, ...]:
    """:func:`ranked_shares` for a stability release at (eps, delta) with ``calibration``; the noise of
    the matching score when ``test`` is "matching", else of the exact/vertex-cover chain (the rule
    depends on the noise's slope in eps, nearly the same for both)."""
    score = "matching" if test == "matching" else "exact"

    def dop(e: float) -> DeletionRelease:
        return DeletionRelease(e, delta, 1.0, calibration, score=score)

    return ranked_shares(eps, lambda e: dop(e).sigma, lambda e: dop(e).kappa, grid_ratio, grid_size)


def release_share(
    eps: float,
    delta: float,
    calibration: str,
    test: str,
    grid_ratio: float = 2.0,
    grid_size: int = 12,
    accepts: Callable[[float], bool] | None = None,
) -> float:
    """The best share of :func:`release_shares` that ``accepts(f)`` (the release's public check at its
    n; None: any); the best one when none is accepted (the release's check then refuses the run)."""
    ranked = release_shares(eps, delta, calibration, test, grid_ratio, grid_size)
    return next((f for f in ranked if accepts is None or accepts(f)), ranked[0])


__all__ = ["SHARES", "expected_overshoot", "ranked_shares", "release_share", "release_shares"]
