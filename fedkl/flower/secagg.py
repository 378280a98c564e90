"""Secure aggregation (SecAgg+) of fedkl's sum queries: the server learns only the sum of the answers.

``fedkl run --backend flower-local|flower-sim|grpc --secagg`` (run-config key ``fedkl-secagg``) makes
:meth:`fedkl.flower.federation.FlowerFederation.sum` aggregate the clipped answers of an algorithm that
only needs their sum (the algorithms registered with ``secagg=True``: noisy-gd, dp-fedavg without adaptive
clipping, dp-sgd/rmsprop/adam/adambc) through the SecAgg+ protocol (Bell et al. 2020) as Flower implements
it. The client side is Flower's own ``flwr.client.mod.secaggplus_mod``, unchanged, installed on fedkl's
ClientApp (:func:`fedkl.flower.client_app.make_client_app`): it intercepts the ``train`` messages of the
protocol, asks fedkl's handler for the user's clipped answer, quantizes it, masks it and returns only the
masked integer vector. The server side is :func:`secure_sum` below: the four SecAgg+ stages (setup,
share keys, collect masked vectors, unmask) over fedkl's Grid, from Flower's primitives (Shamir shares,
ECDH shared keys, the masks' PRG, quantization). Flower's ``SecAggPlusWorkflow`` is not used: it drives a
legacy ``Strategy`` through a ``LegacyContext``, computes a weighted *average* and gives up when a node
drops before the key exchange; fedkl needs the plain sum over its typed queries with its failure policy.

What the server sees: each node's public keys, encrypted key shares it forwards, the masked vector
(uniform mod ``M`` to anyone without the masks), the shares needed to remove the masks, and the sum.
Never a single user's answer (``tests/flower/test_secagg.py`` intercepts every reply reaching the server).

Dropouts: every asked user is a neighbour of every other; a node that fails in any stage (no reply,
error reply, non-finite answer: its ClientApp raises) is dropped from the sum -- it contributes the zero
vector and is reported failed, as without SecAgg -- and the survivors' masks are removed with the
shares of ``threshold = floor(k/2) + 1`` of the ``k`` asked nodes (a majority, so that the server can
never gather both secrets of one node). If fewer than ``threshold`` nodes remain, or fewer than 2 users
were asked (a "sum" of one answer is that answer), nobody contributes: every asked user is reported
failed and the sum is zero. Both are privacy-safe: the Releaser still adds the full noise and charges
every asked user.

Quantization and the sensitivity (the proof the ledger relies on). Let ``C`` be the query's clip norm,
``d`` the parameter count, ``T`` the quantization range and ``Delta = 2C/T`` the quantization step.
The server sends the query with the smaller clip ``C' = (C - 1.001 Delta sqrt(d)) / (1 + CLIP_SLACK)``
(:func:`preclip`; refused if it is not > 0) and SecAgg+ clipping range ``c = C``. An honest client
returns ``x`` with ``||x|| <= C'(1 + CLIP_SLACK)``, so every coordinate is in ``[-c, c]`` (Flower's
coordinate clip does nothing), and quantizes ``q = round_stoch((x + c) T / (2c))`` in ``[0, T]``. The
dequantized contribution ``v = q (2c/T) - c = x + e`` has ``|e_i| < Delta`` (stochastic rounding moves
a coordinate by less than one step; the 1.001 absorbs float64 rounding), so
``||v|| <= ||x|| + Delta sqrt(d) <= C`` for EVERY outcome of the rounding. The server computes
``sum_u v_u = R (2c/T) - k' c`` from the unmasked integer sum ``R`` of the ``k'`` survivors (exact while
``k' T < M``: :func:`quantization_range` picks ``T`` so that ``k T < M``). Hence under replace-one the
dequantized sum moves by at most ``2C`` (add/remove: ``C``), the sensitivity the algorithm already
charges with: the Gaussian added to the dequantized sum, the ledger and the guarantee are unchanged.
(The rounding is randomness independent of the data; a bound holding for each of its outcomes bounds
the Renyi divergence of the mixture.)

Quantization error (:func:`error_bound`): against the same users' answers clipped at ``C`` without
SecAgg, each contribution differs by at most ``||clip_C(g) - clip_C'(g)|| + ||e|| <= (C - C') + Delta
sqrt(d)``, so the sum by at most ``k ((C - C') + Delta sqrt(d))`` (about ``2 k Delta sqrt(d)``; with
``T = 2^22``, ``d = 100`` and ``k = 100`` users: ``1e-3 C``).

What SecAgg+ does NOT give: the server can no longer check an answer (its norm, finiteness), so the
bound above needs every participating client to run fedkl's client (the clip and Flower's mod). A
deviating client can make the modular sum wrap around, which breaks the sensitivity bound for the other
users; without ``--secagg`` the server checks every answer and the guarantee holds against arbitrary
clients. Flower's mask PRG (``pseudo_rand_gen``) seeds numpy's generator with 32 bits folded from each
32-byte secret. The set of users who dropped out is visible to the server, as without SecAgg.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedkl.federation.base import ClippedGradient, ClippedLocalUpdate, GradientDifference, Query
from fedkl.federation.clipping import CLIP_SLACK

# The queries whose answers can be summed securely: one vector of l2 norm <= ``clip`` per user.
SUM_QUERIES: tuple[type[Query], ...] = (ClippedGradient, ClippedLocalUpdate, GradientDifference)
MAX_QUANTIZATION_RANGE = 1 << 22  # Flower's default; smaller when k T would reach the modulus
MODULUS_RANGE = 1 << 32  # Flower's default (masks are uniform on [0, M))
MAX_WEIGHT = 1.0  # every answer has weight 1: a plain (unweighted) sum


class SecAggError(ValueError):
    """Secure aggregation cannot be run as asked (a configuration problem, not a dropout)."""


def quantization_range(num_users: int, cap: int = MAX_QUANTIZATION_RANGE, modulus: int = MODULUS_RANGE) -> int:
    """The largest power of two ``T <= cap`` with ``num_users * T < modulus`` (no wrap-around of the sum)."""
    if num_users < 1:
        raise ValueError("secure aggregation needs at least one user")
    t = 1 << (((modulus - 1) // num_users).bit_length() - 1)
    return min(cap, t)


def step(clip: float, qrange: int) -> float:
    """The quantization step ``Delta = 2 C / T`` of a clipping range ``C`` over ``T`` levels."""
    return 2.0 * clip / qrange


def preclip(clip: float, num_params: int, qrange: int) -> float:
    """The clip ``C'`` the clients apply so that the dequantized answer has norm <= ``clip`` (module doc)."""
    slack = 1.001 * step(clip, qrange) * math.sqrt(num_params)
    c = (clip - slack) / (1.0 + CLIP_SLACK)
    if not c > 0:
        raise SecAggError(
            f"--secagg: the quantization step {step(clip, qrange):.3g} over {num_params} parameters is too coarse "
            f"for clip {clip:g} (fewer users or fewer parameters)"
        )
    return c


