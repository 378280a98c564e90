"""User-level DP-FTRL with correlated noise (Kairouz et al. 2021; banded matrix factorization as in
Choquette-Choo et al. 2023 / McMahan, Xu, Zhang 2024), without sampling or shuffling.

Participation is a public schedule (:class:`ParticipationScheduler`): user u (public id) gets a
residue r_u in 0..b-1 (users ranked by a keyed hash of their ids and the run's seed, residue = rank
mod b) and is asked in rounds t = r_u, r_u + b, r_u + 2b, ..., at most k times: any two of its
rounds are >= b apart (minimum separation b) and it takes part at most k times. A user that would
violate either is not asked (:meth:`ParticipationScheduler.admit`). Round t = 0..T-1:

    cohort_t: the users scheduled at t (public; every cohort is non-empty: n >= b, T <= k b)
    each asked user u: h_u = clip_C(w_u^K - w_t)   the clipped local update from the current
                       model w_t (query :class:`~fedkl.federation.base.ClippedLocalUpdate`,
                       re-clipped on the server as in :mod:`fedkl.algorithms.gradient.dp_fedavg`)
    x_t   = sum_{u in cohort_t} h_u
    S^_t  = sum_{s <= t} x_s + (B Z)_t          (the matrix mechanism's noisy prefix sum; Z i.i.d. N(0, sigma^2))
    w_t+1 = w_0 + server_lr * S^_t / (n / b)     (FTRL with a quadratic regulariser at w_0; fixed
                                                  public denominator: the mean cohort size)

The factorization A = B C (:mod:`fedkl.privacy.matrix_mechanism`) is the binary tree
(``--factorization tree``), the banded square-root Toeplitz factor (``--factorization banded``,
``--band``; band 1 is independent noise per round), or an m-buffer BLT (``--blt-buffers``):
``--factorization blt`` is the square-root factor's Gauss-Chebyshev rational approximation,
``--factorization blt-opt`` a BLT optimised for this run's public (T, b, k) as in McMahan, Xu, Zhang
2024 (mean squared prefix-sum error; constrained so that its coefficients stay non-negative and
non-increasing and the closed-form sensitivity holds; deterministic, so anyone recomputes C).

Guarantee: the whole run is ONE Gaussian mechanism on ``C x`` (the S^_t are post-processing of
``C x + Z``) with L2 sensitivity ``Delta_K = c * max_pi ||C 1_pi||`` over every (b, k) pattern pi
(c = C add-remove, 2C replace-one: the user's per-round answer changes by at most c), computed
exactly (matrix_mechanism's proofs and DP). The inputs are adaptive (x_t depends on w_t, i.e. on
earlier releases); for a square, invertible, lower-triangular C, as all three are, the Gaussian
matrix mechanism has the same privacy under adaptively chosen inputs (Denisov et al. 2022, Thm 2.1),
and S^_t = (A C^{-1} (C x + Z))_t needs only rows <= t of C x + Z. Hence ``rho = Delta_K^2 / (2 sigma^2)``-zCDP for every
user and ``mu = Delta_K / sigma``-GDP: the exact (eps, delta) is the mu-GDP profile (the ledger's
``gaussian`` conversion). sigma is set so that rho is the budget every user can still afford.

Ledger: a user is charged at each participation, before the round's release, the increment
``(Delta_j^2 - Delta_{j-1}^2) / (2 sigma^2)`` of its j-th participation (a
:class:`~fedkl.privacy.charges.GaussianCharge` with sensitivity ``sqrt(Delta_j^2 - Delta_{j-1}^2)``
and noise scale sigma), Delta_j the max over patterns with at most j participations. A user asked
j times has paid ``Delta_j^2 / (2 sigma^2)``, at least the zCDP of the whole stream's mechanism for
its pattern (which has j participations, gaps >= b), and its Gaussian charges compose as GDP to
exactly ``Delta_j / sigma``. A user never asked is never charged: its records are never read.
What is private: every S^_t, hence every iterate and the final model. What an asked client sees:
the current model w_t (a private output). Composition: each user's ledger holds its own total (no
run-wide filter: users take part in different rounds).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from fedkl.algorithms.contract import (
    Algorithm,
    BuildContext,
    Clip,
    ModelResult,
    PlannedRelease,
    Rounds,
    SmallAudit,
    StepSize,
    param,
)
from fedkl.algorithms.gradient.local_updates import LocalUpdates
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import Federation
from fedkl.federation.clipping import clip_rows
from fedkl.privacy.charges import GaussianCharge, Need
from fedkl.privacy.guarantee import Absence, Guarantee, check_relation, sum_sensitivity
from fedkl.privacy.matrix_mechanism import FACTORIZATIONS, BufferedToeplitz, make_factorization, max_participations
from fedkl.privacy.release import Releaser


class ParticipationScheduler:
    """Deterministic cohorts from public ids: residue = rank of ``sha256(seed:id)`` mod b; user u is
    asked at rounds ≡ r_u (mod b), at most k times. :meth:`admit` enforces b and k on any candidate
    list from the history of who was asked (a violating user is not asked)."""

    def __init__(self, user_ids: Sequence[str], rounds: int, min_separation: int, max_participations: int, seed: int):
        n, b, k = len(user_ids), min_separation, max_participations
        self.check(n, rounds, b, k)
        self.rounds, self.b, self.k = int(rounds), int(b), int(k)
        keyed = sorted(range(n), key=lambda i: hashlib.sha256(f"{seed}:{user_ids[i]}".encode()).hexdigest())
        self.residue = [0] * n
        for rank, i in enumerate(keyed):
            self.residue[i] = rank % b
        self.last: dict[int, int] = {}
        self.count: dict[int, int] = {}

    @staticmethod
    def check(n: int, rounds: int, b: int, k: int) -> None:
        """Refuse (one line, before any data is read) a schedule with a round that asks nobody."""
        max_participations(rounds, b, k)  # positive integers
        if n < b:
            raise ValueError(f"--min-separation {b} is more than the {n} users: some rounds would ask nobody")
        if rounds > k * b:
            raise ValueError(
                f"--rounds {rounds} > --max-participations x --min-separation = {k * b}: the later rounds would "
                "ask nobody; raise --max-participations or --min-separation, or lower --rounds"
            )

    def planned(self, t: int) -> list[int]:
        """The users scheduled at round t (public)."""
        if t // self.b >= self.k:
            return []
        return [i for i, r in enumerate(self.residue) if r == t % self.b]

    def admit(self, t: int, candidates: Sequence[int]) -> list[int]:
        """The candidates that may take part in round t (>= b rounds since their last participation,
        fewer than k so far), recorded as participating; the others are not asked."""
        ok = [
            u
            for u in candidates
            if self.count.get(u, 0) < self.k and (u not in self.last or t - self.last[u] >= self.b)
        ]
        for u in ok:
            self.last[u] = t
            self.count[u] = self.count.get(u, 0) + 1
        return ok


@dataclass(frozen=True)
class DPFTRLParams(Rounds, StepSize, Clip, LocalUpdates):
    factorization: str = param(
        "tree",
        "dp-ftrl: the correlated-noise factorization: binary tree (Kairouz et al. 2021), the banded "
        "square-root Toeplitz factor, a BLT (buffered linear Toeplitz) approximation of the square-root factor, "
        "or a BLT optimised for the participation pattern (blt-opt)",
        "heuristic",
        choices=FACTORIZATIONS,
    )
    band: int | None = param(
        None, "dp-ftrl --factorization banded: band width (default --min-separation)", positive=True
    )
    blt_buffers: int = param(
        4, "dp-ftrl --factorization blt|blt-opt: number of buffers m (noise memory)", positive=True
    )
    min_separation: int = param(
        1, "dp-ftrl: minimum number of rounds b between two participations of one user", "heuristic", positive=True
    )
    max_participations: int | None = param(
        None, "dp-ftrl: most participations k per user (default: as many as --rounds allow)", positive=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        max_participations(self.rounds, self.min_separation, self.participations)  # validates the integers

    @property
    def participations(self) -> int:
        """k: the given maximum, or every round of the residue (ceil(T / b))."""
        if self.max_participations is not None:
            return self.max_participations
        return -(-self.rounds // self.min_separation)


# the releases are the running prefix sums of ONE matrix mechanism (module docstring): a failed user's
# update is a zero row of its round's sum x_t; each charge is an increment of the stream's sensitivity
PREFIX_SUMS = (
    Absence(
        "zero",
        "a failed, dropped or non-finite user's clipped update is the zero row of its round's sum x_t; the "
        "denominator n/b is public",
        measure="prefix-increment",
    ),
)


DPFTRLResult = ModelResult


@register
class DPFTRL(Algorithm[DPFTRLParams]):
    """DP-FTRL: correlated (tree or banded) noise on prefix sums of clipped local updates, b-min-sep cohorts (zCDP).

    See the module docstring. ``local_lr`` None: the run's ``lr``. The budget: the zCDP every user can still
    afford (``ctx.rho_left``); ``ctx.seed``: the run's public seed (cohorts)."""

    name = "dp-ftrl"
    Params = DPFTRLParams
    guarantee = Guarantee("zcdp", "parallel")
    absence = PREFIX_SUMS
    step_size = 4.0
    noise_state = True  # the factorization's noise generator carries earlier draws (register's noise_state)
    float32 = True  # L2-clipped answers, float64 sums and noise (contract.Algorithm.float32)
    small = {"neighbouring": "add-remove", "min_separation": 2, "max_participations": 2, "local_steps": 2}
    audit = SmallAudit()

    def __init__(self, params: DPFTRLParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        check_relation(ctx.neighbouring)
        if not (ctx.rho_left > 0 and math.isfinite(ctx.rho_left)):
            raise ValueError(f"the zCDP budget must be finite and > 0, got rho={ctx.rho_left}")
        p = self.params
        ParticipationScheduler.check(ctx.num_users, p.rounds, p.min_separation, p.participations)
        self.neighbouring = ctx.neighbouring
        self.rho = float(ctx.rho_left)
        self.seed = int(ctx.seed)
        self.local_lr = p.local_update_lr(p.lr)
        # per unit of c, for j = 1..K participations (exact; refused here if too costly, before any data)
        self.sensitivity_squares = self.factor.sensitivity_squares(p.min_separation, p.participations)
        self.sensitivity = self.answer_bound * math.sqrt(self.sensitivity_squares[-1])
        self.noise_std = self.sensitivity / math.sqrt(2.0 * self.rho)

    @property
    def factor(self):
        """The factorization C of this run's public (T, b, k) (matrix_mechanism)."""
        p = self.params
        band = p.min_separation if p.band is None else p.band
        return make_factorization(p.factorization, p.rounds, band, p.blt_buffers, p.min_separation, p.participations)

    @property
    def answer_bound(self) -> float:
        """c: how far one user's answer in one round can move the round sum."""
        return sum_sensitivity(self.params.clip, self.neighbouring)

    def charge(self, j: int) -> GaussianCharge:
        """What a user's j-th participation costs (module docstring)."""
        sq = self.sensitivity_squares
        increment = sq[j - 1] - (sq[j - 2] if j > 1 else 0.0)
        sens = self.answer_bound * math.sqrt(increment)
        return GaussianCharge(sens**2 / (2.0 * self.noise_std**2), sens)

    def _cohorts(self, user_ids: Sequence[str]) -> list[tuple[tuple[str, ...], GaussianCharge | None]]:
        """Each round's cohort (the public schedule, replayed as :meth:`run` admits it) and its
        participation's charge."""
        p = self.params
        scheduler = ParticipationScheduler(list(user_ids), p.rounds, p.min_separation, p.participations, self.seed)
        out = []
        for t in range(p.rounds):
            users = scheduler.admit(t, scheduler.planned(t))
            out.append((tuple(user_ids[u] for u in users), self.charge(scheduler.count[users[0]]) if users else None))
        return out

    def needs(self, user_ids: Sequence[str]) -> tuple[Need, ...]:
        """Each round's cohort (the public schedule, replayed): its participation's charge."""
        return tuple(Need(ids, charge) for ids, charge in self._cohorts(user_ids) if ids)

    def plan_schedule(self) -> list[PlannedRelease]:
        """The plan (fedkl.runner._ScheduleCut): round t's release charges its cohort its participation's
        charge, all public (the schedule replayed, no training: 20,000 rounds, 12 users, plan in 11.6 s, not 387 s)."""
        return [
            PlannedRelease(f"{self.name}/round-{t}", charge, ids)
            for t, (ids, charge) in enumerate(self._cohorts(self.ctx.user_ids))
        ]

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> DPFTRLResult:
        cfg, local_lr = self.params, self.local_lr
        n = federation.num_users
        ids = federation.ids_of(list(range(n)))
        scheduler = ParticipationScheduler(ids, cfg.rounds, cfg.min_separation, cfg.participations, self.seed)
        factor = self.factor
        noise = factor.noise()
        denominator = n / cfg.min_separation
        w = w0.clone()
        prefix = torch.zeros_like(w)
        log = RoundLog(cfg.rounds, progress)
        for t in range(cfg.rounds):
            start = time.perf_counter()
            users = scheduler.admit(t, scheduler.planned(t))
            index = {scheduler.count[u] for u in users}
            if len(index) != 1:  # every cohort's users are at the same participation (the scheduler's plan)
                raise RuntimeError(f"round {t}: the cohort is not at one participation index ({sorted(index)})")
            j = index.pop()
            answers = federation.compute(cfg.query(w, cfg.clip, local_lr), users)
            rows, _ = clip_rows(answers.values.to(w.dtype), cfg.clip)  # server-side re-clip
            prefix = prefix + rows.sum(0)
            if not torch.isfinite(prefix).all():
                raise ValueError(f"{self.name}/round-{t}: refusing to release a non-finite value (nothing was charged)")
            exact = prefix.clone()
            released = releaser.release(
                self.charge(j),
                lambda: exact + noise.step(releaser.noise.gaussian(tuple(exact.shape), self.noise_std)).to(exact.dtype),
                user_ids=federation.ids_of(users),
                label=f"{self.name}/round-{t}",
                details={"round": t, "participation": j, "factorization": cfg.factorization},
            )
            w = w0 + cfg.server_lr * released / denominator
            norm = float(released.norm()) / denominator
            log.round(t + 1, start, len(answers.failed), noisy_prefix_norm=norm, asked=len(users))
        return DPFTRLResult(
            w=w,
            rho_spent=self.rho,
            rounds=cfg.rounds,
            sigma=self.noise_std,
            history=log.history,
            details={
                "factorization": cfg.factorization,
                "band": factor.band if cfg.factorization == "banded" else None,
                "blt_buffers": cfg.blt_buffers if cfg.factorization.startswith("blt") else None,
                "blt_parameters": (
                    {"omega": factor.omegas.tolist(), "theta": factor.decays.tolist()}
                    if isinstance(factor, BufferedToeplitz)
                    else None
                ),
                "min_separation": cfg.min_separation,
                "max_participations": cfg.participations,
                "sensitivity": self.sensitivity,
                "sensitivity_by_participations": [self.answer_bound * math.sqrt(s) for s in self.sensitivity_squares],
                "noise_std": self.noise_std,
                "mu_gdp": self.sensitivity / self.noise_std,
                "fixed_denominator": denominator,
                "neighbouring": self.neighbouring,
                **cfg.local_details(),
                "local_lr": local_lr,
                "server_lr": cfg.server_lr,
            },
        )
