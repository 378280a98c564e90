"""Adaptive noisy gradient descent over users (paper 000, Algorithm 3), with a fully adaptive zCDP filter.

It needs no KL constants: it adapts to (gamma, kappa) by itself. Round t, all n users taking part:

    S_t   = sum_u clip_C(grad f_u(w_t))                                    (federation)
    N_t   = (||S_t|| + N(0, s_norm^2)) / n        s_norm = Delta / sqrt(2 rho_norm)    (release 1)
    sigma_t = max(N_t / sqrt(d A), sigma_floor)   (noise std on the MEAN; A = log(n sqrt(rho)/beta))
    rho_t = Delta^2 / (2 n^2 sigma_t^2)  (<= rho_cap)                       (the cost of release 2)
    w_t+1 = w_t - lr * (S_t + N(0, (n sigma_t)^2 I)) / n                   (release 2)

and it runs while the run's filter admits a worst-case round, ``rho_norm + rho_cap`` (plus the
selection's reserve): the stopping rule is the budget, not a convergence test. Large noisy gradient
norms make a round cheap, small ones expensive; the floor ``sigma_floor = Delta / (n sqrt(2 rho_cap))``
caps a round's gradient cost at ``rho_cap``. As in the paper, ``rho_norm + rho_cap = rho/2``
(``rho`` = the loop's budget) with ``rho_norm = sqrt(rho)/n`` by default: every round but the last
is admitted while at most rho/2 is spent, so the last one (at most rho/2) still fits. The output is
the LAST iterate, or (``kl_select="exponential"``, Theorem 5) an iterate chosen by the exponential
mechanism.

Guarantee: user-level rho-zCDP, rho = the run's budget (``min(rho_total, filter.remaining)``).
* Each round is two Gaussian releases on sums of terms of norm <= C: the norm ``||S_t||`` (L2
  sensitivity <= ||S_t - S'_t|| <= Delta by the triangle inequality) and ``S_t`` itself (Delta).
  ``Delta = 2C`` (replace-one: all records of one user replaced, n public) or ``C`` (add-remove:
  one user added or removed; the algorithm divides by the public n, never by a count).
* The cost of release 2 is chosen from release 1 (an earlier output), so the rounds compose by the
  FULLY ADAPTIVE zCDP filter (Whitehouse et al. 2023; :class:`fedkl.privacy.filter.ZCDPFilter`):
  each release is checked against the filter and charged to every user's ledger entry before the
  noise is drawn, at the rho computed from the sigma actually used (so a negative or tiny N_t can
  only make a round MORE private: sigma_t >= sigma_floor; docs/derivations/paper-000.md §6, pitfall 3).
* Selection (optional): utilities ``u_t = -||S_t / n||`` of the candidates w_0..w_T (earlier
  private outputs) have sensitivity ``Delta / n``; the exponential mechanism with ``eps`` is
  ``eps^2/8``-zCDP (bounded range) and is charged (``rho_sel``, reserved before the loop) through
  :meth:`Releaser.exponential`.

Private: every released norm and noisy sum, hence the iterates, the chosen index and the output.
A participating client sees the iterates it is sent (private outputs). The theory's L0 is the clip
C; clipping bias is ignored by the theory (as in the paper).

Rate (Theorem 4, kappa in [1, 2], L1-smooth, L0-Lipschitz, KL* on the valley of w0):
``O~((sqrt(d)/(n sqrt(rho)))^(2 kappa/(4 - kappa)) + (1/(n sqrt(rho)))^(kappa/2))``; PL (kappa = 2):
``O~(d/(n^2 rho) + 1/(n sqrt(rho)))``. Theorem 5 (exponential selection, no KL): ``||grad F(w_t*)||
= O~(sqrt(d)/(n sqrt(rho)) + 1/(sqrt(n) rho^(1/4)))`` in the best case.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fedkl.algorithms.contract import param
from fedkl.algorithms.kl.kl_common import KLAlgorithm, KLBase, KLResult, MaxRounds, check_positive
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import ClippedGradient, Federation
from fedkl.privacy.filter import BudgetExhausted
from fedkl.privacy.guarantee import Guarantee
from fedkl.privacy.release import Releaser

SELECTIONS = ("last", "exponential")


@dataclass(frozen=True)
class AdaptiveKLGDParams(KLBase, MaxRounds):
    """kl-adaptive-gd: ``lr`` (the theorem's is 1/(2 L1)), ``clip`` C (the theorem's L0), ``kl_beta``
    (the failure probability in ``A = log(n sqrt(rho) / beta)``, clamped to A >= 1), ``kl_norm_rho``,
    ``kl_select`` / ``kl_select_fraction`` (the default 1/9 gives the paper's ``eps = sqrt(rho_loop)``:
    ``eps^2/8 = rho/9`` when ``rho_loop = 8 rho/9``) and ``kl_max_rounds`` (None: until the filter would
    be exhausted; the capped last round spends everything the loop has left, at least ``rho_norm + rho_cap``)."""

    kl_select: str = param(
        "last",
        "kl-adaptive-gd output: last (Thm 4) or exponential (Thm 5, exponential-mechanism selection of an iterate)",
        "theorem",
        choices=SELECTIONS,
    )
    kl_select_fraction: float = param(
        1.0 / 9.0,
        "kl-adaptive-gd: budget share of the exponential selection (1/9: the paper's eps = sqrt(rho))",
        "theorem",
    )
    kl_norm_rho: float | None = param(
        None, "kl-adaptive-gd: zCDP cost of each gradient-norm release (default sqrt(rho)/n)", "theorem", positive=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.kl_select_fraction < 1:
            raise ValueError(f"--kl-select-fraction must be in (0, 1), got {self.kl_select_fraction}")


@dataclass(frozen=True)
class AdaptivePlan:
    """The data-independent constants of one run (all zCDP costs are per release)."""

    rho: float  # the run's budget
    rho_select: float  # reserved for the exponential selection (0 without it)
    rho_norm: float
    rho_cap: float  # the most a gradient release may cost
    A: float
    sigma_norm: float  # noise std on ||S_t|| (the sum)
    sigma_floor: float  # the smallest noise std on S_t (the sum)
    eps_select: float | None

    @property
    def rho_loop(self) -> float:
        return self.rho - self.rho_select

    @property
    def max_rounds_bound(self) -> int:
        """Every round but the last costs >= rho_norm, so there are at most this many."""
        return int(self.rho_loop / self.rho_norm) + 1


@register
class AdaptiveKLGD(KLAlgorithm[AdaptiveKLGDParams]):
    """Algorithm 3: adaptive noisy GD until the budget is spent (no KL constants needed).

    Paper 000, Algorithm 3 over users; see the module docstring. ``ctx.rho_left``: this run's zCDP budget."""

    name = "kl-adaptive-gd"
    Params = AdaptiveKLGDParams
    guarantee = Guarantee("zcdp", adaptive=True)  # the gradient's rho follows the released norm
    step_size = 0.01
    small = {"reg": 0.1, "kl_max_rounds": 3}

    @property
    def gaussian_releases_only(self) -> bool:
        """Every zCDP charge is a Gaussian release (the exact Gaussian conversion applies) unless the
        output iterate is chosen by the exponential mechanism."""
        return self.params.kl_select != "exponential"

    def plan(self, n: int, d: int, rho: float | None = None) -> AdaptivePlan:
        """The constants for n users, d parameters and budget rho (default ``rho_total``)."""
        cfg = self.params
        rho = self.rho_total if rho is None else float(rho)
        check_positive("rho", rho)
        if n < 1 or d < 1:
            raise ValueError(f"need n >= 1 users and d >= 1 parameters, got {n}, {d}")
        rho_select = cfg.kl_select_fraction * rho if cfg.kl_select == "exponential" else 0.0
        rho_loop = rho - rho_select
        rho_norm = cfg.kl_norm_rho if cfg.kl_norm_rho is not None else math.sqrt(rho_loop) / n
        rho_cap = rho_loop / 2.0 - rho_norm
        if not rho_cap > 0:
            raise ValueError(
                f"{self.name}: the budget is too small for one round: rho_norm = {rho_norm:.4g} must be below "
                f"half the loop's budget {rho_loop / 2:.4g} (with the default rho_norm = sqrt(rho)/n: "
                f"n sqrt(rho) = {n * math.sqrt(rho_loop):.3g} must exceed 2); nothing was released"
            )
        delta_s = self.sensitivity
        return AdaptivePlan(
            rho=rho,
            rho_select=rho_select,
            rho_norm=rho_norm,
            rho_cap=rho_cap,
            A=max(1.0, math.log(n * math.sqrt(rho_loop) / cfg.kl_beta)),
            sigma_norm=delta_s / math.sqrt(2.0 * rho_norm),
            sigma_floor=delta_s / math.sqrt(2.0 * rho_cap),
            eps_select=math.sqrt(8.0 * rho_select) if rho_select > 0 else None,
        )

    def gradient_rho(self, plan: AdaptivePlan, noisy_norm: float, n: int, d: int) -> float:
        """zCDP cost of the gradient release after the norm release gave ``N_t = noisy_norm`` (mean
        scale): ``Delta^2 / (2 (n sigma_t)^2)`` with ``sigma_t = max(N_t/sqrt(d A), floor/n)``; at most rho_cap."""
        sigma_sum = max(n * noisy_norm / math.sqrt(d * plan.A), plan.sigma_floor)  # a non-positive N_t -> floor
        return min(self.sensitivity**2 / (2.0 * sigma_sum**2), plan.rho_cap)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> KLResult:
        cfg, neighbouring = self.params, self.ctx.neighbouring
        flt = releaser.filter
        if flt is None:
            raise ValueError(
                f"{self.name} composes adaptively chosen costs: it needs a Releaser with a zCDP "
                "filter (nothing was released)"
            )
        n, d = federation.num_users, federation.num_params
        users = list(range(n))
        user_ids = federation.ids_of(users)
        available = min(self.rho_total, flt.remaining)
        if not available > 0:
            raise BudgetExhausted(f"{self.name}: the run's zCDP filter is exhausted; nothing was released")
        try:
            plan = self.plan(n, d, available)
        except ValueError as err:
            if available < self.rho_total:  # the filter, not the configuration, is too small
                raise BudgetExhausted(
                    f"{self.name}: the filter's remaining budget {available:.4g} cannot fund one round: {err}"
                ) from err
            raise
        spent_before = flt.spent
        budget_end = spent_before + plan.rho  # the run never takes the filter past this point
        delta_s = self.sensitivity
        w = w0.clone()
        selecting = cfg.kl_select == "exponential"
        iterates: list[torch.Tensor] = [w.clone()] if selecting else []
        exact_norms: list[float] = []  # ||S(w_t)||/n, kept on the server for the selection; never released
        log = RoundLog(plan.max_rounds_bound if cfg.kl_max_rounds is None else cfg.kl_max_rounds, progress)
        sigma_sum = None
        stopped = "budget"

        def fits(rho: float) -> bool:  # rho more (plus the selection's reserve) within this run's budget
            return flt.admits(rho + plan.rho_select) and flt.spent + rho + plan.rho_select <= budget_end * (1 + 1e-12)

        t = 0
        while fits(plan.rho_norm + plan.rho_cap):
            start = time.perf_counter()
            total = federation.sum(ClippedGradient(w, cfg.clip), users).total()
            if selecting:
                exact_norms.append(float(total.norm()) / n)
            last_by_cap = cfg.kl_max_rounds is not None and t == cfg.kl_max_rounds - 1
            if last_by_cap:  # spend what the loop has left on one precise final step (>= rho_norm + rho_cap)
                noisy_norm = None
                rho_grad = budget_end - plan.rho_select - flt.spent
                stopped = "max_rounds"
            else:
                released = releaser.gaussian(
                    total.norm().reshape(1),
                    sensitivity=delta_s,
                    rho=plan.rho_norm,
                    user_ids=user_ids,
                    label=f"{self.name}/round-{t}/norm",
                    details={"round": t, "clip": cfg.clip, "neighbouring": neighbouring, "query": "norm"},
                )
                noisy_norm = float(released[0]) / n
                rho_grad = self.gradient_rho(plan, noisy_norm, n, d)
            sigma_sum = delta_s / math.sqrt(2.0 * rho_grad)
            noisy = releaser.gaussian(
                total,
                sensitivity=delta_s,
                rho=rho_grad,
                user_ids=user_ids,
                label=f"{self.name}/round-{t}/grad",
                details={"round": t, "clip": cfg.clip, "neighbouring": neighbouring, "query": "gradient"},
            )
            w = w - cfg.lr * noisy.to(w.dtype) / n
            if selecting:
                iterates.append(w.clone())
            t += 1
            rho_round = rho_grad if noisy_norm is None else plan.rho_norm + rho_grad
            spent = flt.spent - spent_before
            log.round(t, start, noisy_grad_norm=noisy_norm, rho_round=rho_round, rho_spent=spent, sigma_sum=sigma_sum)
            if last_by_cap:
                break
        details = {
            "rho_norm": plan.rho_norm,
            "rho_cap": plan.rho_cap,
            "A": plan.A,
            "sigma_norm_sum": plan.sigma_norm,
            "sigma_floor_sum": plan.sigma_floor,
            "stopped": stopped,
            "select": cfg.kl_select,
            "neighbouring": neighbouring,
            "sensitivity": delta_s,
        }
        if selecting:
            w, index = self._select(federation, releaser, iterates, exact_norms, plan, users, user_ids)
            details.update(
                selected_iterate=index, candidates=len(iterates), eps_select=plan.eps_select, rho_select=plan.rho_select
            )
        details["rho_unspent"] = max(0.0, plan.rho - (flt.spent - spent_before))
        return KLResult(
            w=w, rounds=t, sigma=sigma_sum, rho_spent=flt.spent - spent_before, history=log.history, details=details
        )

    def _select(
        self,
        federation: Federation,
        releaser: Releaser,
        iterates: list[torch.Tensor],
        exact_norms: list[float],
        plan: AdaptivePlan,
        users: list[int],
        user_ids: list[str],
    ) -> tuple[torch.Tensor, int]:
        """Theorem 5: choose t with probability ∝ exp(-eps ||S(w_t)/n|| / (2 Delta/n)).

        The candidates are earlier private outputs; each utility is a norm of a mean of clipped
        terms, so it moves by at most Delta/n between neighbours (triangle inequality)."""
        cfg = self.params
        n = len(users)
        norms = list(exact_norms)
        for v in iterates[len(norms) :]:  # the last iterate's gradient was never queried
            norms.append(float(federation.sum(ClippedGradient(v, cfg.clip), users).total().norm()) / n)
        scores = [-x for x in norms]
        index = releaser.exponential(
            scores,
            eps=plan.eps_select,
            sensitivity=self.sensitivity / n,
            user_ids=user_ids,
            label=f"{self.name}/select",
            details={"neighbouring": self.ctx.neighbouring, "clip": cfg.clip},
        )
        return iterates[index].clone(), index
