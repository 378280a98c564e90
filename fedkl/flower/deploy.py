"""The ``grpc`` backend: a real Flower deployment on 127.0.0.1, started and torn down per run.

:func:`run_grpc` starts, each in its own process group:

* one ``flower-superlink`` with TLS (a CA and a server certificate for 127.0.0.1 generated for
  this run) and SuperNode authentication (``--enable-supernode-auth``);
* one ``flower-supernode`` per user (``partition-id`` = user position), each with its own EC key
  pair registered with ``flwr supernode register`` before it connects;
* ``flwr run`` of a generated Flower app whose components are ``fedkl.flower.server_app:app`` and
  ``fedkl.flower.client_app:app``, configured by ``fedkl-*`` run-config keys.

The ServerApp (noisy GD, ledger, noise) runs in Flower's ``flwr-serverapp`` process and writes
``flower_result.json`` and ``ledger.sqlite`` under ``out``; every process is killed (SIGTERM, then
SIGKILL, by process group) when the run ends, fails or is interrupted. Offline: it sets
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` and a private ``FLWR_HOME``.

Key material (the run's CA, server and node keys) and the private ``FLWR_HOME`` are deleted when the
run ends, whatever the outcome; a work folder that :func:`run_grpc` created itself is deleted too (a
failed run's logs are first copied to ``<fedkl-out>/grpc-logs/``, and it says so); ``FEDKL_KEEP_WORK=1`` keeps
it (keys deleted), as a ``workdir`` given by the caller is kept. A failed run's error ends with where its ledger
(what it charged before failing, never deleted) and its logs are. One local SuperNode per user costs
about :data:`NODE_MEMORY_BYTES`: a population the machine cannot hold is refused before anything starts
(:func:`local_capacity`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedkl.flower.codec import PATH_KEYS, ClientSpec, absolute_run_config  # noqa: F401  (this module's API too)
from fedkl.flower.federation import STALL_FACTOR, answer_deadline, connect_deadline

REPO = Path(__file__).resolve().parents[2]  # the checkout holding fedkl/ (on the nodes' PYTHONPATH)


# Resident memory of one local SuperNode with its ClientApp process (measured: 41 SuperNodes took
# 9.7 GB on tv16, issue 19), and what the SuperLink, the ServerApp and the OS keep besides.
NODE_MEMORY_BYTES = 240 * 2**20
RESERVED_BYTES = 1536 * 2**20
KEEP_WORK = "FEDKL_KEEP_WORK"  # =1: run_grpc's own temporary work folder is kept (logs, app, bindings; keys deleted)


def _mem_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def local_capacity() -> int:
    """How many local SuperNodes this machine can hold now (available memory / :data:`NODE_MEMORY_BYTES`)."""
    return max(0, (_mem_available_bytes() - RESERVED_BYTES) // NODE_MEMORY_BYTES)


def check_capacity(num_users: int) -> None:
    """ValueError (one line) when ``num_users`` local SuperNodes do not fit this machine."""
    can = local_capacity()
    if num_users > can:
        raise ValueError(
            f"--backend grpc starts one local SuperNode (~{NODE_MEMORY_BYTES / 2**20:.0f} MB) per user: "
            f"{num_users} users do not fit, this machine can hold {can} now; use --backend flower-local or "
            "flower-sim, fewer users (--users), or SuperNodes on their own hosts (docs/how-to/deploy.md)"
        )


def _bin(name: str) -> str:
    cand = Path(sys.executable).with_name(name)
    return str(cand) if cand.exists() else name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float, procs: list) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p, log in procs:
            if p.poll() is not None:
                raise RuntimeError(f"process {p.args[0]} exited with {p.returncode}; see {log}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


CERT_FILES = {"ca": "ca.crt", "cert": "server.pem", "key": "server.key"}  # what make_certificates writes


def _san(host: str):
    """A subjectAltName entry: an IP address where ``host`` is one, else a DNS name."""
    import ipaddress

    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_certificates(folder: Path, hosts: Sequence[str] = (), days: float = 1.0) -> dict[str, Path]:
    """A CA and a SuperLink server certificate signed by it, for 127.0.0.1, localhost and ``hosts`` (the
    names or addresses the SuperLink is reached at; the first is its common name, else 127.0.0.1), valid
    ``days`` (a run's own: 1 day, deleted with the run; ``fedkl deploy certs``: the operator's). Writes
    :data:`CERT_FILES` in ``folder`` (the key 0600; the CA's key is not kept) and returns their paths by
    role: ``flower-superlink --ssl-ca-certfile ca --ssl-certfile cert --ssl-keyfile key``, and ``ca`` as a
    SuperNode's ``--root-certificates`` and the ``flwr`` connection's ``root-certificates``."""

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not (days > 0 and math.isfinite(days)):
        raise ValueError(f"a certificate is valid for a finite number of days > 0, got {days}")
    names = [*hosts, "127.0.0.1", "localhost"] if hosts else ["127.0.0.1", "localhost"]
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedkl run CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in dict.fromkeys(names)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    paths = {role: folder / name for role, name in CERT_FILES.items()}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_secret(
        paths["key"],
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return paths


def _write_secret(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only from the start (0600; an existing file is replaced)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_node_keys(folder: Path, name: str) -> tuple[Path, Path]:
    """An EC (SECP384R1) key pair in OpenSSH format, as SuperNode authentication expects."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    priv, pub = folder / f"{name}.key", folder / f"{name}.pub"
    _write_secret(
        priv,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return priv, pub


def deployment_certificates(
    folder: Path, hosts: Sequence[str] = (), days: float = 365.0, node_keys: int = 0, force: bool = False
) -> dict[str, Path]:
    """``fedkl deploy certs``: :func:`make_certificates` for a real deployment (``hosts``: the coordinator's
    names or addresses; ``days`` valid) and ``node_keys`` SuperNode key pairs (:func:`make_node_keys`,
    ``node-<i>.key``/``.pub``) in ``folder``. An existing file of these is refused (a new CA would lock out every
    node given the old one) unless ``force``; nothing is written then. Returns the paths by role (``ca``,
    ``cert``, ``key``, ``node-<i>``: the private key)."""
    folder = Path(folder)
    names = list(CERT_FILES.values()) + [f"node-{i}.{ext}" for i in range(node_keys) for ext in ("key", "pub")]
    there = [n for n in names if (folder / n).exists()]
    if there and not force:
        raise FileExistsError(f"{folder} already holds {', '.join(there)}: nothing written (--force replaces them)")
    paths = make_certificates(folder, hosts, days)
    for i in range(node_keys):
        paths[f"node-{i}"] = make_node_keys(folder, f"node-{i}")[0]
    return paths


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def _write_app(folder: Path, run_config: Mapping[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "",
        "[project]",
        'name = "fedklrun"',
        'version = "1.0.0"',
        'description = "fedkl over Flower"',
        'license = "Apache-2.0"',
        "dependencies = []",
        "",
        "[tool.hatch.build.targets.wheel]",
        'packages = ["."]',
        "",
        "[tool.flwr.app]",
        'publisher = "fedkl"',
        "",
        "[tool.flwr.app.components]",
        'serverapp = "fedkl.flower.server_app:app"',
        'clientapp = "fedkl.flower.client_app:app"',
        "",
        "[tool.flwr.app.config]",
    ]
    lines += [f"{k} = {_toml_value(v)}" for k, v in run_config.items() if v is not None]
    (folder / "pyproject.toml").write_text("\n".join(lines) + "\n")


def run_config_for(cfg: Any, spec: Any | None = None, out: str | None = None) -> dict[str, Any]:
    """``fedkl-*`` run-config keys for a :class:`fedkl.runner.RunConfig` (and optionally an explicit
    :class:`fedkl.flower.codec.ClientSpec`)."""
    rc = {"fedkl-" + k.replace("_", "-"): v for k, v in cfg.settings().items() if v is not None}
    if out is not None:
        rc["fedkl-out"] = out
    if spec is not None:
        rc.update(spec.to_user_config())
    return rc


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process (Linux /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(d)] = (int(fields[1]), fields[0])
    return out


def processes_of(work: str | Path) -> set[int]:
    """Live processes of the deployment run in ``work``: every process it starts, down to Flower's
    SuperExecs and ClientApps, inherits ``FLWR_HOME=<work>/flwr-home`` (other deployments on the same
    machine have their own)."""
    marker = b"FLWR_HOME=" + str(Path(work) / "flwr-home").encode()
    return {pid for pid, env in _live("environ") if marker in env}


def _live(field: str):
    """``(pid, /proc/<pid>/<field> split at NULs)`` of every live (not zombie) process we can read."""
    for pid, (_, state) in _proc_table().items():
        if state == "Z":
            continue
        try:
            yield pid, Path(f"/proc/{pid}/{field}").read_bytes().split(b"\0")
        except OSError:
            continue


@contextlib.contextmanager
def signals_deferred():
    """Hold Ctrl-C (SIGINT) and SIGTERM back while a child process is started and recorded: one arriving
    while ``Popen`` waits for the child's exec would leave that child running unseen (it then recreated the
    deleted Flower home, ``make stress`` found); it is raised right after, when the child can be stopped.

    Python-level handlers, not a signal mask: a mask holds the signal for this thread only, and a process
    with other threads (gRPC, Ray, torch's pool) would take it on one of those, and Python would still
    raise it here at once. A Python handler always runs in the main thread, so holding it there holds it
    for the process. Off the main thread (no handler can be set there) this does nothing. Yields the list of
    the signals held so far (for a caller or test that waits on one)."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    pending: list[int] = []

    def hold(signum, frame) -> None:
        pending.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield pending
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pending:
            signal.raise_signal(pending[0])  # delivered now to the restored handler (Ctrl-C: KeyboardInterrupt)


def _tree(roots: list[int]) -> set[int]:
    """``roots`` and all their live descendants (Flower's SuperLink/SuperNode start their SuperExec
    detached, in a new session, so killing process groups is not enough)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, []))
    return {p for p in seen if p in table and table[p][1] != "Z"}


def _watchers(pids: set[int]) -> set[int]:
    """Live processes started with ``--parent-pid P`` for P in ``pids`` (Flower's SuperExec): one
    spawned while its parent was being stopped is reparented to init before we can see it as a
    descendant."""
    out = set()
    for pid, args in _live("cmdline"):
        for i, a in enumerate(args[:-1]):
            if a == b"--parent-pid" and args[i + 1].isdigit() and int(args[i + 1]) in pids:
                out.add(pid)
    return out


def stop_processes(
    procs: list[subprocess.Popen], grace: float = 5.0, settle: float = 1.5, work: Path | None = None
) -> None:
    """SIGTERM the processes we started and everything they started (descendants, SuperExecs watching
    one of them, and, given the deployment's ``work`` folder, every Flower process of it: :func:`processes_of`),
    SIGKILL what is left after ``grace``, and keep sweeping until nothing new has appeared for ``settle`` seconds."""
    seen: set[int] = set()

    def flower(pid: int) -> bool:  # never signal a recycled pid that is not a Flower process
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return b"flower-" in cmd or b"flwr-" in cmd or b"flwr" in cmd.split(b"\0")[0]

    def targets() -> set[int]:
        live = {pid for pid in _tree([p.pid for p in procs] + sorted(seen)) if flower(pid)}
        live |= _watchers(seen | live | {p.pid for p in procs})
        if work is not None:  # an orphan of this deployment that neither rule sees (its environment says whose)
            live |= processes_of(work)
        seen.update(live)
        return live

    start = time.monotonic()
    quiet_since = None
    while True:
        for p in procs:
            p.poll()  # reap our direct children
        live = targets()
        if not live:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= settle:
                break
        else:
            quiet_since = None
            sig = signal.SIGTERM if time.monotonic() - start < grace else signal.SIGKILL
            for pid in live:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if time.monotonic() - start > grace + 30:  # pragma: no cover - unkillable (D state)
            raise RuntimeError(f"processes {sorted(live)} survived SIGKILL")
        time.sleep(0.1)
    for p in procs:
        try:
            p.wait(timeout=2)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


def run_grpc(
    run_config: Mapping[str, Any],
    num_users: int,
    *,
    workdir: str | None = None,
    tls: bool = True,
    node_auth: bool = True,
    timeout: float | None = None,
    unregistered: tuple[int, ...] = (),
    connect_timeout: float | None = None,
    node_config: Mapping[int, Mapping[str, Any]] | None = None,
    user_ids: Sequence[str] | None = None,
    log=print,
) -> dict:
    """Run the fedkl app on a fresh local SuperLink + ``num_users`` SuperNodes; return the parsed
    ``flower_result.json`` (plus ``"workdir"``, ``"wall_s"``). ``run_config`` holds the ``fedkl-*``
    keys (see :func:`run_config_for`); ``fedkl-out`` defaults to ``<workdir>/out``.

    ``unregistered``: user positions whose SuperNode starts with a key that was NOT registered (a
    test of SuperNode authentication: the SuperLink must refuse them, so those users fail).
    ``node_config``: extra node-config keys per user position (e.g. a site's own ``data-path``).
    ``user_ids`` (the enrolment, in position order) with ``node_auth``: each user is bound to the node id its
    key was registered under (``fedkl-node-bindings``), so a node claiming another's user is refused alone.
    The run is submitted once every registered SuperNode is online (polled, :func:`wait_online`: it gives up
    when no new node came online for ``connect_timeout``, default :func:`fedkl.flower.federation.connect_deadline`
    of ``num_users``, scaling with the federation);
    ``timeout`` bounds ``flwr run`` (default :func:`run_deadline`). A run whose ServerApp failed raises
    RuntimeError with the ServerApp's one-line reason (``flower_error.json``); any failure's error (its type
    kept) ends with where the run's ledger and logs are (:func:`_kept`)."""
    if num_users < 1:
        raise ValueError("num_users must be >= 1")
    check_capacity(num_users)
    own_work = workdir is None
    rc = absolute_run_config(run_config)  # here, before the work folder exists: the processes run there
    work = Path(workdir or tempfile.mkdtemp(prefix="fedkl-grpc-"))
    work.mkdir(parents=True, exist_ok=True)
    rc.setdefault("fedkl-out", str(work / "out"))
    # deleted at the end: a folder run_grpc made itself, not holding the run's out folder nor its ledger
    temporary = (
        own_work
        and os.environ.get(KEEP_WORK) != "1"
        and not any(
            Path(rc[k]).resolve().is_relative_to(work.resolve()) for k in ("fedkl-out", "fedkl-ledger") if rc.get(k)
        )
    )
    try:
        res = _deploy(
            work,
            rc,
            num_users,
            tls,
            node_auth,
            timeout,
            unregistered,
            connect_timeout,
            dict(node_config or {}),
            user_ids,
            log,
        )
    except Exception as exc:
        raise _kept(exc, _clean_up(work, rc, temporary, False, log), rc) from exc
    except BaseException:  # Ctrl-C: the same clean-up, the interrupt itself goes on
        _clean_up(work, rc, temporary, False, log)
        raise
    _clean_up(work, rc, temporary, True, log)
    res["workdir"] = None if temporary else str(work)
    return res


def _clean_up(work: Path, rc: Mapping[str, Any], temporary: bool, ok: bool, log) -> Path:
    """:func:`run_grpc`'s end, whatever the outcome: the keys and Flower's home deleted; a ``temporary`` work
    folder removed, after a failure once its logs are copied to ``<fedkl-out>/grpc-logs/`` (said in one line).
    Returns where the run's logs are now."""
    for secret in (work / "certs", work / "flwr-home"):  # private keys; Flower's credentials and state
        remove_tree(secret, log)
    if temporary and not ok:  # failed: the logs the user needs, to the run's out folder
        logs = Path(rc["fedkl-out"]) / "grpc-logs"
        logs.mkdir(parents=True, exist_ok=True)
        for f in work.glob("*.log"):
            shutil.copy2(f, logs / f.name)
        gone = remove_tree(work, log)
        log(f"fedkl grpc: the run failed; its logs are in {logs}" + ("" if gone else f" and {work}"))
        return logs
    if temporary:
        remove_tree(work, log)
    elif not ok:
        log(f"fedkl grpc: the run failed; its logs are in {work} (keys deleted)")
    return work


def _kept(exc: Exception, logs: Path, rc: Mapping[str, Any]) -> Exception:
    """``exc`` (its type kept where it can be) with where the failed run's ledger and logs are, in its one line:
    what was charged before the failure stays on the ledger, and the logs say why."""
    ledger = Path(rc.get("fedkl-ledger") or Path(rc["fedkl-out"]) / "ledger.sqlite")
    kept = f"its ledger is {ledger}" if ledger.exists() else f"no ledger was written ({ledger}: nothing charged)"
    message = f"{exc}; {kept}; its logs are in {logs}"
    try:
        return type(exc)(message)
    except Exception:  # noqa: BLE001  (an exception type that takes other arguments)
        return RuntimeError(message)


def stream(args: list[str], logfile: Path, limit: float, log, env: Mapping[str, str] | None = None) -> None:
    """Run ``args`` (``flwr run --stream``) writing its output to ``logfile`` and passing the ServerApp's
    progress lines (:data:`fedkl.flower.server_app.PROGRESS`, with an ETA) to ``log`` as they come; the run's
    start (its ledger run: :func:`fedkl.flower.server_app.run_started`) also to this process's run observer.
    RuntimeError (one line) if it exits non-zero or has not finished after ``limit`` seconds (then killed)."""
    from fedkl.flower.server_app import PROGRESS, run_started
    from fedkl.runner import RUN_OBSERVER

    with open(logfile, "w") as f:
        with signals_deferred():
            p = subprocess.Popen(
                args,
                env=env,
                cwd=logfile.parent,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        timer = threading.Timer(limit, p.kill)
        timer.start()
        try:
            for line in p.stdout:
                f.write(line)
                f.flush()
                if line.startswith(PROGRESS):
                    log(line.rstrip("\n"))
                    started, observer = run_started(line), RUN_OBSERVER.get()
                    if started is not None and observer is not None:  # the ServerApp's ledger run (Ctrl-C says it)
                        observer.started(*started)
            rc = p.wait()
        finally:
            expired = not timer.is_alive()
            timer.cancel()
            if p.poll() is None:  # interrupted (Ctrl-C): do not leave it behind
                p.kill()
                p.wait()
    if expired and rc != 0:
        raise RuntimeError(
            f"{Path(args[0]).name} {args[1]} did not finish within {limit:.0f} s (killed); see {logfile}"
        )
    if rc != 0:
        raise RuntimeError(f"{Path(args[0]).name} {args[1]} failed ({rc}); see {logfile}")


def remove_tree(path: Path, log, tries: int = 5) -> bool:
    """Delete ``path`` (a folder), retrying while something still writes into it; a folder that cannot be
    deleted is said in one line through ``log``, never ignored. True when it is gone."""
    for _ in range(tries):
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            error = exc
            time.sleep(0.2)
            continue
        if not path.exists():
            return True
        error = OSError(f"{path} reappeared")
    log(f"fedkl grpc: could not delete {path} ({error}); delete it by hand")
    return False


def wait_online(online, expected: int, quiet: float, where: str = "", clock: Any = time) -> float:
    """Poll ``online()`` (how many SuperNodes are online) until it reaches ``expected``; returns the seconds
    waited. The deadline follows progress: TimeoutError once no new node came online for ``quiet`` seconds
    (SuperNodes starting on a loaded machine come online one by one, late but steadily), so the wait is at
    most ``expected`` x ``quiet`` in all."""
    start = last = clock.monotonic()
    best = -1
    while True:
        n = online()
        now = clock.monotonic()
        if n >= expected:
            return now - start
        if n > best:
            best, last = n, now
        if now - last > quiet:
            raise TimeoutError(
                f"only {n} of {expected} SuperNodes online after {now - start:.0f} s "
                f"(none new for {now - last:.0f} s){'; ' + where if where else ''}"
            )
        clock.sleep(0.5)


def run_deadline(num_users: int) -> float:
    """Default seconds for ``flwr run`` of ``num_users`` local SuperNodes: the longest handshake wait
    (:data:`~fedkl.flower.federation.STALL_FACTOR` x :func:`~fedkl.flower.federation.answer_deadline`) plus
    600 + 30 per user (their ClientApps start concurrently on this machine; the run returns when it is done)."""
    return STALL_FACTOR * answer_deadline(num_users) + 600.0 + 30.0 * num_users


def read_outcome(out: Path, run_log: Path) -> dict:
    """The ServerApp's ``flower_result.json`` in ``out``; RuntimeError with its one-line reason where it
    wrote ``flower_error.json`` (``flwr run`` exits 0 when the ServerApp fails), or when it wrote neither."""
    if (out / "flower_error.json").exists():
        raise RuntimeError(
            f"the fedkl ServerApp failed: {json.loads((out / 'flower_error.json').read_text())['error']}"
        )
    if not (out / "flower_result.json").exists():
        raise RuntimeError(f"the run ended without {out / 'flower_result.json'}; see {run_log}")
    return json.loads((out / "flower_result.json").read_text())


def _deploy(
    work: Path,
    rc: dict,
    num_users: int,
    tls: bool,
    node_auth: bool,
    timeout: float,
    unregistered: tuple[int, ...],
    connect_timeout: float | None,
    node_config: dict,
    user_ids: Sequence[str] | None,
    log,
) -> dict:
    """The body of :func:`run_grpc` in ``work``: start, submit, collect; every process stopped on exit."""
    home = work / "flwr-home"
    home.mkdir(exist_ok=True)
    port = _free_port()
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    }
    conn = ["[superlink]", 'default = "fedkl"', "", "[superlink.fedkl]", f'address = "127.0.0.1:{port}"']
    link_tls: list[str] = ["--insecure"]
    node_tls: list[str] = ["--insecure"]
    if tls:
        certs = make_certificates(work / "certs")
        link_tls = [
            "--ssl-ca-certfile",
            str(certs["ca"]),
            "--ssl-certfile",
            str(certs["cert"]),
            "--ssl-keyfile",
            str(certs["key"]),
        ]
        node_tls = ["--root-certificates", str(certs["ca"])]
        conn.append(f'root-certificates = "{certs["ca"]}"')
    else:
        conn.append("insecure = true")
    (home / "config.toml").write_text("\n".join(conn) + "\n")
    procs: list[tuple[subprocess.Popen, Path]] = []

    def start(args: list[str], name: str) -> subprocess.Popen:
        logf = work / f"{name}.log"
        with open(logf, "wb") as f, signals_deferred():
            p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work)
            procs.append((p, logf))
        return p

    def cli(args: list[str], limit: float) -> str:
        with signals_deferred():
            p = subprocess.Popen(
                [_bin("flwr"), *args],
                env=env,
                cwd=work,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        try:
            out, err = p.communicate(timeout=limit)
        finally:
            if p.poll() is None:  # timed out or interrupted: never leave it running
                p.kill()
                p.wait()
        if p.returncode == -signal.SIGINT:  # Ctrl-C reached it (a terminal's whole process group): an interrupt
            raise KeyboardInterrupt
        if p.returncode != 0:
            raise RuntimeError(f"flwr {' '.join(args[:2])} failed ({p.returncode}): {out[-2000:]}{err[-2000:]}")
        return out

    try:
        start(
            [
                _bin("flower-superlink"),
                *link_tls,
                *(["--enable-supernode-auth"] if node_auth else []),
                "--disable-runtime-dependency-installation",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            "superlink",
        )
        _wait_port(port, connect_deadline(1), procs)
        bindings: dict[str, int] = {}
        for u in range(num_users):
            auth: list[str] = []
            if node_auth:
                priv, pub = make_node_keys(work / "certs", f"node-{u}")
                if u not in unregistered:
                    reg = cli(["supernode", "register", str(pub), "fedkl", "--format", "json"], 120)
                    if user_ids is not None:
                        bindings[str(user_ids[u])] = int(
                            json.loads(reg[reg.index("{") : reg.rindex("}") + 1])["node-id"]
                        )
                auth = ["--auth-supernode-private-key", str(priv)]
            start(
                [
                    _bin("flower-supernode"),
                    *node_tls,
                    *auth,
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--node-config",
                    " ".join(
                        [f"partition-id={u} num-partitions={num_users}"]
                        + [f"{k}={_toml_value(v)}" for k, v in node_config.get(u, {}).items()]
                    ),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(_free_port()),
                ],
                f"supernode-{u}",
            )
        log(
            f"fedkl grpc: SuperLink on 127.0.0.1:{port} ({'TLS' if tls else 'insecure'}, "
            f"{'SuperNode auth' if node_auth else 'no node auth'}), {num_users} SuperNodes; logs in {work}"
        )
        if bindings:
            (work / "node-bindings.json").write_text(json.dumps(bindings))
            rc["fedkl-node-bindings"] = str(work / "node-bindings.json")
        _write_app(work / "app", rc)
        expected = num_users - (len(set(unregistered)) if node_auth else 0)
        connect_timeout = connect_deadline(num_users) if connect_timeout is None else connect_timeout

        def online() -> int:
            if procs[0][0].poll() is not None:
                raise RuntimeError(f"the SuperLink exited with {procs[0][0].returncode}; see {procs[0][1]}")
            nodes = json.loads(cli(["supernode", "list", "fedkl", "--format", "json"], 60)).get("nodes", [])
            return sum(1 for nd in nodes if nd.get("status") == "online")

        wait_online(online, expected, connect_timeout, f"see {work}")
        start_t = time.monotonic()
        for stale in ("flower_result.json", "flower_error.json"):  # a previous run's in the same folder
            (Path(rc["fedkl-out"]) / stale).unlink(missing_ok=True)
        limit = run_deadline(num_users) if timeout is None else timeout
        stream([_bin("flwr"), "run", str(work / "app"), "fedkl", "--stream"], work / "flwr-run.log", limit, log, env)
        res = read_outcome(Path(rc["fedkl-out"]), work / "flwr-run.log")
        res["wall_s"] = time.monotonic() - start_t
        return res
    finally:
        stop_processes([p for p, _ in procs], work=work)


def train_over_grpc(cfg: Any, dataset: Any, out: str, log=print, recover: str | None = None, **kw: Any) -> Any:
    """``fedkl run --backend grpc``: train ``cfg`` on a fresh local deployment (:func:`run_grpc`, one
    SuperNode per user of ``dataset``); the ServerApp writes the ledger at ``cfg.ledger`` or
    ``<out>/ledger.sqlite`` and its release journal in ``out``; ``recover``: the out folder of a run whose
    ServerApp died, recovered by this one (``fedkl-recover``; ``fedkl run --backend grpc --recover``). Returns
    the :class:`fedkl.runner.Trained` the ServerApp recorded (``flower_result.json``), which this process writes
    its run files from (:func:`fedkl.runner.write_run_files`, the one writer)."""
    spec = ClientSpec.from_run_config(cfg, task=dataset.task)
    ids = dataset.train.user_ids
    rc = run_config_for(cfg, spec, out=out)
    if recover is not None:
        rc["fedkl-recover"] = recover
    res = run_grpc(rc, len(ids), user_ids=ids, log=log, **kw)
    if res.get("replayed") is not None:
        log(f"fedkl grpc: the ServerApp recovered {recover}: {res['replayed']} releases replayed from its journal")
    from fedkl.runner import Trained

    return Trained.from_record(res)
