"""Simulated Flower nodes holding a block of users (``--users-per-node``, :class:`fedkl.flower.client_app.BlockWorker`):
the same model bit for bit and the same ledger as one user per node, every answer still decoded, bounded and
failed per user on the server, SecAgg+ refused with blocks, and the block-size rule."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, Message, RecordDict  # noqa: E402

from fedkl.data import load_dataset  # noqa: E402
from fedkl.federation.base import (  # noqa: E402
    ClippedGradient,
    ClippedLocalUpdate,
    GradientDifference,
    GradientsAtOwnPoints,
    LocalLoss,
)
from fedkl.federation.inprocess import InProcessFederation  # noqa: E402
from fedkl.flower import codec, localgrid  # noqa: E402
from fedkl.flower.backends import users_per_node  # noqa: E402
from fedkl.flower.client_app import make_client_app  # noqa: E402
from fedkl.flower.federation import FlowerFederation  # noqa: E402
from fedkl.flower.localgrid import LocalGrid  # noqa: E402
from fedkl.flower.server_app import open_federation, run_flower_simulation  # noqa: E402
from fedkl.privacy import PrivacyLedger  # noqa: E402
from fedkl.runner import RunConfig  # noqa: E402

pytestmark = pytest.mark.flower

N, M, D, B = 10, 6, 4, 4  # blocks of 4, 4 and 2 users
SPEC = codec.ClientSpec.build("synthetic-logistic", "logistic", {"n_users": N, "m": M, "d": D, "seed": 3})


def _ids():
    return load_dataset(SPEC.dataset, **SPEC.kwargs[0]).train.user_ids


def _federation(block: int | None, **grid_kw) -> FlowerFederation:
    nodes = N if block is None else -(-N // block)
    grid = LocalGrid(make_client_app(SPEC, users_per_node=block), nodes, **grid_kw)
    return FlowerFederation(grid, user_ids=_ids(), wait_for_nodes=0.0)


def _queries(w):
    points = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return [
        ClippedGradient(w, 0.3),
        GradientDifference(w, 2 * w, 0.2),
        ClippedLocalUpdate(w, 0.5, 3, 0.1, 2),
        LocalLoss(w, "test"),
        GradientsAtOwnPoints(points),  # a different request per user: one query per user in the block message
    ]


def test_every_query_over_blocks_is_bitwise_one_user_per_node():
    w = torch.linspace(-1, 1, D, dtype=torch.float64)
    single, blocks = _federation(None), _federation(B)
    assert len(blocks.blocks) == 3 and blocks.handshake["nodes"] == 3 and single.handshake["nodes"] == N
    for q in _queries(w):
        cohorts = [None] if isinstance(q, GradientsAtOwnPoints) else [None, [7, 0, 9, 5]]
        for users in cohorts:  # every user, and a cohort across blocks out of order
            a, b = single.compute(q, users), blocks.compute(q, users)
            assert a.failed == b.failed == [] and torch.equal(a.values, b.values), type(q).__name__


def _cfg(tmp_path, name, **kw):
    base = dict(
        dataset=SPEC.dataset, problem=SPEC.problem, epsilon=2.0, rounds=3, lr=0.5, clip=0.5, seed=3, noise_seed=7,
        out=str(tmp_path / name), reference=False, kernels="reproducible",
    )  # fmt: skip
    return RunConfig.from_settings(strict=False, **{**base, **kw})


def _ledger(out):
    with PrivacyLedger(out["ledger_path"]) as led:
        led.verify()
        rel = [(r["label"], r["sensitivity"], r["noise_scale"], r["rho"], r["users"]) for r in led.releases()]
        return rel, [(u, led.spend(u)) for u in out["user_ids"]]


@pytest.mark.parametrize("algorithm", ["noisy-gd"])
def test_a_run_with_blocks_is_bitwise_the_run_with_one_user_per_node(tmp_path, algorithm):
    """Same seed: the same model bit for bit and the same ledger (every release, every user's spend). Every
    algorithm over blocks: tests/algorithms/test_algorithm_registry.py (flower-local, 5 users per node)."""
    quiet = dict(log=lambda s: None, spec=SPEC)
    one = run_flower_simulation(_cfg(tmp_path, "one", algorithm=algorithm), "flower-local", **quiet)
    blk = run_flower_simulation(_cfg(tmp_path, "blk", algorithm=algorithm), "flower-local", users_per_node=B, **quiet)
    assert blk["failures"]["handshake"]["nodes"] == 3 and one["failures"]["handshake"]["nodes"] == N
    assert torch.equal(one["w"], blk["w"]) and blk["failed_users"] == one["failed_users"] == [0, 0, 0]
    assert _ledger(one) == _ledger(blk) and len(_ledger(one)[0]) >= 3


def test_a_user_raising_inside_a_block_fails_alone(monkeypatch):
    """One user of a block whose computation raises: only that user fails ('client-error', zero row); the
    block's other users answer exactly as with one user per node."""
    w = torch.linspace(-1, 1, D, dtype=torch.float64)
    bad = _ids()[5]  # in the second block (positions 4..7)
    compute = InProcessFederation.compute

    def raising(self, query, users=None):
        if bad in [self.user_ids[u] for u in (users if users is not None else range(len(self.user_ids)))]:
            raise RuntimeError("this user's records break the model")
        return compute(self, query, users)

    ref = _federation(None).compute(ClippedGradient(w, 0.3))
    monkeypatch.setattr(InProcessFederation, "compute", raising)
    fed = _federation(B)
    out = fed.compute(ClippedGradient(w, 0.3))
    assert out.failed == [5]
    assert "client-error" in fed.failures[-1]["failed"][bad] and "break the model" in fed.failures[-1]["failed"][bad]
    assert torch.equal(out.values[5], torch.zeros(D, dtype=torch.float64))
    keep = [u for u in range(N) if u != 5]
    assert torch.equal(out.values[keep], ref.values[keep])


class _TamperRow(localgrid.Fault):
    """A block node that returns one user's row ``scale`` times larger (a lying node): the server's own norm
    check must reject that user alone."""

    def __init__(self, row: int, scale: float) -> None:
        self.row, self.scale = row, scale

    def reply(self, partition_id, request, reply):
        if reply.has_error() or "fedkl" not in reply.content or reply.content["fedkl"]["kind"] != codec.BLOCK:
            return reply
        a = reply.content["answer"]["v0"].numpy().copy()
        a[self.row] *= self.scale
        content = RecordDict({"fedkl": reply.content["fedkl"], "answer": ArrayRecord({"v0": Array(a)})})
        return Message(content, reply_to=request)


def test_the_server_bounds_each_user_of_a_block_and_a_silent_block_fails_per_user():
    w = torch.linspace(-1, 1, D, dtype=torch.float64)
    # partition 1 = users 4..7: its second row (user 5) is inflated past the clip; partition 2 (users 8, 9) drops out
    fed = _federation(B, faults={1: _TamperRow(1, 1e3), 2: localgrid.drop()})
    out = fed.compute(ClippedGradient(w, 0.3))
    failed = fed.failures[-1]["failed"]
    ids = _ids()
    assert out.failed == [5, 8, 9]
    assert failed[ids[5]].startswith("out-of-bound") and all(failed[ids[u]].startswith("no-reply") for u in (8, 9))
    assert all(float(v.norm()) <= 0.3 * (1 + 1e-9) for v in out.values)


def test_a_malformed_block_reply_fails_each_of_its_users():
    def garbage_rows(req, rep):  # one NaN row: that user alone is 'non-finite'
        if "fedkl" not in rep.content:
            return rep
        a = rep.content["answer"]["v0"].numpy().copy()
        a[0, 0] = np.nan
        return Message(
            RecordDict({"fedkl": rep.content["fedkl"], "answer": ArrayRecord({"v0": Array(a)})}), reply_to=req
        )

    fed = _federation(B, faults={0: localgrid._ReplyFault(garbage_rows), 1: localgrid.garbage()})
    out = fed.compute(ClippedGradient(torch.ones(D, dtype=torch.float64), 0.3))
    failed = fed.failures[-1]["failed"]
    assert out.failed == [0, 4, 5, 6, 7]
    assert failed[_ids()[0]].startswith("non-finite") and failed[_ids()[4]].startswith("bad-reply")


def test_block_requests_are_validated_on_the_node():
    w = torch.ones(D, dtype=torch.float64)
    content = codec.encode_block_request([4, 5], [ClippedGradient(w, 0.3)] * 2)
    content[codec.BLOCK]["query_of"] = [0, 2]  # names a query it does not carry
    with pytest.raises(codec.CodecError, match="query_of"):
        codec.decode_block_request(content, D)
    good = codec.encode_block_request([0, 5], [ClippedGradient(w, 0.3)] * 2)
    positions, queries = codec.decode_block_request(good, D)
    assert positions == [0, 5] and queries[0] is queries[1]
    single = codec.encode_request(ClippedGradient(w, 0.3))  # a one-user request to a block node: an error reply
    grid = LocalGrid(make_client_app(SPEC, users_per_node=B), 3)
    reply = grid.app(Message(single, 1, codec.MESSAGE_TYPE), grid.contexts[next(iter(grid.contexts))])
    assert "error" in reply.content and "block" in reply.content["error"]["reason"]
    # node 0 holds positions 0..3: a request for position 5 fails that user alone
    nid = next(n for n, p in grid.partition_of.items() if p == 0)
    reply = grid.app(Message(good, nid, codec.MESSAGE_TYPE), grid.contexts[nid])
    head = reply.content["fedkl"]
    assert head["codes"][0] == 0 and head["codes"][1] == codec.ERR_NOT_CONFIGURED


def test_secagg_with_blocks_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="one user per node"):
        with open_federation("flower-local", SPEC, user_ids=_ids(), secagg=True, users_per_node=B):
            pass
    grid = LocalGrid(make_client_app(SPEC, users_per_node=B), 3)
    with pytest.raises(RuntimeError, match="one user per node"):
        FlowerFederation(grid, user_ids=_ids(), wait_for_nodes=0.0, secagg=True)
    with pytest.raises(ValueError, match="one user per node"):
        _cfg(tmp_path, "x", secagg=True, users_per_node=2)
    with pytest.raises(ValueError, match="one user per node"):
        _cfg(tmp_path, "x", backend="grpc", users_per_node=2)


