"""Batch-invariant row kernels: a record's result depends only on that record, never on how many
other records share the call or where the record sits among them.

Why: the in-process backend computes all users in one batched call, a Flower client computes its
one user alone. With plain ``X @ w`` and torch's vectorised transcendental functions the two round
differently in the last bits (BLAS blocks rows differently by matrix size; torch's SIMD body and its
scalar tail, and its per-thread chunks, round ``sigmoid``/``exp`` differently by position). These
kernels make the two backends release BIT-IDENTICAL models for the same seed (tested in
``tests/flower/test_flower.py`` and ``tests/problems/test_rowwise.py``):

* :func:`row_matmul` — one ``(1, d) @ (d, k)`` product per record, in blocks small enough for
  ATen's naive batched kernel (a sequential multiply-add loop per entry), blocks added in a fixed
  order: the rounding of a row cannot depend on its neighbours; :func:`row_dots` (``<X_i, V_i>`` of
  two ``(N, d)`` tensors, each record against its own vector) the same way;
* :func:`sigmoid`, :func:`softplus`, :func:`cross_entropy_rows`, :func:`softmax_rows` — the
  transcendental parts in numpy (single-threaded; its SIMD loops treat the tail with masked loads,
  not a different scalar formula), with exact torch backward passes so autograd still works;
* sums over a short axis are done column by column (IEEE additions in a fixed order).

Per-user reductions (``index_add_`` in :func:`fedkl.problems.base.user_means`) add a user's records
one after another in record order, the same order as the client's. Cost: about the speed of the
batched BLAS path for the problems' sizes (see ``tests/problems/test_rowwise.py`` for the invariance checks).

**Kernel modes.** One default everywhere: ``fast``. The mode is this module's context variable (default
``fast``), which every computation reads: a run (``RunConfig.kernels``, ``fedkl run --kernels``; ``auto``
resolves to ``fast`` in-process and on ray-shards), an algorithm class run directly on an
:class:`~fedkl.federation.inprocess.InProcessFederation`, a bare problem call. ``reproducible`` (the kernels
above) is an explicit opt-in (:func:`kernels`, ``--kernels reproducible``) and is what a Flower client
computes: its ClientApp enters ``kernels("reproducible")`` for every answer (a thread starts in the default,
so it cannot rely on the context), and a Flower backend resolves ``auto`` to ``reproducible`` on the server,
so every backend releases the same bits (issue 34: direct class use used to default to reproducible, 5x a
fast round, while a run defaulted to fast). ``fast`` replaces every kernel by the
plain torch one (BLAS ``X @ W``, ``torch.sigmoid``, ``torch.linalg.vector_norm``, ...) and per-user
gradient sums by one segment matmul (:func:`fedkl.problems.base.user_weighted_means`): the same
values up to float64 rounding (a user's row may then differ in the last bits with the batch it shares;
``tests/problems/test_kernels.py`` states the tolerance), several times faster per round
(``simulations/bench_inprocess.py``). The privacy guarantee does not depend on the mode: the clip bounds
every user's row whatever its rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

KERNEL_MODES = ("reproducible", "fast")
# a context variable, not a global: a run's mode stays with the run (and a thread starts in the default, so a
# Flower client, which may run in a thread of a training process, sets reproducible itself)
DEFAULT_KERNELS = "fast"
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("fedkl_kernels", default=DEFAULT_KERNELS)


def kernel_mode() -> str:
    """The kernel mode in force: ``"fast"`` (the default) or ``"reproducible"`` (batch-invariant, opt-in)."""
    return _MODE.get()


def fast_kernels() -> bool:
    return _MODE.get() == "fast"


@contextlib.contextmanager
def kernels(mode: str) -> Iterator[None]:
    """Run the body with kernel mode ``mode`` (one of :data:`KERNEL_MODES`); the previous mode is
    restored on exit (the run layer sets it for one run: ``fedkl run --kernels``)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


# ATen's bmm uses its naive kernel (one sequential multiply-add loop per output entry, the same code
# for every batch entry) when contraction * rows * cols < 400; above that it may call BLAS, whose
# rounding can depend on the call's shape. Blocks stay below the threshold.
_NAIVE_BMM_LIMIT = 399


