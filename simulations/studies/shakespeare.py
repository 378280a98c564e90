"""Shakespeare next-character prediction, speaking parts as users (issue 30): non-private FedAvg, then
user-level DP-FedAvg at the population the data has (1,426 speaking parts).

Reference: LEAF (Caldas et al. 2018) and McMahan et al. (2017) report about 0.5 test accuracy for a
character LSTM trained by non-private FedAvg on Shakespeare by speaking part (LEAF: 2-layer LSTM of 256
units, 80-character context, every position of every part). Here: ``fedkl.data.shakespeare`` with a
20-character context and at most 200 evenly spaced targets per part, and ``simulations/nets.py:char_mlp``
(a neural character n-gram: 8-dim embeddings, one ReLU layer of 128) -- what a loaded 2-core CPU trains in
minutes (the module's table states the time of every run).

Every run is one process (its CPU time, wall time and peak RSS are its own):

    OMP_NUM_THREADS=1 nice -n 15 python simulations/studies/shakespeare.py nonprivate --split test
    OMP_NUM_THREADS=1 nice -n 15 python simulations/studies/shakespeare.py dp --split test --epsilon 8
    python simulations/studies/shakespeare.py report     # simulations/results/shakespeare.md

``--split validation``: the same run on the TRAINING records only, 20 % of each user's training records
held out as its "test" set (the official test records never loaded): the only split settings were looked
at on. Non-private runs are ``fedkl.algorithms.nonprivate.nonprivate_fedavg`` (the library's FedAvg
without clip or noise, the reference of a DP-FedAvg run) in chunks of ``--eval-every`` rounds, evaluated
between chunks for the learning curve; DP runs are ``fedkl.train(..., algorithm="dp-fedavg")`` (the
library writes result.json and the ledger). Each run's folder under ``simulations/results/shakespeare/``
keeps result.json (or the non-private run's own result.json), metrics.jsonl and ``study.json`` (command,
CPU, wall, peak RSS); the report reads only those files.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "simulations", "results", "shakespeare")
REPORT = os.path.join(ROOT, "simulations", "results", "shakespeare.md")
MODEL = "simulations/nets.py:char_mlp"
DATA = {"context": 20, "max_per_user": 200}
# one plan for every run: local lr 1.0 chosen on the validation split (lr 0.5 slow, 1.5 faster, 1.0 with two
# epochs diverged by round 50: the report's validation curves), nothing else tuned
PLAN = {"local_epochs": 1, "batch_size": 20, "local_lr": 1.0, "server_lr": 1.0}
NONPRIVATE = {"rounds": 700, "sampling_rate": 0.1}
# the clip adapts to the private median of the update norms (Andrew et al. 2021), from 1: no clip chosen by hand.
# float64: in float32 a row clipped to C has a computed norm below C (1 - 1e-9) (adaptive_clip.TIE), so the
# server counts nearly every clipped update as unclipped and the clip shrinks geometrically to ~0 (seen in the
# validation run dp-eps8-validation, which ran in float32: final clip 7e-5)
DP = {"rounds": 100, "sampling_rate": 0.3, "clip": 1.0, "adaptive_clip": True, "dtype": "float64"}


def dataset(split: str):
    """The Shakespeare dataset (``DATA``); ``split="validation"``: its training records only, 20 % of each
    user's held out as the test part (split_seed 1)."""
    from fedkl.data.real import make_federated, split_by_user
    from fedkl.data.shakespeare import load_shakespeare

    ds = load_shakespeare(**DATA)
    if split == "test":
        return ds
    tr = ds.train
    user_index = tr.user_index.numpy()
    is_val = split_by_user(user_index, tr.num_users, 0.2, np.random.default_rng(1), 1)
    return make_federated(
        "shakespeare",
        tr.X.numpy(),
        tr.y.numpy(),
        user_index,
        tr.user_ids,
        is_val,
        "multiclass",
        f"VALIDATION split of {ds.description}: 20% of each user's training records held out (split_seed 1)",
        feature_bound=1.0,
        num_classes=ds.num_classes,
        extra=ds.extra,
    )


