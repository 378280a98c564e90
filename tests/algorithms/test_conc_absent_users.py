"""Absent and failed users in noisy-gd-conc (every centre) and noisy-gd-outlier, on both backends: the
adversarial neighbouring pair "user 0 present (with an answer far away) vs user 0 absent/failed (a
dropout on a LocalGrid, a non-finite answer in-process)" moves every release by at most the sensitivity
it was charged for, under both relations; under add-remove the present/absent pair is THE neighbouring
pair and attains it. Also: a finite row whose rotation overflows (1e308 entries) is a vote for the
histogram's end bins, never an abort.

Both worlds are run with the same transcript (the second run returns the first run's released values
instead of its own draws), so every release is compared given the same earlier outputs, which is what
the adaptive composition of the per-release Gaussian mechanisms needs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.concentrated_gd import ConcentratedGD, ConcentratedGDParams
from fedkl.algorithms.gradient.histogram_centre import histogram_counts, histogram_sensitivity, rotate, rotation_signs
from fedkl.algorithms.gradient.outlier_gd import OutlierGD, OutlierGDParams
from fedkl.data import load_dataset
from fedkl.data.base import FederatedDataset, UserData
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.privacy.zcdp import zcdp_to_eps
from fedkl.problems import make_problem

N, M, D = 10, 6, 8  # D a power of two: the rotated dimension is d itself
DATA = {"n_users": N, "m": M, "d": D, "seed": 3}
HUGE = 1e8  # user 0's present answer: far outside every ball and every bin range


class _Replay(Releaser):
    """Keeps (exact value, charged sensitivity, label) of every Gaussian release; given ``script`` (the
    released values of another run), returns those instead of its own draws."""

    def __init__(self, path, alg, script=None):
        rho_filter = ZCDPFilter(alg.rho_total) if alg.guarantee.zcdp else None
        super().__init__(PrivacyLedger(path, Budget(1e6, 1e-5)), NoiseSource(7), rho_filter)
        self.script, self.values, self.outputs = script, [], []

    def gaussian(self, value, **kw):
        out = super().gaussian(value, **kw)
        self.values.append((value.clone(), kw["sensitivity"], kw["label"]))
        self.outputs.append(out)
        return out if self.script is None else self.script[len(self.values) - 1]


def _direction(sign: float) -> torch.Tensor:
    v = torch.ones(D, dtype=torch.float64) / math.sqrt(D)
    v[::2] *= -1
    return sign * v


def _inprocess(user0: str, sign: float) -> InProcessFederation:
    """user0 ``present``: all its records x = v, y = -+HUGE, so its gradient is ~ +-HUGE v (least squares);
    ``failed``: its records x = v, y = 1.7e308 (finite data: a dataset refuses NaN), so its mean gradient
    overflows: a non-finite answer, which the backend reports failed with a zero row."""
    ds = load_dataset("synthetic-least-squares", **DATA)
    tr = ds.train
    mine = tr.user_index == 0
    X, y = tr.X.clone(), tr.y.clone()
    if user0 == "present":
        X[mine], y[mine] = _direction(1.0), -sign * HUGE
    else:
        X[mine], y[mine] = _direction(1.0), 1.7e308
    ds = FederatedDataset("adv", UserData(X, y, tr.user_index, tr.user_ids), ds.test, ds.task, 1.0, "adv")
    return InProcessFederation(make_problem("least-squares", ds), ds)


def _flower(user0: str, sign: float):
    """A LocalGrid: user0 ``present`` answers +-HUGE v to every gradient request (a client may answer
    anything); ``failed`` drops out after the handshake, ``nan`` answers NaN."""
    from fedkl.flower import codec, localgrid
    from fedkl.flower.client_app import make_client_app
    from fedkl.flower.federation import FlowerFederation

    spec = codec.ClientSpec.build("synthetic-least-squares", "least-squares", DATA)
    if user0 == "present":
        value = (HUGE * _direction(sign)).numpy().reshape(1, D)
        fault = localgrid._ReplyFault(lambda req, rep: localgrid._with_value(req, value))
    else:
        fault = localgrid.drop() if user0 == "failed" else localgrid.nan_reply()
    ids = _inprocess("present", 1.0).user_ids
    grid = localgrid.LocalGrid(make_client_app(spec), N, faults={0: fault})
    return FlowerFederation(grid, user_ids=ids, wait_for_nodes=0.0)


def _federation(backend: str, user0: str, sign: float = 1.0):
    return _inprocess(user0, sign) if backend == "inprocess" else _flower(user0, sign)


def _realised_over_charged(tmp_path, make_alg, backend, absent="failed") -> dict[str, float]:
    """max over releases (per kind of release) and over the two signs of user 0's far answer of
    ||value(present) - value(absent)|| / charged sensitivity, the worlds run on one transcript."""
    worst: dict[str, float] = {}
    for k, sign in enumerate((1.0, -1.0)):
        alg = make_alg()
        present = _Replay(tmp_path / f"present-{k}.sqlite", alg)
        alg.run(_federation(backend, "present", sign), present, torch.zeros(D, dtype=torch.float64))
        gone = _Replay(tmp_path / f"absent-{k}.sqlite", alg, script=present.outputs)
        fed = _federation(backend, absent)
        alg.run(fed, gone, torch.zeros(D, dtype=torch.float64))
        assert len(gone.values) == len(present.values) > 0
        for (a, sens, label), (b, sens_b, label_b) in zip(present.values, gone.values, strict=True):
            assert (sens, label) == (sens_b, label_b)  # the charges are public: the same in both worlds
            kind = label.rsplit("/", 1)[1]
            worst[kind] = max(worst.get(kind, 0.0), float((a - b).norm()) / sens)
    return worst


def _context(relation: str, **budget) -> BuildContext:
    """The run's public values: N users, D parameters, ``relation``, and the budget."""
    ids = _inprocess("present", 1.0).user_ids
    return BuildContext.fresh(user_ids=ids, problem=SimpleNamespace(num_params=D), neighbouring=relation, **budget)


