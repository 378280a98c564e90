"""Wire format of the Flower transport: typed fedkl queries <-> Flower ``RecordDict`` messages.

Shared by the ClientApp (``fedkl/flower/client_app.py``) and :class:`fedkl.flower.federation.FlowerFederation`,
so that both ends agree on one small, strictly validated format:

* every request is a Flower message of type ``query.fedkl`` (:data:`MESSAGE_TYPE`);
* its ``"fedkl"`` ConfigRecord holds the protocol version, the query kind and the scalars;
* its ``"tensors"`` ArrayRecord holds the float64 parameter vectors (numpy serialisation);
* a good reply has a ``"fedkl"`` ConfigRecord with ``status == "ok"`` and an ``"answer"``
  ArrayRecord with one float64 array ``"value"``; an error reply has an ``"error"`` ConfigRecord
  (``code``, ``reason``) and nothing else.

A node holding a block of users (simulations: :class:`BlockInfo`, :func:`encode_block_request`) gets one
message per request with each asked user's query, and replies with one row and one status per user.

The format is generic: a query's kind, scalars, tensors, tensor shapes and answer shape all come
from the query type itself (:class:`fedkl.federation.base.Query`, registry
:data:`~fedkl.federation.base.QUERY_KINDS`), so a new query kind needs no change here.

Decoding never trusts the other side: unknown kinds or keys, wrong dtypes/shapes/serialisation,
non-finite values and arrays larger than the expected shape needs are :class:`CodecError`. Array
sizes are checked on the *serialised* bytes before anything is deserialised.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping

import numpy as np
import torch

from fedkl.federation.base import MAX_POINTS as MAX_POINTS  # re-exported: most points per request
from fedkl.federation.base import QUERY_KINDS, Query
from fedkl.federation.base import GradientsAtPoints as GradientsAtPoints  # re-exported for callers
from fedkl.problems import DEFAULT_PROBLEM

PROTOCOL = 1
MESSAGE_TYPE = "query.fedkl"
INFO = "info"  # the handshake kind: which user does this node hold?

# Error codes carried in an "error" ConfigRecord.
ERR_BAD_REQUEST = 1  # unknown kind, wrong shape/dtype, NaN, oversize, bad scalar
ERR_NOT_FINITE = 2  # the user's own answer was not finite (in-process: "failed")
ERR_INTERNAL = 3  # anything else on the client
ERR_NOT_CONFIGURED = 4  # the node holds no valid user (partition-id out of range, no dataset)
ERR_DATA = 5  # the node's own data file was refused (missing, wrong schema, out of bounds)

# Slack for the .npy header on top of the raw float64 bytes of an expected array.
NPY_HEADER_SLACK = 1024


class CodecError(ValueError):
    """A message that does not follow the protocol (or carries invalid values)."""

    def __init__(self, reason: str, code: int = ERR_BAD_REQUEST) -> None:
        super().__init__(reason)
        self.code = code


def max_array_bytes(shape: tuple[int, ...]) -> int:
    """Largest serialised size accepted for a float64 array of ``shape``."""
    return 8 * int(np.prod(shape, dtype=np.int64)) + NPY_HEADER_SLACK


# --- arrays --------------------------------------------------------------------------------------
def _array(x: torch.Tensor | np.ndarray) -> Any:
    from flwr.app import Array

    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return Array(np.ascontiguousarray(a, dtype=np.float64))


def _read_array(arr: Any, name: str, shape: tuple[int, ...], finite: bool = True) -> np.ndarray:
    """Validate a Flower ``Array`` (before deserialising) and return it as float64 numpy (``finite``: NaN or
    inf refused; a block's answers are checked per row, :func:`decode_block_answer`)."""
    from flwr.app import Array

    if not isinstance(arr, Array):
        raise CodecError(f"{name}: not an Array")
    if arr.stype != "numpy.ndarray":
        raise CodecError(f"{name}: serialisation {arr.stype!r}, expected 'numpy.ndarray'")
    if arr.dtype != "float64":
        raise CodecError(f"{name}: dtype {arr.dtype}, expected float64")
    if tuple(arr.shape) != tuple(shape):
        raise CodecError(f"{name}: shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if len(arr.data) > max_array_bytes(shape):
        raise CodecError(f"{name}: payload of {len(arr.data)} bytes exceeds {max_array_bytes(shape)}")
    try:
        a = arr.numpy()
    except Exception as exc:  # malformed bytes
        raise CodecError(f"{name}: cannot deserialise ({type(exc).__name__}: {exc})") from None
    if a.dtype != np.float64 or a.shape != tuple(shape):
        raise CodecError(f"{name}: payload does not match its declared dtype/shape")
    if finite and not np.isfinite(a).all():
        raise CodecError(f"{name}: contains NaN or inf")
    return a


def _exact_keys(record: Mapping, expected: tuple[str, ...], what: str) -> None:
    keys = set(record.keys())
    if keys != set(expected):
        raise CodecError(f"{what}: keys {sorted(keys)}, expected {sorted(expected)}")


# --- requests ------------------------------------------------------------------------------------
def kind_of(query: Query | str) -> str:
    """The wire kind of a query object (TypeError for a type without one), or a kind string checked
    against the registry (:data:`INFO` included)."""
    if isinstance(query, str):
        if query != INFO and query not in QUERY_KINDS:
            raise CodecError(f"unknown request kind {query!r}")
        return query
    kind = getattr(type(query), "kind", None)
    if kind is None or QUERY_KINDS.get(kind) is not type(query):
        raise TypeError(f"unsupported query type {type(query).__name__}")
    return kind


def encode_request(query: Query | str) -> Any:
    """A ``RecordDict`` for ``query`` (a query object, or :data:`INFO` for the handshake)."""
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    kind = kind_of(query)
    cfg: dict[str, Any] = {"protocol": PROTOCOL, "kind": kind}
    tensors: dict[str, Any] = {}
    if kind != INFO:
        scalars, arrays = query.wire_fields()
        cfg.update(scalars)
        tensors = {name: _array(t) for name, t in arrays.items()}
    return RecordDict({"fedkl": ConfigRecord(cfg), "tensors": ArrayRecord(tensors)})


def decode_request(content: Any, num_params: int) -> Query | str:
    """The query in a request ``RecordDict`` (or :data:`INFO`); :class:`CodecError` if invalid."""
    from flwr.app import ArrayRecord, ConfigRecord

    try:
        _exact_keys(content, ("fedkl", "tensors"), "request")
        cfg, tensors = content["fedkl"], content["tensors"]
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"malformed request ({type(exc).__name__})") from None
    if not isinstance(cfg, ConfigRecord) or not isinstance(tensors, ArrayRecord):
        raise CodecError("request: 'fedkl' must be a ConfigRecord and 'tensors' an ArrayRecord")
    if cfg.get("protocol") != PROTOCOL:
        raise CodecError(f"protocol {cfg.get('protocol')!r}, expected {PROTOCOL}")
    kind = cfg.get("kind")
    if not isinstance(kind, str) or (kind != INFO and kind not in QUERY_KINDS):
        raise CodecError(f"unknown request kind {kind!r}")
    if kind == INFO:
        _exact_keys(tensors, (), f"{kind} tensors")
        _exact_keys(cfg, ("protocol", "kind"), "info request")
        return INFO
    cls = QUERY_KINDS[kind]
    names = cls.tensor_names
    _exact_keys(tensors, names, f"{kind} tensors")
    try:
        shapes = cls.wire_shapes({n: tuple(getattr(tensors[n], "shape", ())) for n in names}, num_params)
    except ValueError as exc:
        raise CodecError(str(exc)) from None
    arrays = {n: torch.from_numpy(_read_array(tensors[n], n, shapes[n]).copy()) for n in names}
    _exact_keys(cfg, ("protocol", "kind") + cls.scalar_names, f"{kind} scalars")
    try:
        return cls.from_wire({k: cfg[k] for k in cls.scalar_names}, arrays, num_params)
    except CodecError:
        raise
    except ValueError as exc:  # the query's own checks (types, ranges, clip)
        raise CodecError(str(exc)) from None


# --- replies -------------------------------------------------------------------------------------
def answer_shape(query: Query, num_params: int) -> tuple[int, ...]:
    """The shape of one user's answer to ``query`` on the wire: the query's
    :meth:`~fedkl.federation.base.Query.answer_shape`, a scalar travelling as ``(1,)``."""
    return query.answer_shape(num_params) or (1,)


def encode_answer(query: Query | str, value: torch.Tensor | np.ndarray) -> Any:
    """The reply to a ``query`` request (or its kind) carrying ``value`` (a 0-d scalar travels as ``(1,)``)."""
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    kind = kind_of(query)
    v = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    v = np.ascontiguousarray(v, dtype=np.float64)
    if v.ndim == 0:
        v = v.reshape(1)
    return RecordDict(
        {
            "fedkl": ConfigRecord({"protocol": PROTOCOL, "kind": kind, "status": "ok"}),
            "answer": ArrayRecord({"value": _array(v)}),
        }
    )


def encode_info(partition_id: int, num_partitions: int, user_id: str, num_params: int) -> Any:
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    return RecordDict(
        {
            "fedkl": ConfigRecord(
                {
                    "protocol": PROTOCOL,
                    "kind": INFO,
                    "status": "ok",
                    "partition_id": int(partition_id),
                    "num_partitions": int(num_partitions),
                    "user_id": str(user_id),
                    "num_params": int(num_params),
                }
            ),
            "answer": ArrayRecord(),
        }
    )


def encode_error(code: int, reason: str) -> Any:
    from flwr.app import ConfigRecord, RecordDict

    return RecordDict({"error": ConfigRecord({"protocol": PROTOCOL, "code": int(code), "reason": str(reason)[:1000]})})


class ReplyError(RuntimeError):
    """The client answered with an error (or a Flower-level error)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"client error {code}: {reason}")
        self.code = code
        self.reason = reason


def _content(reply: Any) -> Any:
    if reply.has_error():
        err = reply.error
        raise ReplyError(int(err.code), str(err.reason))
    content = reply.content
    if "error" in content:
        err = content["error"]
        code = err.get("code", ERR_INTERNAL)
        raise ReplyError(int(code) if isinstance(code, int) else ERR_INTERNAL, str(err.get("reason", "")))
    return content


def _ok_header(content: Any, kind: str, keys: tuple[str, ...]) -> Mapping:
    from flwr.app import ArrayRecord, ConfigRecord

    _exact_keys(content, ("fedkl", "answer"), "reply")
    cfg = content["fedkl"]
    if not isinstance(cfg, ConfigRecord) or not isinstance(content["answer"], ArrayRecord):
        raise CodecError("reply: 'fedkl' must be a ConfigRecord and 'answer' an ArrayRecord")
    _exact_keys(cfg, ("protocol", "kind", "status") + keys, "reply header")
    if cfg["protocol"] != PROTOCOL or cfg["kind"] != kind or cfg["status"] != "ok":
        raise CodecError(f"reply header {dict(cfg)} does not answer a {kind!r} request")
    return cfg


def decode_answer(reply: Any, query: Query, num_params: int) -> torch.Tensor:
    """The float64 answer in ``reply`` to the request ``query``, of the query's
    :meth:`~fedkl.federation.base.Query.answer_shape` (a 0-d tensor for a scalar answer).

    Raises :class:`ReplyError` for an error reply and :class:`CodecError` for anything invalid.
    """
    kind = kind_of(query)
    content = _content(reply)
    _ok_header(content, kind, ())
    answer = content["answer"]
    _exact_keys(answer, ("value",), "answer")
    v = torch.from_numpy(_read_array(answer["value"], "value", answer_shape(query, num_params)).copy())
    return v.reshape(query.answer_shape(num_params))


@dataclass(frozen=True)
class NodeInfo:
    partition_id: int
    num_partitions: int
    user_id: str
    num_params: int

    @property
    def positions(self) -> range:
        return range(self.partition_id, self.partition_id + 1)

    def user_at(self, position: int) -> str:
        return self.user_id


def decode_info(reply: Any) -> NodeInfo | BlockInfo:
    """A node's handshake: :class:`NodeInfo` (one user) or :class:`BlockInfo` (a block node, simulation only)."""
    content = _content(reply)
    if "fedkl" in content and "user_ids" in content["fedkl"]:
        return _decode_block_info(content)
    cfg = _ok_header(content, INFO, ("partition_id", "num_partitions", "user_id", "num_params"))
    if len(content["answer"]) != 0:
        raise CodecError("info reply carries arrays")
    pid, npart, uid, nparams = (cfg["partition_id"], cfg["num_partitions"], cfg["user_id"], cfg["num_params"])
    if (
        not all(isinstance(x, int) and not isinstance(x, bool) for x in (pid, npart, nparams))
        or not isinstance(uid, str)
        or not (0 <= pid < npart)
        or nparams < 1
        or len(uid) > 1000
    ):
        raise CodecError(f"invalid info reply {dict(cfg)}")
    return NodeInfo(pid, npart, uid, nparams)


# --- a node holding a block of users (simulation only: fedkl.flower.client_app, users_per_node) -----------
# One message per node carries the request of every asked user of its block, and one reply carries every
# user's own answer (a row each, with a status per user): the server still decodes, bounds and fails each
# user separately, exactly as with one node per user. Nothing is summed on the node.
BLOCK = "fedkl-block"  # the ConfigRecord naming the positions of a block request / reply
MAX_BLOCK = 1 << 20  # most users per block message


@dataclass(frozen=True)
class BlockInfo:
    """A block node's handshake: it holds the users at ``first, first + 1, ...`` (ids ``user_ids``)."""

    first: int
    num_partitions: int
    user_ids: tuple[str, ...]
    num_params: int

    @property
    def positions(self) -> range:
        return range(self.first, self.first + len(self.user_ids))

    def user_at(self, position: int) -> str:
        return self.user_ids[position - self.first]


def encode_block_info(first: int, num_partitions: int, user_ids: Any, num_params: int) -> Any:
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    cfg = {"protocol": PROTOCOL, "kind": INFO, "status": "ok", "partition_id": int(first)}
    cfg.update({"num_partitions": int(num_partitions), "user_ids": [str(u) for u in user_ids]})
    return RecordDict({"fedkl": ConfigRecord({**cfg, "num_params": int(num_params)}), "answer": ArrayRecord()})


def encode_block_request(positions: Any, queries: Any) -> Any:
    """One request to a block node: ``queries[i]`` for the user at ``positions[i]``; a query object shared by
    several users (:meth:`~fedkl.federation.base.Query.for_user`'s default) travels once."""
    from flwr.app import ConfigRecord, RecordDict

    index: dict[int, int] = {}
    records: dict[str, Any] = {}
    query_of = []
    for q in queries:
        if id(q) not in index:
            j = index[id(q)] = len(index)
            one = encode_request(q)
            if kind_of(q) == INFO:
                raise CodecError("a block request carries queries, not the handshake")
            records[f"q{j}"], records[f"t{j}"] = one["fedkl"], one["tensors"]
        query_of.append(index[id(q)])
    head = {"protocol": PROTOCOL, "positions": [int(p) for p in positions], "query_of": query_of}
    return RecordDict({BLOCK: ConfigRecord(head), **records})


def is_block_request(content: Any) -> bool:
    try:
        return BLOCK in content
    except Exception:
        return False


def decode_block_request(content: Any, num_params: int) -> tuple[list[int], list[Query]]:
    """``(positions, the query of each)`` of a :func:`encode_block_request` message; :class:`CodecError` if invalid."""
    from flwr.app import ConfigRecord, RecordDict

    try:
        head = content[BLOCK]
        positions, query_of = head["positions"], head["query_of"]
    except Exception as exc:
        raise CodecError(f"malformed block request ({type(exc).__name__})") from None
    if not isinstance(head, ConfigRecord) or head.get("protocol") != PROTOCOL:
        raise CodecError("block request: not a fedkl block header of this protocol")
    _exact_keys(head, ("protocol", "positions", "query_of"), "block header")
    ints = isinstance(positions, list) and isinstance(query_of, list)
    ints = ints and all(isinstance(x, int) and not isinstance(x, bool) for x in positions + query_of)
    if not ints or len(positions) != len(query_of) or not 0 < len(positions) <= MAX_BLOCK:
        raise CodecError("block header: positions and query_of must be equally long lists of integers")
    if len(set(positions)) != len(positions) or min(positions) < 0:
        raise CodecError("block header: positions must be distinct non-negative integers")
    m = max(query_of) + 1
    if min(query_of) < 0 or set(query_of) != set(range(m)):
        raise CodecError("block header: query_of must index the block's queries 0..m-1, each used")
    _exact_keys(content, (BLOCK,) + tuple(f"{c}{j}" for j in range(m) for c in "qt"), "block request")
    queries = []
    for j in range(m):
        q = decode_request(RecordDict({"fedkl": content[f"q{j}"], "tensors": content[f"t{j}"]}), num_params)
        if q == INFO:
            raise CodecError("a block request carries queries, not the handshake")
        queries.append(q)
    return list(positions), [queries[j] for j in query_of]


def encode_block_answer(positions: Any, queries: Any, answers: Mapping[int, Any], errors: Mapping[int, Any]) -> Any:
    """The reply of a block node to :func:`encode_block_request` ``(positions, queries)``. The users asked the
    same query object form a group (numbered in order of first appearance); ``answers[j]`` holds group j's
    answers, one row per user in request order; ``errors[i] = (code, reason)`` for the user at ``positions[i]``
    when that user failed (its row is sent as zeros)."""
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    index: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for i, q in enumerate(queries):
        members.setdefault(index.setdefault(id(q), len(index)), []).append(i)
    arrays = {}
    for j, rows in members.items():
        a = torch.as_tensor(answers[j], dtype=torch.float64).reshape(len(rows), -1)
        bad = [k for k, i in enumerate(rows) if i in errors]
        if bad:
            a = a.clone()
            a[bad] = 0.0
        arrays[f"v{j}"] = _array(a)
    codes = [int(errors[i][0]) if i in errors else 0 for i in range(len(positions))]
    reasons = [str(errors[i][1])[:1000] if i in errors else "" for i in range(len(positions))]
    head = {"protocol": PROTOCOL, "kind": BLOCK, "status": "ok", "positions": [int(p) for p in positions]}
    head.update({"codes": codes, "reasons": reasons})
    return RecordDict({"fedkl": ConfigRecord(head), "answer": ArrayRecord(arrays)})


def decode_block_answer(reply: Any, positions: Any, queries: Any, num_params: int) -> list[tuple]:
    """The answers in a block node's reply to :func:`encode_block_request` ``(positions, queries)``, per group of
    users asked the same query object (in order of first appearance): ``(members, values, errors)`` with
    ``members`` the indices into ``positions``, ``values`` their answers (one float64 row each, of the query's
    :meth:`~fedkl.federation.base.Query.answer_shape`) and ``errors`` ``{row: the exception rejecting that
    user alone}`` (:class:`ReplyError` for its own error, :class:`CodecError` for a non-finite row; its row is
    zero). A reply that is invalid as a whole (an error reply, wrong positions, shapes, dtypes or sizes) raises:
    every user of the block then fails with that reason."""
    content = _content(reply)
    _exact_keys(content, ("fedkl", "answer"), "block reply")
    head = content["fedkl"]
    _exact_keys(head, ("protocol", "kind", "status", "positions", "codes", "reasons"), "block reply header")
    if head["protocol"] != PROTOCOL or head["kind"] != BLOCK or head["status"] != "ok":
        raise CodecError(f"block reply header {dict(head)} does not answer a block request")
    if list(head["positions"]) != [int(p) for p in positions]:
        raise CodecError("block reply: its positions are not the asked users'")
    codes, reasons = list(head["codes"]), list(head["reasons"])
    if len(codes) != len(positions) or len(reasons) != len(positions):
        raise CodecError("block reply: one code and one reason per asked user expected")
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
        raise CodecError("block reply: codes must be integers")
    index: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for i, q in enumerate(queries):
        members.setdefault(index.setdefault(id(q), len(index)), []).append(i)
    answer = content["answer"]
    _exact_keys(answer, tuple(f"v{j}" for j in members), "block answer")
    out = []
    for j, rows in members.items():
        q = queries[rows[0]]
        width = int(np.prod(answer_shape(q, num_params)))
        a = _read_array(answer[f"v{j}"], f"v{j}", (len(rows), width), finite=False)
        finite = np.isfinite(a).all(axis=1)
        errors: dict[int, Exception] = {}
        for k in np.flatnonzero(~finite).tolist():
            errors[k] = CodecError("value: contains NaN or inf")
        for k, i in enumerate(rows):
            if codes[i] != 0:
                errors[k] = ReplyError(codes[i], str(reasons[i]))
        if errors:
            a = a.copy()
            a[list(errors)] = 0.0
        values = torch.from_numpy(np.array(a)).reshape((len(rows),) + tuple(q.answer_shape(num_params)))
        out.append((rows, values, errors))
    return out


def _decode_block_info(content: Any) -> BlockInfo:
    cfg = _ok_header(content, INFO, ("partition_id", "num_partitions", "user_ids", "num_params"))
    if len(content["answer"]) != 0:
        raise CodecError("info reply carries arrays")
    first, npart, uids, nparams = (cfg["partition_id"], cfg["num_partitions"], cfg["user_ids"], cfg["num_params"])
    if (
        not all(isinstance(x, int) and not isinstance(x, bool) for x in (first, npart, nparams))
        or not isinstance(uids, list)
        or not 0 < len(uids) <= MAX_BLOCK
        or not all(isinstance(u, str) and len(u) <= 1000 for u in uids)
        or not (0 <= first and first + len(uids) <= npart)
        or nparams < 1
    ):
        raise CodecError(f"invalid block info reply (first {first!r}, {npart!r} partitions, {nparams!r} parameters)")
    return BlockInfo(first, npart, tuple(uids), nparams)


def encode_user(user_id: str) -> Any:
    """The handshake reply of a node running an app's own ClientApp (:func:`fedkl.flower.dropin.declare_user`):
    only the user id the node declares (it holds no fedkl dataset, so no partition or model size)."""
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    cfg = {"protocol": PROTOCOL, "kind": INFO, "status": "ok", "user_id": str(user_id)}
    return RecordDict({"fedkl": ConfigRecord(cfg), "answer": ArrayRecord()})


def decode_user(reply: Any) -> str:
    """The user id in an :func:`encode_user` reply: a non-empty string of at most 1000 characters."""
    content = _content(reply)
    uid = _ok_header(content, INFO, ("user_id",))["user_id"]
    if len(content["answer"]) != 0:
        raise CodecError("info reply carries arrays")
    if not isinstance(uid, str) or not uid.strip() or len(uid) > 1000:
        raise CodecError(f"invalid user id {uid!r}")
    return uid


# --- what a client loads -------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientSpec:
    """Which dataset/problem a ClientApp builds its one user from (names and JSON kwargs).

    In a deployment (``flwr run`` / gRPC) it comes from the run config keys
    ``fedkl-dataset``, ``fedkl-dataset-kwargs`` (JSON), ``fedkl-problem``, ``fedkl-problem-kwargs``
    (JSON); in-process and in simulations it is passed to :func:`fedkl.flower.client_app.make_client_app`.
    """

    dataset: str = "movielens"
    problem: str = "logistic"
    dataset_kwargs: str = "{}"
    problem_kwargs: str = "{}"

    def __post_init__(self) -> None:
        for name in ("dataset_kwargs", "problem_kwargs"):
            v = getattr(self, name)
            if isinstance(v, Mapping):  # accept dicts, store canonical JSON (hashable, cacheable)
                object.__setattr__(self, name, json.dumps(dict(v), sort_keys=True))
            elif not isinstance(json.loads(v), dict):
                raise ValueError(f"{name} must be a JSON object")

    @classmethod
    def build(
        cls, dataset: str, problem: str, dataset_kwargs: Mapping | None = None, problem_kwargs: Mapping | None = None
    ) -> "ClientSpec":
        return cls(
            dataset,
            problem,
            json.dumps(dict(dataset_kwargs or {}), sort_keys=True),
            json.dumps(dict(problem_kwargs or {}), sort_keys=True),
        )

    @staticmethod
    def loader_kwargs(cfg: Any) -> dict:
        """The loader kwargs ``fedkl run`` uses for a :class:`fedkl.runner.RunConfig` (or a deployment's
        settings): :func:`fedkl.data.files.dataset_kwargs`, the one rule."""
        from fedkl.data.files import DATA_SETTINGS, dataset_kwargs

        return dataset_kwargs({k: getattr(cfg, k, None) for k in DATA_SETTINGS})

    @classmethod
    def from_run_config(cls, cfg: Any, task: str | None = None) -> "ClientSpec":
        """The spec ``fedkl run`` uses for a :class:`fedkl.runner.RunConfig` (same loader kwargs,
        ``reg``); a ``problem`` of None is the default for the dataset's ``task``."""
        problem = cfg.problem
        if problem is None:
            if task is None:
                from fedkl.data import load_dataset

                task = load_dataset(cfg.dataset, **cls.loader_kwargs(cfg)).task
            problem = DEFAULT_PROBLEM[task]
        model = getattr(cfg, "model", None)  # problem "torch": every client imports the same network
        return cls.build(
            cfg.dataset, problem, cls.loader_kwargs(cfg), {"reg": cfg.reg, **({"model": model} if model else {})}
        )

    @classmethod
    def from_user_config(cls, user_config: Mapping) -> "ClientSpec | None":
        """From run-config keys: ``fedkl-dataset``, ``fedkl-problem`` and either the explicit JSON
        ``fedkl-dataset-kwargs`` / ``fedkl-problem-kwargs`` or, like ``fedkl run``, ``fedkl-seed``,
        ``fedkl-users``, ``fedkl-reg``, ``fedkl-model``, the data-file schema keys (``fedkl-label-column``,
        ``fedkl-feature-columns``, ...) and ``fedkl-sites``. None if no dataset is configured."""
        from fedkl.data.files import DATA_SETTINGS

        if "fedkl-dataset" not in user_config:
            return None
        dataset = str(user_config["fedkl-dataset"])
        if "fedkl-dataset-kwargs" in user_config or "fedkl-problem-kwargs" in user_config:
            problem = str(user_config.get("fedkl-problem", "logistic"))
            return cls(
                dataset,
                problem,
                str(user_config.get("fedkl-dataset-kwargs", "{}")),
                str(user_config.get("fedkl-problem-kwargs", "{}")),
            )
        settings = {k: user_config.get("fedkl-" + k.replace("_", "-")) or None for k in DATA_SETTINGS}  # "": unset
        settings.update(dataset=dataset, seed=int(user_config.get("fedkl-seed") or 0))
        settings.update(reg=float(user_config.get("fedkl-reg") or 0.0))
        settings.update(problem=user_config.get("fedkl-problem") or None, model=user_config.get("fedkl-model") or None)
        return cls.from_run_config(SimpleNamespace(**settings))

    def to_user_config(self) -> dict[str, str]:
        return {
            "fedkl-dataset": self.dataset,
            "fedkl-problem": self.problem,
            "fedkl-dataset-kwargs": self.dataset_kwargs,
            "fedkl-problem-kwargs": self.problem_kwargs,
        }

    @property
    def kwargs(self) -> tuple[dict, dict]:
        return json.loads(self.dataset_kwargs), json.loads(self.problem_kwargs)


PATH_KEYS = ("fedkl-out", "fedkl-ledger", "fedkl-recover")  # run-config keys holding a path (and a data file dataset)


def absolute_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``run_config`` with its paths (:data:`PATH_KEYS`, a data file ``fedkl-dataset``) absolute, resolved
    against this process's working directory: the SuperLink, SuperNodes and ServerApp run in the deployment's
    work folder, where a relative path would name a file inside it (deleted with it)."""
    from fedkl.data.files import is_data_file

    rc = dict(run_config)
    for key in (*PATH_KEYS, *(["fedkl-dataset"] if is_data_file(rc.get("fedkl-dataset")) else [])):
        if isinstance(rc.get(key), str) and rc[key] and not os.path.isabs(rc[key]):
            rc[key] = os.path.abspath(rc[key])
    return rc
