"""The two kernel modes (fedkl.problems.rowwise.kernels): fast agrees with reproducible to float64
rounding. Stated tolerance: per-user gradients, norms and clipped sums within rtol 1e-12 (plus atol
1e-14 for entries near zero) of the reproducible values; a whole noisy-GD run's model within 1e-9."""

from __future__ import annotations

import pytest
import torch

from fedkl.data import load_dataset
from fedkl.data.base import UserData
from fedkl.federation.base import ClippedGradient
from fedkl.federation.clipping import clip_rows, clipped_sum
from fedkl.federation.inprocess import InProcessFederation
from fedkl.problems import make_problem
from fedkl.problems.base import user_means, user_row_dots, user_weighted_means
from fedkl.problems.rowwise import kernel_mode, kernels, row_dots, row_norms, sigmoid, softplus
from fedkl.runner import RunConfig

TOL = dict(rtol=1e-12, atol=1e-14)


def _both(fn):
    with kernels("reproducible"):
        slow = fn()
    with kernels("fast"):
        fast = fn()
    return slow, fast


@pytest.mark.parametrize(
    "problem,dataset",
    [
        ("logistic", "synthetic-logistic"),
        ("least-squares", "synthetic-least-squares"),
        ("smoothed-hinge", "synthetic-logistic"),
        ("softmax", "synthetic-logistic"),
        ("huber", "synthetic-least-squares"),
        ("absolute", "synthetic-least-squares"),
    ],
)
def test_fast_per_user_gradients_and_clip_match_reproducible(problem, dataset):
    data = load_dataset(dataset, n_users=40, seed=3)
    p = make_problem(problem, data)
    train = data.train.to(p.dtype)
    w = torch.linspace(-1, 1, p.num_params, dtype=p.dtype)
    slow, fast = _both(lambda: p.per_user_gradients(w, train))
    assert not torch.equal(slow, torch.zeros_like(slow))
    torch.testing.assert_close(fast, slow, **TOL)
    (cs, bs), (cf, bf) = _both(lambda: clip_rows(slow, 0.05))
    assert torch.equal(bs, bf)
    torch.testing.assert_close(cf, cs, **TOL)
    torch.testing.assert_close(cf.sum(0), cs.sum(0), **TOL)


def test_the_mlp_computes_the_same_bits_in_both_modes():
    """The MLP (float32, vmap; like a --model network) has no reproducible variant: the kernel mode does not
    touch it, so the default (fast) and reproducible runs compute identical gradients."""
    data = load_dataset("synthetic-logistic", n_users=20, seed=3)
    p = make_problem("mlp", data)
    train = data.train.to(p.dtype)
    w = p.init_params(torch.Generator().manual_seed(0))
    slow, fast = _both(lambda: p.per_user_gradients(w, train))
    assert not torch.equal(slow, torch.zeros_like(slow))
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("batch_size", [None, 3])
def test_fast_local_updates_match_reproducible(batch_size):
    """DP-FedAvg's local SGD (ClippedLocalUpdate): per-record dots and per-user sums by segment matmuls."""
    data = load_dataset("synthetic-logistic", n_users=30, seed=2)
    p = make_problem("logistic", data)
    w = torch.linspace(-0.5, 0.5, p.num_params, dtype=p.dtype)
    slow, fast = _both(lambda: p.local_updates(w, data.train.to(p.dtype), 4, 0.5, batch_size))
    assert not torch.equal(slow, torch.zeros_like(slow))
    torch.testing.assert_close(fast, slow, **TOL)


def _records(order: torch.Tensor, counts: list[int], d: int = 7) -> UserData:
    gen = torch.Generator().manual_seed(0)
    idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))[order]
    X = torch.randn(len(idx), d, generator=gen, dtype=torch.float64)
    return UserData(X, torch.ones(len(idx), dtype=torch.float64), idx, tuple(f"u{i}" for i in range(len(counts))))


