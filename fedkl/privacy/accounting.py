"""(Subsampled) Gaussian schedules accounted with Google's ``dp-accounting`` (RDP and PLD).

We do not re-implement RDP or PLD: these functions only build the ``DpEvent`` of a schedule and ask
dp-accounting. A schedule is ``steps`` compositions of a Gaussian mechanism with noise multiplier
``z = sigma / sensitivity``, each applied to a Poisson sample of users with rate ``q`` (``q = 1``
means every user takes part in every step: no amplification).

Neighbouring relation: ``add-remove`` (one user's data added or removed; dp-accounting's default and
the one under which Poisson amplification is analysed) or ``replace-one``.

**One convention for the noise multiplier**, the one fedkl's runs use and report (result.json's
``noise_multiplier``): ``z = sigma / Delta`` with ``Delta`` the L2 sensitivity of the released sum
under the chosen relation (for a sum of answers clipped to C: ``Delta = C`` under add-remove,
``Delta = 2C`` under replace-one). dp-accounting's accountants read it differently, and differently
from each other (its PLD takes ``sigma / C`` and doubles the sensitivity itself under REPLACE_ONE; its
RDP ignores the relation for an unsampled Gaussian), so this module translates:

* ``q = 1`` (no sampling): a Gaussian of multiplier z is the same mechanism under either relation
  once Delta is the relation's sensitivity, so both accountants account it under add-remove;
* ``q < 1`` under replace-one: PLD with dp-accounting's REPLACE_ONE relation at its multiplier
  ``sigma / C = 2z``; dp-accounting's RDP has no Poisson-sampled replace-one analysis, which is refused.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: dp-accounting (with scipy) costs ~0.6 s, `fedkl --help` needs none of it
    import dp_accounting

ACCOUNTANTS = ("pld", "rdp")
RELATIONS = ("add-remove", "replace-one")  # dp-accounting's ADD_OR_REMOVE_ONE and REPLACE_ONE
MULTIPLIER_CONVENTION = (
    "z = sigma / Delta, Delta the L2 sensitivity of the released sum under the relation "
    "(clip C: Delta = C under add-remove, 2C under replace-one)"
)
PLD_DISCRETIZATION = 1e-4  # dp-accounting's default value_discretization_interval: every eps we report or charge
# the grid the PLD calibration's bisection searches on (noise_multiplier_for): 10x coarser, so each of its
# ~15 evaluations is ~10x cheaper (1-round q = 0.1 schedule at eps 8: ~2.4 s -> 0.18 s each); its eps is
# never charged: the answer is re-accounted at PLD_DISCRETIZATION and must meet the target there
PLD_CALIBRATION_DISCRETIZATION = 1e-3
CALIBRATION_RTOL = (
    1e-4  # the bisection's tolerance on z, relative to its bracket (dp-accounting's default: 1e-6 absolute)
)
# the largest PLD grid (points of the composed privacy-loss pmf) we let dp-accounting build: about
# 5e6 points take half a minute and a few hundred MB; a schedule above this is refused up front
PLD_MAX_POINTS = 1e7
_TAIL = math.log(2 / 1e-15)  # dp-accounting's Chernoff truncation: log(2 / tail_mass_truncation)
# dp-accounting's RDP logs a warning for every fractional order it drops when a series does not
# converge (the remaining orders still give a valid upper bound); keep the console readable
logging.getLogger("absl").setLevel(logging.ERROR)


@dataclass(frozen=True)
class GaussianSchedule:
    noise_multiplier: float
    sampling_rate: float
    steps: int
    neighbouring: str = "add-remove"

    def __post_init__(self) -> None:
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise multiplier must be finite and > 0, got {self.noise_multiplier}")
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"sampling rate must be in (0, 1], got {self.sampling_rate}")
        if int(self.steps) != self.steps or self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps}")
        if self.neighbouring not in RELATIONS:
            raise ValueError(f"neighbouring must be one of {sorted(RELATIONS)}, got {self.neighbouring!r}")

    @property
    def dp_accounting_relation(self) -> str:
        """The relation dp-accounting accounts this schedule under (module docstring)."""
        return "add-remove" if self.sampling_rate >= 1 else self.neighbouring

    def event(self) -> dp_accounting.DpEvent:
        """The schedule as a dp-accounting event, in dp-accounting's multiplier convention: ``z``
        (add-remove, or any unsampled schedule), ``2z`` for a Poisson-sampled replace-one schedule
        (dp-accounting's multiplier is ``sigma / C``, and here ``Delta = 2C``)."""
        import dp_accounting

        doubled = self.dp_accounting_relation == "replace-one"
        step = dp_accounting.GaussianDpEvent(self.noise_multiplier * (2.0 if doubled else 1.0))
        if self.sampling_rate < 1:
            step = dp_accounting.PoissonSampledDpEvent(self.sampling_rate, step)
        return dp_accounting.SelfComposedDpEvent(step, int(self.steps))


def pld_grid_points(schedule: GaussianSchedule) -> float:
    """About how many points dp-accounting's PLD of ``schedule`` has (its memory and time grow with
    them): the single step's grid, ~20 loss standard deviations of a Gaussian with sensitivity
    ``g = 1/z`` (either relation, in this module's convention) over :data:`PLD_DISCRETIZATION`, and the self-composition's
    Chernoff window (dp-accounting ``common.compute_self_convolve_bounds``: orders up to 20 / the
    single grid) for a per-step loss of standard deviation ``min(g, q sqrt(e^{g^2} - 1))``. Checked
    against dp-accounting (between 0.5x and 3x its size) on q in [0.01, 1], z in [0.1, 2], up to 1e5 steps
    (tests/privacy/test_accounting.py)."""
    g = 1.0 / schedule.noise_multiplier  # z = sigma/Delta of the relation (module docstring): one step's shift is 1/z
    q, k = schedule.sampling_rate, int(schedule.steps)
    single = (20.0 if q == 1 else 10.0) * g / PLD_DISCRETIZATION
    sd = g if q == 1 else min(g, q * math.sqrt(math.expm1(min(g * g, 700.0))))
    sd /= PLD_DISCRETIZATION
    order = min(math.sqrt(2 * _TAIL / (k * sd * sd)), 20.0 / single)
    return max(single, k * order * sd * sd + 2 * _TAIL / order)


def _check_pld_size(schedule: GaussianSchedule) -> None:
    points = pld_grid_points(schedule)
    if points > PLD_MAX_POINTS:
        raise ValueError(
            f"the PLD accountant would need ~{points:.2g} grid points (limit {PLD_MAX_POINTS:.0g}: memory and time) "
            f"for noise multiplier {schedule.noise_multiplier:g} over {schedule.steps} steps at q={schedule.sampling_rate:g}; "
            "noise this small gives no meaningful privacy: raise the noise (or lower epsilon), or use the RDP accountant"
        )


def make_accountant(
    name: str, neighbouring: str = "add-remove", discretization: float = PLD_DISCRETIZATION
) -> dp_accounting.PrivacyAccountant:
    """A dp-accounting accountant under ``neighbouring`` as dp-accounting reads it (pass a schedule's
    :attr:`GaussianSchedule.dp_accounting_relation`); ``discretization``: the PLD's
    ``value_discretization_interval`` (pessimistic: an upper bound on eps at any interval)."""
    import dp_accounting
    from dp_accounting import pld, rdp

    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}")
    relation = {
        "add-remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        "replace-one": dp_accounting.NeighboringRelation.REPLACE_ONE,
    }[neighbouring]
    if name == "pld":
        return pld.PLDAccountant(relation, value_discretization_interval=discretization)
    return rdp.RdpAccountant(neighboring_relation=relation)


