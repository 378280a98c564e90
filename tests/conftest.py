"""Shared fixtures, the "unit" marker for every test not marked statistical, flower or slow, and the
stress mode ``--cpu-hog N``: the session runs beside N busy-loop processes (a loaded machine; ``make stress``)."""

import subprocess
import sys

import pytest

# A busy loop that ends with the pytest process that started it (even one killed by SIGKILL).
CPU_HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-hog",
        type=int,
        default=0,
        metavar="N",
        help="run the session beside N busy-loop processes, as on a loaded machine (make stress)",
    )


def pytest_configure(config):
    n = config.getoption("--cpu-hog")
    if n < 0:
        raise pytest.UsageError(f"--cpu-hog {n}: give a number of processes >= 0")
    config.cpu_hogs = [subprocess.Popen([sys.executable, "-c", CPU_HOG]) for _ in range(n)]


def pytest_unconfigure(config):
    for hog in getattr(config, "cpu_hogs", []):
        hog.kill()
    for hog in getattr(config, "cpu_hogs", []):
        hog.wait()


@pytest.fixture
def cpu_hogs(request):
    """The busy-loop processes of ``--cpu-hog`` (empty without it)."""
    return request.config.cpu_hogs


_KINDS = ("statistical", "flower", "slow")


def pytest_collection_modifyitems(items):
    for item in items:
        if not any(item.get_closest_marker(kind) for kind in _KINDS):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True, scope="session")
def _reference_cache(tmp_path_factory):
    """The non-private reference's cache (fedkl.results) in a fresh folder, not the user's home."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FEDKL_CACHE_DIR", str(tmp_path_factory.mktemp("fedkl-cache")))
    yield
    mp.undo()


@pytest.fixture
def dishonest_records(monkeypatch):
    """Records far outside every declared bound model DISHONEST clients: fedkl's datasets and ClientApp
    refuse them (fedkl.data.base.check_record_bounds), a modified client would not. Tests of guarantees
    that hold for ANY client behaviour build such neighbours with the check switched off."""
    monkeypatch.setattr("fedkl.data.base.check_record_bounds", lambda *a, **k: None)
