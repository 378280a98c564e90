"""The Flower transport: ClientApp + FlowerFederation compute what InProcessFederation computes,
failures follow the in-process policy (zero contribution, listed in ``failed``, noise and ledger
unchanged), and noisy GD over Flower releases the same model and ledger as in-process."""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import dataclasses  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import ClassVar  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent  # noqa: E402
from fedkl.data import load_dataset  # noqa: E402
from fedkl.federation.base import (  # noqa: E402
    QUERY_KINDS,
    Answers,
    ClampedGradient,
    ClippedGradient,
    DualClippedGradient,
    FeatureClippedGradient,
    Federation,
    GradientDifference,
    GradientsAtOwnPoints,
    LocalLoss,
    LocalRegularizedMinimizer,
    Query,
    wire_number,
)
from fedkl.federation.clipping import zero_nonfinite_rows  # noqa: E402
from fedkl.federation.inprocess import InProcessFederation, answers  # noqa: E402
from fedkl.flower import codec, localgrid  # noqa: E402
from fedkl.flower.client_app import make_client_app  # noqa: E402
from fedkl.flower.federation import FlowerFederation  # noqa: E402
from fedkl.flower.localgrid import LocalGrid  # noqa: E402
from fedkl.flower.server_app import run_flower_simulation  # noqa: E402
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter  # noqa: E402
from fedkl.problems import make_problem  # noqa: E402
from fedkl.runner import RunConfig  # noqa: E402

pytestmark = pytest.mark.flower

N, M, D = 16, 12, 5
LS = codec.ClientSpec.build("synthetic-least-squares", "least-squares", {"n_users": N, "m": M, "d": D, "seed": 4})
LOGIT = codec.ClientSpec.build("synthetic-logistic", "logistic", {"n_users": N, "m": M, "d": D, "seed": 4})


def _inprocess(spec: codec.ClientSpec) -> InProcessFederation:
    dkw, pkw = spec.kwargs
    ds = load_dataset(spec.dataset, **dkw)
    return InProcessFederation(make_problem(spec.problem, ds, **pkw), ds)


def _flower(spec: codec.ClientSpec, **grid_kw) -> tuple[FlowerFederation, LocalGrid]:
    grid = LocalGrid(make_client_app(spec), N, **grid_kw)
    ref = _inprocess(spec)
    return FlowerFederation(grid, user_ids=ref.user_ids, wait_for_nodes=0.0), grid


