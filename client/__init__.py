"""Flower ClientApp wiring for fedkl.

A ``ClientApp`` holds ONE user's records and answers the typed queries of
:mod:`fedkl.federation.base` (clipped gradient, gradient difference, local regularized minimizer,
local loss). Until it lands, :class:`fedkl.federation.inprocess.InProcessFederation` computes the
same per-user answers for all users at once.
"""
