"""White-box audit: every release's REALISED sensitivity against the one its noise was calibrated for,
and the noise actually drawn against the scale its charge implies. No sampling where a release's law
is known.

The algorithm runs exactly as ``fedkl run`` trains it (:func:`fedkl.runner.train_federation`: builder,
ledger, filter, the one door :class:`~fedkl.privacy.release.Releaser`), with a recording Releaser
(:class:`TapReleaser`) and a recording noise source (:class:`Tap`, the innermost source of every draw).

Adaptivity (conditioning on one transcript). Release i's exact value ``f_i(D | y_<i)`` depends on the
earlier outputs. So:

1. world D runs with noise (``record``): its outputs y_0, y_1, ... (the transcript), its charges, and
   every draw (those outside releases too: Poisson cohorts) are recorded;
2. world D runs again (``replay``): every release computes its exact value (its sample callable runs
   on a ZERO noise source, which also zeroes stateful correlated noise) and then returns world D's
   output y_i; draws outside releases (cohort sampling) are world D's; inside a release the uniform and
   categorical draws are world D's too (a deletion budget), the Gaussian and Laplace draws zero;
3. each neighbouring world D' replays the same way: ``f_i(D' | y_<i)``.

Release i's exact values on D and D' are compared on one transcript, against its typed charge
(:mod:`fedkl.privacy.charges`): a Gaussian (or a scheduled Gaussian step) by the L2 norm of the move
and the charge's ``sensitivity``; the exponential mechanism by the largest utility move; above-threshold
by the largest query move. The algorithm's declared :class:`~fedkl.privacy.guarantee.Absence` says how
(``measure``): ``prefix-increment`` for a matrix mechanism's prefix sums (dp-ftrl), ``not-sensitivity``
for a release whose guarantee is not a sensitivity bound (paper 002's deletion-stability Gaussian: left
to the sampling audits, :mod:`fedkl.audit.audit`). A release made in one world and not at the same
index, with the same label, charge and cohort, in the other (a charge that depends on the data, not
only on y_<i) is a finding, and so is a run that completes in one world and aborts in the other (whether
a run completes must never depend on one user's data).

Neighbouring worlds (:data:`NEIGHBOURS`), per relation and backend. The target is user 0, or, for an
algorithm whose users each take part in one cohort, the first user of the first cohort that is not
everyone (:func:`choose_target`):

* in-process, replace-one: ``outlier`` (all of the user's records replaced by the extreme records within
  the loaders' bounds, x = R e_0 with the opposite label) and ``failed`` (the user fails every request:
  a zero row in ``failed``, the federation's policy);
* in-process, add-remove: ``absent`` (the enrolled user absent = failed in every request: zero-out,
  :data:`~fedkl.privacy.guarantee.RELATION_TEXT`) and ``absent-outlier`` (world D with the target's
  records the outlier's, world D' without it);
* LocalGrid (the Flower path, ClientApps over the wire; one other user drops out and one answers NaN in
  BOTH worlds), replace-one: ``negated`` (the client answers minus its honest answer: finite, inside
  every norm bound, the largest move a clipped answer can make), ``huge`` (1e6 in every coordinate),
  ``zero``, ``nan``, ``drop`` (answers the handshake, then never); the finite lies only for algorithms whose
  guarantee holds for any client (:mod:`fedkl.privacy.clients`); add-remove: ``absent`` (no node),
  ``drop`` and ``absent-huge`` (world D with the target answering 1e6, world D' without its node).

Noise check (world D's recording): every Gaussian draw inside a release has the std its charge implies
(``sensitivity / sqrt(2 rho)``, the schedule's sigma, the stability test's sigma), every exponential
mechanism's log-weights are ``eps u / (2 sensitivity)`` (``/ sensitivity`` if monotone) of the utilities
it was given, every above-threshold's Laplace scales are ``2 Delta/eps`` and ``4 Delta/eps``; exact.
And the noise actually in the outputs, ``(y_i - f_i(D | y_<i)) / sigma_i`` over every independent
Gaussian release, must look standard normal: a two-sided chi-square test of the sum of squares
(:func:`noise_law`), which catches a noise scaled after it was drawn.

Floating point: a realised move is compared with ``sensitivity + tol``, ``tol`` = 64 float64 epsilons
times (the norms of both values + the sensitivity) times sqrt(the number of coordinates): rounding in
sums of a few dozen terms, far below any calibration error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from fedkl.algorithms.catalog import REGISTRY
from fedkl.data.base import FederatedDataset
from fedkl.federation.base import Answers
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy.mechanisms import ExponentialMechanism
from fedkl.privacy.release import Releaser, ScheduledGaussian
from fedkl.privacy.rng import NoiseSource
from fedkl.privacy.sparse_vector import AboveThreshold

TARGET = 0  # the user whose neighbours are searched
BACKGROUND = {"drop": 1, "nan": 2}  # LocalGrid: users that fail in BOTH worlds (a dropout, a NaN answer)
HUGE = 1e6
_EPS64 = float(np.finfo(np.float64).eps)


@dataclass(frozen=True)
class Neighbour:
    """One kind of neighbouring world: its name, relation, backend, whether it needs a client that may
    run other code (``any_client``), and what it is."""

    name: str
    relation: str
    backend: str
    text: str
    any_client: bool = False
    base: str | None = None  # the kind applied to the target in world D too (None: honest)


NEIGHBOURS = (
    Neighbour("outlier", "replace-one", "inprocess", "the target's records replaced by x = R e_0, opposite label"),
    Neighbour("failed", "replace-one", "inprocess", "the target fails every request (zero row, listed failed)"),
    Neighbour("absent", "add-remove", "inprocess", "the target absent: failed in every request (zero-out)"),
    Neighbour(
        "absent-outlier",
        "add-remove",
        "inprocess",
        "world D: the target's records are the outlier's; world D': the target absent",
        base="outlier",
    ),
    Neighbour("negated", "replace-one", "flower", "the client answers minus its honest answer", any_client=True),
    Neighbour("huge", "replace-one", "flower", f"the client answers {HUGE:g} in every coordinate", any_client=True),
    Neighbour("zero", "replace-one", "flower", "the client answers exact zeros", any_client=True),
    Neighbour("nan", "replace-one", "flower", "the client answers NaN"),
    Neighbour("drop", "replace-one", "flower", "the client answers the handshake, then never"),
    Neighbour("absent", "add-remove", "flower", "no node holds the target (enrolled, absent)"),
    Neighbour("drop", "add-remove", "flower", "the target's node drops out after the handshake"),
    Neighbour(
        "absent-huge",
        "add-remove",
        "flower",
        f"world D: the target answers {HUGE:g} in every coordinate; world D': no node holds it",
        any_client=True,
        base="huge",
    ),
)
BACKENDS = ("inprocess", "flower")


def neighbours(relation: str, backend: str, any_client: bool = True) -> list[Neighbour]:
    """The neighbour kinds searched for ``relation`` on ``backend`` (the finite lies only where the
    guarantee holds for any client)."""
    return [
        k for k in NEIGHBOURS if k.relation == relation and k.backend == backend and (any_client or not k.any_client)
    ]


class Divergence(RuntimeError):
    """World D' asked for another release (label, charge or cohort) than world D at the same index."""


