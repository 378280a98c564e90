"""MkDocs hook: the algorithm catalogue (docs/algorithms/catalog.md), generated from the registry at build time.

The page's ``<!-- catalog -->`` marker is replaced by one section per registered algorithm: its summary, its
declared guarantee (how releases are charged and composed, the neighbouring relations its proof covers, what it
assumes of the other clients), what a participating client sees, whether it aggregates sums only (``--secagg``),
how an absent or failed user enters its releases, and its hyperparameters (flag, default, origin, help), all
read through :data:`fedkl.algorithms.registry.REGISTRY`. Nothing here is typed by hand: "when to pick it" is the
hand-written page docs/algorithms/choosing.md.
"""

from __future__ import annotations

import dataclasses
import math

MARKER = "<!-- catalog -->"
PAGE = "algorithms/catalog.md"

CHARGES = {
    "zcdp": "ρ-zCDP: every release a zCDP charge, composed additively, (ε, δ) by the run's conversion",
    "approx-dp": "(ε, δ)-DP: every release an (ε, δ) charge, basic composition in the per-user ledger",
    "approx-zcdp": "approximate zCDP: zCDP charges plus (0, δ) charges (a test's failure probability), added up",
    "schedule": "(ε, δ) of a Poisson-subsampled Gaussian schedule (dp-accounting RDP or PLD), charged up front",
}


def _guarantee(spec):
    """The algorithm's declared :class:`fedkl.privacy.guarantee.Guarantee`: the one place this generator reads it
    (``AlgorithmSpec.guarantee`` comes with the algorithm classes of issue 29 §1)."""
    return spec.guarantee


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _params_table(spec) -> list[str]:
    params = spec.resolve(spec.params())
    fields = dataclasses.fields(spec.params)
    if not fields:
        return ["No hyperparameters."]
    rows = ["| flag | default | origin | help |", "|---|---|---|---|"]
    for f in fields:
        help_ = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if choices:
            help_ += f" (one of {', '.join(str(c) for c in choices)})"
        flag = "--" + f.name.replace("_", "-")
        value = getattr(params, f.name)
        rows.append(f"| `{flag}` | {_default(value)} | {_cell(f.metadata.get('origin', ''))} | {_cell(help_)} |")
    return rows


def _section(name: str, spec) -> list[str]:
    g = _guarantee(spec)
    params = spec.resolve(spec.params())
    view = spec.clients_see(params)
    lines = [f"## `{name}`", "", spec.summary or "(no summary)", ""]
    lines.append(f"- **Guarantee**: user-level {CHARGES.get(g.charges, g.charges)}; {g.composition} composition")
    if g.adaptive:
        lines[-1] += " (later costs chosen from earlier private releases, under a run-wide zCDP filter)"
    lines.append(f"- **Neighbouring relations covered**: {', '.join(g.relations)}")
    lines.append(f"- **Assumes of the other clients**: {g.clients.describe()}")
    lines.append(f"- **A participating client sees**: {view.describe()}")
    lines.append(
        "- **Sums only (`--secagg`)**: "
        + ("yes: it needs nothing but sums of clipped answers" if spec.sums_only(params) else "no")
    )
    for rule in spec.absence:
        where = "" if rule.releases == "*" else f" (releases `{rule.releases}`)"
        lines.append(f"- **An absent or failed user{where}**: {rule.mode}: {rule.text}")
    if spec.step_size is not None:
        lines.append(f"- **Default step size**: `--lr {spec.step_size}` (public tuning, `fedkl run --help`)")
    lines += ["", "Hyperparameters (`fedkl run --algorithm " + name + " --help`):", ""]
    return lines + _params_table(spec) + [""]


def catalog_markdown() -> str:
    from fedkl.algorithms.registry import REGISTRY

    names = sorted(REGISTRY)
    out = [
        f"{len(names)} registered algorithms. Every one runs on every backend; the relation column is what its proof "
        "covers (others are refused before any data is read).",
        "",
        "| algorithm | summary | charges | relations | client sees only private values | `--secagg` |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        spec = REGISTRY[name]
        g = _guarantee(spec)
        params = spec.resolve(spec.params())
        out.append(
            f"| [`{name}`](#{name}) | {_cell(spec.summary)} | {g.charges} | {', '.join(g.relations)} | "
            f"{'yes' if spec.clients_see(params).private_only else '**no**'} | "
            f"{'yes' if spec.sums_only(params) else 'no'} |"
        )
    out.append("")
    for name in names:
        out += _section(name, REGISTRY[name])
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its {MARKER} marker")
    return markdown.replace(MARKER, catalog_markdown())
