"""The ``fedkl`` command line: ``fedkl run`` (train) and ``fedkl account`` (privacy arithmetic).

Bad arguments exit with code 2 and one line that says what is wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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
    common = {
        "sampling_rate": args.sampling_rate,
        "steps": args.steps,
        "delta": args.delta,
        "neighbouring": args.neighbouring,
        "accountants": {n: accounting.describe_accountant(n) for n in names},
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


def _experiments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``fedkl sweep`` and ``fedkl plot`` (fedkl/experiments/)."""
    from fedkl import experiments

    sub = parser.subcommands[args.command]  # type: ignore[attr-defined]
    try:
        if args.command == "sweep":
            spec = experiments.load_sweep(args.file, table=args.table, sets=args.set)
            res = experiments.run_sweep(
                spec,
                log=lambda s: print(s, flush=True),
                restart=args.restart,
                dry_run=args.dry_run,
                verbose=args.verbose,
                max_runs=args.max_runs,
                retry_errors=args.retry_errors,
            )
            return 1 if res["errors"] else 0
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
        k: v for k, v in vars(args).items() if k not in ("command", "config", "no_reference", "algorithms", "json")
    }
    settings["reference"] = not args.no_reference
    return settings


def _plan(args: argparse.Namespace) -> int:
    from fedkl.planner import format_plan, plan

    names = None if args.algorithms is None else [a.strip() for a in args.algorithms.split(",") if a.strip()]
    try:
        result = plan(_run_settings(args), names)
    except ValueError as e:
        print(f"fedkl plan: error: {e} (see 'fedkl plan --help')", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def _audit(args: argparse.Namespace, sub: argparse.ArgumentParser) -> int:
    """``fedkl audit`` (fedkl/audit/): one algorithm or every registered one; exit 1 on a VIOLATION
    or an algorithm's error."""
    import tomllib

    from fedkl.algorithms.catalog import REGISTRY
    from fedkl.audit import format_report, many_run_audit, one_run_audit, one_shot_estimate
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
        "base": args.users,
        "log": lambda s: print(s, flush=True),
    }
    verdicts = []
    for name in names:
        out = os.path.join(args.out, name) if args.all else args.out
        own = {k: v for k, v in settings.items() if not args.all or k in _run_keys_of(name)}
        try:
            if args.method == "many-run":
                report = many_run_audit(name, args.epsilon, out, runs=args.runs, settings=own, **common)
            elif args.method == "one-shot":
                estimate = {k: v for k, v in common.items() if k != "confidence"}  # an estimate: no confidence
                report = one_shot_estimate(name, args.epsilon, out, canaries=args.canaries, settings=own, **estimate)
            else:
                report = one_run_audit(
                    name, args.epsilon, out, canaries=args.canaries, guesses=args.guesses, settings=own, **common
                )
        except ValueError as e:
            sub.error(str(e))
        print(format_report(report), flush=True)
        verdicts.append(report["verdict"])
    return 1 if {"VIOLATION", "failed"} & set(verdicts) else 0


def _run_keys_of(algorithm: str) -> set[str]:
    """The flat settings ``algorithm``'s runs take (run-level fields and its own hyperparameters)."""
    import dataclasses

    from fedkl.algorithms.catalog import REGISTRY
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
    if args.command in ("sweep", "plot"):
        return _experiments(args, parser)
    if args.command in ("run", "plan") and args.config:
        from fedkl.experiments import ConfigError, apply_config_file

        try:
            apply_config_file(args, argv)
        except ConfigError as e:
            parser.subcommands["run"].error(f"--config: {e}")  # type: ignore[attr-defined]
    if args.command == "plan":
        return _plan(args)
    if args.command == "audit":
        return _audit(args, parser.subcommands["audit"])  # type: ignore[attr-defined]
    if args.command == "account":
        res = _account(args, parser.subcommands["account"])  # type: ignore[attr-defined]
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            _print_account(res)
        return 0

    from fedkl.privacy import BudgetExhausted, LedgerError
    from fedkl.runner import RunConfig, run_training

    try:
        cfg = RunConfig.from_settings(**_run_settings(args))
    except ValueError as e:
        print(f"fedkl run: error: {e} (see 'fedkl run --algorithm {args.algorithm} --help')", file=sys.stderr)
        return 2
    try:
        if cfg.backend != "inprocess":
            import fedkl.flower.backends  # noqa: F401  (registers the Flower backends)
        run_training(cfg, log=lambda s: print(s, flush=True))
    except (BudgetExhausted, LedgerError) as e:
        print(f"fedkl run: error: {e}", file=sys.stderr)
        return 3
    except ValueError as e:
        print(f"fedkl run: error: {e} (see 'fedkl run --help')", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