def _footprint(started: float, cpu0: float) -> dict:
    return {
        "command": "python simulations/studies/shakespeare.py " + shlex.join(sys.argv[1:]),
        "cpu_s": time.process_time() - cpu0,
        "wall_s": time.time() - started,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_nonprivate(args) -> None:
    from fedkl.algorithms.nonprivate import nonprivate_fedavg
    from fedkl.problems import make_problem

    started, cpu0 = time.time(), time.process_time()
    ds = dataset(args.split)
    problem = make_problem("torch", ds, model=MODEL, dtype="float32", seed=args.seed)
    train, test = ds.train.to(problem.dtype), ds.test.to(problem.dtype)
    rounds, q = args.rounds or NONPRIVATE["rounds"], args.sampling_rate
    out = os.path.join(RESULTS, f"nonprivate-{args.split}{args.tag}")
    os.makedirs(out, exist_ok=True)
    majority = int(torch.bincount(train.y, minlength=ds.num_classes).argmax())
    trivial = float((test.y == majority).double().mean())
    w, curve = problem.init_params(), []
    plan0 = {**PLAN, "local_lr": args.local_lr, "local_epochs": args.local_epochs}
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for start in range(0, rounds, args.eval_every):
            k = min(args.eval_every, rounds - start)
            plan = {**plan0, "rounds": k, "sampling_rate": q, "local_steps": None, "seed": args.seed * 100_000 + start}
            w = nonprivate_fedavg(problem, train, plan, w0=w)
            m = problem.metrics(w, test)
            row = {"round": start + k, **m, "cpu_s": time.process_time() - cpu0, "wall_s": time.time() - started}
            curve.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)
    result = {
        "what": "non-private FedAvg (fedkl.algorithms.nonprivate.nonprivate_fedavg: no clip, no noise)",
        "split": args.split,
        "dataset_description": ds.description,
        "users": ds.train.num_users,
        "model": MODEL,
        "num_params": problem.num_params,
        "plan": {**plan0, "rounds": rounds, "sampling_rate": q, "seed": args.seed},
        "test_metrics": curve[-1],
        "trivial_baseline": {"accuracy": trivial, "majority_symbol": ds.extra["vocabulary"][majority]},
        "epsilon": None,
        "delta": None,
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "study.json"), "w") as f:
        json.dump(_footprint(started, cpu0), f, indent=1)


def run_dp(args) -> None:
    import fedkl

    started, cpu0 = time.time(), time.process_time()
    ds = dataset(args.split)
    out = os.path.join(RESULTS, f"dp-eps{args.epsilon:g}-{args.split}{args.tag}")
    fedkl.train(
        ds,
        "dp-fedavg",
        epsilon=args.epsilon,
        delta=args.delta,
        model=MODEL,
        problem="torch",
        dtype=args.dtype,
        neighbouring="add-remove",
        accountant="rdp",
        rounds=args.rounds or DP["rounds"],
        sampling_rate=DP["sampling_rate"],
        clip=DP["clip"],
        adaptive_clip=DP["adaptive_clip"],
        lr=args.local_lr,
        local_epochs=args.local_epochs,
        batch_size=PLAN["batch_size"],
        server_lr=PLAN["server_lr"],
        seed=args.seed,
        out=out,
        reference=False,
    )
    with open(os.path.join(out, "study.json"), "w") as f:
        json.dump(_footprint(started, cpu0), f, indent=1)


