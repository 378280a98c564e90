"""The ``fedkl`` command-line grammar: every subcommand's flags, their types, choices and help.

Shared by :mod:`fedkl.cli` (which runs the commands) and :mod:`fedkl.experiments` (which validates
a TOML configuration or a sweep's values through the same ``fedkl run`` flags), so neither imports
the other. Bad arguments exit with code 2 and one line that says what is wrong and how to fix it.

The grammar is built from :func:`catalog`: the algorithms' hyperparameters (their Params dataclasses),
the datasets, problems, backends and run defaults. Reading them from the code imports torch and every
algorithm (~1.5 s of CPU), so ``fedkl --help`` and argument errors read ``flags_catalog.json`` instead,
which :func:`live_catalog` writes (``python -m fedkl.flags``) and ``tests/test_flags_catalog.py`` keeps
equal to the code. Once the algorithms are imported (a test, a plugin that registers one), the parser
reads the code itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

CATALOG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flags_catalog.json")
_KINDS = {"bool": bool, "int": int, "float": float, "str": str}


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is ONE line: 'fedkl run: error: ... (see fedkl run --help)'."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _positive(kind=float):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}")
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _interval(low: float, high: float, high_closed: bool):
    """A float strictly above ``low`` and below ``high`` (or equal to it when ``high_closed``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
        if not (low < value < high or (high_closed and value == high)):
            where = f"in ({low:g}, {high:g}]" if high_closed else f"strictly between {low:g} and {high:g}"
            raise argparse.ArgumentTypeError(f"must be {where}, got {text}")
        return value

    return parse


_probability = _interval(0.0, 1.0, high_closed=False)
_rate = _interval(0.0, 1.0, high_closed=True)


def _number_or_none(kind, positive: bool = False, infinite_ok: bool = False):
    def parse(text: str):
        if text.lower() == "none":
            return None
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} or 'none', got {text!r}")
        if not (math.isfinite(value) or (infinite_ok and value == math.inf)):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if positive and not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def live_catalog() -> dict:
    """What the grammar needs, read from the code (imports torch and every algorithm): the source of
    ``flags_catalog.json``, as JSON values (tuples become lists)."""
    from fedkl.algorithms.catalog import REGISTRY
    from fedkl.algorithms.registry import algorithms_using, field_kind, hyperparameter_fields
    from fedkl.data import DATASETS
    from fedkl.data.files import SUFFIXES
    from fedkl.privacy.zcdp import CONVERSIONS
    from fedkl.problems import PROBLEMS
    from fedkl.runner import BACKENDS, DTYPE_SETTINGS, KERNEL_SETTINGS, RunConfig

    # a canonical order (algorithms by name, then each one's Params fields): REGISTRY's own order is the
    # order the algorithm modules happened to be imported in, which differs between processes
    names = sorted(REGISTRY)
    fields = hyperparameter_fields()
    order = list(
        dict.fromkeys(f.name for a in names for f in dataclasses.fields(REGISTRY[a].params) if f.name in fields)
    )
    order += [name for name in fields if name not in order]
    hyper = {
        name: {
            "kind": field_kind(f).__name__,
            "default": f.default,
            "help": f.metadata["help"],
            "origin": f.metadata["origin"],
            "choices": f.metadata.get("choices"),
            "positive": f.metadata.get("positive", False),
            "algorithms": sorted(algorithms_using(name)),
        }
        for name, f in ((name, fields[name]) for name in order)
    }
    algorithms = {
        name: {
            "params": [f.name for f in dataclasses.fields(spec.params)],
            "step_size": spec.step_size,
            "clients_see": spec.clients_see(spec.params()).describe(),
            "view_depends_on_params": callable(spec.client_view),
            "module": spec.build.__module__,
        }
        for name, spec in ((name, REGISTRY[name]) for name in names)
    }
    live = {
        "run_defaults": {f.name: f.default for f in dataclasses.fields(RunConfig) if f.name != "params"},
        "datasets": DATASETS,
        "data_suffixes": SUFFIXES,
        "problems": PROBLEMS,
        "conversions": CONVERSIONS,
        "backends": BACKENDS,
        "kernels": KERNEL_SETTINGS,
        "dtypes": DTYPE_SETTINGS,
        "hyperparameters": hyper,
        "algorithms": algorithms,
    }
    return json.loads(json.dumps(live))