def error_bound(clip: float, num_params: int, qrange: int, num_users: int) -> float:
    """Largest l2 distance between the SecAgg sum of ``num_users`` answers and their sum without SecAgg."""
    return num_users * ((clip - preclip(clip, num_params, qrange)) + step(clip, qrange) * math.sqrt(num_params))


def secure_query(query: Query, num_params: int, qrange: int) -> Query:
    """The request sent under SecAgg: ``query`` with its clip lowered to :func:`preclip`."""
    if type(query) not in SUM_QUERIES:
        names = ", ".join(q.__name__ for q in SUM_QUERIES)
        raise SecAggError(f"--secagg sums only clipped answers ({names}), not {type(query).__name__}")
    return dataclasses.replace(query, clip=preclip(query.clip, num_params, qrange))


@dataclasses.dataclass
class SecureSum:
    """The outcome of :func:`secure_sum`: the dequantized sum (None when nobody contributed), the
    nodes it includes, and why each other asked node does not count."""

    total: np.ndarray | None
    included: set[int]
    dropped: dict[int, str]


def secure_sum(
    grid: Any,
    node_ids: Sequence[int],
    request: Any,
    *,
    num_params: int,
    clip: float,
    qrange: int,
    timeout: float | None = None,
    group: str = "fedkl-secagg",
    modulus: int = MODULUS_RANGE,
) -> SecureSum:
    """Run SecAgg+ over ``node_ids``: each node answers ``request`` (a fedkl request ``RecordDict``, the
    query with the :func:`preclip` clip) inside Flower's ``secaggplus_mod``; return the sum of the
    answers of the nodes that completed the protocol, dequantized (clipping range ``clip``)."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.app.message_type import MessageType
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    asked = sorted(set(int(n) for n in node_ids))
    k = len(asked)
    dropped: dict[int, str] = {}
    if k < 2:
        return SecureSum(None, set(), {n: "secagg-too-few: fewer than 2 users in the sum" for n in asked})
    threshold = k // 2 + 1
    shapes = [(1,), (num_params,)]

    def exchange(stage: str, make: Any, nodes: Sequence[int]) -> dict[int, Any]:
        """Send one stage's messages; the configs record of every good reply, by node (others dropped)."""
        msgs = [Message(RecordDict(make(n)), n, MessageType.TRAIN, group_id=group) for n in nodes]
        replies = grid.send_and_receive(msgs, timeout=timeout)
        sent = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}  # ids are set when pushed
        got: dict[int, Any] = {}
        for r in replies:
            n = sent.get(r.metadata.reply_to_message_id)
            if n is None or n in got:
                continue
            if r.has_error():
                dropped[n] = f"secagg-dropped: error in stage {stage} ({r.error.reason[:200]})"
            elif RECORD_KEY_CONFIGS not in r.content.config_records:
                dropped[n] = f"secagg-dropped: malformed reply in stage {stage}"
            else:
                got[n] = r.content.config_records[RECORD_KEY_CONFIGS]
        for n in nodes:
            if n not in got:
                dropped.setdefault(n, f"secagg-dropped: no reply in stage {stage}")
        return got

    def enough(nodes: Any, stage: str) -> bool:
        if len(nodes) >= threshold:
            return True
        for n in asked:
            dropped.setdefault(n, f"secagg-aborted: {len(nodes)} of {k} nodes left after {stage}, {threshold} needed")
        return False

    # stage 0: configuration out, two public keys back
    setup = {
        Key.STAGE: Stage.SETUP,
        Key.SAMPLE_NUMBER: k,
        Key.SHARE_NUMBER: k,
        Key.THRESHOLD: threshold,
        Key.CLIPPING_RANGE: float(clip),
        Key.TARGET_RANGE: int(qrange),
        Key.MOD_RANGE: int(modulus),
        Key.MAX_WEIGHT: MAX_WEIGHT,
    }
    replies = exchange(Stage.SETUP, lambda n: {RECORD_KEY_CONFIGS: ConfigRecord(dict(setup))}, asked)
    keys: dict[int, list[bytes]] = {}
    for n, rec in replies.items():
        pk1, pk2 = rec.get(Key.PUBLIC_KEY_1), rec.get(Key.PUBLIC_KEY_2)
        if isinstance(pk1, bytes) and isinstance(pk2, bytes):
            keys[n] = [pk1, pk2]
        else:
            dropped[n] = "secagg-dropped: no public keys in stage setup"
    if not enough(keys, Stage.SETUP):
        return SecureSum(None, set(), dropped)

    # stage 1: everyone's public keys out, encrypted shares (for each other node) back
    def share_keys(n: int) -> dict:
        rec = ConfigRecord({str(m): keys[m] for m in keys})
        rec[Key.STAGE] = Stage.SHARE_KEYS
        return {RECORD_KEY_CONFIGS: rec}

    replies = exchange(Stage.SHARE_KEYS, share_keys, sorted(keys))
    a1 = set(replies)
    fwd: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in a1}
    for src, rec in replies.items():
        for dst, ctxt in zip(rec.get(Key.DESTINATION_LIST, []), rec.get(Key.CIPHERTEXT_LIST, [])):
            if dst in fwd and dst != src:
                fwd[dst][0].append(src)
                fwd[dst][1].append(ctxt)
    if not enough(a1, Stage.SHARE_KEYS):
        return SecureSum(None, set(), dropped)

    # stage 2: the shares addressed to each node, with the query; masked vectors back
    def collect(n: int) -> dict:
        content = {name: request[name] for name in request.keys()}
        srcs, ctxts = fwd[n]
        content[RECORD_KEY_CONFIGS] = ConfigRecord(
            {Key.STAGE: Stage.COLLECT_MASKED_VECTORS, Key.CIPHERTEXT_LIST: ctxts, Key.SOURCE_LIST: srcs}
        )
        return content

    replies = exchange(Stage.COLLECT_MASKED_VECTORS, collect, sorted(a1))
    masked = [np.zeros(s, dtype=np.int64) for s in shapes]
    a2: set[int] = set()
    for n, rec in replies.items():
        try:
            vec = [bytes_to_ndarray(b) for b in rec[Key.MASKED_PARAMETERS]]
            if [v.shape for v in vec] != shapes or any(v.dtype.kind not in "iu" for v in vec):
                raise ValueError(f"shapes {[v.shape for v in vec]}")
            if any(((v < 0) | (v >= modulus)).any() for v in vec):
                raise ValueError("entries outside [0, M)")
        except Exception as exc:  # a malformed masked vector: the node is dropped, its masks removed
            dropped[n] = f"secagg-dropped: invalid masked vector ({type(exc).__name__}: {exc})"
            continue
        masked = [(a + v.astype(np.int64)) % modulus for a, v in zip(masked, vec)]
        a2.add(n)
    dead = sorted(a1 - a2)
    if not enough(a2, Stage.COLLECT_MASKED_VECTORS):
        return SecureSum(None, set(), dropped)

    # stage 3: who is in and who dropped out; the shares to remove the masks back
    def unmask(n: int) -> dict:
        rec = ConfigRecord({Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: sorted(a2), Key.DEAD_NODE_ID_LIST: dead})
        return {RECORD_KEY_CONFIGS: rec}

    replies = exchange(Stage.UNMASK, unmask, sorted(a2))
    shares: dict[int, list[bytes]] = {n: [] for n in a1}
    for rec in replies.values():
        for owner, share in zip(rec.get(Key.NODE_ID_LIST, []), rec.get(Key.SHARE_LIST, [])):
            if owner in shares and isinstance(share, bytes):
                shares[owner].append(share)
    short = [n for n in a1 if len(shares[n]) < threshold]
    if short:  # the masks cannot be removed: nobody contributes
        for n in asked:
            dropped.setdefault(n, f"secagg-aborted: too few shares to unmask {len(short)} node(s)")
        return SecureSum(None, set(), dropped)
    for n in sorted(a2):  # the survivors' private masks
        mask = pseudo_rand_gen(combine_shares(shares[n]), modulus, shapes)
        masked = [(a - m) % modulus for a, m in zip(masked, mask)]
    for n in dead:  # the pairwise masks the survivors added with the nodes that dropped in stage 2
        sk1 = bytes_to_private_key(combine_shares(shares[n]))
        for m in sorted(a2):
            pair = pseudo_rand_gen(generate_shared_key(sk1, bytes_to_public_key(keys[m][0])), modulus, shapes)
            sign = 1 if n > m else -1  # m subtracted the mask when m < n, added it when m > n
            masked = [(a + sign * p) % modulus for a, p in zip(masked, pair)]
    weights, total = int(masked[0][0]), masked[1]
    if weights != len(a2) * qrange:  # every survivor's weight is T: anything else is a broken sum
        for n in asked:
            dropped.setdefault(n, f"secagg-aborted: the unmasked weight {weights} is not {len(a2)} x {qrange}")
        return SecureSum(None, set(), dropped)
    values = total.astype(np.float64) * (2.0 * clip / qrange) - len(a2) * clip
    for n in a2:
        dropped.pop(n, None)
    return SecureSum(values, a2, dropped)