# ---- the noise --------------------------------------------------------------------------------------------
class Tap(NoiseSource):
    """The innermost noise source of a white-box run. ``record``: draws from ``inner`` and logs every draw
    (outside releases, and inside release ``seq`` with its requested std / scale / log-weights);
    ``replay``: outside releases returns the recorded draws in order, inside a release zero Gaussian and
    Laplace noise and the recorded uniform / categorical draws of that release (module docstring)."""

    def __init__(self, inner: NoiseSource | None = None, recorded: "Tap | None" = None) -> None:
        super().__init__(None)
        self.inner, self.recorded = inner, recorded
        self.release: int | None = None  # the release whose sample is running (set by TapReleaser)
        self.outside: list[tuple[str, Any]] = []
        self.inside: dict[int, list[tuple[str, Any, Any]]] = {}
        self._cursor_out = 0
        self._cursor_in: dict[int, int] = {}

    @property
    def mode(self) -> str:  # what result files say
        return self.inner.mode if self.inner is not None else "seeded"

    def describe(self) -> dict:
        return self.inner.describe() if self.inner is not None else {"noise_rng": "white-box replay"}

    def _log(self, kind: str, arg: Any, out: Any) -> Any:
        if self.release is None:
            self.outside.append((kind, out))
        else:
            self.inside.setdefault(self.release, []).append((kind, arg, out))
        return out

    def _replayed(self, kind: str) -> Any:
        rec = self.recorded
        if self.release is None:
            i = self._cursor_out
            if i >= len(rec.outside) or rec.outside[i][0] != kind:
                raise Divergence(f"a {kind} draw outside releases that world D did not make at this point")
            self._cursor_out += 1
            return rec.outside[i][1]
        draws = [d for d in rec.inside.get(self.release, ()) if d[0] == kind]
        j = self._cursor_in.get((self.release, kind), 0)
        self._cursor_in[(self.release, kind)] = j + 1
        return draws[j][2] if j < len(draws) else None

    def uniform(self, n: int) -> np.ndarray:
        if self.recorded is None:
            return self._log("uniform", n, self.inner.uniform(n))
        got = self._replayed("uniform")
        return np.full(n, 0.5) if got is None or len(got) != n else got

    def gaussian(self, shape, std: float) -> torch.Tensor:
        if self.recorded is None:
            return self._log("gaussian", float(std), self.inner.gaussian(shape, std))
        if self.release is None:
            return self._replayed("gaussian")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return torch.zeros(shape, dtype=torch.float64)

    def laplace(self, shape, scale: float) -> torch.Tensor:
        if self.recorded is None:
            return self._log("laplace", float(scale), self.inner.laplace(shape, scale))
        if self.release is None:
            return self._replayed("laplace")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return torch.zeros(shape, dtype=torch.float64)

    def categorical(self, log_weights: np.ndarray) -> int:
        lw = np.asarray(log_weights, dtype=np.float64)
        if self.recorded is None:
            return self._log("categorical", lw.copy(), self.inner.categorical(lw))
        got = self._replayed("categorical")
        return int(np.argmax(lw)) if got is None or got >= lw.size else got


