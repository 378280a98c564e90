"""``fedkl plan``: before any budget is spent, how loud each algorithm's noise would be.

For every algorithm asked (default: every registered one) the planner builds it exactly as
``fedkl run`` would on a fresh budget (same settings, same refusals) and reads its public noise:

* output perturbation (the paper-002 family): the first release's forecast, the norm of its
  noise ``sigma sqrt(d)`` against the farthest the data could move the model (``G/(mu + lam)``):
  ``noise_over_signal``;
* gradient methods (noisy GD, DP-SGD/RMSProp/Adam, DP-FedAvg): the norm of one round's noise on the
  averaged clipped update against the clip, averaged over the rounds
  (:func:`fedkl.algorithms.forecast.gradient_forecast`, which ``fedkl run`` warns with too);
* others (papers 000 and 003): no comparable public forecast; listed, not ranked.

Everything it reads is public: n, d, the feature bound the loader enforces, the problem's
constants, (eps, delta) and the algorithms' settings. It reads no record's value, charges nothing
and writes no ledger. The ranking is by that ratio, smallest first: a ratio above 1 means the
noise alone moves the model farther than any data could. It is a comparison of noise, not a
utility guarantee (heterogeneous users make the deletion test delete or output ⊥; the study
simulations/paper002_crossover.py measures both).
"""

from __future__ import annotations

from typing import Iterable

from fedkl.algorithms.catalog import REGISTRY
from fedkl.algorithms.forecast import gradient_forecast
from fedkl.privacy import Budget, PrivacyLedger
from fedkl.runner import RunConfig, build_algorithm, default_delta, load_run_data


def plan(settings: dict, algorithms: Iterable[str] | None = None) -> dict:
    """The planner's table for flat ``fedkl run`` settings (module docstring)."""
    names = list(algorithms or REGISTRY)
    base = RunConfig.from_settings(strict=False, **{**settings, "algorithm": names[0]})
    dataset, problem, problem_name = load_run_data(base)
    user_ids = dataset.train.user_ids
    n, dim = len(user_ids), problem.num_params
    delta = base.delta if base.delta is not None else default_delta(n)
    rows = []
    for name in names:
        cfg = RunConfig.from_settings(strict=False, **{**settings, "algorithm": name})
        ledger = PrivacyLedger(":memory:", Budget(cfg.epsilon, delta, cfg.conversion))
        row = {"algorithm": name, "ratio": None, "why": ""}
        try:
            alg = build_algorithm(cfg, problem, dataset.feature_bound, user_ids, delta, ledger)
            if hasattr(alg, "forecast"):
                f = alg.forecast(n, problem.init_params(), user_ids)
                row.update(
                    kind="output perturbation",
                    ratio=f["noise_over_signal"],
                    why=f"first release: noise norm {f['noise_norm']:.3g} vs the farthest the model can move "
                    f"{f['signal_radius']:.3g} (sigma/Delta {f['sigma_over_Delta']:.3g})",
                )
            else:
                grad = gradient_forecast(alg, cfg.params, n, dim, cfg.neighbouring)
                if grad is None:
                    row.update(kind="other", why="no comparable public forecast")
                else:
                    row.update(kind="gradient", ratio=grad[0], why=grad[1])
        except (ValueError, RuntimeError) as e:
            row.update(kind="refused", why=str(e).split("\n")[0])
        finally:
            ledger.close()
        rows.append(row)
    ranked = sorted((r for r in rows if r["ratio"] is not None), key=lambda r: r["ratio"])
    best = ranked[0]["algorithm"] if ranked else None
    return {
        "dataset": base.dataset,
        "problem": problem_name,
        "users": n,
        "dim": dim,
        "epsilon": base.epsilon,
        "delta": delta,
        "ranked": ranked,
        "unranked": [r for r in rows if r["ratio"] is None],
        "best": best,
    }


def format_plan(result: dict) -> str:
    lines = [
        f"fedkl plan: {result['dataset']} ({result['users']} users, {result['dim']} parameters, "
        f"{result['problem']}), user-level eps={result['epsilon']:g}, delta={result['delta']:.3g}; public values "
        "only, nothing read or charged",
        "rank  algorithm                 noise/signal  why",
    ]
    for i, r in enumerate(result["ranked"], 1):
        lines.append(f"{i:>4}  {r['algorithm']:<24}  {r['ratio']:>12.4g}  {r['kind']}: {r['why']}")
    for r in result["unranked"]:
        lines.append(f"   -  {r['algorithm']:<24}  {'-':>12}  {r['kind']}: {r['why']}")
    if result["best"]:
        verdict = (
            "its noise stays below the signal"
            if result["ranked"][0]["ratio"] <= 1
            else "but even its noise swamps the signal: raise eps, users or records per user"
        )
        lines.append(f"prefer {result['best']}: {verdict}")
    return "\n".join(lines)


__all__ = ["format_plan", "plan"]
