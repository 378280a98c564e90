"""Baseline: Flower 1.41's own ``DifferentialPrivacyServerSideFixedClipping``, as users get it today.

    .venv/bin/python simulations/flower_dp_baseline.py [--out-dir simulations/results]   # the epsilon table
    fedkl sweep simulations/studies/utility.toml   # (plugins = [this file]) trains it next to fedkl's algorithms

What Flower does (read from ``flwr/serverapp/strategy/dp_fixed_clipping.py``, ``fedavg.py``,
``strategy_utils.py``, ``flwr/supercore/differential_privacy.py`` and
``flwr/supercore/privacy_accounting/``, flwr 1.41.0):

* sampling: ``FedAvg.configure_train`` draws ``m = max(int(N * fraction_train), min_train_nodes)``
  nodes with ``random.sample`` — a FIXED-SIZE sample WITHOUT replacement (Python's Mersenne Twister,
  not a CSPRNG); it is not Poisson sampling;
* clipping: the server clips each reply's model delta ``w_u - w_t`` to L2 norm C;
* aggregation: ``FedAvg.aggregate_train`` = the weighted mean ``sum_u k_u x_u / sum_u k_u`` over the
  REPLIES (with the accountant, all weights must be equal, so it divides by the realised reply
  count, which the accountant forces to equal ``num_sampled_clients``);
* noise: ``N(0, (z C / m)^2)`` added to the mean (``compute_stdv = z * C / num_sampled_clients``),
  drawn with ``np.random.normal`` (global NumPy RNG);
* accounting: the only configuration the wrapper accepts with an accountant is
  ``SamplingMethod.NO_AMPLIFICATION`` (and ``PrivacyConfig`` allows that only with
  ``ADD_OR_REMOVE_ONE``); each round composes ``GaussianDpEvent(z)`` in dp-accounting's RDP
  accountant; ``strategy.privacy_spent()`` reports that epsilon at the target delta.

What that guarantees at user level. ``GaussianDpEvent(z)`` under add-or-remove is correct for a
mechanism whose output moves by at most C/m when one user is added or removed. Flower's does not
satisfy that relation: the sample size m is fixed, so adding or removing a user does not change
how many updates are averaged; it changes WHICH users fill the m slots. (With fraction 1 and an
accountant, a population of N + 1 gives N + 1 replies != num_sampled_clients and the round
raises: an error instead of a model, which no epsilon covers.) The relation this mechanism does
satisfy is replace-one with N public. Replacing one sampled user's update x by another user's x'
moves the mean by ``||x - x'|| / m <= 2C/m``, twice what the accountant assumes. Relative to
that sensitivity the noise multiplier is z/2. The sample is a uniform fixed-size sample without
replacement, so amplification by subsampling applies with q = m/N.
``real_epsilon`` accounts exactly that. For m = N it is exact: T Gaussians of multiplier z/2
compose to one Gaussian, whose epsilon fedkl's ``GaussianMechanism.epsilon`` gives (Balle-Wang).
For m < N it is dp-accounting's RDP of ``SampledWithoutReplacement(N, m, Gaussian(z/2))`` under
REPLACE_ONE, an upper bound (dp-accounting's PLD has no without-replacement event). :func:`sensitivity_demo` measures the 2C/m with Flower's own
``aggregate_train`` (noise off).

The baseline's training: the real strategy object (``FedAvg`` wrapped in
``DifferentialPrivacyServerSideFixedClipping`` with Flower's ``RdpAccountant``) runs its own
``start()`` loop. The grid is a Flower ``Grid``: fedkl's in-process ``LocalGrid`` by default, or
Flower's Ray simulation engine with ``backend = "flower-sim"``. A ClientApp answers each train
message with the user's model after ``local_steps`` full-batch (or ``batch_size``) local SGD
steps at ``local_lr`` on its own records, and reports ``num-examples = 1`` (the accountant demands
equal weights). Two external runners are registered for ``fedkl sweep``:

* ``flower-dp-fixed``: the noise multiplier z is calibrated so that the REAL user-level epsilon
  equals the target. Use this one to compare utility at the same (epsilon, delta) as fedkl's runs;
* ``flower-dp-fixed-as-claimed``: z is calibrated so that FLOWER'S accountant claims the target,
  the way a Flower user would pick it. Its table row's ``epsilon`` is the real epsilon.

Both put ``flower_claimed_epsilon``, ``flower_real_epsilon``, ``flower_noise_multiplier`` and
``flower_sample_size`` in the table. RunConfig fields used: dataset, problem, seed, users, reg,
epsilon, delta (default 1/N^1.1), rounds, clip, sampling_rate (Flower's ``fraction_train``),
local_steps, local_lr (default lr), batch_size, noise_seed (seeds Python's and NumPy's global RNGs,
which Flower samples and noises with), reference, backend. Server momentum and server lr do not
exist in Flower's FedAvg: it sets the model to the noisy mean.
"""