class ScaledNoise(NoiseSource):
    """A deliberately wrong noise source (the audit's negative control): every Gaussian std and Laplace
    scale times ``factor``, every categorical's log-weights divided by it (the exponential mechanism's
    noise scaled by ``factor``); uniforms unchanged. ``factor = 0.5``: a 2x noise error."""

    def __init__(self, inner: NoiseSource, factor: float) -> None:
        super().__init__(None)
        self.inner, self.factor = inner, factor

    mode = property(lambda self: self.inner.mode)

    def describe(self) -> dict:
        return {**self.inner.describe(), "scaled_by": self.factor}

    def uniform(self, n: int) -> np.ndarray:
        return self.inner.uniform(n)

    def gaussian(self, shape, std: float) -> torch.Tensor:
        return self.inner.gaussian(shape, std * self.factor)

    def laplace(self, shape, scale: float) -> torch.Tensor:
        return self.inner.laplace(shape, scale * self.factor)

    def categorical(self, log_weights: np.ndarray) -> int:
        return self.inner.categorical(np.asarray(log_weights, dtype=np.float64) / self.factor)


# ---- the releases -------------------------------------------------------------------------------------------
@dataclass
class Release:
    """One release of a white-box run: its index, label, charge record, cohort digest, the value it
    returned (``output``: world D's noisy value in a recording, the transcript's in a replay) and its
    ``exact`` value (replay: the value with zero noise; the utilities of an exponential mechanism, the
    queries of above-threshold)."""

    seq: int
    label: str
    charge: dict
    cohort: str
    output: Any = None
    exact: Any = None
    members: tuple = ()


class TapReleaser(Releaser):
    """The Releaser of a white-box run (``session``: a :class:`Session`, set on a subclass by
    :func:`releaser_for`): records each release; in a replay, returns the transcript's outputs."""

    session: "Session"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._pending: Any = None
        self._members: tuple = ()
        self.made: list[Release] = []

    def release(self, charge, sample, *, user_ids, label, details=None):
        self._members = tuple(user_ids)
        return super().release(charge, sample, user_ids=user_ids, label=label, details=details)

    def exponential(self, utilities, **kw) -> int:
        self._pending = np.asarray(
            utilities.detach().cpu().numpy() if torch.is_tensor(utilities) else utilities, dtype=np.float64
        ).copy()
        return super().exponential(utilities, **kw)

    def above_threshold(self, queries, **kw) -> int | None:
        self._pending = np.asarray([float(v) for v in queries], dtype=np.float64)
        return super().above_threshold(queries, **kw)

    def _emit(self, seq: int, label: str, record: dict, cohort: str, sample: Callable[[], Any]) -> Any:
        s, tap = self.session, self.session.tap
        pending, self._pending = self._pending, None
        tap.release = seq
        try:
            if s.transcript is None:
                value = super()._emit(seq, label, record, cohort, sample)
                self.made.append(
                    Release(seq, label, record, cohort, output=_copy(value), exact=pending, members=self._members)
                )
                return value
            if seq >= len(s.transcript):
                raise Divergence(f"release {seq} ({label}) was not made in world D (it made {len(s.transcript)})")
            want = s.transcript[seq]
            if (want.label, want.charge, want.cohort) != (label, record, cohort):
                raise Divergence(
                    f"release {seq}: world D made {want.label!r} {want.charge}, this world {label!r} {record}"
                    + (" (another cohort)" if want.cohort != cohort else "")
                )
            self.seq = seq + 1
            exact = sample()
            self.made.append(Release(seq, label, record, cohort, output=want.output, exact=_copy(exact)))
            if pending is not None:
                self.made[-1].exact = pending
            return exact if isinstance(exact, ScheduledGaussian) else _copy(want.output)
        finally:
            tap.release = None


def _copy(v: Any) -> Any:
    return v.detach().clone() if torch.is_tensor(v) else v


@dataclass
class Session:
    """One white-box run's recorder: its :class:`Tap`, the transcript it replays (None: it records)."""

    tap: Tap
    transcript: list[Release] | None = None
    releaser: TapReleaser | None = None


def releaser_for(session: Session) -> type:
    """A :class:`TapReleaser` class bound to ``session`` (what :func:`fedkl.runner.train_federation`
    builds as the run's Releaser); the instance is kept on the session."""

    class Bound(TapReleaser):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            session.releaser = self

    Bound.session = session
    return Bound


# ---- the worlds ---------------------------------------------------------------------------------------------
class FailingFederation(InProcessFederation):
    """The in-process federation in which the users at ``failed`` fail every request: a zero row,
    listed in ``failed`` (the failure policy of :mod:`fedkl.federation.base`)."""

    def __init__(self, problem, dataset: FederatedDataset, failed: Sequence[int]) -> None:
        super().__init__(problem, dataset)
        self.failing = set(failed)

    def compute(self, query, users=None) -> Answers:
        ans = super().compute(query, users)
        lost = [u for u in ans.users if u in self.failing]
        if not lost:
            return ans
        values = ans.values.clone()
        for u in lost:
            values[ans.users.index(u)] = 0
        return Answers(ans.users, values, sorted(set(ans.failed) | set(lost)))