def test_the_block_size_rule():
    assert users_per_node(0, "flower-sim", 10_000, cores=16) == 625  # auto: one node per core
    assert users_per_node(0, "flower-sim", 10, cores=16) == 1
    assert users_per_node(0, "flower-local", 10_000, cores=16) == 1  # the per-user reference grid
    assert users_per_node(7, "flower-sim", 10_000, cores=16) == 7  # explicit
    assert users_per_node(1, "flower-sim", 10_000, cores=16) == 1


def test_the_handshake_ends_when_the_blocks_cover_every_user():
    """The expected count is of users: three block nodes answering for all 10 end the wait at once, not at the
    connect deadline (with the default deadlines the old count, nodes, waited 80 s of simulated time)."""
    grid = LocalGrid(make_client_app(SPEC, users_per_node=B), 3)
    fed = FlowerFederation(grid, user_ids=_ids())
    assert fed.handshake["waited_s"] < 1 and fed.handshake["nodes"] == 3 and not fed.unserved
    absent = FlowerFederation(LocalGrid(make_client_app(SPEC, users_per_node=B), 3, absent=[1]), user_ids=_ids())
    assert sorted(absent.unserved) == [4, 5, 6, 7]  # the absent node's users, each named
    assert absent.handshake["waited_s"] >= 60  # a user missing: waited for until the connect deadline


