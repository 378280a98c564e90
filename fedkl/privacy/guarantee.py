"""The guarantee an algorithm declares: how its releases are charged and composed, and what it
assumes of the other clients. The runner reads it (never a list of algorithm names) to choose the
run-wide filter, to word the budget line and result.json's ``accountant``, and to report
``clients_assumed``.

* ``charges``: ``"zcdp"`` (every release a zCDP charge rho, composed additively, converted to
  (eps, delta) at the end), ``"approx-dp"`` (every release an (eps, delta) charge, basic composition
  in the per-user ledger) or ``"schedule"`` (a dp-accounting Poisson-subsampled Gaussian schedule,
  accounted by RDP or PLD and charged up front as one (eps, delta) release).
* ``composition``: ``"sequential"`` (every release may involve every user: a zCDP run is also held
  by a run-wide filter) or ``"parallel"`` (each user takes part in one disjoint cohort: the per-user
  ledger alone enforces every user's budget).
* ``clients``: :mod:`fedkl.privacy.clients`.
* ``adaptive``: later releases' costs are chosen from earlier (private) releases, under a run-wide
  zCDP filter (fully adaptive composition). Otherwise every charge (mechanism, cost, noise scale,
  sensitivity, users) is fixed by public values before any data is read, which is what lets
  :func:`fedkl.planner.charge_plan` list the run's charges exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fedkl.privacy.clients import ANY_CLIENTS, IN_CLASS_CLIENTS, ClientModel

CHARGES = ("zcdp", "approx-dp", "schedule")
COMPOSITIONS = ("sequential", "parallel")


@dataclass(frozen=True)
class Guarantee:
    charges: str
    composition: str = "sequential"
    clients: ClientModel = ANY_CLIENTS
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.charges not in CHARGES:
            raise ValueError(f"charges must be one of {CHARGES}, got {self.charges!r}")
        if self.composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {COMPOSITIONS}, got {self.composition!r}")
        if self.adaptive and not self.run_wide_filter:
            raise ValueError("adaptive costs need a run-wide zCDP filter (zcdp charges, sequential composition)")

    @property
    def zcdp(self) -> bool:
        """Releases are zCDP charges (a rho budget); otherwise (eps, delta) charges."""
        return self.charges == "zcdp"

    @property
    def run_wide_filter(self) -> bool:
        """A zCDP run whose releases may all involve every user is also held by a run-wide filter."""
        return self.zcdp and self.composition == "sequential"

    def accountant(self, conversion: str, schedule_accountant: str | None) -> str:
        """result.json's ``accountant`` text (``schedule_accountant``: the dp-accounting accountant a
        scheduled algorithm uses; required for ``charges="schedule"``)."""
        if self.charges == "schedule":
            if schedule_accountant is None:
                raise ValueError("a scheduled guarantee needs the schedule's accountant")
            return (
                f"{schedule_accountant.upper()} (dp-accounting) for the Poisson-subsampled Gaussian schedule, "
                "charged up front as one (eps, delta) release"
            )
        if self.charges == "approx-dp":
            return "(eps, delta)-DP releases, basic composition in the per-user ledger"
        return f"zCDP, additive composition; (eps, delta) by {conversion} conversion"

    def to_dict(self) -> dict:
        return {
            "charges": self.charges,
            "composition": self.composition,
            "clients": asdict(self.clients),
            "adaptive": self.adaptive,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Guarantee":
        return cls(d["charges"], d["composition"], ClientModel(**d["clients"]), bool(d.get("adaptive", False)))


__all__ = ["ANY_CLIENTS", "CHARGES", "COMPOSITIONS", "Guarantee", "IN_CLASS_CLIENTS"]