def outlier_dataset(dataset: FederatedDataset, user: int = TARGET) -> FederatedDataset:
    """``dataset`` with all of ``user``'s train records replaced by ``x = R e_0`` (R the declared
    feature bound) and the label opposite to its first record's (binary), or the largest label in the
    data of the other sign (regression): records within the loaders' bounds."""
    tr = dataset.train
    rec = tr.user_index == user
    X, y = tr.X.clone(), tr.y.clone()
    X[rec] = 0
    X[rec, 0] = dataset.feature_bound
    if dataset.task == "multiclass":
        y[rec] = (int(y[rec][0]) + 1) % max(dataset.num_classes, 2)
    else:
        first = float(y[rec][0]) if rec.any() else 1.0
        y[rec] = -float(y.abs().max()) if first >= 0 else float(y.abs().max())
    return dataclasses.replace(dataset, train=dataclasses.replace(tr, X=X, y=y))


@dataclass(frozen=True)
class World:
    """One world: the backend, the neighbour kind applied to the target (None: honest)."""

    backend: str
    kind: str | None = None
    target: int = TARGET


def _flower_faults(kind: str | None, target: int = TARGET) -> dict:
    from fedkl.flower import localgrid

    faults = {BACKGROUND["drop"]: localgrid.drop(), BACKGROUND["nan"]: localgrid.nan_reply()}
    absent: list[int] = []
    if kind == "negated":
        faults[target] = localgrid._ReplyFault(
            lambda req, rep: (
                localgrid._with_value(req, -rep.content["answer"]["value"].numpy()) if "answer" in rep.content else rep
            )
        )
    elif kind == "huge":
        faults[target] = localgrid._ReplyFault(
            lambda req, rep: (
                localgrid._with_value(req, np.full(rep.content["answer"]["value"].shape, HUGE))
                if "answer" in rep.content
                else rep
            )
        )
    elif kind == "zero":
        faults[target] = localgrid.zero_reply()
    elif kind == "nan":
        faults[target] = localgrid.nan_reply()
    elif kind == "drop":
        faults[target] = localgrid.drop()
    elif kind in ("absent", "absent-huge"):
        absent.append(target)
    elif kind is not None:
        raise ValueError(f"unknown LocalGrid neighbour {kind!r}")
    return {"faults": faults, "absent": absent}


@contextlib.contextmanager
def open_world(cfg, world: World):
    """``(federation, problem, dataset)`` of ``world`` for ``cfg`` (closed on exit)."""
    from fedkl.runner import load_run_dataset, run_problem

    dataset = load_run_dataset(cfg)
    if world.backend == "inprocess":
        if world.kind in ("outlier", "absent-outlier"):
            dataset = outlier_dataset(dataset, world.target)
        # the float type the run computes in (--dtype; a torch model's float32 only where the algorithm allows)
        problem, _ = run_problem(cfg, dataset)
        if world.kind in ("failed", "absent", "absent-outlier"):
            yield FailingFederation(problem, dataset, [world.target]), problem, dataset
        elif world.kind in (None, "outlier"):
            yield InProcessFederation(problem, dataset), problem, dataset
        else:
            raise ValueError(f"unknown in-process neighbour {world.kind!r}")
        return
    import fedkl.flower.backends  # noqa: F401  (registers the Flower transports)
    from fedkl.flower.codec import ClientSpec
    from fedkl.flower.server_app import open_federation

    problem, _ = run_problem(cfg, dataset)  # the server's problem, as the run's
    spec = ClientSpec.from_run_config(cfg, task=dataset.task)
    with open_federation(
        "flower-local",
        spec,
        user_ids=dataset.train.user_ids,
        num_params=problem.num_params,
        **_flower_faults(world.kind, world.target),
    ) as fed:
        yield fed, problem, dataset


@dataclass
class Outcome:
    """A white-box run: its releases, or the error that stopped it (``error``: one line)."""

    releases: list[Release] = field(default_factory=list)
    error: str | None = None
    diverged: bool = False
    tap: Tap | None = None
    declared: Any = None  # the algorithm's Guarantee, when the run completed


def run_world(cfg, world: World, session: Session, noise: NoiseSource | None = None) -> Outcome:
    """Train ``cfg`` in ``world`` through ``session``'s recording Releaser; ``noise``: what the run is
    given (default the session's Tap; the negative control wraps the Tap)."""
    from fedkl.runner import default_delta, train_federation

    scratch = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    out = Outcome(tap=session.tap)
    try:
        with (
            open_world(cfg, world) as (federation, problem, dataset),
            tempfile.TemporaryDirectory(prefix="fedkl-whitebox-", dir=scratch) as tmp,
        ):
            delta = cfg.delta if cfg.delta is not None else default_delta(federation.num_users)
            _, _, out.declared = train_federation(
                cfg,
                federation,
                problem,
                dataset,
                delta,
                os.path.join(tmp, "ledger.sqlite"),
                "whitebox",
                noise or session.tap,
                lambda _: None,
                scratch=True,
                releaser_type=releaser_for(session),
            )
    except Divergence as e:
        out.error, out.diverged = f"diverged: {e}", True
    except Exception as e:  # noqa: BLE001  (an abort is a finding: it must not depend on the world)
        out.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if session.releaser is not None:
        out.releases = session.releaser.made
    return out


