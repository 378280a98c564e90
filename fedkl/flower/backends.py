"""The transport backends of ``fedkl run`` (``--backend flower-local | flower-sim | grpc | ray-shards``),
registered with :mod:`fedkl.runner` on import. The CLI and :func:`fedkl.train` import this module when a
run asks for one of them; the run layer itself never imports Flower or Ray."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from fedkl.data import load_dataset
from fedkl.data.files import DATA_SETTINGS, dataset_kwargs, is_data_file
from fedkl.flower.codec import ClientSpec
from fedkl.problems.rowwise import kernel_mode
from fedkl.runner import Transport, load_run_data, register_transport


def cpu_cores() -> int:
    """The CPU cores this process may run on (Ray's simulation runs one ClientApp per core: ``num_cpus`` 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def users_per_node(setting: int, backend: str, num_users: int, cores: int | None = None) -> int:
    """The users each simulated Flower node holds (``--users-per-node``; :class:`fedkl.flower.client_app.BlockWorker`).

    The rule: an explicit ``setting`` >= 1 is kept; 0 (auto) is, on ``flower-sim``, ``ceil(n / cores)`` -- about
    one node per CPU core, so Flower's engine dispatches one message per core per request instead of one per
    user (its per-message cost, tens of ms, dominated a round), while every core still computes its block in
    parallel; on ``flower-local`` (the deterministic in-process grid, the per-user reference) one user per node.
    Deployments (``grpc``) always hold one user per node. The released model and the ledger do not depend on
    the block size (the block computes with the batch-invariant kernels and answers per user)."""
    if setting >= 1 or backend != "flower-sim":
        return max(setting, 1)
    return max(1, -(-num_users // (cores or cpu_cores())))


def _open(backend: str):
    def open_federation(cfg: Any, dataset: Any):
        from fedkl.flower.server_app import start_federation

        ids = dataset.train.user_ids
        return start_federation(
            backend,
            ClientSpec.from_run_config(cfg, task=dataset.task),
            user_ids=ids,
            secagg=getattr(cfg, "secagg", False),
            users_per_node=1 if cfg.secagg else users_per_node(cfg.users_per_node, backend, len(ids)),
        )

    return open_federation


def _train_over_grpc(cfg: Any, dataset: Any, out: str, log: Any, recover: str | None = None):
    from fedkl.flower.deploy import train_over_grpc

    return train_over_grpc(cfg, dataset, out, log=log, recover=recover)


def load_shard_data(cfg: Any, block: range) -> tuple:
    """A Ray shard's ``(dataset, problem, name)`` (:class:`fedkl.federation.ray_shards.Shard`): from a
    data file only the users at positions ``block`` (:func:`fedkl.data.files.load_file`); a generated
    dataset whole (the shard keeps its block)."""
    if not is_data_file(cfg.dataset):
        return load_run_data(cfg)
    kw = dataset_kwargs({k: getattr(cfg, k, None) for k in DATA_SETTINGS})
    return load_run_data(cfg, load_dataset(cfg.dataset, **kw, block=block))


def _open_ray_shards(cfg: Any, dataset: Any):
    """Every shard loads its users itself from ``cfg`` (same loader, same seed; a data file by its
    absolute path, whatever the actor's working directory or node)."""
    from fedkl.federation.ray_shards import RayShardFederation

    if is_data_file(cfg.dataset):
        cfg = dataclasses.replace(cfg, dataset=os.path.abspath(cfg.dataset))
    build = functools.partial(load_shard_data, cfg)
    return RayShardFederation(build, dataset.train.user_ids, cfg.shards, address=cfg.ray_address, mode=kernel_mode())


register_transport("flower-local", Transport(open=_open("flower-local")))
register_transport("flower-sim", Transport(open=_open("flower-sim")))
register_transport("grpc", Transport(train=_train_over_grpc))
register_transport("ray-shards", Transport(open=_open_ray_shards))
