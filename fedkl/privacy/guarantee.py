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
the attack model, docs/concepts/attack-model.md, say so).
* ``adaptive``: later releases' costs are chosen from earlier (private) releases, under a run-wide
  zCDP filter (fully adaptive composition). Otherwise every charge (mechanism, cost, noise scale,
  sensitivity, users) is fixed by public values before any data is read, which is what lets
  :func:`fedkl.planner.charge_plan` list the run's charges exactly.
"""

from __future__ import annotations

import fnmatch
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
# replace-one (docs/derivations/paper-002.md §1); under add-remove the test's deletion budget would have to be defined
# by the remaining users against a public enrolment count, which no proof here covers: refused
PAPER_002_RELATIONS = ("replace-one",)
RELATION_TEXT = {
    "replace-one": "all records of one user replaced by any others; the population n is public",
    "add-remove": "all records of one user added or removed, against a public enrolment count n that every "
    "denominator uses (zero-out: an absent enrolled user contributes nothing)",
}
COMPOSITIONS = ("sequential", "parallel")

# how an absent, failed or non-finite user enters a released quantity (Absence.mode)
ABSENCE_MODES = ("zero", "left-out", "replaced")
# how the white-box search (fedkl.audit.whitebox) measures a release's realised sensitivity (Absence.measure)
MEASURES = ("sensitivity", "prefix-increment", "not-sensitivity")
# the two kinds of transport an absence rule may differ on: the server computes every answer, or clients answer
# over the Flower wire (a failed or dropped client's answer is a zero row, fedkl.flower.federation)
ABSENCE_BACKENDS = ("inprocess", "flower")


@dataclass(frozen=True)
class Absence:
    """How an absent, failed or non-finite user enters the released quantities an algorithm declares
    (``register(..., absence=...)``: a tuple of these, the first that matches a release wins).

    * ``mode``: ``"zero"`` (the user's answer is the zero vector in every released sum and every other
      released statistic; the sensitivity is computed for present vs zero), ``"left-out"`` (the user is
      excluded from the released statistic, whose every denominator and threshold is public) or
      ``"replaced"`` (its answer is replaced by a public value); ``text`` says where, in one sentence.
    * ``releases``: an :mod:`fnmatch` pattern over release labels (``"*"``: every release);
      ``relations`` / ``backends``: where the rule holds (:data:`RELATIONS`, :data:`ABSENCE_BACKENDS`).
    * ``measure``: how the white-box search (:mod:`fedkl.audit.whitebox`) compares the release's exact values
      on neighbouring inputs with the sensitivity its charge was calibrated for: ``"sensitivity"`` (the
      exact value moves by at most the charge's sensitivity: L2 for a Gaussian, the largest utility or
      query move for the exponential mechanism or above-threshold); ``"prefix-increment"`` (the releases are
      running prefix sums of one matrix mechanism whose charges are increments of the stream's sensitivity:
      each release's increment over the previous one moves by at most the largest charged sensitivity so
      far, which is at most the per-round answer bound times a column norm >= 1); ``"not-sensitivity"`` (the
      guarantee is not a sensitivity bound, e.g. paper 002's deletion-stability test: left to the sampling
      audit)."""

    mode: str
    text: str
    releases: str = "*"
    relations: tuple[str, ...] = RELATIONS
    backends: tuple[str, ...] = ABSENCE_BACKENDS
    measure: str = "sensitivity"

    def __post_init__(self) -> None:
        if self.mode not in ABSENCE_MODES:
            raise ValueError(f"absence mode must be one of {ABSENCE_MODES}, got {self.mode!r}")
        if self.measure not in MEASURES:
            raise ValueError(f"absence measure must be one of {MEASURES}, got {self.measure!r}")
        if not (isinstance(self.text, str) and self.text.strip()):
            raise ValueError("an absence rule says in words how the absent user enters the release")
        if not self.relations or not set(self.relations) <= set(RELATIONS):
            raise ValueError(f"relations must be a non-empty subset of {RELATIONS}, got {self.relations!r}")
        if not self.backends or not set(self.backends) <= set(ABSENCE_BACKENDS):
            raise ValueError(f"backends must be a non-empty subset of {ABSENCE_BACKENDS}, got {self.backends!r}")

    def covers(self, label: str, relation: str, backend: str) -> bool:
        return relation in self.relations and backend in self.backends and fnmatch.fnmatchcase(label, self.releases)


# the rule of every algorithm that releases noisy sums (or statistics of sums) of clipped answers
ZERO_SUMS = (
    Absence(
        "zero",
        "a failed, dropped, non-finite or absent user's answer is the zero vector in every released sum (the "
        "federation's failure policy; its row is inside the clip ball) and every denominator is public",
    ),
)
# paper 002's deletion-stability releases: a failed user is replaced by the public centre; the stability
# Gaussian's guarantee is a PTR theorem, not a sensitivity bound (left to the sampling audit)
STABILITY_TEST = (
    Absence(
        "replaced",
        "the noisy deletion budget and the stability test's output: a failed user's local vector is the public "
        "centre; the (eps, delta) is the deletion-stability theorem's, not a sensitivity bound",
        releases="*",
        measure="not-sensitivity",
    ),
)


def check_absence(rules: object, who: str) -> tuple[Absence, ...]:
    """``rules`` as a tuple of :class:`Absence`, refused (TypeError, one line) unless it is a non-empty
    tuple of them whose catch-all rules (``releases="*"``) cover every relation and backend."""
    if isinstance(rules, Absence):
        rules = (rules,)
    if not (isinstance(rules, tuple) and rules and all(isinstance(r, Absence) for r in rules)):
        raise TypeError(f"{who}: absence must be a non-empty tuple of fedkl.privacy.guarantee.Absence, got {rules!r}")
    for relation in RELATIONS:
        for backend in ABSENCE_BACKENDS:
            if not any(r.releases == "*" and r.covers("", relation, backend) for r in rules):
                raise TypeError(
                    f"{who}: no absence rule with releases='*' covers relation {relation!r} on backend {backend!r}"
                )
    return rules


def absence_for(rules: tuple[Absence, ...], label: str, relation: str, backend: str) -> Absence:
    """The first rule of ``rules`` that covers release ``label`` under ``relation`` on ``backend``."""
    return next(r for r in rules if r.covers(label, relation, backend))


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
    "ABSENCE_BACKENDS",
    "ABSENCE_MODES",
    "Absence",
    "MEASURES",
    "STABILITY_TEST",
    "ZERO_SUMS",
    "absence_for",
    "check_absence",
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
