"""Shared fixtures, and the "unit" marker for every test not marked statistical, flower or slow."""

import pytest

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