def catalog() -> dict:
    """The grammar's facts: :func:`live_catalog` when the algorithms are already imported (it then
    includes any algorithm registered since), else the torch-free ``flags_catalog.json``."""
    registry = sys.modules.get("fedkl.algorithms.registry")
    if "fedkl.algorithms.catalog" in sys.modules or (registry is not None and registry.unlisted()):
        return live_catalog()
    with open(CATALOG_PATH, encoding="utf-8") as f:
        return json.load(f)


def _add_hyperparameters(run: argparse.ArgumentParser, algorithm: str | None, cat: dict) -> None:
    """One flag per registered hyperparameter (``--kl-gamma`` for ``kl_gamma``), generated from the
    algorithms' Params (:mod:`fedkl.algorithms.registry`, through :func:`catalog`): type from the
    annotation, default, help, origin and choices from the field. With ``algorithm``, ``--help`` lists
    only its flags (the others still parse; a non-default value for another algorithm is refused by the run)."""
    algorithms = cat["algorithms"]
    own = None if algorithm not in algorithms else set(algorithms[algorithm]["params"])
    title = (
        f"{algorithm} hyperparameters"
        if own is not None
        else "algorithm hyperparameters (`--algorithm NAME --help` lists one algorithm's)"
    )
    sees = None
    if own is not None:
        spec = algorithms[algorithm]
        sees = "What a participating client sees" + (
            " (with the default settings; it depends on them): " if spec["view_depends_on_params"] else ": "
        )
        sees = (sees + spec["clients_see"] + " (result.json: clients_see).").replace("%", "%%")
    group = run.add_argument_group(
        title + " ('theorem': the paper's value by default; 'heuristic': a tunable choice)", description=sees
    )
    for name, h in cat["hyperparameters"].items():
        shown = algorithms[algorithm]["step_size"] if own is not None and name == "lr" else h["default"]
        note = f"{h['help']} [{h['origin']}; default {shown}; {', '.join(h['algorithms'])}]"
        note = argparse.SUPPRESS if own is not None and name not in own else note.replace("%", "%%")
        flag = "--" + name.replace("_", "-")
        kind = _KINDS[h["kind"]]
        if kind is bool:
            group.add_argument(flag, action="store_true", default=h["default"], help=note)
        elif h["choices"]:
            group.add_argument(flag, choices=tuple(h["choices"]), default=h["default"], help=note)
        elif kind is str:
            group.add_argument(flag, default=h["default"], help=note)
        else:
            parse = _number_or_none(kind, h["positive"], infinite_ok=h["default"] == math.inf)
            group.add_argument(flag, type=parse, default=h["default"], help=note)


def _dataset_type(cat: dict):
    """``--dataset``: a built-in dataset's name or a data file (by its suffix, as :func:`fedkl.data.files.is_data_file`)."""
    names, suffixes = cat["datasets"], tuple(cat["data_suffixes"])

    def dataset_name(text: str) -> str:
        if text in names or text.lower().endswith(suffixes):
            return text
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r} (choose from {', '.join(names)}, or a {'/'.join(suffixes)} file)"
        )

    dataset_name.__name__ = "dataset"
    return dataset_name


