"""Benchmark: one federation request in-process vs sharded over 1 and 2 Ray actors (``--backend ray-shards``).

    .venv/bin/python simulations/bench_ray_shards.py [--users 10000] [--shards 1 2] [--repeats 5]
        [--out simulations/results/bench_ray_shards.json] [--markdown simulations/results/bench_ray_shards.md]

Synthetic logistic data (n users x 20 records, d = 50, the data of bench_backends.py), torch with one
thread per process, Ray started locally with 2 CPUs (one per shard). For each backend it times the two
request shapes a round is made of (the noise, the ledger charge and the algorithm's own arithmetic run
on the server and are the same on every backend; bench_inprocess.py measures them):

  sum ms       ``federation.sum(ClippedGradient)``: the clipped per-user gradients of all n users, summed
              (noisy GD's round): in-process one batched op; sharded, each shard sums its block and the
              server adds the block sums in shard order;
  rows ms     ``federation.compute(GradientsAtPoints(1 point))``: every user's (d,) row back on the server
              (the per-user answers of paper 002's algorithms), n x d float64 through Ray's object store;
  start s     building the federation (in-process: the data is already loaded; Ray actors: each loads
              the dataset and keeps its block);
  same        rows bit for bit equal to in-process; sums equal to float64 rounding (max |diff| shown).

Times are min / median over ``--repeats`` requests after one warm-up. The machine is shared: read
ratios within one invocation, not absolute numbers across days.

``--interleaved inprocess ray-shards:2 flower-sim`` (issue 33: flower-sim within 5x of ray-shards per round)
instead runs each backend as its own process (its own Ray instance: Flower's simulation engine starts one),
holding its federation open, and asks them one ``sum(ClippedGradient)`` request each in turn, ``--repeats``
times after a warm-up (interleaved, so a load on the machine hits every backend alike). ``flower-sim`` holds
``--users-per-node`` users per simulated node (0: the auto rule of ``fedkl.flower.backends.users_per_node``,
about one node per CPU core; ``flower-sim:1`` is one user per node). Reported: start-up s (federation built,
handshake done), request ms min / median, x in-process and x ray-shards (medians), and whether each total is
the in-process one bit for bit (flower-sim computes with the reproducible kernels, so its total may differ
from the fast in-process total in the last bits: the max abs difference is shown).

``distributed [--users 10000 100000 1000000] [--skip 1000000:flower-sim]`` (issue 33's benchmark table,
simulations/results/bench_distributed.{json,md}): on a local two-raylet cluster (simulations/ray_cluster.py),
for each population the same interleaved processes over in-process, ray-shards:1/2/4 (on the cluster) and
flower-sim (blocks), reading a population file the way ``fedkl run`` does, each round a full request and a
Poisson-cohort request, then the peak RSS of every process (driver, each shard actor, each Ray worker); then
the ledger's cost per round against the cohort size at fixed populations (:func:`ledger_bench`). Run it
under ``nice -n 10``; it takes about 10 minutes here.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS, DIM = 20, 50


def build(n: int, block: range | None = None) -> tuple:
    """``(dataset, problem)``: what every shard (and the in-process reference) computes on (generated
    whole: a shard keeps its ``block``)."""
    from fedkl.data import load_dataset
    from fedkl.problems import make_problem

    data = load_dataset("synthetic-logistic", n_users=n, m=RECORDS, d=DIM, seed=0)
    return data, make_problem("logistic", data)


def timed(fn, repeats: int) -> tuple[list[float], object]:
    out = fn()  # warm-up
    secs = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        secs.append(time.perf_counter() - start)
    return secs, out


def measure(fed, w, point, repeats: int) -> dict:
    from fedkl.federation.base import ClippedGradient, GradientsAtPoints

    sum_s, total = timed(lambda: fed.sum(ClippedGradient(w, 1.0)).total(), repeats)
    rows_s, rows = timed(lambda: fed.compute(GradientsAtPoints(point)).values, repeats)
    return {"sum_s": sum_s, "rows_s": rows_s, "total": total, "rows": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, nargs="+", default=[10_000])
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=os.path.join(RESULTS, "bench_ray_shards.json"))
    p.add_argument("--markdown", default=os.path.join(RESULTS, "bench_ray_shards.md"))
    p.add_argument("--interleaved", nargs="+", metavar="BACKEND", help="inprocess, ray-shards:K, flower-sim[:B]")
    p.add_argument("--serve", nargs=2, metavar=("BACKEND", "N"), help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--ray-address", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), args.file, args.ray_address)
        return {}
    if args.interleaved:
        info = interleaved(args.interleaved, args.users[0], args.repeats)
        table = markdown_interleaved(info)
        _save(args.out.replace("bench_ray_shards", "bench_flower_blocks"), info)
        _write_table(args.markdown.replace("bench_ray_shards", "bench_flower_blocks"), table)
        return info

    import ray
    import torch

    from fedkl.federation.inprocess import InProcessFederation
    from fedkl.federation.ray_shards import RayShardFederation

    torch.set_num_threads(1)
    started = time.perf_counter()
    ray.init(num_cpus=max(2, max(args.shards)), include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for n in args.users:
            data, problem = build(n)
            w = torch.linspace(-0.1, 0.1, problem.num_params, dtype=problem.dtype)
            point = w.unsqueeze(0)
            t0 = time.perf_counter()
            ref_fed = InProcessFederation(problem, data)
            start_s = time.perf_counter() - t0
            ref = {**measure(ref_fed, w, point, args.repeats), "start_s": start_s}
            results = [("inprocess", ref)]
            for k in args.shards:
                t0 = time.perf_counter()
                fed = RayShardFederation(functools.partial(build, n), data.train.user_ids, k)
                start_s = time.perf_counter() - t0
                try:
                    results.append((f"ray-shards x{k}", {**measure(fed, w, point, args.repeats), "start_s": start_s}))
                finally:
                    fed.close()
            for name, r in results:
                rows.append(
                    {
                        "users": n,
                        "backend": name,
                        "start_s": r["start_s"],
                        "sum_ms_min": 1e3 * min(r["sum_s"]),
                        "sum_ms_median": 1e3 * statistics.median(r["sum_s"]),
                        "rows_ms_min": 1e3 * min(r["rows_s"]),
                        "rows_ms_median": 1e3 * statistics.median(r["rows_s"]),
                        "x_inprocess_sum": statistics.median(r["sum_s"]) / statistics.median(ref["sum_s"]),
                        "rows_bit_equal": bool(torch.equal(r["rows"], ref["rows"])),
                        "sum_max_abs_diff": float((r["total"] - ref["total"]).abs().max()),
                    }
                )
    finally:
        ray.shutdown()
    info = {
        "repeats": args.repeats,
        "records_per_user": RECORDS,
        "dim": DIM,
        "cpus": os.cpu_count(),
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    _save(args.out, info)
    _write_table(args.markdown, markdown(info))
    return info


# --- interleaved: one process per backend, asked in turn ------------------------------------------------------
def serve(backend: str, n: int, file: str | None = None, address: str | None = None) -> None:
    """A child: build ``backend``'s federation over ``n`` users, print ``{"start_s"}``, then answer each stdin
    line ``sum`` (every user) or ``cohort SEED`` (a Poisson cohort of rate POP_COHORT / n drawn from SEED,
    the same users on every backend) with one timed request ``{"s", "total"}``, ``stats`` with the peak
    RSS of this process and of the processes it uses (:func:`process_stats`), until ``quit``.
    ``file``: the population file of :func:`write_population` read the way ``fedkl run`` reads it (each
    ray-shards shard only its block; ``address``: the cluster), else the synthetic data of :func:`build`."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from fedkl.federation.base import ClippedGradient

    name, _, arg = backend.partition(":")
    if file:
        import fedkl.flower.backends as fb
        from fedkl.runner import RunConfig, load_run_data

        cfg = RunConfig.from_settings(
            strict=False, dataset=file, user_column="user", label_column="y", algorithm="noisy-gd",
            reference=False, backend=name, shards=int(arg or 2), ray_address=address,
            users_per_node=int(arg or 0) if name == "flower-sim" else 0,
        )  # fmt: skip
        data, problem, _ = load_run_data(cfg)
    else:
        data, problem = build(n)
    w = torch.linspace(-0.1, 0.1, problem.num_params, dtype=problem.dtype)
    t0 = time.perf_counter()
    if name == "inprocess":
        from fedkl.federation.inprocess import InProcessFederation

        fed = InProcessFederation(problem, data)
    elif name == "ray-shards" and file:
        fed = fb._open_ray_shards(cfg, data)
    elif name == "ray-shards":
        from fedkl.federation.ray_shards import RayShardFederation

        fed = RayShardFederation(functools.partial(build, n), data.train.user_ids, int(arg or 2))
    elif name == "flower-sim" and file:
        fed = fb._open("flower-sim")(cfg, data)
    elif name == "flower-sim":
        from fedkl.flower.backends import users_per_node
        from fedkl.flower.codec import ClientSpec
        from fedkl.flower.server_app import start_federation

        upn = users_per_node(int(arg or 0), "flower-sim", n)
        spec = ClientSpec.build("synthetic-logistic", "logistic", {"n_users": n, "m": RECORDS, "d": DIM, "seed": 0})
        fed = start_federation(
            "flower-sim", spec, user_ids=data.train.user_ids, num_params=problem.num_params, users_per_node=upn
        )
    else:
        raise SystemExit(f"unknown backend {backend!r}")
    print(json.dumps({"start_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:1] == ["stats"]:
            print(json.dumps(process_stats(fed)), flush=True)
            continue
        if cmd[:1] not in (["sum"], ["cohort"]):
            break
        users = None
        if cmd[0] == "cohort":  # the same Poisson cohort on every backend (not a private draw: a benchmark's)
            rng = np.random.default_rng(int(cmd[1]))
            users = np.flatnonzero(rng.random(n) < min(1.0, POP_COHORT / n)).tolist()
        t0 = time.perf_counter()
        ans = fed.sum(ClippedGradient(w, 1.0), users)
        secs = time.perf_counter() - t0
        print(json.dumps({"s": secs, "failed": len(ans.failed), "total": ans.total().tolist()}), flush=True)
    if hasattr(fed, "close"):
        fed.close()


def _peak_mb(pid: int | str = "self") -> float | None:
    """A process's peak resident memory (VmHWM, MiB), None if it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(x.split()[1]) / 1024 for x in f if x.startswith("VmHWM:")), None)
    except OSError:
        return None


def process_stats(fed) -> dict:
    """Peak RSS (MiB) per process of a backend: this driver; ray-shards' shard actors (their own
    :meth:`Shard.stats`: pid, node, VmHWM); for a Ray instance this process started (flower-sim's
    simulation engine) every descendant process, the Ray workers (``ray::``) apart from Ray's own
    daemons (GCS, raylet, ...)."""
    from simulations.ray_cluster import _children, _cmdline

    out = {"driver_mb": _peak_mb(), "workers_mb": [], "ray_daemons_mb": 0.0}
    actors = getattr(fed, "actors", None)
    if actors:
        import ray

        stats = ray.get([a.stats.remote() for a in actors])
        out["workers_mb"] = [s["peak_rss_mb"] for s in stats]
        out["worker_nodes"] = len({s["node"] for s in stats})
        return out
    todo, seen = [os.getpid()], []
    while todo:
        for c in _children(todo.pop()):
            seen.append(c)
            todo.append(c)
    for pid in seen:
        mb = _peak_mb(pid)
        if mb is None:
            continue
        if _cmdline(pid).startswith("ray::"):
            out["workers_mb"].append(mb)
        else:
            out["ray_daemons_mb"] += mb
    return out


def interleaved(backends: list[str], n: int, repeats: int, file: str | None = None, address: str | None = None) -> dict:
    """Each backend its own process (:func:`serve`), start-ups one after the other, then ``repeats`` rounds
    of requests asked in turn (who goes first rotates): ``sum`` over every user and, with ``file``, a
    Poisson ``cohort`` of about POP_COHORT users (the same cohort on every backend in a round); then each
    process's peak RSS. A backend whose process fails to start is reported with its error, not timed."""
    import subprocess
    import tempfile

    import numpy as np

    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    procs, rows, errors = {}, {}, {}
    kinds = ["sum", "cohort"] if file else ["sum"]
    try:
        for b in backends:  # start-ups one after the other (each alone on the machine)
            cmd = [sys.executable, os.path.abspath(__file__), "--serve", b, str(n)]
            cmd += ["--file", file] if file else []
            cmd += ["--ray-address", address] if address and b.startswith("ray-shards") else []
            log = tempfile.NamedTemporaryFile("w+", prefix="fedkl-bench-", suffix=".log", delete=False)
            procs[b] = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                start_new_session=True,
            )  # fmt: skip
            try:
                ready = json.loads(_json_line(procs[b]))
            except RuntimeError as exc:
                log.seek(0)
                errors[b] = f"{exc}: {log.read()[-400:].strip()}"
                print(f"{b}: {errors[b]}", flush=True)
                del procs[b]
                continue
            finally:
                log.close()
                os.unlink(log.name)
            rows[b] = {"backend": b, "users": n, "start_s": ready["start_s"], "failed": 0}
            rows[b].update({f"{k}_secs": [] for k in kinds})
            print(f"{b} at {n:,} users: started in {ready['start_s']:.1f} s", flush=True)
        live = [b for b in backends if b in procs]

        def ask(b: str, line: str) -> dict:
            procs[b].stdin.write(line + "\n")
            procs[b].stdin.flush()
            return json.loads(_json_line(procs[b]))

        totals = {b: ask(b, "sum")["total"] for b in live}  # warm-up
        for b in live:
            ask(b, "cohort 0") if file else None
        cohort_totals = {}
        for r in range(repeats):
            order = live[r % len(live) :] + live[: r % len(live)]  # rotate who goes first
            for kind in kinds:
                for b in order:
                    out = ask(b, "sum" if kind == "sum" else f"cohort {r + 1}")
                    rows[b][f"{kind}_secs"].append(out["s"])
                    rows[b]["failed"] += out["failed"]
                    if kind == "cohort" and r == 0:
                        cohort_totals[b] = out["total"]
        for b in live:
            rows[b]["stats"] = ask(b, "stats")
    finally:
        for p in procs.values():
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
                p.wait(timeout=120)
            except Exception:
                import signal

                os.killpg(p.pid, signal.SIGKILL)
    live = [b for b in backends if b in rows]
    ref = next((b for b in live if b.startswith("inprocess")), live[0])
    shards = next((b for b in live if b.startswith("ray-shards")), None)
    med = {b: statistics.median(rows[b]["sum_secs"]) for b in live}
    out = []
    for b in live:
        r = rows[b]
        diff = float(np.abs(np.asarray(totals[b]) - np.asarray(totals[ref])).max())
        row = {
            "users": n,
            "backend": b,
            "start_s": r["start_s"],
            "sum_ms_min": 1e3 * min(r["sum_secs"]),
            "sum_ms_median": 1e3 * med[b],
            "x_inprocess": med[b] / med[ref],
            "x_ray_shards": med[b] / med[shards] if shards else None,
            "failed": r["failed"],
            "sum_max_abs_diff": diff,
            **{k: v for k, v in r.get("stats", {}).items()},
        }
        if file:
            row["cohort_ms_min"] = 1e3 * min(r["cohort_secs"])
            row["cohort_ms_median"] = 1e3 * statistics.median(r["cohort_secs"])
            row["cohort_max_abs_diff"] = float(
                np.abs(np.asarray(cohort_totals[b]) - np.asarray(cohort_totals[ref])).max()
            )
        out.append(row)
    out += [{"users": n, "backend": b, "error": e} for b, e in errors.items()]
    info = {
        "mode": "interleaved",
        "repeats": repeats,
        "records_per_user": POP_RECORDS if file else RECORDS,
        "dim": POP_DIM if file else DIM,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "rows": out,
    }
    return info


def _json_line(proc) -> str:
    for line in proc.stdout:
        if line.startswith("{"):
            return line
    raise RuntimeError(f"the backend process exited ({proc.wait()}) before answering")


def markdown_interleaved(info: dict) -> str:
    lines = [
        "| users | backend | start s | request ms min / med | x in-process | x ray-shards | failed | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in info["rows"]:
        xs = f"{r['x_ray_shards']:.2f}" if r["x_ray_shards"] is not None else "—"
        lines.append(
            f"| {r['users']:,} | {r['backend']} | {r['start_s']:.1f} | {r['sum_ms_min']:.1f} / {r['sum_ms_median']:.1f} "
            f"| {r['x_inprocess']:.2f} | {xs} | {r['failed']} | {r['sum_max_abs_diff']:.1e} |"
        )
    lines.append(
        f"\nOne invocation, interleaved (each backend its own process, asked in turn), {info['seconds']:.0f} s in all, "
        f"on {info['cpus']} CPU cores (load average before {info['load_before'][0]:.1f}); one request = "
        f"sum(ClippedGradient) over every user (noisy GD's round); synthetic logistic data, "
        f"{info['records_per_user']} records per user, d = {info['dim']}; min / median of {info['repeats']} "
        "requests after a warm-up; torch single-threaded per process.\n"
    )
    return "\n".join(lines) + "\n"


# --- population: 10^4 .. 10^6 enrolled users, Poisson cohorts, on a local two-raylet cluster -------------------

POP_RECORDS, POP_DIM, POP_COHORT, POP_ROUNDS = 3, 10, 1000, 4


def write_population(path: str, n: int, seed: int = 0) -> str:
    """A user-partitioned .npz of ``n`` users x POP_RECORDS records, d = POP_DIM features in the unit
    ball, labels from a logistic model: what each shard reads its own block of."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = n * POP_RECORDS
    X = rng.normal(size=(rows, POP_DIM)) / (2 * np.sqrt(POP_DIM))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1))[:, None] * (1 + 1e-9)  # inside the unit ball, rounding included
    w = np.linspace(-3, 3, POP_DIM)
    y = (rng.random(rows) < 1 / (1 + np.exp(-X @ w))).astype(np.int8)
    cols = {f"x{j}": np.ascontiguousarray(X[:, j]) for j in range(POP_DIM)}
    np.savez(path, user=np.repeat(np.arange(n, dtype=np.int64), POP_RECORDS), y=y, **cols)
    return path


def population_one(argv) -> int:
    """One ``fedkl run`` of dp-fedavg (Poisson rate POP_COHORT / n) through ray-shards on ``--address``,
    in this process, timed: prints one JSON line."""
    import resource

    p = argparse.ArgumentParser()
    p.add_argument("--file", required=True)
    p.add_argument("--users", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=POP_ROUNDS)
    p.add_argument("--shards", type=int, default=2)
    args = p.parse_args(argv)

    import ray

    import fedkl.flower.backends  # noqa: F401  (registers ray-shards)
    from fedkl.federation.ray_shards import RayShardFederation
    from fedkl.privacy.journal import ReleaseJournal
    from fedkl.privacy.ledger import PrivacyLedger
    from fedkl.runner import RunConfig, run_training

    asks, ledger_s, journal_s, shard_stats = [], [], [], []

    def timed_method(cls, name, into):
        plain = getattr(cls, name)

        def wrapper(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return plain(self, *a, **kw)
            finally:
                into.append(time.perf_counter() - t0)

        setattr(cls, name, wrapper)

    plain_ask, plain_close, plain_init = RayShardFederation._ask, RayShardFederation.close, RayShardFederation.__init__
    start_s = []

    def init(self, *a, **kw):
        t0 = time.perf_counter()
        plain_init(self, *a, **kw)
        start_s.append(time.perf_counter() - t0)

    def ask(self, query, users, total):
        t0 = time.perf_counter()
        ans = plain_ask(self, query, users, total)
        asks.append({"start": t0, "secs": time.perf_counter() - t0, "cohort": len(ans.users)})
        return ans

    def close(self):
        if getattr(self, "actors", None) and not shard_stats:
            shard_stats.extend(ray.get([a.stats.remote() for a in self.actors]))
        return plain_close(self)

    RayShardFederation._ask, RayShardFederation.close, RayShardFederation.__init__ = ask, close, init
    timed_method(PrivacyLedger, "charge", ledger_s)
    timed_method(ReleaseJournal, "record", journal_s)
    cfg = RunConfig.from_settings(
        strict=False,
        dataset=args.file,
        user_column="user",
        label_column="y",
        algorithm="dp-fedavg",
        neighbouring="add-remove",  # Poisson sampling is accounted under add-remove
        sampling_rate=POP_COHORT / args.users,
        rounds=args.rounds,
        epsilon=2.0,
        reference=False,
        backend="ray-shards",
        shards=args.shards,
        ray_address=args.address,
        out=args.out,
    )
    t0 = time.perf_counter()
    lines = []  # (seconds since the start, the run's log line): where the run's time goes
    result = run_training(cfg, log=lambda s: lines.append((round(time.perf_counter() - t0, 2), s[:100])))
    total = time.perf_counter() - t0
    starts = [a["start"] for a in asks]
    rounds = [b - a for a, b in zip(starts, starts[1:])]  # request to request: the whole round on the server
    print(
        json.dumps(
            {
                "users": args.users,
                "shards": args.shards,
                "rounds": len(asks),
                "cohorts": [a["cohort"] for a in asks],
                "request_s": [a["secs"] for a in asks],
                "round_s": rounds,
                "run_s": total,
                "shards_start_s": start_s[0],
                "ledger_charges_s": ledger_s,
                "journal_records_s": journal_s,
                "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "shards_peak_rss_mb": [s["peak_rss_mb"] for s in shard_stats],
                "shards_train_records": [s["train"] for s in shard_stats],
                "shard_nodes": len({s["node"] for s in shard_stats}),
                "failures": result["failures"]["counts"],
                "epsilon": result.get("epsilon"),
                "log": lines,
            }
        ),
        flush=True,
    )
    return 0


def population(argv=None) -> int:
    """``python simulations/bench_ray_shards.py population [--users 10000 100000 1000000]``: a local
    two-raylet cluster (simulations/ray_cluster.py), then one dp-fedavg run per population size through
    ray-shards (2 shards, one per node), each in its own process (its own peak RSS); the table into
    simulations/results/bench_ray_population.{json,md}."""
    import subprocess
    import tempfile

    from simulations.ray_cluster import LocalCluster

    p = argparse.ArgumentParser(prog="bench_ray_shards.py population")
    p.add_argument("--users", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--rounds", type=int, default=POP_ROUNDS)
    p.add_argument("--out", default=os.path.join(RESULTS, "bench_ray_population.json"))
    p.add_argument("--markdown", default=None, help="default: --out with .md")
    args = p.parse_args(argv)
    args.markdown = args.markdown or os.path.splitext(args.out)[0] + ".md"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedkl-pop-") as tmp, LocalCluster(head_shards=1, worker_shards=1) as cl:
        for n in args.users:
            t0 = time.perf_counter()
            path = write_population(os.path.join(tmp, f"pop{n}.npz"), n)
            write_s = time.perf_counter() - t0
            cmd = [sys.executable, os.path.abspath(__file__), "population-one", "--file", path, "--users", str(n),
                   "--address", cl.address, "--out", os.path.join(tmp, f"run{n}"), "--rounds", str(args.rounds)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
            if out.returncode:
                raise SystemExit(f"population-one {n} failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({**row, "write_file_s": write_s, "file_mb": os.path.getsize(path) / 2**20})
            print(json.dumps(rows[-1]), flush=True)
    info = {
        "records_per_user": POP_RECORDS,
        "dim": POP_DIM,
        "expected_cohort": POP_COHORT,
        "cpus": os.cpu_count(),
        "load": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    _save(args.out, info)
    _write_table(args.markdown, population_markdown(info))
    return 0


def _mm(xs, scale=1.0) -> str:
    return f"{scale * min(xs):.1f} / {scale * statistics.median(xs):.1f}" if xs else "-"


def population_markdown(info: dict) -> str:
    lines = [
        "# ray-shards at 10^4-10^6 enrolled users (Poisson cohorts, local two-raylet cluster)",
        "",
        "| enrolled users | cohort (mean) | round ms min / med | request ms min / med | ledger: up-front charge s "
        "| ledger + journal ms per round min / med | driver peak RSS MiB | shard peak RSS MiB | file MiB "
        "| whole run s (shards' start) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in info["rows"]:
        per_round = r["journal_records_s"]  # dp-fedavg: one journal row per round, no ledger write
        upfront = sum(r["ledger_charges_s"])
        lines.append(
            f"| {r['users']:,} | {statistics.mean(r['cohorts']):.0f} | {_mm(r['round_s'], 1e3)} "
            f"| {_mm(r['request_s'], 1e3)} "
            f"| {upfront:.2f} ({len(r['ledger_charges_s'])} charge) | {_mm(per_round, 1e3)} "
            f"| {r['driver_peak_rss_mb']:.0f} | {' / '.join(f'{m:.0f}' for m in r['shards_peak_rss_mb'])} "
            f"| {r['file_mb']:.0f} | {r['run_s']:.0f} ({r['shards_start_s']:.0f}) |"
        )
    lines.append(
        f"\nOne invocation ({info['seconds']:.0f} s in all; load average {info['load'][0]:.1f} at the end) on "
        f"{info['cpus']} shared CPU cores: a local two-raylet Ray cluster (simulations/ray_cluster.py), 2 shards "
        f"(one per node, each reading only its block of the file); dp-fedavg (logistic, d = {info['dim']}, "
        f"{info['records_per_user']} records per user) with Poisson rate {info['expected_cohort']} / n; a round = "
        "request to request on the server (the cohort's answers, noise, journal). Ledger: dp-fedavg charges its "
        "whole schedule once, up front, to every enrolled user (one transaction); each round then writes one "
        "journal row and nothing to the ledger: its per-round cost is flat in the population. What does grow with n "
        "in a round is the Poisson draw (one secure uniform per enrolled user: 80-230 ms for 10^6 here, measured "
        "apart), not the ledger. The whole run also holds the driver's load of the file, the "
        "PLD calibration of the schedule (dp-accounting) and the result files; the shards' start is each actor "
        "importing torch and reading its block.\n"
    )
    return "\n".join(lines) + "\n"


def markdown(info: dict) -> str:
    lines = [
        "| users | backend | start s | sum ms min / med | x in-process (sum) | rows ms min / med | rows bit-equal | sum max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in info["rows"]:
        lines.append(
            f"| {r['users']:,} | {r['backend']} | {r['start_s']:.1f} | {r['sum_ms_min']:.1f} / {r['sum_ms_median']:.1f} "
            f"| {r['x_inprocess_sum']:.2f} | {r['rows_ms_min']:.1f} / {r['rows_ms_median']:.1f} "
            f"| {'yes' if r['rows_bit_equal'] else 'NO'} | {r['sum_max_abs_diff']:.1e} |"
        )
    lines.append(
        f"\nOne invocation, {info['seconds']:.0f} s in all, on {info['cpus']} CPU cores shared with other jobs; "
        f"synthetic logistic data, {info['records_per_user']} records per user, d = {info['dim']}; "
        f"min / median of {info['repeats']} requests after a warm-up; torch single-threaded per process.\n"
    )
    return "\n".join(lines) + "\n"


# --- distributed: every backend, 10^4 .. 10^6 users, per round and per process; the ledger vs the cohort -------

DIST_BACKENDS = ["inprocess", "ray-shards:1", "ray-shards:2", "ray-shards:4", "flower-sim"]


def distributed(argv=None) -> int:
    """``python simulations/bench_ray_shards.py distributed [--users 10000 100000 1000000] [--skip N:BACKEND ...]``:
    on a local two-raylet cluster (4 + 3 shard slots: ray-shards:1, :2 and :4 live at once), for each
    population a file of :func:`write_population`, then :func:`interleaved` over ``--backends`` (each its
    own process: request times, peak RSS per process), then :func:`ledger_bench`; all into
    simulations/results/bench_distributed.{json,md}."""
    import tempfile

    from simulations.ray_cluster import LocalCluster

    p = argparse.ArgumentParser(prog="bench_ray_shards.py distributed")
    p.add_argument("--users", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--backends", nargs="+", default=DIST_BACKENDS)
    p.add_argument("--skip", nargs="*", default=[], metavar="N:BACKEND", help="e.g. 1000000:flower-sim")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ledger-population", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--cohorts", type=int, nargs="+", default=[100, 1000, 10_000])
    p.add_argument("--ledger-rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(RESULTS, "bench_distributed.json"))
    args = p.parse_args(argv)
    started, load_start = time.perf_counter(), os.getloadavg()
    cpu0 = _cpu_s()
    info = {"cpus": os.cpu_count(), "load_start": load_start, "records_per_user": POP_RECORDS, "dim": POP_DIM}
    info["expected_cohort"], info["repeats"], rows = POP_COHORT, args.repeats, []
    with tempfile.TemporaryDirectory(prefix="fedkl-dist-") as tmp:
        with LocalCluster(head_shards=4, worker_shards=3, nice=10) as cl:
            for n in args.users:
                path = write_population(os.path.join(tmp, f"pop{n}.npz"), n)
                backends = [b for b in args.backends if f"{n}:{b}" not in args.skip]
                part = interleaved(backends, n, args.repeats, file=path, address=cl.address)
                rows += part["rows"] + [{"users": n, "backend": b, "error": "skipped (--skip)"}
                                        for b in args.backends if f"{n}:{b}" in args.skip]  # fmt: skip
                _save(args.out, {**info, "rows": rows})
        info["ledger"] = ledger_bench(args.ledger_population, args.cohorts, args.ledger_rounds, tmp)
    info.update(rows=rows, seconds=time.perf_counter() - started, cpu_s=_cpu_s() - cpu0, load_end=os.getloadavg())
    _save(args.out, info)
    _write_table(os.path.splitext(args.out)[0] + ".md", distributed_markdown(info))
    return 0


def _cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (the cluster's and the backends' processes)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _save(path: str, info: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(info, f, indent=1)


def _write_table(path: str, table: str) -> None:
    """The markdown table next to the JSON, and on stdout."""
    with open(path, "w") as f:
        f.write(table)
    print(table)


def ledger_bench(populations: list[int], cohorts: list[int], rounds: int, tmp: str) -> dict:
    """The ledger's cost per round, by the code a run uses (:class:`PrivacyLedger`, :class:`ReleaseJournal`):

    - per-round charge (noisy-gd with a sampled cohort, DP-FTRL: one ``GaussianCharge`` per round to the
      round's cohort): a ledger of ``N`` enrolled users (each charged once: every user has a row), then
      ``rounds`` charges, each to a fresh random cohort of ``c`` users; the time per charge (one
      transaction, fsync'd);
    - the up-front schedule (dp-fedavg under Poisson sampling): one charge of the whole schedule to all
      ``N`` users (its time, once), then per round one journal row (``record`` + ``flush``: one fsync'd
      transaction) naming the cohort by its digest;
    - the Poisson draw of a round as the schedule makes it (:meth:`PoissonScheduledRun.sample`: one
      secure uniform per enrolled user, ``NoiseSource().uniform(N) < q``).
    """
    import numpy as np

    from fedkl.privacy.charges import GaussianCharge
    from fedkl.privacy.journal import ReleaseJournal
    from fedkl.privacy.ledger import Budget, PrivacyLedger
    from fedkl.privacy.rng import NoiseSource

    rows = []
    for N in populations:
        ids = [f"u{i}" for i in range(N)]
        path = os.path.join(tmp, f"ledger{N}.sqlite")
        with PrivacyLedger(path, Budget(epsilon=1e6, delta=1e-5), run_id="bench") as ledger:
            t0 = time.perf_counter()
            ledger.charge(ids, GaussianCharge(1e-6), label="schedule")  # dp-fedavg's up-front charge
            upfront = time.perf_counter() - t0
            journal = ReleaseJournal.create(os.path.join(tmp, f"journal{N}.sqlite"), {"bench": True})
            rng = np.random.default_rng(N)
            seq = 0
            for c in cohorts:
                if c > N:
                    continue
                charge_s, journal_s = [], []
                for _ in range(rounds + 1):  # the first: warm-up
                    cohort = [ids[i] for i in rng.choice(N, size=c, replace=False)]
                    t0 = time.perf_counter()
                    ledger.charge(cohort, GaussianCharge(1e-6, 1.0), label="round")
                    charge_s.append(time.perf_counter() - t0)
                    seq += 1
                    t0 = time.perf_counter()
                    journal.record(seq, "round", {"rho": 1e-6}, _digest_ids(cohort), np.zeros(POP_DIM + 1))
                    journal.flush()
                    journal_s.append(time.perf_counter() - t0)
                rows.append({"population": N, "cohort": c, "charge_s": charge_s[1:], "journal_s": journal_s[1:],
                             "upfront_charge_s": upfront})  # fmt: skip
        noise = NoiseSource()
        draw_s = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            np.flatnonzero(noise.uniform(N) < POP_COHORT / N).tolist()
            draw_s.append(time.perf_counter() - t0)
        for r in rows:
            if r["population"] == N:
                r["poisson_draw_s"] = draw_s
        print(json.dumps({"ledger population": N, "upfront_s": upfront}), flush=True)
    return {"rounds": rounds, "rows": rows}


def _digest_ids(ids) -> str:
    import hashlib

    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()


def distributed_markdown(info: dict) -> str:
    lines = [
        "# The distributed path, measured: backends per round and per process, the ledger per round",
        "",
        "## Per round and per process (interleaved)",
        "",
        "| users | backend | start s | full round ms min / med | x in-process | x ray-shards:2 "
        "| cohort round ms min / med | driver peak RSS MiB | workers' peak RSS MiB | failed | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_n: dict = {}
    for r in info["rows"]:
        by_n.setdefault(r["users"], []).append(r)
    for n, rs in by_n.items():
        two = next((r for r in rs if r["backend"] == "ray-shards:2" and "error" not in r), None)
        for r in rs:
            if "error" in r:
                lines.append(f"| {n:,} | {r['backend']} | — | not run: {r['error'][:160]} | | | | | | | |")
                continue
            x2 = r["sum_ms_median"] / two["sum_ms_median"] if two else None
            workers = r.get("workers_mb") or []
            wtxt = " / ".join(f"{m:.0f}" for m in workers) if workers else "—"
            if r.get("ray_daemons_mb"):
                wtxt += f" (+ Ray daemons {r['ray_daemons_mb']:.0f})"
            lines.append(
                f"| {n:,} | {r['backend']} | {r['start_s']:.1f} | {r['sum_ms_min']:.1f} / {r['sum_ms_median']:.1f} "
                f"| {r['x_inprocess']:.2f} | {f'{x2:.2f}' if x2 else '—'} "
                f"| {r['cohort_ms_min']:.1f} / {r['cohort_ms_median']:.1f} | {r['driver_mb']:.0f} | {wtxt} "
                f"| {r['failed']} | {max(r['sum_max_abs_diff'], r['cohort_max_abs_diff']):.1e} |"
            )
    lines.append(
        f"\nOne invocation (`nice -n 10 simulations/bench_ray_shards.py distributed`), {info['seconds']:.0f} s wall "
        f"(so at most {2 * info['seconds'] / 60:.0f} CPU minutes; {info['cpu_s']:.0f} s counted by getrusage for "
        f"the processes this one reaped, the cluster's actors not all among them), on {info['cpus']} shared "
        "CPU cores (load average "
        f"{info['load_start'][0]:.1f} at the start, {info['load_end'][0]:.1f} at the end: other jobs ran). Each "
        "backend is its own process holding its federation open; each round every backend is asked in turn "
        "(who goes first rotates): a full round = sum(ClippedGradient) over every user (noisy GD's round); a "
        f"cohort round = the same over a Poisson cohort of rate {info['expected_cohort']} / n (the same users on "
        "every backend). Data: the population file of `write_population` (logistic, "
        f"{info['records_per_user']} records per user, d = {info['dim']}), read as `fedkl run` reads it (each "
        "ray-shards shard reads only its block). ray-shards:K on a local two-raylet cluster "
        "(simulations/ray_cluster.py, one CPU per raylet, 4 + 3 shard slots: K shards spread over both nodes); "
        f"flower-sim: blocks, about one simulated node per core, its own Ray instance. min / median of {info['repeats']} "
        "rounds after a warm-up; torch single-threaded per process. Peak RSS = VmHWM: driver = the process that "
        "holds the federation (it also loads the whole file, as `fedkl run` does); workers = each shard actor "
        "(ray-shards) or each Ray worker of flower-sim's engine. max abs diff: the totals against in-process "
        "(ray-shards and flower-sim compute with the reproducible kernels).\n"
    )
    led = info.get("ledger")
    if led:
        lines += [
            "## The ledger per round vs the cohort, at fixed population",
            "",
            "| enrolled users | cohort | per-round charge ms min / med (noisy-gd with cohorts, DP-FTRL) "
            "| dp-fedavg: up-front charge s (once) | dp-fedavg: journal row ms min / med (per round) "
            f"| Poisson draw ms min / med (rate {info['expected_cohort']} / n) |",
            "|---|---|---|---|---|---|",
        ]
        for r in led["rows"]:
            lines.append(
                f"| {r['population']:,} | {r['cohort']:,} | {_mm(r['charge_s'], 1e3)} | {r['upfront_charge_s']:.2f} "
                f"| {_mm(r['journal_s'], 1e3)} | {_mm(r['poisson_draw_s'], 1e3)} |"
            )
        lines.append(
            f"\nSame invocation, after the backends; {led['rounds']} rounds per cell after a warm-up. A per-round "
            "charge is one PrivacyLedger.charge (one fsync'd SQLite transaction) of a GaussianCharge to a fresh "
            "random cohort, on a ledger where every enrolled user already has a row; dp-fedavg charges its whole "
            "schedule once to every enrolled user (that charge grows with n, once per run) and then writes per "
            "round one ReleaseJournal row (record + flush). The Poisson draw is the schedule's sampler as it is: "
            "one secure uniform per enrolled user per round, linear in n.\n\n"
            "Read: the per-round charge grows with the cohort (one SQLite row update per charged user); at a "
            "fixed cohort it also grows with the population until the cohort's rows sit on distinct pages of the "
            "users table (a rollback-journal copy and an fsync'd write per page touched: at most two pages per "
            "charged user (its table page and its index page), so the cost is bounded by the cohort, not by n; a larger "
            "SQLite page cache did not change it). dp-fedavg's per-round journal row is flat in both; its one up-front charge is linear "
            "in n, once per run.\n"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["population"]:
        sys.exit(population(sys.argv[2:]))
    if sys.argv[1:2] == ["distributed"]:
        sys.exit(distributed(sys.argv[2:]))
    if sys.argv[1:2] == ["population-one"]:
        sys.exit(population_one(sys.argv[2:]))
    main()
