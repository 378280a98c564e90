"""``fedkl audit``: an empirical lower bound on an algorithm's user-level epsilon, against its claim.

Two audits, both on whole users (the unit of privacy) and both running the algorithm exactly as
``fedkl run`` does (:mod:`fedkl.audit.release`):

* :func:`many_run_audit` — ``runs`` trainings on each world of the worst-case neighbouring pair under
  the run's relation (:func:`fedkl.audit.worlds.neighbour_worlds`: the outlier replaced by its mirror, or
  present vs absent under add-remove); the statistic is the released model's coordinate on
  the outlier's direction (⊥: NaN); the bound is :func:`fedkl.audit.bounds.two_sample_bound`, and
  the report adds its Gaussian-DP reading :func:`fedkl.audit.bounds.gdp_bound` (``gaussian_dp``: a
  bound on mu for any mechanism, on eps for those whose trade-off curve is Gaussian; never the verdict).
* ``white-box`` (:func:`fedkl.audit.whitebox.white_box_audit`) — no sampling: every release's realised
  sensitivity on adversarial neighbours against the one its noise was calibrated for, and every draw
  against the scale its charge implies (:mod:`fedkl.audit.whitebox`).
* :func:`one_run_audit` — ONE training with ``canaries`` canary users, each in or out (its mirror, or
  absent under add-remove) with probability 1/2; the score of canary i is the model's coordinate on its
  direction; the top ``k`` are guessed in and the bottom ``k`` out; the bound is
  :func:`fedkl.audit.bounds.one_run_epsilon`.

``settings`` override the algorithm's small audit setting (:func:`fedkl.audit.settings.small_settings`).

Verdict: "VIOLATION" when the lower bound exceeds the claimed epsilon (a correct algorithm gets it
with probability at most ``1 - confidence``), else "consistent with claim" (which proves nothing:
an audit's bound is only a lower bound). An algorithm that refuses the small setting is reported as
"refused" with its own reason, never audited on something else.

Output folder: ``statistics.jsonl`` (one line per run, appended as each finishes: a rerun with the
same settings skips the runs it holds), ``audit.json`` and ``histogram.png``.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable

import numpy as np

from fedkl.audit.bounds import (
    clopper_pearson_upper,
    epsilon_from_rates,
    gdp_bound,
    one_run_epsilon,
    one_run_guesses,
    two_sample_bound,
)
from fedkl.audit.release import audit_config, audit_federation, claimed_delta, released_model
from fedkl.audit.report import (
    FAILED,
    REFUSED,
    Statistics,
    audited_settings,
    histogram,
    noise_seed,
    refused,
    verdict,
    write_report,
)
from fedkl.audit.settings import small_audit, small_settings
from fedkl.audit.worlds import canary_world, neighbour_worlds

METHODS = ("many-run", "one-run", "one-shot", "white-box")  # white-box: fedkl.audit.whitebox.white_box_audit


def many_run_audit(
    algorithm: str,
    epsilon: float,
    out: str,
    *,
    runs: int = 100,
    settings: dict | None = None,
    confidence: float = 0.95,
    seed: int = 0,
    base: int | None = None,
    records: int | None = None,
    outlier_records: int | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """The many-run distinguishing audit (module docstring): ``runs`` trainings per dataset of
    :func:`~fedkl.audit.worlds.neighbour_pair` (``base`` ordinary users of ``records`` records, the
    outlier with ``outlier_records``; default: the algorithm's :func:`~fedkl.audit.settings.small_audit`)."""
    small = small_audit(algorithm)
    base = small.users if base is None else base
    records = small.records if records is None else records
    cfg = audit_config(algorithm, epsilon, small_settings(algorithm, settings))
    worlds = neighbour_worlds(cfg.neighbouring, base=base, records=records, seed=seed, outlier_records=outlier_records)
    d1 = worlds[1].dataset
    delta = claimed_delta(cfg, d1)
    report = {
        "method": "many-run",
        "algorithm": algorithm,
        "claimed": {"epsilon": epsilon, "delta": delta, "neighbouring": cfg.neighbouring},
        "setting": {
            "users": d1.train.num_users,
            "records_per_user": records,
            "outlier_records": outlier_records or records,
            "runs_per_dataset": runs,
            "seed": seed,
        },
        "settings": audited_settings(cfg),
        "confidence": confidence,
        "statistic": "released model's coordinate on the outlier's direction e_0 (⊥: NaN)",
        "neighbours": "D0/D1 differ in one whole user: the outlier with labels -1 / +1 on x = e_0"
        if cfg.neighbouring == "replace-one"
        else "D0/D1 differ in one whole user: the outlier (labels +1 on x = e_0) absent (enrolled, contributing "
        "nothing: n public) / present",
    }
    # the runs' number is not part of the header: a rerun with more runs extends the file, with fewer reads a prefix
    header = {k: report[k] for k in ("method", "algorithm", "claimed", "settings")}
    header["setting"] = {k: v for k, v in report["setting"].items() if k != "runs_per_dataset"}
    stats = Statistics(out, json.loads(json.dumps(header, default=str)))
    started, total = time.time(), 2 * runs
    todo = [(w, r) for r in range(runs) for w in (0, 1) if (w, r) not in stats.done]
    if todo and len(todo) < total:
        log(f"resuming: {total - len(todo)} of {total} runs already in {stats.path}")
    pair = [w.dataset for w in worlds]
    federations = [audit_federation(cfg, *w) for w in worlds]  # remember the deterministic solves (release.py)
    for i, (world, run) in enumerate(todo):
        try:
            w = released_model(cfg, pair[world], noise_seed(seed, world, run), federations[world])
        except ValueError as e:
            return refused(out, report, str(e), log)
        except Exception as e:  # an algorithm's crash is reported as such, never as a refusal or a pass
            return refused(out, report, f"{type(e).__name__}: {e}", log, verdict=FAILED)
        stats.add(world, run, math.nan if w is None else float(w[0]))
        if (i + 1) % max(1, len(todo) // 10) == 0 or i + 1 == len(todo):
            log(f"  {algorithm}: run {total - len(todo) + i + 1}/{total} ({time.time() - started:.0f} s)")
    s0 = np.array([stats.done[(0, r)] for r in range(runs)])
    s1 = np.array([stats.done[(1, r)] for r in range(runs)])
    bound = two_sample_bound(s0, s1, delta, confidence, seed=seed)
    report.update(bound)
    report["gaussian_dp"] = gdp_bound(
        s0, s1, delta, confidence, seed=seed
    )  # its own bound (bounds.py), not the verdict's
    ev = bound["evaluation"]
    report["largest_attainable_bound"] = epsilon_from_rates(  # what error-free held-out runs would show
        clopper_pearson_upper(0, ev["runs_d0"], (1 - confidence) / 2),
        clopper_pearson_upper(0, ev["runs_d1"], (1 - confidence) / 2),
        delta,
    )
    report["bottom_outputs"] = [int(np.isnan(s0).sum()), int(np.isnan(s1).sum())]
    report["verdict"] = verdict(bound["epsilon_lower_bound"], epsilon)
    histogram(
        os.path.join(out, "histogram.png"),
        {"D0 (outlier -1)" if cfg.neighbouring == "replace-one" else "D0 (outlier absent)": s0, "D1 (outlier +1)": s1},
        "model coordinate on the outlier direction",
        f"{algorithm}: claimed eps={epsilon:g}, audited lower bound {bound['epsilon_lower_bound']:.3g} "
        f"({confidence:.0%} conf.)",
    )
    write_report(out, report)
    return report


def one_run_audit(
    algorithm: str,
    epsilon: float,
    out: str,
    *,
    canaries: int = 200,
    guesses: int | None = None,
    settings: dict | None = None,
    confidence: float = 0.95,
    seed: int = 0,
    base: int = 40,
    records: int = 10,
    log: Callable[[str], None] = print,
) -> dict:
    """The one-run audit (module docstring): ``guesses`` in and ``guesses`` out (default canaries/10)."""
    k = max(1, canaries // 10) if guesses is None else guesses
    if not 0 < 2 * k <= canaries:
        raise ValueError(f"guesses must be in 1..canaries/2 = {canaries // 2}, got {k}")
    cfg = audit_config(algorithm, epsilon, small_settings(algorithm, settings))
    included = np.random.default_rng([seed, 7]).random(canaries) < 0.5
    world, absent = canary_world(included, base=base, records=records, seed=seed, neighbouring=cfg.neighbouring)
    delta = claimed_delta(cfg, world)
    report = {
        "method": "one-run",
        "algorithm": algorithm,
        "claimed": {"epsilon": epsilon, "delta": delta, "neighbouring": cfg.neighbouring},
        "setting": {"users": world.train.num_users, "canaries": canaries, "guesses_each_way": k, "seed": seed},
        "settings": audited_settings(cfg),
        "confidence": confidence,
        "statistic": "per canary: the released model's coordinate on the canary's direction (labels +1 in; out: "
        + ("-1)" if cfg.neighbouring == "replace-one" else "absent, enrolled and contributing nothing)"),
    }
    header = {k_: report[k_] for k_ in ("method", "algorithm", "claimed", "setting", "settings")}
    stats = Statistics(out, json.loads(json.dumps(header, default=str)))
    if (0, 0) not in stats.done:
        try:
            w = released_model(cfg, world, noise_seed(seed, 0, 0), audit_federation(cfg, world, absent))
        except ValueError as e:
            return refused(out, report, str(e), log)
        except Exception as e:  # an algorithm's crash is reported as such, never as a refusal or a pass
            return refused(out, report, f"{type(e).__name__}: {e}", log, verdict=FAILED)
        for i in range(canaries):
            stats.add(0, i, math.nan if w is None else float(w[i]))
    scores = np.array([stats.done[(0, i)] for i in range(canaries)])
    if np.isnan(scores).all():  # ⊥: the auditor abstains on every canary
        r, v = 0, 0
    else:
        r, v = one_run_guesses(scores, included, k, k)
    lower = one_run_epsilon(canaries, r, v, delta, confidence)
    report.update(
        epsilon_lower_bound=lower,
        guesses=r,
        correct=v,
        largest_attainable_bound=one_run_epsilon(canaries, 2 * k, 2 * k, delta, confidence),
        bottom_output=bool(np.isnan(scores).all()),
        verdict=verdict(lower, epsilon),
    )
    histogram(
        os.path.join(out, "histogram.png"),
        {"canaries in": scores[included], "canaries out": scores[~included]},
        "model coordinate on the canary's direction",
        f"{algorithm}: claimed eps={epsilon:g}, one-run lower bound {lower:.3g} ({confidence:.0%} conf.)",
    )
    write_report(out, report)
    log(f"  {algorithm}: {v} of {r} guesses correct")
    return report


def format_report(report: dict) -> str:
    if report["method"] == "white-box":
        from fedkl.audit.whitebox import format_white_box

        return format_white_box(report)
    c = report["claimed"]
    head = f"{report['algorithm']} ({report['method']} audit): claimed user-level eps={c['epsilon']:g}, delta={c['delta']:.3g}"
    if report["verdict"] == REFUSED:
        return f"{head}\n  refused the audit setting (nothing audited): {report['reason']}"
    if report["verdict"] == FAILED:
        return f"{head}\n  FAILED: the algorithm raised an error (nothing audited): {report['reason']}"
    if report["method"] == "one-shot":
        return (
            f"{head}\n  one-shot ESTIMATE (Andrew et al. 2023; no confidence level, not a bound): "
            f"eps ~ {report['epsilon_estimate']:.4g} (Gaussian fit, mu = {report['gdp_mu']:.3g})\n"
            f"  {report['verdict']}"
        )
    lb = report["epsilon_lower_bound"]
    gdp = report.get("gaussian_dp")
    return (
        f"{head}\n  empirical lower bound eps >= {lb:.4g} at {report['confidence']:.0%} one-sided confidence"
        + f"; the most this audit could show is {report['largest_attainable_bound']:.4g}"
        + (
            f"\n  Gaussian-DP reading (same confidence): not mu-GDP for mu < {gdp['mu_lower_bound']:.3g}; "
            f"eps >= {gdp['epsilon_lower_bound']:.4g} IF the mechanism's trade-off curve is Gaussian "
            f"(most {gdp['largest_attainable_bound']:.4g})"
            if gdp
            else ""
        )
        + f"\n  verdict: {report['verdict']}"
    )