def _add_run_arguments(run: argparse.ArgumentParser, algorithm: str | None, cat: dict) -> None:
    """The ``fedkl run`` settings (shared by ``fedkl plan``)."""
    d = argparse.Namespace(**cat["run_defaults"])  # RunConfig's field defaults (kernels: auto, unresolved)
    run.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="read settings from a TOML file (keys: the options below, dashes or underscores); "
        "options given on the command line override the file",
    )
    run.add_argument(
        "--dataset",
        type=_dataset_type(cat),
        default=d.dataset,
        help=f"user-partitioned dataset: one of {', '.join(cat['datasets'])} (default %(default)s), or your own "
        ".csv/.npz/.parquet file with --user-column and --label-column",
    )
    run.add_argument(
        "--problem",
        choices=cat["problems"],
        default=d.problem,
        help="model / loss (default: logistic for binary, softmax for multiclass, least-squares for regression; "
        "torch: your own network, see --model)",
    )
    run.add_argument(
        "--model",
        default=d.model,
        help="with --problem torch: your torch.nn.Module as 'package.module:factory', called as "
        "factory(input_dim, num_outputs) (importable on every client)",
    )
    run.add_argument(
        "--algorithm",
        choices=tuple(cat["algorithms"]),
        default=d.algorithm,
        help="private algorithm (default %(default)s)",
    )
    run.add_argument(
        "--backend",
        choices=cat["backends"],
        default=d.backend,
        help="where users compute (default %(default)s: the vectorized in-process simulator)",
    )
    run.add_argument(
        "--epsilon", type=_positive(), default=d.epsilon, help="user-level epsilon budget (default %(default)s)"
    )
    run.add_argument("--delta", type=_probability, default=None, help="user-level delta (default 1/n^1.1 for n users)")
    run.add_argument("--reg", type=float, default=d.reg, help="L2 regularization (reg/2)||w||^2 (default %(default)s)")
    run.add_argument(
        "--neighbouring",
        choices=("replace-one", "add-remove"),
        default=d.neighbouring,
        help="user-level neighbouring relation (default %(default)s: all of one user's records replaced, n public; "
        "add-remove: one user's records added or removed against a public enrolment count n, i.e. zero-out; "
        "the paper-002 algorithms are proven for replace-one only)",
    )
    run.add_argument(
        "--clients",
        choices=("any", "in-class"),
        default=d.clients,
        help="the trust model you state for the other clients (default %(default)s: the guarantee must hold "
        "whatever they answer). in-class: an explicit opt-in, required to run an algorithm whose guarantee "
        "assumes every client's gradient answers come from one fixed loss of its own records in the declared "
        "class (the paper-002 diameter test and Delta selection, the fkt family) on a backend where clients "
        "run their own code (every Flower backend; run config fedkl-clients); the privacy line says it",
    )
    run.add_argument(
        "--conversion",
        choices=cat["conversions"],
        default=d.conversion,
        help="zCDP -> (eps, delta) conversion that sizes the budget (default %(default)s: "
        "Canonne-Kamath-Steinke 2020; gaussian: the exact profile of Gaussian releases, accepted "
        "only where every zCDP release is Gaussian). result.json's epsilon is exact for Gaussian "
        "releases whatever this is",
    )
    run.add_argument(
        "--seed", type=int, default=d.seed, help="seed of the data split and initialisation (default %(default)s)"
    )
    run.add_argument(
        "--noise-seed",
        type=int,
        default=None,
        help="seed the privacy noise (reproducible, NOT secure; default: os.urandom)",
    )
    run.add_argument("--out", default=None, help="output folder (default runs/<run id>-<algorithm>-<dataset>)")
    run.add_argument(
        "--ledger",
        default=None,
        help="ledger file (default OUT/ledger.sqlite); an existing ledger's spent budget is honoured",
    )
    run.add_argument("--no-reference", action="store_true", help="skip the non-private reference model")
    run.add_argument(
        "--force",
        action="store_true",
        help="run an output-perturbation algorithm even when its public forecast says the noise would "
        "swamp the model (it is refused otherwise, before any data is read or budget spent)",
    )
    run.add_argument(
        "--allow-large-delta",
        action="store_true",
        help="run with delta >= 1/n (n users), which allows publishing one user's data outright: refused "
        "otherwise, before anything is read or charged; the privacy line then says so next to epsilon",
    )
    run.add_argument(
        "--secagg",
        action="store_true",
        help="Flower backends: aggregate the clipped answers through SecAgg+ so the server sees only their sum "
        "(algorithms that need only sums; fedkl.flower.secagg)",
    )
    run.add_argument(
        "--shards",
        type=_positive(int),
        default=d.shards,
        help="--backend ray-shards: Ray actors, each holding a block of users (default %(default)s; "
        "--ray-address spreads them over a cluster)",
    )
    run.add_argument(
        "--ray-address",
        default=d.ray_address,
        metavar="HOST:PORT",
        help="--backend ray-shards: the running Ray cluster to place the shards on (a `ray start --head` "
        "address, or auto; default: RAY_ADDRESS when set, else a local Ray instance for the run). Nodes that "
        "declare the resource fedkl_shards host the shards, one unit each (docs/how-to/ray-cluster.md)",
    )
    run.add_argument(
        "--users-per-node",
        type=int,
        default=d.users_per_node,
        help="--backend flower-sim/flower-local: users held by each simulated Flower node, answering per user in one "
        "message (default 0 = auto: flower-sim about one node per CPU core, flower-local one user per node)",
    )
    run.add_argument(
        "--kernels",
        choices=cat["kernels"],
        default=d.kernels,
        help="numeric kernels (default auto: fast in-process, reproducible on the Flower backends; fast: plain "
        "torch kernels, several times faster per round, in-process only, equal to float64 rounding; reproducible: "
        "batch-invariant, every backend releases the same bits). result.json's config names the kernels that ran",
    )
    run.add_argument(
        "--dtype",
        choices=cat["dtypes"],
        default=d.dtype,
        help="float type of the users' data and per-user computation (default auto: float64, float32 for torch "
        "models; in-process only). Sums, noise and the server's iterate stay float64; float32 only for algorithms "
        "whose proof allows it (noisy-gd, dp-sgd/adam, dp-fedavg/fedopt, dp-ftrl)",
    )
    _add_data_arguments(run, d.dataset, d.seed, cat)
    _add_hyperparameters(run, algorithm, cat)


