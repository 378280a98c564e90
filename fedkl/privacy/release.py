"""The one door through which private values leave the server.

:class:`Releaser` ties a mechanism, the run's zCDP filter and the per-user ledger together in the
only safe order:

1. validate the exact query value (finite, the expected shape) — a bad value is refused before any
   charge, and since validity is enforced upstream (clients' answers are sanitised and clipped by
   the federation) this never depends on one user's data;
2. ask the run's filter whether the cost fits (no side effect);
3. charge the ledger for every participating user (durable; raises if any user is over budget);
4. record the cost in the filter;
5. draw the noise and return the noisy value.

If step 3 raises, nothing is released; if the process dies after step 3, the charge is already on
disk. Algorithms never add noise themselves: they call this class.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from fedkl.privacy.charges import ApproxDPCharge, Charge, ExponentialCharge, GaussianCharge
from fedkl.privacy.filter import BudgetExhausted, ZCDPFilter
from fedkl.privacy.ledger import PrivacyLedger
from fedkl.privacy.mechanisms import ExponentialMechanism, GaussianMechanism, TruncatedDiscreteLaplace
from fedkl.privacy.rng import NoiseSource
from fedkl.privacy.sparse_vector import AboveThreshold

T = TypeVar("T")


class Releaser:
    """Every public method builds the release's typed charge (:mod:`fedkl.privacy.charges`) and
    goes through :meth:`release`, the one path: validate -> filter check (zCDP charges; a filtered
    Releaser refuses an (eps, delta) charge) -> ledger charge -> filter spend -> sample."""

    def __init__(self, ledger: PrivacyLedger, noise: NoiseSource, zcdp_filter: ZCDPFilter | None = None) -> None:
        self.ledger = ledger
        self.noise = noise
        self.filter = zcdp_filter

    def accepts(self, notion: str) -> bool:
        """Whether this Releaser can account a charge stated in ``notion`` ("zcdp" or "approx-dp"):
        a zCDP filter cannot account (eps, delta) releases."""
        return notion == "zcdp" or self.filter is None

    def approx_left(self, user_ids: Sequence[str]) -> tuple[float, float] | None:
        """The (eps, delta) every listed user can still afford, for a plan's check before any data
        is read (None: a stand-in ledger that keeps no budget). Algorithms ask here, never the ledger."""
        left = getattr(self.ledger, "approx_left", None)
        return None if left is None else left(list(user_ids))

    def rho_left(self, user_ids: Sequence[str]) -> float | None:
        """The zCDP rho every listed user can still afford (None: a stand-in ledger without a budget)."""
        left = getattr(self.ledger, "rho_left", None)
        return None if left is None else left(list(user_ids))

    def require(self, notion: str, who: str) -> None:
        """Refuse, before any data is read, an algorithm whose releases this Releaser cannot account."""
        if not self.accepts(notion):
            raise ValueError(
                f"{who}: (eps, delta) releases cannot be accounted by a zCDP filter; use a Releaser "
                "without filter (nothing was read or charged)"
            )

    def release(
        self,
        charge: Charge,
        sample: Callable[[], T],
        *,
        user_ids: Sequence[str],
        label: str,
        details: dict | None = None,
    ) -> T:
        """Charge ``charge`` to every user in ``user_ids`` (and to the run's filter), then return
        ``sample()``: the noisy value, drawn only after the charge is durable. A refusal at any step
        draws nothing; a refused charge writes nothing."""
        if not self.accepts(charge.notion):
            raise ValueError(
                f"{label}: an (eps, delta) release cannot be accounted by a zCDP filter; use a "
                "Releaser without filter (nothing was charged)"
            )
        rho = charge.cost()[0]
        if self.filter is not None and not self.filter.admits(rho):
            self.filter.spend(rho)  # raises BudgetExhausted with the explanation
        self.ledger.charge(user_ids, charge, label=label, details=details)
        if self.filter is not None:
            self.filter.spend(rho)
        return sample()

    def gaussian(
        self,
        value: torch.Tensor,
        *,
        sensitivity: float,
        rho: float,
        user_ids: Sequence[str],
        label: str,
        details: dict | None = None,
    ) -> torch.Tensor:
        """Release ``value + N(0, sigma^2 I)``, ``sigma = sensitivity / sqrt(2 rho)``: rho-zCDP for
        the users in ``user_ids`` w.r.t. the relation under which ``sensitivity`` was computed."""
        mech = GaussianMechanism.from_zcdp(sensitivity, rho)
        if not torch.is_tensor(value) or not torch.isfinite(value).all():
            raise ValueError(f"{label}: refusing to release a non-finite value (nothing was charged)")
        return self.release(
            GaussianCharge(rho, sensitivity),
            lambda: mech.privatize(value, self.noise),
            user_ids=user_ids,
            label=label,
            details=details,
        )

    def exponential(
        self,
        utilities: Sequence[float] | np.ndarray | torch.Tensor,
        *,
        eps: float,
        sensitivity: float,
        user_ids: Sequence[str],
        label: str,
        monotone: bool = False,
        details: dict | None = None,
    ) -> int:
        """Select an index with probability ∝ ``exp(eps * u_i / (2 * sensitivity))`` (exponential
        mechanism, :class:`~fedkl.privacy.mechanisms.ExponentialMechanism`) and return it.

        ``sensitivity`` must bound ``|u_i(x) - u_i(x')|`` for every candidate ``i`` and every pair of
        neighbouring datasets (under the relation the caller states); the candidates themselves must
        be data-independent or earlier private outputs. Guarantee: eps-DP and ``eps^2/8``-zCDP
        (bounded range, Cesar & Rogers 2021); with ``monotone=True`` the factor 2 is dropped and the
        charge is ``eps^2/2`` (:class:`~fedkl.privacy.charges.ExponentialCharge`).
        """
        mech = ExponentialMechanism(eps, sensitivity, monotone)  # validates eps, sensitivity
        if torch.is_tensor(utilities):
            utilities = utilities.detach().cpu().numpy()
        u = np.asarray(utilities, dtype=np.float64)
        if u.ndim != 1 or u.size == 0 or not np.isfinite(u).all():
            raise ValueError(
                f"{label}: utilities must be a non-empty 1-D array of finite numbers (nothing was charged)"
            )
        return self.release(
            ExponentialCharge(eps, sensitivity, monotone),
            lambda: mech.select(u, self.noise),
            user_ids=user_ids,
            label=label,
            details={**(details or {}), "eps": eps, "candidates": int(u.size), "monotone": bool(monotone)},
        )

    def above_threshold(
        self,
        queries: Sequence[float],
        *,
        eps: float,
        threshold: float,
        sensitivity: float,
        user_ids: Sequence[str],
        label: str,
        details: dict | None = None,
    ) -> int | None:
        """The first index whose noisy query reaches the noisy threshold, or None
        (:class:`~fedkl.privacy.sparse_vector.AboveThreshold`): eps-DP (pure; charged as an
        (eps, 0) release) when every query has ``sensitivity`` under the caller's relation."""
        mech = AboveThreshold(eps, threshold, sensitivity)  # validates
        q = [float(v) for v in queries]
        if not q or not all(math.isfinite(v) for v in q):
            raise ValueError(f"{label}: queries must be finite numbers (nothing was charged)")
        charge = ApproxDPCharge(eps, 0.0, "above-threshold", sensitivity, mech.query_scale)
        return self.release(
            charge,
            lambda: mech.select(q, self.noise),
            user_ids=user_ids,
            label=label,
            details={**(details or {}), "threshold": threshold, "queries": len(q)},
        )

    def schedule_gaussian(
        self,
        *,
        eps: float,
        delta: float,
        sigma: float,
        sensitivity: float,
        releases: int,
        user_ids: Sequence[str],
        label: str,
        details: dict | None = None,
    ) -> "ScheduledGaussian":
        """Charge a whole schedule of ``releases`` Gaussian releases (noise ``sigma`` for a query of
        L2 sensitivity ``sensitivity``) whose accountant says (eps, delta), and return the handle that
        makes them. The (eps, delta) claim is the caller's (e.g. dp-accounting's PLD of the schedule);
        this method guarantees the charge precedes every release and bounds their number.
        """
        for name, v in (("eps", eps), ("sigma", sigma), ("sensitivity", sensitivity)):
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{label}: {name} must be finite and > 0, got {v} (nothing was charged)")
        if not 0 < delta < 1 or int(releases) != releases or releases < 1:
            raise ValueError(f"{label}: need 0 < delta < 1 and a positive number of releases (nothing was charged)")
        charge = ApproxDPCharge(eps, delta, "gaussian-schedule", sensitivity, sigma)
        return self.release(
            charge,
            lambda: ScheduledGaussian(sigma, int(releases), self.noise, label),
            user_ids=user_ids,
            label=label,
            details={**(details or {}), "releases": int(releases)},
        )

    def stability_gaussian(
        self,
        choose: Callable[[int], torch.Tensor | None],
        *,
        eps: float,
        delta: float,
        deletion_budget: TruncatedDiscreteLaplace,
        sensitivity: float,
        sigma: float,
        user_ids: Sequence[str],
        label: str,
        details: dict | None = None,
    ) -> torch.Tensor | None:
        """Release of a deletion-stability test with Gaussian output (paper 002, Algorithm 1).

        An (eps, delta)-DP (approximate DP, NOT zCDP) release, charged to the ledger as
        ``eps``/``delta`` in this order: validate -> charge -> draw ``R1 ~ deletion_budget`` ->
        ``value = choose(R1)`` -> return ``None`` (the output ⊥, also a release: it was charged)
        or ``value + N(0, sigma^2 I)``. ``choose`` maps the noisy deletion budget to the exact value
        of the chosen stable dataset (or None); the (eps, delta) claim is the caller's theorem
        (:mod:`fedkl.algorithms.del_output_pert`), this method guarantees the order and the charge.

        A zCDP filter cannot account an approximate-DP release, so a Releaser that has one refuses
        (use a Releaser without filter: the ledger enforces the (eps, delta) budget).
        """
        for name, v in (("eps", eps), ("sensitivity", sensitivity), ("sigma", sigma)):
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{label}: {name} must be finite and > 0, got {v} (nothing was charged)")
        if not 0 < delta < 1:
            raise ValueError(f"{label}: delta must be in (0, 1), got {delta} (nothing was charged)")

        def sample() -> torch.Tensor | None:
            value = choose(deletion_budget.sample(self.noise))
            return None if value is None else GaussianMechanism(sensitivity, sigma).privatize(value, self.noise)

        return self.release(
            ApproxDPCharge(eps, delta, "stability-gaussian", sensitivity, sigma),
            sample,
            user_ids=user_ids,
            label=label,
            details=details,
        )


class ScheduledGaussian:
    """The Gaussian releases of a schedule whose whole (eps, delta) was charged up front.

    Used where per-release costs do not add up in any currency the ledger keeps (e.g. Poisson-
    subsampled Gaussians accounted by PLD): :meth:`Releaser.schedule_gaussian` charges the
    schedule's total, then this handle allows at most ``releases`` releases at the fixed ``sigma``
    and refuses any more. A run that stops early was over-charged, never under-charged.
    """

    def __init__(self, sigma: float, releases: int, noise: NoiseSource, label: str) -> None:
        self.sigma = sigma
        self.releases = releases
        self.used = 0
        self._noise = noise
        self._label = label

    def release(self, value: torch.Tensor) -> torch.Tensor:
        if self.used >= self.releases:
            raise BudgetExhausted(f"{self._label}: all {self.releases} charged releases are used; refused")
        if not torch.is_tensor(value) or not torch.isfinite(value).all():
            raise ValueError(f"{self._label}: refusing to release a non-finite value")
        self.used += 1
        return value + self._noise.gaussian(tuple(value.shape), self.sigma).to(value.dtype)
