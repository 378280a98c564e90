"""`flwr run` / SuperNode entry point of the fedkl ClientApp: ``client.app:app``.

The code lives in :mod:`fedkl.flower.client_app` (installed with fedkl); this module only names it,
so that a Flower app whose ``pyproject.toml`` says ``clientapp = "client.app:app"`` finds it.
"""

from fedkl.flower.client_app import app

__all__ = ["app"]