def _add_data_arguments(parser: argparse.ArgumentParser, dataset: str | None, seed: int | None, cat: dict) -> None:
    """The data options of ``fedkl run`` (``--dataset`` and ``--seed`` are added here for ``fedkl
    predict``, whose defaults are the model's own)."""
    if dataset is None:
        parser.add_argument(
            "--dataset",
            type=_dataset_type(cat),
            default=None,
            help=f"one of {', '.join(cat['datasets'])} or a data file (default: the model's)",
        )
        parser.add_argument("--seed", type=int, default=None, help="seed of the data split (default: the model's)")
    parser.add_argument("--users", type=_positive(int), default=None, help="number of users (synthetic datasets only)")
    parser.add_argument(
        "--partition",
        choices=("iid", "dirichlet", "shards"),
        default=None,
        help="mnist, fashion-mnist: how images are dealt to users: iid (default), dirichlet (alpha 0.5 label "
        "skew) or shards (sorted by label, two shards per user: McMahan et al. 2017, Geyer et al. 2017)",
    )
    data = parser.add_argument_group("your own data file (--dataset FILE; fedkl.data.files)")
    data.add_argument("--user-column", default=None, help="the column naming each record's user (the privacy unit)")
    data.add_argument("--label-column", default=None, help="the label column")
    data.add_argument(
        "--feature-columns", default=None, help="comma-separated feature columns (default: every other numeric one)"
    )
    data.add_argument("--task", choices=("binary", "multiclass", "regression"), default=None, help="default binary")
    data.add_argument(
        "--feature-bound",
        type=_positive(),
        default=None,
        help="public bound B on every record's ||x||_2 (default 1); features are divided by B",
    )
    data.add_argument("--label-bound", type=_positive(), default=None, help="public bound on |y| (regression)")
    data.add_argument(
        "--on-bound",
        choices=("refuse", "clip"),
        default=None,
        help="a record beyond a bound: refuse the file (default) or clip it (and say how many)",
    )


def build_parser(algorithm: str | None = None) -> argparse.ArgumentParser:
    """The ``fedkl`` parser; ``algorithm``: ``fedkl run --help`` lists that algorithm's flags only."""
    cat = catalog()
    parser = _Parser(prog="fedkl", description="Federated learning with user-level differential privacy.")
    sub = parser.add_subparsers(
        dest="command",
        metavar="{run,tune,plan,account,predict,ledger,deploy,sweep,plot,report,audit}",
        parser_class=_Parser,
    )
    sub.required = True

    _run_command(sub, algorithm, cat)
    for command in (_tune_command, _plan_command, _predict_command):
        command(sub, cat)
    for command in (_account_command, _ledger_command, _deploy_command, _sweep_command, _plot_command, _report_command):
        command(sub)
    _audit_command(sub, cat)
    parser.subcommands = sub.choices  # type: ignore[attr-defined]  # name -> its parser
    return parser


