"""External sweep runner ``audit`` for simulations/studies/audit.toml: the empirical user-level privacy
audits of ``fedkl audit`` (fedkl.audit's functions) for one registered algorithm (``audited``) at one
claimed eps (the point's ``epsilon``); no training of its own beyond the audits' runs.

* many-run: ``runs`` trainings on each dataset of the outlier pair (the algorithm's small audit in
  fedkl/audit/settings.py: 41 users, 101-261 for paper 002; delta = 1/n^1.1), skipped for an algorithm
  whose one run takes longer than ``max_seconds`` (``many_verdict = "skipped"``, ``many_seconds`` its
  time per run); ``many_gdp_*``: the same runs' Gaussian-DP reading (``gaussian_dp`` of the report: the
  mu lower bound, and the eps bound valid for a mechanism whose trade-off curve is Gaussian);
* one-run: one training with ``canaries`` canary users (+40 ordinary ones) at delta = 1e-5 (the one-run
  bound pays 2 m delta, so it needs delta well below 1/m), ``canaries`` / 10 guesses;
* one-shot: Andrew et al.'s estimate (no confidence level) from ``canaries`` / 2 random-direction canaries.

Each bound is one-sided at 95% confidence; ``*_most`` is the largest bound that audit could show
(error-free guesses): a claim above it cannot be refuted by that audit. A refusal (the algorithm's own
check of the small setting) is recorded with its reason (``*_verdict = "refused"``, ``*_reason``), never
replaced by another setting; an algorithm's crash is ``"failed"``. ``one_bottom`` / ``shot_bottom``: the
algorithm released ⊥ (no model), so the audit abstains; ``many_bottom_d0/d1``: ⊥ runs per dataset. The
audits' per-run statistics live under runs/audit_table/ (the script's cache) and are reused by a rerun.
"""

from __future__ import annotations

import math
import os
import time

from fedkl.audit import many_run_audit, one_run_audit, one_shot_estimate
from fedkl.audit.release import audit_config, audit_federation, released_model
from fedkl.audit.settings import small_audit, small_settings
from fedkl.audit.worlds import neighbour_pair
from fedkl.experiments import register_runner, runner_result

NAME = "audit"
WORK = os.path.join("runs", "audit_table")
COLUMNS = (
    "runs",
    "canaries",
    "many_verdict",
    "many_bound",
    "many_most",
    "many_seconds",
    "many_reason",
    "many_bottom_d0",
    "many_bottom_d1",
    "many_users",
    "many_gdp_mu",
    "many_gdp_bound",
    "many_gdp_most",
    "one_verdict",
    "one_bound",
    "one_most",
    "one_reason",
    "one_bottom",
    "shot_verdict",
    "shot_estimate",
    "shot_reason",
    "shot_bottom",
)


def seconds_per_run(algorithm: str, eps: float) -> float | tuple[str, str]:
    """One run's time on the many-run pair, or (verdict, reason) when the algorithm refuses or fails."""
    cfg = audit_config(algorithm, eps, small_settings(algorithm))
    small = small_audit(algorithm)
    _, d1 = neighbour_pair(base=small.users, records=small.records)
    try:
        shared = audit_federation(cfg, d1)  # as the audit's runs share it
        released_model(cfg, d1, 0, shared)  # the first run pays one-off set-up (a calibration, the solves)
        start = time.time()
        released_model(cfg, d1, 1, shared)
    except ValueError as e:
        return "refused", str(e)
    except Exception as e:  # an algorithm's crash: reported in the table
        return "failed", f"{type(e).__name__}: {e}"
    return time.time() - start


def _audit(prefix: str, report: dict) -> dict:
    """A report's verdict, bound, "most" and reason as ``prefix_*`` columns."""
    return {
        f"{prefix}_verdict": report["verdict"],
        f"{prefix}_bound": report.get("epsilon_lower_bound"),
        f"{prefix}_most": report.get("largest_attainable_bound"),
        f"{prefix}_reason": report.get("reason", ""),
    }


def run(settings, log) -> dict:
    name, eps = settings.audited, float(settings.epsilon)
    quiet = lambda s: None  # noqa: E731
    work = os.path.join(WORK, name, f"eps{eps:g}")
    extra: dict = {c: None for c in COLUMNS} | {"runs": settings.runs, "canaries": settings.canaries}
    speed = seconds_per_run(name, eps)
    if isinstance(speed, tuple):
        extra["many_verdict"], extra["many_reason"] = speed
    elif speed > settings.max_seconds:
        extra["many_verdict"], extra["many_seconds"] = "skipped", speed
    else:
        many = many_run_audit(name, eps, os.path.join(work, "many"), runs=settings.runs, log=quiet)
        extra.update(_audit("many", many), many_seconds=speed)
        extra["many_bottom_d0"], extra["many_bottom_d1"] = many.get("bottom_outputs", [None, None])
        extra["many_users"] = many["setting"]["users"]
        gdp = many.get("gaussian_dp") or {}
        extra.update(
            many_gdp_mu=gdp.get("mu_lower_bound"),
            many_gdp_bound=gdp.get("epsilon_lower_bound"),
            many_gdp_most=gdp.get("largest_attainable_bound"),
        )
    one = one_run_audit(
        name,
        eps,
        os.path.join(work, "one"),
        canaries=settings.canaries,
        guesses=settings.canaries // 10,
        settings={"delta": 1e-5},
        log=quiet,
    )
    extra.update(_audit("one", one), one_bottom=bool(one.get("bottom_output", False)))
    shot = one_shot_estimate(
        name, eps, os.path.join(work, "shot"), canaries=settings.canaries // 2, settings={"delta": 1e-5}, log=quiet
    )
    estimate = shot.get("epsilon_estimate")
    extra.update(
        shot_verdict=shot["verdict"],
        shot_estimate=None if estimate is None or math.isnan(estimate) else estimate,
        shot_reason=shot.get("reason", ""),
        shot_bottom=estimate is not None and math.isnan(estimate),
    )
    log(f"{name} eps={eps:g}: many {extra['many_verdict']}, one {one['verdict']}, one-shot {shot['verdict']}")
    return runner_result(NAME, settings.dataset, None, eps, None, settings.seed, None, extra)


register_runner(
    NAME,
    run,
    columns=COLUMNS,
    description=__doc__.splitlines()[0],
    settings={"audited": "noisy-gd", "runs": 100, "canaries": 200, "max_seconds": 0.5},
)
