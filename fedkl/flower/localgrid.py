"""A deterministic, synchronous, in-process Flower ``Grid`` (no Ray, no network).

``LocalGrid(client_app, num_nodes)`` gives every node a ``Context`` with
``node_config = {"partition-id": p, "num-partitions": num_nodes}`` and calls the ClientApp directly
when messages are pushed, exactly as a SuperNode would (an exception in the ClientApp becomes a
Flower ``Error`` reply, as the real runtime does). Node ids are not the partition ids (by default a
fixed shuffled set of large integers), so code that maps nodes to users is exercised.

Fault injection for tests: a :class:`Fault` sees each (partition, request) before the ClientApp and
each reply after it, and may change or withhold them. Helpers: :func:`drop`, :func:`nan_reply`,
:func:`wrong_shape`, :func:`garbage`, :func:`oversize`, :func:`unknown_request`, :func:`delay`,
:func:`wrong_info`.
A delay is simulated (no sleep): a reply delayed by more than the ``timeout`` given to
``send_and_receive`` is not returned, so tests are deterministic and fast.

Time is simulated too (:class:`SimClock`, the grid's ``clock``): a node listed in ``connect_at`` appears
in ``get_node_ids()`` only once the clock reaches its time, and a reply pushed at t with a delay d is
returned by ``pull_messages`` from t + d on. Who waits on the grid (the handshake) sleeps on that clock,
so a load that makes nodes connect late or answer slowly is replayed exactly, without waiting.
"""

from __future__ import annotations

import os

for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"), ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_k, _v)

import random  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Iterable, Mapping  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from fedkl.flower import codec  # noqa: E402

# ClientApp exceptions become this error code (Flower's ErrorCode.CLIENT_APP_RAISED_EXCEPTION).
CLIENT_APP_RAISED_EXCEPTION = 2


def _set_task_identity(run_id: int) -> None:
    # Flower 1.41's Message() outside a Flower run needs its (internal) task identity set: run, node and task ids.
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 1


class Fault:
    """Per-node fault hooks. Override either method; the defaults change nothing."""

    def request(self, partition_id: int, message: Message) -> Message:
        return message

    def reply(self, partition_id: int, request: Message, reply: Message) -> Message | None:
        """Return the reply to deliver, or None to drop it."""
        return reply

    def delay(self, partition_id: int, request: Message) -> float:
        """Simulated latency of this node's reply to ``request`` (seconds)."""
        return 0.0


