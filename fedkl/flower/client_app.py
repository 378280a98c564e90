"""Flower ClientApp for fedkl: ONE user's records (a deployment), or a BLOCK of users (a simulation), answering
typed fedkl queries.

The node's user is its position ``node_config["partition-id"]`` in the dataset named by the
:class:`fedkl.flower.codec.ClientSpec` (given to :func:`make_client_app`, or read from the run
config keys ``fedkl-dataset`` / ``fedkl-problem`` / ``*-kwargs``). The client keeps only that user's
records (``dataset.train.subset([u])`` / ``test.subset([u])``).

A site that loads its own data: with the dataset ``"sites"`` (the run's public schema and enrolment
list, :func:`fedkl.data.files.sites_dataset`), the node reads the file named by its node-config key
``data-path`` (``.csv``, ``.npz``, ``.parquet``), checks it against the run's schema
(:func:`fedkl.data.files.load_site`) and holds it as the one user ``sites[partition-id]``. A node may
declare its own schema in its node-config (``label-column``, ``feature-columns``, ``task``,
``feature-bound``); one that differs from the run's, or a file that breaks it, is refused: the node
answers every request, the handshake included, with an :data:`~fedkl.flower.codec.ERR_DATA` error
naming the problem. The server never reads a site's file.

Either way the client computes its answer with the
same code as :class:`fedkl.federation.inprocess.InProcessFederation` run on that one-user dataset
(so clipping is ``clip_rows``, a non-finite answer is reported as failed, and so on), always with the
reproducible kernels (:mod:`fedkl.problems.rowwise`: the default elsewhere is fast).

**Blocks (simulation only).** ``make_client_app(spec, users_per_node=B)`` makes node ``p`` hold the users at
positions ``p*B, ..., p*B + B - 1`` (:class:`BlockWorker`): Flower's simulation engine dispatches one message
per node, so a block amortises its cost over B users. The node still answers per user: its handshake names
every user it holds (:class:`~fedkl.flower.codec.BlockInfo`), a request carries each asked user's query and
the reply each user's own answer and status (:func:`~fedkl.flower.codec.encode_block_answer`; nothing is
summed on the node), so the server bounds, checks and fails each user separately, as with one node per user.
The block computes its users in one batched call (the batch-invariant kernels of
:mod:`fedkl.problems.rowwise`: every row is bit for bit the one-user answer); if that call raises, each user
is computed alone and only the users that raise fail. A deployment (``app``, gRPC) holds one user per node.

Every request is a ``query.fedkl`` message (see :mod:`fedkl.flower.codec`). An unknown
request, a wrong shape/dtype, NaN or an oversize payload gets an ``"error"`` reply, never an
exception; other message types (``evaluate``, ``query``) get an error reply too. ``train`` messages
are the SecAgg+ protocol's (:mod:`fedkl.flower.secagg`): Flower's ``secaggplus_mod`` handles them and
asks :func:`handle_secure` for the user's clipped answer, which leaves the node only quantized and
masked; a ``train`` message outside the protocol is refused by the mod (an error reply).
"""

from __future__ import annotations

import os

for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"), ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_k, _v)

import dataclasses  # noqa: E402
import threading  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
from flwr.app import Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedkl.data import load_dataset  # noqa: E402
from fedkl.federation.inprocess import InProcessFederation  # noqa: E402
from fedkl.flower import codec  # noqa: E402
from fedkl.flower.secagg import SUM_QUERIES  # noqa: E402
from fedkl.problems import make_problem  # noqa: E402
from fedkl.problems.rowwise import kernels  # noqa: E402

_LOCK = threading.Lock()
_DATASETS: dict[codec.ClientSpec, Any] = {}
_USERS: dict[tuple[codec.ClientSpec, int], "UserWorker"] = {}
_BLOCKS: dict[tuple[codec.ClientSpec, int, int], "BlockWorker"] = {}


