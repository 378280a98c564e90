"""The CLI grammar without torch: ``fedkl --help``, ``fedkl run --help`` and argument errors are answered
from fedkl/flags_catalog.json (fedkl.flags.catalog), which must say exactly what the code says. The
start-up time itself is measured in simulations/bench_startup.py, not here."""

from __future__ import annotations

import json
import subprocess
import sys

import fedkl.algorithms.catalog  # noqa: F401  (the live catalog: every built-in algorithm registered)
from fedkl.flags import CATALOG_PATH, build_parser, live_catalog

_PROBE = """
import contextlib, io, json, sys
from fedkl.cli import main
out = {}
for argv in ARGVS:
    text, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    out[" ".join(argv)] = [code, text.getvalue(), err.getvalue()]
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "numpy", "scipy", "flwr", "pandas"})
heavy += sorted(m for m in sys.modules if m.startswith("fedkl.") and m not in ("fedkl.cli", "fedkl.flags"))
print(json.dumps({"results": out, "heavy": heavy}))
"""


def _probe(argvs: list[list[str]], monkeypatch) -> dict:
    """Run ``fedkl.cli.main`` on each argv in a fresh interpreter; what it printed and which modules it loaded."""
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps help text to the terminal width
    code = _PROBE.replace("ARGVS", repr(argvs))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_catalog_file_says_what_the_code_says():
    """flags_catalog.json equals the live catalog (same values, same order: the order of the flags and
    choices); after changing an algorithm's Params, a dataset or a run default, regenerate it with
    ``python -m fedkl.flags``."""
    with open(CATALOG_PATH, encoding="utf-8") as f:
        shipped = json.load(f)
    live = live_catalog()
    builtin = set(fedkl.algorithms.catalog.ALGORITHMS)  # another test may have registered a toy algorithm
    live["algorithms"] = {k: v for k, v in live["algorithms"].items() if k in builtin}
    assert list(shipped) == list(live)
    for key in live:
        assert json.dumps(shipped[key]) == json.dumps(live[key]), f"{key}: run `python -m fedkl.flags`"


def test_help_and_argument_errors_do_not_import_torch(monkeypatch):
    """``fedkl --help``, ``fedkl run [--algorithm A] --help`` and bad arguments load nothing but the CLI's
    two modules (no torch, numpy, flwr, no algorithm), and print the same help as the parser built
    from the code itself."""
    argvs = [
        ["--help"],
        ["run", "--help"],
        ["run", "--algorithm", "phased-erm", "--help"],
        ["plan", "--help"],
        ["audit", "--help"],
        ["run", "--epsilon", "0"],
        ["run", "--kernels", "turbo"],
        ["run", "--dataset", "nope"],
        ["run", "--algorithm", "no-such"],
    ]
    got = _probe(argvs, monkeypatch)
    assert got["heavy"] == []
    res = got["results"]
    for argv in argvs[:5]:
        code, text, _ = res[" ".join(argv)]
        assert code == 0 and "usage: fedkl" in text
        parser = build_parser(argv[2] if argv[1:2] == ["--algorithm"] else None)  # live catalog here
        command = parser.subcommands.get(argv[0]) if argv[0] != "--help" else parser  # type: ignore[attr-defined]
        assert text == command.format_help()
    assert "phased-erm hyperparameters" in res["run --algorithm phased-erm --help"][1]
    for argv, needle in zip(argvs[5:], ("--epsilon", "--kernels", "--dataset", "--algorithm")):
        code, _, err = res[" ".join(argv)]
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
