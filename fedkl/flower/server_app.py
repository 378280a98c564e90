"""Flower ServerApp for fedkl: any fedkl algorithm, unchanged, over a Flower federation.

The ledger, the privacy filter/accountant and the noise stay on the server; the clients only
compute clipped per-user answers (``fedkl/flower/client_app.py``).

Entry points:

* :func:`open_federation` -- a context manager yielding a :class:`fedkl.federation.base.Federation`
  for a backend: ``"inprocess"`` (the given in-process federation), ``"flower-local"`` (the
  deterministic in-process :class:`~fedkl.flower.localgrid.LocalGrid` + ClientApp) or
  ``"flower-sim"`` (Flower's simulation runtime on Ray, ``run_simulation``). It is used from the
  caller's thread, so an algorithm, its Releaser and its SQLite ledger run exactly as with the
  in-process backend (for ``flower-sim`` the ServerApp's main, which Flower runs in its own thread,
  only relays Grid calls for the caller).
* :func:`start_federation` -- the same, returned open (``close()`` it), for ``build_federation``.
* :func:`run_flower_simulation` -- a training (any registered algorithm, ``fedkl.algorithms.catalog``)
  over a backend, with its ledger; no evaluation.
* ``app`` -- the ServerApp for deployments (``flwr run`` / SuperLink; see ``fedkl/flower/deploy.py`` for
  the local TLS + SuperNode-auth deployment): it reads the ``fedkl-*`` run-config keys (see
  :func:`_run_config_from_user_config`), trains with the ledger and noise in its own process and
  writes ``flower_result.json`` next to the ledger.
"""

from __future__ import annotations

import os

for _k, _v in (("FLWR_TELEMETRY_ENABLED", "0"), ("FLWR_DISABLE_UPDATE_CHECK", "1"), ("RAY_USAGE_STATS_ENABLED", "0")):
    os.environ.setdefault(_k, _v)

import contextlib  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from fedkl import runner  # noqa: E402
from fedkl.data import load_dataset  # noqa: E402
from fedkl.federation.base import Federation  # noqa: E402
from fedkl.federation.inprocess import InProcessFederation  # noqa: E402
from fedkl.flower.client_app import make_client_app  # noqa: E402
from fedkl.flower.codec import ClientSpec  # noqa: E402
from fedkl.flower.federation import FlowerFederation  # noqa: E402
from fedkl.flower.localgrid import LocalGrid  # noqa: E402
from fedkl.problems import make_problem, problem_spec  # noqa: E402
from fedkl.results import write_json  # noqa: E402
from fedkl.runner import RunConfig  # noqa: E402

BACKENDS = ("inprocess", "flower-local", "flower-sim")
RAY_BACKEND_CONFIG = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"include_dashboard": False}}


def make_server_app(main: Callable[[Grid, Context], None]) -> ServerApp:
    app = ServerApp()
    app.main()(main)
    return app


# --- flower-sim: the ServerApp relays Grid calls made from the caller's thread ------------------
_STOP = object()


class _RelayGrid:
    """A Grid stand-in for the caller's thread: each call is executed by the ServerApp's main (in
    Flower's server thread) on the real Grid, and its result handed back."""

    def __init__(self) -> None:
        self.calls: queue.Queue = queue.Queue()
        self.failed: BaseException | None = None

    def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        if self.failed is not None:
            raise RuntimeError("the Flower simulation stopped") from self.failed
        box: queue.Queue = queue.Queue(maxsize=1)
        self.calls.put((name, args, kw, box))
        while True:
            try:
                ok, value = box.get(timeout=1.0)
                break
            except queue.Empty:
                if self.failed is not None:
                    raise RuntimeError("the Flower simulation stopped") from self.failed
        if not ok:
            raise value
        return value

    def get_node_ids(self) -> list[int]:
        return self._call("get_node_ids")

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Any]:
        return self._call("send_and_receive", list(messages), timeout=timeout)

    def push_messages(self, messages: Any) -> list[str]:
        return self._call("push_messages", list(messages))

    def pull_messages(self, message_ids: Any) -> list[Any]:
        return self._call("pull_messages", list(message_ids))

    def serve(self, grid: Grid) -> None:
        """The ServerApp's main: relay calls until stopped."""
        while True:
            item = self.calls.get()
            if item is _STOP:
                return
            name, args, kw, box = item
            try:
                out = getattr(grid, name)(*args, **kw)
                box.put((True, list(out)))
            except BaseException as exc:  # handed to the caller
                box.put((False, exc))


