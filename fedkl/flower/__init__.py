"""Everything Flower in fedkl, above the transport-free core (the run layer never imports it).

* :mod:`fedkl.flower.codec` -- the wire format of typed queries and answers;
* :mod:`fedkl.flower.federation` -- :class:`FlowerFederation`, the Federation interface over a Grid;
* :mod:`fedkl.flower.localgrid` -- a deterministic in-process Grid with fault injection;
* :mod:`fedkl.flower.client_app` -- the ClientApp (one user's records);
* :mod:`fedkl.flower.server_app` -- the ServerApp and the flower-local / flower-sim backends;
* :mod:`fedkl.flower.deploy` -- a loopback SuperLink + SuperNodes deployment (TLS, node auth);
* :mod:`fedkl.flower.secagg` -- ``--secagg``: sum queries through Flower's SecAgg+ (the server sees sums only);
* :mod:`fedkl.flower.dropin` -- :class:`~fedkl.flower.dropin.UserLevelDPStrategy`, user-level DP for an
  existing Flower app's strategy;
* :mod:`fedkl.flower.backends` -- registers the Flower backends with :mod:`fedkl.runner` (imported by
  the CLI and :func:`fedkl.train` when a run asks for one).

The repository's ``server/app.py`` and ``client/app.py`` re-export the two apps for ``flwr run``.
"""
