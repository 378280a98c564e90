"""The one door through which private values leave the server.

:class:`Releaser` ties a mechanism, the run's zCDP filter and the per-user ledger together in the
only safe order:

1. validate the exact query value (finite, the expected shape) — a bad value is refused before any
   charge, and since validity is enforced upstream (clients' answers are sanitised and clipped by
   the federation) this never depends on one user's data;
2. ask the run's filter whether the cost fits (no side effect);
3. make the journal durable (a ledger row is egress of every value released before it:
   :mod:`fedkl.privacy.journal`), then charge the ledger for every participating user (durable; raises
   if any user is over budget);
4. record the cost in the filter;
5. draw the noise and return the noisy value.

If step 3 raises, nothing is released; if the process dies after step 3, the charge is already on
disk. Algorithms never add noise themselves: they call this class.

Numbered releases, the journal and crash recovery
-------------------------------------------------
A Releaser numbers its releases 0, 1, 2 ... (``seq``, in call order; the steps of a
:class:`ScheduledGaussian` too) and records ``seq`` with each ledger row. With a
:class:`~fedkl.privacy.journal.ReleaseJournal` it records each drawn value (with its seq, label,
charge and cohort digest) right after step 5 and before returning it; the journal buffers it, and
:meth:`Releaser.flush` makes every recorded value durable in one transaction. The run calls
:meth:`Releaser.flush` before every egress (the list and the argument:
:mod:`fedkl.privacy.journal`), so no value, nor anything computed from one, leaves the process
unjournalled.

Every release is charged by the Releaser, in its own ledger transaction, right before its noise is
drawn. (Charging a run's planned releases ahead in batches, "prepay", was removed in issue 29 §3: the
dry run that made the plan cost about what the batches saved, ``simulations/results/bench_prepay.md``.
A ledger row an older version wrote as ``'prepaid'`` or ``'unused'`` is a charge like any other: it
counts in every total, :meth:`~fedkl.privacy.ledger.PrivacyLedger.verify` checks it, and recovery lets it
back the release it was charged for, below.)

Recovery (``replay``: the journal of a run whose process died, and the ledger rows of that run): the
same deterministic run is re-executed. For seq i:

* journalled: the label, charge and cohort must equal the journal's (else :class:`RecoveryMismatch`,
  nothing released); nothing is charged (its ledger row backs it); the release's sample is drawn again
  (so a seeded noise stream stays in step) and thrown away, and the JOURNALLED value is returned. Never a
  recomputed one: if a user's data had changed, ``f(D') + Z`` with the first run's ``Z`` would
  reveal ``f(D) - f(D')``. The value returned is one already released, so this is post-processing;
  the algorithm continues from exactly the state the first run had. Its noise state too: for an
  algorithm registered with ``noise_state`` (a release's noise depends on earlier draws: dp-ftrl's
  correlated-noise generator is fed each release's draw inside its sample), the journal keeps the raw
  bits every release drew from :attr:`Releaser.noise` as a secret (:mod:`fedkl.privacy.journal`), and
  the replayed sample is fed THOSE bits (the run's source is still drawn from, and the draw thrown
  away), so the generator holds exactly the first process's state and every later release carries the
  noise the uninterrupted run would have. Re-drawn noise fed to the generator would make later releases
  carry noise correlated with draws that were never released (true rho up to 1.88x the charged rho after
  one crash: issue 28). Only draws made inside a release's sample are recorded; a draw between releases
  (a Poisson cohort) is part of no later release's state;
* charged (a ledger row of the run backs it) but not journalled: the first process died before
  the flush that would have made the value durable, so that value never left it (nothing computed
  from a value leaves the process before a flush covering it); the row backs the new draw, which is
  charged once;
* neither: an ordinary release.

Since the journal is flushed before every ledger transaction, a ledger row whose charge was computed
from released values (kl-adaptive-gd) is never durable before those values are: recovery never redraws a
value a durable charge depends on. Each ledger row therefore backs at most one value that ever left a
process, and every such value was charged before it was drawn: after recovery the ledger holds each release once, and with a
seeded noise stream the run's releases and model equal the uninterrupted run's bit for bit.
A row of the run that does not match the release at its seq means the recovery is not the same run
(other settings): refused; except a row an older version charged ahead (``'prepaid'``): its plan could
be dropped mid-run, so such a row may match no release; it stays charged (never refunded) and backs nothing. The run-wide zCDP filter is spent for replayed
releases as for new ones.
"""

