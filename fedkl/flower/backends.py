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


def _open(backend: str):
    def open_federation(cfg: Any, dataset: Any):
        from fedkl.flower.server_app import start_federation

        return start_federation(
            backend,
            ClientSpec.from_run_config(cfg, task=dataset.task),
            user_ids=dataset.train.user_ids,
            secagg=getattr(cfg, "secagg", False),
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