class SimClock:
    """Simulated time: ``sleep`` advances ``monotonic()`` at once (and counts the sleeps)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1


class LocalGrid(Grid):
    """Synchronous in-process Grid over ``client_app`` with ``num_nodes`` nodes."""

    def __init__(
        self,
        client_app: Callable[[Message, Context], Message],
        num_nodes: int,
        *,
        run_id: int = 1,
        run_config: Mapping[str, Any] | None = None,
        faults: Mapping[int, Fault] | None = None,
        node_ids: Iterable[int] | None = None,
        absent: Iterable[int] = (),
        node_config: Mapping[int, Mapping[str, Any]] | None = None,
        connect_at: Mapping[int, float] | None = None,
        leave_at: Mapping[int, float] | None = None,
        clock: SimClock | None = None,
    ) -> None:
        """``faults`` maps partition ids to their :class:`Fault`; ``absent`` partitions have no node
        at all (never connected); ``node_ids`` overrides the (shuffled, deterministic) node ids;
        ``node_config`` adds node-config keys per partition (e.g. a site's ``data-path``);
        ``connect_at`` maps partitions to the simulated time their node connects (default 0), ``leave_at`` to
        the time it goes offline (crashed: no longer listed, never answers again)."""
        self.app = client_app
        self.run_id = run_id
        _set_task_identity(run_id)
        ids = list(node_ids) if node_ids is not None else random.Random(run_id).sample(range(10**6, 10**9), num_nodes)
        if len(ids) != num_nodes or len(set(ids)) != num_nodes or 0 in ids:
            raise ValueError("node_ids must be num_nodes distinct non-zero integers")
        absent = set(absent)
        self.partition_of = {nid: p for p, nid in enumerate(ids) if p not in absent}
        self.contexts = {
            nid: Context(
                run_id=run_id,
                node_id=nid,
                node_config={"partition-id": p, "num-partitions": num_nodes, **(node_config or {}).get(p, {})},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for nid, p in self.partition_of.items()
        }
        self.faults = dict(faults or {})
        self.clock = clock or SimClock()
        self.connect_at = {nid: float((connect_at or {}).get(p, 0.0)) for nid, p in self.partition_of.items()}
        self.leave_at = {nid: float((leave_at or {}).get(p, float("inf"))) for nid, p in self.partition_of.items()}
        self._replies: dict[
            str, tuple[Message, float, float, int]
        ] = {}  # message id -> (reply, delay, pushed at, node)
        self.calls: list[tuple[int, str]] = []  # (partition, message type) of every delivered request

    # --- Grid interface ------------------------------------------------------------------------
    def set_run(self, run: Any) -> None:  # noqa: D401 - nothing to set
        pass

    @property
    def run(self) -> Any:
        raise NotImplementedError("LocalGrid has no Run object")

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return [nid for nid in self.contexts if self._online(nid)]

    def _online(self, nid: int) -> bool:
        return self.connect_at[nid] <= self.clock.now < self.leave_at[nid]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        # One user's tensors are tiny: torch's intra-op threads only add OpenMP barrier waits (20x
        # slower on a busy 2-core box). Run the clients single-threaded, then restore.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._push(messages)
        finally:
            torch.set_num_threads(threads)

    def _push(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            nid = m.metadata.dst_node_id
            if nid not in self.contexts or not self._online(nid):
                continue  # unknown (or not yet connected, or gone) node: the message is never answered
            pid = self.partition_of[nid]
            fault = self.faults.get(pid, Fault())
            req = fault.request(pid, m)
            self.calls.append((pid, req.metadata.message_type))
            try:
                reply = self.app(req, self.contexts[nid])
            except Exception as exc:  # what a SuperNode does with a ClientApp exception
                reply = Message(Error(CLIENT_APP_RAISED_EXCEPTION, f"{type(exc).__name__}: {exc}"), reply_to=req)
            reply = fault.reply(pid, req, reply)
            if reply is not None:
                self._replies[mid] = (reply, fault.delay(pid, req), self.clock.now, nid)
        return ids

    def pull_messages(self, message_ids: Iterable[str], *, deadline: float | None = None) -> list[Message]:
        """The replies that have arrived: by the clock (pushed at + delay <= now), or, given a
        ``deadline``, those delayed by at most ``deadline`` seconds."""
        out = []
        for i in message_ids:
            if i not in self._replies:
                continue
            _, late, at, nid = self._replies[i]
            if self.leave_at[nid] <= at + late:
                continue  # the node went offline before its reply was sent
            if (late <= deadline) if deadline is not None else (at + late <= self.clock.now):
                out.append(self._replies.pop(i)[0])
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        ids = self.push_messages(messages)
        out = self.pull_messages(ids, deadline=float("inf") if timeout is None else timeout)
        for i in ids:  # late replies are gone (as after a real timeout)
            self._replies.pop(i, None)
        return out


# --- fault helpers -------------------------------------------------------------------------------
class _ReplyFault(Fault):
    def __init__(self, fn: Callable[[Message, Message], Message | None]) -> None:
        self.fn = fn

    def reply(self, partition_id: int, request: Message, reply: Message) -> Message | None:
        if request.metadata.message_type == "query.fedkl" and _kind(request) == "info":
            return reply  # let the handshake through; break the answers
        return self.fn(request, reply)


def _kind(message: Message) -> Any:
    try:
        return message.content["fedkl"]["kind"]
    except Exception:
        return None


def _with_value(request: Message, value: np.ndarray) -> Message:
    content = RecordDict(
        {
            "fedkl": ConfigRecord({"protocol": 1, "kind": _kind(request), "status": "ok"}),
            "answer": ArrayRecord({"value": Array(value)}),
        }
    )
    return Message(content, reply_to=request)


def drop() -> Fault:
    """The node answers the handshake, then never replies (dropout)."""
    return _ReplyFault(lambda req, rep: None)


def nan_reply() -> Fault:
    """A well-formed reply whose values are NaN."""

    def fn(req: Message, rep: Message) -> Message:
        shape = rep.content["answer"]["value"].shape if "answer" in rep.content else (1,)
        return _with_value(req, np.full(shape, np.nan))

    return _ReplyFault(fn)


def wrong_shape(extra: int = 1) -> Fault:
    """A reply with ``extra`` more coordinates than asked for."""

    def fn(req: Message, rep: Message) -> Message:
        n = rep.content["answer"]["value"].shape[0] if "answer" in rep.content else 1
        return _with_value(req, np.zeros(n + extra))

    return _ReplyFault(fn)


def wrong_dtype() -> Fault:
    def fn(req: Message, rep: Message) -> Message:
        v = rep.content["answer"]["value"].numpy()
        return _with_value(req, v.astype(np.float32))

    return _ReplyFault(fn)


def zero_reply() -> Fault:
    """A well-formed reply of exact zeros (e.g. a user at its own optimum)."""

    def fn(req: Message, rep: Message) -> Message:
        shape = rep.content["answer"]["value"].shape if "answer" in rep.content else (1,)
        return _with_value(req, np.zeros(shape))

    return _ReplyFault(fn)


def garbage() -> Fault:
    """A reply that is not in the fedkl format at all."""
    return _ReplyFault(lambda req, rep: Message(RecordDict({"x": ConfigRecord({"junk": b"\x00\xff"})}), reply_to=req))


def huge_norm(scale: float = 1e6) -> Fault:
    """A well-formed, finite reply far outside the clip bound (a malicious client)."""

    def fn(req: Message, rep: Message) -> Message:
        n = rep.content["answer"]["value"].shape[0]
        return _with_value(req, np.full(n, scale))

    return _ReplyFault(fn)


def oversize(nbytes: int = 1 << 20) -> Fault:
    """A reply whose array declares the right shape but carries ``nbytes`` of payload."""

    def fn(req: Message, rep: Message) -> Message:
        arr = rep.content["answer"]["value"]
        big = Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=arr.stype, data=arr.data + b"\x00" * nbytes)
        content = RecordDict({"fedkl": rep.content["fedkl"], "answer": ArrayRecord({"value": big})})
        return Message(content, reply_to=req)

    return _ReplyFault(fn)


class _InfoFault(Fault):
    def __init__(self, changes: Mapping[str, int]) -> None:
        self.changes = dict(changes)

    def reply(self, partition_id: int, request: Message, reply: Message) -> Message | None:
        if _kind(request) != "info" or "fedkl" not in reply.content:
            return reply
        cfg = reply.content["fedkl"]
        fields = {k: cfg[k] + self.changes.get(k, 0) for k in ("partition_id", "num_partitions", "num_params")}
        return Message(codec.encode_info(user_id=cfg["user_id"], **fields), reply_to=request)


def wrong_info(*, num_params: int = 0, num_partitions: int = 0) -> Fault:
    """The node's handshake reports ``num_params`` more parameters (another model) and/or
    ``num_partitions`` more users than it holds (a node configured for another run); it answers the
    queries as before."""
    return _InfoFault({"num_params": num_params, "num_partitions": num_partitions})


class _RequestFault(Fault):
    def __init__(self, fn: Callable[[Message], Message]) -> None:
        self.fn = fn

    def request(self, partition_id: int, message: Message) -> Message:
        if _kind(message) == "info":
            return message
        return self.fn(message)


def _replace_content(message: Message, content: RecordDict) -> Message:
    m = Message(
        content, message.metadata.dst_node_id, message.metadata.message_type, group_id=message.metadata.group_id
    )
    m.metadata.__dict__["_message_id"] = message.metadata.message_id
    return m


def unknown_request() -> Fault:
    """The request reaching the node has an unknown query kind (e.g. a corrupted or newer server)."""

    def fn(m: Message) -> Message:
        cfg = dict(m.content["fedkl"])
        cfg["kind"] = "steal_records"
        return _replace_content(m, RecordDict({"fedkl": ConfigRecord(cfg), "tensors": m.content["tensors"]}))

    return _RequestFault(fn)


def oversize_request(nbytes: int = 1 << 20) -> Fault:
    """The request reaching the node carries an oversize array payload."""

    def fn(m: Message) -> Message:
        tensors = ArrayRecord()
        for k, a in m.content["tensors"].items():
            tensors[k] = Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype, data=a.data + b"\x00" * nbytes)
        return _replace_content(m, RecordDict({"fedkl": m.content["fedkl"], "tensors": tensors}))

    return _RequestFault(fn)


class _Delay(Fault):
    def __init__(self, seconds: float, handshake: bool) -> None:
        self.seconds = seconds
        self.handshake = handshake

    def delay(self, partition_id: int, request: Message) -> float:
        return self.seconds if self.handshake or _kind(request) != "info" else 0.0


def delay(seconds: float, *, handshake: bool = False) -> Fault:
    """The node's replies arrive ``seconds`` late (simulated): lost if that exceeds the timeout.
    ``handshake``: its handshake reply too (a ClientApp slow to start)."""
    return _Delay(seconds, handshake)
