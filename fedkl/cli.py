"""The ``fedkl`` command line: ``fedkl run`` (train), ``fedkl account`` (privacy arithmetic), ``fedkl
ledger`` (inspect a ledger) ...

Bad arguments exit with code 2 and one line that says what is wrong and how to fix it; budget and
ledger problems exit with 3; an interrupted ``fedkl run`` (Ctrl-C, SIGTERM) with 128 + the signal
(130 for Ctrl-C) and one line saying what was charged and released.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from fedkl.flags import build_parser  # noqa: E402


def _account(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    from fedkl.privacy import accounting, zcdp

    names = ("pld", "rdp") if args.accountant == "all" else (args.accountant,)
    if args.rho is not None:
        return {
            "question": "epsilon of rho-zCDP",
            "rho": args.rho,
            "delta": args.delta,
            "epsilon": {c: zcdp.zcdp_to_eps(args.rho, args.delta, c) for c in zcdp.CONVERSIONS},
            "accountant": "zCDP conversions: cks = Canonne-Kamath-Steinke 2020, bun_steinke = Bun-Steinke 2016",
        }
    if args.zcdp:
        if args.epsilon is None:
            parser.error("--zcdp needs --epsilon (the target to convert)")
        return {
            "question": "rho-zCDP budget for (eps, delta)",
            "epsilon": args.epsilon,
            "delta": args.delta,
            "rho": {c: zcdp.rho_for_eps_delta(args.epsilon, args.delta, c) for c in zcdp.CONVERSIONS},
            "accountant": "zCDP conversions: cks = Canonne-Kamath-Steinke 2020, bun_steinke = Bun-Steinke 2016",
        }
    if (args.noise_multiplier is None) == (args.epsilon is None):
        parser.error(
            "give exactly one of --noise-multiplier (to get epsilon) or --epsilon (to get the noise multiplier)"
        )
    try:
        unit = accounting.GaussianSchedule(1.0, args.sampling_rate, args.steps, args.neighbouring)
    except ValueError as e:
        parser.error(str(e))
    skipped = [n for n in names if len(names) > 1 and not accounting.supports(unit, n)]
    names = tuple(n for n in names if n not in skipped)
    common = {
        "sampling_rate": args.sampling_rate,
        "steps": args.steps,
        "delta": args.delta,
        "neighbouring": args.neighbouring,
        "noise_multiplier_convention": accounting.MULTIPLIER_CONVENTION,
        "accountants": {n: accounting.describe_accountant(n) for n in names},
        **(
            {"not_supported": {n: f"no analysis of this schedule under {args.neighbouring}" for n in skipped}}
            if skipped
            else {}
        ),
    }
    try:
        if args.noise_multiplier is not None:
            schedule = accounting.GaussianSchedule(
                args.noise_multiplier, args.sampling_rate, args.steps, args.neighbouring
            )
            return {
                "question": "epsilon of a Gaussian schedule",
                "noise_multiplier": args.noise_multiplier,
                **common,
                "epsilon": {n: accounting.schedule_epsilon(schedule, args.delta, n) for n in names},
            }
        return {
            "question": "noise multiplier for a target epsilon",
            "epsilon": args.epsilon,
            **common,
            "noise_multiplier": {
                n: accounting.noise_multiplier_for(
                    args.epsilon, args.delta, args.sampling_rate, args.steps, n, args.neighbouring
                )
                for n in names
            },
        }
    except ValueError as e:
        parser.error(str(e))
    raise AssertionError("unreachable")


def _print_account(res: dict) -> None:
    print(res["question"])
    for key in ("noise_multiplier", "epsilon", "rho"):
        value = res.get(key)
        if isinstance(value, dict):
            for name, v in value.items():
                label = res.get("accountants", {}).get(name, name)
                print(f"  {key} = {v:.6g}   [{label}]")
    given = {
        k: res[k]
        for k in ("noise_multiplier", "epsilon", "rho", "sampling_rate", "steps", "delta", "neighbouring")
        if k in res and not isinstance(res[k], dict)
    }
    print("  given: " + ", ".join(f"{k}={v}" for k, v in given.items()))
    if "noise_multiplier_convention" in res:
        print(f"  noise multiplier: {res['noise_multiplier_convention']}")
    for name, why in res.get("not_supported", {}).items():
        print(f"  {name}: {why} (dp-accounting)")


def _experiments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``fedkl sweep``, ``fedkl plot`` and ``fedkl report`` (fedkl/experiments/)."""
    from fedkl import experiments

    sub = parser.subcommands[args.command]  # type: ignore[attr-defined]
    try:
        if args.command == "sweep":
            spec = experiments.load_sweep(args.file, table=args.table, sets=args.set)
            res = experiments.run_sweep(
                spec,
                log=lambda s: print(s, flush=True),
                restart=args.restart,
                resume=args.resume,
                dry_run=args.dry_run,
                verbose=args.verbose,
                max_runs=args.max_runs,
                retry_errors=args.retry_errors,
            )
            return 1 if res["errors"] else 0
        if args.command == "report":
            from fedkl.experiments.report import run_report

            print("wrote " + ", ".join(run_report(args.file, table=args.table, out_dir=args.out_dir)))
            return 0
        out = args.out or f"{os.path.splitext(args.table)[0]}_{args.kind}.png"
        res = experiments.plot_table(
            args.table,
            args.kind,
            out,
            x=args.x,
            y=args.y,
            group=args.group,
            panel=None if args.panel.lower() == "none" else args.panel,
            where=args.where,
            theory_slope=args.theory_slope,
            theory_label=args.theory_label,
            title=args.title,
            markdown=args.markdown,
        )
        if args.kind == "slope":
            for group, fit in res.items():
                print(
                    f"{group}: fitted slope {fit['slope']:.4f}"
                    + (f" (theory {args.theory_slope:g})" if args.theory_slope is not None else "")
                    + (f"; {fit['dropped']} non-positive point(s) dropped" if fit["dropped"] else "")
                )
        print(f"wrote {out}" + (f" and {args.markdown}" if args.markdown else ""))
        return 0
    except experiments.ConfigError as e:
        sub.error(str(e))
    raise AssertionError("unreachable")


