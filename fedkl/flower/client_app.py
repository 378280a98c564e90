"""Flower ClientApp for fedkl: ONE user's records, answering typed fedkl queries.

The node's user is its position ``node_config["partition-id"]`` in the dataset named by the
:class:`fedkl.flower.codec.ClientSpec` (given to :func:`make_client_app`, or read from the run
config keys ``fedkl-dataset`` / ``fedkl-problem`` / ``*-kwargs``). The client keeps only that user's
records (``dataset.train.subset([u])`` / ``test.subset([u])``) and computes its answer with the
same code as :class:`fedkl.federation.inprocess.InProcessFederation` run on that one-user dataset
(so clipping is ``clip_rows``, a non-finite answer is reported as failed, and so on).

Every request is a ``query.fedkl`` message (see :mod:`fedkl.flower.codec`). An unknown
request, a wrong shape/dtype, NaN or an oversize payload gets an ``"error"`` reply, never an
exception; other message types (``train``, ``evaluate``, ``query``) get an error reply too.
"""

from __future__ import annotations

import os

for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"), ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_k, _v)

import dataclasses  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from flwr.app import Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedkl.data import load_dataset  # noqa: E402
from fedkl.federation.inprocess import InProcessFederation  # noqa: E402
from fedkl.flower import codec  # noqa: E402
from fedkl.problems import make_problem  # noqa: E402

_LOCK = threading.Lock()
_DATASETS: dict[codec.ClientSpec, Any] = {}
_USERS: dict[tuple[codec.ClientSpec, int], "UserWorker"] = {}


class UserWorker:
    """One user's records and the problem; answers decoded queries."""

    def __init__(self, spec: codec.ClientSpec, partition_id: int) -> None:
        dataset, problem = _load(spec)
        if not 0 <= partition_id < dataset.train.num_users:
            raise codec.CodecError(
                f"partition-id {partition_id} is not a user position of {spec.dataset} "
                f"({dataset.train.num_users} users)",
                codec.ERR_NOT_CONFIGURED,
            )
        one = dataclasses.replace(
            dataset, train=dataset.train.subset([partition_id]), test=dataset.test.subset([partition_id])
        )
        self.partition_id = partition_id
        self.num_partitions = dataset.train.num_users
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
        ans = self._fed.compute(query, [0])
        if ans.failed:
            return codec.encode_error(codec.ERR_NOT_FINITE, "the answer of this user is not finite")
        return codec.encode_answer(kind, ans.values[0])


def _load(spec: codec.ClientSpec) -> tuple[Any, Any]:
    """Dataset and problem for ``spec``, loaded once per process."""
    with _LOCK:
        if spec not in _DATASETS:
            dkw, pkw = spec.kwargs
            dataset = load_dataset(spec.dataset, **dkw)
            _DATASETS[spec] = (dataset, make_problem(spec.problem, dataset, **pkw))
        return _DATASETS[spec]


def worker_for(spec: codec.ClientSpec, partition_id: int) -> UserWorker:
    key = (spec, partition_id)
    with _LOCK:
        w = _USERS.get(key)
    if w is None:
        w = UserWorker(spec, partition_id)
        with _LOCK:
            _USERS.setdefault(key, w)
    return w


def handle(message: Message, context: Context, spec: codec.ClientSpec | None = None) -> Message:
    """Answer one ``query.fedkl`` message; every failure becomes an error reply."""
    try:
        spec = spec or codec.ClientSpec.from_user_config(context.run_config)
        if spec is None:
            raise codec.CodecError(
                "no fedkl dataset configured (run config key 'fedkl-dataset')", codec.ERR_NOT_CONFIGURED
            )
        pid = context.node_config.get("partition-id")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise codec.CodecError(f"node_config partition-id {pid!r} is not an integer", codec.ERR_NOT_CONFIGURED)
        worker = worker_for(spec, pid)
        query = codec.decode_request(message.content, worker.num_params)
        content = worker.answer(query)
    except codec.CodecError as exc:
        content = codec.encode_error(exc.code, str(exc))
    except Exception as exc:  # never crash the node on a request
        content = codec.encode_error(codec.ERR_INTERNAL, f"{type(exc).__name__}: {exc}")
    return Message(content, reply_to=message)


def _refuse(message: Message, context: Context) -> Message:
    return Message(
        codec.encode_error(
            codec.ERR_BAD_REQUEST,
            f"unsupported message type {message.metadata.message_type!r}; fedkl answers {codec.MESSAGE_TYPE!r}",
        ),
        reply_to=message,
    )


def make_client_app(spec: codec.ClientSpec | None = None, *, torch_threads: int | None = None) -> ClientApp:
    """A ClientApp answering fedkl queries for the node's user. With ``spec=None`` the dataset and
    problem come from the run config (deployments); a given ``spec`` takes precedence.

    ``torch_threads``: set torch's intra-op threads of the client's process on first use (1 for
    a SuperNode or Ray actor: one user's tensors are tiny and extra threads only wait on each
    other). None leaves the process alone (in-process grids share it with the server)."""
    app = ClientApp()
    action = codec.MESSAGE_TYPE.split(".", 1)[1]

    @app.query(action)
    def _fedkl(message: Message, context: Context) -> Message:
        if torch_threads is not None and torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        return handle(message, context, spec)

    app.query()(_refuse)
    app.train()(_refuse)
    app.evaluate()(_refuse)
    return app


# For `flwr run` / SuperNodes: configured by the run config.
app = make_client_app(torch_threads=1)
