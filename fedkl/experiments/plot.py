"""Plots and summary tables of a result table: ``fedkl plot TABLE.csv --kind privacy-utility|slope``.

PNG figures (matplotlib, Agg): ``privacy-utility``, the test metric against epsilon, mean ± std over
seeds, one line per algorithm and one panel per dataset (with the non-private reference and the
trivial baseline); or ``slope``, a log-log plot of an error column (default ``excess_loss``) against
``users``, with the least-squares slope of each line and the theory slope drawn. ``--markdown``
writes the numbers as a table. Only rows with status ``ok`` are drawn.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from fedkl.experiments.config import ConfigError
from fedkl.experiments.table import check_unique, read_table
from fedkl.results import pyplot, savefig


def _num(v: Any) -> float | None:
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def filter_rows(rows: list[dict], where: Sequence[str] = ()) -> list[dict]:
    """Rows with status ok (or no status column) matching every ``KEY=VALUE`` of ``where``."""
    conds = []
    for item in where:
        if "=" not in item:
            raise ConfigError(f"--where {item!r}: expected COLUMN=VALUE")
        k, v = item.split("=", 1)
        conds.append((k.strip(), v.strip()))
    if rows:
        for k, _ in conds:
            if k not in rows[0]:
                raise ConfigError(f"--where: no column {k!r} in the table (columns: {', '.join(rows[0])})")
    out = []
    for r in rows:
        if r.get("status", "ok") != "ok":
            continue
        if all(
            r.get(k) == v or (_num(r.get(k)) is not None and _num(v) is not None and _num(r.get(k)) == _num(v))
            for k, v in conds
        ):
            out.append(r)
    return out


def _order(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(rows: list[dict], x: str, y: str, group: str, panel: str | None) -> dict:
    """``{panel: {group: [(x, mean, std, count), ...]}}`` over the rows with numeric x and y."""
    out: dict[str, dict[str, list[tuple[float, float, float, int]]]] = {}
    panels = _order(r.get(panel, "") for r in rows) if panel else [""]
    for p in panels:
        sub = [r for r in rows if not panel or r.get(panel, "") == p]
        groups = _order(r.get(group, "") for r in sub)
        out[p] = {}
        for g in groups:
            pts: dict[float, list[float]] = {}
            for r in sub:
                if r.get(group, "") != g:
                    continue
                xv, yv = _num(r.get(x)), _num(r.get(y))
                if xv is None or yv is None:
                    continue
                pts.setdefault(xv, []).append(yv)
            out[p][g] = [(xv, *mean_std(vs), len(vs)) for xv, vs in sorted(pts.items())]
    return out


def _panel_constant(rows: list[dict], panel: str | None, p: str, column: str) -> float | None:
    vals = [_num(r.get(column)) for r in rows if (not panel or r.get(panel, "") == p)]
    vals = [v for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None


def plot_privacy_utility(
    rows: list[dict],
    out: str,
    *,
    x: str = "epsilon_target",
    y: str = "test_metric",
    group: str = "algorithm",
    panel: str | None = "dataset",
    title: str | None = None,
    log_x: bool = True,
) -> dict:
    """Test metric vs epsilon: mean ± std over the rows at each x (the seeds), one line per group,
    one panel per ``panel`` value, with the mean non-private reference and trivial baseline."""
    if not rows:
        raise ConfigError("no rows to plot (empty table, or every row filtered out / failed)")
    summary = summarize(rows, x, y, group, panel)
    plt = pyplot()
    panels = list(summary)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
    metric = _order(r.get("metric", "") for r in rows)
    ylabel = f"test {metric[0]}" if y == "test_metric" and len(metric) == 1 and metric[0] else y
    for ax, p in zip(axes[0], panels):
        for g, pts in summary[p].items():
            if not pts:
                continue
            ax.errorbar(
                [q[0] for q in pts], [q[1] for q in pts], yerr=[q[2] for q in pts], marker="o", capsize=3, label=g
            )
        if y == "test_metric":
            ref = _panel_constant(rows, panel, p, "reference_metric")
            if ref is not None:
                ax.axhline(ref, color="k", ls="--", lw=1, label="non-private")
            triv = _panel_constant(rows, panel, p, "trivial_metric")
            if triv is not None:
                ax.axhline(triv, color="grey", ls=":", lw=1, label="trivial baseline")
        if log_x:
            ax.set_xscale("log", base=2)
            ticks = sorted({q[0] for pts in summary[p].values() for q in pts if q[0] > 0})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel("user-level ε" if x.startswith("epsilon") else x)
        users = _order(r.get("users", "") for r in rows if not panel or r.get(panel, "") == p)
        ax.set_title(f"{p} ({users[0]} users)" if p and len(users) == 1 and users[0] else (p or title or ""))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    savefig(fig, out)
    plt.close(fig)
    return summary


def fit_loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``log y = a + b log x``: returns (b, a). Needs two or more distinct x > 0, y > 0."""
    pts = [(math.log(a), math.log(b)) for a, b in zip(xs, ys) if a > 0 and b > 0]
    if len({p[0] for p in pts}) < 2:
        raise ConfigError("a slope needs positive values at two or more distinct x")
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    return b, my - b * mx