@pytest.mark.parametrize(
    "query",
    [
        ClippedGradient(torch.zeros(D), 0.3),
        GradientDifference(torch.zeros(D), torch.zeros(D), 0.3),
        LocalLoss(torch.zeros(D)),
    ],
)
def test_batched_answer_checks_reject_exactly_the_rows_the_per_row_check_rejects(query):
    """The server checks a block's rows with Query.check_answers (batched): the same rows as check_answer alone."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(40, *query.answer_shape(D), dtype=torch.float64, generator=g)
    if rows.dim() > 1:
        scale = torch.tensor([0.5, 1.0, 1.0 + 1e-13, 1.0 + 1e-9, 2.0] * 8, dtype=torch.float64) * 0.3
        rows = rows / rows.norm(dim=1, keepdim=True) * scale[:, None]
    alone = {}
    for k in range(rows.shape[0]):
        try:
            query.check_answer(rows[k])
        except ValueError as exc:
            alone[k] = str(exc)
    batched = query.check_answers(rows)
    assert sorted(batched) == sorted(alone)
    assert rows.dim() == 1 or sorted(alone) == [k for k in range(40) if k % 5 >= 3]


def test_a_subclass_with_its_own_rule_is_checked_by_that_rule():
    """ClampedGradientDifference (an l_inf bound) inherits GradientDifference: its batched check is its own rule."""
    from fedkl.federation.base import ClampedGradientDifference

    q = ClampedGradientDifference(torch.zeros(D), torch.zeros(D), 0.3)
    rows = torch.full((3, D), 0.2, dtype=torch.float64)  # l2 norm 0.4 > 0.3, every entry within the 0.3 bound
    rows[1, 0] = 0.5  # over the l_inf bound
    assert list(q.check_answers(rows)) == [1]
