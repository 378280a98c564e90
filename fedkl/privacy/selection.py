"""Private selection by random stopping (Papernot & Steinke, "Hyperparameter tuning with Renyi
differential privacy", ICLR 2022): the RDP of a whole hyperparameter search.

The mechanism ``A``. Draw ``K`` from a public distribution with secret randomness; run one base
mechanism ``Q`` (here: one trial = its settings drawn at random from the search space, training and a
private score; :mod:`fedkl.tuning`) ``K`` times independently; release only the best of the ``K``
outputs (by its released score; ``⊥`` when ``K = 0``). ``K`` itself, the losing outputs and the order
of the trials are NOT released: the bounds below are for the best output alone (releasing ``K`` too
would be the best of a known number of trials, which costs up to ``K`` times one trial).

The theorems, stated as implemented. ``Q`` is ``(l, r(l))``-RDP for every order ``l >= 1`` (``r(1)``
the KL bound) under a neighbouring relation; its outputs are totally ordered (score, then a fixed
tie-break). Then ``A`` is ``(l, R(l))``-RDP under the same relation, for every ``l > 1``, with:

* **Truncated negative binomial** ``K ~ D(eta, gamma)``, ``eta > -1``, ``0 < gamma < 1``:
  ``P[K = k] = (1 - gamma)^k / (gamma^-eta - 1) * prod_{j=0}^{k-1} (j + eta)/(j + 1)`` for ``k >= 1``
  (``eta = 0``: the logarithmic law ``(1 - gamma)^k / (k ln(1/gamma))``; ``eta = 1``: geometric).
  Papernot & Steinke, Theorem 2: for every ``l_hat >= 1``,
  ``R(l) = r(l) + (1 + eta)(1 - 1/l_hat) r(l_hat) + (1 + eta) ln(1/gamma)/l_hat + ln(E[K])/(l - 1)``,
  ``E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta))`` (``eta != 0``), ``(1/gamma - 1)/ln(1/gamma)``
  (``eta = 0``). We take the minimum over ``l_hat`` (every ``l_hat`` is valid). For a ``rho``-zCDP
  trial (``r(l) = rho l``) the ``l_hat`` term is ``(1 + eta)(rho (l_hat - 1) + ln(1/gamma)/l_hat)``,
  minimized in closed form at ``l_hat* = max(1, sqrt(ln(1/gamma)/rho))``.
* **Poisson** ``K ~ Poisson(mu)``: Papernot & Steinke, Theorem 6: if ``Q`` is also
  ``(eps_hat, delta_hat)``-DP with ``e^eps_hat <= 1 + 1/(l - 1)``, then
  ``R(l) = r(l) + mu delta_hat + ln(mu)/(l - 1)``. We take ``eps_hat = ln(l/(l - 1))`` (the largest
  allowed) and ``delta_hat`` the RDP-to-DP profile of ``Q`` at ``eps_hat``:
  ``delta_hat = min_a exp((a - 1)(r(a) - eps_hat) + (a - 1) ln(1 - 1/a) - ln a)`` (Canonne, Kamath &
  Steinke 2020, Prop. 12 / Asoodeh et al. 2021; for zCDP the minimum is
  :func:`fedkl.privacy.zcdp.delta_cks`; we minimize over a fixed grid of ``a``: any ``a`` is valid).

(eps, delta): ``A``'s RDP curve is converted by dp-accounting's ``compute_epsilon`` (Balle et al.
2020, Prop. 12: ``eps = R(l) + ln(1 - 1/l) - ln(delta l)/(l - 1)``), minimized over a grid of
orders :data:`ORDERS` (every order gives a valid bound, so a grid is conservative).

Limiting case (a test): as ``eta -> -1``, ``K -> 1`` almost surely and ``E[K] -> 1``, so
``R(l) -> r(l)``: one trial. The constants are checked in ``tests/test_tune.py`` against the exact
Renyi divergence of the best-of-K output of small discrete ``rho``-zCDP mechanisms (randomized
response), computed by direct summation of ``K``'s law.

Trials that are not zCDP-native: the ``grid`` curve. Theorems 2 and 6 need only SOME RDP curve ``r``
of ``Q``, valid at every order, and read it at finitely many orders. A Poisson-subsampled Gaussian
schedule (dp-sgd, dp-fedavg, ...: ``T`` steps of ``PoissonSampled(q, Gaussian(z))``, dp-accounting's
RDP, :func:`fedkl.privacy.rdp_conversion.rdp_curve`) is not ``rho``-zCDP at any useful ``rho``: its
curve is far below ``rho l`` at small orders (amplification) and approaches ``T l / (2 z^2)`` at large
ones. So a search whose space holds such trials bounds every trial by the step curve

    ``c(l) = rho * g+(l)`` for ``l <= max G``, ``c(l) = inf`` above,

with ``G`` = :data:`TRIAL_GRID` (a fixed public grid of orders) and ``g+(l)`` the smallest grid order
``>= l``. Proof that a trial with curve ``r`` is ``c``-RDP whenever ``r(g) <= rho g`` at every ``g`` in
``G``: Renyi divergence is non-decreasing in its order (van Erven & Harremoes 2014, Thm. 3), so for
``l`` in ``(g_{i-1}, g_i]``, ``r(l) <= r(g_i) <= rho g_i = c(l)``; above ``max G`` the claim is void. A
``rho``-zCDP trial (``rho l <= rho g+(l)``) and the ``rho``-zCDP score meet it too. The settings of a
trial are drawn with randomness independent of the data, so ``Q`` is a mixture of mechanisms each
``c``-RDP, and is ``c``-RDP itself: ``exp((l - 1) D_l)`` is jointly convex (van Erven & Harremoes 2014,
Thm. 13), so the mixture's divergence is at most the largest of its components'. Theorems 2 and 6 then
apply with ``r = c``: :func:`search_epsilon` with ``curve="grid"`` (the conversion over the orders of ``G``
only, where ``c`` is tight; the ``l_hat`` and ``a`` minima over their grids, each point a valid choice, ``inf`` terms
never chosen). A scheduled trial's noise multiplier is the smallest (bisection, on the safe side) whose
curve meets ``rho g`` on ``G`` (:func:`schedule_multiplier`), and :func:`schedule_fits` re-checks a run's
schedule from its ledger's record. The grid's step costs only where the theorems read ``c`` off the
grid (the ``l_hat`` and ``a`` minima, and the choice of the conversion's order), paid only by searches
holding a scheduled algorithm.

(eps, delta) trials without an RDP curve (the ``approx-dp`` and ``approx-zcdp`` guarantees: output
perturbation, PTR, stability; ``delta > 0`` makes every Renyi divergence infinite) are not covered by
these theorems; :mod:`fedkl.tuning` refuses them (Liu & Talwar 2019's approximate-DP variant would be
needed).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

STOPPING_RULES = ("poisson", "tnb")
CURVES = ("zcdp", "grid")  # r(l) = rho l at every order, or the step curve rho g+(l) on TRIAL_GRID
# the public orders G at which a scheduled trial's RDP curve is bounded by rho g (module docstring): 1.25 to
# 4.75 by 0.25, the integers 5 to 64, then 72 to 256 by 8 (few fractional orders: dp-accounting's series for
# them is slow); the search's conversion uses these orders (where c is tight), none above 256
TRIAL_GRID = tuple(
    float(x) for x in np.concatenate([np.arange(1.25, 5.0, 0.25), np.arange(5.0, 65.0), np.arange(72.0, 257.0, 8.0)])
)
# the orders l of the search's RDP curve (conversion to (eps, delta)) and the a / l_hat grids
ORDERS = tuple(float(x) for x in 1.0 + np.exp(np.linspace(math.log(0.011), math.log(5000.0), 600)))
_A_GRID = 1.0 + np.exp(np.linspace(math.log(1e-4), math.log(1e7), 3000))
_LHAT_GRID = np.concatenate([[1.0], 1.0 + np.exp(np.linspace(math.log(1e-4), math.log(1e7), 3000))])


@dataclass(frozen=True)
class Stopping:
    """The law of the number of trials ``K``: ``poisson`` (``mu``) or ``tnb`` (``eta``, ``gamma``)."""

    rule: str
    mu: float | None = None
    eta: float | None = None
    gamma: float | None = None

    def __post_init__(self) -> None:
        if self.rule == "poisson":
            if not (self.mu is not None and math.isfinite(self.mu) and self.mu > 0):
                raise ValueError(f"poisson stopping needs mu > 0, got {self.mu}")
            if self.eta is not None or self.gamma is not None:
                raise ValueError("poisson stopping takes mu only")
        elif self.rule == "tnb":
            if not (self.eta is not None and math.isfinite(self.eta) and self.eta > -1):
                raise ValueError(f"truncated negative binomial stopping needs eta > -1, got {self.eta}")
            if not (self.gamma is not None and 0 < self.gamma < 1):
                raise ValueError(f"truncated negative binomial stopping needs 0 < gamma < 1, got {self.gamma}")
            if self.mu is not None:
                raise ValueError("truncated negative binomial stopping takes eta and gamma")
        else:
            raise ValueError(f"stopping rule must be one of {STOPPING_RULES}, got {self.rule!r}")

    @classmethod
    def with_mean(cls, rule: str, mean: float, eta: float = 0.0) -> "Stopping":
        """The law of ``rule`` with ``E[K] = mean`` (``tnb``: at ``eta``, ``gamma`` by bisection; E[K]
        decreases in gamma). ``mean > 1`` for ``tnb`` (``K >= 1``)."""
        if not (math.isfinite(mean) and mean > 0):
            raise ValueError(f"the expected number of trials must be > 0, got {mean}")
        if rule == "poisson":
            return cls("poisson", mu=float(mean))
        if rule != "tnb":
            raise ValueError(f"stopping rule must be one of {STOPPING_RULES}, got {rule!r}")
        if not mean > 1:
            raise ValueError(f"a truncated negative binomial K is >= 1: its mean must be > 1, got {mean}")
        lo, hi = 1e-12, 1 - 1e-12
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if _tnb_mean(eta, mid) > mean:
                lo = mid
            else:
                hi = mid
        return cls("tnb", eta=float(eta), gamma=float(hi))

    @property
    def expected_trials(self) -> float:
        return self.mu if self.rule == "poisson" else _tnb_mean(self.eta, self.gamma)

    def pmf(self, k_max: int) -> np.ndarray:
        """``P[K = k]`` for ``k = 0..k_max`` (by the recursions of the laws above)."""
        p = np.zeros(k_max + 1)
        if self.rule == "poisson":
            logp = -self.mu
            for k in range(k_max + 1):
                p[k] = math.exp(logp)
                logp += math.log(self.mu) - math.log(k + 1)
            return p
        eta, g = self.eta, self.gamma
        if eta == 0:
            for k in range(1, k_max + 1):
                p[k] = (1 - g) ** k / (k * math.log(1 / g))
            return p
        term = 1.0 / math.expm1(-eta * math.log(g))  # 1 / (gamma^-eta - 1)
        for k in range(1, k_max + 1):
            term *= (1 - g) * (k - 1 + eta) / k
            p[k] = term
        return p

    def sample(self, uniform: Callable[[], float]) -> int:
        """One draw of ``K`` by inversion of its CDF from one uniform in [0, 1) (``uniform()``)."""
        u = float(uniform())
        k, cdf, chunk = 0, 0.0, 64
        while True:
            p = self.pmf(k + chunk)
            for j in range(k, k + chunk + 1):
                cdf += p[j]
                if u < cdf:
                    return j
            k += chunk + 1
            chunk *= 2
            if chunk > 1 << 24:  # the remaining mass is below float precision: the CDF's float sum fell short
                return k

    def describe(self) -> str:
        if self.rule == "poisson":
            return f"K ~ Poisson(mu={self.mu:g})"
        return f"K ~ truncated negative binomial(eta={self.eta:g}, gamma={self.gamma:.6g}), E[K]={self.expected_trials:.4g}"


def _tnb_mean(eta: float, gamma: float) -> float:
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * (1 - gamma**eta))


def dp_delta_from_rdp(curve: Callable[[np.ndarray], np.ndarray], eps: float) -> float:
    """``delta`` such that a mechanism with RDP curve ``curve`` is ``(eps, delta)``-DP (module
    docstring; the minimum over the grid of orders ``a``)."""
    a = _A_GRID
    with np.errstate(over="ignore", invalid="ignore"):
        log_d = (a - 1) * (curve(a) - eps) + (a - 1) * np.log1p(-1 / a) - np.log(a)
    return float(min(1.0, math.exp(min(float(np.nanmin(log_d)), 0.0))))


def search_rdp(order: float, curve: Callable[[np.ndarray], np.ndarray], stopping: Stopping) -> float:
    """``R(order)``: the RDP of the whole search at ``order > 1`` for trials with RDP curve ``curve``
    (``curve(array of orders) -> array``; module docstring, Theorems 2 and 6)."""
    if not order > 1:
        raise ValueError(f"the order must be > 1, got {order}")
    r = float(curve(np.array([order]))[0])
    if stopping.rule == "poisson":
        delta_hat = dp_delta_from_rdp(curve, math.log(order / (order - 1)))
        return r + stopping.mu * delta_hat + math.log(stopping.mu) / (order - 1)
    eta, gamma = stopping.eta, stopping.gamma
    lh = _LHAT_GRID
    best = float(np.min((1 - 1 / lh) * curve(lh) + math.log(1 / gamma) / lh))
    return r + (1 + eta) * best + math.log(_tnb_mean(eta, gamma)) / (order - 1)


def search_rdp_zcdp(order: float, rho: float, stopping: Stopping) -> float:
    """:func:`search_rdp` for ``rho``-zCDP trials (``r(l) = rho l``); the TNB ``l_hat`` in closed form."""
    if not (rho > 0 and math.isfinite(rho)):
        raise ValueError(f"rho must be finite and > 0, got {rho}")
    if stopping.rule == "poisson":
        return search_rdp(order, lambda a: rho * a, stopping)
    eta, gamma = stopping.eta, stopping.gamma
    log_g = math.log(1 / gamma)
    lh = max(1.0, math.sqrt(log_g / rho))
    return rho * order + (1 + eta) * (rho * (lh - 1) + log_g / lh) + math.log(_tnb_mean(eta, gamma)) / (order - 1)


def grid_curve(rho: float, grid=TRIAL_GRID) -> Callable[[np.ndarray], np.ndarray]:
    """The step curve ``c(l) = rho * g+(l)`` on ``grid`` (``inf`` above its largest order; module docstring)."""
    g = np.asarray(grid, dtype=float)

    def curve(orders) -> np.ndarray:
        a = np.atleast_1d(np.asarray(orders, dtype=float))
        i = np.searchsorted(g, a, side="left")  # g[i] >= a
        out = np.full(a.shape, np.inf)
        ok = i < len(g)
        out[ok] = rho * g[i[ok]]
        return out

    return curve


def _grid_search_curve(rho: float, stopping: Stopping, orders: np.ndarray) -> np.ndarray:
    """``R(l)`` at ``orders`` (all ``<= max G``) for ``c``-RDP trials, ``c`` = :func:`grid_curve` (``rho``)."""
    c = grid_curve(rho)
    r = c(orders)
    if stopping.rule == "poisson":
        a = np.concatenate([_A_GRID[_A_GRID <= TRIAL_GRID[-1]], TRIAL_GRID])
        ca = c(a)
        eps_hat = np.log(orders / (orders - 1))[:, None]
        log_d = (a - 1) * (ca - eps_hat) + (a - 1) * np.log1p(-1 / a) - np.log(a)
        delta_hat = np.minimum(1.0, np.exp(np.minimum(np.min(log_d, axis=1), 0.0)))
        return r + stopping.mu * delta_hat + math.log(stopping.mu) / (orders - 1)
    lh = np.concatenate([_LHAT_GRID[_LHAT_GRID <= TRIAL_GRID[-1]], TRIAL_GRID])
    with np.errstate(invalid="ignore"):
        term = (1 - 1 / lh) * c(lh) + math.log(1 / stopping.gamma) / lh
    fixed = (1 + stopping.eta) * float(np.min(term))
    return r + fixed + math.log(_tnb_mean(stopping.eta, stopping.gamma)) / (orders - 1)


def schedule_rdp(sampling_rate: float, noise_multiplier: float, steps: int) -> np.ndarray:
    """An RDP bound of ``steps`` Poisson-subsampled Gaussian steps at every order ``g`` of
    :data:`TRIAL_GRID`: the least of (i) dp-accounting's bound at ``g``
    (:func:`fedkl.privacy.rdp_conversion.rdp_curve`; it is ``inf`` at some fractional orders below 2, and
    its fractional-order bound can exceed its bound at the next integer), (ii) its bound at any grid order
    ``g' >= g`` (RDP is non-decreasing in the order), (iii) ``steps g / (2 z^2)``, the unsampled Gaussian's
    (the sampled output is a mixture, on neighbours, of the unsampled mechanism's outputs and of outputs
    equal on both: joint convexity). Each is valid, so their minimum is."""
    from fedkl.privacy.rdp_conversion import rdp_curve

    g = np.asarray(TRIAL_GRID)
    unsampled = steps * g / (2 * noise_multiplier**2)
    if sampling_rate >= 1:
        return unsampled
    with np.errstate(over="ignore", invalid="ignore"):
        r = rdp_curve(sampling_rate, noise_multiplier, int(steps), g)
    r = np.where(np.isnan(r), np.inf, r)
    suffix = np.minimum.accumulate(r[::-1])[::-1]
    return np.minimum(suffix, unsampled)


def schedule_fits(rho: float, sampling_rate: float, noise_multiplier: float, steps: int) -> bool:
    """Whether :func:`schedule_rdp` is at most ``rho g`` at every ``g`` of :data:`TRIAL_GRID` (then the
    schedule is ``c``-RDP for :func:`grid_curve`; module docstring)."""
    return bool(np.all(schedule_rdp(sampling_rate, noise_multiplier, steps) <= rho * np.asarray(TRIAL_GRID)))


@functools.lru_cache(maxsize=256)  # pure; a trial and the preflight ask for the same one
def schedule_multiplier(rho: float, sampling_rate: float, steps: int) -> float:
    """The smallest noise multiplier ``z`` (bisection to 1e-6 relative, returned on the safe side) such
    that the schedule fits ``rho`` on the grid (:func:`schedule_fits`)."""
    if not (rho > 0 and math.isfinite(rho)):
        raise ValueError(f"rho must be finite and > 0, got {rho}")
    hi = max(1e-3, math.sqrt(steps / (2 * rho)))  # no amplification: T l / (2 z^2) <= rho l
    while not schedule_fits(rho, sampling_rate, hi, steps):
        hi *= 2.0  # (rounding at the boundary only)
    lo = hi / 2.0
    while lo > 1e-6 and schedule_fits(rho, sampling_rate, lo, steps):
        lo /= 2.0
    while hi / lo > 1 + 1e-6:
        mid = math.sqrt(lo * hi)
        if schedule_fits(rho, sampling_rate, mid, steps):
            hi = mid
        else:
            lo = mid
    return hi


def search_epsilon(rho: float, stopping: Stopping, delta: float, curve: str = "zcdp") -> float:
    """The search's ``eps`` at ``delta`` for ``rho``-zCDP trials (``curve="zcdp"``) or for trials whose
    RDP is at most ``rho g+(l)`` (``curve="grid"``): its RDP curve over :data:`ORDERS` (those up to
    ``max G`` for ``grid``), converted by dp-accounting's ``compute_epsilon`` (module docstring)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if curve not in CURVES:
        raise ValueError(f"the trials' curve must be one of {CURVES}, got {curve!r}")
    if curve == "grid":
        if not (rho > 0 and math.isfinite(rho)):
            raise ValueError(f"rho must be finite and > 0, got {rho}")
        orders = np.array(TRIAL_GRID)
        eps, _ = rdp_lib.compute_epsilon(list(orders), list(_grid_search_curve(rho, stopping, orders)), delta)
        return float(eps)
    if stopping.rule == "tnb":  # search_rdp_zcdp over every order at once (the same closed form)
        if not (rho > 0 and math.isfinite(rho)):
            raise ValueError(f"rho must be finite and > 0, got {rho}")
        orders = np.array(ORDERS)
        log_g = math.log(1 / stopping.gamma)
        lh = max(1.0, math.sqrt(log_g / rho))
        fixed = (1 + stopping.eta) * (rho * (lh - 1) + log_g / lh)
        curve = list(rho * orders + fixed + math.log(_tnb_mean(stopping.eta, stopping.gamma)) / (orders - 1))
    else:
        curve = [search_rdp_zcdp(o, rho, stopping) for o in ORDERS]
    eps, _ = rdp_lib.compute_epsilon(list(ORDERS), curve, delta)
    return float(eps)


__all__ = [
    "CURVES",
    "ORDERS",
    "TRIAL_GRID",
    "grid_curve",
    "schedule_fits",
    "schedule_multiplier",
    "schedule_rdp",
    "STOPPING_RULES",
    "Stopping",
    "dp_delta_from_rdp",
    "search_epsilon",
    "search_rdp",
    "search_rdp_zcdp",
]