def plot_slope(
    rows: list[dict],
    out: str,
    *,
    x: str = "users",
    y: str = "excess_loss",
    group: str = "algorithm",
    theory_slope: float | None = None,
    theory_label: str = "theory",
    title: str | None = None,
) -> dict:
    """Log-log plot of mean ``y`` (over seeds) against ``x`` per group, with the fitted slope of each
    line and the theory slope drawn through the data's log-centroid. Returns
    ``{group: {"slope", "intercept", "points": [(x, mean, std, n)], "dropped": k}}``: a point with a
    non-positive mean cannot be drawn on log axes and is dropped (and counted)."""
    if not rows:
        raise ConfigError("no rows to plot (empty table, or every row filtered out / failed)")
    summary = summarize(rows, x, y, group, None)[""]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 4.0))
    fits: dict[str, dict] = {}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for idx, (g, pts) in enumerate(summary.items()):
        good = [q for q in pts if q[0] > 0 and q[1] > 0]
        if len({q[0] for q in good}) < 2:
            continue
        b, a = fit_loglog_slope([q[0] for q in good], [q[1] for q in good])
        fits[g] = {"slope": b, "intercept": a, "points": pts, "dropped": len(pts) - len(good)}
        color = colors[idx % len(colors)]
        ax.errorbar(
            [q[0] for q in good],
            [q[1] for q in good],
            yerr=[min(q[2], q[1] * 0.999) for q in good],
            fmt="o",
            color=color,
            capsize=3,
        )
        xs = [min(q[0] for q in good), max(q[0] for q in good)]
        ax.plot(xs, [math.exp(a) * v**b for v in xs], "-", color=color, label=f"{g}: fitted slope {b:.2f}")
        if theory_slope is not None:
            lx = statistics.fmean(math.log(q[0]) for q in good)
            ly = statistics.fmean(math.log(q[1]) for q in good)
            ax.plot(
                xs,
                [math.exp(ly + theory_slope * (math.log(v) - lx)) for v in xs],
                "--",
                color=color,
                alpha=0.6,
                label=f"{theory_label} slope {theory_slope:g}",
            )
    if not fits:
        raise ConfigError(f"no group has positive mean {y!r} at two or more {x!r} values: nothing to fit")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    savefig(fig, out)
    plt.close(fig)
    return fits