# ---- the comparison ---------------------------------------------------------------------------------------
@dataclass
class Finding:
    """One release's realised vs declared sensitivity (``realised`` None: not comparable, ``note`` says why)."""

    seq: int
    label: str
    mechanism: str
    declared: float | None
    realised: float | None
    tol: float = 0.0
    note: str = ""

    @property
    def exceeds(self) -> bool:
        return self.realised is not None and self.declared is not None and self.realised > self.declared + self.tol


def _flat(v: Any) -> np.ndarray:
    return (v.detach().cpu().to(torch.float64).numpy() if torch.is_tensor(v) else np.asarray(v, np.float64)).ravel()


def _tol(a: np.ndarray, b: np.ndarray, sens: float) -> float:
    return 64 * _EPS64 * (np.linalg.norm(a) + np.linalg.norm(b) + sens) * math.sqrt(max(a.size, 1))


def compare(algorithm: str, relation: str, backend: str, d: Sequence[Release], e: Sequence[Release]) -> list[Finding]:
    """Each release's realised sensitivity between the exact values ``d`` (world D) and ``e`` (world
    D') of one transcript, against its charge (module docstring)."""
    spec = REGISTRY[algorithm]
    absence_backend = "inprocess" if backend == "inprocess" else "flower"
    out: list[Finding] = []
    schedules: dict[str, dict] = {}
    prev: dict[str, np.ndarray] = {}
    top: dict[str, float] = {}
    for a, b in zip(d, e):
        c = a.charge
        kind = c.get("type")
        if kind == "ApproxDPCharge" and c.get("mechanism") == "gaussian-schedule":
            schedules[a.label] = c
            continue
        rule = spec.absence_rule(a.label, relation, absence_backend)
        if kind == "scheduled-step":
            sched = schedules.get(a.label.rsplit("#", 1)[0])
            mech, sens = "gaussian-schedule", (sched or {}).get("sensitivity")
        else:
            mech, sens = c.get("mechanism", kind), c.get("sensitivity")
        if rule.measure == "not-sensitivity":
            out.append(Finding(a.seq, a.label, mech, sens, None, note="not a sensitivity bound (sampling audit)"))
            continue
        if sens is None or a.exact is None or b.exact is None or isinstance(a.exact, ScheduledGaussian):
            note = "no value released" if a.exact is None and b.exact is None else "no value in one world"
            out.append(Finding(a.seq, a.label, mech, sens, None, note=note if sens is not None else "no sensitivity"))
            continue
        x, y = _flat(a.exact), _flat(b.exact)
        if x.shape != y.shape:
            out.append(Finding(a.seq, a.label, mech, sens, math.inf, note="values of different shapes"))
            continue
        if mech in ("exponential", "above-threshold"):
            realised = float(np.max(np.abs(x - y))) if x.size else 0.0
        elif rule.measure == "prefix-increment":
            diff = x - y
            stream = rule.releases
            realised = float(np.linalg.norm(diff - prev.get(stream, np.zeros_like(diff))))
            prev[stream] = diff
            top[stream] = sens = max(top.get(stream, 0.0), sens)
        else:
            realised = float(np.linalg.norm(x - y))
        out.append(Finding(a.seq, a.label, mech, sens, realised, _tol(x, y, sens)))
    return out


@dataclass
class Search:
    """The white-box search of one algorithm x relation x backend: world D's recording and exact replay,
    and per neighbour kind its findings (or why none)."""

    algorithm: str
    relation: str
    backend: str
    record: Outcome
    exact: Outcome
    target: int = TARGET
    bases: dict[str | None, tuple[Outcome, Outcome]] = field(default_factory=dict)  # world D per base kind
    kinds: dict[str, Outcome] = field(default_factory=dict)
    findings: dict[str, list[Finding]] = field(default_factory=dict)

    def problems(self, kind: str) -> list[str]:
        """Why ``kind``'s neighbour breaks the declaration (empty: it does not)."""
        out = []
        kind_of = {k.name: k for k in NEIGHBOURS if k.relation == self.relation and k.backend == self.backend}
        record, base = self.bases.get(kind_of[kind].base, (self.record, self.exact))
        other = self.kinds[kind]
        if record.error or base.error:
            out.append(f"world D: {record.error or base.error}")
        if other.error and not (record.error or base.error):
            out.append(f"world D' ({kind}) {'diverged' if other.diverged else 'aborted'}: {other.error}")
        for f in self.findings.get(kind, []):
            if f.exceeds:
                out.append(f"{f.label} ({f.mechanism}): realised {f.realised:.6g} > declared {f.declared:.6g}")
        if not other.error and len(other.releases) != len(base.releases):
            out.append(f"world D made {len(base.releases)} releases, world D' ({kind}) {len(other.releases)}")
        return out

    def zero_rule(self, answered: str = "zero", failed: str = "drop") -> list[str]:
        """The declared ``zero`` absence rule, checked: for every release the algorithm declares ``zero``
        (a failed user's answer is the zero vector), the exact values with the target answering exact
        zeros (kind ``answered``) and with it failing (``failed``) must be equal. Empty when they are (or
        when either kind did not run or complete)."""
        a, b = self.kinds.get(answered), self.kinds.get(failed)
        if a is None or b is None or a.error or b.error:
            return []
        spec = REGISTRY[self.algorithm]
        backend = "inprocess" if self.backend == "inprocess" else "flower"
        out = []
        for x, y in zip(a.releases, b.releases):
            rule = spec.absence_rule(x.label, self.relation, backend)
            if rule.mode != "zero" or x.exact is None or y.exact is None or isinstance(x.exact, ScheduledGaussian):
                continue
            u, v = _flat(x.exact), _flat(y.exact)
            if u.shape != v.shape or np.linalg.norm(u - v) > _tol(u, v, 0.0):
                out.append(f"{x.label}: declared 'zero' but a failed user and one answering zeros differ")
        return out

    def worst(self, kind: str) -> tuple[float, float] | None:
        """The largest realised / declared ratio's pair among ``kind``'s findings."""
        pairs = [(f.realised, f.declared) for f in self.findings.get(kind, []) if f.realised is not None and f.declared]
        return max(pairs, key=lambda p: p[0] / p[1]) if pairs else None


