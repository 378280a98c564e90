"""``fedkl ledger show|users|releases|runs|verify|release-stale PATH``: look at a privacy ledger without
SQL, as a table or (``--json``) as one strict JSON object. A ledger problem (missing, locked,
corrupt, not verifying) is one line on stderr and exit code 3."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from fedkl.privacy import LedgerError, PrivacyLedger


def _finite(obj):
    """``obj`` with every non-finite float as None (strict JSON has no Infinity/NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Rows as an aligned text table with a header (``-`` for a missing value)."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _when(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _verification(ledger: PrivacyLedger) -> dict:
    try:
        ledger.verify()
    except LedgerError as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True, "error": None}


def ledger_report(action: str, path: str, run: str | None = None, limit: int | None = None) -> dict:
    """The JSON object that ``fedkl ledger ACTION PATH --json`` prints."""
    with PrivacyLedger(path) as ledger:
        if action == "release-stale":
            return {"path": path, **ledger.release_stale()}
        with ledger.snapshot():  # one moment of the ledger, while runs may charge it
            return _report(ledger, action, path, run, limit)


def _report(ledger: PrivacyLedger, action: str, path: str, run: str | None, limit: int | None) -> dict:
    if action == "verify":
        return {"path": path, "releases": ledger.num_releases(), **_verification(ledger)}
    if action == "users":
        return {"path": path, "budget": ledger.summary()["budget"], "users": ledger.user_spends(limit)}
    if action == "releases":
        rows = ledger.releases(run)
        return {"path": path, "run": run, "releases": rows[-limit:] if limit else rows}
    runs = [{**r, "started": _when(r["started"]), "ended": _when(r["ended"])} for r in ledger.runs()]
    if action == "runs":
        return {"path": path, "runs": runs}
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {
        "path": path,
        **ledger.summary(),
        "runs": statuses,
        "active_runs": [r for r in runs if r["status"] == "running"],
        "verify": _verification(ledger),
    }


def _print_report(action: str, res: dict) -> None:
    if action == "show":
        b = res["budget"]
        print(f"ledger {res['path']}")
        print(f"  budget: eps = {b['epsilon']:g}, delta = {b['delta']:g} per user ({b['conversion']} conversion)")
        print(f"  users charged: {res['users_charged']}; releases: {res['releases']}")
        print(
            f"  most charged user: eps = {res['max_user_epsilon']:.6g} by the budget's conversion, "
            f"{res['max_user_epsilon_exact']:.6g} exact; rho = {res['max_user_rho']:.6g}"
        )
        print("  runs: " + (", ".join(f"{n} {s}" for s, n in sorted(res["runs"].items())) or "none"))
        for r in res["active_runs"]:
            print(f"  active: run {r['run_id']} (pid {r['pid']} on {r['host']}, started {r['started']})")
        v = res["verify"]
        print("  verify: " + ("ok (every total recomputed from the release log)" if v["ok"] else v["error"]))
    elif action == "users":
        cols = ["user_id", "releases", "rho", "eps", "delta", "epsilon", "epsilon_exact"]
        print(format_table(res["users"], cols))
    elif action == "releases":
        cols = [
            "id",
            "run_id",
            "seq",
            "label",
            "mechanism",
            "sensitivity",
            "noise_scale",
            "rho",
            "eps",
            "delta",
            "users",
        ]
        if any(r["state"] for r in res["releases"]):  # an older version's 'prepaid'/'unused' rows (still charged)
            cols.append("state")
        print(format_table(res["releases"], cols))
    elif action == "runs":
        cols = ["run_id", "status", "started", "ended", "pid", "host", "releases", "reserved_users", "note"]
        print(format_table(res["runs"], cols))
    elif action == "release-stale":
        for run_id in res["released"]:
            print(f"released run {run_id}: its process is gone; marked interrupted")
        for k in res["kept"]:
            print(f"kept run {k['run_id']}: {k['why']}")
        if not res["released"] and not res["kept"]:
            print("no running run: nothing to release")


def ledger_command(args: argparse.Namespace) -> int:
    """``fedkl ledger``: 0 on success; 3 (one line on stderr) for a ledger problem or a failed verify."""
    try:
        res = ledger_report(args.action, args.path, args.run, args.limit)
    except LedgerError as e:
        print(f"fedkl ledger: error: {e}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(_finite(res), indent=2, allow_nan=False, default=str))
    else:
        _print_report(args.action, res)
    if args.action == "verify":
        if not res["ok"]:
            print(f"fedkl ledger: error: {res['error']}", file=sys.stderr)
            return 3
        if not args.json:
            print(f"ledger {args.path} verifies: {res['releases']} releases, every total recomputed from the log")
    return 0
