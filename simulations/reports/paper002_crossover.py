"""Reports of paper 002's crossover: ``tuning_report`` (simulations/studies/paper002_crossover_tuning.toml,
stage 1: every validation run and the baselines' choice per (source, eps)) and ``report``
(simulations/studies/paper002_crossover.toml, stage 2: who wins per (dataset, m, eps), the deletion jumps
against what the test certifies, the predicted crossover m*, every algorithm's cells, the figure and a
JSON summary; it refuses a table whose baselines do not run stage 1's choice). Run by
``fedkl report simulations/studies/paper002_crossover{_tuning,}.toml``."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from fedkl.algorithms.output_perturbation.exact_output_pert import delta_union_bound
from fedkl.algorithms.output_perturbation.stability_profile import calibrate as profile_calibration
from fedkl.experiments.config import ConfigError
from fedkl.experiments.plot import write_text
from fedkl.experiments.report import load_function
from fedkl.experiments.table import read_table

REG = 0.1
BASELINES = ("noisy-gd", "dp-fedavg")
FAMILY = ("sc-output-pert", "mean-output-pert", "phased-sco", "sc-phased-sco", "sc-phased-erm", "phased-erm")
# kappa of the deletion test, as the runner computes it (loaded by path, as fedkl loads plugins)
kappa = load_function(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "../plugins/paper002_crossover.py:kappa")
)


def script_row(r: dict, phase: str) -> dict:
    """A table row under the names the analysis reads (those of the script's CSV)."""
    return {
        "phase": phase,
        "dataset": r["source"],
        "n": r["users"],
        "m": r["records"],
        "epsilon": r["epsilon_target"],
        "delta": r["delta"],
        "seed": r["seed"],
        "algorithm": r["method"],
        "hyper": r["hyper"],
        "status": r["outcome"],
        "test_loss": r["test_loss"],
        "eps_spent": r["epsilon"],
        **{k: r[k] for k in ("loss_eff", "test_accuracy", "nonprivate_loss", "majority_accuracy", "bottom")},
        **{k: r[k] for k in ("bottom_rate", "Delta", "deletions", "conflict_edges", "noise_over_signal", "sigma")},
        **{k: r[k] for k in ("max_jump", "median_jump", "seconds", "note")},
    }


def fnum(x):
    try:
        v = float(x)
        return v if math.isfinite(v) else None
    except (TypeError, ValueError):
        return None


def tuning_choice(tuning: list[dict]) -> dict[tuple[str, float, str], dict]:
    """(source, eps, method) -> the setting of the lowest validation objective (the first on a tie)."""
    best: dict = {}
    for r in tuning:
        loss = fnum(r["test_loss"])
        key = (r["dataset"], float(r["epsilon"]), r["algorithm"])
        if loss is not None and (key not in best or loss < best[key][0]):
            best[key] = (loss, json.loads(r["hyper"]))
    return {k: v[1] for k, v in best.items()}


def tuning_report(study) -> list[str]:
    rows = [script_row(r, "tune") for r in study.rows]
    chosen = tuning_choice(rows)
    L = [
        "# Paper 002's crossover, stage 1: the baselines' settings chosen on a validation split",
        "",
        "Regenerate: `fedkl sweep` + `fedkl report simulations/studies/paper002_crossover_tuning.toml`. Seed 0, "
        "the middle m of each source; validation objective = per-user mean log-loss + reg/2 ‖w‖² on a 75/25 "
        "re-split of the train records (the test records are never seen). The choice (marked) is what "
        "`simulations/studies/paper002_crossover.toml` runs.",
        "",
        "| source | m | ε | algorithm | setting | validation objective | chosen |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        key = (r["dataset"], float(r["epsilon"]), r["algorithm"])
        mark = "**yes**" if chosen.get(key) == json.loads(r["hyper"]) else ""
        L.append(
            f"| {r['dataset']} | {r['m']} | {float(r['epsilon']):g} | {r['algorithm']} | {r['hyper']} | "
            f"{fmt(fnum(r['test_loss']))} | {mark} |"
        )
    path = study.output("markdown")
    write_text(path, "\n".join(L) + "\n")
    return [path]


def report(study) -> list[str]:
    rows = [script_row(r, "eval") for r in study.rows if r["phase"] == "eval"]
    tuning_path = study.option("tuning_table")
    if not tuning_path or not os.path.exists(tuning_path):
        raise ConfigError(f"{study.path}: [report] tuning_table (stage 1's table) not found: {tuning_path!r}")
    tuning = [script_row(r, "tune") for r in read_table(tuning_path) if r.get("status") == "ok"]
    chosen = tuning_choice(tuning)
    for r in rows:
        if r["algorithm"] in BASELINES:
            want = chosen.get((r["dataset"], float(r["epsilon"]), r["algorithm"]))
            if want != json.loads(r["hyper"]):
                raise ConfigError(
                    f"{study.table}: {r['algorithm']} on {r['dataset']} at eps {float(r['epsilon']):g} runs {r['hyper']}, "
                    f"but stage 1 ({tuning_path}) chose {want}: update the study's settings"
                )
    payload, S, specs, epsilons, diag, verdicts, predictions = analyse(study, rows, tuning)
    written = [study.output("json"), study.output("figure"), study.output("markdown")]
    write_text(written[0], json.dumps(payload, indent=1, default=str))
    plot(written[1], S, specs, epsilons)
    write_md(written[2], payload, S, specs, epsilons, diag, verdicts, predictions, rows)
    return written


def summarize(rows: list[dict]) -> dict:
    """(dataset, m, eps, algorithm) -> stats over seeds."""
    groups: dict = {}
    for r in rows:
        if r["phase"] != "eval":
            continue
        k = (r["dataset"], int(float(r["m"])), float(r["epsilon"]), r["algorithm"])
        groups.setdefault(k, []).append(r)
    out = {}
    for k, rs in groups.items():
        st = [r["status"] for r in rs]
        le = [fnum(r["loss_eff"]) for r in rs if fnum(r["loss_eff"]) is not None]
        acc = [fnum(r["test_accuracy"]) for r in rs if fnum(r["test_accuracy"]) is not None]
        nos = [fnum(r["noise_over_signal"]) for r in rs if fnum(r["noise_over_signal"]) is not None]
        br = [fnum(r["bottom_rate"]) for r in rs if fnum(r["bottom_rate"]) is not None and r["status"] != "refused"]
        dels = [fnum(r["deletions"]) for r in rs if fnum(r["deletions"]) is not None]
        Ds = [fnum(r["Delta"]) for r in rs if fnum(r["Delta"]) is not None]
        out[k] = {
            "runs": len(rs),
            "refused": st.count("refused"),
            "errors": st.count("error"),
            "loss": float(np.mean(le)) if le else None,
            "loss_sd": float(np.std(le)) if len(le) > 1 else 0.0,
            "acc": float(np.mean(acc)) if acc else None,
            "bottom_rate": float(np.mean(br)) if br else None,
            "noise_over_signal": float(np.mean(nos)) if nos else None,
            "deletions": (min(dels), max(dels)) if dels else None,
            "Delta": float(np.mean(Ds)) if Ds else None,
            "nonprivate": float(np.mean([fnum(r["nonprivate_loss"]) for r in rs if fnum(r["nonprivate_loss"])]))
            if any(fnum(r["nonprivate_loss"]) for r in rs)
            else None,
            "note": next((r["note"] for r in rs if r["note"]), ""),
        }
    return out


def fmt(x, p=4):
    return "-" if x is None else f"{x:.{p}g}"


def analyse(study, rows: list[dict], tuning: list[dict]) -> tuple:
    """What the script computed from its CSV: the summary, the grid, the diagnostics and the choice."""
    S = summarize(rows)
    specs: dict = {}
    for r in rows:
        if r["phase"] == "eval":
            spec = specs.setdefault(r["dataset"], {"n": int(r["n"]), "ms": [], "algorithms": []})
            m = int(r["m"])
            if m not in spec["ms"]:
                spec["ms"].append(m)
            if r["algorithm"] not in spec["algorithms"]:
                spec["algorithms"].append(r["algorithm"])
    for r in tuning:
        specs[r["dataset"]]["tune_m"] = int(r["m"])
    epsilons = sorted({float(r["epsilon"]) for r in rows if r["phase"] == "eval"})
    diag = {}
    for r in study.rows:
        if r["phase"] == "diagnostics":
            n, m = int(r["users"]), int(r["records"])
            diag[f"{r['source']}|{m}"] = {
                **{k: float(r[k]) for k in ("nonprivate_loss", "trH_test", "max_jump", "median_jump", "theta_norm")},
                "d": int(r["d"]),
                "majority_accuracy": float(r["majority_accuracy"]),
                "n": n,
                "iid_scale": 1.0 / (REG * n * math.sqrt(m)),
            }
    chosen = {}
    for r in rows:
        if r["phase"] == "eval" and r["algorithm"] in BASELINES:
            chosen[f"{r['dataset']}|eps={float(r['epsilon']):g}|{r['algorithm']}"] = json.loads(r["hyper"])
    # winners
    verdicts = []
    for name, spec in specs.items():
        for eps in epsilons:
            for m in spec["ms"]:
                fam = [
                    (S[(name, m, eps, a)]["loss"], a)
                    for a in spec["algorithms"]
                    if a in FAMILY and (name, m, eps, a) in S and S[(name, m, eps, a)]["loss"] is not None
                ]
                base = [
                    (S[(name, m, eps, a)]["loss"], a)
                    for a in BASELINES
                    if (name, m, eps, a) in S and S[(name, m, eps, a)]["loss"] is not None
                ]
                if fam and base:
                    bf, bb = min(fam), min(base)
                    np_loss = S[(name, m, eps, bb[1])]["nonprivate"]
                    verdicts.append(
                        {
                            "dataset": name,
                            "m": m,
                            "eps": eps,
                            "best_family": bf[1],
                            "family_loss": bf[0],
                            "best_baseline": bb[1],
                            "baseline_loss": bb[0],
                            "nonprivate": np_loss,
                            "family_wins": bf[0] < bb[0],
                            "gap": bf[0] - bb[0],
                        }
                    )
    # predicted crossover m* for sc-output-pert (IID model; see the module docstring)
    predictions = []
    for name, spec in specs.items():
        m_max = max(spec["ms"])
        dg = diag[f"{name}|{m_max}"]
        for eps in epsilons:
            sigs = [
                fnum(r["sigma"])
                for r in rows
                if r["phase"] == "eval"
                and r["dataset"] == name
                and int(float(r["m"])) == m_max
                and float(r["epsilon"]) == eps
                and r["algorithm"] == "sc-output-pert"
                and fnum(r["sigma"]) is not None
            ]
            base = [
                S[(name, m_max, eps, a)]["loss"]
                for a in BASELINES
                if (name, m_max, eps, a) in S and S[(name, m_max, eps, a)]["loss"] is not None
            ]
            if not sigs or not base:
                continue
            sigma = float(np.mean(sigs))
            excess_b = max(min(base) - dg["nonprivate_loss"], 1e-6)
            excess_op = 0.5 * sigma**2 * dg["trH_test"]
            try:
                Du = delta_union_bound(
                    1.0, REG, dg["n"], m_max, kappa(eps, 1 / dg["n"] ** 1.1), 1.0 / (2 * dg["n"] ** 2 * m_max)
                )
            except ValueError:
                continue
            predictions.append(
                {
                    "dataset": name,
                    "eps": eps,
                    "n": dg["n"],
                    "m_max": m_max,
                    "sigma_at_m_max": sigma,
                    "predicted_excess_at_m_max": excess_op,
                    "baseline_excess": excess_b,
                    "m_star": m_max * excess_op / excess_b,
                    "m_star_oracle_Delta": m_max * excess_op / excess_b * (dg["max_jump"] / Du) ** 2,
                }
            )
    payload = {
        "command": "fedkl sweep + fedkl report simulations/studies/paper002_crossover.toml",
        "quick": False,
        "reg": REG,
        "epsilons": list(epsilons),
        "grid": specs,
        "tuning_grids": "simulations/studies/paper002_crossover_tuning.toml",
        "chosen_baseline_settings": chosen,
        "diagnostics_seed0": diag,
        "summary": [{"dataset": k[0], "m": k[1], "eps": k[2], "algorithm": k[3], **v} for k, v in sorted(S.items())],
        "verdicts": verdicts,
        "predicted_crossover": predictions,
        "runs": {
            "eval": sum(r["phase"] == "eval" for r in rows),
            "tune": len(tuning),
            "train_seconds": round(sum(fnum(r["seconds"]) or 0 for r in rows + tuning), 1),
        },
    }
    return payload, S, specs, epsilons, diag, verdicts, predictions


def _style_axis(ax, title: str, first_column: bool, last_row: bool) -> None:
    """One crossover panel's frame: log-m axis, the start point log 2, title and the outer labels."""
    ax.axhline(math.log(2.0), color="grey", lw=0.5)
    ax.set_xscale("log")
    ax.set_title(title, fontsize=8)
    if first_column:
        ax.set_ylabel("test objective (⊥ = log 2; ▲ off-scale)", fontsize=8)
    if last_row:
        ax.set_xlabel("records per user m", fontsize=8)
    ax.tick_params(labelsize=7)


def plot(path: str, S, specs, epsilons) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(specs)
    fig, axes = plt.subplots(len(names), len(epsilons), figsize=(3.6 * len(epsilons), 3.0 * len(names)), squeeze=False)
    algs = BASELINES + FAMILY
    colors = dict(zip(algs, plt.cm.tab10.colors))
    for i, name in enumerate(names):
        for j, eps in enumerate(epsilons):
            ax = axes[i][j]
            ms = specs[name]["ms"]
            nps = [
                (m, S[(name, m, eps, a)]["nonprivate"])
                for a in algs
                for m in ms
                if (name, m, eps, a) in S and S[(name, m, eps, a)]["nonprivate"] is not None
            ]
            lo = min([v for _, v in nps] + [0.6]) - 0.01
            top = 0.75  # log 2 = 0.693 is the start point; larger losses are drawn at the top edge (triangles)
            for a in algs:
                pts = [
                    (m, S[(name, m, eps, a)]["loss"])
                    for m in ms
                    if (name, m, eps, a) in S and S[(name, m, eps, a)]["loss"] is not None
                ]
                if pts:
                    x, y = zip(*pts)
                    yc = [min(v, top) for v in y]
                    ax.plot(
                        x, yc, "-" if a in BASELINES else "--", color=colors[a], label=a, lw=2 if a in BASELINES else 1
                    )
                    for xi, yi, v in zip(x, yc, y):
                        ax.plot([xi], [yi], "^" if v > top else ("o" if a in BASELINES else "s"), color=colors[a], ms=4)
            if nps:
                d = dict(nps)
                ax.plot(sorted(d), [d[m] for m in sorted(d)], "k:", label="non-private θ*")
            _style_axis(ax, f"{name}, eps={eps:g}", first_column=j == 0, last_row=i == len(names) - 1)
            ax.set_ylim(lo, top + 0.005)
    h, lab = axes[0][0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=5, fontsize=8)
    fig.suptitle(
        "Paper 002 family (dashed) vs noisy GD and DP-FedAvg (solid) at equal user-level (eps, 1/n^1.1), "
        f"replace-one, reg={REG}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_md(path: str, payload, S, specs, epsilons, diag, verdicts, predictions, rows) -> None:
    L = []
    L.append("# Paper 002's crossover, measured: output perturbation vs noisy GD and DP-FedAvg as m grows\n")
    L.append(
        "Regenerate: `fedkl sweep` + `fedkl report simulations/studies/paper002_crossover.toml` (stage 2; the "
        "baselines' settings come from stage 1, `simulations/studies/paper002_crossover_tuning.toml`). "
        "Method, data, settings and every choice: the two study files and the runner "
        "`simulations/plugins/paper002_crossover.py`.\n"
    )
    ev = [r for r in rows if r["phase"] == "eval"]
    seeds_done = sorted({int(float(r["seed"])) for r in ev})
    L.append(
        f"Coverage: {len(ev)} evaluation runs (+{payload['runs']['tune']} validation-tuning runs), "
        f"seeds present: {seeds_done}; {payload['runs']['train_seconds'] / 60:.1f} min of training. "
        f"User-level (ε, δ = 1/n^1.1), replace-one for every algorithm; reg = {REG} for every algorithm; "
        "logistic regression, ‖x‖ ≤ 1. Test objective = per-user mean log-loss + reg/2‖w‖² on held-out "
        "records (evaluation only, not private); a ⊥ release counts as the start point w0 = 0 (loss log 2 = "
        "0.6931). Baselines tuned on a validation split of the train records (never on test).\n"
    )
    # headline
    wins = [v for v in verdicts if v["family_wins"]]
    L.append("## Headline\n")
    L.append(headline(verdicts, wins, predictions, diag, specs))
    L.append(
        "\nThe paper-002 releases on each dataset (over all its m, ε and seeds): ⊥ rate, most users deleted by the "
        "test, refused configurations, and the public forecast's noise_over_signal (range):\n"
    )
    for name, spec in specs.items():
        parts = []
        for a in spec["algorithms"]:
            if a not in FAMILY:
                continue
            ks = [k for k in S if k[0] == name and k[3] == a]
            if not ks:
                continue
            br = [S[k]["bottom_rate"] for k in ks if S[k]["bottom_rate"] is not None]
            dl = [S[k]["deletions"][1] for k in ks if S[k]["deletions"]]
            nos = [S[k]["noise_over_signal"] for k in ks if S[k]["noise_over_signal"] is not None]
            ref = sum(S[k]["refused"] for k in ks)
            runs = sum(S[k]["runs"] for k in ks)
            parts.append(f"{a}: ⊥ {np.mean(br):.2f}" if br else f"{a}: no release")
            if dl:
                parts[-1] += f", ≤ {max(dl):g} deleted"
            if nos:
                parts[-1] += f", nos {min(nos):.2g}–{max(nos):.2g}"
            if ref:
                parts[-1] += f", refused {ref}/{runs}"
        L.append(f"- {name}: " + "; ".join(parts))
    L.append("\n## Who wins, per (dataset, m, ε)\n")
    L.append(
        "Best of the paper-002 family vs best baseline (mean test objective over seeds; lower is better; gap = "
        "family − baseline, negative = output perturbation wins).\n"
    )
    L.append("| dataset | m | ε | best paper-002 | its loss | best baseline | its loss | non-private | gap | winner |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for v in verdicts:
        L.append(
            f"| {v['dataset']} | {v['m']} | {v['eps']:g} | {v['best_family']} | {v['family_loss']:.4f} | "
            f"{v['best_baseline']} | {v['baseline_loss']:.4f} | {fmt(v['nonprivate'])} | {v['gap']:+.4f} | "
            f"{'**paper 002**' if v['family_wins'] else 'baseline'} |"
        )
    L.append("\n## Deletion jumps (non-private diagnostic, seed 0) against what the test certifies\n")
    L.append(
        "max / median jump = max_u / median_u ‖θ*(x) − θ*(x₋ᵤ)‖ (one Newton step, reg = 0.1); IID scale = "
        "1/(μ n √m) (G = 1): the paper's model predicts jumps of a few times this, falling like 1/√m; "
        "Δ_uc(ε=8) is the threshold sc-output-pert's test certifies per deletion at ε = 8.\n"
    )
    L.append(
        "| dataset | n | m | max jump | median jump | IID scale 1/(μn√m) | max jump / IID scale | "
        "Δ_uc (ε=8) | max jump / Δ_uc |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for name, spec in specs.items():
        for m in spec["ms"]:
            dg = diag[f"{name}|{m}"]
            n = dg["n"]
            Du = delta_union_bound(1.0, REG, n, m, kappa(8.0, 1 / n**1.1), 1.0 / (2 * n * n * m))
            L.append(
                f"| {name} | {n} | {m} | {dg['max_jump']:.3g} | {dg['median_jump']:.3g} | {dg['iid_scale']:.3g} | "
                f"{dg['max_jump'] / dg['iid_scale']:.1f} | {Du:.3g} | {dg['max_jump'] / Du:.3g} |"
            )
    slopes = []
    for name, spec in specs.items():
        ms = list(spec["ms"])
        if len(ms) >= 2:
            mj = [diag[f"{name}|{m}"]["max_jump"] for m in ms]
            md = [diag[f"{name}|{m}"]["median_jump"] for m in ms]
            sl = np.polyfit(np.log(ms), np.log(mj), 1)[0]
            sm = np.polyfit(np.log(ms), np.log(md), 1)[0]
            slopes.append(f"{name}: max-jump slope in m {sl:+.2f}, median {sm:+.2f}")
    if slopes:
        L.append("\nLog–log slopes of the jumps vs m (IID theory: −0.5): " + "; ".join(slopes) + ".\n")
    L.append("\n## Predicted crossover for sc-output-pert (forecast σ, IID model)\n")
    L.append(
        "σ(m_max) = the public noise per coordinate of sc-output-pert at the largest m; predicted excess = "
        "σ² tr(H)/2; m* = m_max · predicted excess / best baseline's measured excess (σ² ∝ 1/m). It assumes the "
        "deletion test passes (IID users) at that m and n fixed.\n"
    )
    L.append(
        "m*_oracle: the same with Δ set to the MEASURED max deletion jump instead of Δ_uc (a non-private, "
        "data-calibrated Δ: how much of m* is the union-bound constant rather than σ/Δ).\n"
    )
    L.append(
        "| dataset | n | ε | m_max | σ(m_max) | predicted excess at m_max | best baseline excess | m* | m*_oracle |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for p in predictions:
        L.append(
            f"| {p['dataset']} | {p['n']} | {p['eps']:g} | {p['m_max']} | {p['sigma_at_m_max']:.3g} | "
            f"{p['predicted_excess_at_m_max']:.3g} | {p['baseline_excess']:.3g} | {p['m_star']:.2g} | "
            f"{p['m_star_oracle_Delta']:.2g} |"
        )
    L.append("\n## Every algorithm: test objective (mean ± sd over seeds), ⊥ rate, Δ, deletions, forecast\n")
    L.append(
        "Cell: loss ± sd [accuracy] (⊥ rate; noise_over_signal of the public forecast; Δ of the first release; "
        "deletions min–max over seeds). `refused`: the algorithm's public check refused the configuration "
        "before reading data (too few users for its deletion depth at this ε).\n"
    )
    for name, spec in specs.items():
        L.append(f"\n### {name}\n")
        L.append("| m | algorithm | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |")
        L.append("|---|---|" + "---|" * len(epsilons))
        for m in spec["ms"]:
            for a in spec["algorithms"]:
                cells = []
                for e in epsilons:
                    s = S.get((name, m, e, a))
                    if s is None:
                        cells.append("-")
                    elif s["loss"] is None:
                        cells.append(
                            f"refused ({s['refused']}/{s['runs']})" if s["refused"] else f"error: {s['note'][:60]}"
                        )
                    else:
                        extra = [
                            f"⊥ {s['bottom_rate']:.2f}" if s["bottom_rate"] is not None else None,
                            f"nos {s['noise_over_signal']:.3g}" if s["noise_over_signal"] is not None else None,
                            f"Δ {s['Delta']:.3g}" if s["Delta"] is not None and a in FAMILY else None,
                            f"del {s['deletions'][0]:g}–{s['deletions'][1]:g}" if s["deletions"] else None,
                        ]
                        ex = "; ".join(x for x in extra if x)
                        cells.append(
                            f"{s['loss']:.4f} ± {s['loss_sd']:.3f} [{fmt(s['acc'], 3)}]"
                            + (f" ({ex})" if ex and a in FAMILY else "")
                            + f" n={s['runs']}"
                        )
                L.append(f"| {m} | {a} | " + " | ".join(cells) + " |")
            np_vals = [S[k]["nonprivate"] for k in S if k[0] == name and k[1] == m and S[k]["nonprivate"] is not None]
            if np_vals:
                L.append(f"| {m} | non-private θ* | " + " | ".join(f"{np.mean(np_vals):.4f}" for _ in epsilons) + " |")
    L.append("\n## Baseline settings chosen on the validation split\n")
    for k, v in sorted(chosen_rows(rows).items()):
        L.append(f"- {k}: {v}")
    L.append("\n![crossover](paper002_crossover.png)\n")
    write_text(path, "\n".join(L) + "\n")


def chosen_rows(rows):
    out = {}
    for r in rows:
        if r["phase"] == "eval" and r["algorithm"] in BASELINES:
            out[f"{r['dataset']}, ε={float(r['epsilon']):g}, {r['algorithm']}"] = r["hyper"]
    return out


def headline(verdicts, wins, predictions, diag, specs) -> str:
    if not verdicts:
        return "No comparable cell was measured yet.\n"
    lines = []
    total = len(verdicts)
    if wins:
        best = min(wins, key=lambda v: v["gap"])
        lines.append(
            f"Output perturbation (paper 002) beats the best tuned baseline in {len(wins)} of {total} "
            f"(dataset, m, ε) cells; the largest margin: {best['best_family']} on {best['dataset']} at m = "
            f"{best['m']}, ε = {best['eps']:g}: test objective {best['family_loss']:.4f} vs "
            f"{best['best_baseline']} {best['baseline_loss']:.4f} (gap {best['gap']:+.4f})."
        )
        cells = ", ".join(
            f"{v['dataset']} m={v['m']} ε={v['eps']:g} ({v['best_family']}, {v['gap']:+.4f})" for v in wins
        )
        lines.append(f"Winning cells: {cells}.")
    else:
        lines.append(
            f"In none of the {total} measured (dataset, m, ε) cells does any paper-002 algorithm beat the "
            "best tuned baseline (noisy GD or DP-FedAvg) on test objective."
        )
    gaps = {}
    for v in verdicts:
        gaps.setdefault(v["dataset"], []).append(v["gap"])
    lines.append(
        "Median gap (family − baseline) per dataset: "
        + ", ".join(f"{k} {np.median(g):+.4f}" for k, g in gaps.items())
        + "."
    )
    het = []
    for name, spec in specs.items():
        ms = list(spec["ms"])
        if len(ms) >= 2:
            a, b = diag[f"{name}|{ms[0]}"], diag[f"{name}|{ms[-1]}"]
            het.append(
                f"{name}: max deletion jump {a['max_jump']:.3g} at m = {ms[0]} → {b['max_jump']:.3g} at "
                f"m = {ms[-1]} (×{b['max_jump'] / a['max_jump']:.2f}; IID predicts "
                f"×{math.sqrt(ms[0] / ms[-1]):.2f}), {b['max_jump'] / b['iid_scale']:.0f}× the IID scale "
                "1/(μn√m)"
            )
    if het:
        lines.append("Measured deletion jumps: " + "; ".join(het) + ".")
    if predictions:
        fert = [p for p in predictions if p["dataset"].startswith("fertility")]
        ps = fert or predictions
        lines.append(
            "Forecast crossover for sc-output-pert (IID model, σ² ∝ 1/m): "
            + ", ".join(f"{p['dataset']} ε={p['eps']:g}: m* ≈ {p['m_star']:.2g}" for p in ps)
            + "."
        )
    return "\n".join(lines) + "\n"


TODAY = ("sc-output-pert", "mean-output-pert", "phased-mean-output-pert", "sc-phased-sco", "phased-erm")


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def today_report(study) -> list[str]:
    """``fedkl report simulations/studies/paper002_crossover_{today,silos}.toml``: the crossover rerun with
    today's noise (the plugin's ``noise = "today"``) on the random partition (``_today``) or the real silos
    (``_silos``: one table per source; ``[report] title`` and ``data`` name them). Per (source, m, eps), means
    over the seeds: every algorithm's effective test loss, its gap to the best tuned baseline of the same seed,
    sigma/Delta, the Delta the release used against the measured largest deletion jump and the jump against
    the IID scale 1/(mu n sqrt(m)), the deletions (and conflict edges) of the test, the ⊥ rate; then, per
    source, the forecast crossover m* of
    sc-output-pert (the IID model of ``report``: excess = sigma^2 tr(H_test) / 2, sigma^2 ∝ 1/m), once from
    public values (Delta_uc, and the profile calibration's sigma/Delta without the sparse vector:
    ``fedkl plan``'s) and once with the privately chosen Delta and the sigma released. tr(H_test) and the
    tight sigma/Delta come from the committed stage-2 table (``[report] committed_table``, same partitions).
    A row's source is its ``dataset`` (the loader; the plugin refuses a source whose loader differs)."""
    rows = [r for r in study.rows if r["noise"] == "today"]  # every row is an eval (no phase axis)
    old = read_table(study.option("committed_table"))
    trh = {(r["source"], int(r["records"]), r["seed"]): fnum(r["trH_test"]) for r in old if r["phase"] == "diagnostics"}
    tight: dict = {}
    for r in old:
        if r["phase"] == "eval" and fnum(r["sigma"]) and fnum(r["Delta"]):
            key = (r["source"], int(r["records"]), float(r["epsilon_target"]), r["method"])
            tight.setdefault(key, []).append(fnum(r["sigma"]) / fnum(r["Delta"]))
    by: dict = {}
    for r in rows:
        by.setdefault((r["dataset"], int(r["records"]), float(r["epsilon_target"]), r["seed"]), {})[r["method"]] = r
    best = {
        k: min(
            (fnum(c[a]["loss_eff"]) for a in BASELINES if a in c and fnum(c[a]["loss_eff"]) is not None), default=None
        )
        for k, c in by.items()
    }
    cells: dict = {}
    for (src, m, eps, seed), c in by.items():
        for a, r in c.items():
            loss, D, sig = fnum(r["loss_eff"]), fnum(r["Delta"]), fnum(r["sigma"])
            b = best[(src, m, eps, seed)]
            cells.setdefault((src, m, eps), {}).setdefault(a, []).append(
                {
                    "loss": loss,
                    "acc": fnum(r["test_accuracy"]),
                    "gap": None if a in BASELINES or loss is None or b is None else loss - b,
                    "bottom": fnum(r["bottom_rate"]),
                    "D": D,
                    "jump": fnum(r["max_jump"]),
                    "iid": fnum(r["max_jump"]) * REG * int(r["users"]) * math.sqrt(m),  # jump / (1/(mu n sqrt m))
                    "dels": fnum(r["deletions"]),
                    "edges": fnum(r["conflict_edges"]),
                    "sig": sig,
                    "ratio": sig / D if sig and D else None,
                    "excess_b": None if b is None else max(b - fnum(r["nonprivate_loss"]), 1e-6),
                    "excess": None if loss is None else max(loss - fnum(r["nonprivate_loss"]), 1e-6),
                    "trh": trh.get((src, m, seed)),
                    "n": int(r["users"]),
                    "outcome": r["outcome"],
                    "s": fnum(r["seconds"]),
                }
            )
    sources = list(dict.fromkeys(k[0] for k in sorted(cells, key=lambda k: (k[1], k[2]))))
    L = [
        "# " + study.option("title", "Paper 002's crossover on the random partition, rerun with today's noise"),
        "",
        f"Regenerate: `fedkl sweep` + `fedkl report {study.path}`. "
        + study.option("data", "fertility-partition (n = 1,000 IID users of m records)")
        + ", δ = 1/n^1.1; means over the seeds run. Output "
        "perturbation runs with `noise = today`: the whole-release profile calibration, Δ chosen privately by the "
        "sparse vector (inside the same ε; mean family: its own diameter threshold), the optimal phase split "
        "(phased-erm), the Newton local solver (mean family); the baselines with stage 1's validation choice. "
        "loss: effective test objective (⊥ counts as log 2); gap: loss − the same seed's best baseline "
        "(negative = output perturbation wins); jump: the measured largest deletion jump ‖θ*(x) − θ*(x₋ᵤ)‖ "
        "(non-private diagnostic); jump/IID: the jump over the IID scale 1/(μ n √m) (the paper's model: a few, "
        "constant in m); deletions (conflict edges): the test's non-private count of deleted users (empty when the "
        "conflicts alone decide ⊥) and of conflicting pairs; σ/Δ tight: the committed table's "
        "(paper002_crossover.csv), same cell.",
        "",
        today_wins(cells),
    ]
    if study.option("conclusion"):
        L += ["", "## Conclusion", "", study.option("conclusion").strip()]
    head = [
        "",
        "| m | ε | algorithm | seeds | loss | accuracy | gap | ⊥ rate | Δ (first release) | jump | jump/IID | Δ/jump | "
        "deletions (conflict edges) | σ | σ/Δ | σ/Δ tight | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for src in sources:
        n_src = next(x["n"] for (s_, _, _), c in cells.items() if s_ == src for rs in c.values() for x in rs)
        L += ["", f"## {src} (n = {n_src})", *head] if len(sources) > 1 else head
        for (s_, m, eps), c in sorted(cells.items(), key=lambda kv: kv[0][1:]):
            if s_ == src:
                L += today_cell_rows(src, m, eps, c, tight)
    L += [
        "",
        "## Forecast crossover m* of sc-output-pert with today's noise (IID model)",
        "",
        "Predicted excess at m_max = σ² tr(H_test)/2; m* = m_max · predicted excess / the best baseline's measured "
        "excess over the non-private optimum (σ² ∝ 1/m, as in `paper002_crossover.md`; means over the seeds). "
        "Public: σ = (σ/Δ)·Δ_uc with the profile calibration's σ/Δ at a fixed Δ (no sparse-vector share; "
        "`fedkl plan` prints the same σ/Δ) and Δ_uc from n, m, G = 1, μ = reg, κ. Chosen Δ: the σ the runs "
        "released with the Δ the sparse vector chose (releases that passed the test only; - where all were ⊥). Measured trend: the least-squares slope of log(sc-output-pert's "
        "measured excess) against log m over the m run (all seeds, ⊥ releases left out), and the m where that line "
        "meets the best "
        "baseline's excess at m_max. The public Δ_uc, σ/Δ and m* are computed on the seeds whose tr(H_test) the "
        "committed table holds (seed 0); m_max is the largest m it holds. Δ_uc is undefined (-) where n < 4κ + 2.",
    ]
    head = [
        "",
        "| ε | m_max | σ/Δ public | Δ_uc | σ/Δ with selection | chosen Δ | jump | best baseline excess | "
        "m* (public Δ_uc) | m* (chosen Δ) | measured slope | m* (measured trend) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for src in sources:
        L += ["", f"### {src}", *head] if len(sources) > 1 else head
        L += today_forecast_rows(src, cells)
    written = []
    if study.options.get("figure"):  # optional: [report] figure = "PATH.png"
        written.append(study.output("figure"))
        today_plot(written[-1], cells, sources)
        L.append(f"\n![{os.path.splitext(os.path.basename(written[-1]))[0]}]({os.path.basename(written[-1])})")
    path = study.output("markdown")
    write_text(path, "\n".join(L) + "\n")
    return [path, *written]


def today_plot(path: str, cells: dict, sources: list[str]) -> None:
    """Test objective (mean over seeds; ⊥ = log 2) against m, one panel per (source, eps): the baselines
    solid, the paper-002 family dashed, the non-private optimum dotted; losses above the top edge drawn
    there as triangles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epsilons = sorted({k[2] for k in cells})
    fig, axes = plt.subplots(
        len(sources), len(epsilons), figsize=(3.6 * len(epsilons), 3.0 * len(sources)), squeeze=False
    )
    algs = list(dict.fromkeys(a for k in sorted(cells) for a in cells[k]))
    colors = dict(zip(algs, plt.cm.tab10.colors))
    top = 0.75  # log 2 = 0.693 is the start point
    for i, src in enumerate(sources):
        for j, eps in enumerate(epsilons):
            ax = axes[i][j]
            ms = sorted(k[1] for k in cells if k[0] == src and k[2] == eps)
            for a in algs:
                pts = [(m, _mean([v["loss"] for v in cells[(src, m, eps)].get(a, [])])) for m in ms]
                pts = [(m, y) for m, y in pts if y is not None]
                if not pts:
                    continue
                x, y = zip(*pts)
                yc = [min(v, top) for v in y]
                base = a in BASELINES
                ax.plot(x, yc, "-" if base else "--", color=colors[a], label=a, lw=2 if base else 1)
                for xi, yi, v in zip(x, yc, y):
                    ax.plot([xi], [yi], "^" if v > top else ("o" if base else "s"), color=colors[a], ms=4)
            _style_axis(ax, f"{src}, eps={eps:g}", first_column=j == 0, last_row=i == len(sources) - 1)
            ax.minorticks_off()
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.set_ylim(top=top + 0.005)
    h, lab = axes[0][0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def today_wins(cells: dict) -> str:
    """The cells (source, m, eps) where a paper-002 algorithm's mean gap to the best baseline is negative, and
    which of them it wins by ⊥ alone (⊥ rate 1: the start point w0 = 0, no model, under the baseline's loss)."""
    wins = []
    for (src, m, eps), c in sorted(cells.items(), key=lambda kv: kv[0][1:]):
        for a in TODAY:
            gap, bottom = (_mean([x[k] for x in c.get(a, [])]) for k in ("gap", "bottom"))
            if gap is not None and gap < 0:
                wins.append(f"{src} m = {m} ε = {eps:g} {a} ({gap:+.3g}{', all ⊥' if bottom == 1 else ''})")
    head = f"Cells where a paper-002 algorithm's mean gap is negative: {len(wins)} of {len(cells)} (source, m, ε) cells"
    return head + (": " + "; ".join(wins) + "." if wins else ".")


def today_cell_rows(src: str, m: int, eps: float, c: dict, tight: dict) -> list[str]:
    """``today_report``'s rows of one (source, m, eps) cell: every algorithm run, means over the seeds."""
    out = []
    for a in (*BASELINES, *TODAY):
        if a not in c:
            continue
        rs = c[a]
        keys = ("loss", "acc", "gap", "bottom", "D", "jump", "iid", "dels", "edges", "sig", "ratio", "s")
        mu = {k: _mean([x[k] for x in rs]) for k in keys}
        bad = sorted({x["outcome"] for x in rs} - {"ok", "bottom"})
        label = f"{a} ({', '.join(bad)})" if bad else a
        dels = "-" if mu["dels"] is None and mu["edges"] is None else f"{fmt(mu['dels'], 3)} ({fmt(mu['edges'], 4)})"
        out.append(
            f"| {m} | {eps:g} | {label} | {len(rs)} | {fmt(mu['loss'])} | {fmt(mu['acc'])} | {fmt(mu['gap'], 3)} | "
            f"{fmt(mu['bottom'], 2)} | {fmt(mu['D'], 3)} | {fmt(mu['jump'], 3)} | {fmt(mu['iid'], 2)} | "
            f"{fmt(mu['D'] / mu['jump'] if mu['D'] and mu['jump'] else None, 3)} | {dels} | {fmt(mu['sig'], 3)} | "
            f"{fmt(mu['ratio'], 3)} | {fmt(_mean(tight.get((src, m, eps, a), [])), 3)} | {fmt(mu['s'], 3)} |"
        )
    return out


def today_forecast_rows(src: str, cells: dict) -> list[str]:
    """``today_report``'s forecast rows of one source: per eps at the largest m whose tr(H_test) the committed
    table holds."""
    out = []
    m_max = max((k[1] for k, c in cells.items() if k[0] == src and any(x["trh"] for rs in c.values() for x in rs)),
                default=None)  # fmt: skip
    for (s_, m, eps), c in sorted(cells.items(), key=lambda kv: kv[0][1:]):
        rs = [x for x in c.get("sc-output-pert", []) if x["sig"] and x["excess_b"] and x["trh"]]
        if s_ != src or m != m_max or not rs:
            continue
        n = rs[0]["n"]
        delta = 1 / n**1.1
        pub = profile_calibration(eps, delta).sigma_over_Delta
        try:
            Du = delta_union_bound(1.0, REG, n, m, kappa(eps, delta), 1.0 / (2 * n**2 * m))
        except ValueError:  # n < 4 kappa + 2
            Du = None
        trh_m, excess_b = _mean([x["trh"] for x in rs]), _mean([x["excess_b"] for x in rs])
        ok = [x for x in rs if x["outcome"] == "ok"]  # the chosen Delta of a ⊥ release never made a model
        sig = _mean([x["sig"] for x in ok])
        m_pub = None if Du is None else m * 0.5 * (pub * Du) ** 2 * trh_m / excess_b
        m_priv = None if sig is None else m * 0.5 * sig**2 * trh_m / excess_b
        pts = [(math.log(mm), math.log(x["excess"])) for (s2, mm, e), cc in cells.items() if s2 == src and e == eps
               for x in cc.get("sc-output-pert", []) if x["excess"] and x["outcome"] == "ok"]  # fmt: skip
        slope, icpt = np.polyfit(*zip(*pts), 1) if len({p[0] for p in pts}) > 1 else (None, None)
        m_fit = math.exp((math.log(excess_b) - icpt) / slope) if slope and slope < 0 else None
        out.append(
            f"| {eps:g} | {m} | {fmt(pub, 3)} | {fmt(Du, 3)} | {fmt(_mean([x['ratio'] for x in rs]), 3)} | "
            f"{fmt(_mean([x['D'] for x in ok]), 3)} | {fmt(_mean([x['jump'] for x in rs]), 3)} | {fmt(excess_b, 3)} | "
            f"{fmt(m_pub, 2)} | {fmt(m_priv, 2)} | {fmt(slope, 3)} | {'-' if m_fit is None else f'{m_fit:.2g}'} |"
        )
    return out