def _run_command(sub, algorithm: str | None, cat: dict) -> None:
    """``fedkl run``: the run options (of ``algorithm`` only, when given) and how the run starts."""
    run = sub.add_parser(
        "run",
        help="train a model with user-level DP and write result.json + ledger",
        description="Train a model with user-level differential privacy (one user = one "
        "unit of privacy) and write result.json and the privacy ledger.",
    )
    _add_run_arguments(run, algorithm, cat)
    run.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="start from the released model of RUN_DIR (its model.pt), on its ledger, with its settings "
        "(options left at their default take the run's; one that differs is refused); the only value reused "
        "is the released model",
    )
    run.add_argument(
        "--recover",
        default=None,
        metavar="RUN_DIR",
        help="finish the run of RUN_DIR whose process died (kill -9, power loss): re-run it with its own settings "
        "from its release journal and ledger; what it released before is returned from the journal and nothing is "
        "charged twice (not --resume: that starts a new run from a finished run's model); takes no other option",
    )


def _tune_command(sub, cat: dict) -> None:
    """``fedkl tune``: the run options as the base of every trial, and the search."""
    tune = sub.add_parser(
        "tune",
        help="private hyperparameter search: the best of a random number of trials, its whole cost one ledger charge",
        description="Pick the algorithm and its settings privately (fedkl/tuning.py): K random trials (K ~ truncated "
        "negative binomial or Poisson, Papernot & Steinke 2022), each trained on the training users of a public seeded "
        "split and scored on the validation users by a user-level DP score; only the best trial's model and settings "
        "are released. The whole search is charged once, to every user, before any trial (refused if it does not "
        "fit). The run options below are the base of every trial; a hyperparameter flag fixes that setting.",
    )
    _add_run_arguments(tune, None, cat)
    tune.add_argument(
        "--algorithms",
        default=None,
        metavar="A,B,...",
        help="the algorithms to search over (default: --algorithm); zCDP-charged algorithms only",
    )
    tune.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help="the values of one hyperparameter to search (repeatable), e.g. --grid lr=0.5,1,2 --grid clip=0.5,1; "
        "or a range drawn afresh per trial: --grid lr=log:0.1:10 (log-uniform), uniform:LO:HI, int:LO:HI",
    )
    _tune_law(tune)


def _tune_law(tune: argparse.ArgumentParser) -> None:
    """``fedkl tune``: the law of the number of trials, the validation split and the score bound."""
    tune.add_argument(
        "--trials", type=_positive(), default=5.0, help="expected number of trials E[K] (default %(default)s)"
    )
    tune.add_argument(
        "--stopping",
        choices=("tnb", "poisson"),
        default="tnb",
        help="law of the number of trials: tnb (truncated negative binomial, Theorem 2) or poisson (Theorem 6) "
        "(default %(default)s)",
    )
    tune.add_argument(
        "--eta", type=float, default=0.0, help="tnb's eta > -1 (default %(default)s: the logarithmic law)"
    )
    tune.add_argument(
        "--validation-fraction",
        type=_interval(0.0, 1.0, False),
        default=0.3,
        help="expected share of users held out to score the trials (default %(default)s)",
    )
    tune.add_argument(
        "--score-bound",
        type=_positive(),
        default=1.0,
        help="regression: each validation user's mean loss is clipped to [0, B] (default %(default)s)",
    )
    tune.add_argument(
        "--operator-view",
        action="store_true",
        help="also write trials.NOT_PUBLIC.csv/.png next to result.json: every trial's settings and private score, "
        "for the operator on the server only; NOT PUBLIC (the search's charge covers the selected trial only, and "
        "these reveal the number of trials) (default off: only what may be released is written)",
    )


