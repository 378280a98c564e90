"""Noisy GD with a user-level winsorized mean of the gradients (Levy et al. 2021): users with m records
each pay a projection radius ~ C/sqrt(m) instead of the clip C (zCDP, user level).

Round t, all n users, per-user mean gradients ``g_u = grad f_u(w_t)`` (one ``GradientsAtPoints``
request; the server computes everything below from the answers):

    centre c_t (public: a function of earlier releases)
    S_t  = sum_u clip_tau_t(g_u - c_t),   g~_t = c_t + (S_t + N(0, s_t^2 I)) / n   (the winsorized mean)
    w_t+1 = w_t - lr * g~_t

``clip_r(v) = v min(1, r/||v||)``, so ``c_t + clip_tau(g_u - c_t)`` is the projection of ``g_u`` onto
the ball B(c_t, tau) (Levy, Sun, Amin, Kale, Kulesza, Mohri, Suresh 2021, "Learning with user-level
privacy", Alg 2/3: a private centre, every user's mean projected onto a ball around it, Gaussian
noise). Three centres (``--conc-centre``; ``histogram`` below):

* ``previous`` (default): c_0 = 0 with tau_0 = C (round 0 IS noisy-gd's round), then c_t = g~_(t-1),
  the previous round's released estimate, and a public schedule tau_t (below). One release per round.
* ``fresh``: c_t = (sum_u clip_C(g_u) + N(0, s1^2 I)) / n, noisy-gd's release at a share
  ``--conc-centre-share`` of the round's budget, then the winsorized mean at the rest, with a constant
  tau. Two releases per round (Levy et al.'s shape; they find the centre with a histogram).

Privacy (user level, rho-zCDP with rho the sum of the round charges; each round gets rho_t = rho/T):

* The winsorized release, given c_t. c_t is a function of earlier releases only (the previous
  estimate, or this round's centre release): post-processing, so for the analysis of S_t it is a
  fixed public vector. Every term ``clip_tau(g_u - c_t)`` has norm <= tau whatever g_u is, so replacing
  one user's records moves S_t by at most ``Delta = 2 tau`` (add-remove: tau; the estimate divides by
  the public enrolled n, never by a count); ``s_t = Delta / sqrt(2 rho_w)``: rho_w-zCDP, rho_w = rho_t
  (previous) or (1 - share) rho_t (fresh).
* fresh only, the centre release: noisy-gd's round at share * rho_t: every term clip_C(g_u) has norm
  <= C, ``Delta1 = 2C`` (add-remove C).
* Adaptive composition of zCDP over the releases: rho in total. Every release is charged to the
  ledger before it is made (``GaussianCharge``, labels ``noisy-gd-conc/round-t/winsorized`` and, fresh,
  ``.../centre``).
* Every tau_t is a public function of public values only (C, the declared m, beta, n, d, rho, T):
  never of the records, nor of any client's report, nor of earlier releases; so the charges are fixed
  before any data is read (``fedkl plan --charges`` lists them).
* Absent and failed users (a dropout, an invalid or non-finite answer: every backend hands over a zero
  row and lists the user in ``answers.failed``) are left out of every release: the zero displacement in
  S_t (the user sits at the centre; its zero row is NOT projected as ``clip_tau(0 - c_t)``, a term of
  norm up to tau that would make present vs absent move S_t by up to 2 tau), nothing in the fresh
  centre's sum, no count in the histogram. So under add-remove (zero-out) a user's two worlds differ
  by one term of norm <= tau (C, sqrt(D) cells) and the add-remove sensitivities hold; under replace-one
  "present vs failed" is one replacement, within 2 tau (2C, sqrt(2 D)). Whether a user fails is its own
  doing (its data, its node): a function of that user only, as the analysis needs.
* Any client behaviour: the clipping and the projection are done on the SERVER from the per-user
  answers, so a client that lies about its gradient can only choose its own point inside the ball;
  the sensitivities above hold for arbitrary answers (tests: adversarial replace-one neighbours
  attain 2 tau exactly and never exceed it).
* What clients see: the current model w_t, computed from earlier releases (private, as noisy-gd).
  The server sees every user's unclipped mean gradient (central DP, trusted server; no secure
  aggregation of the per-user answers is possible here).

Utility (why tau ~ 1/sqrt(m)). If every record gradient has norm <= G (take G = C: a G-Lipschitz
loss with the clip set at G, so clip_C changes nothing) and user u's m records are i.i.d. with mean
mu, then E||g_u - mu|| <= G/sqrt(m) and, by McDiarmid (one record moves ||g_u - mu|| by <= 2G/m),
``||g_u - mu|| <= r = G (1 + sqrt(2 ln(n/beta))) / sqrt(m)`` for all n users with probability >= 1 - beta
at a fixed w; so ``||g_u - mean_v g_v|| <= 2r``. A Gaussian's norm satisfies
``||N(0, s^2 I_d)|| <= s (sqrt(d) + sqrt(2 ln(1/beta)))`` with probability >= 1 - beta. Then no user is
projected (the estimate is unbiased) when tau >= 2r + (the centre's error):

* fresh: the centre's error is its noise, ``e = s1 (sqrt(d) + sqrt(2 ln(1/beta))) / n``:
  ``tau = k C / sqrt(m) + e``;
* previous: the centre g~_(t-1) errs by the previous round's noise, ``a tau_(t-1)`` with
  ``a = (Delta/tau) (sqrt(d) + sqrt(2 ln(1/beta))) / (n sqrt(2 rho_t))``, plus the drift of the gradients
  between w_(t-1) and w_t (ignored: small for a small step; where it is not, users are projected):
  ``tau_0 = C``, ``tau_t = k C / sqrt(m) + a tau_(t-1)`` (-> k C/sqrt(m) / (1 - a) when a < 1);

``k = 2 (1 + sqrt(2 ln(n/beta)))`` (``--conc-scale`` overrides it). The winsorized noise is then
``s_t sqrt(d)/n ~ tau sqrt(d)/(n sqrt(rho_w))``, a factor ~ tau/C below noisy-gd's. The bounds are at a
fixed w; the iterates depend on the data, so along the run it is a heuristic (the default k is the
fixed-w theorem's constant; a smaller k is a tuning choice: tau never enters the privacy proof beyond
being public). ``previous`` spends the whole round on one release and its centre error shrinks with
tau, so it beats ``fresh`` wherever the gradients drift slowly (simulations/results/concentrated_gd.md).

When concentration fails (non-IID users, fewer than m records, heavy-tailed gradients, a fast-moving
gradient), users outside B(c_t, tau) are projected onto it: their pull is shortened, which BIASES the
gradient estimate towards the centre; it never costs privacy (the sensitivity is 2 tau for any data).
m is declared, public (``--conc-records``): a user with fewer records is not refused, it is just less
concentrated.

``histogram`` (Levy et al.'s coarse centre, :mod:`fedkl.algorithms.gradient.histogram_centre`): every round a
private per-coordinate histogram of the users' gradients in a publicly, randomly rotated basis (the
released table is charged as a Gaussian of L2 sensitivity sqrt(2 D), add-remove sqrt(D), D = d padded
to a power of two: every present user adds one count per coordinate, a failed one none) at
``--conc-centre-share`` of the round, the fullest bin's midpoint per coordinate as the centre
(post-processing), then the winsorized mean
at the rest with the constant public ``tau = r + sqrt(D) w = r (1 + 2 L)``, r = k C/sqrt(m), bin width
``w = 2 r L/sqrt(D)``, ``L = sqrt(2 ln(2 n D/beta))`` (the centre's error bound does not grow like
sqrt(d)/n as the noisy mean's does, but carries the factor 1 + 2L ~ 10: it pays off where d is large
against n). Labels ``.../histogram`` and ``.../winsorized``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fedkl.algorithms.contract import (
    Algorithm,
    AlgorithmParams,
    BuildContext,
    Clip,
    ModelResult,
    Rounds,
    SmallAudit,
    StepSize,
    param,
)
from fedkl.algorithms.gradient.histogram_centre import (
    ROTATION_SEED,
    bin_width,
    centre_from_counts,
    histogram_counts,
    histogram_sensitivity,
    padded_dim,
    rotation_signs,
)
from fedkl.algorithms.registry import register
from fedkl.algorithms.round_log import RoundLog
from fedkl.federation.base import Federation, GradientsAtPoints
from fedkl.federation.clipping import clip_rows
from fedkl.privacy.guarantee import Absence, Guarantee, sum_sensitivity
from fedkl.privacy.release import Releaser

NAME = "noisy-gd-conc"
CENTRES = ("fresh", "histogram", "previous")


def winsorized_sum(
    grads: torch.Tensor, centre: torch.Tensor, tau: float, present: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_u clip_tau(g_u - centre), mask of the rows left out)``: the users' displacements from the
    centre, each projected onto the ball of radius tau. A user not ``present`` (a boolean mask over the
    rows, False for a failed answer, whose row a backend hands over as zeros; None: all present) and a
    non-finite row contribute the zero displacement (they sit at the centre), never ``clip_tau(0 - centre)``.
    Each term has norm <= tau whatever the row is, and is 0 for a user left out."""
    displacements, bad = clip_rows(grads - centre.unsqueeze(0), tau)
    if present is not None and not bool(present.all()):
        bad = bad | ~present
        displacements = torch.where(bad.unsqueeze(1), torch.zeros_like(displacements), displacements)
    return displacements.sum(0), bad