from __future__ import annotations

import argparse
import csv
import functools
import logging
import math
import os
import random
import sys
import time

if __package__ in (None, ""):  # run as a script: make `fedkl`, `client`, `server` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"), ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_k, _v)

import dp_accounting  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod  # noqa: E402
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg  # noqa: E402
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent  # noqa: E402

from fedkl.algorithms.registry import algorithm_spec  # noqa: E402
from fedkl.privacy.accounting import make_accountant  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BIG_CLIP = 1e12  # the ClientApp returns its unclipped local model; Flower's wrapper clips on the server
COLUMNS = ("flower_claimed_epsilon", "flower_real_epsilon", "flower_noise_multiplier", "flower_sample_size")


def sample_size(num_users: int, fraction: float, min_train_nodes: int = 1) -> int:
    """``FedAvg.configure_train``'s sample size."""
    return max(int(num_users * fraction), min_train_nodes)


# --------------------------------------------------------------------------------------------------
# accounting: what Flower claims, what the mechanism really gives
# --------------------------------------------------------------------------------------------------
def flower_accountant(delta: float, num_users: int) -> RdpAccountant:
    """The accountant the fixed-clipping wrapper accepts (the only sampling method it allows)."""
    return RdpAccountant(
        PrivacyConfig(
            target_delta=delta,
            population_size=num_users,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
        )
    )


@functools.lru_cache(maxsize=4096)
def claimed_epsilon(z: float, rounds: int, delta: float, num_users: int, m: int) -> float:
    """Flower's own ``RdpAccountant`` after ``rounds`` releases (what ``privacy_spent()`` reports)."""
    acc = flower_accountant(delta, num_users)
    acc.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=m, population_size=num_users), count=rounds)
    return acc.get_privacy_spent().epsilon


@functools.lru_cache(maxsize=4096)
def real_epsilon(z: float, rounds: int, delta: float, num_users: int, m: int, accountant: str = "tight") -> float:
    """User-level epsilon of Flower's mechanism under replace-one (N public), the relation it satisfies:
    the mean's sensitivity is 2C/m and the noise std z C/m, so the multiplier is z/2; the sample is
    m of N users, fixed size, without replacement.

    ``accountant="tight"``: for m = N the exact epsilon of T Gaussians (their composition is one
    Gaussian of multiplier (z/2)/sqrt(T); Balle-Wang analytic, fedkl's ``GaussianMechanism.epsilon``);
    for m < N dp-accounting's RDP of ``SampledWithoutReplacement(N, m, Gaussian(z/2))`` (its PLD has
    no such event). ``accountant="rdp"``: RDP in both cases (the accountant Flower's claim uses)."""
    z_eff = z / 2.0
    if m >= num_users and accountant == "tight":
        from fedkl.privacy.mechanisms import GaussianMechanism

        return GaussianMechanism(1.0, z_eff / math.sqrt(rounds)).epsilon(delta)
    acc = make_accountant("rdp", "replace-one")
    step = dp_accounting.GaussianDpEvent(z_eff)
    if m < num_users:
        step = dp_accounting.SampledWithoutReplacementDpEvent(num_users, m, step)
    acc.compose(dp_accounting.SelfComposedDpEvent(step, rounds))
    return float(acc.get_epsilon(delta))


def real_epsilon_method(num_users: int, m: int) -> str:
    if m >= num_users:
        return "fedkl accounting: exact (Balle-Wang analytic) epsilon of T Gaussians of multiplier z/2, replace-one"
    return "fedkl accounting: RDP (dp-accounting), T x SampledWithoutReplacement(N, m, Gaussian(z/2)), replace-one"