class UserWorker:
    """One user's records and the problem; answers decoded queries."""

    def __init__(self, spec: codec.ClientSpec, partition_id: int, node_config: Any = None) -> None:
        if spec.dataset == "sites":  # this node's own file
            one, problem, n = _load_site(spec, partition_id, node_config)
        else:
            dataset, problem = _load(spec)
            n = dataset.train.num_users
            if not 0 <= partition_id < n:
                raise codec.CodecError(
                    f"partition-id {partition_id} is not a user position of {spec.dataset} ({n} users)",
                    codec.ERR_NOT_CONFIGURED,
                )
            one = dataclasses.replace(
                dataset, train=dataset.train.subset([partition_id]), test=dataset.test.subset([partition_id])
            )
        self.partition_id = partition_id
        self.num_partitions = n
        self.user_id = one.train.user_ids[0]
        self.problem = problem
        self._fed = InProcessFederation(problem, one)  # only this user's records

    @property
    def num_params(self) -> int:
        return self.problem.num_params

    def answer(self, query: Any) -> Any:
        """The reply content for a decoded query (exactly InProcessFederation's row for this user)."""
        kind = codec.kind_of(query)
        if query == codec.INFO:
            return codec.encode_info(self.partition_id, self.num_partitions, self.user_id, self.num_params)
        try:  # the query's own request rule (a decoded query already passed the codec's)
            query.check_request(self.num_params, 1)
        except ValueError as exc:
            raise codec.CodecError(str(exc)) from None
        with kernels("reproducible"):  # a client computes reproducibly, whatever its thread's default
            ans = self._fed.compute(query, [0])
        if ans.failed:
            return codec.encode_error(codec.ERR_NOT_FINITE, "the answer of this user is not finite")
        return codec.encode_answer(kind, ans.values[0])

    def secure_answer(self, content: Any) -> Any:
        """The answer to the sum query in a SecAgg+ ``train`` message, as the ``FitRes`` record that
        Flower's ``secaggplus_mod`` quantizes and masks (it never leaves the node as is; weight 1).
        Anything but a sum query, or a non-finite answer, raises: the node drops out of the sum."""
        from flwr.app import RecordDict
        from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
        from flwr.compat.common.recorddict_compat import fitres_to_recorddict

        query = codec.decode_request(
            RecordDict({k: v for k, v in content.items() if k != RECORD_KEY_CONFIGS}), self.num_params
        )
        if type(query) not in SUM_QUERIES:
            raise codec.CodecError(f"secure aggregation sums clipped answers only, not {codec.kind_of(query)!r}")
        query.check_request(self.num_params, 1)
        with kernels("reproducible"):
            ans = self._fed.compute(query, [0])
        if ans.failed:
            raise codec.CodecError("the answer of this user is not finite", codec.ERR_NOT_FINITE)
        value = ans.values[0].detach().to(torch.float64).cpu().numpy()
        return fitres_to_recorddict(FitRes(Status(Code.OK, ""), ndarrays_to_parameters([value]), 1, {}), False)


class BlockWorker:
    """The users at positions ``node*users_per_node, ...`` (a simulated node holding a block); answers
    block requests per user (module docstring)."""

    def __init__(self, spec: codec.ClientSpec, node: int, users_per_node: int) -> None:
        if spec.dataset == "sites":
            raise codec.CodecError("a site loads its own file: one user per node", codec.ERR_NOT_CONFIGURED)
        dataset, problem = _load(spec)
        n = dataset.train.num_users
        first = node * users_per_node
        if not 0 <= first < n:
            raise codec.CodecError(
                f"node {node} holds no user of {spec.dataset} ({n} users, {users_per_node} per node)",
                codec.ERR_NOT_CONFIGURED,
            )
        self.positions = range(first, min(n, first + users_per_node))
        rows = list(self.positions)
        block = dataclasses.replace(dataset, train=dataset.train.subset(rows), test=dataset.test.subset(rows))
        self.num_partitions = n
        self.user_ids = block.train.user_ids
        self.problem = problem
        self._fed = InProcessFederation(problem, block)  # only this block's records

    @property
    def num_params(self) -> int:
        return self.problem.num_params

    def info(self) -> Any:
        return codec.encode_block_info(self.positions.start, self.num_partitions, self.user_ids, self.num_params)

    def answer(self, positions: list[int], queries: list[Any]) -> Any:
        """The block reply: each asked user's answer to its query, or its own (code, reason)."""
        groups: dict[int, list[int]] = {}  # one per distinct query object, in order of first appearance
        for i, q in enumerate(queries):
            groups.setdefault(id(q), []).append(i)
        answers: dict[int, torch.Tensor] = {}
        errors: dict[int, tuple[int, str]] = {}
        for j, members in enumerate(groups.values()):
            query = queries[members[0]]
            shape = (len(members),) + tuple(codec.answer_shape(query, self.num_params))
            answers[j] = torch.zeros(shape, dtype=torch.float64)  # a failed user's row stays zero
            try:
                query.check_request(self.num_params, 1)  # each user's request, as a one-user node checks it
            except ValueError as exc:
                errors.update((i, (codec.ERR_BAD_REQUEST, str(exc))) for i in members)
                continue
            held = [k for k, i in enumerate(members) if positions[i] in self.positions]
            for k, i in enumerate(members):
                if positions[i] not in self.positions:
                    errors[i] = (codec.ERR_NOT_CONFIGURED, f"this node does not hold user position {positions[i]}")
            if held:
                rows = [positions[members[k]] - self.positions.start for k in held]
                with kernels("reproducible"):  # as a one-user node computes (bit for bit), whatever the default
                    values, failed = self._compute(query, rows)
                answers[j][held] = values.reshape((len(held),) + shape[1:]).to(torch.float64)
                for k, why in failed.items():
                    errors[members[held[k]]] = why
        return codec.encode_block_answer(positions, queries, answers, errors)

    def _compute(self, query: Any, rows: list[int]) -> tuple[torch.Tensor, dict[int, tuple[int, str]]]:
        """The answers of the block's ``rows`` (one batched call) and the failed ones: {index: (code, reason)}.
        If the batch raises, each user is computed alone and only the users that raise fail."""
        not_finite = (codec.ERR_NOT_FINITE, "the answer of this user is not finite")
        try:
            ans = self._fed.compute(query, rows)
            at = {r: k for k, r in enumerate(rows)}
            return ans.values, {at[r]: not_finite for r in ans.failed}
        except Exception:  # noqa: BLE001  (someone's computation raised: find who, alone)
            pass
        values, failed = [], {}
        for k, r in enumerate(rows):
            try:
                one = self._fed.compute(query, [r])
                values.append(one.values[0])
                if one.failed:
                    failed[k] = not_finite
            except Exception as exc:  # noqa: BLE001  (this user's error reply)
                values.append(None)
                failed[k] = (codec.ERR_INTERNAL, f"{type(exc).__name__}: {exc}")
        like = next((v for v in values if v is not None), None)
        zero = torch.zeros_like(like) if like is not None else None
        if zero is None:  # every user raised: their rows stay zero
            return torch.zeros((len(rows),) + tuple(query.answer_shape(self.num_params)), dtype=torch.float64), failed
        return torch.stack([zero if v is None else v for v in values]), failed


