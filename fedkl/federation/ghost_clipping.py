"""The clipped per-user gradient SUM of any :class:`~fedkl.problems.torch_model.TorchModel` (the
built-in MLP included) without per-record or per-user gradients of the whole network in memory.

The per-record path (:meth:`TorchModel.per_user_gradients`) builds every per-RECORD gradient
(``vmap(grad(...))``: records x parameters floats), sums them into users and clips the rows. Here the
same clipped sum ``sum_u clip_C(g_u)`` comes from one forward and one backward pass of the batch
("ghost clipping", Goodfellow 2015, Li et al. 2022; "book-keeping", Bu et al. 2023), generalised
from records to users. Forward hooks keep every layer call's input ``a``; the backward pass of the
summed per-record losses gives ``d``, the loss gradient at every layer call's output (read by tensor
hooks; no parameter gradient is formed). User u's gradient is the mean of its records' gradients,
``g_u = (1/m_u) sum_{j in u} g_j``.

* **Linear, Conv1d, Conv2d**: a record's weight gradient is ``sum_t d_t a_t^T`` over its positions t
  (one position for a Linear on flat rows; conv patches; the same layer called several times adds
  positions), bias ``sum_t d_t``. Where that gradient is no larger than the record's rows (most
  convolutions) it is formed per record (a conv: one grouped convolution backward, one group per
  record) during the backward pass. Otherwise, per user, either the Gram form
  ``||.||^2 = sum_{r,s in u} (d_r . d_s)(a_r . a_s + 1)`` (batched matmuls of each user's own rows) or
  the user's gradient of that layer ``sum_r d_r a_r^T`` (``out x in`` floats per user), whichever needs
  fewer operations (R rows per user: Gram if ``R (in + out) < in * out``).
* **Embedding**: ``sum_{r,s in u} [i_r = i_s] (d_r . d_s)`` (rows at ``padding_idx`` have no gradient).
* **LayerNorm, GroupNorm**: their per-record weight/bias gradients are small (``d * x_hat`` summed over
  positions) and formed per record.
* The squared norms of all layers add up to ``||g_u||^2``; ``c_u = min(1, C/||g_u||)`` (a user inside
  the ball is not scaled, as :func:`~fedkl.federation.clipping.clip_rows`) and the clipped sum is
  ``sum_j (c_u(j)/m_u(j)) g_j``: one weighted matmul (or ``index_add``) per layer from the kept ``a``, ``d``.

Users are processed in blocks of similar record counts padded to ``(users, max records, .)``, records in
chunks, with at most :data:`BLOCK_ELEMENTS` floats per temporary: about the memory of the batch's
activations, never ``records x parameters`` (simulations/bench_torch_models.py). A user whose gradient
norm is not finite contributes zero and is reported (``bad``), as ``clip_rows`` does.

What is covered (:func:`unsupported_reason`): every parametrised module is exactly one of
:data:`SUPPORTED` (not a subclass, which may change ``forward``), no parameter is shared between
modules, Conv without groups and with zero padding, Embedding without ``max_norm`` or
``scale_grad_by_freq``, and every layer call keeps the records on its first axis (checked per call)
(an in-place op on a layer's output, ``ReLU(inplace=True)``, is fine). BatchNorm is refused
by :class:`TorchModel` itself (batch statistics mix users' records); a regularised problem
(``reg != 0``) is not covered. Parameters used outside their module's call (``F.linear(x, self.fc.weight)``)
cannot be seen by hooks: :func:`check_against_per_record` compares the norms with the per-record path
on a few records, which the in-process backend does once before it first uses this path. Anything not
covered is refused with one line (``ValueError``); the in-process backend then answers with the
per-record path (:class:`~fedkl.federation.inprocess.InProcessFederation`, ``clipped_sum_path``).

:func:`record_metrics` (accuracy and mean loss over RECORDS) is the evaluation paper 004's study uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from fedkl.data.base import UserData
from fedkl.problems.torch_model import TorchModel

SUPPORTED = (
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Embedding,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
)
# the most floats one padded per-user temporary may hold (users are processed in blocks)
BLOCK_ELEMENTS = 1 << 22
# tolerance of check_against_per_record, in units of the dtype's epsilon (rounding of two exact formulas:
# 1.2e-4 relative in float32, 2.2e-13 in float64)
CHECK_ULPS = 1000


def _conv_padding(mod: torch.nn.Module) -> tuple[int, ...] | str:
    """The symmetric zero padding of a conv layer, or why it is not covered."""
    if mod.groups != 1:
        return f"{type(mod).__name__} with groups={mod.groups}"
    if mod.padding_mode != "zeros":
        return f"{type(mod).__name__} with padding_mode={mod.padding_mode!r}"
    if mod.padding == "valid":
        return (0,) * len(mod.kernel_size)
    if mod.padding == "same":
        totals = [d * (k - 1) for d, k in zip(mod.dilation, mod.kernel_size)]
        if any(t % 2 for t in totals):
            return f"{type(mod).__name__} with asymmetric 'same' padding"
        return tuple(t // 2 for t in totals)
    return tuple(mod.padding)


def unsupported_reason(problem: TorchModel) -> str | None:
    """Why :func:`ghost_clipped_sum` does not cover ``problem`` (one line), or None."""
    if not isinstance(problem, TorchModel):
        return f"{type(problem).__name__} is not a torch model"
    if problem.reg != 0:
        return "a regularised problem (reg != 0)"
    owners: dict[int, str] = {}
    for name, mod in problem.module.named_modules():
        own = [p for p in mod._parameters.values() if p is not None]
        if not own:
            continue
        label = f"layer {name or '(root)'} ({type(mod).__name__})"
        if type(mod) not in SUPPORTED:
            return f"{label} has parameters; covered: {', '.join(t.__name__ for t in SUPPORTED)}"
        for p in own:
            if id(p) in owners:
                return f"{label} shares a parameter with layer {owners[id(p)]}"
            owners[id(p)] = name
        if isinstance(mod, (torch.nn.Conv1d, torch.nn.Conv2d)) and isinstance(_conv_padding(mod), str):
            return f"{label}: {_conv_padding(mod)}"
        if isinstance(mod, torch.nn.Embedding) and (mod.max_norm is not None or mod.scale_grad_by_freq):
            return f"{label} with max_norm or scale_grad_by_freq"
    return None


@dataclass
class _Term:
    """One parametrised layer's per-record quantities (``names``: its parameters, in order).

    ``kind`` "small": ``G (N / group, P)``, every record's (``group`` 1) or every user's gradient of the
    layer's parameters (formed when a record's is no larger than its rows: norm layers, most convolutions). "factor": ``rows(sel)`` gives the
    selected records' ``A (k, T, p)`` and ``D (k, T, q)``; the weight gradient is ``sum_t D_t A_t^T``,
    plus a bias ``sum_t D_t`` when ``bias``. "index" (Embedding): ``rows(sel)`` gives indices ``(k, T)``
    and ``D (k, T, q)``; ``num_rows`` rows of the table."""

    kind: str
    names: list[str]
    G: torch.Tensor | None = None
    rows: Callable[[slice | torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    T: int = 0
    p: int = 0
    q: int = 0
    bias: bool = False
    num_rows: int = 0
    group: int = 1  # "small": G's rows sum this many consecutive records (one user's when > 1)


def _unfold(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Patches of a conv input, ``(k, L, C_in * prod(kernel))`` in the order of ``weight.view(C_out, -1)``."""
    pad = _conv_padding(mod)
    if isinstance(mod, torch.nn.Conv1d):
        cols = F.unfold(
            x.unsqueeze(2),
            (1, mod.kernel_size[0]),
            dilation=(1, mod.dilation[0]),
            padding=(0, pad[0]),
            stride=(1, mod.stride[0]),
        )
    else:
        cols = F.unfold(x, mod.kernel_size, dilation=mod.dilation, padding=pad, stride=mod.stride)
    return cols.transpose(1, 2)


