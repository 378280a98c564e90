"""Report of simulations/studies/paper002_sc_compare.toml: SCOutputPert against noisy clipped-gradient
descent and the global-sensitivity output perturbation on synthetic least squares (tables by m, the
certificate's outcomes, the fitted slope in m and the extrapolated crossovers) and on MovieLens (every
configuration, the references), the conclusion paragraph and the figure. Run by
``fedkl report simulations/studies/paper002_sc_compare.toml``."""

from __future__ import annotations

import math
import os

import numpy as np

from fedkl.experiments.report import load_function

# the log-log fit of the slopes study's report (loaded by path, as fedkl report loads both)
fit_slope = load_function(os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper002_slopes.py:fit_slope"))
SYNTHETIC = "synthetic-least-squares"


def _num(text: str) -> float:
    return math.nan if text in ("", None) else float(text)


def _row(r: dict) -> dict:
    """A table row as the analysis reads it: setting, n, m, seed, eps, method, config, status, sigma and
    the metric (excess risk on synthetic data, test accuracy on MovieLens)."""
    synthetic = r["dataset"] == SYNTHETIC
    method = r["method"] if r["algorithm"] == "paper002-sc-compare" else r["algorithm"]
    a, clip, rounds = float(r["delta_scale"]), float(r["clip"]), int(r["rounds"])
    if method == "noisy-gd":
        config = f"C={clip:g},T={rounds}" + ("" if synthetic else f",lr={float(r['lr']):g}")
    elif method == "sc-output-pert":
        config = f"a={a:g}" if synthetic else f"mu={float(r['reg']):g},b={a:g}"
    else:
        config = "" if synthetic else f"mu={float(r['reg']):g}"
    out = {
        "setting": "synthetic" if synthetic else "movielens",
        "n": int(r["users"]),
        "m": int(r["records"]) if synthetic else math.nan,
        "seed": int(r["seed"]),
        "eps": float(r["epsilon_target"]),
        "delta": float(r["delta"]),
        "method": method,
        "config": config,
        "status": r["outcome"] if method != "noisy-gd" or synthetic else "private run (run_training)",
        "sigma": _num(r["sigma_sum"] if r["algorithm"] == "noisy-gd" else r["sigma"]),
        "Delta": _num(r.get("Delta", "")),
    }
    if synthetic:
        out["excess_risk"] = float(r["excess_risk"])
    else:
        out["test_accuracy"] = _num(r["test_metric"] if r["algorithm"] == "noisy-gd" else r["test_accuracy"])
    return out


def analyse(rows: list[dict]) -> dict:
    """The study's rows as the script's result: config (the grids, read from the rows), synthetic and
    MovieLens rows, the MovieLens references and the crossover fit."""
    syn = [_row(r) for r in rows if r["dataset"] == SYNTHETIC]
    ml_rows = [r for r in rows if r["dataset"] == "movielens"]
    ml = [_row(r) for r in ml_rows if r["algorithm"] == "noisy-gd" or r["method"] != "nonprivate-ridge"]
    gd = [r for r in ml_rows if r["algorithm"] == "noisy-gd"]
    ridge = [r for r in ml_rows if r["algorithm"] != "noisy-gd" and r["method"] == "nonprivate-ridge"]
    sc = [r for r in ml if r["method"] == "sc-output-pert"]
    grid = lambda key, sel: sorted({x[key] for x in sel}, key=float)  # noqa: E731
    reg = float(ridge[0]["reg"]) if ridge else float(sc[0]["config"].split(",")[0][3:])
    cfg = {
        "tag": "full",
        "n": syn[0]["n"],
        "d": int(next(r["d"] for r in rows if r["dataset"] == SYNTHETIC)),
        "reg": float(next(r["reg"] for r in rows if r["dataset"] == SYNTHETIC)),
        "eps": syn[0]["eps"],
        "delta": syn[0]["delta"],
        "seeds": len({x["seed"] for x in syn}),
        "m_grid": grid("m", syn),
        "a_grid": sorted({float(x["config"][2:]) for x in syn if x["method"] == "sc-output-pert"}, reverse=True),
        "clip_grid": sorted(
            {float(x["config"].split(",")[0][2:]) for x in syn if x["method"] == "noisy-gd"}, reverse=True
        ),
        "ml_reg": reg,
        "ml_eps": grid("eps", ml),
    }
    refs = {
        "nonprivate_accuracy": float(np.mean([float(r["reference_metric"]) for r in gd])),
        f"ridge_mu{reg:g}_nonprivate_accuracy": float(np.mean([float(r["test_accuracy"]) for r in ridge])),
        "majority_baseline": float(np.mean([float(r["trivial_metric"]) for r in gd])),
        "users": ml[0]["n"],
        "delta": ml[0]["delta"],
        "sigma_over_Delta": {
            str(e): float(np.mean([x["sigma"] / x["Delta"] for x in sc if x["eps"] == e])) for e in cfg["ml_eps"]
        },
    }
    result = {"config": cfg, "synthetic": syn, "movielens": ml, "movielens_refs": refs}
    result["crossover"] = crossover(syn, cfg)
    return result


def report(study) -> list[str]:
    result = analyse(study.rows)
    md, fig = study.output("markdown"), study.output("figure")
    with open(md, "w") as fh:
        fh.write(markdown(result))
    plot(result, fig)
    return [md, fig]


def best_by_config(rows: list[dict], method: str, m: int, key: str = "excess_risk") -> tuple[str, float, float] | None:
    """(config, mean, sd) of the method's best configuration at m over the seeds; configurations with
    an undetermined seed are skipped (their mean is unknown)."""
    best = None
    for conf in sorted({r["config"] for r in rows if r["method"] == method}):
        sel = [r for r in rows if r["method"] == method and r["m"] == m and r["config"] == conf]
        if not sel or any(r["status"] == "undetermined" for r in sel):
            continue
        v = np.array([r[key] for r in sel])
        if best is None or v.mean() < best[1]:
            best = (conf, float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0)
    return best


# --- analysis and outputs ------------------------------------------------------------------------
def crossover(rows: list[dict], cfg: dict) -> dict:
    """Fit log excess vs log m for sc-output-pert at a = 1 and extrapolate where it meets the best
    noisy-GD value at the largest m (noisy GD's error does not fall with m: its noise is set by C)."""
    sel = [r for r in rows if r["method"] == "sc-output-pert" and r["config"] == "a=1" and r["status"] == "certified"]
    f = fit_slope([r["m"] for r in sel], [r["excess_risk"] for r in sel])
    gd = best_by_config(rows, "noisy-gd", max(cfg["m_grid"]))
    gs = [r for r in rows if r["method"] == "global-sens-law" and r["m"] == max(cfg["m_grid"])]
    out = {
        "sc_a1_slope_in_m": f["slope"],
        "sc_a1_slope_se": f["se"],
        "noisy_gd_best_at_max_m": gd[1],
        "noisy_gd_best_config": gd[0],
    }
    out["m_star_vs_noisy_gd"] = (
        math.exp((math.log(gd[1]) - f["intercept"]) / f["slope"]) if f["slope"] < 0 else math.inf
    )
    gsv = float(np.mean([r["excess_risk"] for r in gs]))
    out["m_star_vs_global_sens"] = (
        math.exp((math.log(gsv) - f["intercept"]) / f["slope"]) if f["slope"] < 0 else math.inf
    )
    gd_sel = [r for r in rows if r["method"] == "noisy-gd" and r["config"] == gd[0]]
    out["noisy_gd_best_config_slope_in_m"] = fit_slope([r["m"] for r in gd_sel], [r["excess_risk"] for r in gd_sel])[
        "slope"
    ]
    return out


def summarize(rows: list[dict], metric: str, keys=("setting", "eps", "m", "method", "config")) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for k, sel in groups.items():
        ok = [r for r in sel if r["status"] != "undetermined"]
        v = np.array([r[metric] for r in ok], float)
        out.append(
            {
                **dict(zip(keys, k)),
                "runs": len(sel),
                "determined": len(ok),
                "mean": float(v.mean()) if len(ok) == len(sel) else math.nan,
                "sd": float(v.std(ddof=1)) if len(ok) == len(sel) and len(v) > 1 else math.nan,
                "sigma": float(np.mean([r["sigma"] for r in sel])),
            }
        )
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    syn, ml, refs = result["synthetic"], result["movielens"], result["movielens_refs"]
    L = [
        "# Paper 002: output perturbation vs noisy clipped-gradient descent",
        "",
        "Regenerate: `fedkl sweep` + `fedkl report simulations/studies/paper002_sc_compare.toml`. All methods at the "
        "same user-level (ε, δ), replace-one. Hyperparameters from small public grids; 'best' = best mean over seeds "
        "(tuning is not private; it favours both methods equally). A seed is a new dataset (synthetic draw, MovieLens "
        "split) and new noise, shared by every method.",
        "",
        f"## Synthetic least squares (IID users, n = {cfg['n']}, d = {cfg['d']}, μ = {cfg['reg']}, "
        f"(ε, δ) = ({cfg['eps']}, {cfg['delta']:g}), {cfg['seeds']} seeds)",
        "",
        "Excess empirical risk F(θ̂) − F(θ*) of the ridge objective (mean ± sd over seeds).",
        "",
        "| m | sc-output-pert a=1 | sc-output-pert best (a) | noisy-gd best (C, T) | noisy-gd C=1 best T | "
        "global-sens law | winner |",
        "|---|---|---|---|---|---|---|",
    ]
    s = summarize(syn, "excess_risk")
    for m in cfg["m_grid"]:

        def pick(method, conf=None, prefix=None):
            cands = [
                x
                for x in s
                if x["m"] == m
                and x["method"] == method
                and (conf is None or x["config"] == conf)
                and (prefix is None or x["config"].startswith(prefix))
            ]
            cands = [x for x in cands if not math.isnan(x["mean"])]
            return min(cands, key=lambda x: x["mean"]) if cands else None

        def fmt(x, show=False):
            if x is None:
                return "undetermined"
            return f"{x['mean']:.3g} ± {x['sd']:.2g}" + (f" ({x['config']})" if show else "")

        a1, sc, gd, gd1, gs = (
            pick("sc-output-pert", "a=1"),
            pick("sc-output-pert"),
            pick("noisy-gd"),
            pick("noisy-gd", prefix="C=1,"),
            pick("global-sens-law"),
        )
        contenders = {"sc-output-pert": sc, "noisy-gd": gd, "global-sens law": gs}
        winner = min((k for k, v in contenders.items() if v), key=lambda k: contenders[k]["mean"])
        L.append(f"| {m} | {fmt(a1)} | {fmt(sc, True)} | {fmt(gd, True)} | {fmt(gd1, True)} | {fmt(gs)} | {winner} |")
    L += [
        "",
        "Certificate outcomes of sc-output-pert (certified runs / runs):",
        "",
        "| m | " + " | ".join(f"a={a:g}" for a in cfg["a_grid"]) + " |",
        "|---|" + "---|" * len(cfg["a_grid"]),
    ]
    for m in cfg["m_grid"]:
        cells = []
        for a in cfg["a_grid"]:
            x = [r for r in syn if r["m"] == m and r["method"] == "sc-output-pert" and r["config"] == f"a={a:g}"]
            cells.append(f"{sum(r['status'] == 'certified' for r in x)}/{len(x)}")
        L.append(f"| {m} | " + " | ".join(cells) + " |")
    ridge_acc = refs.get("ridge_mu%g_nonprivate_accuracy" % cfg["ml_reg"], math.nan)
    L += [
        "",
        f"## MovieLens ({refs['users']} raters, logistic regression, test accuracy, mean ± sd over seeds)",
        "",
        f"δ = 1/n^1.1 = {refs['delta']:.3g}. Non-private (mean over the splits): unregularized {refs.get('nonprivate_accuracy', math.nan):.4f}, "
        f"ridge μ = {cfg['ml_reg']} {ridge_acc:.4f}; "
        f"majority class {refs['majority_baseline']:.4f}. σ/Δ of sc-output-pert: "
        + ", ".join(f"{v:.1f} at ε = {k}" for k, v in refs["sigma_over_Delta"].items())
        + ".",
        "",
        "| ε | method | configuration | test accuracy | certified | noise σ |",
        "|---|---|---|---|---|---|",
    ]
    for x in sorted(summarize(ml, "test_accuracy"), key=lambda x: (x["eps"], x["method"], x["config"])):
        acc = "undetermined" if math.isnan(x["mean"]) else f"{x['mean']:.4f} ± {x['sd']:.4f}"
        cert = f"{x['determined']}/{x['runs']}" if x["method"] == "sc-output-pert" else "–"
        L.append(f"| {x['eps']:g} | {x['method']} | {x['config']} | {acc} | {cert} | {x['sigma']:.3g} |")
    L += ["", "## Who wins where, and why", "", conclusion(result), ""]
    return "\n".join(L)


def conclusion(result: dict) -> str:
    cfg, cross = result["config"], result["crossover"]
    syn = result["synthetic"]
    ratio = np.mean([r["sigma"] / r["Delta"] for r in syn if r["method"] == "sc-output-pert"])
    ml = summarize(result["movielens"], "test_accuracy")

    def best_ml(method, eps):
        c = [x for x in ml if x["method"] == method and x["eps"] == eps and not math.isnan(x["mean"])]
        return max(c, key=lambda x: x["mean"]) if c else None

    ml_txt = []
    for eps in cfg["ml_eps"]:
        sc, gd, gs = best_ml("sc-output-pert", eps), best_ml("noisy-gd", eps), best_ml("global-sens-law", eps)
        ml_txt.append(
            f"at ε = {eps:g}: noisy GD {gd['mean']:.3f}, global-sensitivity output perturbation "
            f"{gs['mean']:.3f}, SCOutputPert {sc['mean']:.3f}"
            if sc
            else f"at ε = {eps:g}: noisy GD {gd['mean']:.3f}, SCOutputPert undetermined"
        )
    return (
        f"**Synthetic (IID users).** SCOutputPert's error falls with m as theory says: with a = 1 its excess risk has "
        f"slope {cross['sc_a1_slope_in_m']:.2f} ± {cross['sc_a1_slope_se']:.2f} in m (theory −1, i.e. ‖θ̂−θ*‖ ∝ "
        f"1/√m), because its threshold Δ ∝ G/(μn√m) is justified by deletion stability (the measured certificate "
        f"bound falls like 1/√m). Noisy GD's noise is set by the clip C, not by m: its best configuration "
        f"({cross['noisy_gd_best_config']}) has slope {cross['noisy_gd_best_config_slope_in_m']:.2f} in m. Yet noisy "
        f"GD wins at every m we can afford here, by orders of magnitude: SCOutputPert pays σ/Δ ≈ {ratio:.0f} "
        f"(the TDLap deletion budget κ = 8 enters the sensitivity as (4κ+1)Δ, then the Gaussian at (ε/2, δ̄)), and "
        f"Δ must use the worst-case Lipschitz constant G of the ridge problem, while noisy GD's clip can sit at the "
        f"users' actual gradient scale and its noise is averaged over n users and damped by the step. Extrapolating "
        f"the a = 1 fit, SCOutputPert would match the best noisy GD at m ≈ {cross['m_star_vs_noisy_gd']:.2g} records "
        f"per user and the classic global-sensitivity output perturbation (θ* + N(0, s²I), sensitivity 2G/(μn)) at "
        f"m ≈ {cross['m_star_vs_global_sens']:.2g}; a smaller public a (0.3, 0.1) shrinks the noise but the "
        f"certificate then fails at small m (table above: 'undetermined' = the exact test would have to decide, "
        f"which is infeasible at n = {cfg['n']}). The brief's expectation that noisy GD stops improving once its "
        f"clip binds is borne out only in the sense that its error is flat in m; clipping does not bind here "
        f"because IID users' gradients shrink towards the optimum, so noisy GD is never hurt by it. "
        f"**MovieLens (heterogeneous raters, median 57 ratings).** "
        + "; ".join(ml_txt)
        + ". Heterogeneous users make the deletion stability Θ(G/(μn)) with no √m gain "
        "(note §6.13), so SCOutputPert keeps its κ-inflated noise without the benefit; it needs b ≳ 0.3 for "
        "the certificate to pass at all. Noisy GD (and, at large ε, plain output perturbation) win on real "
        "user-partitioned data. The deletion-based mechanism is a large-m, IID-users tool: it wins only beyond "
        "the extrapolated crossover, consistent with the note's §4 estimate (m* of order 1e3–1e6 items per user)."
    )


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, syn, ml = result["config"], result["synthetic"], result["movielens"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    ax = axes[0]
    s = summarize(syn, "excess_risk")
    ms = np.array(cfg["m_grid"], float)
    for i, a in enumerate(cfg["a_grid"]):
        y = np.array([next(x["mean"] for x in s if x["m"] == m and x["config"] == f"a={a:g}") for m in cfg["m_grid"]])
        ax.loglog(ms, y, "o-", color=f"C{i}", label=f"SCOutputPert a={a:g} (missing = certificate failed)")
    for j, clip in enumerate(cfg["clip_grid"]):
        y = []
        for m in cfg["m_grid"]:
            c = [
                x["mean"]
                for x in s
                if x["m"] == m and x["method"] == "noisy-gd" and x["config"].startswith(f"C={clip:g},")
            ]
            y.append(min(c))
        ax.loglog(ms, y, "s--", color=f"C{j + 4}", label=f"noisy GD C={clip:g} (best T)")
    y = [next(x["mean"] for x in s if x["m"] == m and x["method"] == "global-sens-law") for m in cfg["m_grid"]]
    ax.loglog(ms, y, "^:", color="k", label="global-sensitivity output pert. (law)")
    ax.set_xlabel("records per user m")
    ax.set_ylabel("excess empirical risk F(θ̂) − F(θ*)")
    ax.set_title(f"synthetic least squares, n = {cfg['n']}, (ε, δ) = ({cfg['eps']}, {cfg['delta']:g})", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    sm = summarize(ml, "test_accuracy")
    labels = sorted({(x["method"], x["config"]) for x in sm})
    width = 0.8 / len(cfg["ml_eps"])
    for k, eps in enumerate(cfg["ml_eps"]):
        vals = []
        for meth, conf in labels:
            x = next(x for x in sm if x["eps"] == eps and x["method"] == meth and x["config"] == conf)
            vals.append(0.0 if math.isnan(x["mean"]) else x["mean"])
        ax.barh(np.arange(len(labels)) + k * width, vals, height=width, label=f"ε = {eps:g}")
    refs = result["movielens_refs"]
    ax.axvline(refs.get("nonprivate_accuracy", math.nan), color="k", ls="--", lw=1, label="non-private")
    ax.axvline(refs["majority_baseline"], color="gray", ls=":", lw=1, label="majority class")
    ax.set_yticks(np.arange(len(labels)) + width * (len(cfg["ml_eps"]) - 1) / 2)
    ax.set_yticklabels([f"{meth}\n{conf}" for meth, conf in labels], fontsize=7)
    ax.set_xlim(0.45, 0.72)
    ax.set_xlabel("test accuracy (0 = undetermined)")
    ax.set_title(f"MovieLens, {refs['users']} users, δ = {refs['delta']:.2g}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
