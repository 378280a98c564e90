"""Noise mechanisms. Each one is calibrated from an explicit sensitivity and states its guarantee.

The neighbouring relation is the caller's: a mechanism is DP with respect to whatever relation the
given sensitivity was computed under. In fedkl the unit is the USER: the sensitivity is the largest
change of the query when all records of one user change (replace-one) or one user is removed /
added (add-remove); the algorithm that calls the mechanism states which.

Noise comes from a :class:`~fedkl.privacy.rng.NoiseSource` (os.urandom unless explicitly seeded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedkl.privacy.rng import NoiseSource


def _check_positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, got {value}")


def _check_query(value: torch.Tensor) -> None:
    if not torch.is_tensor(value):
        raise TypeError(f"the query value must be a torch tensor, got {type(value).__name__}")
    if not torch.isfinite(value).all():
        raise ValueError("the query value contains NaN or inf: refusing to release it")


def _add_noise(value: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``value + noise`` computed in float64, THEN cast to ``value``'s dtype.

    The cast is post-processing of the float64 mechanism output. Casting the noise first is not:
    for an integer tensor it truncates the noise towards zero (``v + trunc(Z)`` is not a function of
    ``v + Z``, and its Renyi divergence exceeds the claimed ``alpha * rho``).
    """
    return (value.to(torch.float64) + noise).to(value.dtype)


@dataclass(frozen=True)
class GaussianMechanism:
    """``M(x) = q(x) + N(0, sigma^2 I)`` for a vector query ``q`` with L2 sensitivity ``sensitivity``.

    Guarantees (same noise, two views):
      * ``rho``-zCDP with ``rho = sensitivity^2 / (2 sigma^2)`` (Bun & Steinke 2016, Prop. 1.6);
      * (eps, delta)-DP for every delta with eps from the exact analytic Gaussian characterisation
        of Balle & Wang (2018, Thm. 8): ``Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D) <= delta``,
        evaluated by dp-accounting's ``get_epsilon_gaussian`` / ``get_sigma_gaussian``.
    """

    sensitivity: float
    sigma: float

    def __post_init__(self) -> None:
        _check_positive("sensitivity", self.sensitivity)
        _check_positive("sigma", self.sigma)

    @classmethod
    def from_zcdp(cls, sensitivity: float, rho: float) -> "GaussianMechanism":
        """sigma = sensitivity / sqrt(2 rho)."""
        _check_positive("rho", rho)
        return cls(sensitivity, sensitivity / math.sqrt(2.0 * rho))

    @classmethod
    def analytic(cls, sensitivity: float, eps: float, delta: float) -> "GaussianMechanism":
        """The smallest sigma giving (eps, delta)-DP (Balle & Wang 2018), any eps > 0."""
        _check_positive("eps", eps)
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        import dp_accounting  # here, not at import: ~0.6 s that `fedkl --help` does not need

        return cls(sensitivity, sensitivity * dp_accounting.get_sigma_gaussian(eps, delta))

    @property
    def noise_multiplier(self) -> float:
        return self.sigma / self.sensitivity

    @property
    def rho(self) -> float:
        return self.sensitivity**2 / (2.0 * self.sigma**2)

    def epsilon(self, delta: float) -> float:
        """Exact (analytic) eps of ONE release at delta."""
        import dp_accounting

        return dp_accounting.get_epsilon_gaussian(self.noise_multiplier, delta)

    def privatize(self, value: torch.Tensor, noise: NoiseSource) -> torch.Tensor:
        _check_query(value)
        return _add_noise(value, noise.gaussian(tuple(value.shape), self.sigma))


@dataclass(frozen=True)
class LaplaceMechanism:
    """``M(x) = q(x) + Lap(b)^k`` for a query with L1 sensitivity ``sensitivity``; b = sensitivity/eps.

    Guarantee: eps-DP (pure); hence (eps^2/2)-zCDP (Bun & Steinke 2016, Prop. 1.4).
    """

    sensitivity: float
    eps: float

    def __post_init__(self) -> None:
        _check_positive("sensitivity", self.sensitivity)
        _check_positive("eps", self.eps)

    @property
    def scale(self) -> float:
        return self.sensitivity / self.eps

    @property
    def rho(self) -> float:
        return self.eps**2 / 2.0

    def privatize(self, value: torch.Tensor, noise: NoiseSource) -> torch.Tensor:
        _check_query(value)
        return _add_noise(value, noise.laplace(tuple(value.shape), self.scale))


