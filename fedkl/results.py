"""result.json as strict JSON, and the non-private reference computed once per dataset and problem.

Strict JSON: result.json never holds ``NaN`` / ``Infinity`` literals (they are not JSON). A
non-finite float is written as the STRING ``"nan"``, ``"inf"`` or ``"-inf"`` (``float()`` reads
each back); everything else that is not JSON (paths, tuples) is written as its ``str``.

The non-private reference (the exact minimizer of the training objective, NOT private) depends only
on the training data and the problem, so its test metrics are cached under ``$FEDKL_CACHE_DIR``
(default ``~/.cache/fedkl``), keyed by a hash of the problem spec and the train/test tensors: a
second run on the same data and problem reads it instead of training it again.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
from typing import Callable

from fedkl.algorithms.nonprivate import nonprivate_fedavg, nonprivate_minimizer
from fedkl.algorithms.round_log import NOT_PUBLIC
from fedkl.data.base import FederatedDataset
from fedkl.federation.inprocess import InProcessFederation

_CACHE_VERSION = 1  # bump when the reference's optimizer or metrics change


def strict(value):
    """``value`` with every non-finite float replaced by its string (module docstring)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, float):
        return value
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "ndim", 1) == 0:
        return strict(item())
    return str(value)


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` as strict JSON, atomically (a reader sees the old file or the new one)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(strict(payload), f, indent=2, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


METRICS_FILES = ("metrics.jsonl", "metrics.csv", "curves.png")  # what write_round_metrics writes in a run's folder
TENSORBOARD_DIR = "tensorboard"  # its TensorBoard event files, where the tensorboard package is installed


def round_rows(history: list | None) -> list[dict]:
    """One row per round record of a run's history (:mod:`fedkl.algorithms.round_log`: the progress records the
    run already handed out): ``round`` first (the record's, else its position), then the record's scalar fields
    (numbers, strings, booleans) in its own order, strict (a non-finite float as its string); a list or dict field
    (a release's own details) and a field that is not public (``round_log.NOT_PUBLIC``: a secret sample's size)
    are left out."""
    rows = []
    for i, rec in enumerate(history or (), 1):
        if not isinstance(rec, dict):
            continue
        row = {"round": strict(rec.get("round", i))}
        for k, v in rec.items():
            v = strict(v)
            if k != "round" and k not in NOT_PUBLIC and (isinstance(v, (int, float, str, bool)) or v is None):
                row[str(k)] = v
        rows.append(row)
    return rows


def _curves(rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """``{field: [(round, value)]}`` of every numeric field but ``round``/``rounds`` (finite values only)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        x = row["round"]
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            continue
        for k, v in row.items():
            if k in ("round", "rounds") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if math.isfinite(v):
                out.setdefault(k, []).append((x, v))
    return out


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display): imported when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def savefig(fig, out: str, dpi: int = 120) -> None:
    """Save ``fig`` as ``out`` (its folder made)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)


def _tick(v: float) -> str:
    return f"{v:.3g}"


def draw_curves(curves: dict[str, list[tuple[float, float]]], png: str, title: str = "") -> None:
    """Write ``curves`` (``{field: [(round, value)]}``) as one PNG, a panel per field (at most three across),
    each a line against the round with its lowest, middle and highest value marked. Drawn with Pillow, not
    matplotlib: matplotlib's import and layout cost 0.75 CPU s, a third of a 1,000-user run's whole process
    (issue 34, simulations/bench_startup.py); Pillow's drawing costs ~0.05 s."""
    from PIL import Image, ImageDraw, ImageFont

    try:
        font = ImageFont.load_default(size=11)
    except (TypeError, ImportError, OSError):  # a Pillow built without FreeType: its fixed bitmap font
        font = ImageFont.load_default()
    pw, ph, top = 290, 210, (22 if title else 0)
    cols = min(len(curves), 3) or 1
    nrows = max(1, math.ceil(len(curves) / cols))
    img = Image.new("RGB", (pw * cols, ph * nrows + top), "white")
    draw = ImageDraw.Draw(img)
    if title:
        draw.text((img.width // 2, 6), title, fill="black", font=font, anchor="mt")
    for i, (name, pts) in enumerate(curves.items()):
        x0, y0 = (i % cols) * pw, (i // cols) * ph + top
        left, right, upper, lower = x0 + 56, x0 + pw - 12, y0 + 22, y0 + ph - 30
        draw.text(((left + right) // 2, y0 + 6), name.replace("_", " "), fill="black", font=font, anchor="mt")
        draw.rectangle((left, upper, right, lower), outline=(90, 90, 90))
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        xl, xh, yl, yh = min(xs), max(xs), min(ys), max(ys)
        if yh == yl:  # a constant: centred, its value the middle mark
            yl, yh = yl - (abs(yl) or 1.0) / 2, yh + (abs(yh) or 1.0) / 2
        xspan, yspan = (xh - xl) or 1.0, yh - yl

        def at(x: float, y: float) -> tuple[float, float]:
            u = left + 4 + (x - xl) / xspan * (right - left - 8)
            return u, lower - 4 - (y - yl) / yspan * (lower - upper - 8)

        for v in sorted({yl, (yl + yh) / 2, yh}):
            u, w = at(xl, v)
            draw.line((left - 3, w, left, w), fill=(90, 90, 90))
            draw.text((left - 5, w), _tick(v), fill="black", font=font, anchor="rm")
        for x in sorted({xl, xh}):
            u, _ = at(x, yl)
            draw.line((u, lower, u, lower + 3), fill=(90, 90, 90))
            draw.text((u, lower + 5), _tick(x), fill="black", font=font, anchor="mt")
        draw.text(((left + right) // 2, lower + 5), "round", fill=(90, 90, 90), font=font, anchor="mt")
        line = [at(x, y) for x, y in pts]
        if len(line) > 1:
            draw.line(line, fill=(31, 119, 180), width=2)
        if len(line) < 50:
            for u, w in line:
                draw.ellipse((u - 2, w - 2, u + 2, w + 2), fill=(31, 119, 180))
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    img.save(png)


def write_round_metrics(out: str, history: list | None, title: str = "") -> str | None:
    """Write a run's per-round metrics in its folder ``out``: ``metrics.jsonl`` (one JSON object a round:
    :func:`round_rows`), ``metrics.csv`` (the same rows; the columns of every round, empty where a round lacks
    one), ``curves.png`` (one panel per numeric field against the round) and, where the ``tensorboard`` package
    is installed, TensorBoard event files in ``out/tensorboard`` (``torch.utils.tensorboard``; a scalar per field
    and round). Nothing new leaves: the rows are the run's public round records (module
    :mod:`fedkl.algorithms.round_log`). Returns the line to print, or None where the run kept no round records
    (a one-shot release: nothing is written)."""
    rows = round_rows(history)
    if not rows:
        return None
    os.makedirs(out, exist_ok=True)
    jsonl, csv_path, png = (os.path.join(out, name) for name in METRICS_FILES)
    with open(jsonl, "w") as f:
        for row in rows:
            f.write(json.dumps(row, allow_nan=False) + "\n")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    curves = _curves(rows)
    draw_curves(curves, png, title)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package (not a dependency of fedkl)
        return (
            f"wrote {len(rows)} rounds' metrics: {jsonl}, {csv_path} and {png} (TensorBoard is not installed: "
            "open metrics.csv in a spreadsheet or pandas.read_csv, or `pip install tensorboard` for event files)"
        )
    board = os.path.join(out, TENSORBOARD_DIR)
    writer = SummaryWriter(log_dir=board)
    try:
        for name, pts in curves.items():
            for x, v in pts:
                writer.add_scalar(name, v, int(x))
    finally:
        writer.close()
    return (
        f"wrote {len(rows)} rounds' metrics: {jsonl}, {csv_path}, {png} and TensorBoard event files "
        f"(tensorboard --logdir {board})"
    )


def cache_dir() -> str:
    return os.environ.get("FEDKL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fedkl")


def _reference_key(spec: dict, dataset: FederatedDataset, plan: dict | None = None) -> str:
    key = {"v": _CACHE_VERSION, "problem": spec, **({"fedavg": plan} if plan is not None else {})}
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
    for data in (dataset.train, dataset.test):
        for t in (data.X, data.y, data.user_index):
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.contiguous().numpy().tobytes())
        h.update("\0".join(data.user_ids).encode())
    return h.hexdigest()[:32]


def reference_metrics(
    evaluator: InProcessFederation,
    spec: dict,
    log: Callable[[str], None],
    use_cache: bool = True,
    plan: dict | None = None,
) -> dict:
    """Test metrics of the non-private reference on ``evaluator``'s data (cached; module docstring),
    logging the optimizer's progress about ten times. ``plan`` (:func:`fedkl.algorithms.nonprivate.fedavg_plan`,
    given for non-convex problems): the reference is FedAvg without clip or noise under that plan, not L-BFGS."""
    path = os.path.join(cache_dir(), "reference", _reference_key(spec, evaluator.dataset, plan) + ".json")
    if use_cache and os.path.exists(path):
        with open(path) as f:
            metrics = json.load(f)["test_metrics"]
        log(f"non-private reference: cached ({path})")
        return metrics

    if plan is not None:
        log(
            "non-private reference (evaluation only, NOT private; --no-reference skips it): FedAvg without clip or "
            f"noise, the run's plan: {plan['rounds']} rounds, cohort rate {plan['sampling_rate']:g}"
        )
        w_ref = nonprivate_fedavg(
            evaluator.problem,
            evaluator.dataset.train,
            plan,
            progress=lambda k, total: log(f"  non-private reference: FedAvg round {k}/{total}"),
        )
    else:

        def progress(k: int, total: int) -> None:
            if k == 1 or k % max(1, total // 10) == 0:
                log(f"  non-private reference: L-BFGS iteration {k} (at most {total})")

        log("non-private reference (evaluation only, NOT private; --no-reference skips it): training")
        w_ref = nonprivate_minimizer(evaluator.problem, evaluator.dataset.train, progress=progress)
    metrics = evaluator.evaluate(w_ref, "test")
    if use_cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, {"problem": spec, "test_metrics": metrics})
    return metrics


__all__ = ["cache_dir", "reference_metrics", "strict", "write_json"]
