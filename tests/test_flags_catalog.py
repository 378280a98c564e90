"""The CLI grammar without torch: ``fedkl --help``, ``fedkl run --help`` and argument errors are answered
from fedkl/flags_catalog.json (fedkl.flags.catalog), which must say exactly what the code says. The
start-up time itself is measured in simulations/bench_startup.py, not here."""

from __future__ import annotations

import json
import subprocess
import sys

from fedkl.flags import CATALOG_PATH

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


_LIVE = """
import json
import fedkl.algorithms.catalog  # the live catalog: every built-in algorithm registered, nothing else
from fedkl.flags import build_parser, live_catalog
helps = {}
for argv in ARGVS:
    parser = build_parser(argv[2] if argv[1:2] == ["--algorithm"] else None)
    command = parser.subcommands.get(argv[0]) if argv[0] != "--help" else parser
    helps[" ".join(argv)] = command.format_help()
print(json.dumps({"catalog": live_catalog(), "helps": helps}))
"""


def _live(argvs: list[list[str]], monkeypatch) -> dict:
    """The catalog and help texts the code itself gives, in a fresh interpreter (this test session may
    have registered toy algorithms or imported algorithm modules in another order)."""
    monkeypatch.setenv("COLUMNS", "100")
    proc = subprocess.run(
        [sys.executable, "-c", _LIVE.replace("ARGVS", repr(argvs))], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _probe(argvs: list[list[str]], monkeypatch) -> dict:
    """Run ``fedkl.cli.main`` on each argv in a fresh interpreter; what it printed and which modules it loaded."""
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps help text to the terminal width
    code = _PROBE.replace("ARGVS", repr(argvs))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_catalog_file_says_what_the_code_says(monkeypatch):
    """flags_catalog.json equals the live catalog (same values, same order: the order of the flags and
    choices); after changing an algorithm's Params, a dataset or a run default, regenerate it with
    ``python -m fedkl.flags``."""
    with open(CATALOG_PATH, encoding="utf-8") as f:
        shipped = json.load(f)
    live = _live([], monkeypatch)["catalog"]
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
    helps = _live(argvs[:5], monkeypatch)["helps"]
    assert got["heavy"] == []
    res = got["results"]
    for argv in argvs[:5]:
        code, text, _ = res[" ".join(argv)]
        assert code == 0 and "usage: fedkl" in text
        assert text == helps[" ".join(argv)]  # the file's help is the code's help
    assert "phased-erm hyperparameters" in res["run --algorithm phased-erm --help"][1]
    for argv, needle in zip(argvs[5:], ("--epsilon", "--kernels", "--dataset", "--algorithm")):
        code, _, err = res[" ".join(argv)]
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