def _w(seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _queries(w: torch.Tensor):
    return [
        ClippedGradient(w, 0.3),
        ClippedGradient(w, 1e6),
        GradientDifference(w, 2 * w, 0.2),
        ClampedGradient(w, 0.05),
        DualClippedGradient(w, 0.05, 3.0),
        FeatureClippedGradient(w, 0.5, 10.0),
        LocalLoss(w),
        LocalLoss(w, "test"),
        LocalRegularizedMinimizer(w, 0.5),
    ]


# --- per-user answers ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [LS, LOGIT], ids=["least-squares", "logistic"])
def test_every_query_matches_inprocess(spec):
    fed, grid = _flower(spec)
    ref = _inprocess(spec)
    assert fed.user_ids == ref.user_ids and fed.num_params == ref.num_params
    # node ids are not partition ids: the handshake mapped them
    assert set(grid.get_node_ids()).isdisjoint(range(N + 1))
    users = [5, 0, 11, 3]
    for q in _queries(_w(1, 2.0)):
        for us in (users, None):
            a, b = fed.compute(q, us), ref.compute(q, us)
            assert a.users == b.users and a.failed == b.failed == []
            assert a.values.shape == b.values.shape and a.values.dtype == b.values.dtype
            assert torch.equal(a.values, b.values), type(q).__name__  # bit for bit, L-BFGS included
    # clipped answers respect the bound
    a = fed.compute(ClippedGradient(_w(1, 2.0), 0.3))
    assert (a.values.norm(dim=1) <= 0.3 * (1 + 1e-12)).all()


class PerUserReference(Federation):
    """In-process reference computing each user's answer ALONE (InProcessFederation on that user's
    one-user dataset, what a client does), stacked in user order. The batched InProcessFederation
    must equal it bit for bit (batch-invariant kernels, :mod:`fedkl.problems.rowwise`)."""

    def __init__(self, spec: codec.ClientSpec) -> None:
        base = _inprocess(spec)
        ds = base.dataset
        self.base = base
        self.feds = [
            InProcessFederation(
                base.problem, dataclasses.replace(ds, train=ds.train.subset([u]), test=ds.test.subset([u]))
            )
            for u in range(base.num_users)
        ]

    @property
    def user_ids(self):
        return self.base.user_ids

    @property
    def num_params(self):
        return self.base.num_params

    def compute(self, query, users=None):
        users = list(range(self.num_users)) if users is None else list(users)
        answers = [self.feds[u].compute(query, [0]) for u in users]
        values = torch.stack([a.values[0] for a in answers])
        failed = [u for u, a in zip(users, answers) if a.failed]
        values[[i for i, u in enumerate(users) if u in failed]] = 0
        return Answers(users=users, values=values, failed=failed)


@pytest.mark.parametrize("spec", [LS, LOGIT], ids=["least-squares", "logistic"])
def test_transport_is_bitwise_lossless(spec):
    """FlowerFederation == each user's answer computed alone, bit for bit (codec round trip,
    node<->user mapping, stacking in user order)."""
    fed, _ = _flower(spec)
    ref = PerUserReference(spec)
    for q in _queries(_w(5, 3.0)):
        for us in ([4, 2, 15, 0], None):
            a, b = fed.compute(q, us), ref.compute(q, us)
            assert a.users == b.users and a.failed == b.failed
            assert torch.equal(a.values, b.values), type(q).__name__
            assert torch.equal(a.total(), b.total())


@pytest.mark.parametrize("spec", [LS, LOGIT], ids=["least-squares", "logistic"])
def test_output_perturbation_queries_match(spec):
    """The unclipped queries of the output-perturbation algorithms travel too (no norm bound)."""
    fed, _ = _flower(spec)
    ref, per_user = _inprocess(spec), PerUserReference(spec)
    points = torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(8)) * 4
    own = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) * 4
    for us in ([6, 1, 13], None):
        rows = own[us] if us is not None else own
        for q in (codec.GradientsAtPoints(points), GradientsAtOwnPoints(rows)):
            a, b = fed.compute(q, us), ref.compute(q, us)
            assert a.values.shape == b.values.shape and a.failed == b.failed == []
            assert torch.equal(a.values, b.values), type(q).__name__
        p = per_user.compute(codec.GradientsAtPoints(points), us)
        assert torch.equal(fed.compute(codec.GradientsAtPoints(points), us).values, p.values)
    with pytest.raises(ValueError):
        fed.compute(GradientsAtOwnPoints(own[:2]), [0, 1, 2])  # one point per asked user
    with pytest.raises(ValueError):
        fed.compute(codec.GradientsAtPoints(torch.zeros(2, D + 1, dtype=torch.float64)))
    with pytest.raises(ValueError):
        fed.compute(codec.GradientsAtPoints(torch.zeros(codec.MAX_POINTS + 1, D, dtype=torch.float64)))
    bad = _flower(spec, faults={2: localgrid.wrong_shape(), 3: localgrid.nan_reply()})[0]
    a = bad.compute(codec.GradientsAtPoints(points))
    assert a.failed == [2, 3] and torch.equal(a.values[[2, 3]], torch.zeros(2, 3, D, dtype=torch.float64))


# A query kind added outside the library: the query class (kind, wire fields, validation) and its
# in-process answer are all it takes; the codec, the ClientApp and FlowerFederation need no change.
@dataclasses.dataclass(frozen=True)
class _ScaledGradient(Query):
    """Toy kind: ``scale * grad f_u(w)`` (unclipped)."""

    kind: ClassVar[str] = "test_scaled_gradient"
    tensor_names: ClassVar[tuple[str, ...]] = ("w",)
    scalar_names: ClassVar[tuple[str, ...]] = ("scale",)

    w: torch.Tensor
    scale: float

    def wire_fields(self):
        return {"scale": float(self.scale)}, {"w": self.w}

    @classmethod
    def from_wire(cls, scalars, tensors, num_params):
        scale = wire_number(scalars, "scale")
        if not scale > 0:
            raise ValueError("scale must be > 0")
        return cls(tensors["w"], scale)


