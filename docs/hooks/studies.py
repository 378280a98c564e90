"""MkDocs hook: the studies and benchmarks pages, generated at build time from simulations/results/ (no copies).

Every committed report ``simulations/results/NAME.md`` (written by ``fedkl report`` or a benchmark script)
becomes the page ``studies/NAME.md``, with the figures beside it (``studies/NAME.png``), so that the
reports' own relative image links work; ``README_tables.md`` (``make bench``'s collected tables) becomes
``studies/benchmarks.md``. The ``<!-- studies -->`` marker of docs/studies/index.md is replaced by the list of
those pages, titled by each report's first heading (or its name).
"""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "simulations", "results")
MARKER = "<!-- studies -->"
INDEX = "studies/index.md"
BENCHMARKS = "README_tables.md"


def _reports() -> list[str]:
    return sorted(f for f in os.listdir(RESULTS) if f.endswith(".md") and f != BENCHMARKS)


def _title(name: str) -> str:
    with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"#+\s+(.*\S)", line)
            if m:
                return m.group(1)
    return name[: -len(".md")].replace("_", " ")


def _page(name: str, title: str | None = None) -> str:
    """The report as a page: its own text, under a top heading (``title``, or the report's first heading when
    that is not already a top one), and a line naming the file it is."""
    with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
        text = f.read()
    if title is not None or not re.match(r"#\s", text):
        text = f"# {title or _title(name)}\n\n{text}"
    return text + f"\n\n---\nThis page is `simulations/results/{name}`, included at build time.\n"


def on_files(files, config):
    for name in _reports():
        files.append(File.generated(config, f"studies/{name}", content=_page(name)))
    files.append(File.generated(config, "studies/benchmarks.md", content=_page(BENCHMARKS, "Benchmarks")))
    for name in sorted(os.listdir(RESULTS)):
        if name.endswith(".png"):
            files.append(File.generated(config, f"studies/{name}", abs_src_path=os.path.join(RESULTS, name)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != INDEX:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{INDEX} lost its {MARKER} marker")
    items = [f"- [{_title(name)}]({name}) (`simulations/results/{name}`)" for name in _reports()]
    return markdown.replace(MARKER, "\n".join(items))