def calibrate(target: float, eps_of_z, lo: float = 0.25, hi: float = 4.0) -> float:
    """A noise multiplier z with ``eps_of_z(z) <= target`` and within 1e-5 (relative) of the smallest
    such z (epsilon decreases in z): bracket by doubling/halving, Brent's method on log z, then step
    up until the target holds."""
    from scipy.optimize import brentq

    while eps_of_z(hi) > target:
        lo, hi = hi, hi * 2.0
        if hi > 1e6:
            raise ValueError(f"no noise multiplier up to {hi:g} reaches epsilon {target}")
    while eps_of_z(lo) <= target:
        lo, hi = lo / 2.0, lo
        if lo < 1e-4:
            return lo
    log_z = brentq(lambda t: math.log(eps_of_z(math.exp(t))) - math.log(target), math.log(lo), math.log(hi), xtol=1e-6)
    z = math.exp(log_z)
    while eps_of_z(z) > target:
        z *= 1 + 1e-6
    return z


def noise_for(target: float, mode: str, rounds: int, delta: float, num_users: int, m: int) -> float:
    fn = real_epsilon if mode == "real" else claimed_epsilon
    return calibrate(target, lambda z: fn(round(z, 10), rounds, delta, num_users, m))


def sensitivity_demo(m: int = 10, clip: float = 1.0, dim: int = 5) -> dict:
    """Flower's own ``aggregate_train`` (noise multiplier 0, no accountant) on two neighbouring
    reply sets: the same m sampled slots, one user's update x (norm C) replaced by -x. Returns the
    distance between the two released means, next to the C/m the accountant assumes."""
    from fedkl.flower.localgrid import _set_task_identity

    _set_task_identity(1)
    rng = np.random.default_rng(0)
    current = np.zeros(dim)
    updates = [rng.standard_normal(dim) for _ in range(m)]
    updates = [u * (clip / np.linalg.norm(u)) for u in updates]

    def release(ups: list[np.ndarray]) -> np.ndarray:
        strategy = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(fraction_evaluate=0.0), noise_multiplier=0.0, clipping_norm=clip, num_sampled_clients=m
        )
        strategy.current_arrays = ArrayRecord({"w": Array(current.copy())})
        replies = []
        for u in ups:
            ref = Message(RecordDict(), dst_node_id=1, message_type="train")
            replies.append(
                Message(
                    RecordDict(
                        {"arrays": ArrayRecord({"w": Array(current + u)}), "metrics": MetricRecord({"num-examples": 1})}
                    ),
                    reply_to=ref,
                )
            )
        arrays, _ = strategy.aggregate_train(1, replies)
        return arrays["w"].numpy()

    logging.getLogger("flwr").setLevel(logging.ERROR)
    a = release(updates)
    b = release([-updates[0]] + updates[1:])
    return {
        "m": m,
        "clip": clip,
        "released_distance": float(np.linalg.norm(a - b)),
        "assumed_sensitivity": clip / m,
        "replace_one_sensitivity": 2 * clip / m,
        "noise_std": "z * C / m (compute_stdv)",
    }


# --------------------------------------------------------------------------------------------------
# training through Flower's strategy
# --------------------------------------------------------------------------------------------------
def _load(cfg):
    from fedkl.runner import load_run_data

    return load_run_data(cfg)


def make_client_app(problem, dataset, local_steps: int, local_lr: float, batch_size: int | None) -> ClientApp:
    """Each node = one user (``partition-id``), holding only its own records (a one-user view, built
    on first use, as fedkl's ClientApp does): local SGD from the received model, returns its model."""
    import dataclasses

    from fedkl.federation.base import ClippedLocalUpdate
    from fedkl.federation.inprocess import InProcessFederation

    users: dict[int, InProcessFederation] = {}
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if pid not in users:
            one = dataclasses.replace(dataset, train=dataset.train.subset([pid]), test=dataset.test.subset([pid]))
            users[pid] = InProcessFederation(problem, one)
        w = torch.from_numpy(np.asarray(msg.content["arrays"]["w"].numpy(), dtype=np.float64).copy())
        query = ClippedLocalUpdate(w.to(problem.dtype), BIG_CLIP, local_steps, local_lr, batch_size)
        delta = users[pid].compute(query, [0]).values[0].to(torch.float64)
        return Message(
            RecordDict(
                {"arrays": ArrayRecord({"w": Array((w + delta).numpy())}), "metrics": MetricRecord({"num-examples": 1})}
            ),
            reply_to=msg,
        )

    return app


