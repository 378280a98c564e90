"""The guarantee an algorithm declares: how its releases are charged and composed, and what it
assumes of the other clients. The runner reads it (never a list of algorithm names) to choose the
run-wide filter, to word the budget line and result.json's ``accountant``, and to report
``clients_assumed``.

* ``charges``: ``"zcdp"`` (every release a zCDP charge rho, composed additively, converted to
  (eps, delta) at the end), ``"approx-dp"`` (every release an (eps, delta) charge, basic composition
  in the per-user ledger), ``"approx-zcdp"`` (approximate zCDP, Bun & Steinke 2016 Def. 8.1: zCDP
  charges rho, added up, plus (0, delta_i) charges, e.g. a PTR test's failure probability, added up;
  (eps, delta) by the budget's conversion of the summed rho at delta less the summed delta_i, what the
  ledger computes) or ``"schedule"`` (a dp-accounting Poisson-subsampled Gaussian schedule, accounted by
  RDP or PLD and charged up front as one (eps, delta) release).
* ``composition``: ``"sequential"`` (every release may involve every user: a zCDP run is also held
  by a run-wide filter) or ``"parallel"`` (each user takes part in one disjoint cohort: the per-user
  ledger alone enforces every user's budget).
* ``clients``: :mod:`fedkl.privacy.clients`.
* ``relations``: the user-level neighbouring relations its proof covers; the runner refuses any
  other before reading data (:data:`RELATIONS`: ``replace-one``, all records of one user replaced,
  n public; ``add-remove``, all records of one user added or removed against a public enrolment
  count n that every denominator uses, i.e. zero-out: the absent user contributes nothing, and
  under textbook add/remove the scale of a released mean would reveal n).

What a participating client SEES is declared beside the guarantee, at registration
(:class:`ClientView`, ``register(..., client_view=...)``): only private values (the models the run
released, public centres), or also values that are NOT private outputs (solver iterates inside a
phase, Snowball's intermediate iterates). A client is an observer too: where it sees non-private
values, the run's (eps, delta) holds against the final model's recipients and outsiders, not against
the participating clients (``fedkl run --algorithm NAME --help``, result.json's ``clients_see`` and
the README's attack model say so).
* ``adaptive``: later releases' costs are chosen from earlier (private) releases, under a run-wide
  zCDP filter (fully adaptive composition). Otherwise every charge (mechanism, cost, noise scale,
  sensitivity, users) is fixed by public values before any data is read, which is what lets
  :func:`fedkl.planner.charge_plan` list the run's charges exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fedkl.privacy.clients import ANY_CLIENTS, IN_CLASS_CLIENTS, ClientModel

CHARGES = ("zcdp", "approx-dp", "schedule", "approx-zcdp")
RELATIONS = ("replace-one", "add-remove")


def check_relation(neighbouring: str) -> None:
    """One-line ValueError unless ``neighbouring`` is one of :data:`RELATIONS`."""
    if neighbouring not in RELATIONS:
        raise ValueError(f"neighbouring must be one of {RELATIONS}, got {neighbouring!r}")


def sum_sensitivity(bound: float, neighbouring: str) -> float:
    """L2 sensitivity of ``sum_u v_u`` when every ``||v_u|| <= bound``: replacing one user's records
    moves one term by at most ``2 bound``; adding / removing one user moves the sum by ``bound``."""
    check_relation(neighbouring)
    return 2.0 * bound if neighbouring == "replace-one" else bound


# paper 002's deletion-stability test (and fedkl's diameter test and whole-release profile) is proven for
# replace-one (seed-002 note §1); under add-remove the test's deletion budget would have to be defined
# by the remaining users against a public enrolment count, which no proof here covers: refused
PAPER_002_RELATIONS = ("replace-one",)
RELATION_TEXT = {
    "replace-one": "all records of one user replaced by any others; the population n is public",
    "add-remove": "all records of one user added or removed, against a public enrolment count n that every "
    "denominator uses (zero-out: an absent enrolled user contributes nothing)",
}
COMPOSITIONS = ("sequential", "parallel")


@dataclass(frozen=True)
class ClientView:
    """What a participating client receives during a run: ``private_only`` when it is only ever sent
    private outputs or public values; ``text`` says what, in one sentence."""

    private_only: bool
    text: str

    def describe(self) -> str:
        return ("private values only: " if self.private_only else "NOT only private values: ") + self.text


RELEASED_MODELS = ClientView(
    True, "the current model, computed from earlier releases (private at the budget spent so far)"
)
PUBLIC_CENTRES = ClientView(True, "public phase centres and previously released models only")
SOLVER_ITERATES = ClientView(
    False,
    "the iterates of each phase's federated solve, which are not private outputs (only the phase's noisy "
    "release is); the run's (eps, delta) holds against the final model's recipients, not against these clients",
)


@dataclass(frozen=True)
class Guarantee:
    charges: str
    composition: str = "sequential"
    clients: ClientModel = ANY_CLIENTS
    adaptive: bool = False
    relations: tuple[str, ...] = RELATIONS

    def __post_init__(self) -> None:
        if self.charges not in CHARGES:
            raise ValueError(f"charges must be one of {CHARGES}, got {self.charges!r}")
        if self.composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {COMPOSITIONS}, got {self.composition!r}")
        if not self.relations or not set(self.relations) <= set(RELATIONS):
            raise ValueError(f"relations must be a non-empty subset of {RELATIONS}, got {self.relations!r}")
        if self.adaptive and not self.run_wide_filter:
            raise ValueError("adaptive costs need a run-wide zCDP filter (zcdp charges, sequential composition)")

    @property
    def zcdp(self) -> bool:
        """Releases are zCDP charges only (a rho budget); otherwise some are (eps, delta) charges."""
        return self.charges == "zcdp"

    @property
    def run_wide_filter(self) -> bool:
        """A zCDP run whose releases may all involve every user is also held by a run-wide filter."""
        return self.zcdp and self.composition == "sequential"

    def check_relation(self, neighbouring: str, who: str) -> None:
        """Refuse (one line, before any data is read) a relation this guarantee's proof does not cover."""
        if neighbouring not in self.relations:
            raise ValueError(
                f"{who}'s guarantee is proven for --neighbouring {' or '.join(self.relations)} only, not "
                f"{neighbouring!r} (nothing was read or charged)"
            )

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
        if self.charges == "approx-zcdp":
            return (
                f"approximate zCDP: zCDP charges added, (0, delta) charges (a PTR test's failure) added; "
                f"(eps, delta) by {conversion} conversion of rho at the budget's delta less the charged delta"
            )
        return f"zCDP, additive composition; (eps, delta) by {conversion} conversion"

    def to_dict(self) -> dict:
        return {
            "charges": self.charges,
            "composition": self.composition,
            "clients": asdict(self.clients),
            "adaptive": self.adaptive,
            "relations": list(self.relations),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Guarantee":
        return cls(
            d["charges"],
            d["composition"],
            ClientModel(**d["clients"]),
            bool(d.get("adaptive", False)),
            tuple(d.get("relations", RELATIONS)),
        )


__all__ = [
    "check_relation",
    "sum_sensitivity",
    "ANY_CLIENTS",
    "ClientView",
    "PUBLIC_CENTRES",
    "RELEASED_MODELS",
    "SOLVER_ITERATES",
    "CHARGES",
    "COMPOSITIONS",
    "Guarantee",
    "IN_CLASS_CLIENTS",
    "PAPER_002_RELATIONS",
    "RELATIONS",
    "RELATION_TEXT",
]
