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

This first version accounts ``rho``-zCDP trials only (:class:`fedkl.tuning` refuses other algorithms);
the functions take the trial's RDP curve ``r`` where that generality is free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

STOPPING_RULES = ("poisson", "tnb")
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


def search_epsilon(rho: float, stopping: Stopping, delta: float) -> float:
    """The search's ``eps`` at ``delta`` for ``rho``-zCDP trials: its RDP curve over :data:`ORDERS`,
    converted by dp-accounting's ``compute_epsilon`` (module docstring)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
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
    "ORDERS",
    "STOPPING_RULES",
    "Stopping",
    "dp_delta_from_rdp",
    "search_epsilon",
    "search_rdp",
    "search_rdp_zcdp",
]