def markdown_privacy_utility(
    rows: list[dict],
    summary: dict,
    *,
    x: str = "epsilon_target",
    y: str = "test_metric",
    group: str = "algorithm",
    panel: str | None = "dataset",
    digits: int = 3,
) -> str:
    """The privacy-utility numbers as a markdown table: one row per (panel, group), one column per x."""
    xs = sorted({q[0] for groups in summary.values() for pts in groups.values() for q in pts})
    head = (
        f"| {panel or ''} | {group} | "
        + " | ".join(f"ε = {v:g}" if x.startswith("epsilon") else f"{x} = {v:g}" for v in xs)
        + " |"
    )
    lines = [head, "|" + "---|" * (2 + len(xs))]
    for p, groups in summary.items():
        users = _order(r.get("users", "") for r in rows if not panel or r.get(panel, "") == p)
        label = f"{p} ({users[0]} users)" if p and len(users) == 1 and users[0] else p
        for g, pts in groups.items():
            by_x = {q[0]: q for q in pts}
            cells = [
                f"{by_x[v][1]:.{digits}f} ± {by_x[v][2]:.{digits}f} (n={by_x[v][3]})" if v in by_x else "—" for v in xs
            ]
            lines.append(f"| {label} | {g} | " + " | ".join(cells) + " |")
        if y == "test_metric":
            for name, col in (("non-private reference", "reference_metric"), ("trivial baseline", "trivial_metric")):
                m = _panel_constant(rows, panel, p, col)
                if m is not None:
                    lines.append(f"| {label} | {name} | " + " | ".join([f"{m:.{digits}f}"] * len(xs)) + " |")
    return "\n".join(lines) + "\n"


def markdown_slope(fits: dict, *, x: str, y: str, group: str, theory_slope: float | None) -> str:
    """The fitted slopes of :func:`plot_slope` as a markdown table."""
    lines = [f"| {group} | fitted slope of {y} vs {x} | theory slope | points |", "|---|---|---|---|"]
    for g, fit in fits.items():
        pts = ", ".join(f"{q[0]:g}: {q[1]:.3g}" for q in fit["points"])
        lines.append(f"| {g} | {fit['slope']:.3f} | {theory_slope if theory_slope is not None else '—'} | {pts} |")
    return "\n".join(lines) + "\n"


def plot_table(
    table: str,
    kind: str,
    out: str,
    *,
    x: str | None = None,
    y: str | None = None,
    group: str = "algorithm",
    panel: str | None = "dataset",
    where: Sequence[str] = (),
    theory_slope: float | None = None,
    theory_label: str = "theory",
    title: str | None = None,
    markdown: str | None = None,
) -> dict:
    """``fedkl plot``: read the table, filter, draw; optionally write the markdown numbers."""
    if not os.path.exists(table):
        raise ConfigError(f"table {table!r} not found")
    rows = read_table(table)
    if not rows:
        raise ConfigError(f"table {table!r} has no rows")
    check_unique(rows, table)
    for col in [c for c in (x, y, group, panel if kind == "privacy-utility" else None) if c]:
        if col not in rows[0]:
            raise ConfigError(f"no column {col!r} in {table} (columns: {', '.join(rows[0])})")
    rows = filter_rows(rows, where)
    if kind == "privacy-utility":
        summary = plot_privacy_utility(
            rows, out, x=x or "epsilon_target", y=y or "test_metric", group=group, panel=panel, title=title
        )
        if markdown:
            text = markdown_privacy_utility(
                rows, summary, x=x or "epsilon_target", y=y or "test_metric", group=group, panel=panel
            )
            write_text(markdown, text)
        return summary
    if kind == "slope":
        fits = plot_slope(
            rows,
            out,
            x=x or "users",
            y=y or "excess_loss",
            group=group,
            theory_slope=theory_slope,
            theory_label=theory_label,
            title=title,
        )
        if markdown:
            write_text(
                markdown,
                markdown_slope(fits, x=x or "users", y=y or "excess_loss", group=group, theory_slope=theory_slope),
            )
        return fits
    raise ConfigError(f"unknown plot kind {kind!r} (privacy-utility or slope)")


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)