def _run_settings(args: argparse.Namespace) -> dict:
    """The flat ``fedkl run`` settings of parsed ``run``/``plan`` options."""
    settings = {
        k: v
        for k, v in vars(args).items()
        if k not in ("command", "config", "no_reference", "algorithms", "json", "charges", "resume", "recover")
        and k not in _TUNE_ONLY
    }
    settings["reference"] = not args.no_reference
    return settings


_TUNE_ONLY = ("grid", "trials", "stopping", "eta", "validation_fraction", "score_bound", "operator_view")


def _tune(args: argparse.Namespace, argv: list[str]) -> int:
    """``fedkl tune``: the private search of :mod:`fedkl.tuning`. Exit 2 on a bad option or search
    space, 3 when the search does not fit the budget or the ledger refuses it."""
    from fedkl.privacy import BudgetExhausted, LedgerError
    from fedkl.tuning import run_settings_and_grid, tune

    names = (
        [args.algorithm] if args.algorithms is None else [a.strip() for a in args.algorithms.split(",") if a.strip()]
    )
    try:
        cfg, grid = run_settings_and_grid(_run_settings(args), names, args.grid)
        tune(
            cfg, names, grid, trials=args.trials, stopping=args.stopping, eta=args.eta,
            validation_fraction=args.validation_fraction, score_bound=args.score_bound,
            operator_view=args.operator_view, log=lambda s: print(s, flush=True),
        )  # fmt: skip
    except (BudgetExhausted, LedgerError) as e:
        print(f"fedkl tune: error: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"fedkl tune: error: {e} (see 'fedkl tune --help')", file=sys.stderr)
        return 2
    return 0


def _plan(args: argparse.Namespace) -> int:
    from fedkl.planner import charge_plan, format_charge_plan, format_plan, plan

    names = None if args.algorithms is None else [a.strip() for a in args.algorithms.split(",") if a.strip()]
    try:
        if args.charges:
            from fedkl.runner import RunConfig

            result = charge_plan(RunConfig.from_settings(**_run_settings(args)))
            text = format_charge_plan(result)
        else:
            result = plan(_run_settings(args), names)
            text = format_plan(result)
    except ValueError as e:
        print(f"fedkl plan: error: {e} (see 'fedkl plan --help')", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else text)
    return 0


def _predict(args: argparse.Namespace) -> int:
    """``fedkl predict``: a saved model's metrics on a dataset (the model's own by default)."""
    from fedkl.data import DATASETS
    from fedkl.data.files import SCHEMA_SETTINGS, is_data_file
    from fedkl.runner import RunConfig, load_run_dataset
    from fedkl.saved_model import load_model, model_file

    try:
        model = load_model(model_file(args.model))
        saved = model.receipt["settings"]
        if args.dataset is None and saved["dataset"] not in DATASETS and not is_data_file(saved["dataset"]):
            raise ValueError(
                f"the model was trained on your own data ({saved['dataset']!r}): give --dataset, or evaluate it "
                "in Python with fedkl.load_model(PATH).evaluate(data)"
            )
        dataset_name = args.dataset or saved["dataset"]
        # a data file's schema: what is given here, else the model's own (the same file read the same way)
        schema = {
            k: getattr(args, k) if getattr(args, k) is not None or args.dataset else saved.get(k)
            for k in SCHEMA_SETTINGS
        }
        cfg = RunConfig(
            dataset=dataset_name,
            seed=saved["seed"] if args.seed is None else args.seed,
            users=args.users if args.users is not None or args.dataset else saved.get("users"),
            partition=args.partition if args.partition is not None or args.dataset else saved.get("partition"),
            **(schema if is_data_file(dataset_name) else {}),
        )
        dataset = load_run_dataset(cfg)
        metrics = model.evaluate(dataset, args.split)
    except (ValueError, KeyError) as e:
        print(f"fedkl predict: error: {e} (see 'fedkl predict --help')", file=sys.stderr)
        return 2
    r = model.receipt
    if args.json:
        print(json.dumps({"model": args.model, "dataset": cfg.dataset, "split": args.split, "metrics": metrics}))
        return 0
    print(
        f"model {args.model}: {r['algorithm']} (run {r['run_id']}), user-level ({r['neighbouring']}) "
        f"epsilon = {r['epsilon']:.4f}, delta = {r['delta']:.3g}"
    )
    print(f"{cfg.dataset} {args.split}: " + ", ".join(f"{k} = {v:.6g}" for k, v in metrics.items()))
    return 0


def _audit(args: argparse.Namespace, sub: argparse.ArgumentParser) -> int:
    """``fedkl audit`` (fedkl/audit/): one algorithm or every registered one; exit 1 on a VIOLATION
    or an algorithm's error."""
    import tomllib

    from fedkl.algorithms.catalog import REGISTRY
    from fedkl.audit import format_report, many_run_audit, one_run_audit, one_shot_estimate
    from fedkl.audit.settings import small_audit
    from fedkl.experiments.config import ConfigError, field_name, run_settings

    raw = {}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            sub.error(f"--set {item!r}: expected KEY=VALUE")
        try:
            raw[field_name(key.strip())] = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            raw[field_name(key.strip())] = text.strip()
    try:
        settings = run_settings(raw, "--set")
    except ConfigError as e:
        sub.error(str(e))
    if args.delta is not None:
        settings["delta"] = args.delta
    names = list(REGISTRY) if args.all else [args.algorithm]
    common = {
        "confidence": args.confidence,
        "seed": args.seed,
        "log": lambda s: print(s, flush=True),
    }
    if args.users is not None:  # else each audit's own (many-run: the algorithm's small audit)
        common["base"] = args.users
    verdicts, caught = [], []
    for name in names:
        out = os.path.join(args.out, name) if args.all else args.out
        own = {k: v for k, v in settings.items() if not args.all or k in _run_keys_of(name)}
        eps = small_audit(name).epsilon if args.epsilon is None else args.epsilon
        try:
            if args.method == "many-run":
                report = many_run_audit(name, eps, out, runs=args.runs, settings=own, **common)
            elif args.method == "white-box":
                from fedkl.audit.whitebox import white_box_audit

                report = white_box_audit(
                    name, eps, out, settings=own, seed=args.seed, noise_scale=args.noise_scale,
                    users=args.users, log=common["log"],
                )  # fmt: skip
            elif args.method == "one-shot":
                estimate = {k: v for k, v in common.items() if k != "confidence"}  # an estimate: no confidence
                report = one_shot_estimate(name, eps, out, canaries=args.canaries, settings=own, **estimate)
            else:
                report = one_run_audit(
                    name, eps, out, canaries=args.canaries, guesses=args.guesses, settings=own, **common
                )
        except ValueError as e:
            sub.error(str(e))
        print(format_report(report), flush=True)
        verdicts.append(report["verdict"])
        # a negative control is caught by what it breaks: the white-box audit must flag the noise itself
        caught.append(report["verdict"] == "VIOLATION" and report.get("noise_problems", 1) > 0)
    if args.expect == "violation":  # a negative control: every audited algorithm must be caught
        missed = [n for n, c in zip(names, caught) if not c]
        if missed:
            print(f"negative control NOT caught on: {', '.join(missed)}", flush=True)
        return 1 if missed else 0
    return 1 if {"VIOLATION", "failed"} & set(verdicts) else 0


def _run_keys_of(algorithm: str) -> set[str]:
    """The flat settings ``algorithm``'s runs take (run-level fields and its own hyperparameters)."""
    import dataclasses

    from fedkl.algorithms.registry import REGISTRY  # this algorithm's module only
    from fedkl.runner import RunConfig

    run_level = {f.name for f in dataclasses.fields(RunConfig)} - {"params"}
    return run_level | {f.name for f in dataclasses.fields(REGISTRY[algorithm].params)}


def _algorithm_in(argv: list[str]) -> str | None:
    """The ``--algorithm`` value of a ``fedkl run`` command line (for ``--help``), else None."""
    for i, arg in enumerate(argv):
        if arg == "--algorithm" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--algorithm="):
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_algorithm_in(argv) if argv[:1] == ["run"] else None)
    args = parser.parse_args(argv)
    if args.command in ("sweep", "plot", "report"):
        return _experiments(args, parser)
    if args.command in ("run", "plan") and args.config:
        from fedkl.experiments import ConfigError, apply_config_file

        try:
            apply_config_file(args, argv)
        except ConfigError as e:
            parser.subcommands["run"].error(f"--config: {e}")  # type: ignore[attr-defined]
    if args.command == "plan":
        return _plan(args)
    if args.command == "tune":
        return _tune(args, argv)
    if args.command == "ledger":
        from fedkl.ledger_cli import ledger_command

        return ledger_command(args)
    if args.command == "predict":
        return _predict(args)
    if args.command == "deploy":
        return _deploy_certs(args)
    if args.command == "audit":
        return _audit(args, parser.subcommands["audit"])  # type: ignore[attr-defined]
    if args.command == "account":
        res = _account(args, parser.subcommands["account"])  # type: ignore[attr-defined]
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            _print_account(res)
        return 0

    from fedkl.runner import RunConfig

    if args.recover is not None:
        if [a for a in argv[1:] if a.startswith("--") and a.split("=")[0] not in ("--recover", "--ray-address")]:
            print(
                "fedkl run: error: --recover takes no other option but --ray-address (the run keeps its own settings)",
                file=sys.stderr,
            )
            return 2
        return _train(None, recover=args.recover, ray_address=args.ray_address)
    try:
        settings = _run_settings(args)
        if args.resume is not None:  # the resumed run's settings; the options given here on top
            from fedkl.saved_model import resume_settings

            run = parser.subcommands["run"]  # type: ignore[attr-defined]
            given = {k: v for k, v in settings.items() if v != run.get_default(k) and k != "reference"}
            settings = resume_settings(args.resume, {**given, "reference": settings["reference"]})
        cfg = RunConfig.from_settings(**settings)
    except ValueError as e:
        print(f"fedkl run: error: {e} (see 'fedkl run --algorithm {args.algorithm} --help')", file=sys.stderr)
        return 2
    return _train(cfg, args.resume)


