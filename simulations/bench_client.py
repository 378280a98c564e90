"""What one fedkl client costs on a device: start-up (imports) and memory.

    .venv/bin/python simulations/bench_client.py [--repeats 3]

Each repeat runs in a fresh Python process, exactly what a SuperNode's ClientApp process does: import
``fedkl.flower.client_app``, build the app for a small synthetic least-squares federation, answer the
handshake and one clipped-gradient query for its user. It reports the seconds to import, the seconds to
the first answer (import + load the user's records + answer), the peak resident memory of that process
(``ru_maxrss``), and whether the server's algorithm code (``fedkl.algorithms``) was loaded. A Flower
SuperNode process runs besides it (Flower's own cost; ``fedkl.flower.deploy.NODE_MEMORY_BYTES`` is the
measured pair).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import fedkl.flower.client_app as client_app
t_import = time.perf_counter() - t0
import torch
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedkl.federation.base import ClippedGradient
from fedkl.flower import codec
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
spec = codec.ClientSpec.build("synthetic-least-squares", "least-squares", {"n_users": 20, "m": 20, "d": 10, "seed": 0})
app = client_app.make_client_app(spec, torch_threads=1)
ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 3, "num-partitions": 20}, state=RecordDict(), run_config={})
def ask(q):
    return app(Message(codec.encode_request(q), 7, codec.MESSAGE_TYPE, group_id="bench"), ctx)
info = codec.decode_info(ask(codec.INFO))
q = ClippedGradient(torch.zeros(info.num_params, dtype=torch.float64), 1.0)
codec.decode_answer(ask(q), q, info.num_params)
t_first = time.perf_counter() - t0
print(json.dumps({
    "import_s": t_import,
    "first_answer_s": t_first,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "algorithms_loaded": sorted(m for m in sys.modules if m.startswith("fedkl.algorithms")),
    "top_level_modules": sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names)),
}))
"""


def measure(repo: Path) -> dict:
    """One fresh client process's numbers (see the module docstring)."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    runs = [measure(repo) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in ("import_s", "first_answer_s", "peak_rss_mb")}
    print(
        f"fedkl client (median of {len(runs)} fresh processes): import {med['import_s']:.2f} s, "
        f"first answer {med['first_answer_s']:.2f} s, peak RSS {med['peak_rss_mb']:.0f} MB; "
        f"server algorithm modules loaded: {len(runs[0]['algorithms_loaded'])}"
    )
    if runs[0]["algorithms_loaded"]:
        print("  " + ", ".join(runs[0]["algorithms_loaded"][:10]))


if __name__ == "__main__":
    main()