@pytest.mark.parametrize("layout", ["equal", "unequal", "ungrouped"])
def test_segment_sums_every_layout(layout):
    """Equal counts (one bmm), grouped unequal counts with an empty user (CSR), records not grouped by
    user (index_add_ fallback): all equal the reproducible per-user means."""
    counts = [5, 5, 5, 5] if layout == "equal" else [3, 0, 6, 1]
    n = sum(counts)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)) if layout == "ungrouped" else torch.arange(n)
    data = _records(order, counts)
    coef = torch.linspace(-2, 3, n, dtype=torch.float64)
    expected = user_means(coef.unsqueeze(1) * data.X, data)
    W = torch.linspace(-1, 1, len(counts) * data.X.shape[1], dtype=torch.float64).view(len(counts), -1)
    dots = (data.X * W[data.user_index]).sum(1)
    with kernels("fast"):
        got = user_weighted_means(coef, data.X, data)
        got_dots = user_row_dots(data.X, W, data)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(got_dots, dots, **TOL)
    if 0 in counts:
        assert torch.equal(got[counts.index(0)], torch.zeros(data.X.shape[1], dtype=torch.float64))


def test_fast_clip_zeroes_nonfinite_rows_and_rescues_overflow():
    V = torch.tensor(
        [[3.0, 4.0], [float("nan"), 1.0], [1e200, 1e200], [0.0, float("inf")], [0.1, 0.0]], dtype=torch.float64
    )
    (cs, bs), (cf, bf) = _both(lambda: clip_rows(V, 1.0))
    assert bf.tolist() == [False, True, False, True, False] and torch.equal(bs, bf)
    torch.testing.assert_close(cf, cs, **TOL)
    assert torch.equal(cf[4], V[4])  # a row inside the ball is returned bit for bit


def test_fast_clipped_sum_matches_clip_then_sum_and_falls_back_on_a_nonfinite_norm():
    """clipped_sum (fast: norms and one matrix-vector product) equals clip_rows then the sum; a NaN row
    or an overflowing finite row takes the general path (zeroed and reported / rescued)."""
    gen = torch.Generator().manual_seed(4)
    V = (
        torch.randn(50, 6, generator=gen, dtype=torch.float64)
        * torch.linspace(0.01, 3, 50, dtype=torch.float64)[:, None]
    )
    for rows in (V, torch.cat([V, torch.tensor([[float("nan")] * 6, [1e200] * 6], dtype=torch.float64)])):
        (ts, bs), (tf, bf) = _both(lambda: clipped_sum(rows, 0.7))
        with kernels("reproducible"):
            clipped, bad = clip_rows(rows, 0.7)
        assert torch.equal(ts, clipped.sum(0)) and torch.equal(bs, bad) and torch.equal(bf, bad)
        torch.testing.assert_close(tf, ts, **TOL)
    assert bf.tolist()[-2:] == [True, False]
    with kernels("fast"):  # a norm bound still holds: each row enters with its clip factor
        assert float(clipped_sum(V[:1] * 1e6, 0.7)[0].norm()) <= 0.7 * (1 + 1e-12)


def test_fast_inprocess_sum_is_the_clipped_total_and_a_subclass_override_still_sees_the_request():
    data = load_dataset("synthetic-logistic", n_users=30, seed=1)
    p = make_problem("logistic", data)
    fed = InProcessFederation(p, data)
    w = torch.linspace(-1, 1, p.num_params, dtype=p.dtype)
    q = ClippedGradient(w, 0.05)
    slow, fast = _both(lambda: fed.sum(q, list(range(30))))
    assert slow.values.shape[0] == 30 and fast.values.shape[0] == 1  # fast: one row, the total
    assert fast.users == slow.users == list(range(30)) and fast.failed == slow.failed == []
    torch.testing.assert_close(fast.total(), slow.total(), **TOL)

    class Seen(InProcessFederation):
        asked: list = []

        def compute(self, query, users=None):
            self.asked.append(users)
            return super().compute(query, users)

    with kernels("fast"):
        got = Seen(p, data).sum(q, [3, 1])
    assert Seen.asked == [[3, 1]] and got.values.shape[0] == 2 and got.users == [3, 1]
    with pytest.raises(ValueError, match="asked once"):
        fed.sum(q, [1, 1])


def test_the_remembered_grouping_follows_an_in_place_change_of_the_user_index():
    data = _records(torch.arange(8), [4, 4])
    coef = torch.ones(8, dtype=torch.float64)
    before = user_means(data.X, data)
    with kernels("fast"):
        first = user_weighted_means(coef, data.X, data)  # grouped: one bmm, the layout remembered
        data.user_index[:] = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])  # same tensor, new version: not grouped now
        second = user_weighted_means(coef, data.X, data)
    torch.testing.assert_close(first, before, **TOL)
    torch.testing.assert_close(second, user_means(data.X, data), **TOL)
    assert not torch.allclose(first, second)