def supports(schedule: GaussianSchedule, accountant: str) -> bool:
    """Whether dp-accounting's ``accountant`` can account ``schedule`` (RDP: not a Poisson-sampled
    replace-one schedule)."""
    return make_accountant(accountant, schedule.dp_accounting_relation).supports(schedule.event())


def _require_support(schedule: GaussianSchedule, accountant: str) -> None:
    if not supports(schedule, accountant):
        raise ValueError(
            f"dp-accounting's {accountant} accountant has no analysis of a Poisson-sampled schedule "
            f"under {schedule.neighbouring} (use --accountant pld, or --neighbouring add-remove)"
        )


def describe_accountant(name: str) -> str:
    version = importlib.metadata.version("dp-accounting")
    if name == "pld":
        return f"PLD (dp-accounting {version}, value_discretization_interval={PLD_DISCRETIZATION})"
    return f"RDP (dp-accounting {version}, default orders)"


def schedule_epsilon(
    schedule: GaussianSchedule, delta: float, accountant: str = "pld", discretization: float = PLD_DISCRETIZATION
) -> float:
    """eps of the whole schedule at ``delta`` by the named dp-accounting accountant (PLD: at
    ``discretization``; only :func:`noise_multiplier_for`'s search passes a coarser one)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    _require_support(schedule, accountant)
    if accountant == "pld":
        _check_pld_size(schedule)
    acc = make_accountant(accountant, schedule.dp_accounting_relation, discretization)
    acc.compose(schedule.event())
    return float(acc.get_epsilon(delta))


def noise_multiplier_for(
    eps: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: str = "pld",
    neighbouring: str = "add-remove",
) -> float:
    """Smallest noise multiplier whose schedule meets (eps, delta), via dp-accounting's
    ``calibrate_dp_mechanism`` (bisection; the answer is on the private side of the bracket, within
    :data:`CALIBRATION_RTOL` of the bracket's top).

    PLD: the search runs on the coarser grid :data:`PLD_CALIBRATION_DISCRETIZATION` (it took ~160 s for a
    1-round q = 0.1 schedule on a loaded machine at the fine grid and 1e-6 tolerance: ~20 PLDs of 1.5e6
    points). Why that loosens nothing: dp-accounting builds every PLD with ``pessimistic_estimate=True``
    (privacy losses rounded UP to the grid, truncated tail mass added to the infinite loss), so the eps
    it gives at any interval is an upper bound on the true eps of the schedule; the coarse search only
    picks z. The z returned is then accounted at :data:`PLD_DISCRETIZATION`, the grid every charged and
    reported eps uses, and must meet ``eps`` there: the coarse grid's points are a subset of the fine
    grid's (1e-3 = 10 x 1e-4), so rounding up to it can only give a larger eps and the check holds; if it
    ever did not, z is raised by 0.1% steps until it does (tests/privacy/test_accounting.py checks the
    result at a 10x finer grid still). The price: the coarse grid's pessimism can ask up to ~1% more noise
    than the charged grid's smallest multiplier, never less (0.3% on paper 004's schedule,
    tests/test_paper004_repro.py)."""
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be finite and > 0, got {eps}")
    unit = GaussianSchedule(1.0, sampling_rate, steps, neighbouring)  # validates the arguments
    _require_support(unit, accountant)

    def eps_at(z: float, name: str, grid: float = PLD_CALIBRATION_DISCRETIZATION) -> float:
        return schedule_epsilon(GaussianSchedule(z, sampling_rate, steps, neighbouring), delta, name, grid)

    # Bracket first with RDP where it applies (cheap, and never below PLD, so its answer upper-bounds
    # PLD's); a tiny lower endpoint would make PLD allocate gigabytes, so we walk down from there.
    bracket = "rdp" if supports(unit, "rdp") else accountant
    hi = 1.0
    while eps_at(hi, bracket) > eps:
        hi *= 2.0
    lo = hi / 2.0
    if accountant == "pld" and bracket == "rdp":  # refuse up front when even RDP's answer (>= PLD's) is too fine
        while lo > 1e-6 and eps_at(lo, "rdp") <= eps:
            lo /= 2.0
        try:
            _check_pld_size(GaussianSchedule(lo * 2.0, sampling_rate, steps, neighbouring))
        except ValueError as e:
            raise ValueError(
                f"epsilon={eps:g} at delta={delta:g} needs a noise multiplier below {lo * 2.0:.3g} over {steps} steps; {e}"
            ) from None
        lo = hi / 2.0
    while lo > 1e-2 and eps_at(lo, accountant) <= eps:
        lo /= 2.0
    if eps_at(lo, accountant) <= eps:
        z = lo
    else:
        import dp_accounting

        z = float(
            dp_accounting.calibrate_dp_mechanism(
                lambda: make_accountant(accountant, unit.dp_accounting_relation, PLD_CALIBRATION_DISCRETIZATION),
                lambda z: GaussianSchedule(z, sampling_rate, steps, neighbouring).event(),
                eps,
                delta,
                dp_accounting.ExplicitBracketInterval(lo, hi),
                tol=CALIBRATION_RTOL * hi,
            )
        )
    if accountant == "pld":  # the charged grid (docstring): must meet eps there too
        while eps_at(z, accountant, PLD_DISCRETIZATION) > eps:
            z *= 1.001
    return z