def _deploy_certs(args) -> int:
    """``fedkl deploy certs DIR``: the files, then the Flower commands that use them (one line each)."""
    from pathlib import Path

    from fedkl.flower.deploy import deployment_certificates

    if args.node_keys < 0:
        print("fedkl deploy: error: --node-keys must be >= 0", file=sys.stderr)
        return 2
    try:
        paths = deployment_certificates(Path(args.folder).resolve(), args.host, args.days, args.node_keys, args.force)
    except (FileExistsError, ValueError) as e:
        print(f"fedkl deploy: error: {e}", file=sys.stderr)
        return 2
    ca, cert, key = paths["ca"], paths["cert"], paths["key"]
    host = args.host[0] if args.host else "127.0.0.1"
    print(f"wrote {ca} (the CA: give it to every SuperNode and flwr), {cert} and {key} (0600: the SuperLink's only)")
    if args.node_keys:
        print(f"wrote node-0 .. node-{args.node_keys - 1} key pairs in {ca.parent} (.key to its node only, 0600)")
    print(
        f"SuperLink: flower-superlink --ssl-ca-certfile {ca} --ssl-certfile {cert} --ssl-keyfile {key} --host 0.0.0.0 --port 8000"
    )
    print(f"SuperNode: flower-supernode --root-certificates {ca} --superlink {host}:8000 ...")
    print(f'flwr:      $FLWR_HOME/config.toml [superlink.<name>] address = "{host}:8000", root-certificates = "{ca}"')
    return 0


