"""Report of simulations/studies/mean_output_pert_movielens.toml: test accuracy (mean ± population std over
the noise seeds), ⊥ rate per release and the users the diameter test deleted (non-private diagnostics,
read from each run's result). Run by ``fedkl report simulations/studies/mean_output_pert_movielens.toml``."""

from __future__ import annotations

import numpy as np


def _value(text: str, kind=float):
    return kind(text) if text != "" else None


def diagnostics(row: dict, result: dict) -> dict:
    """Phases, ⊥ count and deleted users of one run (server-side, not private)."""
    d = result.get("algorithm_details") or {}
    deleted = (d.get("nonprivate_diagnostics") or {}).get("deleted_users")
    if row["algorithm"] == "mean-output-pert":
        return {"phases": 1, "bottoms": int(bool(d.get("bottom"))), "deleted": [deleted]}
    if row["algorithm"] == "phased-mean-output-pert":
        return {"phases": int(row["mean_phases"]), "bottoms": int(d["bottoms"]), "deleted": deleted}
    return {"phases": None, "bottoms": 0, "deleted": None}


def report(study) -> list[str]:
    rows = study.rows
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for r in rows:
        g = diagnostics(r, study.result(r))
        rho = _value(r["mean_rho_fraction"]) if r["algorithm"] != "averaging+gaussian" else None
        groups.setdefault((r["algorithm"], _value(r["mean_lam"]), rho, g["phases"]), []).append((r, g))
    (eps,) = {float(r["epsilon_target"]) for r in rows}
    (delta,) = {float(r["delta"]) for r in rows}
    seeds = len({r["noise_seed"] for r in rows})
    lines = [
        f"# MeanOutputPert on MovieLens ({rows[0]['users']} users, logistic), eps = {eps:g}, delta = {delta:.3g}, "
        f"{seeds} noise seeds",
        "",
        "| method | lam | rho_fraction | T | test accuracy (mean ± std) | ⊥ rate (per release) "
        "| deleted users (non-private) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (method, lam, frac, phases), rs in groups.items():
        accs = [float(r["test_metric"]) for r, _ in rs if r["test_metric"] != ""]
        acc = "n/a" if not accs else f"{float(np.mean(accs)):.4f} ± {float(np.std(accs)):.4f}"
        rate = sum(g["bottoms"] for _, g in rs) / sum(g["phases"] or 1 for _, g in rs)
        deleted = [g["deleted"] for _, g in rs]
        lines.append(f"| {method} | {lam} | {frac} | {phases} | {acc} | {rate:.2f} | {deleted} |")
    (trivial,) = {float(r["trivial_metric"]) for r in rows if r["trivial_metric"] != ""}
    lines += ["", f"Trivial (majority) accuracy: {trivial:.4f}."]
    path = study.output("markdown")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return [path]