def report(args) -> None:
    rows, private, nonprivate = [], [], {}  # rows: (validation?, line): the test runs first
    for name in sorted(os.listdir(RESULTS)):
        folder = os.path.join(RESULTS, name)
        if not os.path.exists(os.path.join(folder, "study.json")):
            continue
        with open(os.path.join(folder, "result.json")) as f:
            res = json.load(f)
        with open(os.path.join(folder, "study.json")) as f:
            foot = json.load(f)
        acc, majority = res["test_metrics"]["accuracy"], res["trivial_baseline"]["accuracy"]
        if name.startswith("nonprivate"):
            eps, delta, dtype, noise = "∞ (non-private)", "—", "float32", "—"
            rounds, q, split, seed = (
                res["plan"]["rounds"],
                res["plan"]["sampling_rate"],
                res["split"],
                res["plan"]["seed"],
            )
        else:
            cfg, det = res["config"], res["algorithm_details"]
            eps, delta, dtype = f"{res['epsilon']:.2f}", f"{res['delta']:.2g}", cfg["dtype"]
            noise = f"{det['noise_multiplier']:.2f} / {det['final_clip']:.2g}"
            rounds, q, seed = res["rounds"], cfg["sampling_rate"], res["seed"]
            split = "validation" if "VALIDATION" in res["dataset_description"] else "test"
        if split == "test" and name.startswith("nonprivate"):
            nonprivate[name] = (acc, majority, rounds, q)
        elif split == "test":
            private.append((eps, seed, acc))
        line = (
            f"| {split} | {eps} | {delta} | {acc:.3f} | {majority:.3f} | {rounds} | {q:g} | {seed} | {dtype} | {noise} | "
            f"{foot['cpu_s'] / 60:.1f} / {foot['wall_s'] / 60:.1f} | {foot['peak_rss_mib']:.0f} | "
            f"`{foot['command']}` |"
        )
        rows.append((split != "test", line))
    summary = []  # each private test accuracy against the non-private one, above the majority class
    if "nonprivate-test" in nonprivate:
        top, majority = nonprivate["nonprivate-test"][:2]
        for eps, seed, acc in private:
            share = (acc - majority) / (top - majority)
            summary.append(
                f"- ε = {eps} (seed {seed}): {acc:.3f}, {top - acc:.3f} below non-private FedAvg ({top:.3f}); it keeps "
                f"{share:.0%} of the non-private model's gain over the majority class ({majority:.3f})."
            )
    for name, (acc, _, rounds, q) in nonprivate.items():
        if name != "nonprivate-test":
            summary.append(
                f"- Non-private FedAvg under the DP runs' plan ({rounds} rounds, q = {q:g}; `{name}`, the reference "
                f"fedkl computes for a DP-FedAvg run): {acc:.3f}."
            )
    curves = []  # the non-private runs' learning curves
    for name in sorted(os.listdir(RESULTS)):
        path = os.path.join(RESULTS, name, "metrics.jsonl")
        if name.startswith("nonprivate") and os.path.exists(path):
            with open(path) as f:
                points = [json.loads(line) for line in f]
            curve = ", ".join(f"{p['round']}: {p['accuracy']:.3f}" for p in points)
            back = [p for p in points if p["round"] == points[-1]["round"] - 200]
            gain = f"{points[-1]['accuracy'] - back[0]['accuracy']:+.4f}" if back else ""
            curves.append(f"| `{name}` | {curve} | {gain} |")
    lines = [
        "# Shakespeare by speaking part: non-private FedAvg and user-level DP-FedAvg (fedkl)",
        "",
        "Generated by `python simulations/studies/shakespeare.py report` from the result.json / study.json files",
        "under `simulations/results/shakespeare/` (settings and what was chosen on what: the script's docstring",
        "and the notes below). "
        f"Data: `fedkl.data.shakespeare` with context {DATA['context']}, at most {DATA['max_per_user']} targets "
        f"per speaking part; model `{MODEL}`; local training {PLAN['local_epochs']} epoch, batch "
        f"{PLAN['batch_size']}, lr {PLAN['local_lr']}, server lr {PLAN['server_lr']} (plain averaging). "
        "CPU and wall time on the shared, loaded 2-core machine (`nice -n 15`).",
        "",
        "| split | ε | δ | accuracy | majority class | rounds | cohort rate q | seed | dtype | noise multiplier / final clip "
        "| CPU / wall (min) | peak RSS (MiB) | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(line for _, line in sorted(rows, key=lambda r: r[0])),
        "",
        *summary,
        "",
        "Non-private learning curves (round: accuracy; on held-out training records for the validation runs, whose",
        "folder names the local lr and epochs where they differ from the plan's; on the test records for the test run,",
        "looked at only after its plan was fixed):",
        "",
        "| run | round: accuracy | gain over its last 200 rounds |",
        "|---|---|---|",
        *curves,
        "",
    ]
    notes = os.path.join(RESULTS, "NOTES.md")
    if os.path.exists(notes):
        with open(notes) as f:
            lines += [f.read()]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("nonprivate", "dp"):
        s = sub.add_parser(name)
        s.add_argument("--split", choices=("validation", "test"), required=True)
        s.add_argument("--rounds", type=int, default=None)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--local-lr", type=float, default=PLAN["local_lr"])
        s.add_argument("--local-epochs", type=int, default=PLAN["local_epochs"])
        s.add_argument("--tag", default="", help="suffix of the run folder (a validation variant)")
        if name == "nonprivate":
            s.add_argument("--eval-every", type=int, default=25)
            s.add_argument("--sampling-rate", type=float, default=NONPRIVATE["sampling_rate"])
        else:
            s.add_argument("--epsilon", type=float, required=True)
            s.add_argument("--delta", type=float, default=None, help="default: fedkl's 1/n^1.1")
            s.add_argument("--dtype", choices=("float32", "float64"), default=DP["dtype"])
    sub.add_parser("report").add_argument("--out", default=REPORT, help=f"default {REPORT}")
    args = p.parse_args()
    torch.set_num_threads(1)
    {"nonprivate": run_nonprivate, "dp": run_dp, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