def _register_backend(cfg) -> None:
    if cfg.backend != "inprocess":
        import fedkl.flower.backends  # noqa: F401  (registers the Flower backends)


def _train(cfg, resume: str | None = None, recover: str | None = None, ray_address: str | None = None) -> int:
    """``fedkl run`` with its configuration parsed: train, with a progress bar on a terminal; a
    budget or ledger problem exits 3, Ctrl-C (or SIGTERM) one line and 128 + the signal."""
    from fedkl.privacy import BudgetExhausted, LedgerError
    from fedkl.privacy.journal import JournalError
    from fedkl.run_progress import make_observer
    from fedkl.runner import RUN_OBSERVER, recover_run, run_training

    observer = make_observer(sys.stderr)
    token = RUN_OBSERVER.set(observer)
    received = []

    def terminate(signum, frame):  # SIGTERM ends the run as Ctrl-C does: the ledger marks it interrupted
        received.append(signum)
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    if main_thread:
        signal.signal(signal.SIGTERM, terminate)
    try:
        if recover is not None:
            recover_run(recover, log=lambda s: print(s, flush=True), before=_register_backend, ray_address=ray_address)
            return 0
        _register_backend(cfg)
        run_training(cfg, log=lambda s: print(s, flush=True), resume=resume)
    except KeyboardInterrupt:
        if main_thread:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the report short
        observer.close()
        print(observer.interrupted_line(), file=sys.stderr, flush=True)
        return 128 + (received[0] if received else signal.SIGINT)
    except (BudgetExhausted, LedgerError, JournalError) as e:
        print(f"fedkl run: error: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"fedkl run: error: {e} (see 'fedkl run --help')", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a deployment that failed (e.g. the ServerApp's reason): one line, non-zero
        if cfg is None or cfg.backend != "grpc":
            raise
        print(f"fedkl run: error: {e}", file=sys.stderr)
        return 1
    finally:
        observer.close()
        RUN_OBSERVER.reset(token)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