from __future__ import annotations

import json
import math
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from fedkl.privacy.charges import ApproxDPCharge, Charge, ExponentialCharge, GaussianCharge, to_record
from fedkl.privacy.filter import BudgetExhausted, ZCDPFilter
from fedkl.privacy.journal import JournalEntry, ReleaseJournal
from fedkl.privacy.ledger import PrivacyLedger, cohort_digest
from fedkl.privacy.mechanisms import ExponentialMechanism, GaussianMechanism, TruncatedDiscreteLaplace, _add_noise
from fedkl.privacy.rng import NoiseSource
from fedkl.privacy.sparse_vector import AboveThreshold

T = TypeVar("T")
_STEP = {
    "type": "scheduled-step"
}  # the charge record journalled for a ScheduledGaussian step (charged with its schedule)


class RecoveryMismatch(ValueError):
    """A recovered run asked for a release other than the one its first run made at that seq."""


class _DrawTap(NoiseSource):
    """A Releaser's noise source when its journal keeps the noise draws (an algorithm with noise state:
    module docstring). Every draw is made from the run's ``source``; inside :meth:`draw` the raw bits
    served are recorded, and in playback the first process's recorded bits are served instead (the
    source's are drawn and thrown away: a seeded stream stays in step). Between releases it is the
    source itself."""

    def __init__(self, source: NoiseSource) -> None:
        self.source = source
        self.seed, self._gen = source.seed, source._gen  # the source's mode and seed (describe())
        self._taken: list[np.ndarray] | None = None
        self._playback: np.ndarray | None = None
        self._at = 0

    def _raw_uint64(self, n: int) -> np.ndarray:
        bits = self.source._raw_uint64(n)
        if self._playback is not None:
            if self._at + n > self._playback.size:
                raise RecoveryMismatch(
                    "recovery: a journalled release draws more noise than its first process drew: not the same "
                    "run (same settings, data and code?)"
                )
            bits = self._playback[self._at : self._at + n].astype(np.uint64)
            self._at += n
        if self._taken is not None:
            self._taken.append(np.array(bits, dtype=np.uint64))
        return bits

    def draw(self, sample: Callable[[], T], playback: np.ndarray | None = None) -> tuple[T, np.ndarray]:
        """``sample()`` and the raw bits it drew (in order); with ``playback``, fed exactly those bits."""
        self._taken, self._playback, self._at = [], playback, 0
        try:
            value = sample()
            if playback is not None and self._at != playback.size:
                raise RecoveryMismatch(
                    "recovery: a journalled release draws less noise than its first process drew: not the same "
                    "run (same settings, data and code?)"
                )
            taken = self._taken
        finally:
            self._taken, self._playback = None, None
        return value, (np.concatenate(taken) if taken else np.empty(0, dtype=np.uint64))


def _canonical(record: dict) -> dict:
    """A charge record as stored (JSON round trip: tuples become lists), for comparisons."""
    return json.loads(json.dumps(record, sort_keys=True))