def _conc(centre: str, relation: str):
    # a small radius against the centre's norm (scale 0.5, m = 6): the absent user's old zero row,
    # projected as 0 - c_t, is far from the present user's projection
    params = ConcentratedGDParams(rounds=3, lr=0.5, clip=1.0, conc_records=M, conc_scale=0.5, conc_centre=centre)
    return lambda: ConcentratedGD(params, _context(relation, rho=50.0))


def _check(worst: dict[str, float], relation: str, kinds: tuple[str, ...]) -> None:
    assert set(worst) == set(kinds)
    for kind, ratio in worst.items():
        assert ratio <= 1 + 1e-9, (kind, worst)
        if relation == "add-remove":  # present vs absent is the neighbouring pair: its bound is attained
            assert ratio == pytest.approx(1.0, rel=1e-9), (kind, worst)
        else:  # present vs absent is one replacement (by nothing): tau of 2 tau, C of 2 C, sqrt(D) of sqrt(2 D)
            half = math.sqrt(0.5) if kind == "histogram" else 0.5
            assert ratio == pytest.approx(half, rel=1e-9), (kind, worst)


CENTRES = {"previous": ("winsorized",), "fresh": ("centre", "winsorized"), "histogram": ("histogram", "winsorized")}


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
@pytest.mark.parametrize("centre", sorted(CENTRES))
def test_conc_absent_user_moves_every_release_by_its_charged_sensitivity_inprocess(tmp_path, centre, relation):
    """In-process, user 0 present (gradient ~ +-1e8 v) vs failed (a non-finite answer: a zero row in
    ``failed``). Before the fix the failed zero row was data: the winsorized sum projected 0 - c_t
    (realised up to 2 tau against the charged add-remove tau) and the histogram counted it in the bin of
    0 (realised sqrt(2 D) against the charged sqrt(D))."""
    worst = _realised_over_charged(tmp_path, _conc(centre, relation), "inprocess")
    _check(worst, relation, CENTRES[centre])


@pytest.mark.flower
@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
@pytest.mark.parametrize("centre", sorted(CENTRES))
def test_conc_absent_user_moves_every_release_by_its_charged_sensitivity_on_a_localgrid(tmp_path, centre, relation):
    """The same pair on the Flower path: user 0's node answers +-1e8 v, or drops out after the handshake
    (its answer is a zero row listed in ``failed``)."""
    worst = _realised_over_charged(tmp_path, _conc(centre, relation), "flower")
    _check(worst, relation, CENTRES[centre])


@pytest.mark.flower
def test_conc_nan_answer_on_a_localgrid_is_left_out_like_a_dropout(tmp_path):
    worst = _realised_over_charged(tmp_path, _conc("histogram", "add-remove"), "flower", absent="nan")
    _check(worst, "add-remove", CENTRES["histogram"])


def test_histogram_counts_leave_out_absent_and_non_finite_rows():
    """The count table alone: a row marked absent (failed) or non-finite adds NO count, so present vs
    absent changes exactly D cells by one (sqrt(D), the add-remove sensitivity), for any present row;
    before the fix the absent user's zero row added one count per coordinate (sqrt(2 D) realised)."""
    signs = rotation_signs(D, 11)
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(N, D, generator=g, dtype=torch.float64) * 0.1
    present = torch.ones(N, dtype=torch.bool)
    for row0 in (HUGE * _direction(1.0), -HUGE * _direction(1.0), torch.full((D,), 0.5, dtype=torch.float64)):
        here = rows.clone()
        here[0] = row0
        gone = rows.clone()
        gone[0] = 0.0  # what a backend hands over for a failed user
        absent = present.clone()
        absent[0] = False
        diff = histogram_counts(here, signs, 1.0, 0.3, present) - histogram_counts(gone, signs, 1.0, 0.3, absent)
        assert float(diff.norm()) == pytest.approx(histogram_sensitivity(D, "add-remove"), rel=1e-12)
        assert float(diff.norm()) <= histogram_sensitivity(D, "replace-one")
        nan = rows.clone()
        nan[0, 3] = float("nan")
        assert torch.equal(histogram_counts(nan, signs, 1.0, 0.3), histogram_counts(gone, signs, 1.0, 0.3, absent))
        assert float(histogram_counts(gone, signs, 1.0, 0.3, absent).sum()) == (N - 1) * D


