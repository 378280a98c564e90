"""An EXACT, efficient instance of paper 002's DelOutputPert for the quadratic mean family
(:class:`~fedkl.problems.quadratic_mean.QuadraticMean` over a :class:`~fedkl.federation.means.MeanFederation`),
usable as the inner release of the phased algorithms at any n (the bitmask enumeration of SCOutputPert
stops at 20 users), and the public threshold rule :func:`gaussian_users_rule` that goes with it.

Privacy argument of :class:`MeanTypeInner`:

  f(y) = argmin_theta mean_{u in y} f_u(theta) + (lam/2)||theta - c||^2 = (mean_{u in y} v_u + lam c)/mu_i,
  v_u = xbar_u, mu_i = 1 + reg + lam. The mechanism is Algorithm 1 with the test predicate
  ``P(y, b): diam{v_u : u in y} <= Delta mu_i (|y| - b - 1)`` in place of ``Dbar_b f(y) <= Delta``. The
  proof of Thm 3.3 uses only (docs/derivations/paper-002.md §2A) (H) heredity, P(y, b) => P(y - i, b - 1) (the diameter can only
  shrink and |y| - b - 1 is unchanged), and (S) soundness, P(y, b) => Dbar_b f(y) <= Delta: for z ⊆ y
  with |z| >= |y| - b >= 2 and i in z, ||f(z) - f(z - i)|| = ||v_i - mean_z v|| / (mu_i (|z| - 1)) <=
  diam(V_y) / (mu_i (|y| - b - 1)) <= Delta. (|y| - b >= 2 holds inside the algorithm because
  |y| - b = n - 4 kappa >= 2 is required: the run refuses smaller n before reading data.) Inside
  Algorithm 1, |y| - b - 1 = n - 4 kappa - 1 for every candidate y = x_{-S}, b = 4 kappa - |S|, so
  X_stable^{R1} is non-empty iff the users can be made pairwise within rho = Delta mu_i (n - 4 kappa - 1)
  by deleting <= R1 of them: dist(x) = the minimum vertex cover of the "conflict graph" (edges between
  users farther apart than rho), computed exactly by fedkl's
  :func:`~fedkl.algorithms.output_perturbation.vertex_cover.min_vertex_cover` (capped at 2 kappa: beyond it the output
  is ⊥ for every R1); the chosen set is its canonical minimum cover. Noise, sensitivity and kappa are
  DelOutputPert's (:class:`~fedkl.algorithms.output_perturbation.del_output_pert.DeletionRelease`); the release goes
  through :meth:`Releaser.stability_gaussian` (charge, then R1, then the output).

  This is fedkl's :mod:`~fedkl.algorithms.output_perturbation.mean_output_pert` mechanism (docs/derivations/paper-002.md §5(c)) with
  v_u = user u's exact regularized minimizer (x̄_u + lam c)/mu_i, whose mean IS the phase minimizer
  for this loss, so here it is DelOutputPert of the paper's f. Differences, for speed at n up to
  64,000 and kappa' up to ~600 (Phased-ERM's per-phase kappa): the conflict graph is built in O(n d)
  via the centroid (same padded edge rule), and there is no worst-case work cap (fedkl's refuses
  2 kappa > 40 before reading data, because the FPT bound 1.38^(2 kappa) is astronomical): the time
  of the search depends on the data (empty graphs here). It is therefore an evaluation tool, not a
  deployment: its output law is the exact mechanism's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fedkl.algorithms.output_perturbation.del_output_pert import DeletionRelease
from fedkl.algorithms.output_perturbation.phased_common import InnerOutcome, PhaseCall
from fedkl.algorithms.output_perturbation.vertex_cover import min_vertex_cover
from fedkl.federation.base import Federation, GradientsAtPoints
from fedkl.privacy.release import Releaser

_FP_PAD = 1e-9  # as fedkl.algorithms.output_perturbation.mean_output_pert: a missing edge certifies distance <= rho


def conflict_graph(v: torch.Tensor, rho: float) -> dict[int, set[int]]:
    """Edges between users whose vectors are farther apart than rho (padded: an edge whenever the
    computed distance exceeds rho (1 - 1e-9), so a missing edge certifies distance <= rho). Only
    users farther than rho'/2 from the centroid can have an edge (triangle inequality), so only they
    are compared with everyone: O(n d) when users are IID (no O(n^2) distance matrix)."""
    v = v.to(torch.float64)
    rho_p = rho * (1 - _FP_PAD)
    centre = v.mean(0)
    far = torch.nonzero((v - centre).norm(dim=1) > rho_p * (1 - _FP_PAD) / 2).flatten().tolist()
    adj: dict[int, set[int]] = {}
    for u in far:
        for w in torch.nonzero((v - v[u]).norm(dim=1) > rho_p).flatten().tolist():
            adj.setdefault(u, set()).add(w)
            adj.setdefault(w, set()).add(u)
    return adj


@functools.lru_cache(maxsize=1024)
def _unit_config(eps: float, delta: float, calibration: str) -> DeletionRelease:
    """DelOutputPert's constants at Delta = 1. kappa and the TDLap law do not depend on Delta; the
    sensitivity ((8 kappa or 4 kappa + 1) Delta) and sigma (the classic formula, or the analytic
    Gaussian, whose sigma/sensitivity depends only on (eps_bar, delta_bar)) are linear in Delta, so
    scaling these constants IS the calibration at Delta (computed once instead of per call)."""
    return DeletionRelease(eps, delta, 1.0, calibration, max_exact_users=1)


@dataclass
class MeanTypeInner:
    """Exact DelOutputPert for QuadraticMean over a MeanFederation view (module docstring).
    ``base_mu`` = 1 + reg of the problem; ``calibration`` as DeletionRelease."""

    base_mu: float = 1.0
    calibration: str = "paper"

    def __call__(self, federation: Federation, releaser: Releaser, call: PhaseCall) -> InnerOutcome:
        unit = _unit_config(call.eps, call.delta, self.calibration)  # Delta = 1; sensitivity, sigma ∝ Delta
        sensitivity, sigma = unit.sensitivity * call.Delta, unit.sigma * call.Delta
        if not (call.Delta > 0 and math.isfinite(call.Delta)):
            raise ValueError(f"Delta must be finite and > 0, got {call.Delta}")
        n, k = federation.num_users, unit.kappa
        if n - 4 * k - 1 < 1:
            raise ValueError(
                f"the mean-type test needs n >= 4 kappa + 2 = {4 * k + 2} users, got {n} (refused before reading data)"
            )
        mu = self.base_mu + call.lam
        center = call.center.to(torch.float64)
        # v_u = xbar_u from the gradient at 0: grad f_u(0) = -xbar_u (QuadraticMean, reg * 0 = 0)
        v = (
            -federation.compute(GradientsAtPoints(torch.zeros(1, federation.num_params, dtype=torch.float64)))
            .values[:, 0, :]
            .to(torch.float64)
        )
        # a failed user's row is zero (the federation's rule); a non-finite one is set to zero too, so the run
        # never aborts on an answer (issue 28 §2): the point asked is public, so the row is a function of that
        # user alone, and the test's proof holds for any vectors
        v = torch.where(torch.isfinite(v).all(dim=1, keepdim=True), v, torch.zeros((), dtype=v.dtype))
        rho = call.Delta * mu * (n - 4 * k - 1)
        adj = conflict_graph(v, rho)
        found = (
            (0, ()) if not adj else min_vertex_cover(adj, 2 * k)
        )  # exact (fedkl.algorithms.output_perturbation.vertex_cover)
        cover = None if found is None else list(found[1])
        if cover is None:
            value = None
        else:
            drop = frozenset(cover)
            kept = v if not drop else v[[u for u in range(n) if u not in drop]]
            value = (kept.mean(0) + call.lam * center) / mu
        dist = None if cover is None else len(cover)

        def choose(r1: int) -> torch.Tensor | None:
            return value if dist is not None and dist <= r1 else None

        theta = releaser.stability_gaussian(
            choose,
            eps=call.eps,
            delta=call.delta,
            deletion_budget=unit.deletion_budget,
            sensitivity=sensitivity,
            sigma=sigma,
            user_ids=list(federation.user_ids),
            label=call.label,
            details={
                "kappa": k,
                "Delta": call.Delta,
                "calibration": self.calibration,
                "neighbouring": "replace-one",
                "test": "mean-type diameter predicate (fedkl/algorithms/output_perturbation/mean_type_inner.py)",
            },
        )
        return InnerOutcome(
            theta,
            sigma,
            {"decided_by": "mean-type exact", "dist": dist, "conflict_edges": sum(len(s) for s in adj.values()) // 2},
        )


def gaussian_users_rule(s: float, d: int):
    """The public threshold rule for users with means N(theta_pop, s^2 I/m) and the mean-type test:
    Delta = 2 s (sqrt(d) + sqrt(2 ln(n/beta))) / (sqrt(m) mu (n - 4 kappa - 1)).

    W.p. >= 1 - beta every ||xbar_u - theta_pop|| <= s (sqrt d + sqrt(2 ln(n/beta)))/sqrt(m) (Gaussian
    norm tail + union bound), so the diameter of the means is <= 2 x that and the test passes with
    dist = 0. A utility choice from the public model of the data; any public value is private."""

    def rule(G_call: float, mu: float, n_call: int, m: int, kappa_: int, beta: float) -> float:
        if n_call - 4 * kappa_ - 1 < 1:
            raise ValueError(f"the mean-type test needs n >= 4 kappa + 2 = {4 * kappa_ + 2}, got {n_call}")
        return (
            2
            * s
            * (math.sqrt(d) + math.sqrt(2 * math.log(n_call / beta)))
            / (math.sqrt(m) * mu * (n_call - 4 * kappa_ - 1))
        )

    return rule


__all__ = ["MeanTypeInner", "conflict_graph", "gaussian_users_rule"]