def _load(spec: codec.ClientSpec) -> tuple[Any, Any]:
    """Dataset and problem for ``spec``, loaded once per process."""
    with _LOCK:
        if spec not in _DATASETS:
            dkw, pkw = spec.kwargs
            dataset = load_dataset(spec.dataset, **dkw)
            _DATASETS[spec] = (dataset, make_problem(spec.problem, dataset, **pkw))
        return _DATASETS[spec]


def _load_site(spec: codec.ClientSpec, partition_id: int, node_config: Any) -> tuple[Any, Any, int]:
    """``(one-user dataset, problem, enrolled users)`` from this node's own file (``data-path``),
    checked against the run's schema (:data:`~fedkl.flower.codec.ERR_DATA` otherwise)."""
    from fedkl.data.files import DataError, Schema, load_site, parse_sites

    dkw, pkw = spec.kwargs
    sites = parse_sites(dkw.get("sites"))
    if not 0 <= partition_id < len(sites):
        raise codec.CodecError(
            f"partition-id {partition_id} is not a position of the run's {len(sites)} sites", codec.ERR_NOT_CONFIGURED
        )
    where = f"site {sites[partition_id]!r} (partition-id {partition_id})"
    try:
        path = (node_config or {}).get("data-path")
        if not path:
            raise DataError("no data-path in the node-config")
        schema = Schema.from_settings({k: v for k, v in dkw.items() if k not in ("sites", "split_seed")})
        differs = schema.differences(node_config)
        if differs:
            raise DataError("the node declares another schema: " + "; ".join(differs))
        one = load_site(str(path), schema, sites[partition_id], split_seed=int(dkw.get("split_seed", 0)))
    except DataError as exc:
        raise codec.CodecError(f"{where}: {exc}", codec.ERR_DATA) from None
    return one, make_problem(spec.problem, one, **pkw), len(sites)


def _cached(table: dict, key: tuple, make: Callable[[], Any]) -> Any:
    """``table[key]``, made once per process (a node's worker outlives its messages; two threads may race to
    make it: the first stored wins)."""
    with _LOCK:
        w = table.get(key)
    if w is None:
        w = make()
        with _LOCK:
            w = table.setdefault(key, w)
    return w


def worker_for(spec: codec.ClientSpec, partition_id: int, node_config: Any = None) -> UserWorker:
    key = (spec, partition_id, str((node_config or {}).get("data-path", "")) if spec.dataset == "sites" else "")
    return _cached(_USERS, key, lambda: UserWorker(spec, partition_id, node_config))


def block_worker_for(spec: codec.ClientSpec, node: int, users_per_node: int) -> BlockWorker:
    return _cached(_BLOCKS, (spec, node, users_per_node), lambda: BlockWorker(spec, node, users_per_node))


