"""The non-private reference: the exact minimizer of the user-level objective (no noise, no clip).

Used only to report how far a private model is from what the same model class reaches without
privacy. It reads all training data directly and is NOT private.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from fedkl.data.base import UserData
from fedkl.problems.base import Problem


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
