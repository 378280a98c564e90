"""Flower ClientApp wiring for fedkl.

:mod:`client.app` holds a ``ClientApp`` with ONE user's records that answers the typed queries of
:mod:`fedkl.federation.base` (clipped gradient, gradient difference, local regularized minimizer,
local loss, local minimizers) exactly as the in-process backend computes them for that user, and
answers anything malformed with an error reply.
"""
