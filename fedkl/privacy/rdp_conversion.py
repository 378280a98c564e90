"""RDP of the Poisson-subsampled Gaussian and its conversions to (eps, delta): the classic one, the one
pyvacy / TF-privacy (2019) searched, and dp-accounting's improved one.

fedkl's own accounting (:mod:`fedkl.privacy.accounting`) asks dp-accounting for a schedule's epsilon
(its RDP accountant with the improved conversion, or its PLD accountant). These functions expose the
steps underneath, so that an epsilon printed by older tools can be recomputed and compared (paper 004's
labels 1.22 / 0.57 / 0.28 are the classic conversion: ``simulations/studies/paper004_eps.toml``). Every function
here returns a valid upper bound on the schedule's epsilon at ``delta``; at every order above 1.01 the
improved conversion is below the classic one (by ``ln(a)/(a - 1) - ln(1 - 1/a) > 0``).

The schedule: ``steps`` compositions of the Gaussian mechanism with noise multiplier ``z`` applied to
a Poisson sample of rate ``q`` (add/remove relation, the one under which dp-accounting analyses Poisson
subsampling).

* RDP curve (:func:`rdp_curve`). One step is ``(a, r(a))``-RDP with ``r`` the subsampled-Gaussian bound of
  Mironov, Talwar and Zhang (2019), computed by dp-accounting's
  ``_compute_rdp_poisson_subsampled_gaussian`` (integer and fractional orders ``a > 1``); RDP composes
  additively at each order (Mironov 2017, Prop. 1), so ``steps`` steps are ``(a, steps r(a))``-RDP.
* Classic conversion (:func:`classic_eps`; Mironov 2017, Prop. 3): an ``(a, R)``-RDP mechanism is
  ``(R + ln(1/delta)/(a - 1), delta)``-DP for every ``a > 1``; any order gives a valid bound, the
  function returns the smallest over the orders given. Proof: for outputs P, Q on neighbours and any
  event S, Hoelder's inequality gives ``P(S) = E_Q[(dP/dQ) 1_S] <= E_Q[(dP/dQ)^a]^(1/a) Q(S)^((a-1)/a)
  <= (e^R Q(S))^((a-1)/a)``. If ``e^R Q(S) <= delta^(a/(a-1))`` this is ``<= delta``; otherwise
  ``P(S) <= e^R Q(S) (e^R Q(S))^(-1/a) < e^R Q(S) delta^(-1/(a-1)) = e^(R + ln(1/delta)/(a-1)) Q(S)``.
  Either way ``P(S) <= e^eps Q(S) + delta``.
* pyvacy's search (:func:`pyvacy_eps`): the classic conversion at the order found by pyvacy's
  ``analysis.epsilon`` (72 ternary-search iterations over a continuous order in [1, 512]); a valid
  bound because every order is (the search only decides which).
* Improved conversion (:func:`improved_eps`): dp-accounting's ``compute_epsilon``, ``R + ln(1 - 1/a)
  - ln(delta a)/(a - 1)`` (Balle et al. 2020, Prop. 12; Asoodeh et al. 2021), the conversion of
  dp-accounting's ``RdpAccountant`` and hence of ``fedkl account --accountant rdp`` over the same
  orders; dp-accounting gives no bound (infinity) at orders up to 1.01 and clamps the result at 0.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib


def rdp_curve(q: float, z: float, steps: int, orders) -> np.ndarray:
    """RDP of ``steps`` Poisson-subsampled Gaussian steps (rate ``q``, noise multiplier ``z``) at ``orders``
    (dp-accounting's formula, composed additively)."""
    return steps * np.asarray(rdp_lib._compute_rdp_poisson_subsampled_gaussian(q, z, list(orders)), dtype=float)


def classic_eps(q: float, z: float, steps: int, delta: float, orders) -> tuple[float, float]:
    """``(eps, order)``: the minimum over ``orders`` of the classic conversion
    ``steps r(a) + ln(1/delta)/(a - 1)`` (module docstring)."""
    orders = np.asarray(list(orders), dtype=float)
    eps = rdp_curve(q, z, steps, orders) + math.log(1 / delta) / (orders - 1)
    i = int(np.nanargmin(eps))
    return float(eps[i]), float(orders[i])


def pyvacy_eps(q: float, z: float, steps: int, delta: float) -> tuple[float, float]:
    """``(eps, order)`` as pyvacy's ``analysis.epsilon``: the classic conversion at the order its ternary
    search (72 iterations over [1, 512]) ends on."""
    f = lambda a: classic_eps(q, z, steps, delta, [a])[0]  # noqa: E731
    lo, hi = 1.0, 512.0
    for _ in range(72):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if f(a) < f(b):
            hi = b
        else:
            lo = a
    order = (lo + hi) / 2
    return f(order), order


def improved_eps(q: float, z: float, steps: int, delta: float, orders) -> tuple[float, float]:
    """``(eps, order)``: dp-accounting's improved conversion (``compute_epsilon``) over ``orders``."""
    orders = list(orders)
    eps, order = rdp_lib.compute_epsilon(orders, rdp_curve(q, z, steps, orders), delta)
    return float(eps), float(order)


__all__ = ["classic_eps", "improved_eps", "pyvacy_eps", "rdp_curve"]