def _conv_group_grads(mod: torch.nn.Module, x: torch.Tensor, d: torch.Tensor, m: int) -> torch.Tensor:
    """The weight gradient of one conv call summed over every ``m`` consecutive records (one user's),
    ``(k / m, C_out * C_in * prod(kernel))``: the users as the groups of one grouped convolution's weight
    gradient, each user's records its batch (no patch matrix)."""
    k, dims = x.shape[0] // m, len(mod.kernel_size)
    weight_shape = (k * mod.out_channels, mod.in_channels, *mod.kernel_size)
    if m > 1:  # records of a user on the batch axis, users on the channel axis
        x = x.reshape(k, m, *x.shape[1:]).transpose(0, 1)
        d = d.reshape(k, m, *d.shape[1:]).transpose(0, 1)
    _, grad_w, _ = torch.ops.aten.convolution_backward(
        d.reshape(m, k * mod.out_channels, *d.shape[-dims:]),
        x.reshape(m, k * mod.in_channels, *x.shape[-dims:]),
        x.new_empty(()).expand(weight_shape),
        None,
        list(mod.stride),
        list(_conv_padding(mod)),
        list(mod.dilation),
        False,
        [0] * dims,
        k,
        [False, True, False],
    )
    return grad_w.reshape(k, -1)


