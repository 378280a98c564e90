"""Paper 002 evidence: the phased output-perturbation algorithms against noisy clipped-gradient descent
(fedkl's ``noisy-gd``) at the same user-level (eps, delta), on the mean-estimation family.

    .venv/bin/python simulations/paper002_compare.py            # full: about 2-3 min on 2 cores
    .venv/bin/python simulations/paper002_compare.py --quick    # about 20 s

Writes ``simulations/results/paper002_compare{,_quick}.{csv,json,md,png}``; the markdown file holds
the tables and the "who wins where, and why" paragraph.

Family and public constants: those of :mod:`simulations.paper002_slopes` (l = 0.5 ||theta - x||^2,
d = 4, user means exactly N(theta_pop, I/m), K = B(0, 3), w0 = 0). Metric: the excess empirical risk
0.5 ||theta^ - theta*||^2 (exact). Every method at user-level (eps, delta) = (4, 1e-5), replace-one:

* ``alg2`` (one output perturbation, paper 002 Alg 2), ``phased-erm`` (Alg 3), ``sc-phased-erm``
  (Alg 5): fedkl's classes with their THEOREM schedules and the exact mean-type inner release
  (see paper002_slopes); no tuning. The threshold Delta comes from the public model of the users
  (:func:`~fedkl.algorithms.mean_type_inner.gaussian_users_rule`). Where the public n is below
  4 kappa + 2 for some call the algorithm refuses before reading data ("refused").
* ``noisy-gd``: :class:`fedkl.algorithms.noisy_gd.NoisyGradientDescent` (per-user clipping to C,
  Gaussian noise on the sum with replace-one sensitivity 2C, lr = 1 = 1/smoothness, iterates
  projected onto K), rho = Budget(eps, delta).rho (the CKS conversion the ledger uses), enforced by a
  ZCDPFilter. Reported twice: at fedkl's default clip and round count (C = 1, T = 10), and the best
  of a grid C x T (4 x 3 configurations) chosen AFTER seeing the results - that choice is not private
  (what a tuning budget would buy); it favours noisy GD.

Charges go to in-memory recorders (the repetitions would exhaust a real ledger); the ledger tests are
in tests/algorithms/test_phased_output_pert.py and tests/algorithms/test_noisy_gd.py.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fedkl.algorithms.noisy_gd import NoisyGDConfig, NoisyGradientDescent  # noqa: E402
from fedkl.algorithms.phased_common import noise_ratio  # noqa: E402
from fedkl.federation.means import MeanFederation  # noqa: E402
from fedkl.privacy import Budget, NoiseSource, Releaser, ZCDPFilter  # noqa: E402
from fedkl.problems.quadratic_mean import draw_user_means  # noqa: E402
from simulations.paper002_slopes import RESULTS, Family, Recorder, SlopeConfig, fit_slope, seed_of  # noqa: E402

OURS = ("alg2", "phased-erm", "sc-phased-erm")
LABELS = {
    "alg2": "Alg 2 output perturbation",
    "phased-erm": "Alg 3 Phased-ERM",
    "sc-phased-erm": "Alg 5 SC-ERM",
    "noisy-gd-default": "noisy GD, C=1, T=10",
    "noisy-gd-best": "noisy GD, best of grid (non-private tuning)",
}


@dataclass(frozen=True)
class CompareConfig:
    m_grid: tuple[int, ...] = tuple(10**k for k in range(2, 13))
    n_for_m: int = 8000
    n_grid: tuple[int, ...] = (1000, 2000, 4000, 8000, 16000)
    m_for_n: int = 10**4
    seeds: int = 3
    clip_grid: tuple[float, ...] = (1.0, 0.3, 0.1, 0.03)
    rounds_grid: tuple[int, ...] = (10, 30, 100)
    eps: float = 4.0
    delta: float = 1e-5
    tag: str = "full"


FULL = CompareConfig()
QUICK = CompareConfig(
    m_grid=(10**2, 10**5, 10**8, 10**11),
    n_grid=(1000, 4000),
    seeds=2,
    clip_grid=(1.0, 0.1),
    rounds_grid=(10, 100),
    tag="quick",
)


def family(cfg: CompareConfig) -> Family:
    return Family(replace(SlopeConfig(), eps=cfg.eps, delta=cfg.delta))


def run_point(cfg: CompareConfig, fam: Family, sweep: str, n: int, m: int, seed: int) -> list[dict]:
    d = fam.cfg.d
    fed = MeanFederation(draw_user_means(n, m, d, fam.pop, fam.cfg.s, seed_of("compare-data", sweep, n, m, seed)))
    theta_star = fed.means.mean(0)
    w0 = torch.zeros(d, dtype=torch.float64)
    base = {"sweep": sweep, "n": n, "m": m, "seed": seed, "eps": cfg.eps, "delta": cfg.delta}

    def excess(w):
        return math.nan if w is None else 0.5 * float((w - theta_star) @ (w - theta_star))

    rows = []
    for name in OURS:
        noise = NoiseSource(seed_of("compare-noise", name, sweep, n, m, seed))
        try:
            if name == "alg2":
                w, phases = fam.output_pert(fed, m, noise)["w"], 1
            else:
                res = fam.algorithm(name, m).run(fed, Releaser(Recorder(), noise), w0)
                w, phases = res.w, res.phases
            status = "released" if w is not None else "⊥"
        except ValueError as exc:  # public n below 4 kappa + 2 for some call: refused, nothing read
            if "4 kappa" not in str(exc):
                raise
            w, phases, status = None, 0, "refused"
        rows.append(
            {**base, "method": name, "config": "theorem", "status": status, "phases": phases, "excess_emp": excess(w)}
        )
    rho = Budget(cfg.eps, cfg.delta).rho
    grid = [(c, t) for c in cfg.clip_grid for t in cfg.rounds_grid]
    if (1.0, 10) not in grid:
        grid.append((1.0, 10))
    for clip, rounds in grid:
        gd = NoisyGradientDescent(NoisyGDConfig(rounds=rounds, lr=1.0, clip=clip, radius=fam.cfg.radius), rho)
        filt = ZCDPFilter(rho)
        res = gd.run(
            fed, Releaser(Recorder(), NoiseSource(seed_of("compare-gd", sweep, n, m, seed, clip, rounds)), filt), w0
        )
        if res.rho_spent > rho * (1 + 1e-9):
            raise RuntimeError("noisy GD overspent its budget")
        rows.append(
            {
                **base,
                "method": "noisy-gd",
                "config": f"C={clip:g},T={rounds}",
                "status": "released",
                "phases": rounds,
                "excess_emp": excess(res.w),
            }
        )
    return rows


def best(rows: list[dict], sweep: str, n: int, m: int, method: str) -> dict | None:
    """Mean/sd of ``method`` at a point; for noisy GD "noisy-gd-best" (best mean over the grid) and
    "noisy-gd-default" (C=1, T=10). None if some seed did not release."""
    sel = [r for r in rows if (r["sweep"], r["n"], r["m"]) == (sweep, n, m)]
    if method.startswith("noisy-gd"):
        confs = (
            ["C=1,T=10"]
            if method == "noisy-gd-default"
            else sorted({r["config"] for r in sel if r["method"] == "noisy-gd"})
        )
        cands = []
        for conf in confs:
            v = np.array([r["excess_emp"] for r in sel if r["method"] == "noisy-gd" and r["config"] == conf])
            cands.append(
                {
                    "mean": float(v.mean()),
                    "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                    "config": conf,
                    "status": "released",
                }
            )
        return min(cands, key=lambda x: x["mean"])
    got = [r for r in sel if r["method"] == method]
    status = sorted({r["status"] for r in got})
    if status != ["released"]:
        return {"mean": math.nan, "sd": math.nan, "config": "theorem", "status": "/".join(status)}
    v = np.array([r["excess_emp"] for r in got])
    return {
        "mean": float(v.mean()),
        "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
        "config": "theorem",
        "status": "released",
    }


METHODS = ("alg2", "phased-erm", "sc-phased-erm", "noisy-gd-default", "noisy-gd-best")


def table(rows: list[dict], sweep: str, points: list[tuple[int, int]]) -> list[dict]:
    out = []
    for n, m in points:
        entry = {"sweep": sweep, "n": n, "m": m}
        for meth in METHODS:
            entry[meth] = best(rows, sweep, n, m, meth)
        finite = {k: entry[k]["mean"] for k in METHODS if k != "noisy-gd-best" and np.isfinite(entry[k]["mean"])}
        entry["winner_untuned"] = min(finite, key=finite.get)
        allm = {k: entry[k]["mean"] for k in METHODS if np.isfinite(entry[k]["mean"])}
        entry["winner_with_tuning"] = min(allm, key=allm.get)
        out.append(entry)
    return out


def crossover(tab: list[dict], ours: str, theirs: str) -> float | None:
    """Smallest m (m-sweep) from which ``ours`` beats ``theirs`` at every larger grid point (None: never)."""
    ms = [e["m"] for e in tab]
    wins = [np.isfinite(e[ours]["mean"]) and e[ours]["mean"] < e[theirs]["mean"] for e in tab]
    for i in range(len(ms)):
        if all(wins[i:]):
            return ms[i]
    return None


def conclusion(result: dict) -> str:
    cfg = result["config"]
    tm, tn = result["table_m"], result["table_n"]
    cross = {k: crossover(tm, k, "noisy-gd-best") for k in OURS}
    cross_d = {k: crossover(tm, k, "noisy-gd-default") for k in OURS}
    gd_slope = result["slopes"]["noisy-gd-best"]["m"]
    a2_slope = result["slopes"]["alg2"]["m"]

    def fmt(v):
        return "never on this grid" if v is None else f"m ≥ {v:.0e}"

    refused = [f"{LABELS[k]} at n = {e['n']}" for e in tn for k in OURS if e[k]["status"] == "refused"]
    ref_txt = (
        f" Refused before reading data (some call would have fewer than 4κ' + 2 users; κ' grows with the "
        f"number of phases): {', '.join(refused)}."
        if refused
        else ""
    )
    n_wins = ", ".join(f"n = {e['n']}: {LABELS[e['winner_with_tuning']]}" for e in tn)
    sl = result["slopes"]
    T = result["phases_range"]
    ratio = result["noise_ratios"]
    return (
        f"**Records per user (n = {cfg['n_for_m']}).** Noisy GD's error does not fall with m (best-of-grid slope "
        f"{gd_slope:.2f}): its noise is set by the clip C and the round count, not by how concentrated the users "
        f"are, and with a fixed start point a small C costs rounds (every step moves at most C). The output "
        f"perturbation falls like 1/m (slope {a2_slope:.2f}): its threshold Δ ∝ (spread of the user means)/n "
        f"∝ 1/(n√m) is what the deletion-stability test certifies. Alg 2 beats the best-tuned noisy GD from "
        f"{fmt(cross['alg2'])} and fedkl's default noisy GD from {fmt(cross_d['alg2'])}; Alg 5 (SC-ERM: half the "
        f"budget localises, the other half is spread over ⌈ln nm⌉ = {T['sc-phased-erm'][0]}–{T['sc-phased-erm'][1]} "
        f"phases) from {fmt(cross['sc-phased-erm'])}; Alg 3 (Phased-ERM, every phase at ε/T with T = "
        f"{T['phased-erm'][0]}–{T['phased-erm'][1]}, so κ' ∝ T and σ/Δ ∝ T²) from {fmt(cross['phased-erm'])}. On this "
        f"strongly convex family localisation only costs: Alg 2 alone is the best of paper 002's algorithms at "
        f"every point, and the phased methods are the price of the convex (not strongly convex) guarantee. "
        f"**Users (m = {cfg['m_for_n']:.0e}).** Winner (including tuned noisy GD): {n_wins}.{ref_txt} Measured "
        f"n-slopes of the excess: noisy GD best {sl['noisy-gd-best']['n']:.2f}, Alg 2 {sl['alg2']['n']:.2f}, Alg 5 "
        f"{sl['sc-phased-erm']['n']:.2f}, Alg 3 {sl['phased-erm']['n']:.2f} (−2 is noise on a mean of n users; the "
        f"phased methods are flatter because at this m they are outside their non-vacuous regime n√m ≫ c√d: their "
        f"errors are of the order of the domain K, clipped by the projection). At this m the user means are spread "
        f"out, so Δ "
        f"times the κ-inflated ratio σ/Δ ({ratio['alg2']:.0f} for Alg 2, {ratio['phased-erm'][0]:.2g}–"
        f"{ratio['phased-erm'][1]:.2g} per Phased-ERM phase) exceeds what noisy GD pays. "
        f"**Why.** The deletion-based mechanism pays a large constant "
        f"(TDLap deletion budget κ in the sensitivity, Gaussian at (ε/2, δ/(e^{{ε/2}}+2))) for a noise scale that "
        f"adapts to the users' concentration, 1/√m; noisy GD pays a small constant (√T/√(2ρ)) on a noise scale "
        f"fixed by C. Hence noisy GD wins with few records per user and the output perturbation with many; the "
        f"phased algorithms move that crossover up by the factors their budget splitting costs. Caveats: the "
        f"thresholds use the public model of the users (IID, N(θ_pop, I/m)): with heterogeneous users the test "
        f"deletes users or outputs ⊥ (privacy holds, utility does not); noisy GD could also exploit the public "
        f"scale (C ∝ 1/√m after a warm start), which was not tried."
    )


def markdown(result: dict) -> str:
    cfg = result["config"]
    q = " --quick" if cfg["tag"] == "quick" else ""
    L = [
        f"# Paper 002 vs noisy clipped-gradient descent ({cfg['tag']} run)",
        "",
        f"Regenerate: `.venv/bin/python simulations/paper002_compare.py{q}` ({result['seconds']:.0f} s). "
        f"ℓ = ½‖θ − x‖², d = 4, user means N(θ_pop, I/m) exactly; excess empirical risk ½‖θ̂ − θ*‖² (mean ± sd over "
        f"{cfg['seeds']} seeds: new data and noise each); user-level (ε, δ) = ({cfg['eps']}, {cfg['delta']:g}), "
        "replace-one, for every method. Paper 002's algorithms run with their theorem schedules (no tuning); "
        "'noisy GD best' is the best of "
        f"{len(cfg['clip_grid'])} clips × {len(cfg['rounds_grid'])} round counts chosen after the fact (not "
        "private). Method: module docstring of `simulations/paper002_compare.py`.",
        "",
    ]
    for title, tab, key in (
        (f"Sweep over m (n = {cfg['n_for_m']})", result["table_m"], "m"),
        (f"Sweep over n (m = {cfg['m_for_n']:.0e})", result["table_n"], "n"),
    ):
        L += [
            f"## {title}",
            "",
            f"| {key} | " + " | ".join(LABELS[k] for k in METHODS) + " | winner (untuned) | winner (with tuning) |",
            "|---|" + "---|" * (len(METHODS) + 2),
        ]
        for e in tab:
            cells = []
            for k in METHODS:
                x = e[k]
                if x["status"] != "released":
                    cells.append(x["status"])
                else:
                    cells.append(
                        f"{x['mean']:.3g} ± {x['sd']:.2g}" + (f" ({x['config']})" if k == "noisy-gd-best" else "")
                    )
            val = f"{e['m']:.0e}" if key == "m" else str(e["n"])
            L.append(
                f"| {val} | " + " | ".join(cells) + f" | {LABELS[e['winner_untuned']]} | "
                f"{LABELS[e['winner_with_tuning']]} |"
            )
        L.append("")
    L += ["## Fitted slopes of the excess (log–log, means over seeds)", "", "| method | vs m | vs n |", "|---|---|---|"]
    for k in METHODS:
        sl = result["slopes"][k]
        L.append(f"| {LABELS[k]} | {sl['m']:.2f} | {sl['n']:.2f} |")
    L += ["", "## Who wins where, and why", "", conclusion(result), ""]
    return "\n".join(L)


def slopes(tab_m: list[dict], tab_n: list[dict]) -> dict:
    out = {}
    for k in METHODS:
        out[k] = {}
        for key, tab in (("m", tab_m), ("n", tab_n)):
            pts = [(e[key], e[k]["mean"]) for e in tab if np.isfinite(e[k]["mean"])]
            out[k][key] = fit_slope(*zip(*pts))["slope"] if len(pts) >= 2 else math.nan
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    cfg = result["config"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    styles = {
        "alg2": ("C0", "o-"),
        "phased-erm": ("C1", "o-"),
        "sc-phased-erm": ("C2", "o-"),
        "noisy-gd-default": ("C3", "s--"),
        "noisy-gd-best": ("C4", "s--"),
    }
    for ax, tab, key in ((axes[0], result["table_m"], "m"), (axes[1], result["table_n"], "n")):
        for k in METHODS:
            pts = [(e[key], e[k]["mean"], e[k]["sd"]) for e in tab if np.isfinite(e[k]["mean"])]
            if not pts:
                continue
            x, y, sd = map(np.array, zip(*pts))
            color, style = styles[k]
            ax.errorbar(x, y, yerr=np.minimum(sd, 0.9 * y), fmt=style, color=color, ms=4, capsize=2, label=LABELS[k])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, alpha=0.3)
        ax.set_ylabel("excess empirical risk ½‖θ̂ − θ*‖²")
        ax.set_xlabel(
            f"records per user m (n = {cfg['n_for_m']})"
            if key == "m"
            else f"users n (m = {cfg['m_for_n']:.0e}); missing = refused (n < 4κ'+2)"
        )
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Paper 002 vs noisy GD at user-level (ε, δ) = ({cfg['eps']}, {cfg['delta']:g}), ℓ = ½‖θ − x‖², "
        f"d = 4, {cfg['seeds']} seeds (error bars: sd)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller grids, 2 seeds")
    p.add_argument("--out", default=RESULTS, help="output folder (default simulations/results)")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    fam = family(cfg)
    start = time.perf_counter()
    rows = []
    for sweep, pairs in (("m", [(cfg.n_for_m, m) for m in cfg.m_grid]), ("n", [(n, cfg.m_for_n) for n in cfg.n_grid])):
        for n, m in pairs:
            t = time.perf_counter()
            for seed in range(cfg.seeds):
                rows.extend(run_point(cfg, fam, sweep, n, m, seed))
            print(f"  {sweep}-sweep n={n:6d} m={m:.0e} ({time.perf_counter() - t:.1f} s)", flush=True)
    tm = table(rows, "m", [(cfg.n_for_m, m) for m in cfg.m_grid])
    tn = table(rows, "n", [(n, cfg.m_for_n) for n in cfg.n_grid])
    phases = {k: [r["phases"] for r in rows if r["method"] == k and r["status"] == "released"] for k in OURS}
    ratios = sorted({noise_ratio(cfg.eps / t, cfg.delta / t, fam.cfg.calibration) for t in phases["phased-erm"]})
    result = {
        "config": asdict(cfg),
        "table_m": tm,
        "table_n": tn,
        "slopes": slopes(tm, tn),
        "phases_range": {k: [min(v), max(v)] for k, v in phases.items() if v},
        "noise_ratios": {
            "alg2": noise_ratio(cfg.eps, cfg.delta, fam.cfg.calibration),
            "phased-erm": [ratios[0], ratios[-1]],
        },
        "seconds": time.perf_counter() - start,
    }
    base = os.path.join(args.out, "paper002_compare" + ("_quick" if cfg.tag == "quick" else ""))
    os.makedirs(args.out, exist_ok=True)
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=2, default=str)
    with open(base + ".md", "w") as f:
        f.write(markdown(result))
    plot(result, base + ".png")
    print(conclusion(result))
    print(f"wrote {base}.{{csv,json,md,png}} ({result['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
