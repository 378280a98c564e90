"""What a guarantee assumes of the OTHER clients: the part of every fedkl guarantee that says whose
misbehaviour it survives.

A user-level guarantee protects an honest user u: the law of what the server releases changes by
at most (eps, delta) when all of u's records change. The other clients may be honest, or run
modified code (a "dishonest" client). Each algorithm declares one of the two models below
(in its ``guarantee``, :class:`fedkl.privacy.guarantee.Guarantee`); ``fedkl run`` writes it into
result.json (``clients_assumed``).

* :data:`ANY_CLIENTS`: the guarantee holds whatever the other clients answer. The algorithm only
  sums answers whose norm the server bounds (a clipped answer over the bound is rejected by the
  transport, :mod:`fedkl.flower.federation`, and a failed user contributes zero), or releases a
  statistic of the reported vectors themselves with a test that is exact on those vectors.
* :data:`IN_CLASS_CLIENTS`: the guarantee holds when every other client c answers every gradient query
  of the run with the gradient of ONE loss F_c, where F_c is (i) fixed for the whole run (the same function
  at every query, every round and every phase), (ii) a function of client c's own records only (through
  the loss the run declares and the public query), NOT of the iterates it is asked at, of the answers it
  gave before or of anything else it observes, hence never chosen adaptively after seeing an iterate, and
  (iii) in the problem's declared class (convex / mu-strongly convex, with the Lipschitz and smoothness
  constants of records within the loaders' bounds), e.g. because the client is fedkl's ClientApp, which
  checks its records' bounds where they are loaded (:class:`fedkl.data.base.FederatedDataset`). An answer
  that is missing, non-finite or outside what any in-class loss can give is not trusted either: the user
  is handled as failed inside the privacy analysis (never an abort: fedkl/algorithms/output_perturbation/diameter_output_pert.py,
  "Failures"). Anything a client reports BEYOND its gradients (a local minimizer's residual, a
  certificate's norm) is recomputed or bounded by the server from gradient answers, never trusted. The
  proofs use convexity or smoothness of every user's loss (amplification by iteration, strongly convex
  minimizer stability, the deletion-jump lemma). The server checks what finitely many answers can show
  (the interpolation conditions of :mod:`fedkl.algorithms.output_perturbation.interpolation` on the paper-002 tests' answers):
  it catches an inconsistent client, but not one that picks an in-class loss after seeing the iterates
  (see there). Running under this model where clients run their own code (every Flower backend) is an
  explicit opt-in (``fedkl run --clients in-class``, :func:`require_trust`), and the printed privacy line
  says it next to epsilon.
* :data:`FEDKL_CLIENTS` (any algorithm run with ``--secagg``): the server sees only the masked sum
  (:mod:`fedkl.flower.secagg`), so it can no longer bound each answer; the sensitivity holds when every
  participating client runs fedkl's ClientApp (its clip and Flower's SecAgg+ mod). A deviating client
  can make the modular sum wrap around.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClientModel:
    """One client model: a short name and the sentence result.json carries."""

    name: str
    text: str

    def describe(self) -> str:
        return f"{self.name}: {self.text}"


ANY_CLIENTS = ClientModel(
    "any",
    "holds whatever the other clients answer (the server bounds every answer it sums, or the test is "
    "exact on the reported values)",
)
IN_CLASS_CLIENTS = ClientModel(
    "in-class gradients",
    "holds when every other client answers every gradient query with the gradient of one loss fixed for "
    "the whole run, a function of that client's own records only (not of the iterates it is asked at, not "
    "chosen adaptively), in the declared class (records within the loaders' bounds, checked by fedkl's "
    "ClientApp); reported residuals and certificate norms are recomputed by the server, never trusted",
)

FEDKL_CLIENTS = ClientModel(
    "fedkl clients (secure aggregation)",
    "holds when every participating client runs fedkl's ClientApp (its clip and the SecAgg+ mod): under "
    "--secagg the server sees only the masked sum and cannot bound an answer",
)

# what the operator may state with ``fedkl run --clients`` (run-config key ``fedkl-clients``): "any" (the
# default: no assumption) or "in-class" (the opt-in to IN_CLASS_CLIENTS)
TRUST_MODELS = ("any", "in-class")


def assumption(model: ClientModel) -> str:
    """The few words the printed privacy line carries next to epsilon: what the guarantee assumes of the
    other clients."""
    if model == ANY_CLIENTS:
        return "any clients"
    if model == IN_CLASS_CLIENTS:
        return "assumes in-class clients"
    return f"assumes {model.name}"


def require_trust(model: ClientModel, stated: str, deployed: bool, who: str) -> None:
    """Refuse (one-line ValueError) a DEPLOYED run (clients answer from their own processes: every Flower
    backend and ``flwr run``'s ServerApp) of a guarantee that assumes in-class clients unless the operator
    stated that trust model (``stated == "in-class"``), in the style of OpenDP's opt-in flags: running under
    a weaker assumption than "any client" is never a default. In-process (and on Ray shards) the server's
    own code computes every answer from the records, so the assumption holds by construction."""
    if stated not in TRUST_MODELS:
        raise ValueError(f"clients must be one of {TRUST_MODELS}, got {stated!r}")
    if deployed and model == IN_CLASS_CLIENTS and stated != "in-class":
        raise ValueError(
            f"{who}'s guarantee assumes in-class clients (every other client's gradient answers come from one "
            "fixed loss of its own records in the declared class), and on this backend clients run their own "
            'code: state that trust model with --clients in-class (run config fedkl-clients = "in-class") to '
            "run it (nothing was read or charged)"
        )


__all__ = [
    "ANY_CLIENTS",
    "FEDKL_CLIENTS",
    "IN_CLASS_CLIENTS",
    "TRUST_MODELS",
    "ClientModel",
    "assumption",
    "require_trust",
]
