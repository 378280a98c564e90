"""A local two-raylet Ray cluster on this machine, standing in for two nodes (``make ray-cluster-demo``;
tests/federation/test_ray_cluster.py loads this file by path; simulations/bench_ray_shards.py runs on it).

    python simulations/ray_cluster.py demo     # start the cluster, a short `fedkl run --backend ray-shards` on it, stop

:class:`LocalCluster` starts a head (``ray start --head --block``) and one worker raylet
(``ray start --address HEAD --block``), each with its own small resources (``--num-cpus``,
``--object-store-memory`` and ``fedkl_shards``: how many ray-shards shards the node may host,
:data:`fedkl.federation.ray_shards.SHARD_RESOURCE`), in a temp dir of its own. Every wait is on an
event, polled with a deadline (the head's address file appears; the GCS lists both nodes alive), never
a fixed sleep. :meth:`LocalCluster.stop` ends only what this cluster started, by process id: each
``ray start --block`` process gets SIGTERM (it stops its own raylet, GCS, ...), then every process still
alive whose command line names the cluster's temp dir gets SIGKILL. It never runs ``ray stop`` (which
ends every Ray process of the user on the machine, other people's clusters included).

Node death is detected fast: the head's GCS runs with ``RAY_health_check_period_ms=500`` and a
failure threshold of 4 (about 2 s instead of Ray's 15 s), so a worker raylet killed mid-round is
declared dead, and its shards restarted elsewhere, within seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
HEALTH_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4"}


def _ray_bin() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "ray")
    return cand if os.path.exists(cand) else (shutil.which("ray") or "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(name))
    return out


def wait_for(what: str, check, timeout: float, every: float = 0.2):
    """Poll ``check()`` until it returns something truthy (returned); TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"local Ray cluster: {what} not seen within {timeout:g} s")
        time.sleep(every)


class LocalCluster:
    """A head and one worker raylet on this machine (see the module docstring); a context manager."""

    def __init__(
        self,
        head_shards: int = 2,
        worker_shards: int = 1,
        num_cpus: int = 1,
        object_store_mb: int = 80,
        timeout: float = 240.0,
        nice: int = 0,
    ) -> None:
        self.head_shards, self.worker_shards = head_shards, worker_shards
        self.num_cpus, self.object_store = num_cpus, object_store_mb * 2**20
        self.timeout, self.nice = timeout, nice
        self.temp_dir = tempfile.mkdtemp(prefix="fkr-", dir="/tmp")  # short: Ray's socket paths have a length limit
        self.procs: dict[str, subprocess.Popen] = {}
        self.address: str | None = None

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        cmd = [_ray_bin(), "start", "--block", f"--temp-dir={self.temp_dir}", "--disable-usage-stats", *args]
        if self.nice:
            cmd = ["nice", "-n", str(self.nice), *cmd]
        log = open(os.path.join(self.temp_dir, f"{name}.log"), "w")
        env = {**os.environ, **HEALTH_ENV}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def _resources(self, shards: int) -> list[str]:
        return [
            f"--num-cpus={self.num_cpus}",
            f"--object-store-memory={self.object_store}",
            "--resources=" + json.dumps({"fedkl_shards": shards}),
        ]

    def start(self) -> "LocalCluster":
        """Start the head, wait for its address, start the worker, wait until the GCS lists 2 alive nodes."""
        try:
            port = _free_port()
            head = self._start(
                "head", ["--head", f"--port={port}", "--include-dashboard=false", *self._resources(self.head_shards)]
            )

            def head_up():
                if head.poll() is not None:
                    raise RuntimeError(f"ray start --head exited ({head.returncode}): {self.log('head')}")
                path = os.path.join(self.temp_dir, "ray_current_cluster")
                return open(path).read().strip() if os.path.exists(path) else None

            self.address = wait_for("the head's address file", head_up, self.timeout)
            self._start("worker", [f"--address={self.address}", *self._resources(self.worker_shards)])
            self.wait_nodes(2)
        except BaseException:
            self.stop()
            raise
        return self

    def alive_nodes(self) -> list[dict]:
        """The GCS's alive nodes (a short-lived driver connection when this process has none)."""
        import ray

        connected = ray.is_initialized()
        if not connected:
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
        try:
            return [n for n in ray.nodes() if n["Alive"]]
        finally:
            if not connected:
                ray.shutdown()

    def wait_nodes(self, n: int) -> list[dict]:
        import ray

        connected = ray.is_initialized()
        if not connected:
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
        try:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"ray start ({name}) exited ({proc.returncode}): {self.log(name)}")
            return wait_for(
                f"{n} alive nodes",
                lambda: (lambda a: a if len(a) == n else None)([x for x in ray.nodes() if x["Alive"]]),
                self.timeout,
            )
        finally:
            if not connected:
                ray.shutdown()

    def raylet_pid(self, name: str = "worker") -> int:
        """The raylet process of node ``name`` (a child of its ``ray start --block``)."""
        pids = [p for p in _children(self.procs[name].pid) if "raylet/raylet" in _cmdline(p)]
        if len(pids) != 1:
            raise RuntimeError(f"expected one raylet under ray start ({name}), found {pids}")
        return pids[0]

    def node_id(self, name: str = "worker") -> str:
        """The Ray node id of node ``name`` (its raylet's ``--node_id``)."""
        for arg in _cmdline(self.raylet_pid(name)).split():
            if arg.startswith("--node_id="):
                return arg.split("=", 1)[1]
        raise RuntimeError(f"no --node_id on the {name} raylet's command line")

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.temp_dir, f"{name}.log")) as f:
                return " | ".join(f.read().strip().splitlines()[-5:])
        except OSError:
            return ""

    def ours(self) -> list[int]:
        """Every live process whose command line names this cluster's temp dir (what it started)."""
        me = os.getpid()
        return [
            int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me and self.temp_dir in _cmdline(int(p))
        ]

    def stop(self) -> None:
        """SIGTERM each ``ray start --block`` (it ends its node's processes), wait for them, then SIGKILL
        any process of this cluster still alive; remove the temp dir. Idempotent."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            wait_for("the cluster's processes ending", lambda: not self.ours(), 20)
        except TimeoutError:
            for pid in self.ours():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.procs = {}
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def demo(argv: list[str] | None = None) -> int:
    """Start the cluster, run a short `fedkl run --backend ray-shards --shards 2` on it, stop it."""
    p = argparse.ArgumentParser(prog="python simulations/ray_cluster.py demo")
    p.add_argument("--users", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="the run folder (default: fedkl run's, a new one under runs/)")
    args = p.parse_args(argv)
    fedkl = os.path.join(os.path.dirname(sys.executable), "fedkl")
    t0 = time.monotonic()
    with LocalCluster() as cluster:
        print(f"local Ray cluster at {cluster.address}: {len(cluster.alive_nodes())} nodes alive "
              f"({time.monotonic() - t0:.1f} s)", flush=True)  # fmt: skip
        cmd = [fedkl, "run", "--dataset", "synthetic-logistic", "--users", str(args.users), "--no-reference",
               "--backend", "ray-shards", "--shards", "2", "--ray-address", cluster.address,
               "--rounds", str(args.rounds), *(["--out", args.out] if args.out else [])]  # fmt: skip
        print("$ " + " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, cwd=REPO)
    print(f"cluster stopped ({time.monotonic() - t0:.1f} s in all)")
    return rc


if __name__ == "__main__":
    if sys.argv[1:2] != ["demo"]:
        sys.exit("usage: python simulations/ray_cluster.py demo [--users N] [--rounds R] [--out DIR]")
    sys.exit(demo(sys.argv[2:]))
