"""What a release costs, as typed values: the ledger stores the type and its fields, and
:meth:`fedkl.privacy.ledger.PrivacyLedger.verify` recomputes every release's cost from them.

Three kinds, by the notion their cost is stated in:

* :class:`GaussianCharge` — a Gaussian mechanism charged ``rho`` zCDP for a query of L2
  ``sensitivity``: its noise is ``sigma = sensitivity / sqrt(2 rho)`` (rho-zCDP, Bun & Steinke 2016,
  Prop. 1.6). The ledger's exact Gaussian conversion applies to users charged only these.
* :class:`ExponentialCharge` — the exponential mechanism at ``eps`` for utilities of sensitivity
  ``sensitivity``: eps-DP and ``eps^2/8``-zCDP (bounded range, Cesar & Rogers 2021), ``eps^2/2``
  when ``monotone`` (the factor 2 dropped; eps-DP implies eps^2/2-zCDP, Bun & Steinke Prop. 1.4).
* :class:`ApproxDPCharge` — a release whose (eps, delta) is a theorem of the caller (a
  deletion-stability test, a dp-accounting schedule, a PTR test): not zCDP, so a zCDP filter cannot
  account it; the ledger composes it by basic composition. ``mechanism`` names it.
  :data:`APPROX_ZCDP_DELTA` names the one that is instead the delta of approximate zCDP (a PTR test's
  failure probability, Bun & Steinke 2016 Def. 8.1): the user's zCDP charges then hold only
  conditionally, so the Renyi-based conversions (CKS, Bun-Steinke) hold and the ledger's exact Gaussian
  conversion does not (the ledger refuses it for that user).
* :class:`SearchCharge` — a whole private hyperparameter search (:mod:`fedkl.privacy.selection`,
  ``fedkl tune``): ``(eps, delta)``-DP by Papernot & Steinke's random-stopping theorem for trials that
  are each ``rho_trial``-zCDP and a number of trials of law ``stopping`` (``mu``, or ``eta``, ``gamma``).
  Charged once, before any trial, to every enrolled user. Its construction (also when the ledger
  re-reads it in :meth:`~fedkl.privacy.ledger.PrivacyLedger.verify`) recomputes the theorem's eps from
  the recorded parameters and refuses a charge whose recorded eps is below it.

Every charge validates its fields on construction (a bad value is a ValueError before anything
is written) and reports ``cost() -> (rho, eps, delta)``, ``notion`` ("zcdp" or "approx-dp"),
``mechanism``, ``sensitivity`` and ``noise_scale``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence, Union

# the mechanism of a (0, delta) charge that is the delta of approximate zCDP (module docstring)
APPROX_ZCDP_DELTA = "propose-test-release"


def _check(name: str, value: float | None, *, positive: bool = True, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = value is not None and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name} must be finite and {'> 0' if positive else '>= 0'}, got {value}")


@dataclass(frozen=True)
class GaussianCharge:
    """``rho``-zCDP Gaussian release of a query of L2 ``sensitivity`` (None: bookkeeping only)."""

    rho: float
    sensitivity: float | None = None

    mechanism = "gaussian"
    notion = "zcdp"

    def __post_init__(self) -> None:
        _check("rho", self.rho, positive=False)
        _check("sensitivity", self.sensitivity, optional=True)

    @property
    def noise_scale(self) -> float | None:
        if self.sensitivity is None or self.rho == 0:
            return None
        return self.sensitivity / math.sqrt(2.0 * self.rho)

    def cost(self) -> tuple[float, float, float]:
        return self.rho, 0.0, 0.0


@dataclass(frozen=True)
class ExponentialCharge:
    """Exponential mechanism at ``eps`` (utilities of sensitivity ``sensitivity``)."""

    eps: float
    sensitivity: float
    monotone: bool = False

    mechanism = "exponential"
    notion = "zcdp"

    def __post_init__(self) -> None:
        _check("eps", self.eps)
        _check("sensitivity", self.sensitivity)

    @property
    def rho(self) -> float:
        return self.eps**2 / 2.0 if self.monotone else self.eps**2 / 8.0

    @property
    def noise_scale(self) -> float:
        """The scale of the Gumbel noise whose report-noisy-max is this mechanism."""
        return (1.0 if self.monotone else 2.0) * self.sensitivity / self.eps

    def cost(self) -> tuple[float, float, float]:
        return self.rho, 0.0, 0.0


@dataclass(frozen=True)
class ApproxDPCharge:
    """A release whose (eps, delta)-DP is the caller's theorem; ``mechanism`` names it, and
    ``sensitivity``/``noise_scale`` (optional) record the noise it draws."""

    eps: float
    delta: float
    mechanism: str
    sensitivity: float | None = None
    noise_scale: float | None = None

    notion = "approx-dp"

    def __post_init__(self) -> None:
        _check("eps", self.eps, positive=False)
        _check("delta", self.delta, positive=False)
        if not self.delta < 1:
            raise ValueError(f"delta must be < 1, got {self.delta}")
        if not (isinstance(self.mechanism, str) and self.mechanism):
            raise ValueError("an (eps, delta) charge names its mechanism")
        _check("sensitivity", self.sensitivity, optional=True)
        _check("noise_scale", self.noise_scale, optional=True)

    def cost(self) -> tuple[float, float, float]:
        return 0.0, self.eps, self.delta


@dataclass(frozen=True)
class SearchCharge:
    """A private selection over ``rho_trial``-zCDP trials (``curve="zcdp"``), or over trials whose RDP is
    at most ``rho_trial g+(l)`` on :data:`fedkl.privacy.selection.TRIAL_GRID` (``curve="grid"``: a space
    with dp-accounting schedules), ``(eps, delta)``-DP (module docstring)."""

    eps: float
    delta: float
    rho_trial: float
    stopping: str
    mu: float | None = None
    eta: float | None = None
    gamma: float | None = None
    curve: str = "zcdp"

    mechanism = "private-selection"
    notion = "approx-dp"
    sensitivity = None
    noise_scale = None

    def __post_init__(self) -> None:
        from fedkl.privacy.selection import Stopping, search_epsilon

        _check("eps", self.eps)
        _check("rho_trial", self.rho_trial)
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        law = Stopping(self.stopping, self.mu, self.eta, self.gamma)
        bound = search_epsilon(self.rho_trial, law, self.delta, self.curve)
        if not bound <= self.eps * (1 + 1e-9):
            raise ValueError(
                f"a search of {self.rho_trial:g}-{'zCDP' if self.curve == 'zcdp' else 'grid-RDP'} trials ({self.stopping}) is ({bound:.6g}, {self.delta:g})-DP, "
                f"more than the charge's eps={self.eps:g}"
            )

    def cost(self) -> tuple[float, float, float]:
        return 0.0, self.eps, self.delta


Charge = Union[GaussianCharge, ExponentialCharge, ApproxDPCharge, SearchCharge]
CHARGE_TYPES: dict[str, type] = {
    c.__name__: c for c in (GaussianCharge, ExponentialCharge, ApproxDPCharge, SearchCharge)
}


class Need(NamedTuple):
    """What a run will charge ``users`` in all (one typed charge whose cost is the sum of their releases'),
    computed from public values before any data is read: an algorithm's ``needs()``, checked once by
    :meth:`fedkl.privacy.ledger.PrivacyLedger.check`."""

    users: Sequence[str]
    charge: Charge


def to_record(charge: Charge) -> dict:
    """The stored form: ``{"type": class name, **fields}``."""
    if type(charge) not in CHARGE_TYPES.values():
        raise TypeError(
            f"not a charge: {charge!r} (use GaussianCharge, ExponentialCharge, ApproxDPCharge or SearchCharge)"
        )
    return {"type": type(charge).__name__, **asdict(charge)}


def from_record(record: dict) -> Charge:
    fields = dict(record)
    kind = fields.pop("type", None)
    if kind not in CHARGE_TYPES:
        raise ValueError(f"unknown charge type {kind!r}")
    return CHARGE_TYPES[kind](**fields)


__all__ = [
    "APPROX_ZCDP_DELTA",
    "ApproxDPCharge",
    "CHARGE_TYPES",
    "Charge",
    "ExponentialCharge",
    "GaussianCharge",
    "Need",
    "SearchCharge",
    "from_record",
    "to_record",
]