@contextlib.contextmanager
def _simulation(
    client_app: Any, num_nodes: int, backend_config: dict | None = None, start_timeout: float = 300.0
) -> Iterator[_RelayGrid]:
    from flwr.simulation import run_simulation

    relay = _RelayGrid()
    started = threading.Event()

    def main(grid: Grid, context: Context) -> None:
        started.set()
        relay.serve(grid)

    def runner() -> None:
        try:
            run_simulation(
                server_app=make_server_app(main),
                client_app=client_app,
                num_supernodes=num_nodes,
                backend_name="ray",
                backend_config=json.loads(json.dumps(backend_config or RAY_BACKEND_CONFIG)),
            )
        except BaseException as exc:
            relay.failed = exc
        finally:
            relay.failed = relay.failed or RuntimeError("the Flower simulation ended")
            started.set()

    th = threading.Thread(target=runner, name="fedkl-flower-sim", daemon=True)
    th.start()
    try:
        if not started.wait(start_timeout) or (relay.failed is not None and not th.is_alive()):
            raise RuntimeError("the Flower simulation did not start") from relay.failed
        yield relay
    finally:
        relay.calls.put(_STOP)
        th.join(timeout=120)
        if th.is_alive():  # pragma: no cover - Ray refused to stop
            raise RuntimeError("the Flower simulation did not stop within 120 s")