@answers(_ScaledGradient)
def _scaled_gradient(fed, query, users):
    grads = fed.problem.per_user_gradients(fed._params(query.w), fed._data(users))
    return zero_nonfinite_rows(query.scale * grads)


def test_a_new_query_kind_needs_only_its_class_and_its_inprocess_answer():
    assert QUERY_KINDS["test_scaled_gradient"] is _ScaledGradient
    fed, _ = _flower(LOGIT)
    ref = _inprocess(LOGIT)
    q = _ScaledGradient(_w(3), 2.5)
    for us in ([7, 2], None):
        a, b = fed.compute(q, us), ref.compute(q, us)
        assert a.failed == b.failed == [] and torch.equal(a.values, b.values)
    back = codec.decode_request(codec.encode_request(q), D)
    assert type(back) is _ScaledGradient and back.scale == 2.5 and torch.equal(back.w, q.w)
    with pytest.raises(codec.CodecError, match="scale must be > 0"):
        codec.decode_request(codec.encode_request(_ScaledGradient(q.w, -1.0)), D)
    with pytest.raises(ValueError, match="expected parameters of shape"):  # the default request check
        fed.compute(_ScaledGradient(torch.zeros(D + 1, dtype=torch.float64), 1.0))


def test_bad_requests_are_refused_on_the_server_like_inprocess():
    fed, grid = _flower(LS)
    w = torch.zeros(D, dtype=torch.float64)
    before = len(grid.calls)
    with pytest.raises(ValueError):
        fed.compute(ClippedGradient(torch.zeros(D + 1, dtype=torch.float64), 1.0))
    with pytest.raises(ValueError):
        fed.compute(ClippedGradient(w, 1.0), [0, 0])
    with pytest.raises(ValueError):
        fed.compute(ClippedGradient(w, 1.0), [N])
    with pytest.raises(ValueError):
        fed.compute(ClippedGradient(torch.full((D,), math.nan, dtype=torch.float64), 1.0))
    with pytest.raises(ValueError):
        fed.compute(LocalRegularizedMinimizer(w, 0.0))
    with pytest.raises(ValueError):
        fed.compute(LocalLoss(w, "validation"))
    assert len(grid.calls) == before  # nothing was sent


# --- the ClientApp on its own: every bad request gets an error reply ------------------------------
def _client_reply(content: RecordDict, message_type: str = codec.MESSAGE_TYPE, spec=LS, pid: int = 2):
    grid = LocalGrid(make_client_app(spec), N)
    nid = next(n for n, p in grid.partition_of.items() if p == pid)
    (reply,) = grid.send_and_receive([Message(content, nid, message_type, group_id="t")])
    return reply


def _request(kind="clipped_gradient", scalars=None, tensors=None):
    cfg = {"protocol": codec.PROTOCOL, "kind": kind, **({"clip": 1.0} if scalars is None else scalars)}
    arr = {"w": Array(np.zeros(D))} if tensors is None else tensors
    return RecordDict({"fedkl": ConfigRecord(cfg), "tensors": ArrayRecord(arr)})


def _error_code(reply) -> int:
    assert not reply.has_error(), reply.error
    assert set(reply.content.keys()) == {"error"}, dict(reply.content)
    return reply.content["error"]["code"]


