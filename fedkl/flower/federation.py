"""The Flower backend: :class:`FlowerFederation`, the federation interface over a Flower ``Grid``.

Each user is one Flower node running ``fedkl/flower/client_app.py``'s ClientApp, which holds that user's records.
A request is one ``query.fedkl`` message per asked user, sent with ``Grid.send_and_receive``; the
replies are decoded by :mod:`fedkl.flower.codec` and stacked in the order of the asked users,
so ``Answers.total()`` sums them in user order exactly as the in-process backend does.

In a simulation a node may hold a block of users (its handshake is a :class:`~fedkl.flower.codec.BlockInfo`;
:attr:`FlowerFederation.blocks`): it gets one message per request carrying each of its asked users' queries
and replies with each user's own answer and status (:func:`~fedkl.flower.codec.decode_block_answer`). Every
user's answer is then checked exactly as a one-user node's (the query's ``check_answer``, e.g. the clip norm
recomputed here), and a user fails alone; a block reply that is invalid as a whole, or missing, fails each of
the block's users by name. SecAgg+ with block nodes is refused (it masks per node).

Failure policy (the in-process one, :mod:`fedkl.federation.base`): a user whose reply is missing
(dropout, timeout, node never connected), is an error reply, cannot be decoded, has the wrong
shape/dtype, is not finite, or (for clipped queries) has a norm above the clip bound contributes
the zero vector and is listed in ``failed``. Every contribution still has norm <= C, so the
sensitivity of the sum, hence the noise, is unchanged; the algorithm charges every asked user.

Every failure is recorded with its reason (:attr:`FlowerFederation.failures`, :meth:`failure_report`,
saved as result.json's ``failures``): per request (noisy GD makes one per round) the failed users and why,
in the categories of :data:`FAILURE_KINDS`, and the counts per category.

Node ids are mapped to user positions by a handshake (``info`` request) at construction: each node
reports its ``partition-id``, the number of partitions, its user id and the parameter count. The
handshake waits on events (:meth:`FlowerFederation._gather_infos`) with deadlines that scale with the
federation (:func:`connect_deadline`, :func:`answer_deadline`) and with the load (nodes still online at the
answer deadline are waited for longer, :data:`STALL_FACTOR`); users with no node at the deadline are
named in one line and, with an enrolment, fail 'absent' every request (charged, zero); without one the
run is refused. Duplicate claims of a user follow :data:`DUPLICATE_RULE`; a node that reports another
model size than the server's problem (``num_params``, a public server-side fact) or another number of
users than the enrolment is refused alone (its user fails 'wrong-model' or 'absent', charged, zero), never
the run; refused nodes and unserved users are saved in ``failures["handshake"]``. A run with no node left
to ask is refused in one line.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedkl.federation.base import Answers, Federation, Query, failure_summary
from fedkl.federation.clipping import CLIP_SLACK as CLIP_SLACK  # re-exported (the accepted excess over a clip)
from fedkl.flower import codec

log = logging.getLogger(__name__)

# Why a user's answer was not used (result.json's ``failures``):
FAILURE_KINDS = {
    "absent": "no node holds this user (never connected, no handshake reply in time, or its claimant refused)",
    "duplicate-claim": "several nodes claimed this user and the enrolment binds none of them: none is asked",
    "wrong-model": "its node answers for a model of another size than the server's problem: it is not asked",
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


# The handshake's deadlines when not given (seconds): they scale with the federation, because the nodes'
# ClientApps start concurrently (on one loaded machine in a local deployment). The waits return on the
# event (every expected node answered); the deadlines only bound how long a missing node is waited for.
CONNECT_BASE_S, CONNECT_PER_NODE_S = 60.0, 2.0  # for the expected nodes to connect
ANSWER_BASE_S, ANSWER_PER_NODE_S = 120.0, 10.0  # for a connected node to answer its handshake
POLL_S = 0.5  # how often the nodes and the replies are polled
# At the answer deadline a node that is still online (its SuperNode heartbeats, so the SuperLink lists it: its
# ClientApp is starting on a loaded machine) is waited for up to this many times the wait so far; a node that
# went offline (crashed) is not. Only with the default deadlines: an explicit handshake_timeout is kept.
STALL_FACTOR = 4.0

DUPLICATE_RULE = (
    "a user position claimed by several nodes: the node the enrolment binds to the user serves it and the "
    "others are refused; without a binding none is asked and the user fails 'duplicate-claim' (charged, zero)"
)


def connect_deadline(num_nodes: int) -> float:
    """Seconds to wait for ``num_nodes`` expected nodes to connect: :data:`CONNECT_BASE_S` + :data:`CONNECT_PER_NODE_S` each."""
    return CONNECT_BASE_S + CONNECT_PER_NODE_S * num_nodes


def answer_deadline(num_nodes: int) -> float:
    """Seconds for the handshake replies of ``num_nodes`` asked nodes: :data:`ANSWER_BASE_S` + :data:`ANSWER_PER_NODE_S` each."""
    return ANSWER_BASE_S + ANSWER_PER_NODE_S * num_nodes


def _first(names: Sequence[Any], k: int = 5) -> str:
    """``'a', 'b', ... (+N more)``: the first ``k`` names and how many others."""
    head = ", ".join(repr(x) for x in names[:k])
    return head + (f", ... (+{len(names) - k} more)" if len(names) > k else "")


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


_ACCEPTED = object()  # a block user's answer already checked and stored


def _users_in(reply: Any) -> int:
    """How many users a handshake reply answers for: a block node's count, else 1 (an invalid reply counts
    as its one node, as before blocks: it is refused after the wait)."""
    try:
        return len(codec.decode_info(reply).positions)
    except Exception:
        return 1


class _EgressGrid:
    """A Grid whose sends (``push_messages``, ``send_and_receive``) first call the federation's
    ``before_send`` hook: every message to a node, SecAgg+ stages included, leaves the process only
    after the release journal is durable (:mod:`fedkl.privacy.journal`). Everything else is the grid's."""

    def __init__(self, grid: Any, federation: Federation) -> None:
        self._grid = grid
        self._federation = federation

    def _egress(self) -> None:
        hook = self._federation.before_send
        if hook is not None:
            hook()

    def push_messages(self, messages: Any) -> Any:
        self._egress()
        return self._grid.push_messages(messages)

    def send_and_receive(self, messages: Any, **kw: Any) -> Any:
        self._egress()
        return self._grid.send_and_receive(messages, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class FlowerFederation(Federation):
    """Per-user queries over a Flower ``Grid`` (see the module docstring).

    Args:
        grid: a Flower ``Grid`` (the ServerApp's, or :class:`fedkl.flower.localgrid.LocalGrid`).
        user_ids: the enrolled users in position order, if the server knows them (e.g. from the
            enrolment list). Then nodes that are missing at the handshake just always fail; without
            it every partition must answer the handshake.
        num_users: the expected number of users (if ``user_ids`` is not given).
        timeout: seconds to wait for the replies of one request (None: wait for all).
        handshake_timeout: seconds a connected node has to answer the handshake (None: :func:`answer_deadline`
            of the nodes asked, which scales with the federation).
        wait_for_nodes: seconds to wait for the expected nodes to connect (None: :func:`connect_deadline`).
            Both waits end as soon as every expected node answered; at the deadline the missing users are
            named (first few + count) and, with ``user_ids``, fail ('absent') and are charged every request.
        bindings: user id -> the node id the enrolment binds it to (decides duplicate claims:
            :data:`DUPLICATE_RULE`).
        num_params: the server's model size (its own problem's ``num_params``): a node reporting another
            size is refused and its user fails 'wrong-model'. Without it the nodes must agree (else the run
            is refused: the server cannot tell which of them is wrong).
        clock: ``monotonic()`` and ``sleep()`` for the waits (default: the grid's ``clock`` if it has one,
            e.g. a LocalGrid in simulated time, else :mod:`time`).
        dtype: dtype of the returned values (float64 on the wire).
        secagg: aggregate :meth:`sum` requests through SecAgg+ (:mod:`fedkl.flower.secagg`): the server
            learns only the sum of the answers, and :meth:`compute` (per-user answers) is refused.
    """

    clients_run_own_code = True  # every node runs its own ClientApp: fedkl.privacy.clients, "deployed"

    def __init__(
        self,
        grid: Any,
        *,
        user_ids: Sequence[str] | None = None,
        num_users: int | None = None,
        timeout: float | None = None,
        handshake_timeout: float | None = None,
        wait_for_nodes: float | None = None,
        dtype: torch.dtype = torch.float64,
        secagg: bool = False,
        bindings: Mapping[str, int] | None = None,
        clock: Any = None,
        num_params: int | None = None,
    ) -> None:
        self.grid = _EgressGrid(grid, self)  # sends call self.before_send first (the journal's flush)
        self.clock = clock if clock is not None else getattr(grid, "clock", time)
        self.secagg = secagg
        self.timeout = timeout
        self.dtype = dtype
        self._group = itertools.count()
        self.last_errors: dict[int, str] = {}  # user position -> why its answer was rejected (last request)
        self.failures: list[dict] = []  # per request: {"request", "query", "asked", "failed": {user id: kind: why}}
        self._closers: list = []
        expected = len(user_ids) if user_ids is not None else num_users
        self._handshake(user_ids, expected, handshake_timeout, wait_for_nodes, bindings, num_params)

    # --- handshake -----------------------------------------------------------------------------
    def _handshake(
        self,
        user_ids: Sequence[str] | None,
        expected: int | None,
        timeout: float | None,
        wait: float | None,
        bindings: Mapping[str, int] | None,
        num_params: int | None,
    ) -> None:
        infos, waited = self._gather_infos(expected, timeout, wait)
        if not infos:
            raise RuntimeError(
                f"no Flower node connected within {waited:.0f} s"
                + (f" (expected {expected})" if expected is not None else "")
            )
        refused: list[str] = []
        ok: dict[int, codec.NodeInfo] = {}
        self.refused_nodes: dict[int, str] = {}  # node id -> why it is never asked
        for nid, reply in sorted(infos.items()):
            if reply is None:
                self.refused_nodes[nid] = "no handshake reply before the deadline"
                continue
            try:
                ok[nid] = codec.decode_info(reply)
            except codec.ReplyError as exc:
                if exc.code == codec.ERR_DATA:  # a site whose own data breaks the run's schema
                    refused.append(exc.reason)
                self.refused_nodes[nid] = f"invalid handshake reply ({exc})"
            except codec.CodecError as exc:
                self.refused_nodes[nid] = f"invalid handshake reply ({exc})"
        if refused:
            raise RuntimeError(f"{len(refused)} node(s) refused their own data: " + "; ".join(sorted(refused)))
        if not ok:
            raise RuntimeError(
                f"none of the {len(infos)} Flower nodes answered the fedkl handshake within {waited:.0f} s"
                + (f" (expected {expected})" if expected is not None else "")
            )
        if num_params is None:  # no server-side fact to judge by: the nodes must agree
            sizes = {i.num_params for i in ok.values()}
            if len(sizes) != 1:
                raise RuntimeError(
                    f"nodes disagree on the model size (num_params {sorted(sizes)}); pass num_params "
                    "(the server's problem) to refuse the nodes that differ"
                )
            num_params = sizes.pop()
        if expected is None:  # likewise for the number of users
            parts = {i.num_partitions for i in ok.values()}
            if len(parts) != 1:
                raise RuntimeError(
                    f"nodes disagree on the number of users ({sorted(parts)}); pass user_ids (the enrolment) "
                    "to refuse the nodes that differ"
                )
        n = expected if expected is not None else next(iter(ok.values())).num_partitions
        ids: list[str | None] = list(user_ids) if user_ids is not None else [None] * n
        claims: dict[int, list[int]] = {}  # user position -> the nodes claiming it
        wrong_model: dict[int, str] = {}  # user position -> why its (otherwise consistent) claimant was refused
        for nid, info in ok.items():  # a block node (codec.BlockInfo) claims each of its positions
            wrong_user = next(
                (p for p in info.positions if user_ids is not None and p < n and info.user_at(p) != user_ids[p]), None
            )
            if info.num_partitions != n:
                self.refused_nodes[nid] = f"holds a dataset of {info.num_partitions} users, expected {n}"
            elif wrong_user is not None:
                self.refused_nodes[nid] = (
                    f"claims user {info.user_at(wrong_user)!r} at position {wrong_user}, "
                    f"enrolled there: {user_ids[wrong_user]!r}"
                )
            elif info.num_params != num_params:
                why = f"answers for a model of {info.num_params} parameters; the server's problem has {num_params}"
                self.refused_nodes[nid] = why
                for p in info.positions:
                    wrong_model[p] = f"node {nid} {why}"
            else:
                for p in info.positions:
                    claims.setdefault(p, []).append(nid)
        # nodes holding several users: asked once per request for all their asked users (block messages)
        self.blocks = {nid for nid, info in ok.items() if isinstance(info, codec.BlockInfo)}
        if self.blocks and self.secagg:
            raise RuntimeError("--secagg needs one user per node (SecAgg+ masks per node): run with --users-per-node 1")
        node_of, self.unserved = self._resolve_claims(claims, ok, ids, bindings, n)
        for p, why in wrong_model.items():
            if p not in node_of and self.unserved[p][0] == "absent":  # no other node claims it
                self.unserved[p] = ("wrong-model", why)
        if user_ids is None and self.unserved:
            raise RuntimeError(
                f"{len(self.unserved)} user positions have no node after {waited:.0f} s "
                f"({_first(sorted(self.unserved))}); pass user_ids (the enrolment) to run with them failed"
            )
        if not node_of:
            reasons = sorted(set(self.refused_nodes.values()))
            raise RuntimeError(
                f"no Flower node is left to ask: all {len(infos)} were refused ({reasons[0]}"
                + (f"; +{len(reasons) - 1} other reason(s))" if len(reasons) > 1 else ")")
            )
        self._user_ids = tuple(str(i) for i in ids)
        self._num_params = num_params
        self.node_of = node_of
        self.missing = sorted(u for u, (kind, _) in self.unserved.items() if kind == "absent")
        for nid, why in sorted(self.refused_nodes.items()):
            log.warning("node %s is refused: %s", nid, why)
        if self.unserved:
            log.warning(
                "%d of %d enrolled users have no node after %.0f s (%s); they contribute zero, are charged, "
                "and are reported failed",
                len(self.unserved),
                n,
                waited,
                _first([self._user_ids[u] for u in sorted(self.unserved)]),
            )
        self.handshake = {
            "waited_s": round(waited, 3),
            "nodes": len(set(node_of.values())),  # serving nodes (a block node serves several users)
            "unserved": {self._user_ids[u]: f"{k}: {why}" for u, (k, why) in sorted(self.unserved.items())},
            "refused_nodes": {str(nid): why for nid, why in sorted(self.refused_nodes.items())},
        }

    def _gather_infos(
        self, expected: int | None, timeout: float | None, wait: float | None
    ) -> tuple[dict[int, Any], float]:
        """Ask every node that connects for its info, on events: poll ``get_node_ids()`` and the replies
        every :data:`POLL_S` and return as soon as ``expected`` nodes answered (or, when ``expected`` is
        unknown, every connected node answered). Nodes are admitted until the connect deadline
        (``wait``, default :func:`connect_deadline`); a node asked at time t must answer by t plus the
        answer deadline (``timeout``, default :func:`answer_deadline` of the nodes asked so far).
        At the answer deadline, the asked nodes still online are waited for up to :data:`STALL_FACTOR`
        times the wait so far (default deadlines only; the nodes that went offline are given up).
        Returns node id -> reply (None: no reply in time) and the seconds waited."""
        clock = self.clock
        stall_by: float | None = None  # set at the answer deadline when asked nodes are still online
        start = clock.monotonic()
        connect_by = start + (connect_deadline(expected or 0) if wait is None else wait)
        answer_by = start
        pending: dict[str, int] = {}  # message id -> node id
        replies: dict[int, Any] = {}
        answered = 0  # the users the replies so far answer for (the expected count is of users)
        first = True
        while True:
            now = clock.monotonic()
            if first or now < connect_by:
                new = [nid for nid in sorted(self.grid.get_node_ids()) if nid not in replies]
                if new:
                    msgs = [self._message(codec.INFO, nid) for nid in new]
                    for mid, nid in zip(self.grid.push_messages(msgs), new):
                        pending[mid] = nid
                        replies[nid] = None
                    allowance = answer_deadline(len(replies)) if timeout is None else timeout
                    answer_by = max(answer_by, now + allowance)
            first = False
            for r in self.grid.pull_messages(list(pending)):
                nid = pending.pop(r.metadata.reply_to_message_id, None)
                if nid is not None:
                    replies[nid] = r
                    answered += _users_in(r)  # a block node answers for several users
            enough = expected is not None and answered >= expected
            if not pending and (enough or expected is None or now >= connect_by):
                break
            if pending and now >= answer_by and now >= connect_by:
                online = set(self.grid.get_node_ids())
                alive = sorted(nid for nid in pending.values() if nid in online)
                if not alive or timeout is not None or (stall_by is not None and now >= stall_by):
                    break
                if stall_by is None:
                    stall_by = start + STALL_FACTOR * (now - start)
                    log.warning(
                        "%d asked node(s) have not answered the fedkl handshake after %.0f s but are still online "
                        "(a ClientApp starting on a loaded machine?): waiting for them up to %.0f s",
                        len(alive),
                        now - start,
                        stall_by - start,
                    )
            clock.sleep(POLL_S)
        return replies, clock.monotonic() - start

    def _resolve_claims(
        self,
        claims: dict[int, list[int]],
        infos: dict[int, codec.NodeInfo],
        ids: list[str | None],
        bindings: Mapping[str, int] | None,
        n: int,
    ) -> tuple[dict[int, int], dict[int, tuple[str, str]]]:
        """The node serving each user position, and the unserved positions with (kind, why).

        The rule for a position claimed by several nodes (:data:`DUPLICATE_RULE`): if the enrolment binds
        the user to a node id (``bindings``), that node serves it and every other claimant is refused;
        otherwise none of the claimants is asked and the user fails ``duplicate-claim`` (charged,
        contributes zero). A bound user whose claimant is not its bound node is not served by it either."""
        node_of: dict[int, int] = {}
        unserved: dict[int, tuple[str, str]] = {}
        bindings = dict(bindings or {})
        for p in range(n):
            nodes = sorted(claims.get(p, []))
            uid = ids[p] if ids[p] is not None else (infos[nodes[0]].user_at(p) if nodes else None)
            bound = bindings.get(str(uid)) if uid is not None else None
            if bound is not None:
                for nid in nodes:
                    if nid != bound:
                        self.refused_nodes[nid] = f"claims user {uid!r}, bound by the enrolment to node {bound}"
                nodes = [nid for nid in nodes if nid == bound]
            if len(nodes) == 1:
                node_of[p] = nodes[0]
                ids[p] = infos[nodes[0]].user_at(p)
            elif len(nodes) > 1:
                if len({infos[nid].user_at(p) for nid in nodes}) > 1 and ids[p] is None:
                    raise RuntimeError(f"nodes {nodes} claim user position {p} with different user ids")
                for nid in nodes:
                    self.refused_nodes[nid] = f"claims user {uid!r} as {len(nodes) - 1} other node(s) do"
                ids[p] = uid
                unserved[p] = ("duplicate-claim", f"claimed by nodes {nodes}; none is bound to it, none is asked")
            else:
                unserved[p] = ("absent", "no node answered the handshake for this user")
        return node_of, unserved

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
                kinds[u], errors[u] = self.unserved[u]
        if asked:
            group = f"fedkl-{next(self._group)}"
            sent = {row: query.for_user(row) for row, _ in asked}
            single = [(row, u) for row, u in asked if self.node_of[u] not in self.blocks]
            by_block: dict[int, list[tuple[int, int]]] = {}
            for row, u in asked:
                if self.node_of[u] in self.blocks:
                    by_block.setdefault(self.node_of[u], []).append((row, u))
            msgs = [self._message(sent[row], self.node_of[u], group) for row, u in single]
            for nid, members in by_block.items():  # one message per block node, a query per asked user
                block = codec.encode_block_request([u for _, u in members], [sent[row] for row, _ in members])
                msgs.append(self._message(block, nid, group))
            replies = self._match(msgs, self.grid.send_and_receive(msgs, timeout=self.timeout))
            decoded: dict[int, Any] = {}  # row -> the user's decoded answer, or the exception rejecting it
            for row, u in single:
                if self.node_of[u] in replies:
                    try:
                        decoded[row] = codec.decode_answer(replies[self.node_of[u]], sent[row], self.num_params)
                    except (codec.CodecError, codec.ReplyError) as exc:
                        decoded[row] = exc
            for nid, members in by_block.items():
                if nid in replies:
                    self._block_answers(replies[nid], members, sent, query, values, decoded)
            for row, u in asked:  # each user's answer is checked alone, wherever it came from
                if row in decoded and decoded[row] is _ACCEPTED:
                    continue
                v = decoded.get(row)
                if v is None:
                    errors[u], kinds[u] = "no reply (dropout or timeout)", "no-reply"
                    continue
                try:
                    if isinstance(v, Exception):
                        raise v
                    sent[row].check_answer(v)
                    values[row] = query.user_answer(v)  # cast to self.dtype by the assignment
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

    def _block_answers(
        self, reply: Any, members: list[tuple[int, int]], sent: dict, query: Query, values: torch.Tensor, decoded: dict
    ) -> None:
        """A block node's reply: each user's row checked alone by its query (:meth:`Query.check_answers`, one
        batched call of the same per-row rule); the accepted rows go into ``values`` (marked ``_ACCEPTED`` in
        ``decoded``), the rejected ones into ``decoded`` as the exception that fails that user alone."""
        rows = [r for r, _ in members]
        qs = [sent[r] for r in rows]
        try:
            groups = codec.decode_block_answer(reply, [u for _, u in members], qs, self.num_params)
        except (codec.CodecError, codec.ReplyError) as exc:  # invalid as a whole: each user fails
            decoded.update((r, exc) for r in rows)
            return
        per_row = type(query).user_answer is not Query.user_answer  # a query that maps each answer
        for idx, got, errors in groups:
            ok = [k for k in range(len(idx)) if k not in errors]
            rejected = qs[idx[0]].check_answers(got[ok]) if ok else {}
            for k, why in rejected.items():
                errors[ok[k]] = ValueError(why)
            accepted = [k for k in ok if k not in errors]
            for k, exc in errors.items():
                decoded[rows[idx[k]]] = exc
            if not accepted:
                continue
            at = [rows[idx[k]] for k in accepted]
            if per_row:
                for r, k in zip(at, accepted):
                    values[r] = query.user_answer(got[k])
            else:
                values[at] = got[accepted].to(self.dtype)
            decoded.update((r, _ACCEPTED) for r in at)

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
        reasons = {u: "{}: {}".format(*self.unserved[u]) for u in users if u not in self.node_of}
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
        return {**failure_summary(self.failures, FAILURE_KINDS), "handshake": self.handshake}

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
    def _message(self, query: Any, node_id: int, group: str = "fedkl-info") -> Any:
        """A request message: ``query`` a Query or :data:`~fedkl.flower.codec.INFO`, or an encoded block request."""
        from flwr.app import Message

        content = query if codec.is_block_request(query) else codec.encode_request(query)
        return Message(content, node_id, codec.MESSAGE_TYPE, group_id=group)

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