def test_fast_row_kernels_match_and_keep_the_overflow_rescue():
    V = torch.tensor([[3.0, 4.0], [1e200, 1e200], [0.0, 0.0], [-1e-300, 2e-300]], dtype=torch.float64)
    slow, fast = _both(lambda: row_norms(V))
    assert torch.isfinite(fast).all()  # ||(1e200, 1e200)|| is finite though its square overflows
    torch.testing.assert_close(fast, slow, **TOL)
    t = torch.linspace(-800, 800, 101, dtype=torch.float64, requires_grad=True)
    for f in (sigmoid, softplus):
        (a, ga), (b, gb) = _both(lambda: (lambda v: (v, torch.autograd.grad(v.sum(), t)[0]))(f(t)))
        torch.testing.assert_close(b, a, **TOL)
        torch.testing.assert_close(gb, ga, **TOL)
    X, Y = torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 5, dtype=torch.float64)
    torch.testing.assert_close(*_both(lambda: row_dots(X, Y)), **TOL)


def test_kernel_mode_is_scoped_and_checked():
    assert kernel_mode() == "fast"  # the default (reproducible is an explicit opt-in)
    with kernels("reproducible"):
        assert kernel_mode() == "reproducible"
        with pytest.raises(ValueError, match="kernels must be one of"):
            with kernels("turbo"):
                pass
        assert kernel_mode() == "reproducible"
    assert kernel_mode() == "fast"


def test_direct_class_use_and_the_runner_compute_with_the_same_kernels_by_default(tmp_path, monkeypatch):
    """One default everywhere (issue 34): an algorithm class run directly on an InProcessFederation computes
    in the mode a default ``fedkl run`` resolves to (it used to run the reproducible kernels, 5x a fast round)."""
    from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
    from fedkl.algorithms.registry import BuildContext
    from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
    from fedkl.runner import run_training

    seen = []
    for name in ("sum", "compute"):  # every query a training asks goes through one of the two

        def recording(self, query, users=None, _method=getattr(InProcessFederation, name)):
            seen.append(kernel_mode())
            return _method(self, query, users)

        monkeypatch.setattr(InProcessFederation, name, recording)
    data = load_dataset("synthetic-logistic", n_users=12)
    problem = make_problem("logistic", data)
    fed = InProcessFederation(problem, data)
    ledger = PrivacyLedger(str(tmp_path / "ledger.sqlite"), Budget(2.0, 1e-3))
    alg = NoisyGradientDescent(NoisyGDParams(rounds=2, lr=1.0), BuildContext.fresh(rho=0.1))
    alg.run(fed, Releaser(ledger, NoiseSource(0), ZCDPFilter(0.1)), problem.init_params())
    ledger.close()
    direct, seen[:] = set(seen), []
    cfg = RunConfig.from_settings(
        dataset="synthetic-logistic", users=12, rounds=2, reference=False, out=str(tmp_path / "run")
    )
    run_training(cfg, log=lambda s: None)
    assert direct == set(seen) == {cfg.kernels} == {"fast"}


def test_a_flower_client_computes_reproducibly_in_any_thread_or_context():
    """A thread starts in the default (fast) mode, so the ClientApp's worker enters the reproducible kernels
    itself: its answer is bit for bit the reproducible in-process row, inside a fast context or a new thread."""
    import threading
    from types import SimpleNamespace

    from fedkl.flower import codec
    from fedkl.flower.client_app import UserWorker

    spec = codec.ClientSpec(dataset="synthetic-logistic", problem="logistic")  # the loader's default users
    worker = UserWorker(spec, 3)
    data = load_dataset("synthetic-logistic")
    fed = InProcessFederation(make_problem("logistic", data), data)
    query = ClippedGradient(w=torch.full((fed.problem.num_params,), 0.3, dtype=torch.float64), clip=0.01)
    with kernels("reproducible"):
        expected = fed.compute(query, [3]).values[0]

    def reply(content):  # the reply message the worker's content travels in
        return codec.decode_answer(SimpleNamespace(has_error=lambda: False, content=content), query, worker.num_params)

    got = []
    with kernels("fast"):
        got.append(worker._fed.compute(query, [0]).values[0])  # the worker's federation alone: fast here
        got.append(reply(worker.answer(query)))
        t = threading.Thread(target=lambda: got.append(reply(worker.answer(query))))
        t.start()
        t.join()
    assert not torch.equal(got[0], expected)  # the default mode really differs in the last bits here ...
    assert torch.equal(got[1], expected) and torch.equal(got[2], expected)  # ... and the client does not use it