def _plan_command(sub, cat: dict) -> None:
    """``fedkl plan``: the run options, the algorithms to rank, ``--charges``."""
    plan = sub.add_parser(
        "plan",
        help="before any budget is spent: each algorithm's noise against the signal, ranked",
        description="Build every algorithm (or --algorithms) as `fedkl run` would with these settings and rank them by "
        "their public noise-to-signal forecast; reads only public values (n, d, constants), charges nothing "
        "(fedkl/planner.py).",
    )
    _add_run_arguments(plan, None, cat)
    plan.add_argument(
        "--algorithms",
        default=None,
        metavar="A,B,...",
        help="the algorithms to compare (default: every registered one)",
    )
    plan.add_argument(
        "--charges",
        action="store_true",
        help="list every charge the run of --algorithm will make (mechanism, cost, users), from the run's own "
        "code on a public stand-in of the users (their ids, zero records); nothing of yours is read or charged",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")


def _predict_command(sub, cat: dict) -> None:
    """``fedkl predict``: a saved model and the data options."""
    predict = sub.add_parser(
        "predict",
        help="metrics of a saved model (model.pt) on a dataset",
        description="Load a model saved by `fedkl run` (RUN_DIR/model.pt: the released parameters, the problem and "
        "the privacy receipt) and print its metrics on a dataset's split (NOT private: evaluation only). The data "
        "options are fedkl run's; left out, they are the model's own run's.",
    )
    predict.add_argument("--model", required=True, metavar="PATH", help="a model.pt, or the run folder that holds it")
    _add_data_arguments(predict, None, None, cat)
    predict.add_argument("--split", choices=("test", "train"), default="test", help="which split (default test)")
    predict.add_argument("--json", action="store_true", help="print one JSON object")


def _account_command(sub) -> None:
    """``fedkl account``: privacy arithmetic."""
    acc = sub.add_parser(
        "account",
        help="(eps, delta) of a noise schedule, or the noise for a target eps",
        description="Privacy arithmetic with dp-accounting (PLD and RDP) and zCDP. Give --noise-multiplier to get "
        "epsilon, or --epsilon to get the noise multiplier; add --rho / --zcdp for zCDP conversions.",
    )
    acc.add_argument("--noise-multiplier", type=_positive(), help="sigma / sensitivity of each Gaussian step")
    acc.add_argument(
        "--epsilon", type=_positive(), help="target epsilon (solve for the noise multiplier, or rho with --zcdp)"
    )
    acc.add_argument(
        "--sampling-rate", type=_rate, default=1.0, help="Poisson user sampling rate q (default 1: everyone)"
    )
    acc.add_argument("--steps", type=_positive(int), default=1, help="number of Gaussian steps (default %(default)s)")
    acc.add_argument("--delta", type=_probability, required=True, help="target delta")
    acc.add_argument(
        "--accountant", choices=("pld", "rdp", "all"), default="all", help="dp-accounting accountant (default all)"
    )
    acc.add_argument(
        "--neighbouring",
        choices=("add-remove", "replace-one"),
        default="add-remove",
        help="neighbouring relation (default %(default)s, dp-accounting's)",
    )
    acc.add_argument("--rho", type=_positive(), help="convert rho-zCDP to (eps, delta) instead")
    acc.add_argument("--zcdp", action="store_true", help="with --epsilon: the rho-zCDP budget that converts to it")
    acc.add_argument("--json", action="store_true", help="print one JSON object")


def _ledger_command(sub) -> None:
    """``fedkl ledger``: inspect, verify, release stale runs."""
    ledger = sub.add_parser(
        "ledger",
        help="inspect a privacy ledger (budget, per-user spend, releases, runs), verify it, release stale runs",
        description="show: the budget, the most charged user, runs by status, verification; users: per-user spend "
        "(rho, (eps, delta) charges, epsilon by the budget's conversion and exact); releases: the release log; "
        "runs: every run and its status; verify: recompute every total from the release log (exit 3 if it does "
        "not match); release-stale: end, as interrupted, the running runs of this host whose process is gone "
        "(their reservation of the users' budget ends with them). Ledger problems exit 3 with one line.",
    )
    ledger.add_argument("action", choices=("show", "users", "releases", "runs", "verify", "release-stale"))
    ledger.add_argument("path", metavar="PATH", help="the ledger file (e.g. runs/<run>/ledger.sqlite)")
    ledger.add_argument("--json", action="store_true", help="print one JSON object (strict: no NaN/Infinity)")
    ledger.add_argument("--run", default=None, help="releases: only this run's")
    ledger.add_argument(
        "--limit",
        type=_positive(int),
        default=None,
        help="users: the N most charged; releases: the N latest (default all)",
    )


def _deploy_command(sub) -> None:
    """``fedkl deploy``: deployment helpers (certificates)."""
    deploy = sub.add_parser(
        "deploy",
        help="deployment helpers: certs writes a CA and the SuperLink's TLS certificate (and SuperNode keys)",
        description="certs: write DIR/ca.crt (a CA: every SuperNode's --root-certificates and the flwr "
        "connection's root-certificates), DIR/server.pem and DIR/server.key (the SuperLink's --ssl-certfile and "
        "--ssl-keyfile, --ssl-ca-certfile DIR/ca.crt), for localhost, 127.0.0.1 and every --host; with "
        "--node-keys N also node-0..N-1 .key/.pub pairs for --enable-supernode-auth. The CA's own key is not "
        "kept. Existing files are refused unless --force.",
    )
    deploy.add_argument("action", choices=("certs",))
    deploy.add_argument("folder", metavar="DIR", help="where the files are written (made if missing)")
    deploy.add_argument(
        "--host",
        action="append",
        default=[],
        help="a name or IP address the SuperLink is reached at (repeatable; localhost and 127.0.0.1 always)",
    )
    deploy.add_argument("--days", type=_positive(), default=365.0, help="validity in days (default %(default)s)")
    deploy.add_argument("--node-keys", type=int, default=0, metavar="N", help="also write N SuperNode key pairs")
    deploy.add_argument("--force", action="store_true", help="replace existing files")


def _sweep_command(sub) -> None:
    """``fedkl sweep``: a TOML sweep file into a table."""
    sweep = sub.add_parser(
        "sweep",
        help="run the cartesian product of a TOML sweep file into a CSV/JSON-lines table (resumable)",
        description="Run every point of a sweep file: top-level keys = the base `fedkl run` settings, [sweep] = lists "
        'of values (any setting) plus `table = "results.csv"`; an existing table is refused unless --resume '
        "(rows already in it are skipped) or --restart. "
        "See fedkl/experiments/__init__.py for the file format.",
    )
    sweep.add_argument("file", metavar="FILE.toml", help="the sweep file")
    sweep.add_argument("--table", default=None, help="write to this CSV instead of the file's [sweep] table")
    sweep.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=V1[,V2...]",
        help="replace an axis (or a base value) of the file, e.g. --set seed=0,1 (repeatable)",
    )
    sweep.add_argument("--resume", action="store_true", help="continue the table: run only the points not in it")
    sweep.add_argument("--restart", action="store_true", help="delete the table and run every point again")
    sweep.add_argument("--retry-errors", action="store_true", help="run again the points whose row records an error")
    sweep.add_argument("--dry-run", action="store_true", help="list the points and whether each is done; run nothing")
    sweep.add_argument("--max-runs", type=_positive(int), default=None, help="stop after this many new runs")
    sweep.add_argument("--verbose", action="store_true", help="print every run's own log")