def records_warning(name: str, records: int, radius: float, clip: float) -> list[str]:
    """``--conc-records`` left at 1 claims no concentration: the radius k C/sqrt(1) (+ ...) is above the clip,
    so the method is a noisier noisy-gd (``fedkl run`` logs this before any budget is spent)."""
    if records > 1:
        return []
    return [
        f"{name} with --conc-records 1 (the default) claims no concentration: its radius {radius:.3g} is above "
        f"the clip {clip:g}, so it is a noisier noisy-gd; declare the public number of records every user holds "
        "(--conc-records m)"
    ]


def check_built_for(alg, federation: Federation) -> None:
    """Refuse, before any data is read, a federation of another size than ``alg`` was built for."""
    if federation.num_users != alg.num_users or federation.num_params != alg.dim:
        raise ValueError(
            f"{alg.name} was built for n={alg.num_users}, d={alg.dim}; the federation has "
            f"n={federation.num_users}, d={federation.num_params} (nothing was read or charged)"
        )


@dataclass(frozen=True)
class Concentration(AlgorithmParams):
    """The public concentration claim shared by noisy-gd-conc and noisy-gd-outlier."""

    conc_records: int = param(
        1,
        "noisy-gd-conc, noisy-gd-outlier: the public number m of records every user holds (declared, never read from "
        "the data; a user with fewer is less concentrated: bias, not privacy loss); the radius is ~ C/sqrt(m)",
        "heuristic",
        positive=True,
    )
    conc_scale: float | None = param(
        None,
        "noisy-gd-conc, noisy-gd-outlier: k in the radius k C/sqrt(m) (default: the concentration theorem's "
        "2 (1 + sqrt(2 ln(n/beta))) at a fixed model)",
        "theorem",
    )
    conc_beta: float = param(
        0.05,
        "noisy-gd-conc, noisy-gd-outlier: failure probability beta of the concentration (and noise) bounds",
        "theorem",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conc_scale is not None and not (self.conc_scale > 0 and math.isfinite(self.conc_scale)):
            raise ValueError(f"--conc-scale must be finite and > 0, got {self.conc_scale}")
        if not 0 < self.conc_beta < 1:
            raise ValueError(f"--conc-beta must be in (0, 1), got {self.conc_beta}")


def concentration_scale(scale: float | None, num_users: int, beta: float) -> float:
    """k: ``--conc-scale``, else the fixed-model theorem's 2 (1 + sqrt(2 ln(n/beta))) (module docstring)."""
    if scale is not None:
        return scale
    return 2.0 * (1.0 + math.sqrt(2.0 * math.log(num_users / beta)))


def population(ctx: BuildContext) -> tuple[int, int]:
    """``(n, d)`` of the run (public: the enrolled users and the model's size), refusing an empty one."""
    if ctx.problem is None:
        raise ValueError("the build context names no problem (its number of parameters d): give problem=")
    n, d = ctx.num_users, ctx.problem.num_params
    if n < 1 or d < 1:
        raise ValueError(f"need at least one user and one parameter, got n={n}, d={d}")
    return n, d


@dataclass(frozen=True)
class ConcentratedGDParams(Rounds, StepSize, Clip, Concentration):
    """noisy-gd-conc: every user every round; one Gaussian release per round (two with fresh centres)."""

    conc_centre_share: float = param(
        0.5,
        "noisy-gd-conc: share of each round's zCDP budget spent on the private centre (fresh and histogram)",
        "heuristic",
    )
    conc_centre: str = param(
        "previous",
        "noisy-gd-conc: the ball's centre: fresh (a private noisy mean each round, two releases per round), "
        "histogram (Levy et al.'s private per-coordinate histogram in a random rotation, two releases per round) "
        "or previous (the previous round's released estimate, free; round 0 is noisy-gd's; one release per round)",
        "heuristic",
        choices=CENTRES,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.conc_centre_share < 1:
            raise ValueError(f"--conc-centre-share must be in (0, 1), got {self.conc_centre_share}")


# module docstring: a missing or non-finite answer contributes the zero displacement (the centre itself);
# the centre's noisy-gd sum takes it as a zero row (the histogram centre counts each row's rotated coordinates)
CONC_ABSENCE = (
    Absence(
        "zero",
        "the fresh centre's noisy sum: a failed user's clipped gradient is the zero row",
        releases="*/centre",
    ),
    Absence(
        "replaced",
        "the winsorized sum (and the histogram centre's counts): a failed, dropped or non-finite user is "
        "replaced by the centre itself (zero displacement), i.e. left out of the sum; n is public",
    ),
)


ConcentratedGDResult = ModelResult  # sigma: a list


@register
class ConcentratedGD(Algorithm[ConcentratedGDParams]):
    """Noisy GD over users with a winsorized mean: gradients projected onto a ball of radius ~C/sqrt(m) around a private centre (zCDP).

    See the module docstring. The run's zCDP budget (``ctx.rho_left``) is split evenly over the rounds,
    each round's share between the centre (``--conc-centre-share``) and the winsorized mean."""

    name = NAME
    Params = ConcentratedGDParams
    guarantee = Guarantee("zcdp")
    absence = CONC_ABSENCE
    step_size = 4.0
    small = {"conc_records": 20}
    audit = SmallAudit()

    def __init__(self, params: ConcentratedGDParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        if not (ctx.rho_left > 0 and math.isfinite(ctx.rho_left)):
            raise ValueError(f"the zCDP budget must be finite and > 0, got rho={ctx.rho_left}")
        self.neighbouring = ctx.neighbouring
        sum_sensitivity(1.0, self.neighbouring)  # refuses an unknown relation
        self.rho_total = float(ctx.rho_left)
        self.num_users, self.dim = population(ctx)

    def warnings(self) -> list[str]:
        """Public settings that make this run a worse noisy-gd, said by ``fedkl run`` before any budget is spent."""
        tau = self.tau_histogram if self.params.conc_centre == "histogram" else self.tau
        return records_warning(self.name, self.params.conc_records, tau, self.params.clip)

    @property
    def rho_centre(self) -> float:
        return self.params.conc_centre_share * self.rho_total / self.params.rounds

    @property
    def rho_winsorized(self) -> float:
        return (1.0 - self.params.conc_centre_share) * self.rho_total / self.params.rounds

    @property
    def sensitivity_centre(self) -> float:
        return sum_sensitivity(self.params.clip, self.neighbouring)

    @property
    def sigma_centre(self) -> float:
        return self.sensitivity_centre / math.sqrt(2.0 * self.rho_centre)

    @property
    def sigma_histogram(self) -> float:
        return self.sensitivity_histogram / math.sqrt(2.0 * self.rho_centre)

    @property
    def scale(self) -> float:
        """k in tau = k C / sqrt(m) + e: ``--conc-scale``, else the fixed-w theorem's 2 (1 + sqrt(2 ln(n/beta)))."""
        return concentration_scale(self.params.conc_scale, self.num_users, self.params.conc_beta)

    @property
    def centre_error(self) -> float:
        """e: a bound on the centre's noise norm / n, holding with probability >= 1 - beta."""
        return (
            self.sigma_centre
            * (math.sqrt(self.dim) + math.sqrt(2.0 * math.log(1.0 / self.params.conc_beta)))
            / self.num_users
        )

    @property
    def tau(self) -> float:
        """The projection radius: public (C, m, beta, n, d, rho only)."""
        p = self.params
        return self.scale * p.clip / math.sqrt(p.conc_records) + self.centre_error

    @property
    def concentration_radius(self) -> float:
        """r = k C / sqrt(m): the users' spread around their mean (module docstring)."""
        return self.scale * self.params.clip / math.sqrt(self.params.conc_records)

    @property
    def bin_width(self) -> float:
        """``--conc-centre histogram``: the public bin width w = 2 r L / sqrt(D) (histogram_centre)."""
        return bin_width(self.concentration_radius, self.num_users, self.dim, self.params.conc_beta)

    @property
    def tau_histogram(self) -> float:
        """``--conc-centre histogram``: tau = r + sqrt(D) w, the spread plus the centre's error bound."""
        return self.concentration_radius + math.sqrt(padded_dim(self.dim)) * self.bin_width

    @property
    def sensitivity_histogram(self) -> float:
        return histogram_sensitivity(self.dim, self.neighbouring)

    @property
    def sensitivity_winsorized(self) -> float:
        tau = self.tau_histogram if self.params.conc_centre == "histogram" else self.tau
        return sum_sensitivity(tau, self.neighbouring)

    @property
    def sigma_winsorized(self) -> float:
        return self.sensitivity_winsorized / math.sqrt(2.0 * self.rho_winsorized)

    @property
    def rho_round(self) -> float:
        return self.rho_total / self.params.rounds

    @property
    def radii(self) -> list[float]:
        """``--conc-centre previous``: the public radius of every round, tau_0 = C (centre 0: noisy-gd's
        round) and tau_t = k C/sqrt(m) + a tau_(t-1), a tau_(t-1) the bound on the previous estimate's
        noise norm / n (module docstring)."""
        p = self.params
        factor = sum_sensitivity(1.0, self.neighbouring)
        tail = math.sqrt(self.dim) + math.sqrt(2.0 * math.log(1.0 / p.conc_beta))
        a = factor * tail / (self.num_users * math.sqrt(2.0 * self.rho_round))
        radii = [p.clip]
        while len(radii) < p.rounds:
            radii.append(self.scale * p.clip / math.sqrt(p.conc_records) + a * radii[-1])
        return radii

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> ConcentratedGDResult:
        cfg, neighbouring = self.params, self.neighbouring
        n = federation.num_users
        check_built_for(self, federation)
        users = list(range(n))
        user_ids = federation.ids_of(users)
        fresh = cfg.conc_centre == "fresh"
        histogram = cfg.conc_centre == "histogram"
        if histogram:
            radii = [self.tau_histogram] * cfg.rounds
        else:
            radii = [self.tau] * cfg.rounds if fresh else self.radii
        fresh = fresh or histogram  # a private centre every round, at the centre share
        rho_winsorized = self.rho_winsorized if fresh else self.rho_round
        w = w0.clone()
        previous = torch.zeros_like(w)  # --conc-centre previous: round 0's centre (tau_0 = C: noisy-gd's round)
        log = RoundLog(cfg.rounds, progress)
        sigmas: list[float] = []
        spent = 0.0
        for t, tau in enumerate(radii):
            start = time.perf_counter()
            answers = federation.compute(GradientsAtPoints(w.unsqueeze(0)), users)
            grads = answers.values[:, 0, :].to(w.dtype)
            present = answers.answered()  # a failed user's zero row is not data: it is left out of every release
            common = {"round": t, "neighbouring": neighbouring, "failed": len(answers.failed)}
            if histogram:
                signs = rotation_signs(self.dim, ROTATION_SEED + t)  # public randomness
                noisy_counts = releaser.gaussian(
                    histogram_counts(grads, signs, cfg.clip, self.bin_width, present),
                    sensitivity=self.sensitivity_histogram,
                    rho=self.rho_centre,
                    user_ids=user_ids,
                    label=f"{self.name}/round-{t}/histogram",
                    details={**common, "bin_width": self.bin_width},
                )
                spent += self.rho_centre
                # a function of the released counts only
                centre = centre_from_counts(noisy_counts, signs, cfg.clip, self.bin_width, self.dim).to(w.dtype)
            elif fresh:
                noisy_centre_sum = releaser.gaussian(
                    clip_rows(grads, cfg.clip)[0][present].sum(0),  # a failed user's row left out
                    sensitivity=self.sensitivity_centre,
                    rho=self.rho_centre,
                    user_ids=user_ids,
                    label=f"{self.name}/round-{t}/centre",
                    details={**common, "clip": cfg.clip},
                )
                spent += self.rho_centre
                centre = noisy_centre_sum.to(w.dtype) / n  # a function of stage 1's release only
            else:
                centre = previous  # a function of earlier releases only
            sensitivity = sum_sensitivity(tau, neighbouring)
            displacement, _ = winsorized_sum(grads, centre, tau, present)
            noisy_displacement = releaser.gaussian(
                displacement,
                sensitivity=sensitivity,
                rho=rho_winsorized,
                user_ids=user_ids,
                label=f"{self.name}/round-{t}/winsorized",
                details={**common, "tau": tau},
            )
            spent += rho_winsorized
            sigmas.append(sensitivity / math.sqrt(2.0 * rho_winsorized))
            grad = centre + noisy_displacement.to(w.dtype) / n
            previous = grad
            w = w - cfg.lr * grad
            log.round(t + 1, start, len(answers.failed), noisy_grad_norm=float(grad.norm()), rho_spent=spent)
        details = {"tau": radii[-1], "scale": self.scale, "records": cfg.conc_records, "centre": cfg.conc_centre}
        if histogram:
            details["bin_width"] = self.bin_width
            details["centre_error_bound"] = self.tau_histogram - self.concentration_radius
        elif fresh:
            details["centre_error_bound"] = self.centre_error
        return ConcentratedGDResult(
            w=w,
            rho_spent=spent,
            rounds=cfg.rounds,
            sigma=[self.sigma_histogram if histogram else self.sigma_centre, sigmas[0]] if fresh else sigmas,
            details=details,
            history=log.history,
        )


__all__ = [
    "CONC_ABSENCE",
    "ConcentratedGD",
    "ConcentratedGDParams",
    "ConcentratedGDResult",
    "Concentration",
    "check_built_for",
    "concentration_scale",
    "population",
    "records_warning",
    "winsorized_sum",
]