def test_run_config_kernels_and_fast_is_inprocess_only():
    """The default ``auto`` resolves when the configuration is made: fast in-process, reproducible on every
    Flower backend; the settings (result.json, the ledger, a sweep's run key) name the resolved mode."""
    assert RunConfig().kernels == RunConfig(kernels="auto").kernels == "fast"
    assert RunConfig().settings()["kernels"] == "fast"
    for backend in ("flower-local", "flower-sim", "grpc"):
        assert RunConfig(backend=backend).kernels == "reproducible"
    assert RunConfig(kernels="reproducible").kernels == "reproducible"
    assert RunConfig.from_settings(**RunConfig(kernels="reproducible").settings()).kernels == "reproducible"
    with pytest.raises(ValueError, match="kernels must be one of auto, reproducible, fast"):
        RunConfig(kernels="turbo")
    with pytest.raises(ValueError, match="in-process only"):
        RunConfig(kernels="fast", backend="flower-local")


def test_a_sweep_row_is_keyed_by_the_kernels_that_ran():
    """A sweep point that does not name the kernels is the in-process fast run (the same row as one naming
    fast), never the same row as a reproducible run (e.g. of a table made before auto became the default)."""
    from fedkl.experiments import run_key

    point = {"dataset": "synthetic-logistic", "users": 30, "seed": 1}
    assert run_key(point) == run_key({**point, "kernels": "auto"}) == run_key({**point, "kernels": "fast"})
    assert run_key(point) != run_key({**point, "kernels": "reproducible"})
    flower = {**point, "backend": "flower-local"}
    assert run_key(flower) == run_key({**flower, "kernels": "reproducible"})


def _modes_seen_by(monkeypatch, name: str) -> list[str]:
    """The kernel mode in force at each call of ``fedkl.runner.<name>`` (a list filled as it is called)."""
    import fedkl.runner as runner

    seen, real = [], getattr(runner, name)

    def spy(*args, **kw):
        seen.append(kernel_mode())
        return real(*args, **kw)

    monkeypatch.setattr(runner, name, spy)
    return seen


def test_train_federation_runs_the_configured_kernels_without_run_training(monkeypatch):
    """The audit (and the deployed ServerApp) train through ``train_federation`` directly: the
    configuration's kernels are in force there too, not the caller's ambient mode."""
    from fedkl.audit.release import audit_config, released_model

    seen = _modes_seen_by(monkeypatch, "build_algorithm")
    ds = load_dataset("synthetic-logistic", n_users=20, seed=0)
    for mode in ("auto", "reproducible"):
        released_model(audit_config("noisy-gd", 2.0, {"kernels": mode, "rounds": 2}), ds, noise_seed=1)
    assert seen == ["fast", "reproducible"] and kernel_mode() == "fast"


def test_run_training_uses_the_configured_kernels(tmp_path, monkeypatch):
    """``fedkl run --kernels fast`` end to end: the mode is in force while training (and restored after),
    the model equals the reproducible run's to 1e-9, the settings record the mode."""
    import fedkl.runner as runner
    from fedkl.saved_model import load_model

    seen = _modes_seen_by(monkeypatch, "train_federation")
    results = {}
    for mode in ("reproducible", "fast"):
        cfg = RunConfig.from_settings(
            dataset="synthetic-logistic",
            users=30,
            rounds=3,
            noise_seed=5,
            reference=False,
            out=str(tmp_path / mode),
            kernels=mode,
        )
        results[mode] = runner.run_training(cfg, log=lambda s: None)
    assert seen == ["reproducible", "fast"] and kernel_mode() == "fast"
    assert results["fast"]["config"]["kernels"] == "fast"
    slow, fast = (load_model(results[m]["model_path"]).params for m in ("reproducible", "fast"))
    assert not torch.equal(slow, torch.zeros_like(slow))
    torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-12)