def train_with_flower(cfg, mode: str = "real", log=print) -> dict:
    """One training with Flower's DP strategy; returns a ``run_training``-style result dict."""
    from fedkl.algorithms.nonprivate import nonprivate_minimizer
    from fedkl.federation.inprocess import InProcessFederation
    from fedkl.flower.localgrid import LocalGrid
    from fedkl.runner import default_delta, quality_metric

    started = time.time()
    if cfg.backend not in ("inprocess", "flower-local", "flower-sim"):
        raise ValueError(
            f"the Flower baseline runs on a LocalGrid (backend inprocess/flower-local) or on Ray "
            f"(flower-sim), not {cfg.backend!r}"
        )
    dataset, problem, problem_name = _load(cfg)
    fed = InProcessFederation(problem, dataset)
    n = fed.num_users
    delta = cfg.delta if cfg.delta is not None else default_delta(n)
    m = sample_size(n, cfg.sampling_rate)
    z = noise_for(cfg.epsilon, mode, cfg.rounds, delta, n, m)
    eps_claimed = claimed_epsilon(round(z, 10), cfg.rounds, delta, n, m)
    eps_real = real_epsilon(round(z, 10), cfg.rounds, delta, n, m)
    # default: dp-fedavg's step size (the fedkl algorithm this baseline is compared with)
    lr = cfg.lr if cfg.lr is not None else algorithm_spec("dp-fedavg").step_size
    local_lr = cfg.local_lr if cfg.local_lr is not None else lr
    log(
        f"flower-dp-fixed ({mode}-calibrated) on {cfg.dataset}: N={n}, m={m}, z={z:.4f}, T={cfg.rounds}, "
        f"claimed eps {eps_claimed:.4f}, real eps {eps_real:.4f} at delta {delta:.3g}"
    )
    if cfg.noise_seed is not None:  # Flower samples with `random` and noises with `np.random`
        random.seed(cfg.noise_seed)
        np.random.seed(cfg.noise_seed)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    accountant = flower_accountant(delta, n)
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(
            fraction_train=cfg.sampling_rate,
            fraction_evaluate=0.0,
            min_train_nodes=1,
            min_evaluate_nodes=0,
            min_available_nodes=n,
        ),
        noise_multiplier=z,
        clipping_norm=cfg.clip,
        num_sampled_clients=m,
        accountant=accountant,
    )
    client_app = make_client_app(problem, dataset, cfg.local_steps, local_lr, cfg.batch_size)
    initial = ArrayRecord({"w": Array(problem.init_params().to(torch.float64).numpy())})
    threads = torch.get_num_threads()
    if cfg.backend == "flower-sim":
        w = _train_on_ray(strategy, client_app, initial, n, cfg.rounds)
    else:
        torch.set_num_threads(1)
        try:
            result = strategy.start(grid=LocalGrid(client_app, n), initial_arrays=initial, num_rounds=cfg.rounds)
        finally:
            torch.set_num_threads(threads)
        w = result.arrays["w"].numpy()
    spent = strategy.privacy_spent()
    if spent is None or spent.num_releases != cfg.rounds:
        raise RuntimeError(f"Flower released {0 if spent is None else spent.num_releases} of {cfg.rounds} rounds")
    w_t = torch.from_numpy(np.asarray(w, dtype=np.float64)).to(problem.dtype)
    test = fed.evaluate(w_t, "test")
    key = quality_metric(test)
    trivial = problem.trivial_metrics(dataset.train, dataset.test)
    reference = fed.evaluate(nonprivate_minimizer(problem, dataset.train), "test") if cfg.reference else None
    name = "flower-dp-fixed" if mode == "real" else "flower-dp-fixed-as-claimed"
    payload = {
        "algorithm": name,
        "dataset": cfg.dataset,
        "problem": problem_name,
        "users": n,
        "epsilon": eps_real,
        "delta": delta,
        "neighbouring": "replace-one",
        "accountant": real_epsilon_method(n, m) + f"; Flower's RdpAccountant claims {spent.epsilon:.4f} "
        "(add-or-remove, no amplification)",
        "budget": {"epsilon": cfg.epsilon, "delta": delta},
        "backend": cfg.backend,
        "test_metric": {"name": key, "value": test.get(key)},
        "test_metrics": test,
        "nonprivate_reference": reference,
        "trivial_baseline": trivial,
        "seed": cfg.seed,
        "noise_rng": "numpy global (Flower's np.random.normal)" + (" seeded" if cfg.noise_seed is not None else ""),
        "rounds": cfg.rounds,
        "sigma_sum": z * cfg.clip,
        "algorithm_details": {
            "noise_multiplier": z,
            "sample_size": m,
            "sampling": "fixed size, without replacement",
            "flower_claimed_epsilon": spent.epsilon,
            "real_epsilon": eps_real,
            "calibrated_to": mode,
        },
        "table_extra": {
            "flower_claimed_epsilon": spent.epsilon,
            "flower_real_epsilon": eps_real,
            "flower_noise_multiplier": z,
            "flower_sample_size": m,
        },
        "wall_time_s": time.time() - started,
        "metrics_are_private": False,
    }
    got = f"{test[key]:.4f}" if key in test else "n/a"
    log(f"test {key} = {got}; Flower claims eps {spent.epsilon:.4f}, real user-level eps {eps_real:.4f}")
    return payload