def row_matmul(X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``X @ W`` computed record by record: ``X`` is ``(N, d)``, ``W`` is ``(d,)`` or ``(d, k)``.

    Each record's row is a ``(1, d) @ (d, k)`` product done in blocks of fewer than 400
    multiply-adds by ATen's naive batched kernel, the blocks added in a fixed order: the result of a
    row depends only on that row and ``W``.
    """
    if fast_kernels():
        return X @ W
    vector = W.dim() == 1
    Wm = W.unsqueeze(1) if vector else W
    n, (d, k) = X.shape[0], Wm.shape
    out = X.new_zeros(n, k)
    if n and d:
        Xb = X.unsqueeze(1)
        for c0 in range(0, k, _NAIVE_BMM_LIMIT):
            cols = slice(c0, min(k, c0 + _NAIVE_BMM_LIMIT))
            width = cols.stop - cols.start
            step = max(1, _NAIVE_BMM_LIMIT // width)
            acc = None
            for r0 in range(0, d, step):
                rows = slice(r0, min(d, r0 + step))
                part = torch.bmm(Xb[:, :, rows], Wm[rows, cols].unsqueeze(0).expand(n, -1, -1)).squeeze(1)
                acc = part if acc is None else acc + part
            out[:, cols] = acc
    return out.squeeze(1) if vector else out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _sigmoid_np(a: np.ndarray) -> np.ndarray:
    # 1/(1+e^-t) for t >= 0 and e^t/(1+e^t) for t < 0: never overflows
    e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        s = torch.from_numpy(_sigmoid_np(_np(t))).to(t.dtype)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, grad):
        (s,) = ctx.saved_tensors
        return grad * s * (1 - s)


class _Softplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        a = _np(t)
        ctx.save_for_backward(t)
        return torch.from_numpy(np.log1p(np.exp(-np.abs(a))) + np.maximum(a, 0.0)).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        return grad * sigmoid(t)


def sigmoid(t: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-t))`` elementwise, position-invariant, differentiable."""
    return torch.sigmoid(t) if fast_kernels() else _Sigmoid.apply(t)


def softplus(t: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(t))`` elementwise (stable form), position-invariant, differentiable."""
    return torch.logaddexp(t, torch.zeros_like(t)) if fast_kernels() else _Softplus.apply(t)


def _softmax_parts(Z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(m, E, S)``: row max, ``exp(Z - m)`` and its row sums added column by column."""
    m = Z.max(axis=1)
    E = np.exp(Z - m[:, None])
    S = E[:, 0].copy()
    for k in range(1, Z.shape[1]):
        S += E[:, k]
    return m, E, S


def softmax_rows(Z: torch.Tensor) -> torch.Tensor:
    """Row softmax of ``(N, K)`` scores (no gradient), position-invariant."""
    if fast_kernels():
        return torch.softmax(Z.detach(), dim=1)
    _, E, S = _softmax_parts(_np(Z))
    return torch.from_numpy(E / S[:, None]).to(Z.dtype)


class _CrossEntropyRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Z, labels):
        m, E, S = _softmax_parts(_np(Z))
        lab = labels.numpy()
        rows = np.arange(len(lab))
        loss = (m + np.log(S)) - _np(Z)[rows, lab]
        P = torch.from_numpy(E / S[:, None]).to(Z.dtype)
        ctx.save_for_backward(P, labels)
        return torch.from_numpy(loss).to(Z.dtype)

    @staticmethod
    def backward(ctx, grad):
        P, labels = ctx.saved_tensors
        G = P.clone()
        G[torch.arange(len(labels)), labels] -= 1.0
        return grad.unsqueeze(1) * G, None


def cross_entropy_rows(Z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-record ``logsumexp(Z_i) - Z_i[y_i]`` for ``(N, K)`` scores and int64 labels; differentiable in Z."""
    if fast_kernels():
        return F.cross_entropy(Z, labels.long(), reduction="none")
    return _CrossEntropyRows.apply(Z, labels.long())


def row_norms(V: torch.Tensor) -> torch.Tensor:
    """L2 norm of every row of ``(N, d)`` (squares summed per row by :func:`row_matmul`). A finite row
    whose squared norm overflows is rescaled by its largest entry first (its norm is finite)."""
    if V.shape[0] == 0:
        return V.new_zeros(0)
    if fast_kernels():
        norms = torch.linalg.vector_norm(V, dim=1)
    else:
        norms = torch.sqrt(row_matmul(V * V, torch.ones(V.shape[1], dtype=V.dtype)))
    big = torch.isinf(norms) & torch.isfinite(V).all(dim=1)
    if big.any():
        scale = V[big].abs().amax(dim=1)
        U = V[big] / scale.unsqueeze(1)
        norms = norms.clone()
        norms[big] = scale * row_norms(U)
    return norms


def row_dots(X: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``<X_i, V_i>`` for every row ``i`` of two ``(N, d)`` tensors, in blocks of fewer than 400
    multiply-adds (ATen's naive batched kernel): a row's result depends only on that row."""
    if fast_kernels():
        return torch.linalg.vecdot(X, V)
    out = X.new_zeros(X.shape[0])
    for c0 in range(0, X.shape[1], _NAIVE_BMM_LIMIT):
        blk = slice(c0, c0 + _NAIVE_BMM_LIMIT)
        out = out + torch.bmm(X[:, None, blk], V[:, blk, None]).reshape(-1)
    return out
