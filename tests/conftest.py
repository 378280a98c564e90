"""Shared fixtures."""
import pytest


@pytest.fixture
def dishonest_records(monkeypatch):
    """Records far outside every declared bound model DISHONEST clients: fedkl's datasets and ClientApp
    refuse them (fedkl.data.base.check_record_bounds), a modified client would not. Tests of guarantees
    that hold for ANY client behaviour build such neighbours with the check switched off."""
    monkeypatch.setattr("fedkl.data.base.check_record_bounds", lambda *a, **k: None)