@contextlib.contextmanager
def open_federation(
    backend: str,
    spec: ClientSpec | None = None,
    *,
    user_ids: Sequence[str] | None = None,
    num_users: int | None = None,
    inprocess: Federation | None = None,
    timeout: float | None = None,
    secagg: bool = False,
    num_params: int | None = None,
    users_per_node: int = 1,
    **grid_kw: Any,
) -> Iterator[Federation]:
    """A federation over ``backend`` (see the module docstring), closed on exit.

    ``inprocess`` is what ``"inprocess"`` yields (and where ``user_ids`` default from); ``spec``
    says which dataset/problem the clients load; ``grid_kw`` goes to :class:`LocalGrid` (faults);
    ``secagg``: sums through SecAgg+ (:mod:`fedkl.flower.secagg`); ``num_params``: the server's model
    size (a node answering for another is refused alone, :class:`FlowerFederation`); ``users_per_node``: each
    simulated node holds a block of that many users (:class:`fedkl.flower.client_app.BlockWorker`; 1: one per node).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "inprocess":
        if inprocess is None:
            raise ValueError("backend 'inprocess' needs the in-process federation")
        yield inprocess
        return
    if spec is None:
        raise ValueError(f"backend {backend!r} needs a ClientSpec")
    if user_ids is None and inprocess is not None:
        user_ids = inprocess.user_ids
    n = len(user_ids) if user_ids is not None else num_users
    if n is None:
        raise ValueError("give user_ids or num_users")
    if users_per_node > 1 and secagg:
        raise ValueError("--secagg needs one user per node (SecAgg+ masks per node): run with --users-per-node 1")
    block = users_per_node if users_per_node > 1 else None
    client_app = make_client_app(spec, torch_threads=1 if backend == "flower-sim" else None, users_per_node=block)
    n_nodes = n if block is None else -(-n // block)
    if backend == "flower-local":
        # a LocalGrid's nodes are all there at once: never wait for absent ones
        yield FlowerFederation(
            LocalGrid(client_app, n_nodes, **grid_kw),
            user_ids=user_ids,
            num_users=n,
            timeout=timeout,
            wait_for_nodes=0.0,
            secagg=secagg,
            num_params=num_params,
        )
        return
    with _simulation(client_app, n_nodes, grid_kw.get("backend_config")) as relay:
        yield FlowerFederation(
            relay, user_ids=user_ids, num_users=n, timeout=timeout, secagg=secagg, num_params=num_params
        )


def start_federation(backend: str, spec: ClientSpec, **kw: Any) -> FlowerFederation:
    """Like :func:`open_federation` for a Flower backend, but returns the open federation; call
    its ``close()`` (or use it in a ``with``) to stop the runtime (also done at interpreter exit)."""
    import atexit

    if backend not in ("flower-local", "flower-sim"):
        raise ValueError(f"start_federation serves the Flower backends, not {backend!r}")
    stack = contextlib.ExitStack()
    fed = stack.enter_context(open_federation(backend, spec, **kw))
    fed.on_close(stack.close)
    atexit.register(fed.close)
    return fed


# --- noisy GD over Flower, end to end -----------------------------------------------------------
def run_flower_simulation(
    cfg: Any,
    backend: str = "flower-local",
    log: Callable[[str], None] = print,
    *,
    spec: ClientSpec | None = None,
    **open_kw: Any,
) -> dict:
    """Train ``cfg`` (a :class:`fedkl.runner.RunConfig`, noisy-gd) over a Flower backend
    (``"flower-local"`` or ``"flower-sim"``; ``open_kw`` goes to :func:`open_federation`), or over
    ``"inprocess"`` through the same code (the reference the Flower backends are tested against).

    Same data, problem, budget, ledger and noise as ``fedkl run``; the per-user answers come from
    ClientApps. Returns ``{"w", "rho_spent", "sigma", "history", "ledger" (summary), "ledger_path",
    "failed_users" (per round), "user_ids", "backend"}``; the ledger is written under
    ``cfg.ledger`` or ``cfg.out`` (default ``runs/<run id>-...``). No evaluation (the runner does it).
    ``spec`` overrides the dataset/problem derived from ``cfg`` (e.g. a smaller synthetic set).
    """
    if backend != "inprocess" and cfg.kernels != "reproducible":  # the clients compute reproducibly
        raise ValueError(f"kernels {cfg.kernels!r} is in-process only: over {backend} use kernels='reproducible'")
    if backend == "inprocess":  # the reference, through the very same training code

        def federation_for(spec: ClientSpec, dataset: Any, problem: Any) -> Any:  # the server's own data, as fedkl run
            return contextlib.nullcontext(InProcessFederation(problem, dataset))

    else:
        open_kw.setdefault("secagg", getattr(cfg, "secagg", False))

        def federation_for(spec: ClientSpec, dataset: Any, problem: Any) -> Any:
            ids, num_params = dataset.train.user_ids, problem.num_params
            return open_federation(backend, spec, user_ids=ids, num_params=num_params, **open_kw)

    trained, place, dataset, _, replayed = _train(cfg, backend, federation_for, log, spec)
    r = trained.result
    raw = {"w": r.w, "rho_spent": r.rho_spent, "sigma": r.sigma, "rounds": r.rounds, "details": r.details or {}}
    return {**raw, "history": r.history or [], **_outcome(trained, place, dataset, backend, replayed)}


def _train(
    cfg: Any,
    label: str,
    federation_for: Callable[[ClientSpec, Any, Any], Any],
    log: Callable[[str], None],
    spec: ClientSpec | None = None,
    journal: bool = False,
    recover: str | None = None,
    transport: str | None = None,
) -> tuple:
    """``(Trained, RunPlace, dataset, problem, replayed)`` of a training over ``label`` (``transport``: the
    backend the budget line names, default ``label``).
    ``journal``: keep the run's release journal in its out folder (``journal.sqlite``, what a
    recovery needs); ``recover``: the out folder of a run whose process died, recovered here
    (:func:`fedkl.runner.open_recovery`: its run id, ledger and delta; its releases replayed)."""
    # The server uses the dataset only for the enrolment list (user ids, n) and the problem's shape
    # and initial point; the per-user answers come from the clients.
    if spec is None:
        dataset = load_dataset(cfg.dataset, **ClientSpec.loader_kwargs(cfg))
        spec = ClientSpec.from_run_config(cfg, task=dataset.task)
    else:
        dataset = load_dataset(spec.dataset, **spec.kwargs[0])
    problem = make_problem(spec.problem, dataset, **spec.kwargs[1])
    user_ids = dataset.train.user_ids
    recovered = None if recover is None else runner.open_recovery(recover, cfg)  # never creates a ledger
    place = runner.prepare_run(cfg, len(user_ids), f"-{label}", recovered)
    journal_at, replayed = recovered, None if recovered is None else len(recovered)  # replayed: all, once done
    if recovered is None and journal:
        journal_at = os.path.join(place.out, runner.JOURNAL_FILE)
    log(f"fedkl {label} {place.run_id}: {cfg.algorithm} on {spec.dataset} ({len(user_ids)} users, {problem.num_params} parameters)")  # fmt: skip
    # the server's own problem fixes the model size: a node answering for another is refused alone
    with federation_for(spec, dataset, problem) as federation:  # ledger, filter, noise as `fedkl run`
        result, summary, declared = runner.train_federation(
            cfg, federation, problem, dataset, place.delta, place.ledger_path, place.run_id, place.noise, log,
            journal=journal_at, journal_header={"out": os.path.abspath(place.out), "deployed": label == "grpc"},
            transport=transport or label,
        )  # fmt: skip
        failures = federation.failure_report()
    return runner.Trained(result, summary, declared, failures), place, dataset, problem, replayed


def _outcome(trained: runner.Trained, place: runner.RunPlace, dataset: Any, label: str, replayed: int | None) -> dict:
    """Where and how a training over ``label`` ran, next to its result (run_flower_simulation's dict, and
    flower_result.json: :meth:`fedkl.runner.Trained.record` with these)."""
    history = trained.result.history or []
    return {
        "ledger": trained.summary,
        "ledger_path": place.ledger_path,
        "out_dir": place.out,
        "run_id": place.run_id,
        "delta": place.delta,
        "users": len(dataset.train.user_ids),
        "user_ids": dataset.train.user_ids,
        "guarantee": trained.declared.to_dict(),
        "backend": label,
        "failed_users": [h.get("failed_users") for h in history],
        "failures": trained.failures,
        "replayed": replayed,  # recovering: the releases replayed from the journal (charged by the dead run)
    }


# --- the deployed ServerApp (flwr run / SuperLink) ----------------------------------------------
def _run_config_from_user_config(rc: Any) -> Any:
    """A RunConfig from ``fedkl-*`` run-config keys (``fedkl-dataset``, ``fedkl-problem``,
    ``fedkl-epsilon``, ``fedkl-rounds``, ``fedkl-lr``, ``fedkl-clip``, ``fedkl-seed``, ...)."""
    kw = {}
    for name in runner.settings_fields():
        key = "fedkl-" + name.replace("_", "-")
        if key in rc and rc[key] != "":  # "" stands for None (TOML has no null)
            kw[name] = rc[key]
    if kw.get("kernels", "auto") not in ("auto", "reproducible"):  # the clients always compute reproducibly
        raise ValueError(f"fedkl-kernels = {kw['kernels']!r}: a Flower deployment runs the reproducible kernels only")
    return RunConfig.from_settings(**{**kw, "kernels": "reproducible"})


def _deployed_main(grid: Grid, context: Context) -> None:
    """Training with the ledger and noise here; the SuperNodes run ``fedkl.flower.client_app:app`` with the
    same ``fedkl-*`` run config. Runs in the ServerApp's thread (the ledger is opened there).
    Extra keys: ``fedkl-timeout`` (seconds per request), ``fedkl-wait-for-nodes`` (seconds to wait
    for the enrolled users' nodes to connect) and ``fedkl-handshake-timeout`` (seconds a node has to
    answer the handshake), both by default scaling with the number of users
    (:func:`fedkl.flower.federation.connect_deadline`, :func:`~fedkl.flower.federation.answer_deadline`);
    ``fedkl-node-bindings``: a JSON file ``{user id: node id}`` binding users to Flower node ids (decides
    duplicate claims, :data:`fedkl.flower.federation.DUPLICATE_RULE`).
    The run keeps its release journal in ``fedkl-out`` (``journal.sqlite``); ``fedkl-recover``: the out folder
    of a run whose ServerApp died (kill -9, a host crash), recovered by this run with the same settings: its
    ledger run taken over, its journalled releases replayed without charging (the SuperNodes answer the
    replayed queries again), then continued (:class:`fedkl.privacy.release.Releaser`).
    A run that fails writes ``flower_error.json`` (``{"error": one line}``) before raising, so that
    ``fedkl run --backend grpc`` reports it and exits non-zero.
    Paths are resolved first (:func:`resolve_paths`), before anything is read or charged."""
    rc = resolve_paths(context.run_config)
    out = rc.get("fedkl-out") or None
    try:
        _deployed_train(grid, rc)
    except Exception as exc:
        if out:
            os.makedirs(out, exist_ok=True)
            write_json(os.path.join(out, "flower_error.json"), {"error": f"{type(exc).__name__}: {exc}"})
        raise


def resolve_paths(rc: Any) -> dict:
    """The run config with its paths absolute (:func:`fedkl.flower.codec.absolute_run_config`: ``fedkl-out``,
    ``fedkl-ledger``, ``fedkl-recover``, a data file ``fedkl-dataset``), resolved when the ServerApp starts,
    before anything is read or charged.

    A relative path (and the default out folder ``runs/<run id>-...``, used when ``fedkl-out`` is empty) resolves
    against the ServerApp's working directory: the directory its SuperLink was started in. For ``flwr run .`` on
    the local simulation engine that is the directory ``flwr run`` was run from when it started Flower's local
    SuperLink (Flower keeps that SuperLink, and its directory, for later runs with the same ``FLWR_HOME``); for a
    SuperLink you started (docs/how-to/deploy.md), the directory you started it in. ``fedkl run --backend grpc``
    resolves every path where you typed it before its deployment starts, so its ServerApp sees absolute ones.
    Where that directory is inside the system's temporary folder or Flower's home (``FLWR_HOME``, default
    ``~/.flwr``: Flower's own copies of the app), a relative path is refused in one line (ValueError; nothing
    created or charged): a ledger or model written there could be deleted with it; give an absolute path."""
    import tempfile
    from pathlib import Path

    from fedkl.data.files import is_data_file
    from fedkl.flower.codec import PATH_KEYS, absolute_run_config

    keys = [*PATH_KEYS, *(["fedkl-dataset"] if is_data_file(rc.get("fedkl-dataset")) else [])]
    relative = [f"{k}={rc[k]!r}" for k in keys if isinstance(rc.get(k), str) and rc[k] and not os.path.isabs(rc[k])]
    if not rc.get("fedkl-out"):
        relative.append("fedkl-out (empty: the default runs/<run id>-...)")
    here = Path.cwd().resolve()
    flwr_home = Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr").resolve()
    for name, folder in (
        ("the system's temporary folder", Path(tempfile.gettempdir()).resolve()),
        ("FLWR_HOME", flwr_home),
    ):
        if relative and here.is_relative_to(folder):
            raise ValueError(
                f"{', '.join(relative)} is relative, and this ServerApp runs in {here}, inside {name} ({folder}), "
                "where the run's ledger and model could be deleted: give an absolute path, e.g. "
                f"--run-config \"fedkl-out='/absolute/path'\" (nothing was read or charged)"
            )
    return absolute_run_config(rc)


def _seconds(rc: Any, key: str) -> float | None:
    return float(rc[key]) if rc.get(key) not in (None, "") else None


PROGRESS = "fedkl progress: "  # the prefix of the deployed ServerApp's progress lines (streamed by run_grpc)


class ProgressLines(runner.RunObserver):
    """The deployed ServerApp's progress: when the run starts ``fedkl progress: run ID on ledger PATH``, after
    each round one line ``fedkl progress: round k/R, E s elapsed, ETA S s`` (the mean round so far times the
    rounds left) through ``log``; ``fedkl run --backend grpc`` shows these lines as they come."""

    def __init__(self, log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.clock = log, clock
        self.start = clock()

    def started(self, run_id: str, ledger_path: str) -> None:
        self.start = self.clock()
        self.log(f"{PROGRESS}run {run_id} on ledger {os.path.abspath(ledger_path)}")  # read by run_started

    def round(self, record: dict) -> None:
        k, total = int(record["round"]), int(record["rounds"])
        elapsed = self.clock() - self.start
        eta = elapsed / max(k, 1) * (total - k)
        self.log(f"{PROGRESS}round {k}/{total}, {elapsed:.0f} s elapsed, ETA {eta:.0f} s")


def run_started(line: str) -> tuple[str, str] | None:
    """``(run id, ledger path)`` of the line :meth:`ProgressLines.started` prints, else None: ``fedkl run
    --backend grpc`` learns from it which ledger run its ServerApp charges (what Ctrl-C reports)."""
    head = f"{PROGRESS}run "
    if not line.startswith(head) or " on ledger " not in line:
        return None
    run_id, ledger = line[len(head) :].rstrip("\n").split(" on ledger ", 1)
    return run_id, ledger


def _deployed_train(grid: Grid, rc: Any) -> None:
    token = runner.RUN_OBSERVER.set(ProgressLines(lambda s: print(s, flush=True)))
    try:
        _deployed_train_observed(grid, rc)
    finally:
        runner.RUN_OBSERVER.reset(token)


def _deployed_train_observed(grid: Grid, rc: Any) -> None:
    started = time.time()
    cfg = _run_config_from_user_config(rc)
    bindings = None
    if rc.get("fedkl-node-bindings") not in (None, ""):
        with open(rc["fedkl-node-bindings"]) as f:
            bindings = {str(k): int(v) for k, v in json.load(f).items()}
    spec = ClientSpec.from_user_config(rc)  # exactly what the clients load
    # the transport, as the budget line and result.json name it: `fedkl run --backend grpc`'s deployment, else
    # a ServerApp that `flwr run` started (whatever backend the run config names: it runs over Flower here)
    transport = "grpc" if cfg.backend == "grpc" else "flwr-run"
    trained, place, dataset, problem, replayed = _train(
        cfg,
        "grpc",
        lambda spec, dataset, problem: contextlib.nullcontext(
            FlowerFederation(
                grid,
                user_ids=dataset.train.user_ids,
                num_params=problem.num_params,
                timeout=_seconds(rc, "fedkl-timeout"),
                wait_for_nodes=_seconds(rc, "fedkl-wait-for-nodes"),
                handshake_timeout=_seconds(rc, "fedkl-handshake-timeout"),
                bindings=bindings,
                secagg=cfg.secagg,
            )
        ),
        print,
        spec,
        journal=True,
        recover=rc.get("fedkl-recover") or None,
        transport=transport,
    )
    # in fedkl-out, where `fedkl run --backend grpc` reads it back (Trained.from_record; the ledger may be elsewhere)
    outcome = {k: v for k, v in _outcome(trained, place, dataset, "grpc", replayed).items() if k != "user_ids"}
    write_json(os.path.join(place.out, "flower_result.json"), {**trained.record(), **outcome})
    # model.pt, result.json, the metrics and the summary lines, by the one writer of every backend (`flwr run .`
    # and a deployment of sites have no fedkl run to write them; under `fedkl run --backend grpc` that process
    # writes the same files again); sites keeping their own records: no test metric, and the lines say so
    try:  # after flower_result.json: a failure here never turns a trained, charged run into a failed one
        data = runner.RunData(dataset, problem, spec.problem, problem_spec(spec.problem, dataset, cfg.reg, cfg.model))
        runner.write_run_files(
            cfg, trained, data, place, resume=None, started=started, log=lambda s: print(s, flush=True),
            backend=transport,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001  (one line; the run's outcome is flower_result.json)
        print(f"fedkl: could not write model.pt/result.json ({type(exc).__name__}: {exc})", flush=True)


app = make_server_app(_deployed_main)