def handle(
    message: Message, context: Context, spec: codec.ClientSpec | None = None, users_per_node: int | None = None
) -> Message:
    """Answer one ``query.fedkl`` message; every failure becomes an error reply. ``users_per_node``: this
    node holds a block of users (:class:`BlockWorker`) and answers block requests."""
    try:
        spec = spec or codec.ClientSpec.from_user_config(context.run_config)
        if spec is None:
            raise codec.CodecError(
                "no fedkl dataset configured (run config key 'fedkl-dataset')", codec.ERR_NOT_CONFIGURED
            )
        pid = context.node_config.get("partition-id")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise codec.CodecError(f"node_config partition-id {pid!r} is not an integer", codec.ERR_NOT_CONFIGURED)
        if users_per_node is not None:
            block = block_worker_for(spec, pid, users_per_node)
            if codec.is_block_request(message.content):
                content = block.answer(*codec.decode_block_request(message.content, block.num_params))
            elif codec.decode_request(message.content, block.num_params) == codec.INFO:
                content = block.info()
            else:
                raise codec.CodecError(f"this node holds a block of {len(block.positions)} users: send block requests")
        else:
            worker = worker_for(spec, pid, context.node_config)
            query = codec.decode_request(message.content, worker.num_params)
            content = worker.answer(query)
    except codec.CodecError as exc:
        content = codec.encode_error(exc.code, str(exc))
    except Exception as exc:  # never crash the node on a request
        content = codec.encode_error(codec.ERR_INTERNAL, f"{type(exc).__name__}: {exc}")
    return Message(content, reply_to=message)


def handle_secure(message: Message, context: Context, spec: codec.ClientSpec | None = None) -> Message:
    """The ``train`` handler behind Flower's ``secaggplus_mod`` (:mod:`fedkl.flower.secagg`): called by
    the mod in the protocol's masked-vector stage; an exception drops the node out of the sum."""
    spec = spec or codec.ClientSpec.from_user_config(context.run_config)
    if spec is None:
        raise codec.CodecError("no fedkl dataset configured (run config key 'fedkl-dataset')", codec.ERR_NOT_CONFIGURED)
    pid = context.node_config.get("partition-id")
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise codec.CodecError(f"node_config partition-id {pid!r} is not an integer", codec.ERR_NOT_CONFIGURED)
    return Message(worker_for(spec, pid, context.node_config).secure_answer(message.content), reply_to=message)


def _protocol_train_only(message: Message, context: Context, call_next: Any) -> Message:
    """A mod in front of Flower's ``secaggplus_mod``: a ``train`` message that is not a SecAgg+ step gets
    fedkl's error reply (the mod would raise on it)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if message.metadata.message_type == "train" and RECORD_KEY_CONFIGS not in message.content.config_records:
        return _refuse(message, context)
    return call_next(message, context)


def _refuse(message: Message, context: Context) -> Message:
    return Message(
        codec.encode_error(
            codec.ERR_BAD_REQUEST,
            f"unsupported message type {message.metadata.message_type!r}; fedkl answers {codec.MESSAGE_TYPE!r}",
        ),
        reply_to=message,
    )


def make_client_app(
    spec: codec.ClientSpec | None = None, *, torch_threads: int | None = None, users_per_node: int | None = None
) -> ClientApp:
    """A ClientApp answering fedkl queries for the node's user. With ``spec=None`` the dataset and
    problem come from the run config (deployments); a given ``spec`` takes precedence.

    ``users_per_node``: node ``p`` holds the block of users ``p*B, ..., p*B + B - 1`` (B = users_per_node;
    simulations, module docstring); such a node refuses SecAgg+ (``train``) messages. None: one user per node.

    ``torch_threads``: set torch's intra-op threads of the client's process on first use (1 for
    a SuperNode or Ray actor: one user's tensors are tiny and extra threads only wait on each
    other). None leaves the process alone (in-process grids share it with the server)."""
    from flwr.client.mod import secaggplus_mod

    app = ClientApp(mods=[_protocol_train_only, secaggplus_mod])  # the mod handles SecAgg+ `train` messages only
    action = codec.MESSAGE_TYPE.split(".", 1)[1]

    @app.query(action)
    def _fedkl(message: Message, context: Context) -> Message:
        if torch_threads is not None and torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        return handle(message, context, spec, users_per_node)

    @app.train()
    def _secure(message: Message, context: Context) -> Message:
        if users_per_node is not None:
            raise codec.CodecError("a node holding a block of users takes no part in SecAgg+ (one user per node)")
        if torch_threads is not None and torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        return handle_secure(message, context, spec)

    app.query()(_refuse)
    app.evaluate()(_refuse)
    return app


# For `flwr run` / SuperNodes: configured by the run config.
app = make_client_app(torch_threads=1)