@pytest.mark.parametrize(
    "content",
    [
        _request(kind="steal_records"),  # unknown request
        _request(kind="clipped_gradient", scalars={}),  # missing scalar
        _request(scalars={"clip": -1.0}),  # invalid clip
        _request(scalars={"clip": math.nan}),  # NaN scalar
        _request(tensors={"w": Array(np.zeros(D + 2))}),  # wrong shape
        _request(tensors={"w": Array(np.zeros(D, dtype=np.float32))}),  # wrong dtype
        _request(tensors={"w": Array(np.full(D, np.nan))}),  # NaN
        _request(tensors={"w": Array(np.zeros(D)), "x": Array(np.zeros(D))}),  # extra tensor
        _request(
            tensors={
                "w": Array(
                    dtype="float64", shape=(D,), stype="numpy.ndarray", data=Array(np.zeros(D)).data + b"\0" * (1 << 20)
                )
            }
        ),  # oversize
        _request(tensors={"w": Array(dtype="float64", shape=(D,), stype="numpy.ndarray", data=b"junk")}),
        RecordDict({"something": ConfigRecord({"a": 1})}),  # not fedkl at all
        RecordDict(),
    ],
    ids=[
        "unknown-kind",
        "missing-scalar",
        "bad-clip",
        "nan-scalar",
        "wrong-shape",
        "wrong-dtype",
        "nan",
        "extra-tensor",
        "oversize",
        "junk-bytes",
        "foreign",
        "empty",
    ],
)
def test_client_answers_bad_requests_with_an_error_reply(content):
    assert _error_code(_client_reply(content)) == codec.ERR_BAD_REQUEST


@pytest.mark.parametrize("message_type", ["train", "evaluate", "query"])
def test_client_refuses_other_message_types(message_type):
    assert _error_code(_client_reply(_request(), message_type)) == codec.ERR_BAD_REQUEST


def test_unregistered_action_becomes_a_flower_error_not_a_crash():
    reply = _client_reply(_request(), "query.bogus")
    assert reply.has_error()


def test_client_without_a_valid_user_replies_with_an_error():
    bad = codec.ClientSpec.build("synthetic-least-squares", "least-squares", {"n_users": 3, "m": 4, "d": D, "seed": 4})
    assert _error_code(_client_reply(_request(), spec=bad, pid=7)) == codec.ERR_NOT_CONFIGURED


def test_client_computes_one_user_like_inprocess_and_zero_gradient_is_fine():
    ref = _inprocess(LS)
    w = _w(3)
    reply = _client_reply(codec.encode_request(ClippedGradient(w, 0.25)), pid=6)
    got = codec.decode_answer(reply, ClippedGradient(w, 0.25), D)
    assert torch.equal(got, ref.compute(ClippedGradient(w, 0.25), [6]).values[0])
    # a user whose gradient is exactly zero (e.g. a GradientDifference at w_new == w_old): no 0/0
    reply = _client_reply(codec.encode_request(GradientDifference(w, w, 0.25)), pid=6)
    assert torch.equal(
        codec.decode_answer(reply, GradientDifference(w, w, 0.25), D), torch.zeros(D, dtype=torch.float64)
    )