@dataclass(frozen=True)
class TruncatedDiscreteLaplace:
    """TDLap(eps, delta) of paper 002, Definition 3.4 (shifted, truncated discrete Laplace).

    ``kappa = 1 + ceil(ln(1/delta)/eps)``; support {0, ..., 2 kappa}; ``Pr[x] ∝ exp(-eps |x - kappa|)``.
    Facts the PTR analysis uses (checked in tests): ``Pr[0] = Pr[2 kappa] <= delta`` and
    ``Pr[r] <= e^eps Pr[r +- 1]`` inside the support. This is a noise *distribution*, not a
    mechanism by itself: paper 002 uses it as the noisy deletion budget R1 of its stability test.
    """

    eps: float
    delta: float

    def __post_init__(self) -> None:
        _check_positive("eps", self.eps)
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")

    @property
    def kappa(self) -> int:
        return 1 + math.ceil(math.log(1.0 / self.delta) / self.eps)

    def support(self) -> np.ndarray:
        return np.arange(2 * self.kappa + 1)

    def log_weights(self) -> np.ndarray:
        return -self.eps * np.abs(self.support() - self.kappa).astype(np.float64)

    def pmf(self) -> np.ndarray:
        w = np.exp(self.log_weights())
        return w / w.sum()

    def sample(self, noise: NoiseSource) -> int:
        return noise.categorical(self.log_weights())


@dataclass(frozen=True)
class _Selection:
    """Common fields of the mechanisms that privately select one index from a utility vector."""

    eps: float
    sensitivity: float
    monotone: bool = False

    def __post_init__(self) -> None:
        _check_positive("eps", self.eps)
        _check_positive("sensitivity", self.sensitivity)

    @staticmethod
    def _utilities(utilities: np.ndarray) -> np.ndarray:
        u = np.asarray(utilities, dtype=np.float64)
        if u.ndim != 1 or u.size == 0 or not np.isfinite(u).all():
            raise ValueError("utilities must be a non-empty 1-D array of finite numbers")
        return u


@dataclass(frozen=True)
class ExponentialMechanism(_Selection):
    """Select index i with probability ∝ ``exp(eps * u_i / (2 * sensitivity))`` (McSherry & Talwar 2007).

    ``sensitivity`` bounds ``|u_i(x) - u_i(x')|`` for every candidate i and neighbours x, x'.
    Guarantee: eps-DP; it is eps-bounded-range (Durfee & Rogers 2019), hence (eps^2/8)-zCDP
    (Cesar & Rogers 2021, "Bounding, concentrating, and truncating"). With ``monotone=True``
    (all utilities move in the same direction between neighbours) the factor 2 is dropped and the
    guarantee is eps-DP, (eps^2/2)-zCDP.
    """

    @property
    def rho(self) -> float:
        return self.eps**2 / 2.0 if self.monotone else self.eps**2 / 8.0

    def log_weights(self, utilities: np.ndarray) -> np.ndarray:
        u = self._utilities(utilities)
        factor = 1.0 if self.monotone else 2.0
        return self.eps * u / (factor * self.sensitivity)

    def probabilities(self, utilities: np.ndarray) -> np.ndarray:
        lw = self.log_weights(utilities)
        p = np.exp(lw - lw.max())
        return p / p.sum()

    def select(self, utilities: np.ndarray, noise: NoiseSource) -> int:
        return noise.categorical(self.log_weights(utilities))


@dataclass(frozen=True)
class ReportNoisyMax(_Selection):
    """Return ``argmax_i (u_i + Lap(b))`` with b = 2*sensitivity/eps (b = sensitivity/eps if monotone).

    Guarantee: eps-DP (Dwork & Roth 2014, Sec. 3.3: Lap(1/eps) for monotone
    sensitivity-1 counts; twice the scale for general sensitivity), hence
    (eps^2/2)-zCDP. Only the index is released, never the noisy values.
    """

    @property
    def scale(self) -> float:
        return (1.0 if self.monotone else 2.0) * self.sensitivity / self.eps

    @property
    def rho(self) -> float:
        return self.eps**2 / 2.0

    def select(self, utilities: np.ndarray, noise: NoiseSource) -> int:
        u = self._utilities(utilities)
        return int(np.argmax(u + noise.laplace(u.size, self.scale).numpy()))