def choose_target(releases: Sequence[Release], user_ids: Sequence[str]) -> int:
    """The searched user's position: the first user (not one of the :data:`BACKGROUND` failures) of the
    first release with a sensitivity whose cohort is not everyone (algorithms whose users each take part
    in one cohort), else :data:`TARGET`."""
    position = {uid: p for p, uid in enumerate(user_ids)}
    for r in releases:
        if r.members and len(r.members) < len(user_ids) and r.charge.get("sensitivity") is not None:
            for uid in r.members:
                if position.get(uid, 0) not in (*BACKGROUND.values(), 0) or position.get(uid) == TARGET:
                    return position[uid]
    return TARGET


def search(
    cfg,
    relation: str,
    backend: str,
    kinds: Sequence[str] | None = None,
    noise_seed: int = 0,
    noise_factor: float = 1.0,
) -> Search:
    """Run the white-box search (module docstring) of ``cfg``'s algorithm under ``relation`` on
    ``backend`` (``"inprocess"`` or ``"flower"``: LocalGrid) for neighbour ``kinds`` (default: every
    kind :func:`neighbours` lists). ``noise_factor``: world D's noise scaled by it (:class:`ScaledNoise`,
    the negative control of the noise check; 1: as the algorithm draws it)."""
    cfg = dataclasses.replace(cfg, neighbouring=relation)
    if backend == "flower":
        # the search runs each algorithm under the trust model its guarantee states: an in-class guarantee
        # is searched with the operator's opt-in (fedkl.privacy.clients.require_trust), and its neighbours
        # are then only the kinds an in-class client can produce (neighbours(any_client=False))
        cfg = dataclasses.replace(cfg, kernels="reproducible", clients="in-class")
    from fedkl.runner import load_run_dataset

    covered = kinds is None  # every kind the algorithm's client model covers (read from world D's guarantee)
    if kinds is None:
        kinds = [k.name for k in neighbours(relation, backend)]
    kind_of = {k.name: k for k in NEIGHBOURS if k.relation == relation and k.backend == backend}
    target, out = TARGET, None
    bases = {kind_of[k].base for k in kinds} or {None}  # no kinds: world D alone (the noise check)
    for base in sorted(bases, key=lambda b: b or ""):  # the honest world first
        rec = Session(Tap(NoiseSource(noise_seed)))
        noise = rec.tap if noise_factor == 1.0 else ScaledNoise(rec.tap, noise_factor)
        record = run_world(cfg, World(backend, base, target), rec, noise)
        exact = run_world(cfg, World(backend, base, target), Session(Tap(recorded=rec.tap), transcript=record.releases))
        if out is None:
            target = choose_target(record.releases, load_run_dataset(cfg).train.user_ids)
            out = Search(cfg.algorithm, relation, backend, record, exact, target=target)
            if target != TARGET and base is not None:  # world D depends on the target: record it again
                rec = Session(Tap(NoiseSource(noise_seed)))
                noise = rec.tap if noise_factor == 1.0 else ScaledNoise(rec.tap, noise_factor)
                record = run_world(cfg, World(backend, base, target), rec, noise)
                exact = run_world(
                    cfg, World(backend, base, target), Session(Tap(recorded=rec.tap), transcript=record.releases)
                )
        out.bases[base] = (record, exact)
        for kind in (k for k in kinds if kind_of[k].base == base):
            declared = out.record.declared
            if covered and kind_of[kind].any_client and (declared is None or declared.clients.name != "any"):
                continue  # in-class clients: a finite lie is not a neighbour the guarantee covers
            other = run_world(
                cfg, World(backend, kind, target), Session(Tap(recorded=rec.tap), transcript=record.releases)
            )
            out.kinds[kind] = other
            out.findings[kind] = compare(cfg.algorithm, relation, backend, exact.releases, other.releases)
    return out


