"""Flower ClientApp entry point (``client.app:app``); the code is :mod:`fedkl.flower.client_app`: ONE
user's records, answering the typed queries of :mod:`fedkl.federation.base` exactly as the
in-process backend computes them for that user, and anything malformed with an error reply."""