def run_on_ray(main, client_app, n: int) -> None:
    """Flower's Ray simulation engine with ``n`` SuperNodes, ``main(grid, context)`` as the ServerApp."""
    from flwr.simulation import run_simulation

    from fedkl.flower.server_app import RAY_BACKEND_CONFIG, make_server_app

    run_simulation(
        server_app=make_server_app(main),
        client_app=client_app,
        num_supernodes=n,
        backend_name="ray",
        backend_config=RAY_BACKEND_CONFIG,
    )


def _train_on_ray(strategy, client_app, initial, n: int, rounds: int) -> np.ndarray:
    """The same strategy.start() inside a ServerApp on Flower's Ray simulation engine."""
    from flwr.serverapp import Grid

    box: dict = {}

    def main(grid: Grid, context: Context) -> None:
        box["result"] = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds)

    run_on_ray(main, client_app, n)
    if "result" not in box:
        raise RuntimeError("the Flower simulation ended without a result")
    return box["result"].arrays["w"].numpy()


def _register() -> None:
    try:
        from fedkl.experiments import EXTERNAL_RUNNERS, register_runner
    except ImportError:  # pragma: no cover
        return
    if "flower-dp-fixed" not in EXTERNAL_RUNNERS:
        register_runner(
            "flower-dp-fixed",
            lambda cfg, log: train_with_flower(cfg, "real", log),
            COLUMNS,
            "Flower DifferentialPrivacyServerSideFixedClipping, z calibrated to the REAL user-level eps",
        )
        register_runner(
            "flower-dp-fixed-as-claimed",
            lambda cfg, log: train_with_flower(cfg, "claimed", log),
            COLUMNS,
            "Flower DifferentialPrivacyServerSideFixedClipping, z calibrated to Flower's CLAIMED eps",
        )


_register()


# --------------------------------------------------------------------------------------------------
# the epsilon table
# --------------------------------------------------------------------------------------------------
# (label, N users, m sampled per round, T rounds, delta or None for 1/N^1.1)
SETTINGS = (
    ("TV16 (all 51 states every round)", 51, 51, 30, None),
    ("Adult (all 41 countries every round)", 41, 41, 30, None),
    ("MovieLens (all 671 raters every round)", 671, 671, 30, None),
    ("MovieLens (201 of 671 raters per round)", 671, 201, 10, None),
    ("TFF DP tutorial (120 of 3,383 per round)", 3383, 120, 100, 1e-5),
)