def _norm_layer_grads(mod: torch.nn.Module, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Every record's (weight, bias) gradient of a LayerNorm/GroupNorm call: ``(N, P)``."""
    n = x.shape[0]
    if isinstance(mod, torch.nn.LayerNorm):
        xhat = F.layer_norm(x, mod.normalized_shape, eps=mod.eps)
        dims = tuple(range(1, x.dim() - len(mod.normalized_shape)))
    else:
        xhat = F.group_norm(x, mod.num_groups, eps=mod.eps)
        dims = tuple(range(2, x.dim()))
    parts = []
    if mod.weight is not None:
        parts.append((d * xhat).sum(dims) if dims else d * xhat)
    if mod.bias is not None:
        parts.append(d.sum(dims) if dims else d)
    return torch.cat([p.reshape(n, -1) for p in parts], 1)


def _record_grads(mod: torch.nn.Module, x: torch.Tensor, d: torch.Tensor, m: int = 1) -> torch.Tensor:
    """The gradient of one call's parameters (weight, then bias) summed over every ``m`` consecutive
    records: ``(k / m, P)`` (``m = 1``: every record's), in chunks whose temporaries hold at most
    :data:`BLOCK_ELEMENTS` floats."""
    k = x.shape[0]
    chunk = max(m, BLOCK_ELEMENTS // max(1, x[0].numel() + d[0].numel()) // m * m)
    if chunk < k:
        return torch.cat([_record_grads(mod, x[s : s + chunk], d[s : s + chunk], m) for s in range(0, k, chunk)])
    if isinstance(mod, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
        g = _norm_layer_grads(mod, x, d)
        return g if m == 1 else g.reshape(k // m, m, -1).sum(1)
    if isinstance(mod, torch.nn.Linear):
        D = d.reshape(k // m, -1, mod.out_features)
        parts = [torch.bmm(D.transpose(1, 2), x.reshape(k // m, -1, mod.in_features)).reshape(k // m, -1)]
        if mod.bias is not None:
            parts.append(D.sum(1))
    else:
        parts = [_conv_group_grads(mod, x, d, m)]
        if mod.bias is not None:
            parts.append(d.reshape(k // m, m, mod.out_channels, -1).sum((1, 3)))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


class _Layer:
    """Collects one parametrised layer's calls during the forward pass (its input) and the backward pass
    (``d``, the loss gradient at its output), and turns them into a :class:`_Term`. A layer whose
    per-record gradient is small ("small": norm layers, most convolutions) folds every call into ``G``
    as soon as its ``d`` exists, so neither is kept; the others keep ``(input, d)`` of every call."""

    def __init__(self, name: str, mod: torch.nn.Module, n: int, dtype: torch.dtype, group: int) -> None:
        self.name, self.mod, self.n, self.dtype = name, mod, n, dtype
        self.group = group  # records per user when every user has that many, in order; else 1
        self.what = f"layer {name} ({type(mod).__name__})"
        self.names = [f"{name}.{k}" for k, p in mod._parameters.items() if p is not None]
        self.size = sum(p.numel() for p in mod._parameters.values() if p is not None)
        self.conv = isinstance(mod, (torch.nn.Conv1d, torch.nn.Conv2d))
        self.kind: str | None = None
        self.calls: list[list] = []  # [input, d] of every call ("factor", "index")
        self.G: torch.Tensor | None = None
        self.p = self.q = 0
        if isinstance(mod, torch.nn.Linear):
            self.p, self.q = mod.in_features, mod.out_features
        elif self.conv:
            self.p, self.q = mod.in_channels * math.prod(mod.kernel_size), mod.out_channels
        elif isinstance(mod, torch.nn.Embedding):
            self.q = mod.embedding_dim

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """Record one call; returns what to do with its ``d``."""
        if x.dim() < 2 or x.shape[0] != self.n:
            raise ValueError(f"{self.what} is called on {tuple(x.shape)}, not on the {self.n} records")
        if self.conv and x.dim() != (3 if isinstance(self.mod, torch.nn.Conv1d) else 4):
            raise ValueError(f"{self.what} is called on {tuple(x.shape)}: a batch of records is needed")
        if self.kind is None:
            if isinstance(self.mod, torch.nn.Embedding):
                self.kind = "index"
            elif self.q == 0:  # a norm layer
                self.kind = "small"
            else:
                T = out[0].numel() // self.q
                self.kind = "small" if self.size <= T * (self.p + self.q) else "factor"
        if self.kind == "small":
            held = [x]

            def fold(d: torch.Tensor) -> None:
                g = _record_grads(self.mod, held.pop(), d, self.group)
                self.G = g if self.G is None else self.G + g

            return fold
        entry = [x, None]
        self.calls.append(entry)
        return lambda d: entry.__setitem__(1, d)

    def term(self) -> _Term:
        calls = [(x, d) for x, d in self.calls if d is not None]  # a call whose output the loss ignores adds 0
        if self.kind == "small" or not calls:
            G = self.G if self.G is not None else torch.zeros(self.n // self.group, self.size, dtype=self.dtype)
            return _Term("small", self.names, G=G, group=self.group)
        n, p, q, mod = self.n, self.p, self.q, self.mod
        if self.kind == "index":
            idx = torch.cat([x.reshape(n, -1) for x, _ in calls], 1)
            D = torch.cat([d.reshape(n, -1, q) for _, d in calls], 1)
            if mod.padding_idx is not None:
                D = torch.where((idx == mod.padding_idx).unsqueeze(2), torch.zeros((), dtype=D.dtype), D)
            return _Term("index", self.names, rows=lambda sel: (idx[sel], D[sel]), T=idx.shape[1], q=q,
                         num_rows=mod.num_embeddings)  # fmt: skip

        def rows(sel: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            A, D = [], []
            for x, d in calls:
                x, d = x[sel], d[sel]
                A.append(_unfold(mod, x) if self.conv else x.reshape(x.shape[0], -1, p))
                D.append(d.reshape(d.shape[0], q, -1).transpose(1, 2) if self.conv else d.reshape(d.shape[0], -1, q))
            return (A[0], D[0]) if len(calls) == 1 else (torch.cat(A, 1), torch.cat(D, 1))

        T = sum(d[0].numel() // q for _, d in calls)
        return _Term("factor", self.names, rows=rows, T=T, p=p, q=q, bias=mod.bias is not None)


def _forward_backward(problem: TorchModel, w: torch.Tensor, data: UserData) -> list[_Term]:
    """One forward pass with hooks and one backward pass to the layer outputs: every layer's terms.

    No parameter gradient is computed: every hooked output gets ``+ probe`` (a zero scalar leaf), and the
    backward pass asks for the probe's gradient, which needs exactly the gradients at the layer outputs
    (read by tensor hooks as they are formed; a hook registered before an in-place op on the output,
    ``ReLU(inplace=True)``, still gets the gradient at the layer's own output)."""
    w, X, y = problem._prepare(w, data)
    params = {k: v.detach() for k, v in problem._unflatten(w).items()}
    idx, counts = data.user_index, data.counts()
    equal = bool((counts == counts[0]).all()) and bool((idx[1:] >= idx[:-1]).all())
    group = int(counts[0]) if equal and len(idx) else 1  # users' records consecutive, all as many
    layers = {
        name: _Layer(name, mod, X.shape[0], problem.dtype, group)
        for name, mod in problem.module.named_modules()
        if any(p is not None for p in mod._parameters.values())
    }
    probe = torch.zeros((), dtype=problem.dtype, requires_grad=True)

    def keep(layer: _Layer):
        def hook(mod, inputs, output):
            out = output + probe
            out.register_hook(layer.forward(inputs[0].detach(), out))
            return out

        return hook

    handles = [layer.mod.register_forward_hook(keep(layer)) for layer in layers.values()]
    try:
        with torch.enable_grad():
            loss = problem._losses(torch.func.functional_call(problem.module, params, (X,)), y).sum()
    finally:
        for h in handles:
            h.remove()
    for layer in layers.values():
        if layer.kind is None:
            raise ValueError(f"{layer.what} is never called in forward")
    if loss.requires_grad:
        torch.autograd.grad(loss, probe, allow_unused=True)
    return [layer.term() for layer in layers.values()]


def _user_blocks(counts: torch.Tensor, row_cost: int) -> list[torch.Tensor]:
    """Users (positions) in blocks of similar record counts whose padded temporaries hold at most
    :data:`BLOCK_ELEMENTS` floats (``row_cost`` floats per padded record); empty users left out."""
    order = torch.argsort(counts, stable=True)
    order = order[counts[order] > 0]
    c = counts[order].tolist()
    blocks, i = [], 0
    while i < len(c):
        j = i + 1
        while j < len(c) and (j + 1 - i) * c[j] * row_cost <= BLOCK_ELEMENTS:
            j += 1
        blocks.append(order[i:j])
        i = j
    return blocks


def _norms_sq(terms: list[_Term], data: UserData, dtype: torch.dtype) -> torch.Tensor:
    """``||sum_{j in u} g_j||^2`` of every user (not yet divided by m_u^2)."""
    U, idx = data.num_users, data.user_index
    counts = torch.bincount(idx, minlength=U)
    out = torch.zeros(U, dtype=dtype)
    for t in terms:
        if t.kind == "small" and t.group > 1:  # already per user
            out += t.G.pow(2).sum(1)
        elif t.kind == "small":
            out += torch.zeros(U, t.G.shape[1], dtype=dtype).index_add_(0, idx, t.G).pow(2).sum(1)
    factor = [t for t in terms if t.kind != "small"]
    if not factor:
        return out
    grouped = bool((idx[1:] >= idx[:-1]).all())  # records in user order: a block of equal users is a slice
    by_user = torch.arange(len(idx)) if grouped else torch.sort(idx, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    row_cost = max(t.T * (t.q + (t.p if t.kind == "factor" else 1)) for t in factor)
    for users in _user_blocks(counts, row_cost):
        k, M = len(users), int(counts[users].max())
        first = int(starts[users[0]])
        if grouped and bool((counts[users] == M).all()) and bool((users[1:] == users[:-1] + 1).all()):
            sel, mask = slice(first, first + k * M), None
        else:
            slot = torch.arange(M)
            mask = (slot.unsqueeze(0) < counts[users].unsqueeze(1)).reshape(-1)
            sel = by_user[(starts[users].unsqueeze(1) + slot).clamp(max=len(idx) - 1).reshape(-1)]
        for t in factor:
            A, D = t.rows(sel)
            if mask is not None:  # padding records: zero rows (an index row needs only its zero D)
                D = torch.where(mask.view(-1, 1, 1), D, torch.zeros((), dtype=D.dtype))
                if t.kind == "factor":
                    A = torch.where(mask.view(-1, 1, 1), A, torch.zeros((), dtype=A.dtype))
            R = M * t.T  # rows of a user in this block
            Dp = D.reshape(k, R, t.q)
            if t.kind == "index":
                Ip = A.reshape(k, R)
                same = (Ip.unsqueeze(2) == Ip.unsqueeze(1)).to(dtype)
                out[users] += (torch.bmm(Dp, Dp.transpose(1, 2)) * same).sum((1, 2))
                continue
            Ap = A.reshape(k, R, t.p)
            if R * (t.p + t.q) < t.p * t.q:  # Gram form
                gram_a = torch.bmm(Ap, Ap.transpose(1, 2))
                if t.bias:
                    gram_a += 1
                out[users] += (torch.bmm(Dp, Dp.transpose(1, 2)) * gram_a).sum((1, 2))
            else:  # the user's gradient of this layer
                out[users] += torch.bmm(Dp.transpose(1, 2), Ap).pow(2).sum((1, 2))
                if t.bias:
                    out[users] += Dp.sum(1).pow(2).sum(1)
    return out


def _weighted_sum(terms: list[_Term], coef: torch.Tensor, problem: TorchModel) -> torch.Tensor:
    """``sum_j coef_j g_j`` as one flat vector in ``named_parameters()`` order (a record with
    ``coef_j = 0`` has its terms zeroed first, so a non-finite record adds nothing)."""
    keep = None if bool((coef != 0).all()) else coef != 0
    n = len(coef)
    grads: dict[str, torch.Tensor] = {}
    for t in terms:
        if t.kind == "small":  # coef and keep are constant over a user's (consecutive) records
            k = None if keep is None else keep[:: t.group].unsqueeze(1)
            G = t.G if k is None else torch.where(k, t.G, torch.zeros((), dtype=t.G.dtype))
            flat = coef[:: t.group] @ G
            sizes = [size for name, _, size in problem._shapes if name in t.names]
            grads.update(zip(t.names, flat.split(sizes)))
            continue
        if t.kind == "index":
            idx, D = t.rows(slice(None))
            D = D if keep is None else torch.where(keep.view(-1, 1, 1), D, torch.zeros((), dtype=D.dtype))
            D = (D * coef.view(-1, 1, 1)).reshape(-1, t.q)
            grads[t.names[0]] = torch.zeros(t.num_rows, t.q, dtype=D.dtype).index_add_(0, idx.reshape(-1), D)
            continue
        weight = torch.zeros(t.q, t.p, dtype=coef.dtype)
        bias = torch.zeros(t.q, dtype=coef.dtype)
        chunk = max(1, BLOCK_ELEMENTS // (t.T * (t.p + t.q)))
        for s in range(0, n, chunk):
            A, D = t.rows(slice(s, s + chunk))
            c = coef[s : s + chunk]
            if keep is not None:
                k = keep[s : s + chunk].view(-1, 1, 1)
                A = torch.where(k, A, torch.zeros((), dtype=A.dtype))
                D = torch.where(k, D, torch.zeros((), dtype=D.dtype))
            D = (D * c.view(-1, 1, 1)).reshape(-1, t.q)
            weight += D.T @ A.reshape(-1, t.p)
            if t.bias:
                bias += D.sum(0)
        grads[t.names[0]] = weight
        if t.bias:
            grads[t.names[1]] = bias
    return torch.cat([grads[name].reshape(-1) for name, _, _ in problem._shapes])


def user_gradient_norms(problem: TorchModel, w: torch.Tensor, data: UserData) -> tuple[torch.Tensor, list[_Term]]:
    """``||grad f_u(w)||`` of every user of ``data`` (NaN/inf where not finite) and the layer terms."""
    reason = unsupported_reason(problem)
    if reason is not None:
        raise ValueError(f"ghost clipping does not cover this model: {reason}")
    terms = _forward_backward(problem, w, data)
    counts = torch.bincount(data.user_index, minlength=data.num_users).clamp_min(1)
    return torch.sqrt(_norms_sq(terms, data, problem.dtype)) / counts.to(problem.dtype), terms


def ghost_clipped_sum(
    problem: TorchModel, w: torch.Tensor, data: UserData, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_u clip_C(grad f_u(w)), bad)`` over every user of ``data`` (see the module docstring);
    ``bad[u]``: user u's gradient was not finite (it contributes zero). One-line ``ValueError`` for a
    model this does not cover."""
    if data.num_records == 0:
        return torch.zeros(problem.num_params, dtype=problem.dtype), torch.zeros(data.num_users, dtype=torch.bool)
    norms, terms = user_gradient_norms(problem, w, data)
    bad = ~torch.isfinite(norms)
    scale = torch.where(
        norms > clip, clip / torch.clamp(norms, min=torch.finfo(norms.dtype).tiny), torch.ones_like(norms)
    )
    scale = torch.where(bad, torch.zeros_like(scale), scale)
    counts = torch.bincount(data.user_index, minlength=data.num_users).clamp_min(1).to(norms.dtype)
    coef = (scale / counts)[data.user_index]
    return _weighted_sum(terms, coef, problem), bad


def check_against_per_record(problem: TorchModel, w: torch.Tensor, data: UserData, records: int = 3) -> str | None:
    """Compare the user norms of this path with the per-record path on ``records`` records (each its own
    user): None when they agree to :data:`CHECK_ULPS` epsilons, else why not (a parameter used outside its
    layer's call, which hooks cannot see). Raises the one-line ValueError of an uncovered model."""
    k = min(records, data.num_records)
    if k == 0:
        return None
    sub = UserData(data.X[:k], data.y[:k], torch.arange(k), tuple(f"check{i}" for i in range(k)))
    norms, _ = user_gradient_norms(problem, w, sub)
    exact = problem.per_user_gradients(w, sub).norm(dim=1)
    if not bool(torch.isfinite(exact).all()):
        return "the per-record gradients of the first records are not finite, so the check could not run"
    rtol = CHECK_ULPS * torch.finfo(problem.dtype).eps
    if not torch.allclose(norms.to(exact.dtype), exact, rtol=rtol, atol=rtol * float(exact.max())):
        return (
            "its gradient norms differ from the per-record path (a parameter used outside its layer's call, "
            "e.g. F.linear(x, self.fc.weight) or weight tying?)"
        )
    return None


def record_metrics(problem: TorchModel, w: torch.Tensor, data: UserData) -> dict[str, float]:
    """Accuracy and mean RECORD loss (``metrics`` averages the loss over users, which counts users
    without records in this split as zero-loss users)."""
    w, X, y = problem._prepare(w, data)
    with torch.no_grad():
        logits = problem._outputs(w, X)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(1) == y).double().mean()
    return {"loss": float(loss), "accuracy": float(acc)}


__all__ = [
    "SUPPORTED",
    "check_against_per_record",
    "ghost_clipped_sum",
    "record_metrics",
    "unsupported_reason",
    "user_gradient_norms",
]
