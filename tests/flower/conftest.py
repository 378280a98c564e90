"""The Flower tests compare the server's in-process answers with the clients' bit for bit: they run with the
reproducible kernels, the explicit opt-in (the default is fast, fedkl.problems.rowwise; a Flower client always
computes reproducibly, and a run sets its configured kernels itself)."""

import pytest

from fedkl.problems.rowwise import kernels


@pytest.fixture(autouse=True)
def _reproducible_kernels():
    with kernels("reproducible"):
        yield