def _plot_command(sub) -> None:
    """``fedkl plot``: a figure of a sweep table."""
    plot = sub.add_parser(
        "plot",
        help="PNG figure (and markdown table) of a sweep table: privacy-utility or log-log slope",
        description="privacy-utility: the test metric vs epsilon, mean +- std over seeds, per algorithm and dataset. "
        "slope: an error column vs users (log-log) with the fitted and the theory slope.",
    )
    plot.add_argument("table", metavar="TABLE.csv", help="a table written by fedkl sweep")
    plot.add_argument("--kind", choices=("privacy-utility", "slope"), required=True)
    plot.add_argument("--out", default=None, help="PNG path (default: TABLE with the kind and .png)")
    plot.add_argument("--x", default=None, help="x column (default epsilon_target / users)")
    plot.add_argument("--y", default=None, help="y column (default test_metric / excess_loss)")
    plot.add_argument("--group", default="algorithm", help="one line per value of this column (default %(default)s)")
    plot.add_argument(
        "--panel",
        default="dataset",
        help="privacy-utility: one panel per value of this column (default %(default)s; 'none': one panel)",
    )
    plot.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="COLUMN=VALUE",
        help="keep only rows with this value (repeatable)",
    )
    plot.add_argument("--theory-slope", type=float, default=None, help="slope: the theory's slope to draw")
    plot.add_argument("--theory-label", default="theory", help="slope: legend label of the theory line")
    plot.add_argument("--title", default=None)
    plot.add_argument("--markdown", default=None, metavar="FILE.md", help="also write the plotted numbers as markdown")


