"""simulations/geyer_table.py (issue 30's Geyer table): each cell's `fedkl run` command carries exactly the settings
chosen on validation, every committed record is a run of its cell under that command, and the committed
markdown is what `report` writes from those records (no number typed by hand)."""

import importlib.util
import os
import sys

import pytest

from fedkl.flags import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def table():
    """simulations/geyer_table.py loaded by path (tests never import simulations/); the folder it puts on
    sys.path for its sibling geyer_validation.py, and the modules it loads, are taken back afterwards."""
    path, modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location(
            "geyer_table", os.path.join(REPO, "simulations", "geyer_table.py")
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name in ("geyer_table", "geyer_validation", "nets"):
                del sys.modules[name]


def test_each_cell_command_parses_to_its_validation_choice(table):
    checked = 0
    for cell, (dataset, users, eps) in table.CELLS.items():
        if not table._has_rows(dataset, users):
            continue
        c = table.choice(dataset, users)
        ns = build_parser("dp-fedavg").parse_args(table.command(cell, 3)[1:])
        assert (ns.dataset, ns.users, ns.partition, ns.algorithm) == (dataset, users, "shards", "dp-fedavg")
        assert (ns.epsilon, ns.delta, ns.seed) == (eps, table.val.DELTA[users], 3)
        for key in table.FLAGS:
            assert getattr(ns, key) == c[key], (cell, key)
        checked += 1
    assert checked >= 3


def test_committed_records_are_runs_of_their_cells_and_the_markdown_is_generated(table):
    n = 0
    for cell, (dataset, users, eps) in table.CELLS.items():
        for r in table.records(cell):  # refuses a record whose command is not today's choice
            assert (r["dataset"], r["users"], r["partition"], r["delta"]) == (
                dataset,
                users,
                "shards",
                table.val.DELTA[users],
            )
            assert r["epsilon"] <= eps and r["usage"]["cpu_s"] > 0
            n += 1
    assert n > 0
    assert table.report() == table.MARKDOWN.read_text()
