"""`flwr run` entry point of the fedkl ServerApp: ``server.app:app``.

The code lives in :mod:`fedkl.flower.server_app` (installed with fedkl); this module only names it,
so that a Flower app whose ``pyproject.toml`` says ``serverapp = "server.app:app"`` finds it.
"""

from fedkl.flower.server_app import app

__all__ = ["app"]