def _report_command(sub) -> None:
    """``fedkl report``: a study's report from its table."""
    report = sub.add_parser(
        "report",
        help="write a study's report (markdown, figures) from its sweep table, without training",
        description="Read the table of a study (a sweep file with a [report] table: a built-in kind or a "
        "function 'FILE.py:NAME') and write its outputs. See fedkl/experiments/report.py.",
    )
    report.add_argument("file", metavar="STUDY.toml", help="the study's sweep file")
    report.add_argument("--table", default=None, help="read this CSV instead of the file's [sweep] table")
    report.add_argument("--out-dir", default=None, help="write the outputs into this folder instead")


def _audit_command(sub, cat: dict) -> None:
    """``fedkl audit``: what is audited and how (:func:`_audit_sizes`: the claim and the sizes)."""
    audit = sub.add_parser(
        "audit",
        help="empirical lower bound on an algorithm's user-level epsilon from real runs, against its claim",
        description="Audit a registered algorithm on a small synthetic federation (fedkl/audit/): many-run "
        "(R trainings on each of two datasets that differ in one outlier user) or one-run (one training with "
        "canary users, Steinke et al. 2023), or the one-shot estimate (Andrew et al. 2023; no confidence). Prints the claimed (eps, delta), the empirical lower bound at the "
        "stated one-sided confidence and a verdict; writes audit.json, histogram.png and statistics.jsonl "
        "(resumable) under --out.",
    )
    who = audit.add_mutually_exclusive_group(required=True)
    who.add_argument("--algorithm", choices=tuple(cat["algorithms"]), help="the algorithm to audit")
    who.add_argument("--all", action="store_true", help="audit every registered algorithm (OUT/<algorithm>/)")
    audit.add_argument(
        "--method",
        choices=("many-run", "one-run", "one-shot", "white-box"),
        default="many-run",
        help="many-run / one-run: lower bounds; one-shot: Andrew et al.'s estimate (no confidence); white-box: "
        "realised sensitivity on adversarial neighbours and the noise drawn vs each release's charge, no "
        "sampling (fedkl/audit/whitebox.py) (default %(default)s)",
    )
    audit.add_argument(
        "--noise-scale",
        type=_positive(),
        default=1.0,
        help="white-box: scale world D's noise by this (0.5: the 2x-too-little-noise negative control) (default 1)",
    )
    audit.add_argument(
        "--expect",
        choices=("pass", "violation"),
        default="pass",
        help="exit 0 when every verdict is a pass (default) or, for a negative control, a VIOLATION",
    )
    _audit_sizes(audit)


def _audit_sizes(audit: argparse.ArgumentParser) -> None:
    """``fedkl audit``: the claimed (eps, delta), the runs, canaries and users, the output."""
    audit.add_argument(
        "--epsilon",
        type=_positive(),
        default=None,
        help="claimed user-level epsilon (default: the algorithm's small audit in fedkl/audit/settings.py)",
    )
    audit.add_argument("--delta", type=_probability, default=None, help="claimed delta (default 1/n^1.1)")
    audit.add_argument("--runs", type=_positive(int), default=100, help="many-run: trainings per dataset (default 100)")
    audit.add_argument(
        "--canaries", type=_positive(int), default=200, help="one-run, one-shot: canary users (default 200)"
    )
    audit.add_argument(
        "--guesses", type=_positive(int), default=None, help="one-run: guesses each way (default canaries/10)"
    )
    audit.add_argument(
        "--users",
        type=_positive(int),
        default=None,
        help="ordinary users besides the audited ones (default: many-run the small audit's, else 40)",
    )
    audit.add_argument("--confidence", type=_probability, default=0.95, help="one-sided confidence (default 0.95)")
    audit.add_argument("--seed", type=int, default=0, help="seed of the data, the split and the noise (default 0)")
    audit.add_argument("--out", default="audit", help="output folder (default %(default)s)")
    audit.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a `fedkl run` setting of the audited runs over the small setting of fedkl/audit/settings.py "
        "(reg 0.1, clip 0.1, radius 5), e.g. --set clip=0.5 (repeatable)",
    )


if __name__ == "__main__":  # python -m fedkl.flags: rewrite flags_catalog.json from the code
    live = live_catalog()  # before the file is opened for writing: the algorithm registry reads it
    with open(CATALOG_PATH, "w", encoding="utf-8") as out:
        json.dump(live, out, indent=1)
        out.write("\n")
    print(f"wrote {CATALOG_PATH}")
