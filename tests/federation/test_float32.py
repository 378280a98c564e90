"""The float32 path (issues 30, 33): users compute in float32, the clip holds exactly, sums and noise are float64.

* ``clip_rows`` on float32 rows: every returned row's EXACT norm (rational arithmetic) is below the clip on
  adversarial rows, where clipping in float32 arithmetic goes above it;
* a float32 run of noisy-gd and dp-fedavg trains to the float64 run's model (same seeds) with the same ledger,
  records its dtype in model.pt, and ``fedkl predict`` reads it;
* ``--dtype float32`` is refused for an algorithm whose proof is stated in float64, and off in-process.
"""

import json
import sqlite3
from fractions import Fraction

import pytest
import torch

import fedkl
from fedkl import cli
from fedkl.federation.base import Answers
from fedkl.federation.clipping import clip_rows, clipped_sum, low_precision_margin
from fedkl.problems.rowwise import kernels
from fedkl.runner import RunConfig, problem_dtype
from fedkl.saved_model import load_model


def _exact_sq_norm(row: torch.Tensor) -> Fraction:
    return sum((Fraction(float(x)) ** 2 for x in row.tolist()), Fraction(0))


def _adversarial_rows(clip: float, d: int) -> torch.Tensor:
    """Float32 rows at and just around the clip bound: equal entries (every rounding goes the same way),
    one spike, entries of mixed magnitude, huge and subnormal entries, random directions."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in range(-8, 9):  # norms clip * (1 + k 2^-24): inside, on and just outside the ball
        scale = clip * (1 + k * 2.0**-24)
        rows.append(torch.full((d,), scale / d**0.5, dtype=torch.float64))
        v = torch.randn(d, generator=g, dtype=torch.float64)
        rows.append(v / v.norm() * scale)
        v = torch.randn(d, generator=g, dtype=torch.float64) * torch.logspace(-6, 6, d, dtype=torch.float64)
        rows.append(v / v.norm() * scale)
    rows.append(torch.cat([torch.tensor([clip * 3.0]), torch.full((d - 1,), clip * 1e-3)]).double())
    rows.append(torch.full((d,), 1e30, dtype=torch.float64))  # a huge row
    rows.append(torch.full((d,), 1e-44, dtype=torch.float64))  # subnormal entries
    out = torch.stack(rows).to(torch.float32)
    # the float32 rounding of rows that are "on" the ball in float64 may land a few ulps out: add scaled copies
    return torch.cat([out, out * torch.tensor(1 + 2.0**-23, dtype=torch.float32)])


@pytest.mark.parametrize("mode", ["fast", "reproducible"])
@pytest.mark.parametrize("clip,d", [(1.0, 7), (0.1, 100), (3.7, 1000), (1e-3, 33)])
def test_a_float32_clipped_row_never_exceeds_the_clip_in_exact_arithmetic(mode, clip, d):
    x = _adversarial_rows(clip, d)
    with kernels(mode):
        y, bad = clip_rows(x, clip)
        total, bad_sum = clipped_sum(x, clip)
    assert y.dtype == torch.float32 and not bad.any() and not bad_sum.any()
    c2 = Fraction(clip) ** 2
    assert all(_exact_sq_norm(row) < c2 for row in y)
    # rows well inside the ball are returned bit for bit; the others are on it, at most the margin inside
    inside = torch.linalg.vector_norm(x.double(), dim=1) <= clip * (1 - low_precision_margin(torch.float32, d))
    assert inside.any() and torch.equal(y[inside], x[inside])
    norms = torch.linalg.vector_norm(y[~inside].double(), dim=1)
    assert float(norms.min()) >= clip * (1 - 4 * low_precision_margin(torch.float32, d))
    # the sum is float64, of these rows (Answers.total adds float32 rows in float64 too)
    assert total.dtype == torch.float64 and torch.equal(total, y.double().sum(0))
    assert torch.equal(Answers(list(range(len(y))), y).total(), y.double().sum(0))
    # these rows are adversarial: clipping them in float32 arithmetic (the float64 code on float32 rows)
    # leaves some above the clip
    norms32 = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    naive = torch.where(norms32 > clip, x * (clip / norms32), x)
    assert any(_exact_sq_norm(row) > c2 for row in naive)


def test_float32_clip_zeroes_non_finite_rows_and_refuses_a_clip_it_cannot_enforce():
    x = torch.tensor([[1.0, float("nan")], [3.0, 4.0], [float("inf"), 0.0]], dtype=torch.float32)
    y, bad = clip_rows(x, 1.0)
    assert bad.tolist() == [True, False, True] and torch.equal(y[[0, 2]], torch.zeros(2, 2))
    assert _exact_sq_norm(y[1]) < 1
    with pytest.raises(ValueError, match="too small"):
        clip_rows(x, 1e-31)


def _train(tmp_path, algorithm: str, dtype: str, **settings):
    out = tmp_path / f"{algorithm}-{dtype}"
    trained = fedkl.train(
        "synthetic-logistic", algorithm, epsilon=2.0, log=None, users=60, noise_seed=7, seed=0,
        dtype=dtype, out=str(out), **settings,
    )  # fmt: skip
    return trained, out


def _charges(path) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return db.execute(
            "select r.label, r.mechanism, r.sensitivity, r.noise_scale, r.rho, r.eps, r.delta, r.charge, c.digest "
            "from releases r join cohorts c on c.id = r.cohort_id order by r.id"
        ).fetchall()


@pytest.mark.parametrize(
    "algorithm,settings",
    [("noisy-gd", {"rounds": 8}), ("dp-fedavg", {"rounds": 4, "local_steps": 2, "accountant": "rdp"})],
)
def test_a_float32_run_trains_like_float64_with_the_same_ledger(tmp_path, algorithm, settings):
    f64, out64 = _train(tmp_path, algorithm, "float64", **settings)
    f32, out32 = _train(tmp_path, algorithm, "float32", **settings)
    assert f64.model.dtype == torch.float64 and f32.model.dtype == torch.float32
    # same noise draws (seeded), per-user rounding only: float32's ~1e-7 relative, over a few rounds
    rel = float((f32.model.double() - f64.model).norm() / f64.model.norm())
    assert rel < 1e-4, rel
    assert abs(f32.metrics["accuracy"] - f64.metrics["accuracy"]) <= 0.01  # the same model to 1e-4: a record or two
    # charges do not depend on the dtype: every ledger row equal (labels, mechanisms, scales, cohorts)
    assert _charges(out32 / "ledger.sqlite") == _charges(out64 / "ledger.sqlite")
    assert f32.epsilon == f64.epsilon
    # model.pt records the dtype, and `fedkl predict` evaluates it as the run did
    saved = load_model(str(out32 / "model.pt"))
    assert saved.problem_spec["dtype"] == "float32" and saved.params.dtype == torch.float32
    assert saved.problem.dtype == torch.float32 and torch.equal(saved.params, f32.model)
    assert json.loads((out32 / "result.json").read_text())["config"]["dtype"] == "float32"


def test_fedkl_predict_reads_a_float32_model(tmp_path, capsys):
    _, out = _train(tmp_path, "noisy-gd", "float32", rounds=3)
    assert cli.main(["predict", "--model", str(out), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    saved = load_model(str(out / "model.pt"))
    run = json.loads((out / "result.json").read_text())["test_metrics"]
    # the run evaluated with its fast kernels, predict with the reproducible ones: float32 sums in another order
    assert metrics["accuracy"] == run["accuracy"] and metrics["loss"] == pytest.approx(run["loss"], rel=1e-6)
    assert saved.problem_spec["dtype"] == "float32"


def test_float32_is_refused_where_the_proof_is_stated_in_float64():
    with pytest.raises(ValueError, match="kl-prox-point's privacy proof is stated in float64"):
        RunConfig(dataset="synthetic-logistic", algorithm="kl-prox-point", dtype="float32")
    with pytest.raises(ValueError, match="in-process only"):
        RunConfig(dataset="synthetic-logistic", backend="flower-sim", dtype="float32")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        RunConfig(dataset="synthetic-logistic", dtype="float16")


def test_auto_dtype_is_float64_for_glms_and_float32_for_torch_models_when_the_proof_allows():
    cfg = RunConfig(dataset="mnist", algorithm="noisy-gd")
    assert problem_dtype(cfg, "softmax") == "float64" and problem_dtype(cfg, "mlp") == "float32"
    # an algorithm whose proof is stated in float64 runs a torch model in float64 (in-process)
    assert problem_dtype(RunConfig(dataset="mnist", algorithm="kl-prox-point"), "mlp") == "float64"
    assert problem_dtype(RunConfig(dataset="mnist", algorithm="noisy-gd", dtype="float64"), "mlp") == "float64"


def test_a_torch_model_trains_in_float32_by_default_with_float64_noise(tmp_path):
    trained = fedkl.train(
        "synthetic-logistic", "noisy-gd", log=None, users=30, problem="mlp", rounds=2, noise_seed=1,
        out=str(tmp_path / "mlp"),
    )  # fmt: skip
    saved = load_model(str(tmp_path / "mlp" / "model.pt"))
    assert trained.model.dtype == torch.float32 and saved.problem_spec["dtype"] == "float32"
    assert json.loads((tmp_path / "mlp" / "result.json").read_text())["config"]["dtype"] == "auto"
