"""The vectorized federation sharded over Ray actors (``fedkl run --backend ray-shards --shards K``).

The users are cut into K contiguous blocks of positions; one Ray actor per block loads ITS users
itself (``build(block)``, the same loader and seed as the server: a data file is read one column at a
time and only the block's records are kept, :func:`fedkl.data.files.load_file`'s ``block``; no record
goes through the driver, at start or per round) and holds them as an
:class:`~fedkl.federation.inprocess.InProcessFederation` (stacked per-user tensors). A generated
dataset (synthetic, MovieLens ...) has no per-user storage: the shard draws it whole from its seed,
keeps its block and drops the rest before answering anything (a transient peak, not a copy held).
A request goes to every shard that holds an asked user, at once:

* :meth:`RayShardFederation.sum` (``federation.sum(...).total()``): each shard answers the SUM of its
  users' rows; the server adds the block sums in shard order (fixed) and returns the total as one row;
* :meth:`RayShardFederation.compute`: each shard answers its users' per-user rows; the server puts
  them back in the asked order.

Noise, the ledger and every sampling decision stay on the server: the algorithm, its
:class:`~fedkl.privacy.release.Releaser` and its charges are the in-process ones, unchanged. A shard
sees only the users it holds and the (public) query.

Equality with in-process. Per-user rows are bit for bit the in-process rows (the reproducible kernels
are batch-invariant: :mod:`fedkl.problems.rowwise`), so every algorithm that asks per-user answers
(paper 002's output perturbation, ...) releases the same bits. A SUM is not: in-process adds all rows
in one ``values.sum(0)``, here each shard adds its rows and the server adds the block sums, another
float order; the totals agree to float64 rounding (``|error| <= (n - 1) u sum_i |x_i|``, u = 2^-53),
not bit for bit. Shipping every row to the server to reproduce in-process's order would defeat the
shards, so sums are compared to a stated tolerance (tests/federation/test_ray_shards.py).

Cluster. ``address`` (``fedkl run --ray-address HOST:PORT``, else ``RAY_ADDRESS``) connects to a
running cluster (``ray start --head`` and worker raylets: ``make ray-cluster-demo``,
docs/how-to/ray-cluster.md); without one a local Ray instance is started for the run and stopped at
:meth:`close`. Placement is by resources, through Ray's scheduler: when a node of the cluster declares
the custom resource :data:`SHARD_RESOURCE` (``ray start --resources '{"fedkl_shards": 2}'``: it may
host 2 shards), every shard asks one unit of it, so shards go only to such nodes, at most that many
per node, spread (``SPREAD``) over them; otherwise each shard asks one CPU.

Failures. A user whose answer is non-finite is zeroed and listed in ``failed`` as in-process. A shard
whose actor dies during a request: its asked users fail that request ('shard-died': zero rows, listed
in ``failed``, the reason saved in :meth:`failure_report`; they were charged like every asked user,
and the noise is unchanged, so the sensitivity of the sum holds); Ray restarts the actor from the same
``build`` (``max_restarts`` times per shard), and the next request asks it again. A worker raylet
(a node) that dies takes its shards with it: they fail that request the same way and restart on a
node that still has the resource (``SPREAD`` is a preference, not a pin; with none free the request
waits at most :data:`RESTART_WAIT_S` and the shard's next request finds it dead, which counts as
another death). The restarted shard loads its block again from the data file, so the file must be
readable at the same path on every node that can host a shard (shared storage). A shard that dies
more than ``max_restarts`` times stops the run with one line (a RuntimeError; the ledger keeps every
charge made). tests/federation/test_ray_cluster.py kills a worker raylet mid-run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any, Callable, Sequence

import torch

from fedkl.federation.base import Answers, Federation, Query, failure_summary
from fedkl.federation.inprocess import InProcessFederation
from fedkl.problems.rowwise import kernel_mode, kernels

SHARD_RESOURCE = "fedkl_shards"  # a node's custom resource: how many shards it may host
RESTART_WAIT_S = 300.0  # how long a request waits for a dead shard's restart before going on

FAILURE_KINDS = {
    "shard-died": "the Ray actor holding this user died during the request (restarted for the next one)",
    "non-finite": "the answer (or the user's own computation) was NaN or infinite",
}


def blocks(num_users: int, shards: int) -> list[range]:
    """``shards`` contiguous blocks of user positions, sizes differing by at most one."""
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= max(num_users, 1):
        raise ValueError(f"shards must be an integer in [1, {num_users}] (the number of users), got {shards!r}")
    cuts = [k * num_users // shards for k in range(shards + 1)]
    return [range(cuts[k], cuts[k + 1]) for k in range(shards)]


def digest(user_ids: Sequence[str]) -> str:
    """A fingerprint of a block's user ids, in order: what a shard checks its data against (the
    actor's arguments stay small, so Ray keeps them inline and can restart it)."""
    return hashlib.sha256("\n".join(user_ids).encode()).hexdigest()


