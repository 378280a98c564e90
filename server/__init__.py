"""Flower ServerApp wiring for fedkl.

The server side of the Flower transport (a ``ServerApp`` whose ``main`` runs any fedkl algorithm
through a Flower-backed :class:`fedkl.federation.base.Federation`) is built on the federation
interface; until it lands, algorithms run on :class:`fedkl.federation.inprocess.InProcessFederation`.
"""
