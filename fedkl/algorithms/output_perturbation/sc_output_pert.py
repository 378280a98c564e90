"""``sc-output-pert``: one user-level output perturbation of a strongly convex minimizer (paper 002, Alg 2,
Thm 3.1), the registered algorithm and its Params.

The release is ``DelOutputPert(f~)`` (:mod:`fedkl.algorithms.output_perturbation.del_output_pert`) of the
fixed-iteration solver f~ of the regularized objective, centred at the public initial model, with Delta =
``--stability-delta``. :class:`SCOutputPertAlgorithm` picks, from public values only (n, eps, delta and
the Params), the engine that decides its deletion test:

* the paper's exact test (the Lemma C.1 certificate, else enumeration of ~2^n user sets; n <= 20):
  :class:`~fedkl.algorithms.output_perturbation.exact_output_pert.SCOutputPert`;
* the polynomial-time local-minimizer diameter test (vertex cover or matching):
  :class:`~fedkl.algorithms.output_perturbation.diameter_output_pert.DiameterSCOutputPert`;
* with ``--p002-delta-select sparse-vector``, Delta chosen privately from a public grid below
  ``--stability-delta``, then the diameter test:
  :class:`~fedkl.algorithms.output_perturbation.diameter_output_pert.SelectedDeltaSCOutputPert`.

``--p002-test auto`` (the default) is the exact test up to 20 users, else the diameter test with its own
``auto`` score (the rule of :class:`~fedkl.algorithms.output_perturbation.phased_common.SCInnerRelease`,
which the phased algorithms' calls follow too).

Guarantee: **(eps, delta)-DP, user level, replace-one, n public**, for every engine (each module's
docstring has its proof), with (eps, delta) the budget every user can still afford (all of it on a fresh
ledger), charged to every user before the release. Clients: in class
(:data:`~fedkl.privacy.clients.IN_CLASS_CLIENTS`, see the engines). The engines are internal (not
registered): the phased algorithms use them as inner releases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fedkl.algorithms.contract import Algorithm, BuildContext, SmallAudit
from fedkl.algorithms.output_perturbation.del_output_pert import DelOutputPertResult
from fedkl.algorithms.output_perturbation.diameter_output_pert import (
    DiameterSCOutputPert,
    DiameterTest,
    SelectedDeltaSCOutputPert,
)
from fedkl.algorithms.output_perturbation.exact_output_pert import SCOutputPert
from fedkl.algorithms.output_perturbation.p002 import P002_ABSENCE, P002Release
from fedkl.algorithms.output_perturbation.phased_common import SCInnerRelease
from fedkl.algorithms.registry import register
from fedkl.federation.base import Federation
from fedkl.privacy.guarantee import IN_CLASS_CLIENTS, PAPER_002_RELATIONS, SOLVER_ITERATES, Guarantee
from fedkl.privacy.release import Releaser


@dataclass(frozen=True)
class SCOutputPertParams(P002Release):
    """sc-output-pert: Delta = ``stability_delta``, or chosen privately below it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.p002_delta_select == "sparse-vector":
            if self.p002_test == "exact":
                raise ValueError(
                    "--p002-delta-select sparse-vector uses the diameter test: give --p002-test auto, "
                    "vertex-cover or matching"
                )
            if self.p002_select_fraction is not None and not self.p002_select_fraction < 1:
                raise ValueError(
                    f"--p002-select-fraction must be < 1 (the share of eps spent choosing Delta), "
                    f"got {self.p002_select_fraction}"
                )


@register
class SCOutputPertAlgorithm(Algorithm[SCOutputPertParams]):
    """One SCOutputPert release (Alg 2) with the deletion test ``--p002-test`` (auto: the paper's exact
    test up to 20 users, else the polynomial-time diameter test), Delta = ``--stability-delta``.

    ``engine``: the internal engine chosen from public values (module docstring); it is built, and refuses
    a setting it cannot run exactly, before any data is read."""

    name = "sc-output-pert"
    Params = SCOutputPertParams
    guarantee = Guarantee("approx-dp", clients=IN_CLASS_CLIENTS, relations=PAPER_002_RELATIONS)
    absence = P002_ABSENCE
    clients_see = SOLVER_ITERATES
    small = {"reg": 0.5}
    audit = SmallAudit(epsilon=2.0, runs=70, users=100, records=10)

    def __init__(self, params: SCOutputPertParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        problem = ctx.problem
        if problem.reg <= 0:
            raise ValueError("sc-output-pert needs a strongly convex objective: give --reg > 0")
        eps, delta = ctx.approx_budget()  # what every user can still afford (all of it on a fresh ledger)
        solver = SCOutputPert.for_problem(
            problem,
            ctx.feature_bound,
            problem.init_params(),
            eps=eps,
            delta=delta,
            Delta=params.stability_delta,
            calibration=params.p002_calibration,
        )
        n = ctx.num_users
        self.engine: SCOutputPert | DiameterSCOutputPert | SelectedDeltaSCOutputPert
        if params.p002_delta_select == "sparse-vector":
            self.engine = SelectedDeltaSCOutputPert(
                solver, DiameterTest(test=params.p002_test), params.p002_select_fraction, users=n
            )
            self.engine.check(n)  # public refusal at build time
            return
        chooser = SCInnerRelease(problem, ctx.feature_bound, calibration=params.p002_calibration, test=params.p002_test)
        kind = chooser.kind(n, eps, delta)
        chooser.check(n, eps, delta)  # public refusal at build time
        self.engine = solver if kind == "exact" else DiameterSCOutputPert(solver, DiameterTest(test=kind))

    def forecast(self, n: int, w0: torch.Tensor, user_ids=None) -> dict:
        """The engine's public noise-to-signal forecast of the release."""
        return self.engine.forecast(n, w0, user_ids)

    def run(
        self,
        federation: Federation,
        releaser: Releaser,
        w0: torch.Tensor,
        progress: Callable[[dict], None] | None = None,
    ) -> DelOutputPertResult:
        """The one (eps, delta) release, charged to every user; ``theta`` is None for ⊥. ``w0``: the public
        centre (the problem's initial model when run by ``fedkl run``)."""
        return self.engine.run(federation, releaser, w0, progress)


__all__ = ["SCOutputPertAlgorithm", "SCOutputPertParams"]