def epsilon_table(epsilons=(0.5, 1.0, 2.0, 4.0, 8.0), settings=SETTINGS) -> list[dict]:
    rows = []
    for label, n, m, rounds, delta in settings:
        delta = delta if delta is not None else 1.0 / n**1.1
        for eps in epsilons:
            z_claim = noise_for(eps, "claimed", rounds, delta, n, m)
            real_at_claim = real_epsilon(round(z_claim, 10), rounds, delta, n, m)
            real_rdp = real_epsilon(round(z_claim, 10), rounds, delta, n, m, accountant="rdp")
            z_real = noise_for(eps, "real", rounds, delta, n, m)
            rows.append(
                {
                    "setting": label,
                    "users": n,
                    "sampled": m,
                    "rounds": rounds,
                    "delta": delta,
                    "epsilon_claimed": eps,
                    "z_flower_user_picks": z_claim,
                    "real_epsilon": real_at_claim,
                    "real_over_claimed": real_at_claim / eps,
                    "real_epsilon_rdp": real_rdp,
                    "z_for_real_epsilon": z_real,
                    "noise_ratio_needed": z_real / z_claim,
                }
            )
            print(
                f"{label:>45}  claimed eps {eps:<4g}: z = {z_claim:8.4f} -> real eps {real_at_claim:9.4f} "
                f"({real_at_claim / eps:5.2f}x); real eps {eps:g} needs z = {z_real:.4f} ({z_real / z_claim:.2f}x)",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=RESULTS)
    p.add_argument("--eps", default="0.5,1,2,4,8")
    args = p.parse_args(argv)
    start = time.perf_counter()
    demo = sensitivity_demo()
    print(
        f"Flower's aggregate_train, noise off, m={demo['m']}, C={demo['clip']}: replacing one sampled user's update "
        f"x by -x moves the released mean by {demo['released_distance']:.4f} = 2C/m "
        f"(the accountant assumes C/m = {demo['assumed_sensitivity']:.4f})"
    )
    rows = epsilon_table(tuple(float(e) for e in args.eps.split(",")))
    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = os.path.join(args.out_dir, "flower_dp_epsilon.csv")
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import flwr

    lines = [
        f"# Flower {flwr.__version__} `DifferentialPrivacyServerSideFixedClipping`: claimed vs real user-level ε",
        "",
        "A Flower user picks the noise multiplier z so that Flower's own `RdpAccountant` (the only configuration "
        "the wrapper accepts: add-or-remove, `NO_AMPLIFICATION`) reports the target ε. The mechanism averages a "
        "fixed-size sample of m users (drawn without replacement), so one user's data moves the released mean by "
        f"2C/m, not C/m: measured with Flower's own `aggregate_train` (noise off, m = {demo['m']}, C = {demo['clip']:g}), "
        f"the distance is **{demo['released_distance']:.4f}**, against the {demo['assumed_sensitivity']:.4f} "
        "the accountant assumes. The 'real ε' below is fedkl's accounting of the relation the mechanism does "
        "satisfy: replace-one with N public, multiplier z/2, and without-replacement amplification when m < N "
        "(exact, Balle-Wang analytic, for m = N; dp-accounting's RDP, an upper bound, for m < N). Flower's "
        "claim is dp-accounting's RDP of T Gaussians of multiplier z (no sampling); the 'real ε by RDP' column "
        "accounts the real relation with that same accountant, so its ratio to the claim is due to the relation "
        "alone.",
        "",
        "| setting | N | m | T | δ | claimed ε | z a Flower user picks | real ε | real / claimed | real ε by RDP "
        "(Flower's accountant) | z for real ε = claimed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['users']} | {r['sampled']} | {r['rounds']} | {r['delta']:.3g} | "
            f"{r['epsilon_claimed']:g} | {r['z_flower_user_picks']:.4f} | {r['real_epsilon']:.4f} | "
            f"{r['real_over_claimed']:.2f} | {r['real_epsilon_rdp']:.4f} | {r['z_for_real_epsilon']:.4f} |"
        )
    lines += [
        "",
        "Real / claimed > 1: Flower under-reports the user-level ε (the factor 2 in sensitivity is "
        "not offset by amplification). Real / claimed < 1: sampling amplification, which Flower's "
        "accountant refuses to count, outweighs it, and Flower over-reports ε. "
        f"Generated by `simulations/flower_dp_baseline.py` in {time.perf_counter() - start:.0f} s.",
    ]
    md_path = os.path.join(args.out_dir, "flower_dp_epsilon.md")
    with open(md_path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {csv_path} and {md_path}")
    return rows


if __name__ == "__main__":
    main()
