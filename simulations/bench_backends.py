"""Speed benchmark: the same user-level DP run on every backend, and the in-process backend vs its floor.

    .venv/bin/python simulations/bench_backends.py [--users 100 1000 10000] [--rounds 3]
        [--ray-max-users 1000] [--grpc-users 0] [--out simulations/results/bench_backends.json]

For each population size n (synthetic logistic data: n users x 20 records, d = 50), this one command
runs the same noisy-GD job (user-level, replace-one, eps = 2, the same seeds, R rounds) through
fedkl's ServerApp code path (``fedkl.flower.server_app.run_flower_simulation``: ledger, filter and noise on the
server) on

* ``inprocess``:    all users as stacked tensors (one batched op per request);
* ``flower-local``: the Flower ServerApp/ClientApp pair over fedkl's deterministic in-process Grid;
* ``flower-sim``:   the same ServerApp on Flower's Ray simulation engine (``num_cpus = 1`` per ClientApp
  actor), each virtual SuperNode holding a block of users (``--users-per-node``, default 0: the auto rule of
  ``fedkl.flower.backends.users_per_node``, about one node per core; 1: one node per user, the numbers of the
  notes below), for n <= ``--ray-max-users``;

and measures the tensor-compute floor of a round (the per-user gradients of all users, clipping and
the sum; nothing else) on the same data. Each (backend, n) runs in its own process. The parent
samples the resident memory of that process tree (every 0.2 s from /proc; the sum over processes,
so pages shared between Ray workers are counted once per process) and keeps the peak. It reports:

  wall s      the whole job (data, federation start-up incl. Ray and the handshake, R rounds, ledger)
  round ms    median seconds of one round as the algorithm sees it (query + release + ledger charge)
  rounds/s    1 / round
  x inproc    round time / the in-process round time (same n, this invocation)
  floor ms    the floor of one round; ``inproc/floor`` = in-process round / floor
  peak MB     peak RSS of the job's process tree
  same model  the released model is bit-for-bit the in-process one (same seeds)

Ray at 10,000 users is not run by default. Each virtual SuperNode message costs tens of ms of Ray
and Flower overhead on this 2-core machine (measured at 1,000 users and printed), so one round of
10,000 messages takes minutes, and the fedkl handshake (one message per user) takes as long again.
The handshake waits at most 120 s (``FlowerFederation``'s default), so the users whose reply
comes later are left out: the run would no longer be the same run. The benchmark prints that
extrapolation from the measured per-message cost. ``--ray-max-users 10000 --backends inprocess
flower-sim`` attempts it anyway. The error column then reports how many users had no node.
``--grpc-users N`` also times the loopback gRPC deployment (one SuperNode process per user, ~260
MB each, so only a handful of users fit here). Results: ``--out`` (JSON), and ``--markdown``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"), ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_k, _v)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RECORDS, DIM = 20, 50
BACKENDS = ("inprocess", "flower-local", "flower-sim")


# --------------------------------------------------------------------------------------------------
# the child: one (backend, n) measurement, printed as one JSON line
# --------------------------------------------------------------------------------------------------
def _floor_seconds(n: int, repeats: int = 5) -> float:
    import torch

    from fedkl.data import load_dataset
    from fedkl.federation.inprocess import clip_rows
    from fedkl.problems import make_problem

    data = load_dataset("synthetic-logistic", n_users=n, m=RECORDS, d=DIM, seed=0)
    problem = make_problem("logistic", data)
    w = torch.zeros(problem.num_params, dtype=problem.dtype)
    train = data.train.to(problem.dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        clip_rows(problem.per_user_gradients(w, train), 1.0)[0].sum(0)
        best = min(best, time.perf_counter() - start)
    return best


USERS_PER_NODE = int(os.environ.get("FEDKL_BENCH_USERS_PER_NODE", "0"))  # the parent's --users-per-node


def measure(backend: str, n: int, rounds: int) -> dict:
    import torch

    from fedkl.flower.codec import ClientSpec
    from fedkl.flower.server_app import run_flower_simulation
    from fedkl.runner import RunConfig

    torch.set_num_threads(1)
    spec = ClientSpec.build("synthetic-logistic", "logistic", {"n_users": n, "m": RECORDS, "d": DIM, "seed": 0})
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig.from_settings(
            dataset="synthetic-logistic",
            users=n,
            rounds=rounds,
            lr=1.0,
            epsilon=2.0,
            noise_seed=0,
            reference=False,
            out=os.path.join(tmp, "run"),
        )
        start = time.perf_counter()
        kw = {}
        if backend == "flower-sim":
            from fedkl.flower.backends import users_per_node

            kw["users_per_node"] = users_per_node(USERS_PER_NODE, backend, n)
        res = run_flower_simulation(cfg, backend, log=lambda s: None, spec=spec, **kw)
        wall = time.perf_counter() - start
    secs = [h["seconds"] for h in res["history"]]
    w = res["w"].to(torch.float64).contiguous().numpy()
    out = {
        "backend": backend,
        "users": n,
        "rounds": rounds,
        "wall_s": wall,
        "round_s": statistics.median(secs),
        "round_s_all": secs,
        "setup_s": wall - sum(secs),
        "model_sha1": hashlib.sha1(w.tobytes()).hexdigest(),
        "epsilon": res["ledger"]["max_user_epsilon"],
        "failed_users": sum(x or 0 for x in res["failed_users"]),
    }
    if backend == "inprocess":
        out["floor_s"] = _floor_seconds(n)
    return out


# --------------------------------------------------------------------------------------------------
# the parent: run the children, sample their memory, print the table
# --------------------------------------------------------------------------------------------------
def _tree_rss_mb(root: int) -> float:
    """Sum of VmRSS over ``root`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            rss[int(proc.name)] = int((proc / "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total / 2**20


def measure_run(backend: str, n: int, rounds: int) -> dict:
    """A whole ``fedkl run`` (``run_training``) on the default synthetic data: for the gRPC deployment."""
    from fedkl.runner import RunConfig, run_training

    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig.from_settings(
            dataset="synthetic-logistic",
            users=n,
            rounds=rounds,
            backend=backend,
            noise_seed=0,
            reference=False,
            out=os.path.join(tmp, "run"),
        )
        start = time.perf_counter()
        res = run_training(cfg, log=lambda s: None)
        wall = time.perf_counter() - start
    return {
        "backend": backend,
        "users": n,
        "rounds": rounds,
        "wall_s": wall,
        "test_metric": res["test_metric"]["value"],
        "epsilon": res["epsilon"],
    }


def run_sampled(cmd: list[str], env: dict, timeout: float) -> tuple[subprocess.CompletedProcess | None, float]:
    """Run ``cmd`` in its own session, sampling the summed RSS of its process tree every 0.2 s, and
    kill the whole session at the end (anything it left behind: Ray's daemons) or at the timeout.
    Returns (the finished process with its text output, or None if it timed out; the peak MB)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], _tree_rss_mb(proc.pid))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: Ray's processes included
        proc.communicate()
        return None, peak[0]
    finally:
        done.set()
        th.join()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything the child left behind (Ray daemons)
    except ProcessLookupError:
        pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), peak[0]


def run_child(backend: str, n: int, rounds: int, timeout: float, mode: str = "--measure") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), mode, backend, str(n), str(rounds)]
    proc, peak = run_sampled(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout)
    if proc is None:
        return {
            "backend": backend,
            "users": n,
            "rounds": rounds,
            "error": f"timed out after {timeout:.0f} s",
            "peak_rss_mb": peak,
        }
    out, err = proc.stdout, proc.stderr
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        text = (err or out).strip().splitlines()
        tail = [ln.strip() for ln in text if "have no node" in ln] + text[-1:]
        return {
            "backend": backend,
            "users": n,
            "rounds": rounds,
            "error": f"exit {proc.returncode}: {'; '.join(tail)}",
            "peak_rss_mb": peak,
        }
    row = json.loads(lines[-1])
    row["peak_rss_mb"] = peak
    return row


def markdown(rows: list[dict], notes: list[str]) -> str:
    lines = [
        "| users | backend | rounds | wall s | round ms | rounds/s | x in-process (round) | floor ms | "
        "in-process / floor | peak MB | same model |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "data" in r:  # whole-run timings (gRPC section)
            lines.append(
                f"| {r['users']:,} | {r['backend']} (whole `fedkl run`) | {r['rounds']} | "
                + (
                    f"{r['wall_s']:.2f} | — | — | {r['ratio_to_inprocess']:.0f} (wall) | — | — | "
                    f"{r['peak_rss_mb']:.0f} | {'yes' if r.get('same_model') else 'no'} |"
                    if "error" not in r
                    else f"— | — | — | — | — | — | {r['peak_rss_mb']:.0f} | {r['error']} |"
                )
            )
            continue
        if "error" in r:
            lines.append(
                f"| {r['users']:,} | {r['backend']} | {r['rounds']} | — | — | — | — | — | — | "
                f"{r['peak_rss_mb']:.0f} | {r['error']} |"
            )
            continue
        floor = f"{1e3 * r['floor_s']:.2f}" if "floor_s" in r else ""
        ratio_floor = f"{r['round_s'] / r['floor_s']:.1f}" if "floor_s" in r else ""
        lines.append(
            f"| {r['users']:,} | {r['backend']} | {r['rounds']} | {r['wall_s']:.2f} | {1e3 * r['round_s']:.2f} | "
            f"{1 / r['round_s']:.2f} | {r.get('ratio_to_inprocess', float('nan')):.1f} | {floor} | {ratio_floor} | "
            f"{r['peak_rss_mb']:.0f} | {'yes' if r.get('same_model') else 'no'} |"
        )
    return "\n".join(lines + [""] + notes) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ray-max-users", type=int, default=1000, help="run flower-sim (Ray) only up to this many users")
    p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=list(BACKENDS),
        help="backends to time (inprocess is the reference of the ratios; default all)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed to one (backend, n) job")
    p.add_argument("--users-per-node", type=int, default=0, help="flower-sim: users per node (0: auto; 1: one each)")
    p.add_argument("--grpc-users", type=int, default=0, help="also time the loopback gRPC deployment at this n (0: no)")
    p.add_argument("--out", default=os.path.join(RESULTS, "bench_backends.json"))
    p.add_argument("--markdown", default=os.path.join(RESULTS, "bench_backends.md"))
    p.add_argument("--measure", nargs=3, metavar=("BACKEND", "N", "ROUNDS"), help=argparse.SUPPRESS)
    p.add_argument("--measure-run", nargs=3, metavar=("BACKEND", "N", "ROUNDS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag, fn in ((args.measure, measure), (args.measure_run, measure_run)):
        if flag:
            print(json.dumps(fn(flag[0], int(flag[1]), int(flag[2]))), flush=True)
            return []
    os.environ["FEDKL_BENCH_USERS_PER_NODE"] = str(args.users_per_node)  # read by the children
    started = time.perf_counter()
    rows: list[dict] = []
    notes: list[str] = []
    print(
        f"{'users':>7} {'backend':>13} {'rounds':>6} {'wall s':>8} {'round ms':>9} {'rounds/s':>9} {'x inproc':>8} "
        f"{'floor ms':>9} {'inproc/floor':>12} {'peak MB':>8} {'same model':>10}",
        flush=True,
    )
    per_message, ray_n = None, 0
    for n in args.users:
        base = None
        for backend in [b for b in BACKENDS if b in args.backends]:
            if backend == "flower-sim" and n > args.ray_max_users:
                if per_message is not None and args.users_per_node == 1:  # the per-message cost of one user per node
                    est_round = per_message * n
                    verdict = (
                        "the handshake would outlast FlowerFederation's 120 s handshake timeout, so the users "
                        "whose reply is late would be left out (they contribute zero): not the same run"
                        if est_round > 120
                        else f"about {(args.rounds + 1) * est_round / 60:.1f} min for the job"
                    )
                    note = (
                        f"flower-sim at {n:,} users: not run (--ray-max-users {args.ray_max_users}). Measured Ray cost "
                        f"per user-message at the largest Ray run ({ray_n:,} users): {1e3 * per_message:.1f} ms; "
                        f"extrapolated linearly (a lower bound: the cost per message grows with n) that is about "
                        f"{est_round:.0f} s per round, and as long again for the fedkl handshake (one message "
                        f"per user): {verdict}. Measure it with --ray-max-users {n} --backends inprocess flower-sim."
                    )
                else:
                    note = f"flower-sim at {n:,} users: not run (--ray-max-users {args.ray_max_users})."
                notes.append(note)
                print(note, flush=True)
                continue
            r = run_child(backend, n, args.rounds, args.timeout)
            if "error" not in r:
                if backend == "inprocess":
                    base = r
                if base is not None:
                    r["ratio_to_inprocess"] = r["round_s"] / base["round_s"]
                    r["same_model"] = r["model_sha1"] == base["model_sha1"]
                if backend == "flower-sim":
                    per_message, ray_n = r["round_s"] / n, n
            rows.append(r)
            if "error" in r:
                print(
                    f"{n:>7} {backend:>13} {args.rounds:>6}  ERROR {r['error']} (peak {r['peak_rss_mb']:.0f} MB)",
                    flush=True,
                )
                continue
            floor = f"{1e3 * r['floor_s']:>9.2f}" if "floor_s" in r else f"{'':>9}"
            ratio = f"{r['round_s'] / r['floor_s']:>12.1f}" if "floor_s" in r else f"{'':>12}"
            print(
                f"{n:>7} {backend:>13} {args.rounds:>6} {r['wall_s']:>8.2f} {1e3 * r['round_s']:>9.2f} "
                f"{1 / r['round_s']:>9.2f} {r.get('ratio_to_inprocess', float('nan')):>8.1f} {floor} {ratio} "
                f"{r['peak_rss_mb']:>8.0f} {'yes' if r.get('same_model') else 'NO':>10}",
                flush=True,
            )
    if args.grpc_users:  # `fedkl run` on the default synthetic data (d = 10): in-process vs the gRPC deployment
        grpc_rows = [
            run_child(b, args.grpc_users, args.rounds, args.timeout, mode="--measure-run")
            for b in ("inprocess", "grpc")
        ]
        for r in grpc_rows:
            r["data"] = "fedkl run --dataset synthetic-logistic (d = 10)"
            if "error" not in r:
                r["ratio_to_inprocess"] = r["wall_s"] / grpc_rows[0]["wall_s"]
                r["same_model"] = r["test_metric"] == grpc_rows[0].get("test_metric")
            print(
                f"fedkl run --backend {r['backend']} --users {args.grpc_users}: "
                + (
                    r["error"]
                    if "error" in r
                    else f"{r['wall_s']:.2f} s ({r['ratio_to_inprocess']:.0f}x in-process), "
                    f"peak {r['peak_rss_mb']:.0f} MB, same test metric: {r['same_model']}"
                ),
                flush=True,
            )
        rows += grpc_rows
    notes.append(
        f"One invocation, {time.perf_counter() - started:.0f} s in all, on {os.cpu_count()} CPU cores; "
        f"synthetic logistic data, {RECORDS} records per user, d = {DIM}; noisy GD, replace-one, eps = 2, "
        f"{args.rounds} rounds; torch single-threaded. Peak MB is the summed RSS of the job's process tree."
    )
    print(notes[-1])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "notes": notes}, fh, indent=2)
    with open(args.markdown, "w") as fh:
        fh.write(markdown(rows, notes))
    print(f"wrote {args.out} and {args.markdown}")
    return rows


if __name__ == "__main__":
    main()
