"""The mean-estimation family of note §7 T6(a), for paper 002's experiments and tests.

Loss ``l(theta; x) = 0.5 ||theta - x||^2`` (1-strongly convex, 1-smooth; G-Lipschitz on bounded sets).
User u's objective is ``f_u(theta) = 0.5 ||theta - xbar_u||^2 + const (+ reg/2 ||theta||^2)``, so a user is
fully described by its MEAN xbar_u: :func:`draw_user_means` draws the means exactly from
``N(theta_pop, s^2 I / m)`` (records ``x ~ N(theta_pop, s^2 I)``, m of them per user), which makes
m = 10^12 as cheap as m = 1. The empirical minimizer is ``theta* = mean_u xbar_u`` (exact), the
population minimizer ``theta_pop``.

* :class:`QuadraticMean` - the :class:`~fedkl.problems.base.Problem` (constants only: the data live in
  the federation).
* :class:`MeanFederation` - a :class:`~fedkl.federation.base.Federation` over user means answering the
  queries fedkl's algorithms send (ClippedGradient for noisy GD, GradientsAtPoints and
  the certificate's gradients for SCOutputPert), vectorised.
* :class:`MeanTypeInner` - an EXACT, efficient instance of paper 002's DelOutputPert for this family,
  usable as the inner release of the phased algorithms at any n (the bitmask enumeration of
  SCOutputPert stops at 20 users). Its privacy argument:

  f(y) = argmin_theta mean_{u in y} f_u(theta) + (lam/2)||theta - c||^2 = (mean_{u in y} v_u + lam c)/mu_i,
  v_u = xbar_u, mu_i = 1 + reg + lam. The mechanism is Algorithm 1 with the test predicate
  ``P(y, b): diam{v_u : u in y} <= Delta mu_i (|y| - b - 1)`` in place of ``Dbar_b f(y) <= Delta``. The
  proof of Thm 3.3 uses only (note §2A) (H) heredity, P(y, b) => P(y - i, b - 1) (the diameter can only
  shrink and |y| - b - 1 is unchanged), and (S) soundness, P(y, b) => Dbar_b f(y) <= Delta: for z ⊆ y
  with |z| >= |y| - b >= 2 and i in z, ||f(z) - f(z - i)|| = ||v_i - mean_z v|| / (mu_i (|z| - 1)) <=
  diam(V_y) / (mu_i (|y| - b - 1)) <= Delta. (|y| - b >= 2 holds inside the algorithm because
  |y| - b = n - 4 kappa >= 2 is required: the run refuses smaller n before reading data.) Inside
  Algorithm 1, |y| - b - 1 = n - 4 kappa - 1 for every candidate y = x_{-S}, b = 4 kappa - |S|, so
  X_stable^{R1} is non-empty iff the users can be made pairwise within rho = Delta mu_i (n - 4 kappa - 1)
  by deleting <= R1 of them: dist(x) = the minimum vertex cover of the "conflict graph" (edges between
  users farther apart than rho), computed exactly by fedkl's
  :func:`~fedkl.algorithms.vertex_cover.min_vertex_cover` (capped at 2 kappa: beyond it the output
  is ⊥ for every R1); the chosen set is its canonical minimum cover. Noise, sensitivity and kappa are
  DelOutputPert's (:class:`~fedkl.algorithms.del_output_pert.DelOutputPertConfig`); the release goes
  through :meth:`Releaser.stability_gaussian` (charge, then R1, then the output).

  This is fedkl's :mod:`~fedkl.algorithms.mean_output_pert` mechanism (the note's §5(c)) with
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
from typing import Sequence

import numpy as np
import torch

from fedkl.algorithms.del_output_pert import DelOutputPertConfig
from fedkl.algorithms.phased_common import InnerOutcome, PhaseCall
from fedkl.algorithms.vertex_cover import min_vertex_cover
from fedkl.data.base import UserData
from fedkl.federation.base import (
    Answers,
    ClippedGradient,
    Federation,
    GradientsAtPoints,
)
from fedkl.privacy.release import Releaser
from fedkl.problems.base import Constants, Problem


class QuadraticMean(Problem):
    """``l(theta; x) = 0.5 ||theta - x||^2`` (+ reg/2 ||theta||^2 per user). Constants on ``||x|| <= X``
    (``feature_bound``) and ``||theta|| <= B``: L0 = B + X + reg B, L1 = mu = 1 + reg."""

    name = "quadratic-mean"

    def constants(self, feature_bound: float, param_bound: float | None = None) -> Constants:
        if param_bound is None:
            raise ValueError("the quadratic loss is Lipschitz only on a bounded domain: give param_bound")
        X, B = float(feature_bound), float(param_bound)
        return Constants(B + X + self.reg * B, 1.0 + self.reg, 1.0 + self.reg, f"||x|| <= {X}, ||w|| <= {B}")

    def record_losses(self, w: torch.Tensor, data: UserData) -> torch.Tensor:  # pragma: no cover - not used
        raise NotImplementedError("QuadraticMean keeps its data in a MeanFederation (user means only)")

    def per_user_gradients(self, w: torch.Tensor, data: UserData) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError("QuadraticMean keeps its data in a MeanFederation (user means only)")

    def metrics(self, w: torch.Tensor, data: UserData) -> dict[str, float]:  # pragma: no cover
        raise NotImplementedError


def draw_user_means(n: int, m: float, d: int, theta_pop: torch.Tensor, s: float, seed: int) -> torch.Tensor:
    """n user means, exactly N(theta_pop, s^2 I_d / m) (the mean of m records N(theta_pop, s^2 I_d))."""
    g = np.random.default_rng(seed)
    z = g.standard_normal((n, d))
    return torch.as_tensor(theta_pop, dtype=torch.float64) + torch.from_numpy(z) * (s / math.sqrt(m))


class MeanFederation(Federation):
    """Users described by their means (rows of ``means``); ``grad f_u(w) = w - xbar_u + reg w``."""

    def __init__(self, means: torch.Tensor, reg: float = 0.0, prefix: str = "user") -> None:
        self.means = torch.as_tensor(means, dtype=torch.float64)
        self.reg = float(reg)
        self._ids = tuple(f"{prefix}:{u}" for u in range(self.means.shape[0]))
        self._all = list(range(self.means.shape[0]))
        self.queries = 0

    @property
    def user_ids(self) -> tuple[str, ...]:
        return self._ids

    @property
    def num_params(self) -> int:
        return int(self.means.shape[1])

    def _grads(self, w: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
        return (1.0 + self.reg) * w.to(torch.float64) - means

    def compute(self, query, users: Sequence[int] | None = None) -> Answers:
        if users is None or (len(users) == len(self._all) and list(users) == self._all):
            users, means = self._all, self.means          # everyone (the common case): no gather
        else:
            users = self._users(users)
            means = self.means[torch.as_tensor(users, dtype=torch.long)]
        self.queries += 1
        if isinstance(query, GradientsAtPoints):
            p = query.points.to(torch.float64)
            values = (1.0 + self.reg) * p.unsqueeze(0) - means.unsqueeze(1)
        elif isinstance(query, ClippedGradient):
            g = self._grads(query.w, means)
            norms = g.norm(dim=1, keepdim=True)
            values = g * torch.clamp(query.clip / norms.clamp_min(1e-300), max=1.0)
        else:
            raise TypeError(f"MeanFederation does not answer {type(query).__name__}")
        return Answers(users=users, values=values, failed=[])


# --- the exact mean-type inner release -----------------------------------------------------------
_FP_PAD = 1e-9   # as fedkl.algorithms.mean_output_pert: a missing edge certifies distance <= rho


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
def _unit_config(eps: float, delta: float, calibration: str) -> DelOutputPertConfig:
    """DelOutputPert's constants at Delta = 1. kappa and the TDLap law do not depend on Delta; the
    sensitivity ((8 kappa or 4 kappa + 1) Delta) and sigma (the classic formula, or the analytic
    Gaussian, whose sigma/sensitivity depends only on (eps_bar, delta_bar)) are linear in Delta, so
    scaling these constants IS the calibration at Delta (computed once instead of per call)."""
    return DelOutputPertConfig(eps, delta, 1.0, calibration, max_exact_users=1)


@dataclass
class MeanTypeInner:
    """Exact DelOutputPert for :class:`QuadraticMean` over a :class:`MeanFederation` view (module
    docstring). ``base_mu`` = 1 + reg of the problem; ``calibration`` as DelOutputPertConfig."""

    base_mu: float = 1.0
    calibration: str = "paper"

    def __call__(self, federation: Federation, releaser: Releaser, call: PhaseCall) -> InnerOutcome:
        unit = _unit_config(call.eps, call.delta, self.calibration)   # Delta = 1; sensitivity, sigma ∝ Delta
        sensitivity, sigma = unit.sensitivity * call.Delta, unit.sigma * call.Delta
        if not (call.Delta > 0 and math.isfinite(call.Delta)):
            raise ValueError(f"Delta must be finite and > 0, got {call.Delta}")
        n, k = federation.num_users, unit.kappa
        if n - 4 * k - 1 < 1:
            raise ValueError(f"the mean-type test needs n >= 4 kappa + 2 = {4 * k + 2} users, got {n} "
                             "(refused before reading data)")
        mu = self.base_mu + call.lam
        center = call.center.to(torch.float64)
        # v_u = xbar_u from the gradient at 0: grad f_u(0) = -xbar_u (QuadraticMean, reg * 0 = 0)
        v = -federation.compute(GradientsAtPoints(torch.zeros(1, federation.num_params, dtype=torch.float64)))\
            .values[:, 0, :].to(torch.float64)
        rho = call.Delta * mu * (n - 4 * k - 1)
        adj = conflict_graph(v, rho)
        found = (0, ()) if not adj else min_vertex_cover(adj, 2 * k)   # exact (fedkl.algorithms.vertex_cover)
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
            choose, eps=call.eps, delta=call.delta, deletion_budget=unit.deletion_budget, sensitivity=sensitivity,
            sigma=sigma, user_ids=list(federation.user_ids), label=call.label,
            details={"kappa": k, "Delta": call.Delta, "calibration": self.calibration, "neighbouring": "replace-one",
                     "test": "mean-type diameter predicate (simulations/paper002_mean.py)"})
        return InnerOutcome(theta, sigma, {"decided_by": "mean-type exact", "dist": dist,
                                               "conflict_edges": sum(len(s) for s in adj.values()) // 2})


def gaussian_users_rule(s: float, d: int):
    """The public threshold rule for users with means N(theta_pop, s^2 I/m) and the mean-type test:
    Delta = 2 s (sqrt(d) + sqrt(2 ln(n/beta))) / (sqrt(m) mu (n - 4 kappa - 1)).

    W.p. >= 1 - beta every ||xbar_u - theta_pop|| <= s (sqrt d + sqrt(2 ln(n/beta)))/sqrt(m) (Gaussian
    norm tail + union bound), so the diameter of the means is <= 2 x that and the test passes with
    dist = 0. A utility choice from the public model of the data; any public value is private."""
    def rule(G_call: float, mu: float, n_call: int, m: int, kappa_: int, beta: float) -> float:
        if n_call - 4 * kappa_ - 1 < 1:
            raise ValueError(f"the mean-type test needs n >= 4 kappa + 2 = {4 * kappa_ + 2}, got {n_call}")
        return 2 * s * (math.sqrt(d) + math.sqrt(2 * math.log(n_call / beta))) / (
            math.sqrt(m) * mu * (n_call - 4 * kappa_ - 1))
    return rule


__all__ = ["MeanFederation", "MeanTypeInner", "QuadraticMean", "conflict_graph", "draw_user_means",
           "gaussian_users_rule"]
