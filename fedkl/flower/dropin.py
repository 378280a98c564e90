"""Drop-in user-level DP for an existing Flower app: :class:`UserLevelDPStrategy`.

Wrap the app's Message-API strategy (``flwr.serverapp.strategy.FedAvg`` or any strategy whose
``configure_train`` sends the global model as an ArrayRecord and whose clients reply with their locally
trained model) and the app's training gets fedkl's user-level accounting, durable ledger and noise::

    strategy = UserLevelDPStrategy(
        FedAvg(fraction_train=0.5), ledger_path="ledger.sqlite", epsilon=2.0, delta=1e-5, clip=1.0, rounds=10
    )
    result = strategy.start(grid, initial_arrays, num_rounds=10)

(a complete app: ``simulations/flower_dropin_app.py``), with one line in the app's ClientApp:
``declare_user(client_app)``.

Users are declared, never inferred from the transport. One Flower node is one user, and the user charged
in the ledger is the id the node declares: :func:`declare_user` answers the strategy's handshake (the
``info`` request of fedkl's own Flower backend, :mod:`fedkl.flower.codec`) with the node config's
``user-id`` (``flower-supernode --node-config 'user-id="alice"'``) or a function of the node's context.
Flower's node ids are transport ids (the simulation engine draws new ones each run) and are never ledger
keys: the same person in two runs on one ledger is one user, whose charges compose. In ``configure_train``,
before any model is sent, every node the wrapped strategy picked that has not declared yet is asked.
A node is refused alone (never sent the model) when it declares no valid id (no handler, no ``user-id``,
an error, or no reply within ``handshake_timeout``), an id outside ``enrolment`` (when given: the public list
of user ids), or an id another node of this run declares too (both claimants, and any later one, are
refused from then on: one person must never contribute two updates to a round, and the server cannot
tell which node is the impostor; rounds one of them took part in earlier stay charged to that id).
Nobody is renamed, and nothing is charged for a refused node: none of its data enters any release (an id
outside the enrolment names no person the ledger could charge). A round in which none of the picked nodes
has a usable id is refused in one line before anything is sent or charged. ``strategy.refused`` says
which nodes were refused and why. A declared id is as trustworthy as the node's authentication: a node
declaring another person's id spends that person's budget (bind ids to node keys with Flower's SuperNode
authentication in a deployment).

Each round, in ``aggregate_train``, the wrapper (not the wrapped strategy) builds the model update:

1. every node the round configured (and did not refuse) is a participant (a public, server-side fact:
   the sample, not the replies); a participant's update is its reply's arrays minus the model it was sent, flattened, and
   clipped to l2 norm ``clip`` HERE, on the server (:func:`fedkl.federation.clipping.clip_rows`): nothing
   a client says is trusted. A missing reply, an error, other array names/shapes or non-finite values
   contribute the zero vector (the failure rule of fedkl);
2. the sum of the clipped updates (unweighted: a weight such as ``num-examples`` is the client's data
   and would change the sensitivity) is released through :class:`fedkl.privacy.release.Releaser`: every
   participant's user is charged ``rho_round`` in the durable ledger, then ``N(0, sigma^2 I)`` is added,
   ``sigma = sensitivity / sqrt(2 rho_round)`` with sensitivity ``2 clip`` (replace-one: one user's
   update replaced) or ``clip`` (add-remove);
3. the new model is ``model + server_lr * noisy_sum / cohort`` with ``cohort`` the number of
   participants (public).

Accounting: ``rho_round = Budget(epsilon, delta, conversion).rho / rounds``, so a user who takes part in
every one of ``rounds`` rounds spends exactly its (epsilon, delta) budget (zCDP composition, converted by
the ledger); the ledger refuses a release that would take any participant over the budget (its earlier
runs on the same ledger count), before any noise is drawn. No amplification by sampling is claimed
(Flower's samplers are not secret Poisson samples). The guarantee covers the sequence of released
models; the clients' training metrics are NOT released (``aggregate_train`` returns no metrics) and
federated evaluation is off unless ``evaluate_outside_guarantee=True`` (its metrics are the clients'
un-noised data). Unlike Flower's ``DifferentialPrivacyServerSideFixedClipping`` (record-free noise
multiplier, no durable per-user ledger, the noise on the mean of the replies), the epsilon here is
user-level, charged before the noisy aggregate exists, and held per user across runs.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedkl.federation.clipping import clip_rows
from fedkl.flower import codec
from fedkl.flower.federation import FlowerFederation, answer_deadline
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser
from fedkl.privacy.guarantee import sum_sensitivity


class UserLevelDPStrategy(Strategy):
    """A Flower strategy wrapper with fedkl's user-level DP (module docstring).

    Args:
        strategy: the app's strategy (chooses the nodes and sends the model; its aggregation is replaced).
        ledger_path: fedkl's SQLite ledger (created with the budget; an existing one must have the same budget).
        epsilon, delta: each user's (epsilon, delta) budget over everything charged to the ledger.
        clip: l2 bound of one user's model update per round.
        rounds: the number of rounds the noise is sized for (more rounds are refused by the ledger once a
            user's budget is spent).
        neighbouring: ``"replace-one"`` (default) or ``"add-remove"``.
        server_lr: step on the noisy mean update.
        noise_seed: seed the noise (reproducible, NOT secure); None: OS randomness.
        enrolment: the public list of user ids; a node declaring another id is refused (None: any id).
        handshake_timeout: seconds a node has to declare its user id (None:
            :func:`fedkl.flower.federation.answer_deadline` of the nodes asked).
        evaluate_outside_guarantee: let the wrapped strategy run federated evaluation (un-noised metrics).
        out: the run's folder, where :meth:`start` writes ``model.pt`` and ``result.json`` when it returns
            (default ``<the ledger's folder>/runs/<run id>``; :meth:`write_run_files`).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        ledger_path: str,
        epsilon: float,
        delta: float,
        clip: float,
        rounds: int,
        neighbouring: str = "replace-one",
        conversion: str = "cks",
        server_lr: float = 1.0,
        noise_seed: int | None = None,
        enrolment: Sequence[str] | None = None,
        handshake_timeout: float | None = None,
        evaluate_outside_guarantee: bool = False,
        out: str | None = None,
    ) -> None:
        super().__init__()
        if not (clip > 0 and math.isfinite(clip)):
            raise ValueError(f"clip must be finite and > 0, got {clip}")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
        self.sensitivity = sum_sensitivity(float(clip), neighbouring)  # of the sum of clipped updates
        if not (server_lr > 0 and math.isfinite(server_lr)):
            raise ValueError(f"server_lr must be finite and > 0, got {server_lr}")
        self.strategy = strategy
        self.budget = Budget(epsilon, delta, conversion)
        self.clip = float(clip)
        self.rounds = rounds
        self.neighbouring = neighbouring
        self.server_lr = float(server_lr)
        self.rho_round = self.budget.rho / rounds
        self.sigma = self.sensitivity / math.sqrt(2.0 * self.rho_round)  # noise std on the SUM of updates
        self.enrolment = None if enrolment is None else frozenset(str(u) for u in enrolment)
        self.handshake_timeout = handshake_timeout
        self._user_of: dict[int, str] = {}  # node id -> the user id it declared (this run)
        self._contested: set[str] = set()  # user ids declared by several nodes: served by none
        self.refused: dict[int, str] = {}  # node id -> why it is never sent the model
        self.evaluate_outside_guarantee = evaluate_outside_guarantee
        self.run_id = "flower-dropin-" + uuid.uuid4().hex[:8]
        self.ledger_path = str(ledger_path)
        self.ledger = PrivacyLedger(ledger_path, self.budget, run_id=self.run_id, run_config=self._settings())
        self.privacy_line: str | None = None  # said (Flower's log) when start() has ended the run
        self.out = os.path.abspath(out or os.path.join(os.path.dirname(self.ledger_path), "runs", self.run_id))
        self._summary: dict | None = None  # the ledger's, when the run ended
        self.releaser = Releaser(self.ledger, NoiseSource(noise_seed))
        self._sent: dict[int, tuple[ArrayRecord, list[int], list[str]]] = {}  # round -> (model, nodes, their users)
        self._released = 0  # rounds whose noisy sum was released

    def _settings(self) -> dict:
        return {
            "wrapper": "fedkl.flower.dropin.UserLevelDPStrategy",
            "epsilon": self.budget.epsilon,
            "delta": self.budget.delta,
            "clip": self.clip,
            "rounds": self.rounds,
            "neighbouring": self.neighbouring,
        }

    # --- the run ---------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, *args: Any, **kw: Any) -> Any:
        """Flower's :meth:`Strategy.start`, as ONE ledger run: when it returns, the run is ended ``finished``
        in the ledger, ``model.pt`` and ``result.json`` are written in :attr:`out` (:meth:`write_run_files`) and
        the summary lines (:attr:`privacy_line`: user-level epsilon and delta, as ``fedkl run`` prints it; the test
        metric: none; the files) are said through Flower's log; when it raises, the run is ended as :meth:`PrivacyLedger.end_status`
        says (refused, failed, interrupted). A strategy serves one run: a second ``start`` is refused."""
        if self.ledger is None:
            raise RuntimeError(f"run {self.run_id} is over (its ledger run is closed): make a new strategy")
        try:
            result = super().start(grid, initial_arrays, num_rounds, *args, **kw)
        except BaseException as exc:
            if self.ledger is not None:
                self.close(self.ledger.end_status(exc))
            raise
        self.close("finished")
        from flwr.supercore import log

        try:  # after the run ended: a file that cannot be written never turns a charged run into a failed one
            lines = self.write_run_files(result.arrays)
        except Exception as exc:  # noqa: BLE001  (one line; the ledger holds the run)
            lines = [
                self.privacy_line or "",
                f"fedkl: could not write model.pt/result.json ({type(exc).__name__}: {exc})",
            ]
        for line in lines:
            log(20, line)
        return result

    def write_run_files(self, arrays: ArrayRecord) -> list[str]:
        """The files every fedkl entry point leaves, for the run that just ended (``arrays``: the model
        ``start`` returned), in :attr:`out`; returns the summary lines (the privacy line, the test metric, the files).

        * ``model.pt``: ``torch.save`` of ``{"format": "fedkl-dropin-model/1", "state_dict": {name: tensor},
          "receipt": {...}}`` (plain values: ``torch.load(path, weights_only=True)``). The state dict is the app's
          own model, names and dtypes as the app's ArrayRecord holds them (a float32 model stays float32), so
          ``Net().load_state_dict(torch.load(path, weights_only=True)["state_dict"])`` restores it. It is not a
          ``fedkl-model/1`` file: its network is the app's class, which fedkl cannot rebuild, so ``fedkl predict``
          refuses it in one line (:func:`fedkl.saved_model.load_model`) and the app evaluates it itself.
        * ``result.json`` (strict JSON): the receipt's guarantee (user-level epsilon, delta, rho, neighbouring,
          clip, rounds released, noise std on the sum), the ledger summary and path, the model path, and
          ``test_metric: null``: the server holds no test data (the clients' evaluation is outside the guarantee).
        * the ledger stays where ``ledger_path`` put it (this run ``finished`` in it)."""
        from fedkl.results import write_json
        from fedkl.saved_model import DROPIN_FORMAT

        s = self._summary or {}
        os.makedirs(self.out, exist_ok=True)
        receipt = {
            "algorithm": "flower-dropin",
            "run_id": self.run_id,
            "epsilon": s.get("max_user_epsilon_exact"),
            "delta": self.budget.delta,
            "rho": s.get("max_user_rho"),
            "budget": {
                "epsilon": self.budget.epsilon,
                "delta": self.budget.delta,
                "conversion": self.budget.conversion,
            },
            "neighbouring": self.neighbouring,
            "ledger": {"path": os.path.abspath(self.ledger_path), "run_id": self.run_id},
            "settings": self._settings(),
        }
        model_path, result_path = os.path.join(self.out, "model.pt"), os.path.join(self.out, "result.json")
        state = {k: torch.from_numpy(np.array(arrays[k].numpy())) for k in arrays.keys()}
        tmp = model_path + ".tmp"
        torch.save({"format": DROPIN_FORMAT, "state_dict": state, "receipt": receipt}, tmp)
        os.replace(tmp, model_path)
        write_json(
            result_path,
            {
                **receipt,
                "epsilon_by_budget_conversion": s.get("max_user_epsilon"),
                "clip": self.clip,
                "rounds": self._released,
                "sigma_sum": self.sigma,
                "test_metric": None,
                "ledger_summary": s,
                "refused_nodes": {str(n): why for n, why in self.refused.items()},
                "model_path": model_path,
                "out_dir": self.out,
            },
        )
        return [
            self.privacy_line or "",
            "test metric: none (the server holds no test data; the clients' evaluation is outside the guarantee)",
            f"wrote {result_path}, {model_path} and ledger {os.path.abspath(self.ledger_path)}",
        ]

    # --- training ------------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        nodes = sorted({m.metadata.dst_node_id for m in messages})
        if len(nodes) != len(messages):
            raise ValueError("the wrapped strategy sent a node two training messages in one round")
        self._identify(grid, nodes)
        kept = [m for m in messages if m.metadata.dst_node_id in self._user_of]
        if messages and not kept:
            raise RuntimeError(
                f"round {server_round}: none of the {len(nodes)} nodes picked declared a usable user id "
                f"(node {nodes[0]}: {self.refused[nodes[0]]}); each node's ClientApp must call "
                "fedkl.flower.dropin.declare_user and its node config give a 'user-id'"
            )
        nodes = sorted(m.metadata.dst_node_id for m in kept)
        self._sent[server_round] = (arrays, nodes, [self._user_of[n] for n in nodes])
        return kept

    def _identify(self, grid: Grid, nodes: list[int]) -> None:
        """Ask each of ``nodes`` not asked yet for its declared user id (module docstring: who is refused)."""
        new = [n for n in nodes if n not in self._user_of and n not in self.refused]
        if not new:
            return
        msgs = [Message(codec.encode_request(codec.INFO), n, codec.MESSAGE_TYPE, group_id="fedkl-dropin") for n in new]
        timeout = answer_deadline(len(new)) if self.handshake_timeout is None else self.handshake_timeout
        replies = FlowerFederation._match(msgs, grid.send_and_receive(msgs, timeout=timeout))
        holder = {u: n for n, u in self._user_of.items()}
        for n in new:
            try:
                if n not in replies:
                    raise codec.CodecError("no handshake reply before the deadline")
                uid = codec.decode_user(replies[n])
            except (codec.CodecError, codec.ReplyError) as exc:
                self.refused[n] = f"declared no user id ({' '.join(str(exc).split())[:300]})"  # one line
                continue
            if self.enrolment is not None and uid not in self.enrolment:
                self.refused[n] = f"declares user {uid!r}, who is not in the enrolment"
            elif uid in holder or uid in self._contested:
                self._contested.add(uid)
                if uid in holder:
                    first = holder.pop(uid)
                    del self._user_of[first]
                    self.refused[first] = f"declares user {uid!r}, also declared by node {n}"
                self.refused[n] = f"declares user {uid!r}, also declared by another node"
            else:
                holder[uid] = n
                self._user_of[n] = uid

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if server_round not in self._sent:
            raise ValueError(f"round {server_round} was not configured by this strategy")
        sent, nodes, users = self._sent.pop(server_round)
        if not nodes:
            return None, None
        names = list(sent.keys())
        dtypes = [sent[k].numpy().dtype for k in names]  # the app's own: the new model keeps them
        base = [np.asarray(sent[k].numpy(), dtype=np.float64) for k in names]
        flat0 = np.concatenate([b.ravel() for b in base])
        rows = torch.zeros((len(nodes), flat0.size), dtype=torch.float64)
        position = {n: i for i, n in enumerate(nodes)}
        seen: set[int] = set()
        for reply in replies:
            n = reply.metadata.src_node_id
            if n not in position or n in seen or reply.has_error():
                continue
            seen.add(n)
            update = self._update(reply, names, base)
            if update is not None:
                rows[position[n]] = torch.from_numpy(update - flat0)
        rows, _ = clip_rows(rows, self.clip)  # non-finite rows were already zero; the clip is the bound
        noisy = self.releaser.gaussian(
            rows.sum(0),
            sensitivity=self.sensitivity,
            rho=self.rho_round,
            user_ids=users,
            label=f"flower-dropin/round-{server_round}",
            details={"round": server_round, "clip": self.clip, "cohort": len(nodes), "replies": len(seen)},
        )
        self._released += 1
        new = flat0 + self.server_lr * noisy.numpy() / len(nodes)
        out, start = {}, 0
        for k, b, dtype in zip(names, base, dtypes):
            part = new[start : start + b.size].reshape(b.shape)  # computed in float64, returned as the app's dtype
            out[k] = Array((np.rint(part) if np.issubdtype(dtype, np.integer) else part).astype(dtype))
            start += b.size
        return ArrayRecord(out), None

    def _update(self, reply: Message, names: list[str], base: list[np.ndarray]) -> np.ndarray | None:
        """The reply's model, flattened as the sent one, or None (contributes zero) if it is not one."""
        records = list(reply.content.array_records.values())
        if len(records) != 1 or list(records[0].keys()) != names:
            return None
        try:
            arrays = [np.asarray(records[0][k].numpy(), dtype=np.float64) for k in names]
        except Exception:
            return None
        if any(a.shape != b.shape for a, b in zip(arrays, base)):
            return None
        flat = np.concatenate([a.ravel() for a in arrays])
        return flat if np.isfinite(flat).all() else None

    # --- evaluation (outside the guarantee) --------------------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.evaluate_outside_guarantee:
            return []
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        if not self.evaluate_outside_guarantee:
            return None
        return self.strategy.aggregate_evaluate(server_round, replies)

    # --- reporting -----------------------------------------------------------------------------
    def epsilon_spent(self, user_id: str) -> float:
        """The user-level epsilon (at the budget's delta) spent by ``user_id`` in this ledger."""
        if self.ledger is None:
            with PrivacyLedger(self.ledger_path) as ledger:
                return ledger.spend(user_id).epsilon(self.budget.delta, self.budget.conversion)
        return self.ledger.spend(user_id).epsilon(self.budget.delta, self.budget.conversion)

    def close(self, status: str = "finished") -> None:
        """End this run in the ledger (the first end recorded is kept), set :attr:`privacy_line` and close
        the ledger (idempotent)."""
        if self.ledger is not None:
            self.ledger.finish_run(status)
            s = self._summary = self.ledger.summary()  # every user of the ledger: what they spent so far, as fedkl run
            self.privacy_line = (
                f"privacy: user-level ({self.neighbouring}) epsilon = {s['max_user_epsilon_exact']:.4f}, "
                f"delta = {self.budget.delta:.3g} (zCDP rho = {s['max_user_rho']:.5g}, {self.budget.conversion} "
                f"gives {s['max_user_epsilon']:.4f}; run {self.run_id} {status}, ledger {self.ledger_path})"
            )
            self.ledger.close()
            self.ledger = None  # type: ignore[assignment]

    def __enter__(self) -> "UserLevelDPStrategy":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """End the run in the ledger as finished, refused, failed or interrupted (:meth:`PrivacyLedger.end_status`)."""
        if self.ledger is not None:
            self.close(self.ledger.end_status(exc))

    def summary(self) -> None:
        from flwr.supercore import log

        log(
            20,
            "\t├──> fedkl user-level DP: (eps %g, delta %g) per user, clip %g, %s, noise std %.4g on the sum, ledger %s",
            self.budget.epsilon,
            self.budget.delta,
            self.clip,
            self.neighbouring,
            self.sigma,
            self.ledger.path if self.ledger is not None else "closed",
        )
        self.strategy.summary()


def declare_user(app: ClientApp, user_id: Callable[[Context], str] | None = None) -> None:
    """Make ``app`` (the app's own ClientApp) answer :class:`UserLevelDPStrategy`'s handshake with the user
    id its node declares: ``user_id(context)``, by default the node config's ``"user-id"``. A node without
    one answers with an error, and the strategy refuses it (never sends it the model)."""

    @app.query(codec.MESSAGE_TYPE.split(".", 1)[1])
    def _declare(message: Message, context: Context) -> Message:
        try:
            if codec.decode_request(message.content, 1) != codec.INFO:
                raise codec.CodecError("this ClientApp answers only fedkl's handshake")
            uid = user_id(context) if user_id is not None else context.node_config.get("user-id")
            if not isinstance(uid, str) or not uid.strip():
                raise codec.CodecError(f"the node declares no user id (user-id {uid!r})", codec.ERR_NOT_CONFIGURED)
            content = codec.encode_user(uid)
        except codec.CodecError as exc:
            content = codec.encode_error(exc.code, str(exc))
        except Exception as exc:  # the app's user_id function failed: never crash the node on a request
            content = codec.encode_error(codec.ERR_INTERNAL, f"{type(exc).__name__}: {exc}")
        return Message(content, reply_to=message)
