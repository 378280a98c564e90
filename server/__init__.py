"""Flower ServerApp entry point (``server.app:app``); the code is :mod:`fedkl.flower.server_app`, and
the loopback TLS deployment is :mod:`fedkl.flower.deploy`."""
