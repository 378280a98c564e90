"""The Flower backend: :class:`FlowerFederation`, the federation interface over a Flower ``Grid``.

Each user is one Flower node running ``fedkl/flower/client_app.py``'s ClientApp, which holds that user's records.
A request is one ``query.fedkl`` message per asked user, sent with ``Grid.send_and_receive``; the
replies are decoded by :mod:`fedkl.flower.codec` and stacked in the order of the asked users,
so ``Answers.total()`` sums them in user order exactly as the in-process backend does.

Failure policy (the in-process one, :mod:`fedkl.federation.base`): a user whose reply is missing
(dropout, timeout, node never connected), is an error reply, cannot be decoded, has the wrong
shape/dtype, is not finite, or (for clipped queries) has a norm above the clip bound contributes
the zero vector and is listed in ``failed``. Every contribution still has norm <= C, so the
sensitivity of the sum, hence the noise, is unchanged; the algorithm charges every asked user.

Every failure is recorded with its reason (:attr:`FlowerFederation.failures`, :meth:`failure_report`,
saved as result.json's ``failures``): per request (noisy GD makes one per round) the failed users and why,
in the categories of :data:`FAILURE_KINDS`, and the counts per category.

Node ids are mapped to user positions by a handshake (``info`` request) at construction: each node
reports its ``partition-id``, the number of partitions, its user id and the parameter count.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from fedkl.federation.base import Answers, Federation, Query
from fedkl.federation.clipping import CLIP_SLACK as CLIP_SLACK  # re-exported (the accepted excess over a clip)
from fedkl.flower import codec

log = logging.getLogger(__name__)

# Why a user's answer was not used (result.json's ``failures``):
FAILURE_KINDS = {
    "absent": "no node holds this user (never connected, refused at the handshake)",
    "no-reply": "no reply within the request's timeout (dropped out, crashed, or too slow)",
    "non-finite": "the answer (or the user's own computation) was NaN or infinite",
    "wrong-shape": "an answer of another shape, dtype or size than the query's",
    "out-of-bound": "an answer beyond the query's bound (e.g. a norm above the clip)",
    "client-error": "the client answered with an error",
    "bad-reply": "a reply that is not in the fedkl format",
    "secagg-dropped": "dropped out of a secure aggregation (its masks were removed; it contributes zero)",
    "secagg-aborted": "a secure aggregation that could not complete (too few nodes left): nobody contributes",
    "secagg-too-few": "a secure aggregation of fewer than 2 users is not run: nobody contributes",
}


def failure_kind(exc: Exception) -> str:
    """The :data:`FAILURE_KINDS` category of a rejected reply."""
    if isinstance(exc, codec.ReplyError):
        return "non-finite" if exc.code == codec.ERR_NOT_FINITE else "client-error"
    text = str(exc)
    if isinstance(exc, codec.CodecError):
        if "NaN or inf" in text:
            return "non-finite"
        if any(w in text for w in ("shape", "dtype", "payload", "exceeds")):
            return "wrong-shape"
        return "bad-reply"
    return "out-of-bound"  # the query's own check_answer (ValueError)


class FlowerFederation(Federation):
    """Per-user queries over a Flower ``Grid`` (see the module docstring).

    Args:
        grid: a Flower ``Grid`` (the ServerApp's, or :class:`fedkl.flower.localgrid.LocalGrid`).
        user_ids: the enrolled users in position order, if the server knows them (e.g. from the
            enrolment list). Then nodes that are missing at the handshake just always fail; without
            it every partition must answer the handshake.
        num_users: the expected number of users (if ``user_ids`` is not given).
        timeout: seconds to wait for the replies of one request (None: wait for all).
        handshake_timeout: the same for the handshake.
        wait_for_nodes: seconds to wait for the expected number of nodes to connect.
        dtype: dtype of the returned values (float64 on the wire).
        secagg: aggregate :meth:`sum` requests through SecAgg+ (:mod:`fedkl.flower.secagg`): the server
            learns only the sum of the answers, and :meth:`compute` (per-user answers) is refused.
    """

    def __init__(
        self,
        grid: Any,
        *,
        user_ids: Sequence[str] | None = None,
        num_users: int | None = None,
        timeout: float | None = None,
        handshake_timeout: float | None = 120.0,
        wait_for_nodes: float = 120.0,
        dtype: torch.dtype = torch.float64,
        secagg: bool = False,
    ) -> None:
        self.grid = grid
        self.secagg = secagg
        self.timeout = timeout
        self.dtype = dtype
        self._group = itertools.count()
        self.last_errors: dict[int, str] = {}  # user position -> why its answer was rejected (last request)
        self.failures: list[dict] = []  # per request: {"request", "query", "asked", "failed": {user id: kind: why}}
        self._closers: list = []
        expected = len(user_ids) if user_ids is not None else num_users
        self._handshake(user_ids, expected, handshake_timeout, wait_for_nodes)

    # --- handshake -----------------------------------------------------------------------------
    def _handshake(
        self, user_ids: Sequence[str] | None, expected: int | None, timeout: float | None, wait: float
    ) -> None:
        deadline = time.monotonic() + wait
        nodes = sorted(self.grid.get_node_ids())
        while expected is not None and len(nodes) < expected and time.monotonic() < deadline:
            time.sleep(0.2)
            nodes = sorted(self.grid.get_node_ids())
        if not nodes:
            raise RuntimeError("no Flower node is connected")
        msgs = [self._message(codec.INFO, nid) for nid in nodes]
        replies = self.grid.send_and_receive(msgs, timeout=timeout)
        infos: dict[int, codec.NodeInfo] = {}
        refused: list[str] = []
        for nid, reply in self._match(msgs, replies).items():
            try:
                infos[nid] = codec.decode_info(reply)
            except codec.ReplyError as exc:
                if exc.code == codec.ERR_DATA:  # a site whose own data breaks the run's schema
                    refused.append(exc.reason)
                log.warning("node %s: invalid handshake reply (%s); it will not be asked", nid, exc)
            except codec.CodecError as exc:
                log.warning("node %s: invalid handshake reply (%s); it will not be asked", nid, exc)
        if refused:
            raise RuntimeError(f"{len(refused)} node(s) refused their own data: " + "; ".join(sorted(refused)))
        if not infos:
            raise RuntimeError(f"none of the {len(nodes)} Flower nodes answered the fedkl handshake")
        params = {i.num_params for i in infos.values()}
        parts = {i.num_partitions for i in infos.values()}
        if len(params) != 1 or len(parts) != 1:
            raise RuntimeError(
                f"nodes disagree on the problem: num_params {sorted(params)}, num_partitions {sorted(parts)}"
            )
        n = expected if expected is not None else parts.pop()
        node_of: dict[int, int] = {}
        ids: list[str | None] = list(user_ids) if user_ids is not None else [None] * n
        for nid, info in sorted(infos.items()):
            if info.num_partitions != n:
                raise RuntimeError(f"node {nid} holds a dataset of {info.num_partitions} users, expected {n}")
            if info.partition_id in node_of:
                raise RuntimeError(f"two nodes claim user position {info.partition_id}")
            if user_ids is not None and info.user_id != user_ids[info.partition_id]:
                raise RuntimeError(
                    f"node {nid} holds user {info.user_id!r} at position {info.partition_id}, "
                    f"expected {user_ids[info.partition_id]!r}"
                )
            node_of[info.partition_id] = nid
            ids[info.partition_id] = info.user_id
        missing = [u for u in range(n) if u not in node_of]
        if user_ids is None and missing:
            raise RuntimeError(
                f"{len(missing)} user positions have no node (e.g. {missing[:5]}); "
                "pass user_ids to run with them absent (they then always fail)"
            )
        if missing:
            log.warning(
                "%d enrolled users have no node (%s%s); they contribute zero and are reported failed ('absent')",
                len(missing),
                ", ".join(repr(ids[u]) for u in missing[:10]),
                ", ..." if len(missing) > 10 else "",
            )
        self._user_ids = tuple(str(i) for i in ids)
        self._num_params = params.pop()
        self.node_of = node_of
        self.missing = missing

    # --- Federation interface ------------------------------------------------------------------
    @property
    def sums_only(self) -> bool:  # type: ignore[override]
        return self.secagg

    @property
    def user_ids(self) -> tuple[str, ...]:
        return self._user_ids

    @property
    def num_params(self) -> int:
        return self._num_params

    def compute(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        """Every asked user's answer, validated by the query itself: the request before it is sent
        (:meth:`~fedkl.federation.base.Query.check_request`, ValueError as in-process), each reply's
        shape by the codec and its content by :meth:`~fedkl.federation.base.Query.check_answer`."""
        if self.secagg:
            raise ValueError(
                f"--secagg: this federation releases sums only; per-user answers ({type(query).__name__}) are refused"
            )
        users = self._users(users)
        if not isinstance(query, Query):
            raise TypeError(f"unsupported query type {type(query).__name__}")
        query.check_request(self.num_params, len(users))
        kind = codec.kind_of(query.for_user(0))  # TypeError for a query type that cannot travel
        values = torch.zeros((len(users),) + query.answer_shape(self.num_params), dtype=self.dtype)
        errors: dict[int, str] = {}
        kinds: dict[int, str] = {}
        asked = [(row, u) for row, u in enumerate(users) if u in self.node_of]
        for row, u in enumerate(users):
            if u not in self.node_of:
                errors[u], kinds[u] = "no node for this user", "absent"
        if asked:
            group = f"fedkl-{next(self._group)}"
            sent = {row: query.for_user(row) for row, _ in asked}
            msgs = [self._message(sent[row], self.node_of[u], group) for row, u in asked]
            replies = self._match(msgs, self.grid.send_and_receive(msgs, timeout=self.timeout))
            for row, u in asked:
                reply = replies.get(self.node_of[u])
                if reply is None:
                    errors[u], kinds[u] = "no reply (dropout or timeout)", "no-reply"
                    continue
                try:
                    v = codec.decode_answer(reply, sent[row], self.num_params)
                    sent[row].check_answer(v)
                    values[row] = query.user_answer(v).to(self.dtype)
                except (codec.CodecError, codec.ReplyError, ValueError) as exc:
                    errors[u], kinds[u] = str(exc), failure_kind(exc)
        self.last_errors = errors
        self.failures.append(
            {
                "request": len(self.failures),
                "query": kind,
                "asked": len(users),
                "failed": {self._user_ids[u]: f"{kinds[u]}: {errors[u]}" for u in users if u in errors},
            }
        )
        failed = [u for u in users if u in errors]
        if failed:
            log.warning(
                "%s request %d: %d of %d users failed (%s)",
                kind,
                len(self.failures) - 1,
                len(failed),
                len(users),
                ", ".join(f"{k} {list(kinds.values()).count(k)}" for k in sorted(set(kinds.values()))),
            )
        return Answers(users=users, values=values, failed=failed)

    def sum(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        """Without ``secagg``: :meth:`compute`. With it: the SecAgg+ sum of the asked users' answers
        (:func:`fedkl.flower.secagg.secure_sum`), one row; the users not in the sum are ``failed``
        (they contribute zero, as a failed user does without SecAgg)."""
        if not self.secagg:
            return self.compute(query, users)
        from fedkl.flower import secagg

        users = self._users(users)
        query.check_request(self.num_params, len(users))
        kind = codec.kind_of(query)
        qrange = secagg.quantization_range(max(len(users), 1))
        sent = secagg.secure_query(query, self.num_params, qrange)
        nodes = {self.node_of[u]: u for u in users if u in self.node_of}
        out = secagg.secure_sum(
            self.grid,
            list(nodes),
            codec.encode_request(sent),
            num_params=self.num_params,
            clip=query.clip,
            qrange=qrange,
            timeout=self.timeout,
            group=f"fedkl-secagg-{next(self._group)}",
        )
        reasons = {u: "absent: no node for this user" for u in users if u not in self.node_of}
        reasons.update({nodes[n]: why for n, why in out.dropped.items()})
        values = torch.zeros((1, self.num_params), dtype=self.dtype)
        if out.total is not None:
            values[0] = torch.from_numpy(out.total).to(self.dtype)
        failed = [u for u in users if u in reasons]
        self.last_errors = {u: reasons[u] for u in failed}
        self.failures.append(
            {
                "request": len(self.failures),
                "query": kind,
                "asked": len(users),
                "secagg": {"included": len(out.included), "quantization_range": qrange},
                "failed": {self._user_ids[u]: reasons[u] for u in failed},
            }
        )
        if failed:
            log.warning(
                "%s secure sum %d: %d of %d users not in the sum", kind, len(self.failures) - 1, len(failed), len(users)
            )
        return Answers(users=users, values=values, failed=failed)

    def failure_report(self) -> dict:
        """result.json's ``failures``: counts per :data:`FAILURE_KINDS` category over the run, and
        every request that had failures with each failed user's reason."""
        counts: dict[str, int] = {}
        for rec in self.failures:
            for why in rec["failed"].values():
                k = why.split(":", 1)[0]
                counts[k] = counts.get(k, 0) + 1
        return {
            "counts": counts,
            "kinds": {k: FAILURE_KINDS[k] for k in counts},
            "requests": len(self.failures),
            "by_request": [r for r in self.failures if r["failed"]],
        }

    # --- lifetime ------------------------------------------------------------------------------
    def on_close(self, fn) -> None:
        """Register a cleanup (e.g. stopping the Flower runtime) for :meth:`close`."""
        self._closers.append(fn)

    def close(self) -> None:
        """Release the transport (idempotent); the federation can no longer be asked."""
        while self._closers:
            self._closers.pop()()

    def __enter__(self) -> "FlowerFederation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- messages ------------------------------------------------------------------------------
    def _message(self, query: Query | str, node_id: int, group: str = "fedkl-info") -> Any:
        from flwr.app import Message

        return Message(codec.encode_request(query), node_id, codec.MESSAGE_TYPE, group_id=group)

    @staticmethod
    def _match(msgs: list[Any], replies: Any) -> dict[int, Any]:
        """Replies keyed by the node id of the request they answer (by reply-to message id; a node
        that answers twice or a reply to nothing we sent is ignored)."""
        by_id = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}
        out: dict[int, Any] = {}
        dup: set[int] = set()
        for r in replies:
            nid = by_id.get(r.metadata.reply_to_message_id)
            if nid is None:
                continue
            if nid in out:
                dup.add(nid)
            out[nid] = r
        for nid in dup:  # ambiguous: treat as no answer
            del out[nid]
        return out