# --- failures at the federation level -----------------------------------------------------------
FAULTS = {
    "dropout": localgrid.drop,
    "nan": localgrid.nan_reply,
    "wrong-shape": localgrid.wrong_shape,
    "wrong-dtype": localgrid.wrong_dtype,
    "garbage": localgrid.garbage,
    "oversize-reply": localgrid.oversize,
    "norm-above-clip": localgrid.huge_norm,
    "unknown-request": localgrid.unknown_request,
    "oversize-request": localgrid.oversize_request,
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_faulty_users_fail_and_contribute_zero(name):
    bad = [1, 9, 14]
    fed, _ = _flower(LS, faults={p: FAULTS[name]() for p in bad})
    ref = PerUserReference(LS)
    q = ClippedGradient(_w(2, 2.0), 0.4)
    a, b = fed.compute(q), ref.compute(q)
    assert a.failed == bad and set(fed.last_errors) == set(bad)
    assert torch.equal(a.values[bad], torch.zeros(len(bad), D, dtype=torch.float64))
    good = [u for u in range(N) if u not in bad]
    assert torch.equal(a.values[good], b.values[good])
    assert (a.values.norm(dim=1) <= 0.4 * (1 + 1e-12)).all()  # every term still within the bound


def test_delay_beyond_the_timeout_is_a_dropout_and_absent_nodes_always_fail():
    fed, _ = _flower(LS, faults={4: localgrid.delay(30.0), 7: localgrid.delay(0.5)}, absent=[12])
    fed.timeout = 5.0
    a = fed.compute(ClippedGradient(_w(0), 1.0))
    assert a.failed == [4, 12]
    fed.timeout = None  # wait for everyone: the slow node answers
    assert fed.compute(ClippedGradient(_w(0), 1.0)).failed == [12]
    assert fed.missing == [12]


def test_start_federation_is_closed_once():
    from fedkl.flower.server_app import start_federation

    fed = start_federation("flower-local", LS, num_users=N)
    assert fed.compute(ClippedGradient(_w(0), 1.0)).failed == []
    fed.close()
    fed.close()  # idempotent
    with pytest.raises(ValueError):
        start_federation("inprocess", LS, num_users=N)


def test_handshake_needs_all_users_unless_enrolment_is_given():
    grid = LocalGrid(make_client_app(LS), N, absent=[3])
    with pytest.raises(RuntimeError, match="no node"):
        FlowerFederation(grid, num_users=N, wait_for_nodes=0.0)
    full = FlowerFederation(LocalGrid(make_client_app(LS), N), wait_for_nodes=0.0)
    assert full.user_ids == _inprocess(LS).user_ids
    # a node holding another user than the enrolment says is refused alone; that user fails 'absent'
    other = FlowerFederation(LocalGrid(make_client_app(LS), N), user_ids=["someone"] + list(full.user_ids[1:]))
    assert other.missing == [0] and 0 not in other.node_of and len(other.node_of) == N - 1
    assert "enrolled there: 'someone'" in next(iter(other.handshake["refused_nodes"].values()))


def _noisy_gd_with(federation, tmp_path, name, rounds=4, rho=0.5):
    ledger = PrivacyLedger(tmp_path / f"{name}.sqlite", Budget(8.0, 1e-5))
    alg = NoisyGradientDescent(NoisyGDParams(rounds=rounds, lr=0.5, clip=0.3), BuildContext.fresh(rho=rho))

    class Recorder(Releaser):
        values: list = []

        def gaussian(self, value, **kw):
            out = super().gaussian(value, **kw)
            type(self).values.append((value.clone(), out.clone(), kw["sensitivity"], kw["rho"]))
            return out

    Recorder.values = []
    rel = Recorder(ledger, NoiseSource(123), ZCDPFilter(rho))
    res = alg.run(federation, rel, torch.zeros(federation.num_params, dtype=torch.float64))
    return res, ledger, Recorder.values


def test_failures_do_not_reduce_the_noise_and_the_ledger_charges_everyone(tmp_path):
    bad = [0, 5, 6, 15]
    faults = {
        0: localgrid.drop(),
        5: localgrid.nan_reply(),
        6: localgrid.wrong_shape(),
        15: localgrid.unknown_request(),
    }
    fed, _ = _flower(LS, faults=faults)
    res, ledger, released = _noisy_gd_with(fed, tmp_path, "faulty")
    clean, clean_ledger, clean_released = _noisy_gd_with(_inprocess(LS), tmp_path, "clean")
    assert [h["failed_users"] for h in res.history] == [len(bad)] * 4
    assert res.sigma == clean.sigma
    # same noise scale, sensitivity and rho per release; the released noise is exactly the seeded draw
    for (v, out, sens, rho), (cv, cout, csens, crho) in zip(released, clean_released):
        assert (sens, rho) == (csens, crho)
    noise0 = released[0][1] - released[0][0]
    clean_noise0 = clean_released[0][1] - clean_released[0][0]
    assert torch.allclose(noise0, clean_noise0, rtol=0, atol=1e-12)
    ledger.verify()
    assert ledger.num_releases() == 4
    for uid in fed.user_ids:  # every asked user charged, failed or not
        assert ledger.spend(uid).releases == 4
        assert ledger.spend(uid).rho == pytest.approx(0.5, rel=1e-12)
    assert [r["noise_scale"] for r in ledger.releases()] == [r["noise_scale"] for r in clean_ledger.releases()]
    assert all(r["users"] == N for r in ledger.releases())


def test_zero_norm_answers_do_not_crash(tmp_path):
    """Flower's own DP clipping divides by the update norm (ZeroDivisionError on a zero update);
    here zero answers are valid, within the bound, and not failures, over a whole training."""
    fed, _ = _flower(LS, faults={p: localgrid.zero_reply() for p in range(N)})
    w = _w(1)
    assert fed.compute(GradientDifference(w, w, 0.5)).failed == []
    a = fed.compute(ClippedGradient(w, 0.5))
    assert a.failed == [] and torch.equal(a.total(), torch.zeros(D, dtype=torch.float64))
    res, ledger, released = _noisy_gd_with(fed, tmp_path, "zeros", rounds=3)
    assert all(torch.equal(v, torch.zeros(D, dtype=torch.float64)) for v, *_ in released)
    assert [h["failed_users"] for h in res.history] == [0, 0, 0] and torch.isfinite(res.w).all()
    ledger.verify()
    # and real zero gradients from the ClientApp (GradientDifference at w_new == w_old)
    clean, _ = _flower(LS)
    z = clean.compute(GradientDifference(w, w, 0.5))
    assert z.failed == [] and torch.equal(z.values, torch.zeros(N, D, dtype=torch.float64))


# --- noisy GD end to end: Flower == in-process -------------------------------------------------
def _cfg(tmp_path, name, **kw):
    base = dict(
        dataset="synthetic-least-squares",
        problem="least-squares",
        epsilon=2.0,
        rounds=3,
        lr=0.5,
        clip=0.5,
        seed=4,
        noise_seed=7,
        out=str(tmp_path / name),
        reference=False,
        kernels="reproducible",  # bit for bit against the Flower backends (in-process alone would default to fast)
    )
    return RunConfig.from_settings(strict=False, **{**base, **kw})  # rounds/lr/clip where the algorithm has them


def _ledger_view(path):
    with PrivacyLedger(path) as led:
        led.verify()
        rel = [
            (r["label"], r["mechanism"], r["sensitivity"], r["noise_scale"], r["rho"], r["eps"], r["delta"], r["users"])
            for r in led.releases()
        ]
        return rel, led


def _same_ledgers(a, b, user_ids):
    ra, _ = _ledger_view(a["ledger_path"])
    rb, _ = _ledger_view(b["ledger_path"])
    assert ra == rb and len(ra) == a["ledger"]["releases"]
    with PrivacyLedger(a["ledger_path"]) as la, PrivacyLedger(b["ledger_path"]) as lb:
        for uid in user_ids:
            assert la.spend(uid) == lb.spend(uid)  # rho, eps, delta and the number of releases


@pytest.mark.parametrize("spec", [LS, LOGIT], ids=["least-squares", "logistic"])
def test_noisy_gd_over_flower_is_bitwise_the_per_user_computation(tmp_path, spec):
    """Same seeds: the released sums, the model and the ledger are bit-identical to noisy GD over
    the per-user in-process reference (the server sums the answers in user order)."""
    fed, _ = _flower(spec)
    res, ledger, released = _noisy_gd_with(fed, tmp_path, "flower", rounds=5)
    ref, ref_ledger, ref_released = _noisy_gd_with(PerUserReference(spec), tmp_path, "ref", rounds=5)
    assert torch.equal(res.w, ref.w)
    for (v, out, *_), (rv, rout, *_) in zip(released, ref_released, strict=True):
        assert torch.equal(v, rv) and torch.equal(out, rout)
    assert ledger.releases() and [{k: r[k] for k in r if k not in ("run_id", "id")} for r in ledger.releases()] == [
        {k: r[k] for k in r if k not in ("run_id", "id")} for r in ref_ledger.releases()
    ]
    for uid in fed.user_ids:
        assert ledger.spend(uid) == ref_ledger.spend(uid)
    ledger.verify()


@pytest.mark.parametrize(
    "problem,dataset", [("least-squares", "synthetic-least-squares"), ("logistic", "synthetic-logistic")]
)
def test_noisy_gd_over_flower_local_matches_batched_inprocess(tmp_path, problem, dataset):
    """Against the batched InProcessFederation (``fedkl run``'s backend), same seed: the same model
    bit for bit and the same ledger exactly."""
    kw = dict(dataset=dataset, problem=problem)
    ref = run_flower_simulation(_cfg(tmp_path, "ref", **kw), "inprocess", log=lambda s: None)
    fl = run_flower_simulation(_cfg(tmp_path, "fl", **kw), "flower-local", log=lambda s: None)
    assert fl["user_ids"] == ref["user_ids"]
    assert torch.equal(fl["w"], ref["w"])
    assert fl["failed_users"] == [0, 0, 0]
    assert fl["ledger"]["releases"] == ref["ledger"]["releases"] == 3
    _same_ledgers(fl, ref, ref["user_ids"])


def test_fast_kernels_inprocess_match_flower_to_rounding(tmp_path):
    """The default in-process kernels (``--kernels auto`` = fast in-process; Flower clients keep the
    reproducible kernels): same seeds, the model agrees with Flower's to 1e-9 (float64 rounding through 3
    rounds), not bit for bit, and the ledger is the same exactly (the charges never depend on the kernels)."""
    kw = dict(dataset="synthetic-logistic", problem="logistic")
    auto = _cfg(tmp_path, "fast", kernels="auto", **kw)
    assert auto.kernels == "fast" and auto.settings()["kernels"] == "fast"  # the run names what ran
    fast = run_flower_simulation(auto, "inprocess", log=lambda s: None)
    fl = run_flower_simulation(_cfg(tmp_path, "fl", **kw), "flower-local", log=lambda s: None)
    assert not torch.equal(fast["w"], fl["w"])  # really the other kernels (not bit for bit) ...
    torch.testing.assert_close(fast["w"], fl["w"], rtol=1e-9, atol=1e-12)  # ... to float64 rounding
    _same_ledgers(fl, fast, fast["user_ids"])
    with pytest.raises(ValueError, match="in-process only"):  # never a Flower run with fast server kernels
        run_flower_simulation(auto, "flower-local", log=lambda s: None)


def test_output_perturbation_algorithm_runs_unchanged_over_flower(tmp_path):
    """Any registered fedkl algorithm, not only noisy GD: Phased-ERM (GradientsAtPoints queries,
    (eps, delta) releases without the zCDP filter) over the LocalGrid equals in-process."""
    kw = dict(
        dataset="synthetic-logistic",
        problem="logistic",
        algorithm="phased-erm",
        reg=0.1,
        p002_delta_rule="fixed",
        p002_phases=2,
        p002_lam=0.05,
        force=True,
        clients="in-class",  # its guarantee assumes in-class clients: the explicit opt-in Flower needs
    )  # 10 users: plumbing only
    spec = codec.ClientSpec.build(
        "synthetic-logistic", "logistic", {"n_users": 10, "m": M, "d": D, "seed": 4}, {"reg": 0.1}
    )
    quiet = dict(log=lambda s: None, spec=spec)
    ref = run_flower_simulation(_cfg(tmp_path, "ref", **kw), "inprocess", **quiet)
    fl = run_flower_simulation(_cfg(tmp_path, "fl", **kw), "flower-local", **quiet)
    assert (fl["w"] is None) == (ref["w"] is None)
    if fl["w"] is not None:
        assert torch.equal(fl["w"], ref["w"])
    _same_ledgers(fl, ref, ref["user_ids"])


def test_noisy_gd_over_flower_sim_ray_matches_inprocess(tmp_path):
    """8 users in blocks of 3, 3 and 2 (``users_per_node``), each block a virtual SuperNode on Ray (run_simulation),
    2 rounds. One user per node on Ray: tests/algorithms/test_algorithm_registry.py (flower-sim)."""
    spec = codec.ClientSpec.build("synthetic-least-squares", "least-squares", {"n_users": 8, "m": M, "d": D, "seed": 4})
    quiet = dict(log=lambda s: None, spec=spec)
    ref = run_flower_simulation(_cfg(tmp_path, "ref", rounds=2), "inprocess", **quiet)
    sim = run_flower_simulation(_cfg(tmp_path, "sim", rounds=2), "flower-sim", users_per_node=3, **quiet)
    assert len(sim["user_ids"]) == 8 and sim["user_ids"] == ref["user_ids"]
    assert sim["failures"]["handshake"]["nodes"] == 3
    assert torch.equal(sim["w"], ref["w"])  # bit for bit even across Ray worker processes
    assert sim["failed_users"] == [0, 0]
    _same_ledgers(sim, ref, ref["user_ids"])


def test_deployed_server_app_main_reads_the_run_config(tmp_path):
    """The deployed ServerApp's main and ClientApp (fedkl.flower.server_app:app / client_app:app, which
    the repository's server/app.py and client/app.py entry points re-export), configured only by
    fedkl-* run-config keys (what `flwr run` / SuperNodes would get), here over a LocalGrid."""
    import json

    from flwr.app import Context

    import client.app
    import server.app
    from fedkl.flower import client_app, server_app

    assert server.app.app is server_app.app and client.app.app is client_app.app  # thin entry points

    rc = {
        "fedkl-dataset": "synthetic-least-squares",
        "fedkl-seed": 3,
        "fedkl-rounds": 2,
        "fedkl-lr": 0.5,
        "fedkl-noise-seed": 5,
        "fedkl-out": str(tmp_path / "deployed"),
        "fedkl-reference": False,
    }
    ds = load_dataset("synthetic-least-squares", seed=3)
    grid = LocalGrid(client_app.app, ds.train.num_users, run_config=rc)
    server_app._deployed_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    res = json.loads((tmp_path / "deployed" / "flower_result.json").read_text())
    ref = run_flower_simulation(
        RunConfig.from_settings(
            dataset="synthetic-least-squares",
            seed=3,
            rounds=2,
            lr=0.5,
            noise_seed=5,
            out=str(tmp_path / "ref"),
            reference=False,
            kernels="reproducible",
        ),
        "inprocess",
        log=lambda s: None,
    )
    assert res["users"] == ds.train.num_users and res["failed_users"] == [0, 0]
    assert np.array_equal(res["w"], ref["w"].numpy())
    assert res["ledger"]["releases"] == 2 and res["ledger"]["max_user_rho"] == ref["ledger"]["max_user_rho"]


@pytest.mark.deployment
def test_grpc_deployment_with_tls_and_node_auth(tmp_path):
    """A real local deployment: SuperLink (TLS, SuperNode auth) + 4 SuperNodes as subprocesses, the
    fedkl app submitted with `flwr run`. User 2's SuperNode has a key that was never registered: the
    SuperLink refuses it, so user 2 fails (zero, charged), exactly like an absent node over the
    LocalGrid with the same seeds; the 3 others give the in-process answers. Every process is gone
    afterwards. (4 nodes, not 8: each node is a SuperNode, a registration and a ClientApp process importing
    torch, the cost of a deployment test on a loaded machine; 3 registered nodes and 1 refused show the same.)"""
    from fedkl.flower.deploy import processes_of, run_config_for, run_grpc

    spec = codec.ClientSpec.build("synthetic-least-squares", "least-squares", {"n_users": 4, "m": M, "d": D, "seed": 4})
    cfg = _cfg(tmp_path, "grpc-out", rounds=1)
    # run_grpc submits the run once the 3 registered SuperNodes are online, so the ServerApp need not wait
    # for user 2 to connect (it never will); the 3 ClientApps, which start concurrently and slowly on a
    # loaded machine, still get the scaled handshake deadline, and the wait ends on their last reply.
    # No fixed deadline here: run_grpc's waits scale with the 4 users too (deploy.run_deadline).
    rc = {**run_config_for(cfg, spec), "fedkl-wait-for-nodes": 0.0}
    ids = _inprocess(spec).user_ids  # the enrolment: each user bound to its registered node id
    res = run_grpc(rc, 4, workdir=str(tmp_path / "grpc"), unregistered=(2,), user_ids=ids, log=lambda s: None)
    ref = run_flower_simulation(
        _cfg(tmp_path, "ref", rounds=1), "flower-local", log=lambda s: None, spec=spec, absent=[2]
    )
    assert res["users"] == 4 and res["failed_users"] == [1] == ref["failed_users"]
    assert np.array_equal(res["w"], ref["w"].numpy())  # bit for bit over gRPC + TLS
    _same_ledgers(res, ref, ref["user_ids"])  # the refused user is charged too
    logs = (tmp_path / "grpc" / "superlink.log").read_text()
    assert "TLS disabled" not in logs and "SuperNode authentication is disabled" not in logs

    # this deployment's processes only: another run's (a concurrent test session) are not ours to judge
    left = processes_of(tmp_path / "grpc")
    assert left == set(), [(p, Path(f"/proc/{p}/cmdline").read_bytes()) for p in left]