# ---- the noise check --------------------------------------------------------------------------------------
def noise_scales(record: Outcome) -> list[str]:
    """Every draw inside a release of world D against the scale its charge implies (module docstring):
    the mismatches, one line each (empty: every draw had its charge's scale)."""
    bad: list[str] = []
    schedules: dict[str, dict] = {}
    tap = record.tap
    for r in record.releases:
        c, draws = r.charge, tap.inside.get(r.seq, [])
        kind, mech = c.get("type"), c.get("mechanism")
        if kind == "ApproxDPCharge" and mech == "gaussian-schedule":
            schedules[r.label] = c
            continue
        if kind == "scheduled-step":
            want = {"gaussian": (schedules.get(r.label.rsplit("#", 1)[0]) or {}).get("noise_scale")}
        elif kind == "GaussianCharge":
            sens = c.get("sensitivity")
            want = {"gaussian": None if not c.get("rho") or sens is None else sens / math.sqrt(2 * c["rho"])}
        elif kind == "ApproxDPCharge" and mech == "stability-gaussian":
            want = {"gaussian": c.get("noise_scale")}
        elif kind == "ApproxDPCharge" and mech == "above-threshold":
            at = AboveThreshold(c["eps"], 0.0, c["sensitivity"])
            want = {"laplace": (at.threshold_scale, at.query_scale)}
        elif kind == "ExponentialCharge":
            mech_ = ExponentialMechanism(c["eps"], c["sensitivity"], c.get("monotone", False))
            lws = [d[1] for d in draws if d[0] == "categorical"]
            if r.exact is not None and lws:
                expected = mech_.log_weights(np.asarray(r.exact))
                if lws[0].shape != expected.shape or not np.allclose(lws[0], expected, rtol=1e-12, atol=0):
                    bad.append(
                        f"{r.label}: exponential log-weights are not eps u / (factor sensitivity) of its utilities"
                    )
            continue
        else:
            continue
        for d in draws:
            if d[0] == "gaussian" and "gaussian" in want and want["gaussian"] is not None:
                if not math.isclose(d[1], want["gaussian"], rel_tol=1e-12):
                    bad.append(f"{r.label}: Gaussian std {d[1]:.6g}, its charge implies {want['gaussian']:.6g}")
            elif d[0] == "laplace" and "laplace" in want:
                if not any(math.isclose(d[1], s, rel_tol=1e-12) for s in want["laplace"]):
                    bad.append(f"{r.label}: Laplace scale {d[1]:.6g}, its charge implies one of {want['laplace']}")
            elif d[0] in ("gaussian", "laplace") and d[0] not in want:
                bad.append(f"{r.label}: a {d[0]} draw its {kind} charge does not describe")
    return bad


def noise_law(record: Outcome, exact: Outcome, algorithm: str, relation: str, backend: str) -> dict:
    """The noise actually in world D's independent Gaussian releases, ``(y_i - f_i(D | y_<i)) / sigma_i``
    (sigma_i: its charge's), pooled: ``{"coordinates": N, "sum_squares": S, "p_low", "p_high"}`` with S
    ~ chi-square(N) when the noise has its claimed law (p_low small: too little noise)."""
    from scipy.stats import chi2

    spec = REGISTRY[algorithm]
    absence_backend = "inprocess" if backend == "inprocess" else "flower"
    schedules: dict[str, dict] = {}
    z: list[np.ndarray] = []
    for r, x in zip(record.releases, exact.releases):
        c = r.charge
        if c.get("type") == "ApproxDPCharge" and c.get("mechanism") == "gaussian-schedule":
            schedules[r.label] = c
            continue
        if spec.absence_rule(r.label, relation, absence_backend).measure != "sensitivity":
            continue
        if c.get("type") == "scheduled-step":
            sigma = (schedules.get(r.label.rsplit("#", 1)[0]) or {}).get("noise_scale")
        elif c.get("type") == "GaussianCharge" and c.get("rho") and c.get("sensitivity"):
            sigma = c["sensitivity"] / math.sqrt(2 * c["rho"])
        else:
            continue
        if sigma and torch.is_tensor(r.output) and torch.is_tensor(x.exact) and r.output.shape == x.exact.shape:
            z.append((_flat(r.output) - _flat(x.exact)) / sigma)
    n = int(sum(v.size for v in z))
    s = float(sum(float(np.sum(v**2)) for v in z))
    if n == 0:
        return {"coordinates": 0, "sum_squares": 0.0, "p_low": 1.0, "p_high": 1.0}
    return {"coordinates": n, "sum_squares": s, "p_low": float(chi2.cdf(s, n)), "p_high": float(chi2.sf(s, n))}


# ---- the audit (`fedkl audit --method white-box`) -----------------------------------------------------------
LAW_ALPHA = 1e-4  # the chi-square check's two-sided level (a correct mechanism is flagged with probability 2e-4)


def _audit_searches(cfg, algorithm, seed, noise_scale, backends, report, problems, refusals, log) -> None:
    """:func:`white_box_audit`'s searches, every relation x backend, into ``report`` / ``problems`` / ``refusals``."""
    from fedkl.privacy.guarantee import RELATIONS

    for relation in RELATIONS:
        for backend in backends:
            s = search(cfg, relation, backend, noise_seed=seed, noise_factor=noise_scale)
            err = s.record.error or ""
            if err.startswith("ValueError") and not s.record.releases:
                refusals.append(f"{relation}: {err}")
                break  # the relation is refused before any data: the same on every backend
            entry = {"relation": relation, "backend": backend, "target": s.target, "kinds": {}}
            for kind in s.kinds:
                found = s.problems(kind)
                worst = s.worst(kind)
                entry["kinds"][kind] = {"problems": found, "worst_realised_declared": worst}
                problems += [f"{relation} {backend} {kind}: {p}" for p in found]
            problems += [f"{relation} {backend} absence rule: {p}" for p in s.zero_rule()]
            if not s.record.error:
                scales = noise_scales(s.record)
                law = noise_law(s.record, s.exact, algorithm, relation, backend)
                entry.update(noise_scales=scales, noise_law=law)
                problems += [f"{relation} {backend} noise: {p}" for p in scales]
                if min(law["p_low"], law["p_high"]) < LAW_ALPHA:
                    problems.append(
                        f"{relation} {backend} noise law: sum of squares {law['sum_squares']:.4g} over "
                        f"{law['coordinates']} standardised coordinates (p_low {law['p_low']:.2g}, p_high {law['p_high']:.2g})"
                    )
            elif not s.kinds:
                problems.append(f"{relation} {backend}: world D: {s.record.error}")
            report["searches"].append(entry)
            log(f"  {algorithm} {relation} {backend}: {len(s.kinds)} neighbour kinds, target user {s.target}")