class Shard:
    """One Ray actor's block of users (run as ``ray.remote(Shard)``): an in-process federation over
    the users at positions ``block``. ``build(block)`` returns ``(dataset, problem, ...)`` where the
    dataset holds exactly the block's users (a loader that reads only them) or all users (then the
    shard keeps the block and drops the rest)."""

    def __init__(self, build: Callable[[range], tuple], block: range, ids_digest: str, mode: str) -> None:
        dataset, problem = build(block)[:2]
        if len(dataset.train.user_ids) != len(block):  # the whole population: keep the block, drop the rest
            positions = list(block)
            train, test = dataset.train.subset(positions), dataset.test.subset(positions)
            dataset = dataclasses.replace(dataset, train=train, test=test)
        if ids_digest != digest(dataset.train.user_ids):
            raise ValueError("the shard's dataset lists other users than the server's (same loader and seed?)")
        self.federation = InProcessFederation(problem, dataset)
        self.mode = mode
        self.crash_next = False

    def info(self) -> tuple[int, int, str]:
        """``(users held, parameter count, dtype)``: what the server checks once at start."""
        return self.federation.num_users, self.federation.num_params, str(self.federation.problem.dtype)

    def stats(self) -> dict:
        """What this shard holds and where (tests and simulations/bench_ray_shards.py): its train and
        test records, its process id, Ray node id and peak resident memory (VmHWM, MiB)."""
        import ray

        peak = None
        try:
            with open("/proc/self/status") as f:
                peak = next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:")), None)
        except OSError:
            pass
        f = self.federation
        return {
            "train": len(f._train.y),
            "test": len(f._test.y),
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "peak_rss_mb": peak,
        }

    def answer(self, query: Query, local: list[int], total: bool) -> tuple[torch.Tensor, list[int]]:
        """The rows of the users at block positions ``local`` (their sum when ``total``) and the block
        positions of those that failed (rows zero)."""
        if self.crash_next:
            os._exit(1)  # fault injection (crash_on_next_request): the process dies mid-request
        with kernels(self.mode):
            ans = self.federation.compute(query, local)
        return (ans.values.sum(0) if total else ans.values), ans.failed

    def crash_on_next_request(self) -> None:
        """Fault injection for tests: the actor's process dies when it is next asked."""
        self.crash_next = True


