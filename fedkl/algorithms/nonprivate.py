"""The non-private reference (no noise, no clip): what the same model reaches without privacy.

* Convex problems: the exact minimizer of the user-level objective (:func:`nonprivate_minimizer`,
  L-BFGS over the full batch).
* Non-convex problems (torch networks, the MLP): never L-BFGS on a network (it need not converge,
  and one iteration over a large network can take many minutes). The reference is **federated
  averaging without clipping or noise** (:func:`nonprivate_fedavg`) under the run's own training
  plan (:func:`fedavg_plan`): the same rounds, Poisson cohort rate, local training (steps or epochs,
  batch size, local lr) and server lr as a DP-FedAvg run; for any other gradient method, its rounds
  with one full-batch local step of its lr on every user (its update without clip or noise). Its
  time is bounded by the plan (as long as the private run's local work), and it reports progress
  every round.

Used only to report how far a private model is from the non-private one. It reads all training data
directly and is NOT private.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from fedkl.algorithms.contract import AlgorithmParams, PoissonSampling, Rounds, StepSize
from fedkl.algorithms.gradient.local_updates import LocalUpdates
from fedkl.data.base import UserData
from fedkl.problems.base import Problem

REFERENCE_ROUNDS = 100  # the FedAvg reference's rounds when the algorithm has none
REFERENCE_LR = 0.1  # its local step size when the algorithm has none


def nonprivate_minimizer(
    problem: Problem,
    data: UserData,
    w0: torch.Tensor | None = None,
    max_iter: int = 500,
    tol: float = 1e-9,
    progress: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Minimize ``F(w) = mean_u f_u(w)`` with L-BFGS (full batch; the problem's dtype for the loss).
    ``progress(iteration, max_iter)`` is called after every L-BFGS iteration."""
    from scipy.optimize import minimize  # here, not at import: `fedkl --help` need not load scipy

    data = data.to(problem.dtype)
    start = problem.init_params() if w0 is None else w0

    def fun(v: np.ndarray) -> tuple[float, np.ndarray]:
        # one autograd pass through F = mean_u f_u (cheaper than per-user gradients, e.g. for MLPs)
        w = torch.from_numpy(v).to(problem.dtype).requires_grad_(True)
        loss = problem.per_user_losses(w, data).mean()
        (grad,) = torch.autograd.grad(loss, w)
        return float(loss.detach()), grad.double().numpy()

    iteration = [0]

    def step(_: np.ndarray) -> None:
        iteration[0] += 1
        if progress is not None:
            progress(iteration[0], max_iter)

    res = minimize(
        fun,
        start.double().numpy(),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": max_iter, "gtol": tol},
        callback=step,
    )
    return torch.from_numpy(res.x).to(problem.dtype)


def fedavg_plan(params: AlgorithmParams, seed: int = 0) -> dict:
    """The non-private FedAvg reference's plan for an algorithm's ``params`` (module docstring): a
    DP-FedAvg-style algorithm's own rounds, cohort rate and local training; any other: its rounds (else
    :data:`REFERENCE_ROUNDS`), everyone every round, one full-batch local step of its lr (else
    :data:`REFERENCE_LR`). ``seed`` draws the cohorts."""
    rounds = params.rounds if isinstance(params, Rounds) else REFERENCE_ROUNDS
    q = params.sampling_rate if isinstance(params, PoissonSampling) else 1.0
    lr = params.lr if isinstance(params, StepSize) and params.lr is not None else REFERENCE_LR
    if isinstance(params, LocalUpdates):
        return {
            "rounds": rounds,
            "sampling_rate": q,
            "local_steps": params.local_steps,
            "local_epochs": params.local_epochs,
            "batch_size": params.batch_size,
            "local_lr": params.local_update_lr(lr),
            "server_lr": params.server_lr,
            "seed": seed,
        }
    return {
        "rounds": rounds,
        "sampling_rate": q,
        "local_steps": 1,
        "local_epochs": None,
        "batch_size": None,
        "local_lr": lr,
        "server_lr": 1.0,
        "seed": seed,
    }


def nonprivate_fedavg(
    problem: Problem,
    data: UserData,
    plan: dict,
    w0: torch.Tensor | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Federated averaging without clipping or noise under ``plan`` (:func:`fedavg_plan`): each round a
    Poisson cohort (rate ``sampling_rate``, numpy generator seeded by ``seed``) trains locally from the
    current model exactly as DP-FedAvg's clients do (:meth:`~fedkl.problems.base.Problem.local_updates`
    or :meth:`~fedkl.problems.base.Problem.local_epoch_updates`), the server adds ``server_lr`` times the
    mean update (unweighted over users, as DP-FedAvg; an empty cohort or non-finite answers leave the
    model as it is). ``progress(round, rounds)`` after every round."""
    data = data.to(problem.dtype)
    w = (problem.init_params() if w0 is None else w0).clone()
    rng = np.random.default_rng(plan["seed"])
    rounds, q = int(plan["rounds"]), float(plan["sampling_rate"])
    for t in range(1, rounds + 1):
        users = np.flatnonzero(rng.random(data.num_users) < q) if q < 1 else np.arange(data.num_users)
        if len(users):
            cohort = data.subset(users.tolist())
            if plan["local_epochs"] is None:
                deltas = problem.local_updates(w, cohort, plan["local_steps"], plan["local_lr"], plan["batch_size"])
            else:
                deltas = problem.local_epoch_updates(
                    w, cohort, plan["local_epochs"], plan["local_lr"], plan["batch_size"]
                )
            finite = torch.isfinite(deltas).all(dim=1)
            if bool(finite.any()):
                w = w + plan["server_lr"] * deltas[finite].mean(0)
        if progress is not None:
            progress(t, rounds)
    return w
