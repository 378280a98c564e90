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

import hashlib
import json
import math
import os
from typing import Callable

from fedkl.algorithms.nonprivate import nonprivate_minimizer
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


def cache_dir() -> str:
    return os.environ.get("FEDKL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fedkl")


def _reference_key(spec: dict, dataset: FederatedDataset) -> str:
    h = hashlib.sha256(json.dumps({"v": _CACHE_VERSION, "problem": spec}, sort_keys=True).encode())
    for data in (dataset.train, dataset.test):
        for t in (data.X, data.y, data.user_index):
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.contiguous().numpy().tobytes())
        h.update("\0".join(data.user_ids).encode())
    return h.hexdigest()[:32]


def reference_metrics(
    evaluator: InProcessFederation, spec: dict, log: Callable[[str], None], use_cache: bool = True
) -> dict:
    """Test metrics of the non-private reference on ``evaluator``'s data (cached; module docstring),
    logging the optimizer's progress about ten times."""
    path = os.path.join(cache_dir(), "reference", _reference_key(spec, evaluator.dataset) + ".json")
    if use_cache and os.path.exists(path):
        with open(path) as f:
            metrics = json.load(f)["test_metrics"]
        log(f"non-private reference: cached ({path})")
        return metrics

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
