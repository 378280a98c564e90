"""Absent, failed and lying users INSIDE a Flower block (``--users-per-node``), for EVERY registered algorithm:
handled per user exactly as with one user per node.

The same faults on the same users, once over one node per user and once over nodes holding 3 users each
(:class:`fedkl.flower.client_app.BlockWorker`), on the deterministic LocalGrid (flower-local, about a second
per algorithm: every algorithm is run, no subset):

* user 0 (block 0): its client finds its own answer non-finite (reported failed by the client's federation);
* user 1 (block 0): its own computation raises (its records break the model);
* user 4 (block 1): lies, answering its honest row x 1e3 + 1 (beyond every clip bound);
* user 5 (block 1): answers NaN (the server finds it non-finite);
* the next-to-last block's node never connects (one node per user: none of its users' nodes does);
* the last block's node drops out after the handshake (one node per user: each of those users' nodes).

Users 2 and 3 are honest users sharing a node with misbehaving ones. Both runs must release the same model bit
for bit, charge the same ledger rows to the same users, and save the same failure record per request and per
user (``failures.by_request``: each failed user with its kind and reason). In the block run, the liar is
rejected by the SERVER's per-user check (``out-of-bound``) at every request whose query has a bound; the other
misbehaving users and the absent and dropped blocks' users fail at every request that asks them, each with its
own reason; no other user ever fails.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from build_helpers import SMALL  # noqa: E402

from fedkl.algorithms.catalog import REGISTRY  # noqa: E402
from fedkl.federation.base import QUERY_KINDS, Query  # noqa: E402
from fedkl.federation.inprocess import InProcessFederation  # noqa: E402
from fedkl.flower import codec, localgrid  # noqa: E402
from fedkl.flower.federation import FlowerFederation  # noqa: E402
from fedkl.flower.server_app import run_flower_simulation  # noqa: E402
from fedkl.privacy import PrivacyLedger  # noqa: E402
from fedkl.runner import RunConfig  # noqa: E402

pytestmark = pytest.mark.flower

B = 3  # users per block node
FAILS, RAISER, LIAR, NAN = 0, 1, 4, 5


def _misbehaving_clients(monkeypatch, ids: tuple[str, ...]) -> None:
    """Every client's computation (one user's node or a block's, both InProcessFederation on their own records):
    RAISER's raises, LIAR's row is inflated, NAN's is NaN, FAILS's is reported failed (a zero row, as
    InProcessFederation reports a non-finite answer). The server answers nothing itself over Flower."""
    compute = InProcessFederation.compute
    raiser, liar, nan, fails = ids[RAISER], ids[LIAR], ids[NAN], ids[FAILS]

    def misbehaving(self, query, users=None):
        asked = [self.user_ids[u] for u in (users if users is not None else range(len(self.user_ids)))]
        if raiser in asked:
            raise RuntimeError("this user's records break the model")
        ans = compute(self, query, users)
        if fails in asked:
            k = asked.index(fails)
            ans.values = ans.values.clone()
            ans.values[k] = 0
            ans.failed = sorted(set(ans.failed) | {(users if users is not None else range(len(asked)))[k]})
        if liar in asked or nan in asked:
            ans.values = ans.values.clone()
            if liar in asked:
                k = asked.index(liar)
                ans.values[k] = ans.values[k] * 1e3 + 1.0
            if nan in asked:
                ans.values[asked.index(nan)] = float("nan")
        return ans

    monkeypatch.setattr(InProcessFederation, "compute", misbehaving)


def _run(tmp_path, monkeypatch, name: str, block: int) -> dict:
    kw = dict(SMALL[name])
    n = kw.pop("users", 12)
    spec = codec.ClientSpec.build(
        "synthetic-logistic", "logistic", {"n_users": n, "m": 6, "d": 3, "seed": 2}, {"reg": kw.get("reg", 0.0)}
    )
    base = dict(
        dataset="synthetic-logistic", problem="logistic", algorithm=name, epsilon=3.0, rounds=3, lr=0.5, clip=1.0,
        seed=2, noise_seed=5, reference=False, force=True, kernels="reproducible", clients="in-class",
    )  # fmt: skip
    cfg = RunConfig.from_settings(strict=False, **{**base, **kw}, out=str(tmp_path / f"b{block}"))
    last = -(-n // B) - 1
    absent, dropped = list(range((last - 1) * B, last * B)), list(range(last * B, n))  # the last two blocks
    assert not {RAISER, LIAR, NAN, FAILS} & {*absent, *dropped}
    if block > 1:
        faults, absent_nodes = {last: localgrid.drop()}, [last - 1]
    else:
        faults, absent_nodes = {u: localgrid.drop() for u in dropped}, absent
    asked: list[tuple] = []  # every request's (wire kind, asked users), in request order
    compute = FlowerFederation.compute

    def recording(self, query, users=None):
        who = list(range(self.num_users)) if users is None else [int(u) for u in users]
        asked.append((codec.kind_of(query.for_user(0)), who))
        return compute(self, query, users)

    monkeypatch.setattr(FlowerFederation, "compute", recording)
    try:
        out = run_flower_simulation(
            cfg, "flower-local", log=lambda s: None, spec=spec, users_per_node=block, faults=faults, absent=absent_nodes
        )
    except Exception as exc:  # noqa: BLE001  (the same refusal in both layouts is the same handling)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        monkeypatch.setattr(FlowerFederation, "compute", compute)
    with PrivacyLedger(out["ledger_path"]) as led:
        led.verify()
        rows = [(r["label"], r["sensitivity"], r["noise_scale"], r["rho"], r["users"]) for r in led.releases()]
        spend = [(u, led.spend(u)) for u in out["user_ids"]]
    return {"w": out["w"], "ledger": rows, "spend": spend, "failures": out["failures"], "asked": asked,
            "dropped": dropped, "absent": absent}  # fmt: skip


def _bounded(kind: str) -> bool:
    """Whether the query of wire kind ``kind`` bounds its answers (its own check_answer)."""
    return QUERY_KINDS[kind].check_answer is not Query.check_answer


@pytest.mark.parametrize("name", sorted(set(REGISTRY) & set(SMALL)))
def test_failed_and_lying_users_inside_a_block_are_handled_as_with_one_user_per_node(tmp_path, monkeypatch, name):
    ids = _ids(name)
    _misbehaving_clients(monkeypatch, ids)
    one = _run(tmp_path, monkeypatch, name, 1)
    blk = _run(tmp_path, monkeypatch, name, B)
    assert "error" not in one and "error" not in blk, (one.get("error"), blk.get("error"))
    assert (one["w"] is None) == (blk["w"] is None)
    if one["w"] is not None:
        assert torch.equal(one["w"], blk["w"])
    assert blk["ledger"] and blk["ledger"] == one["ledger"] and blk["spend"] == one["spend"]
    # the same failure record, request by request, user by user (kind and reason)
    assert blk["asked"] == one["asked"] and blk["asked"]
    assert blk["failures"]["by_request"] == one["failures"]["by_request"]
    assert blk["failures"]["counts"] == one["failures"]["counts"]
    # and it is the per-user handling: each misbehaving user failed alone, at every request that asked it, with
    # its own reason; the liar by the server's check wherever the query bounds its answers
    recorded = {r["request"]: r for r in blk["failures"]["by_request"]}
    for k, (kind, users) in enumerate(blk["asked"]):
        req = recorded.get(k, {"failed": {}, "query": kind})
        assert req["query"] == kind
        failed = {u: why.split(":", 1)[0] for u, why in req["failed"].items()}
        expected = {RAISER: "client-error", NAN: "non-finite", FAILS: "non-finite"}
        expected.update({u: "no-reply" for u in blk["dropped"]} | {u: "absent" for u in blk["absent"]})
        if _bounded(kind):
            expected[LIAR] = "out-of-bound"
        assert failed == {ids[u]: why for u, why in expected.items() if u in users}, (k, req)
    assert recorded


def _ids(name: str) -> tuple[str, ...]:
    from fedkl.data import load_dataset

    n = SMALL[name].get("users", 12)
    return load_dataset("synthetic-logistic", n_users=n, m=6, d=3, seed=2).train.user_ids
