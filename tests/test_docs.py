"""The documentation's promises (issue 29 §4): the README's Python example runs as written, and the code cites only
files in the repository (no absolute machine path, no note outside it, no cited file that does not exist).

`make docs` (CI, after `make test`) builds the site itself with warnings as errors; these tests need no MkDocs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("fedkl", "server", "client")
# an absolute path on some machine (a home or work folder), never a repository path
MACHINE_PATH = re.compile(r"(?<![\w.-])/(?:work|home|Users|root)/[\w.-]+")
# the working notes the derivations came from, which live outside the repository
OUTSIDE_NOTES = re.compile(r"shared/notes|notes/seed-|\bseed-00\d\b")
# a cited repository path: under docs/, simulations/ or tests/, or any *.md file
CITED = re.compile(r"(?<![\w./-])((?:docs|simulations|tests)/[\w./{},*-]*[\w}*]|[\w./-]*\w\.md)\b")
# a path the docs cite: any file of the repository's top folders
DOCS_CITED = re.compile(r"(?<![\w./-])((?:fedkl|tests|simulations|docs|server|client)/[\w./{},*-]*[\w}*])")


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.S)


def _expand(path: str) -> list[str]:
    """``results/x.{md,csv}`` -> both paths; a trailing dot ends the sentence, not the path."""
    path = path.rstrip(".")
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [q for part in m.group(1).split(",") for q in _expand(path[: m.start()] + part + path[m.end() :])]


def _is_placeholder(path: str) -> bool:
    """``simulations/studies/NAME.toml``, ``FILE.md``, ``paper-00N.md``, ``tests/...``: a pattern, not a citation."""
    return (
        "*" in path or "..." in path or any(re.search(r"[A-Z]{2,}|\d[A-Z]$", part) for part in re.split(r"[/.]", path))
    )


def _citations() -> list[tuple[str, int, str]]:
    found = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                found.append((str(path.relative_to(ROOT)), number, line))
    return found


def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The README's one Python example, exactly as printed, trains, reports its privacy and reloads its model."""
    blocks = _python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) == 1, "the README shows one Python example, the one this test runs"
    assert len(blocks[0].strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)  # the run writes runs/<id>/ here
    monkeypatch.setenv("FEDKL_CACHE_DIR", str(tmp_path / "cache"))
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    run, model = scope["run"], scope["model"]
    assert 0 < run.epsilon <= 2.0 and run.delta == pytest.approx(1 / 150**1.1)
    assert model.receipt["epsilon"] == pytest.approx(run.epsilon)
    assert run.metrics["accuracy"] > run.baseline["accuracy"]
    printed = capsys.readouterr().out
    assert str(run.epsilon) in printed


def test_code_cites_no_machine_path_and_no_note_outside_the_repository():
    bad = [
        f"{path}:{number}: {line.strip()}"
        for path, number, line in _citations()
        if MACHINE_PATH.search(line) or OUTSIDE_NOTES.search(line)
    ]
    assert not bad, "cite docs/derivations/paper-00N.md §X instead:\n" + "\n".join(bad)


def test_every_repository_file_the_code_cites_exists():
    missing, cited = [], 0
    for path, number, line in _citations():
        for token in CITED.findall(line):
            for target in _expand(token):
                if _is_placeholder(target) or target.startswith("."):
                    continue
                cited += 1
                if not (ROOT / target).exists():
                    missing.append(f"{path}:{number}: {target}")
    assert cited > 20  # the scan finds the citations (tests, studies, results, derivations)
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_every_repository_file_the_docs_cite_exists():
    """README.md and the hand-written pages under docs/ cite only files that exist (a moved module or test
    fails here, not in a reader's hands)."""
    missing, cited = [], 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for token in DOCS_CITED.findall(line):
                for target in _expand(token):
                    if _is_placeholder(target):
                        continue
                    cited += 1
                    if not (ROOT / target).exists():
                        missing.append(f"{page.relative_to(ROOT)}:{number}: {target}")
    assert cited > 100
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_the_checks_catch_what_they_are_for():
    """The patterns above flag each kind of bad citation and pass the good ones."""
    assert MACHINE_PATH.search("constants re-derived in /work/shared/notes/seed-002.md.")
    assert not MACHINE_PATH.search("data-path='/srv/site7/records.csv'") and not MACHINE_PATH.search("a/work/b")
    for text in ("(../shared/notes/seed-004.md)", "notes/seed-003.md §5", "note seed-001, pitfall 11"):
        assert OUTSIDE_NOTES.search(text), text
    assert not OUTSIDE_NOTES.search("docs/derivations/paper-002.md §2A")
    assert CITED.findall("(docs/derivations/paper-002.md §2A; tests/test_x.py::test_y)") == [
        "docs/derivations/paper-002.md",
        "tests/test_x.py",
    ]
    assert _expand("simulations/results/x.{md,csv}") == ["simulations/results/x.md", "simulations/results/x.csv"]
    assert _is_placeholder("simulations/studies/NAME.toml") and _is_placeholder("docs/derivations/paper-00N.md")
    assert not _is_placeholder("docs/how-to/deploy.md") and not _is_placeholder("tests/test_e2e.py")