def white_box_audit(
    algorithm: str,
    epsilon: float,
    out: str,
    *,
    settings: dict | None = None,
    seed: int = 0,
    noise_scale: float = 1.0,
    users: int | None = None,
    backends: Sequence[str] = BACKENDS,
    log: Callable[[str], None] = print,
) -> dict:
    """``fedkl audit --method white-box``: the search of every relation the algorithm covers on both
    backends with every neighbour kind, and the noise check, at the algorithm's small audit setting
    (:func:`fedkl.audit.settings.small_settings`) on synthetic-logistic with ``users`` users (default the
    small audit's), on ``backends``. ``noise_scale``: world D's noise scaled by it (0.5: the 2x negative control). Verdict
    "VIOLATION" when a release moves beyond its sensitivity, a run completes in one world only, a draw
    is not at its charge's scale, or the noise in the outputs fails the chi-square check at
    :data:`LAW_ALPHA`; "refused" when no relation's setting is accepted; else "consistent with claim"."""
    import json

    from fedkl.audit.release import audit_config
    from fedkl.audit.report import REFUSED, VIOLATION, write_report
    from fedkl.audit.settings import small_audit, small_settings
    from fedkl.privacy.guarantee import RELATIONS

    small = small_audit(algorithm)
    run = {"dataset": "synthetic-logistic", "users": users or small.users, "seed": seed}
    cfg = audit_config(algorithm, epsilon, {**run, **small_settings(algorithm, settings)})
    report: dict = {
        "method": "white-box",
        "algorithm": algorithm,
        "claimed": {"epsilon": epsilon, "delta": cfg.delta, "neighbouring": list(RELATIONS)},
        "setting": {"users": run["users"], "seed": seed, "noise_scale": noise_scale},
        "settings": json.loads(json.dumps(cfg.settings(), default=str)),
        "searches": [],
    }
    problems: list[str] = []
    refusals: list[str] = []
    # the LocalGrid worlds' failures are deliberate: their per-request warnings would bury the report
    quiet = logging.getLogger("fedkl.flower.federation")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        _audit_searches(cfg, algorithm, seed, noise_scale, backends, report, problems, refusals, log)
    finally:
        quiet.setLevel(level)
    report["problems"] = problems
    report["noise_problems"] = sum(" noise" in p for p in problems)  # what the negative control must show
    report["refusals"] = refusals
    if problems:
        report["verdict"] = VIOLATION
    elif not report["searches"]:
        report.update(verdict=REFUSED, reason="; ".join(refusals))
    else:
        report["verdict"] = "consistent with claim"
    os.makedirs(out, exist_ok=True)
    write_report(out, report)
    return report


def format_white_box(report: dict) -> str:
    """The report's lines for ``fedkl audit``."""
    head = f"{report['algorithm']} (white-box audit, noise x{report['setting']['noise_scale']:g})"
    if report["verdict"] == "refused":
        return f"{head}\n  refused the audit setting (nothing audited): {report.get('reason', '')}"
    lines = [head]
    for e in report["searches"]:
        worst = [w["worst_realised_declared"] for w in e["kinds"].values() if w["worst_realised_declared"]]
        ratio = max((r / d for r, d in worst), default=float("nan"))
        lines.append(
            f"  {e['relation']:11s} {e['backend']:9s}: {len(e['kinds'])} neighbour kinds, largest realised/declared "
            f"{ratio:.3g}" + (f", noise chi2 p_low {e['noise_law']['p_low']:.2g}" if "noise_law" in e else "")
        )
    lines += [f"  {p}" for p in report["problems"][:10]]
    if len(report["problems"]) > 10:
        lines.append(f"  ... {len(report['problems']) - 10} more in audit.json")
    lines.append(f"  verdict: {report['verdict']}")
    return "\n".join(lines)


__all__ = [
    "BACKENDS",
    "LAW_ALPHA",
    "format_white_box",
    "white_box_audit",
    "Divergence",
    "FailingFederation",
    "Finding",
    "NEIGHBOURS",
    "Neighbour",
    "Release",
    "ScaledNoise",
    "Search",
    "Session",
    "Tap",
    "TapReleaser",
    "World",
    "compare",
    "neighbours",
    "noise_law",
    "noise_scales",
    "open_world",
    "outlier_dataset",
    "run_world",
    "search",
]
