"""Benchmark that names the peers: one task, one harness, one run (issue 18 §6).

    nice -n 15 .venv/bin/python simulations/bench_peers.py            # the full table (~40 min here)
    nice -n 15 .venv/bin/python simulations/bench_peers.py --quick    # headline point only

The task, the same for every implementation: user-level noisy gradient descent = central-DP FedAvg
with full participation and one full-batch local step, logistic regression (no bias, labels +-1),
``n`` users x ``m`` records, d = 50, T = 10 rounds, one thread, clip C = 1 on each user's gradient
(on the model delta lr*C for the FedAvg peers), Gaussian noise z*C on the sum (z = 1), lr = 1:

    w <- w - lr * (sum_u clip_C(grad L_u(w)) + N(0, (z C)^2 I)) / n,   L_u = mean_j softplus(-y_j x_j.w)

The data are generated here with NumPy from a seed (rows in the unit ball), identically in every
child. Implementations, each a subprocess of its own interpreter (``--child NAME``):

  * ``floor``:              the true floor, hand-written in torch (float64, fedkl's dtype): one
                            ``X @ w``, sigmoid, ONE batched matmul for the per-user gradients,
                            ``torch.linalg.vector_norm``, clip, sum, noise, step;
  * ``floor-f32``:          the same in float32 (the peers' dtype);
  * ``vmap``:               ``torch.func.vmap(torch.func.grad(user_loss))`` over users (float64);
  * ``fedkl-fast`` / ``fedkl-reproducible``: fedkl's ``NoisyGradientDescent`` through the federation,
                            the Releaser and the durable ledger (add-remove, rho per round
                            1/(2 z^2) so that sigma = z C), in each kernel mode;
  * ``fedkl-fast-query``:   fedkl's federation query alone (``ClippedGradient``, fast kernels) with the
                            floor's noise and step: no Releaser, no ledger (what the charge costs);
  * ``opacus``:             Opacus ``PrivacyEngine.make_private`` with one sample = one user (each
                            user's m records form one "sample"; per-sample gradients of the user's
                            mean loss), full batch, ``poisson_sampling=False`` (float32);
  * ``pfl``:                pfl-research's ``FederatedAveraging`` on its ``SimulatedBackend`` with
                            ``CentrallyAppliedPrivacyMechanism(GaussianMechanism)``, cohort = all
                            users (float32);
  * ``flower``:             Flower's ``FedAvg`` wrapped in ``DifferentialPrivacyServerSideFixedClipping``
                            on the Ray simulation engine (``run_simulation``, one SuperNode per user);
                            by default only up to ``--flower-max-users`` users (it is slow).

Each child runs ``--repeats`` (>= 3) whole T-round trainings (plus one untimed warm-up round where
the framework allows it; Flower: the trainings run back to back in one simulation) and reports the
wall time per round (run time / T) of each; the table gives min and median. Peak memory: the
maximum of the child's own ``ru_maxrss`` and the summed RSS of its process tree sampled from /proc
(Ray's workers). Ratios are to ``fedkl-fast`` at the same point in the same run. The scaling
exponent is the least-squares slope of log(time per round) against log(n) (at fixed m) and log(m)
(at fixed n). ``--check`` first runs every implementation with z = 0 and an infinite clip for one
round at a small point and compares the first round's gradient (w0 - w1)/lr with the float64 floor.

Peer setup (separate virtualenvs outside the repo; the fedkl children use this interpreter):

    python3 -m venv /work/peers/opacus-venv && /work/peers/opacus-venv/bin/pip install torch==2.13.0 opacus numpy
    python3 -m venv /work/peers/pfl-venv && /work/peers/pfl-venv/bin/pip install torch==2.13.0 'pfl[pytorch]'

(pfl pins an older dp-accounting than fedkl's, hence its own virtualenv.) ``--opacus-python`` and
``--pfl-python`` point elsewhere; a peer whose interpreter or package is missing is skipped with a
line saying how to install it. Flower and Ray come from fedkl's own environment.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
PEERS_DIR = "/work/peers"
DIM, ROUNDS, CLIP, NOISE, LR, W0 = 50, 10, 1.0, 1.0, 1.0, 0.1
HEADLINE = (1000, 100)
USER_SCAN, RECORD_SCAN = (100, 300, 1000, 3000, 10000), (30, 100, 300)
CHECK_POINT = (200, 30)
IMPLEMENTATIONS = (
    "floor",
    "floor-f32",
    "vmap",
    "fedkl-fast",
    "fedkl-reproducible",
    "fedkl-fast-query",
    "opacus",
    "pfl",
    "flower",
)
INSTALL = {
    "opacus": "python3 -m venv /work/peers/opacus-venv && /work/peers/opacus-venv/bin/pip install torch==2.13.0 opacus numpy",
    "pfl": "python3 -m venv /work/peers/pfl-venv && /work/peers/pfl-venv/bin/pip install torch==2.13.0 'pfl[pytorch]'",
}


# --------------------------------------------------------------------------------------------------
# the task (NumPy only: every child, in any virtualenv, builds the same data)
# --------------------------------------------------------------------------------------------------
def make_data(n: int, m: int, d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``X`` (n, m, d) float64 with rows in the unit ball, ``y`` (n, m) in {-1, +1} from a logistic
    model with a per-user shift."""
    rng = np.random.default_rng(seed)
    w_star = rng.standard_normal(d) * (3.0 / math.sqrt(d))
    X = rng.standard_normal((n, m, d)) / math.sqrt(d) + 0.3 * rng.standard_normal((n, 1, d)) / math.sqrt(d)
    X /= np.maximum(1.0, np.linalg.norm(X, axis=2, keepdims=True))
    p = 1.0 / (1.0 + np.exp(-X @ w_star))
    y = np.where(rng.random((n, m)) < p, 1.0, -1.0)
    return X, y