class RayShardFederation(Federation):
    """All users, in ``shards`` Ray actors holding contiguous blocks (see the module docstring).

    ``build``: a picklable callable, ``build(block)`` returns ``(dataset, problem, ...)`` on any node
    (:class:`Shard`; ``fedkl run``'s reads only the block from a data file); ``user_ids``: the
    server's list of the users, in position order (each shard checks that its dataset lists the same
    block). ``address``: the cluster to connect to (``ray.init(address=...)``; disconnected at
    :meth:`close`, the cluster keeps running); None: the running Ray instance when this process has
    one, else ``RAY_ADDRESS`` when set, else a local instance started here and stopped at :meth:`close`.
    ``mode``: the kernel mode the shards compute in (None: the caller's, :func:`fedkl.problems.rowwise.kernel_mode`,
    as every other federation computes).
    """

    def __init__(
        self,
        build: Callable[[range], tuple],
        user_ids: Sequence[str],
        shards: int,
        *,
        address: str | None = None,
        mode: str | None = None,
        max_restarts: int = 1,
        actor_options: dict[str, Any] | None = None,
    ) -> None:
        import ray

        self._user_ids = tuple(user_ids)
        self._blocks = blocks(len(self._user_ids), shards)
        self.max_restarts = int(max_restarts)
        self.deaths = [0] * shards
        self.failures: list[dict] = []
        self._owner = torch.empty(len(self._user_ids), dtype=torch.int64)
        for k, b in enumerate(self._blocks):
            self._owner[b.start : b.stop] = k
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            except ConnectionError as exc:
                self._started_ray = False
                raise RuntimeError(
                    f"ray-shards: cannot connect to the Ray cluster {address!r}: {_first_line(exc)}"
                ) from None
        if SHARD_RESOURCE in ray.cluster_resources():  # placed by the nodes' declared shard capacity
            placement = {"num_cpus": 0, "resources": {SHARD_RESOURCE: 1}}
        else:
            placement = {"num_cpus": 1}
        options = {
            **placement,
            "max_restarts": self.max_restarts,
            "max_task_retries": 0,
            "scheduling_strategy": "SPREAD",  # one block per node where the cluster has several
            **(actor_options or {}),
        }
        actor = ray.remote(Shard).options(**options)
        self.actors = [
            actor.remote(build, b, digest(self._user_ids[b.start : b.stop]), mode or kernel_mode())
            for b in self._blocks
        ]
        try:
            infos = ray.get([a.info.remote() for a in self.actors])
        except ray.exceptions.RayError as exc:
            self.close()
            raise RuntimeError(f"ray-shards: a shard could not start: {_first_line(exc)}") from None
        if len({i[1:] for i in infos}) != 1 or [i[0] for i in infos] != [len(b) for b in self._blocks]:
            self.close()
            raise RuntimeError(f"ray-shards: the shards disagree on their users or model: {infos}")
        self._num_params = infos[0][1]
        self.dtype = getattr(torch, infos[0][2].removeprefix("torch."))

    @property
    def user_ids(self) -> tuple[str, ...]:
        return self._user_ids

    @property
    def num_params(self) -> int:
        return self._num_params

    def compute(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        return self._ask(query, users, total=False)

    def sum(self, query: Query, users: Sequence[int] | None = None) -> Answers:
        return self._ask(query, users, total=True)

    def _ask(self, query: Query, users: Sequence[int] | None, total: bool) -> Answers:
        import ray

        users = self._users(users)
        if type(query).for_rows is not Query.for_rows:  # rows per asked user (GradientsAtOwnPoints): one per user
            query.check_request(self.num_params, len(users))
        asked = torch.tensor(users, dtype=torch.int64)
        owner = self._owner[asked]
        pending = []  # (shard, rows of the asked list, reply)
        for k, b in enumerate(self._blocks):
            rows = torch.nonzero(owner == k).flatten()
            if len(rows):
                local = (asked[rows] - b.start).tolist()
                reply = self.actors[k].answer.remote(query.for_rows(rows.tolist()), local, total)
                pending.append((k, rows, reply))
        shape = query.answer_shape(self.num_params)
        values = torch.zeros((1,) + shape if total else (len(users),) + shape, dtype=self.dtype)
        reasons: dict[int, str] = {}
        for k, rows, reply in pending:  # shard order: the block sums are added in a fixed order
            try:
                part, failed_local = ray.get(reply)
            except ray.exceptions.RayActorError as exc:
                self._shard_died(k, exc)
                why = f"shard-died: shard {k} of {len(self._blocks)} died during the request: {_first_line(exc)}"
                reasons.update({int(asked[r]): why for r in rows.tolist()})
                continue
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                raise (cause if isinstance(cause, Exception) else RuntimeError(_first_line(exc))) from None
            if total:
                values[0] = values[0] + part
            else:
                values[rows] = part
            start = self._blocks[k].start
            reasons.update({start + u: "non-finite: the answer was NaN or infinite" for u in failed_local})
        failed = [u for u in users if u in reasons]
        self.failures.append(
            {
                "request": len(self.failures),
                "query": type(query).__name__,
                "asked": len(users),
                "failed": {self._user_ids[u]: reasons[u] for u in failed},
            }
        )
        return Answers(users=users, values=values, failed=failed)

    def _shard_died(self, k: int, exc: Exception) -> None:
        """Count shard ``k``'s death; stop the run past ``max_restarts``, else wait until Ray has
        restarted it (at most ``RESTART_WAIT_S``), so that the next request asks it again."""
        import ray

        self.deaths[k] += 1
        if self.deaths[k] > self.max_restarts:
            raise RuntimeError(
                f"ray-shards: shard {k} (users {self._blocks[k].start}..{self._blocks[k].stop - 1}) died "
                f"{self.deaths[k]} times, more than the {self.max_restarts} restarts allowed; the run stops "
                f"(its ledger keeps every charge): {_first_line(exc)}"
            )
        deadline = time.monotonic() + RESTART_WAIT_S
        while time.monotonic() < deadline:
            try:
                ray.get(self.actors[k].info.remote(), timeout=max(deadline - time.monotonic(), 0.1))
                return
            except ray.exceptions.ActorUnavailableError:  # restarting
                time.sleep(0.2)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return  # not back: the next request finds it dead and counts that

    def failure_report(self) -> dict:
        """result.json's ``failures``: counts per :data:`FAILURE_KINDS` kind, every request that had
        failures with each failed user's reason, and the deaths per shard."""
        return {**failure_summary(self.failures, FAILURE_KINDS), "shard_deaths": list(self.deaths)}

    def close(self) -> None:
        """Stop the shards (and the local Ray instance this federation started); idempotent."""
        import ray

        for a in getattr(self, "actors", []):
            ray.kill(a)
        self.actors = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
