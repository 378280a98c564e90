"""Flower ServerApp wiring for fedkl.

:mod:`server.app` holds a ``ServerApp`` whose ``main`` runs any fedkl algorithm through a
Flower-backed :class:`fedkl.federation.base.Federation` (ledger, accountant and noise stay here);
:mod:`server.deploy` starts a loopback SuperLink + SuperNodes deployment with TLS and SuperNode
authentication (``fedkl run --backend grpc``).
"""
