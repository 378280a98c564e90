"""The clipped per-user gradient SUM of fedkl's MLP without materialising per-user gradients.

fedkl's :meth:`fedkl.problems.mlp.MLP.per_user_gradients` builds every per-RECORD gradient
(``vmap(grad(...))``, records x 118,282 floats for the paper's 784-128-128-10 net), concatenates them,
reduces them into users with ``index_add_``, and :class:`~fedkl.federation.inprocess.InProcessFederation`
then clips every row and sums the rows. Memory traffic dominates: 1,280 records (128 users x 10
images) is 1,280 x 118k floats = 0.6 GB written three times per round.

:class:`GhostClippedMLPFederation` answers the same :class:`ClippedGradient` sum from the batch's
forward/backward quantities only ("ghost clipping", Goodfellow 2015; Li et al. 2022), generalised
from records to users:

* a record j's gradient for a Linear layer is ``d_j a_j^T`` (weight) and ``d_j`` (bias), with a_j the
  layer's input and d_j the back-propagated loss derivative at its output;
* user u's gradient is ``g_u = (1/m_u) sum_{j in u} (d_j a_j^T, d_j)`` (the mean record gradient, as
  ``per_user_gradients``), so ``||g_u||^2 = (1/m_u^2) sum_{j,k in u} (d_j . d_k)(a_j . a_k + 1)``,
  summed over layers: only the Gram matrices of each user's own records are needed (batched matmul);
* the clipped sum is ``sum_u c_u g_u = sum_j (c_u(j)/m_u(j)) (d_j a_j^T, d_j)`` with
  ``c_u = min(1, C/||g_u||)`` (rows already inside the ball are not scaled, as ``clip_rows``): one
  weighted matmul per layer.

Same mathematics as fedkl's path (float32 rounding differs: agreement is ~1e-6 relative, see
tests/test_paper004_repro.py), same sampling, same noise, same ledger: only this federation's
``sum`` for a ClippedGradient on an unregularised :class:`MLP` changes; every other query goes to
fedkl's :class:`InProcessFederation`. It returns the total as ONE row, which the
:meth:`Federation.sum` contract allows ("a backend with secure aggregation may return only the total").
A user whose gradient is not finite contributes zero and is reported failed, as ``clip_rows`` does.

:func:`record_metrics` is the evaluation that goes with it: accuracy and the mean loss over RECORDS
(not users). Used by the runner of simulations/studies/paper004_repro.toml (paper 004's MNIST figure), whose default kernel
this is (about 50x faster than the stock one there).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from fedkl.data.base import UserData
from fedkl.federation.base import Answers, ClippedGradient, Query
from fedkl.federation.inprocess import InProcessFederation
from fedkl.problems.mlp import MLP


def _layers(problem: MLP) -> list[tuple[str, str]]:
    """(weight name, bias name) of every Linear layer, in order."""
    out = []
    for name, mod in problem.module.named_children():
        if isinstance(mod, torch.nn.Linear):
            if mod.bias is None:
                raise ValueError("ghost clipping here assumes Linear layers with a bias")
            out.append((f"{name}.weight", f"{name}.bias"))
        elif not isinstance(mod, torch.nn.ReLU):
            raise ValueError(f"unsupported layer {type(mod).__name__}: only Linear and ReLU")
    return out


def ghost_clipped_sum(problem: MLP, w: torch.Tensor, data: UserData, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_u clip_C(grad f_u(w)), bad)`` for every user of ``data``; ``bad[u]``: user u's gradient was
    not finite (it contributes zero)."""
    if problem.reg != 0:
        raise ValueError("ghost_clipped_sum covers the unregularised MLP only (reg = 0)")
    w, X, y = problem._prepare(w, data)
    params = problem._unflatten(w)
    layers = _layers(problem)
    # forward, keeping every Linear layer's input and pre-activation
    inputs, pre = [], []
    a = X
    for i, (wn, bn) in enumerate(layers):
        inputs.append(a)
        h = a @ params[wn].T + params[bn]
        pre.append(h)
        a = torch.relu(h) if i < len(layers) - 1 else h
    # backward of the per-record loss (cross-entropy): d_j at every layer's output
    d = torch.softmax(a, dim=1) - F.one_hot(y, a.shape[1]).to(a.dtype)
    deltas = [None] * len(layers)
    for i in range(len(layers) - 1, -1, -1):
        deltas[i] = d
        if i > 0:
            d = (d @ params[layers[i][0]]) * (pre[i - 1] > 0).to(d.dtype)
    # per-user squared norms from same-user record pairs: records padded into (users, max records, .)
    # blocks (zero rows contribute nothing), Gram matrices by batched matmul
    idx = data.user_index
    U = data.num_users
    counts = torch.bincount(idx, minlength=U)
    order = torch.sort(idx, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(idx)
    pos[order] = torch.arange(len(idx)) - starts[idx[order]]  # position of each record within its user
    M = int(counts.max()) if U else 0
    norms_sq = torch.zeros(U, dtype=w.dtype)
    for a_in, dl in zip(inputs, deltas):
        Dp = torch.zeros(U, M, dl.shape[1], dtype=w.dtype)
        Ap = torch.zeros(U, M, a_in.shape[1], dtype=w.dtype)
        Dp[idx, pos] = dl
        Ap[idx, pos] = a_in
        if M == 1:
            norms_sq += Dp[:, 0].pow(2).sum(1) * (Ap[:, 0].pow(2).sum(1) + 1)
        else:
            norms_sq += (torch.bmm(Dp, Dp.transpose(1, 2)) * (torch.bmm(Ap, Ap.transpose(1, 2)) + 1)).sum((1, 2))
    norms_sq = norms_sq / counts.clamp_min(1).to(w.dtype) ** 2
    norms = torch.sqrt(norms_sq.clamp_min(0))
    bad = ~torch.isfinite(norms)
    scale = torch.where(norms > clip, clip / torch.clamp(norms, min=torch.finfo(w.dtype).tiny), torch.ones_like(norms))
    scale = torch.where(bad, torch.zeros_like(scale), scale)
    coef = (scale / counts.clamp_min(1).to(w.dtype))[idx]  # weight of every record
    parts = []
    for a_in, dl in zip(inputs, deltas):
        cd = dl * coef.unsqueeze(1)
        cd = torch.where(torch.isfinite(cd), cd, torch.zeros_like(cd))
        parts += [(cd.T @ a_in).reshape(-1), cd.sum(0)]
    return torch.cat(parts), bad


class GhostClippedMLPFederation(InProcessFederation):
    """:class:`InProcessFederation` whose ``sum`` of a :class:`ClippedGradient` uses
    :func:`ghost_clipped_sum` (one row: the total); every other request is fedkl's."""

    def sum(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        if not isinstance(query, ClippedGradient) or not isinstance(self.problem, MLP):
            return super().sum(query, users)
        users = self._users(users)
        total, bad = ghost_clipped_sum(self.problem, self._params(query.w), self._data(users), query.clip)
        failed = [users[i] for i in torch.nonzero(bad).flatten().tolist()]
        return Answers(users=users, values=total.unsqueeze(0), failed=failed)


def record_metrics(problem: MLP, w: torch.Tensor, data: UserData) -> dict[str, float]:
    """Accuracy and mean RECORD loss (``MLP.metrics`` averages the loss over users, which counts users
    without records in this split as zero-loss users)."""
    w, X, y = problem._prepare(w, data)
    with torch.no_grad():
        logits = problem._logits(w, X)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(1) == y).double().mean()
    return {"loss": float(loss), "accuracy": float(acc)}


__all__ = ["GhostClippedMLPFederation", "ghost_clipped_sum", "record_metrics"]