class Releaser:
    """Every public method builds the release's typed charge (:mod:`fedkl.privacy.charges`) and
    goes through :meth:`release`, the one path: validate -> filter check (zCDP charges; a filtered
    Releaser refuses an (eps, delta) charge) -> ledger charge -> filter spend -> sample."""

    def __init__(
        self,
        ledger: PrivacyLedger,
        noise: NoiseSource,
        zcdp_filter: ZCDPFilter | None = None,
        journal: ReleaseJournal | None = None,
        replay: bool = False,
    ) -> None:
        """``journal``: where each drawn value is committed before it is returned (and, if the journal
        keeps them, each release's noise draws); ``replay``: recover the run of ``ledger.run_id`` from
        ``journal`` (see the module docstring)."""
        self.ledger = ledger
        keeps_draws = journal is not None and journal.keeps_draws
        self.noise: NoiseSource = _DrawTap(noise) if keeps_draws else noise
        self.filter = zcdp_filter
        self.journal = journal
        self.seq = 0  # the next release's number
        self.replayed = 0  # releases answered from the journal
        self._journalled: dict[int, JournalEntry] = {}
        self._draws: dict[int, np.ndarray] = {}  # in recovery: the first process's noise draws, by seq
        # in recovery: seq -> the ledger rows the first process charged that back no value yet
        self._backing: dict[int, list[dict]] = {}
        self._last_cohort: tuple[tuple, str] | None = None
        self._last_record: tuple[tuple, dict] | None = None
        if replay:
            if journal is None or getattr(ledger, "run_id", None) is None:
                raise ValueError("recovery needs the run's journal and a ledger opened with its run_id")
            self._journalled = journal.entries()
            self._draws = journal.draws()
            for row in ledger.run_releases():
                if row["seq"] is not None:
                    self._backing.setdefault(row["seq"], []).append(row)

    def _cohort(self, user_ids: Sequence[str]) -> str:
        """:func:`cohort_digest` of ``user_ids``, remembered for the last cohort (a round over the same
        users does not sort and hash 100,000 ids again)."""
        key = tuple(user_ids)
        last = self._last_cohort
        if last is None or last[0] != key:
            self._last_cohort = last = (key, cohort_digest(key))
        return last[1]

    def _record(self, charge: Charge) -> dict:
        """``_canonical(to_record(charge))``, remembered for the last charge (a run's rounds make equal
        charges: no JSON round trip per release), a fresh copy each time (its values are scalars). The key
        is the charge's type and the ``repr`` of its field values: equal reprs give equal JSON (floats are
        written by their repr), so ``1`` vs ``1.0`` or ``-0.0`` vs ``0.0`` are different keys."""
        key = (type(charge), repr(tuple(vars(charge).values())))
        last = self._last_record
        if last is None or last[0] != key:
            self._last_record = last = (key, _canonical(to_record(charge)))
        return dict(last[1])

    def flush(self) -> None:
        """Make every value released so far durable in the journal (one transaction; nothing without
        a journal or when nothing is buffered). Call before anything computed from a released value
        leaves the process."""
        if self.journal is not None:
            self.journal.flush()

    def _flush_before_ledger_write(self) -> None:
        """A ledger row is egress of every value released before it (a charge may be computed from them):
        the journal is made durable first (:mod:`fedkl.privacy.journal`, egress point 1)."""
        self.flush()

    def _take_backing(self, seq: int, label: str, record: dict, cohort: str) -> bool:
        """In recovery, consume the ledger row that backs release ``seq`` (True), if one matches it; a
        row that does not match is a different run: refused (an older version's ``'prepaid'`` row excepted:
        module docstring)."""
        rows = self._backing.get(seq, [])
        for row in rows:
            if (row["label"], _canonical(row["charge"]), row["cohort"]) == (label, record, cohort):
                rows.remove(row)
                return True
        for row in rows:
            if row["state"] is None:
                raise RecoveryMismatch(
                    f"recovery: release {seq} is {label!r} {record}, but the run charged {row['label']!r} "
                    f"{row['charge']} there: not the same run (same settings, data and code?); nothing was released"
                )
        return False

    def _emit(self, seq: int, label: str, record: dict, cohort: str, sample: Callable[[], T]) -> T:
        """Draw release ``seq`` (already charged) and journal it (with its noise draws, if the journal
        keeps them) before returning it; in recovery, return the journalled value instead (the sample is
        still drawn, to keep the noise in step, fed the first process's draws if they were kept)."""
        self.seq = seq + 1
        entry = self._journalled.pop(seq, None)
        if isinstance(self.noise, _DrawTap):
            playback = None
            if entry is not None:
                playback = self._draws.pop(seq, None)
                if playback is None:
                    raise RecoveryMismatch(
                        f"recovery: release {seq} ({label}) is journalled without its noise draws: its later "
                        "noise cannot be rebuilt; nothing was released"
                    )
            value, bits = self.noise.draw(sample, playback)
        else:
            value = sample()
        if entry is not None:
            self.replayed += 1
            return value if isinstance(value, ScheduledGaussian) else entry.value()
        if self.journal is not None:
            if isinstance(self.noise, _DrawTap):
                self.journal.record_draws(seq, bits)
            self.journal.record(seq, label, record, cohort, None if isinstance(value, ScheduledGaussian) else value)
        return value

    def _check_journal(self, seq: int, label: str, record: dict, cohort: str) -> None:
        entry = self._journalled.get(seq)
        if entry is not None and (entry.label, entry.charge, entry.cohort) != (label, record, cohort):
            raise RecoveryMismatch(
                f"recovery: release {seq} is {label!r} {record}, but the journal holds {entry.label!r} "
                f"{entry.charge}: not the same run (same settings, data and code?); nothing was released"
            )

    def scheduled_step(self, label: str, sample: Callable[[], T]) -> T:
        """One release of a schedule already charged as a whole (:class:`ScheduledGaussian`):
        numbered and journalled like any release, charged nothing more."""
        seq = self.seq
        self._check_journal(seq, label, _STEP, "")
        return self._emit(seq, label, _STEP, "", sample)

    def accepts(self, notion: str) -> bool:
        """Whether this Releaser can account a charge stated in ``notion`` ("zcdp" or "approx-dp"):
        a zCDP filter cannot account (eps, delta) releases."""
        return notion == "zcdp" or self.filter is None

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
        seq, record, cohort = self.seq, self._record(charge), self._cohort(user_ids)
        self._check_journal(seq, label, record, cohort)
        if not self._take_backing(seq, label, record, cohort):
            if seq in self._journalled:
                raise RecoveryMismatch(
                    f"recovery: release {seq} ({label}) is journalled but the ledger has no charge of this run for "
                    "it: not the ledger of that run; nothing was released"
                )
            self._flush_before_ledger_write()
            self.ledger.charge(user_ids, charge, label=label, details=details, seq=seq)
        if self.filter is not None:
            self.filter.spend(rho)
        return self._emit(seq, label, record, cohort, sample)

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
            lambda: ScheduledGaussian(sigma, int(releases), self.noise, label, self),
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
        (:mod:`fedkl.algorithms.output_perturbation.del_output_pert`), this method guarantees the order and the charge.

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

    def __init__(
        self, sigma: float, releases: int, noise: NoiseSource, label: str, releaser: Releaser | None = None
    ) -> None:
        self.sigma = sigma
        self.releases = releases
        self.used = 0
        self._noise = noise
        self._label = label
        self._releaser = releaser  # numbers and journals each release (Releaser.scheduled_step)

    def release(self, value: torch.Tensor) -> torch.Tensor:
        if self.used >= self.releases:
            raise BudgetExhausted(f"{self._label}: all {self.releases} charged releases are used; refused")
        if not torch.is_tensor(value) or not torch.isfinite(value).all():
            raise ValueError(f"{self._label}: refusing to release a non-finite value")
        self.used += 1

        def sample() -> torch.Tensor:
            return _add_noise(value, self._noise.gaussian(tuple(value.shape), self.sigma))  # in float64, then cast

        if self._releaser is None:
            return sample()
        return self._releaser.scheduled_step(f"{self._label}#{self.used}", sample)