def test_a_row_whose_rotation_overflows_votes_for_the_end_bins_and_never_aborts():
    """A finite row of 1e308 entries: its rotation overflows in float64 (the Hadamard sums exceed the
    largest double); before the fix the binning turned inf - inf into NaN and scatter_add aborted the run
    (whether a run completes then depends on a client's data). Now every coordinate of the row lands in
    the end bin of its true sign (checked against the rotation of the same row scaled down, exact
    in powers of two), or in the bin of 0 where the true coordinate is 0."""
    signs = rotation_signs(D, 5)
    rows = torch.zeros(3, D, dtype=torch.float64)
    rows[0] = 1e308
    rows[1, ::2] = 1e308
    rows[1, 1::2] = -1.7e308
    clip, width = 1.0, 0.3
    counts = histogram_counts(rows, signs, clip, width)  # raised RuntimeError before the fix
    bins = counts.shape[1]
    assert torch.equal(counts.sum(1), torch.full((D,), 3.0, dtype=torch.float64))
    zero_bin = int(math.floor(clip / width))
    for row in rows[:2]:
        true = rotate((row * 2.0**-600).unsqueeze(0), signs)[0]  # exact scaling: the true rotation's signs
        one = histogram_counts(row.unsqueeze(0), signs, clip, width)
        for j in range(D):
            expected = bins - 1 if true[j] > 0 else 0 if true[j] < 0 else zero_bin
            assert one[j, expected] == 1.0 and one[j].sum() == 1.0
    from fedkl.algorithms.gradient.histogram_centre import _hadamard

    assert torch.isnan(_hadamard(rows * signs)).any()  # unscaled, the sums do overflow: the case is exercised
    assert not torch.isnan(rotate(rows, signs)).any()


@pytest.mark.flower
def test_conc_histogram_run_with_a_1e308_answer_completes(tmp_path):
    """End to end on a LocalGrid: user 0's node answers a finite row of 1e308 entries every round; the
    histogram-centre run completes (before the fix: RuntimeError in the first round's binning)."""
    from fedkl.flower import codec, localgrid
    from fedkl.flower.client_app import make_client_app
    from fedkl.flower.federation import FlowerFederation

    spec = codec.ClientSpec.build("synthetic-least-squares", "least-squares", DATA)
    value = np.full((1, D), 1e308)
    fault = localgrid._ReplyFault(lambda req, rep: localgrid._with_value(req, value))
    fed = FlowerFederation(
        localgrid.LocalGrid(make_client_app(spec), N, faults={0: fault}),
        user_ids=_inprocess("present", 1.0).user_ids,
        wait_for_nodes=0.0,
    )
    alg = _conc("histogram", "add-remove")()
    rel = _Replay(tmp_path / "huge.sqlite", alg)
    res = alg.run(fed, rel, torch.zeros(D, dtype=torch.float64))
    assert torch.isfinite(res.w).all() and len(rel.values) == 6
    for counts, _, label in rel.values[0::2]:
        assert label.endswith("/histogram") and float(counts.sum()) == N * D  # user 0 counted, in end bins


def _outlier(relation: str):
    # R = 5 C / sqrt(6) > 2 C: every clipped point is within R of every other, so the PTR test passes
    # (s_q ~ 0.7 at rho 90 over 2 rounds) and the mean is released in both worlds
    # (eps, 2e-6): half of delta pays the PTR tests (delta_ptr 1e-6), the rest leaves rho = 90
    params = OutlierGDParams(rounds=2, lr=0.5, clip=1.0, conc_records=M, conc_scale=5.0)
    return lambda: OutlierGD(params, _context(relation, eps=zcdp_to_eps(90.0, 1e-6), delta=2e-6))


@pytest.mark.parametrize("backend", ["inprocess", pytest.param("flower", marks=pytest.mark.flower)])
def test_outlier_absent_user_stays_within_the_charged_sensitivities(tmp_path, backend):
    """The audit of noisy-gd-outlier: a failed user's zero row IS used as a point (its analysis covers
    add-remove as a replacement of the user's row by the 0 row, and charges the relation-free bounds 3 and
    14 R / W_min), so present vs failed moves the test's weight and the mean within them."""
    worst = _realised_over_charged(tmp_path, _outlier("add-remove"), backend)
    assert set(worst) == {"test", "mean"} and all(r <= 1 + 1e-9 for r in worst.values()), worst
