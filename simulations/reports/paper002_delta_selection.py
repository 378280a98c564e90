"""Report of simulations/studies/paper002_delta_selection.toml: per (m, eps, variant) the mean over seeds of
the test objective, the Delta the release used and its noise sigma, and the reading. Run by
``fedkl report simulations/studies/paper002_delta_selection.toml``."""

from __future__ import annotations

import statistics

from fedkl.experiments.plot import write_text


def _num(text: str) -> float | None:
    return None if text in ("", None) else float(text)


def markdown(rows: list[dict]) -> str:
    order = list(dict.fromkeys(r["variant"] for r in rows))
    lines = [
        "# sc-output-pert with a privately chosen Delta (fertility-partition, n = 1000)",
        "",
        "Regenerate: `fedkl sweep` + `fedkl report simulations/studies/paper002_delta_selection.toml`. Mean over "
        "seeds of the test objective (per-user mean log-loss + reg/2 ||w||^2 on held-out records; lower is "
        "better; evaluation only, not private), the Delta the release used and its noise sigma per coordinate.",
        "",
        "| m | eps | variant | test loss | Delta | sigma | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(int(r["records"]), float(r["epsilon_target"]), r["variant"]) for r in rows},
        key=lambda k: (k[0], k[1], order.index(k[2])),
    )
    for m, eps, variant in keys:
        group = [r for r in rows if (int(r["records"]), float(r["epsilon_target"]), r["variant"]) == (m, eps, variant)]
        losses = [_num(r["test_loss"]) for r in group if _num(r["test_loss"]) is not None]
        deltas = [_num(r["Delta"]) for r in group if _num(r["Delta"]) is not None]
        sigmas = [_num(r["sigma"]) for r in group if _num(r["sigma"]) is not None]
        fmt = lambda xs: f"{statistics.mean(xs):.4g}" if xs else "-"  # noqa: E731
        lines.append(f"| {m} | {eps:g} | {variant} | {fmt(losses)} | {fmt(deltas)} | {fmt(sigmas)} | {len(group)} |")
    lines += [
        "",
        "Reading: the sparse vector picks the smallest grid Delta whose diameter-test deletion score is "
        "near zero: 2-4x below Delta_uc here (Delta_uc/4 in most runs), cutting sigma 2-3x (the selection's share of eps "
        "costs back 4/3). It is not the measured deletion jump (~1/80 of Delta_uc, "
        "paper002_crossover.md): the diameter test certifies a deletion only through the users' local "
        "minimizers' diameter, a factor (L/mu)^2 = 12 above the jump for logistic loss at reg 0.1. "
        "The whole-release profile calibration (fedkl's default) cuts sigma by a further ~2.6x at the same "
        "Delta. DP-FedAvg, within 1e-4 of the non-private objective at these m, still wins.",
    ]
    return "\n".join(lines) + "\n"


def report(study) -> list[str]:
    path = study.output("markdown")
    write_text(path, markdown(study.rows))
    return [path]