# --------------------------------------------------------------------------------------------------
# pure helpers (unit-tested)
# --------------------------------------------------------------------------------------------------
def loglog_slope(xs, ys) -> float:
    """Least-squares slope of log(y) on log(x): the scaling exponent (time ~ x^slope)."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if not (np.isfinite(x).all() and np.isfinite(y).all() and (x > 0).all() and (y > 0).all()):
        raise ValueError("a log-log slope needs positive, finite x and y")
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("a log-log slope needs at least two distinct x values")
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def summarize(round_s: list[float]) -> tuple[float, float]:
    """(min, median) of the per-round times of the repeats."""
    if not round_s:
        raise ValueError("no timings")
    return min(round_s), statistics.median(round_s)


def ratio_rows(rows: list[dict], base: str = "fedkl-fast") -> list[dict]:
    """Add ``x_fast`` (min time per round / the base implementation's at the same point) to each row."""
    base_min = {(r["users"], r["records"]): r["min_s"] for r in rows if r["impl"] == base and "min_s" in r}
    for r in rows:
        b = base_min.get((r["users"], r["records"]))
        r["x_fast"] = r["min_s"] / b if b and "min_s" in r else None
    return rows


def exponents(rows: list[dict], users_fixed_m: int, records_fixed_n: int) -> dict[str, dict[str, float | None]]:
    """Per implementation: the log-log slope of min time per round in users (at m = users_fixed_m)
    and in records (at n = records_fixed_n); None where fewer than two points ran."""
    out: dict[str, dict[str, float | None]] = {}
    for impl in dict.fromkeys(r["impl"] for r in rows):
        ok = [r for r in rows if r["impl"] == impl and "min_s" in r]
        by_n = sorted((r["users"], r["min_s"]) for r in ok if r["records"] == users_fixed_m)
        by_m = sorted((r["records"], r["min_s"]) for r in ok if r["users"] == records_fixed_n)
        out[impl] = {
            "users": loglog_slope(*zip(*by_n)) if len({x for x, _ in by_n}) >= 2 else None,
            "records": loglog_slope(*zip(*by_m)) if len({x for x, _ in by_m}) >= 2 else None,
        }
    return out


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def markdown(rows: list[dict], slopes: dict, checks: list[dict], notes: list[str]) -> str:
    """The result table (times in ms per round), the exponents, the gradient check and the notes."""
    lines = [
        "| users | records | implementation | ms/round min | ms/round median | x fedkl-fast (min) | peak MB | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = lambda k: None if k not in r else 1e3 * r[k]  # noqa: E731
        lines.append(
            f"| {r['users']:,} | {r['records']} | {r['impl']} | {_fmt(ms('min_s'), '.2f')} | "
            f"{_fmt(ms('median_s'), '.2f')} | {_fmt(r.get('x_fast'), '.2f')} | {_fmt(r.get('peak_mb'), '.0f')} | "
            f"{r.get('note', '')} |"
        )
    lines += ["", "Scaling exponent (log-log slope of min ms/round):", ""]
    lines += ["| implementation | in users (fixed m) | in records (fixed n) |", "|---|---|---|"]
    for impl, s in slopes.items():
        lines.append(f"| {impl} | {_fmt(s['users'], '.2f')} | {_fmt(s['records'], '.2f')} |")
    if checks:
        lines += ["", "Non-private first-round gradient vs the float64 floor (z = 0, no clipping):", ""]
        lines += [
            "| implementation | max abs difference | relative to max abs gradient | agrees (<= 1e-5) |",
            "|---|---|---|---|",
        ]
        for c in checks:
            diff, scale = c.get("max_abs_diff"), c.get("max_abs_ref")
            rel = diff / scale if diff is not None and scale else None
            agree = "—" if diff is None else ("yes" if diff <= 1e-5 else "NO")
            note = f" {c['note']}" if c.get("note") else ""
            lines.append(f"| {c['impl']} | {_fmt(diff, '.2e')} | {_fmt(rel, '.2e')} | {agree}{note} |")
    lines += [""] + notes
    return "\n".join(lines) + "\n"


def write_csv(path: str, rows: list[dict]) -> None:
    keys = ["users", "records", "impl", "min_s", "median_s", "x_fast", "peak_mb", "repeats", "note"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


# --------------------------------------------------------------------------------------------------
# the children: each returns (per-round seconds of each repeat, first round's gradient)
# --------------------------------------------------------------------------------------------------
def _torch_round_fn(kind: str, X: np.ndarray, y: np.ndarray, a):
    import torch

    dtype = torch.float32 if kind == "floor-f32" else torch.float64
    n, m, d = X.shape
    X3, y2 = torch.from_numpy(X).to(dtype), torch.from_numpy(y).to(dtype)
    X2, y1 = X3.view(n * m, d), y2.view(n * m)
    gen = torch.Generator().manual_seed(a.seed)

    def clip_sum(grads):
        norms = torch.linalg.vector_norm(grads, dim=1)
        factor = torch.clamp(a.clip / norms.clamp_min(1e-30), max=1.0)
        return factor @ grads

    if kind == "vmap":

        def user_loss(v, Xu, yu):
            return torch.nn.functional.softplus(-yu * (Xu @ v)).mean()

        per_user = torch.func.vmap(torch.func.grad(user_loss), in_dims=(None, 0, 0))

        def grads(w):
            return per_user(w, X3, y2)

    else:

        def grads(w):
            coef = -y1 * torch.sigmoid(-y1 * (X2 @ w))
            return torch.bmm(coef.view(n, 1, m), X3).squeeze(1) / m

    def step(w):
        noisy = clip_sum(grads(w)) + (a.noise * a.clip) * torch.randn(d, generator=gen, dtype=dtype)
        return w - a.lr * noisy / n

    return (lambda: torch.full((d,), W0, dtype=dtype)), step, (lambda w: w.double().numpy())


def _fedkl_runner(mode: str, X: np.ndarray, y: np.ndarray, a):
    import torch

    from fedkl.algorithms.contract import BuildContext
    from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
    from fedkl.data.real import make_federated
    from fedkl.federation.base import ClippedGradient
    from fedkl.federation.inprocess import InProcessFederation
    from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
    from fedkl.problems import make_problem
    from fedkl.problems.rowwise import kernels

    n, m, d = X.shape
    user_index = np.repeat(np.arange(n, dtype=np.int64), m)
    ids = tuple(f"{u:07d}" for u in range(n))
    data = make_federated(
        "bench-peers",
        X.reshape(n * m, d),
        y.reshape(n * m),
        user_index,
        ids,
        np.zeros(n * m, dtype=bool),
        "binary",
        "bench_peers synthetic logistic",
        feature_bound=1.0,
        extra={},
    )
    problem = make_problem("logistic", data)
    fed = InProcessFederation(problem, data)
    w0 = torch.full((problem.num_params,), W0, dtype=problem.dtype)

    def query_only(rounds: int) -> tuple[float, np.ndarray]:
        gen, users, w = torch.Generator().manual_seed(a.seed), list(range(n)), w0
        start = time.perf_counter()
        with kernels("fast"):
            for _ in range(rounds):
                total = fed.sum(ClippedGradient(w, a.clip), users).total()
                noise = (a.noise * a.clip) * torch.randn(d, generator=gen, dtype=w.dtype)
                w = w - a.lr * (total + noise) / n
        return time.perf_counter() - start, w.numpy()

    def train(rounds: int) -> tuple[float, np.ndarray]:
        if a.noise == 0:  # the check: the federation's non-private first-round sum, no Releaser
            with kernels(mode):
                total = fed.sum(ClippedGradient(w0, a.clip), list(range(n))).total()
            return 0.0, (w0 - a.lr * total / n).numpy()
        rho = rounds / (2.0 * a.noise**2)  # add-remove: sigma = C / sqrt(2 rho / T) = z C
        alg = NoisyGradientDescent(
            NoisyGDParams(rounds=rounds, lr=a.lr, clip=a.clip), BuildContext.fresh(rho=rho, neighbouring="add-remove")
        )
        with tempfile.TemporaryDirectory() as tmp:
            ledger = PrivacyLedger(os.path.join(tmp, "ledger.sqlite"), Budget(1e6, 1e-5))
            start = time.perf_counter()
            with kernels(mode):
                result = alg.run(fed, Releaser(ledger, NoiseSource(a.seed), ZCDPFilter(rho)), w0)
            wall = time.perf_counter() - start
            ledger.close()
        return wall, result.w.numpy()

    return (query_only if mode == "fast-query" else train), w0.numpy()


def _opacus_runner(X: np.ndarray, y: np.ndarray, a):
    import warnings

    import torch
    from opacus import PrivacyEngine

    warnings.filterwarnings("ignore")
    n, m, d = X.shape
    ds = torch.utils.data.TensorDataset(torch.from_numpy(X).float(), torch.from_numpy(y).float())

    def train(rounds: int) -> tuple[float, np.ndarray]:
        model = torch.nn.Linear(d, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(W0)
        opt = torch.optim.SGD(model.parameters(), lr=a.lr)
        loader = torch.utils.data.DataLoader(ds, batch_size=n)
        engine = PrivacyEngine()
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=a.noise,
            max_grad_norm=a.clip,
            poisson_sampling=False,
        )
        torch.manual_seed(a.seed)
        start = time.perf_counter()
        for _ in range(rounds):  # one epoch = one full batch = one round
            for xb, yb in loader:
                opt.zero_grad()
                out = model(xb).squeeze(-1)  # (users, m): one sample = one user's records
                loss = torch.nn.functional.softplus(-yb * out).mean(dim=1).mean()
                loss.backward()
                opt.step()
        wall = time.perf_counter() - start
        return wall, model._module.weight.detach().double().numpy().ravel()

    return train, np.full(d, W0)


def _pfl_runner(X: np.ndarray, y: np.ndarray, a):
    import logging

    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism

    logging.getLogger("pfl").setLevel(logging.ERROR)
    n, m, d = X.shape
    Xf, yf = X.astype(np.float32), y.astype(np.float32)
    slices = {u: [Xf[u], yf[u]] for u in range(n)}

    class Logistic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(d, 1, bias=False)

        def forward(self, x):
            return self.linear(x).squeeze(-1)

        def loss(self, x, y, eval=False):
            x, y = torch.as_tensor(x), torch.as_tensor(y)
            return torch.nn.functional.softplus(-y * self(x)).mean()

        def metrics(self, x, y, eval=False):
            return {"loss": Weighted(float(self.loss(x, y)) * len(y), len(y))}

    def train(rounds: int) -> tuple[float, np.ndarray]:
        torch.manual_seed(a.seed)
        np.random.seed(a.seed)
        module = Logistic()
        with torch.no_grad():
            module.linear.weight.fill_(W0)
        model = PyTorchModel(
            model=module,
            local_optimizer_create=torch.optim.SGD,
            central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
        )
        dataset = FederatedDataset.from_slices(slices, get_user_sampler("minimize_reuse", list(range(n))))
        mech = CentrallyAppliedPrivacyMechanism(
            GaussianMechanism(clipping_bound=a.lr * a.clip, relative_noise_stddev=a.noise)
        )
        backend = SimulatedBackend(training_data=dataset, val_data=dataset, postprocessors=[mech])
        params = NNAlgorithmParams(
            central_num_iterations=rounds, evaluation_frequency=rounds + 1, train_cohort_size=n, val_cohort_size=0
        )
        start = time.perf_counter()
        FederatedAveraging().run(
            algorithm_params=params,
            backend=backend,
            model=model,
            model_train_params=NNTrainHyperParams(local_num_epochs=1, local_learning_rate=a.lr, local_batch_size=None),
            model_eval_params=NNEvalHyperParams(local_batch_size=None),
        )
        wall = time.perf_counter() - start
        return wall, module.linear.weight.detach().double().numpy().ravel()

    return train, np.full(d, W0)


def _flower_child(X: np.ndarray, y: np.ndarray, a) -> tuple[list[float], np.ndarray, np.ndarray]:
    """All repeats in ONE Ray simulation (its start-up is excluded): the ServerApp's main runs
    ``strategy.start`` once for one untimed warm-up round, then ``repeats`` times, each a fresh
    strategy and a T-round training."""
    import logging

    from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

    from simulations.flower_dp_baseline import run_on_ray

    n, m, d = X.shape
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        u = int(context.node_config["partition-id"])
        w = np.asarray(msg.content["arrays"]["w"].numpy(), dtype=np.float64)
        z = y[u] * (X[u] @ w)
        grad = -(y[u] / (1.0 + np.exp(z))) @ X[u] / m  # d/dw mean softplus(-y x.w)
        return Message(
            RecordDict(
                {"arrays": ArrayRecord({"w": Array(w - a.lr * grad)}), "metrics": MetricRecord({"num-examples": 1})}
            ),
            reply_to=msg,
        )

    w0 = np.full(d, W0)
    box: dict = {"walls": []}

    def strategy() -> DifferentialPrivacyServerSideFixedClipping:
        return DifferentialPrivacyServerSideFixedClipping(
            FedAvg(
                fraction_train=1.0,
                fraction_evaluate=0.0,
                min_train_nodes=n,
                min_evaluate_nodes=0,
                min_available_nodes=n,
            ),
            noise_multiplier=a.noise,
            clipping_norm=a.lr * a.clip,
            num_sampled_clients=n,
        )

    def main(grid: Grid, context: Context) -> None:
        import random

        random.seed(a.seed)
        np.random.seed(a.seed)
        # warm-up (untimed): one round, which starts Ray's actors; its model is the first round's
        box["w1"] = strategy().start(grid=grid, initial_arrays=ArrayRecord({"w": Array(w0.copy())}), num_rounds=1)
        for _ in range(a.repeats if a.noise > 0 else 0):
            start = time.perf_counter()
            strategy().start(grid=grid, initial_arrays=ArrayRecord({"w": Array(w0.copy())}), num_rounds=a.rounds)
            box["walls"].append(time.perf_counter() - start)

    logging.getLogger("flwr").setLevel(logging.ERROR)
    run_on_ray(main, client, n)
    if "w1" not in box or len(box["walls"]) != (a.repeats if a.noise > 0 else 0):
        raise RuntimeError(f"the Flower simulation finished {len(box['walls'])} of {a.repeats} trainings")
    return [wall / a.rounds for wall in box["walls"]], w0, box["w1"].arrays["w"].numpy().astype(np.float64)


def child(a) -> dict:
    import torch

    torch.set_num_threads(1)
    X, y = make_data(a.users[0], a.records[0], a.dim, a.data_seed)
    if a.child == "flower":
        round_s, w0, w1 = _flower_child(X, y, a)
    else:
        if a.child in ("floor", "floor-f32", "vmap"):
            init, step, to_np = _torch_round_fn(a.child, X, y, a)

            def train(rounds: int) -> tuple[float, np.ndarray]:
                w = init()
                start = time.perf_counter()
                for _ in range(rounds):
                    w = step(w)
                return time.perf_counter() - start, to_np(w)

            w0 = to_np(init())
        elif a.child.startswith("fedkl-"):
            train, w0 = _fedkl_runner(a.child.removeprefix("fedkl-"), X, y, a)
        elif a.child == "opacus":
            train, w0 = _opacus_runner(X, y, a)
        elif a.child == "pfl":
            train, w0 = _pfl_runner(X, y, a)
        else:
            raise ValueError(f"unknown implementation {a.child!r}")
        _, w1 = train(1)  # warm-up, and the first round's model
        round_s = [train(a.rounds)[0] / a.rounds for _ in range(a.repeats)] if a.noise > 0 else []
    g1 = (np.asarray(w0, dtype=np.float64) - np.asarray(w1, dtype=np.float64)) / a.lr
    return {
        "round_s": round_s,
        "g1": g1.tolist(),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# --------------------------------------------------------------------------------------------------
# the parent
# --------------------------------------------------------------------------------------------------
def interpreter(impl: str, args) -> tuple[str | None, str]:
    """(python to run ``impl`` with, or None if missing; the reason/how to install)."""
    if impl in ("opacus", "pfl"):
        py = getattr(args, f"{impl}_python")
        module = {"opacus": "opacus", "pfl": "pfl.model.pytorch"}[impl]
        if not os.path.exists(py):
            return None, f"{impl} skipped: no interpreter at {py}; install: {INSTALL[impl]}"
        ok = subprocess.run([py, "-c", f"import {module}"], capture_output=True).returncode == 0
        return (py, "") if ok else (None, f"{impl} skipped: `import {module}` fails in {py}; install: {INSTALL[impl]}")
    return sys.executable, ""


def run_child(py: str, impl: str, n: int, m: int, args, noise: float, clip: float, rounds: int, repeats: int) -> dict:
    sys.path.insert(0, ROOT)
    from simulations.bench_backends import run_sampled  # samples the process tree's RSS (Ray's workers)

    cmd = [py, os.path.abspath(__file__), "--child", impl, "--users", str(n), "--records", str(m)]
    cmd += ["--dim", str(args.dim), "--rounds", str(rounds), "--repeats", str(repeats), "--lr", str(args.lr)]
    cmd += ["--clip", repr(clip), "--noise", repr(noise), "--seed", str(args.seed), "--data-seed", str(args.data_seed)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": ROOT,
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    proc, peak = run_sampled(cmd, env, args.timeout)
    if proc is None:
        return {"error": f"timed out after {args.timeout:.0f} s", "peak_mb": peak}
    out, err = proc.stdout, proc.stderr
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (err or out).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0][:200]}", "peak_mb": peak}
    res = json.loads(lines[-1])
    res["peak_mb"] = max(peak, res["maxrss_mb"])
    return res


def plan(args) -> list[tuple[int, int]]:
    if args.quick:
        return [HEADLINE]
    points = [(n, HEADLINE[1]) for n in args.users] + [(HEADLINE[0], m) for m in args.records]
    return list(dict.fromkeys(points))


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    p.add_argument("--users", type=int, nargs="+", default=list(USER_SCAN), help="the users scan (at m = 100)")
    p.add_argument("--records", type=int, nargs="+", default=list(RECORD_SCAN), help="the records scan (at n = 1000)")
    p.add_argument("--dim", type=int, default=DIM)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--repeats", type=int, default=3, help="whole T-round trainings timed (>= 3)")
    p.add_argument("--clip", type=float, default=CLIP)
    p.add_argument("--noise", type=float, default=NOISE, help="noise multiplier z (sigma = z C on the sum)")
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    p.add_argument("--quick", action="store_true", help="the headline point (1,000 x 100) only")
    p.add_argument("--no-check", action="store_true", help="skip the non-private first-round gradient check")
    p.add_argument("--pfl-max-users", type=int, default=3000, help="pfl only up to this many users (slow)")
    p.add_argument("--flower-max-users", type=int, default=1000, help="Flower+Ray only up to this many users (slow)")
    p.add_argument("--flower-records", type=int, nargs="+", default=[HEADLINE[1]], help="Flower only at these m")
    p.add_argument("--opacus-python", default=os.path.join(PEERS_DIR, "opacus-venv", "bin", "python"))
    p.add_argument("--pfl-python", default=os.path.join(PEERS_DIR, "pfl-venv", "bin", "python"))
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per child")
    p.add_argument("--out", default=os.path.join(RESULTS, "bench_peers"), help="prefix of the .md and .csv")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return []
    if args.repeats < 3:
        p.error("--repeats must be >= 3")
    started = time.time()
    notes, pythons = [], {}
    for impl in args.impls:
        py, why = interpreter(impl, args)
        if py is None:
            print(why, flush=True)
            notes.append(f"- {why}")
        else:
            pythons[impl] = py
    loads = [load_line()]
    print(loads[0], flush=True)

    checks: list[dict] = []
    if not args.no_check:
        n, m = CHECK_POINT
        ref = None
        for impl in [i for i in IMPLEMENTATIONS if i in pythons]:
            res = run_child(pythons[impl], impl, n, m, args, noise=0.0, clip=1e12, rounds=1, repeats=1)
            if "error" in res:
                checks.append({"impl": impl, "max_abs_diff": None, "note": res["error"]})
            else:
                g = np.asarray(res["g1"])
                ref = g if impl == "floor" else ref
                diff = None if ref is None else float(np.max(np.abs(g - ref)))
                scale = None if ref is None else float(np.max(np.abs(ref)))
                checks.append({"impl": impl, "max_abs_diff": diff, "max_abs_ref": scale})
            print(f"check {impl}: {checks[-1]}", flush=True)

    rows: list[dict] = []
    for n, m in plan(args):
        for impl in [i for i in IMPLEMENTATIONS if i in pythons]:
            row = {"users": n, "records": m, "impl": impl, "repeats": args.repeats}
            skip = None
            if impl == "pfl" and n > args.pfl_max_users:
                skip = f"not run (n > --pfl-max-users {args.pfl_max_users})"
            if impl == "flower" and (n > args.flower_max_users or m not in args.flower_records):
                skip = f"not run (Flower+Ray: n <= --flower-max-users {args.flower_max_users}, m in --flower-records)"
            if skip:
                row["note"] = skip
                rows.append(row)
                continue
            res = run_child(pythons[impl], impl, n, m, args, args.noise, args.clip, args.rounds, args.repeats)
            if "error" in res:
                row.update(note=res["error"], peak_mb=res.get("peak_mb"))
            else:
                row["min_s"], row["median_s"] = summarize(res["round_s"])
                row["peak_mb"] = res["peak_mb"]
                if impl == "flower":
                    row["note"] = "repeats in one Ray simulation (start-up excluded)"
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items()}), flush=True)
        loads.append(load_line())
    ratio_rows(rows)
    slopes = exponents(rows, HEADLINE[1], HEADLINE[0])
    notes = [
        f"One invocation, {time.time() - started:.0f} s in all, on {os.cpu_count()} CPU cores shared with other "
        f"jobs (started niced); {loads[0]} at the start, {loads[-1]} at the end. Read the ratios within this "
        "run, not the absolute times.",
        f"Task: logistic regression, d = {args.dim}, T = {args.rounds} rounds, clip C = {args.clip:g}, noise "
        f"multiplier z = {args.noise:g}, lr = {args.lr:g}, full participation, one torch thread per process; "
        f"min/median over {args.repeats} whole trainings of the time per round (run time / T).",
        "What a round includes: fedkl-fast/-reproducible, the federation query, the Releaser's noise and the "
        "durable ledger charge (one SQLite transaction with fsync per round); fedkl-fast-query, the same "
        "query and noise without the Releaser and ledger (the difference is what the durable charge costs); "
        "floor/vmap, only the tensor work and the noise; "
        "Opacus, its DataLoader over users, per-sample gradients, clipping, noise and its accountant's "
        "bookkeeping; pfl, its per-user simulation loop (local SGD step, clipping, summing) and central "
        "noise, no accountant; Flower, the Ray message round trips of every user and the strategy's "
        "clipping, mean and noise, no accountant. Flower and pfl run only to the user counts shown "
        "(`--flower-max-users`, `--pfl-max-users`): they are the slow ones.",
    ] + notes
    md = markdown(rows, slopes, checks, notes)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    write_csv(args.out + ".csv", rows)
    print(md)
    return rows


if __name__ == "__main__":
    main()
