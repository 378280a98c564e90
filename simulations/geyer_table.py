"""Geyer, Klein & Nabi (2017)'s table on MNIST label shards with fedkl's DP-FedAvg, every cell over seeds.

    nice -n 10 python simulations/geyer_table.py run CELL [--seeds 0 1 2 3 4]   # one `fedkl run` per seed
    python simulations/geyer_table.py report                                   # writes the markdown below
    python simulations/geyer_table.py toml                                     # writes the study TOML

Settings per population are NOT typed here: each cell runs the candidate with the best validation accuracy
for its (dataset, users) in simulations/results/geyer_validation.jsonl (``simulations/geyer_validation.py``:
label shards of 50,000 training images, 10,000 held-out TRAINING images as the evaluation records; the
official test set is never read to choose). The eps = 2 rows reuse the eps = 8 choice of their population.

Each seed is one ``fedkl run`` process (its own partition seed and training seed; noise from the OS CSPRNG),
timed by ``os.wait4`` (CPU = user + system of that process, peak RSS its high-water mark); the run's result.json
and that usage are kept as one JSON record per seed under simulations/results/geyer_table/, and ``report``
writes simulations/results/geyer_mnist.md from those records alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import geyer_validation as val  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "simulations" / "results" / "geyer_table"
MARKDOWN = ROOT / "simulations" / "results" / "geyer_mnist.md"
TOML = ROOT / "simulations" / "studies" / "geyer_mnist.toml"
FEDKL = ROOT / ".venv" / "bin" / "fedkl"

# Geyer et al. (2017), Table 1 (eps = 8): DP accuracy and the non-private federated accuracy per population
PAPER = {100: (0.78, 0.97), 1000: (0.92, 0.98), 10_000: (0.96, 0.99)}
# name -> (dataset, users, epsilon); delta is Geyer's for the population (val.DELTA)
CELLS = {
    "mnist-100-eps8": ("mnist", 100, 8.0),
    "mnist-1000-eps8": ("mnist", 1000, 8.0),
    "mnist-10000-eps8": ("mnist", 10_000, 8.0),
    "mnist-100-eps2": ("mnist", 100, 2.0),
    "mnist-1000-eps2": ("mnist", 1000, 2.0),
    "mnist-10000-eps2": ("mnist", 10_000, 2.0),
    "fashion-mnist-1000-eps8": ("fashion-mnist", 1000, 8.0),
}
DELTA_TEXT = {100: "1e-3", 1000: "1e-5", 10_000: "1e-6"}
FLAGS = ("model", "sampling_rate", "rounds", "local_epochs", "batch_size", "lr", "clip", "server_lr")


def parameters(model: str) -> int:
    """The number of parameters of ``simulations/nets.py:NAME`` on MNIST's 784 features and 10 classes."""
    import nets

    return sum(p.numel() for p in getattr(nets, model.split(":")[-1])(784, 10).parameters())


def _has_rows(dataset: str, users: int) -> bool:
    return any(r["dataset"] == dataset and r["users"] == users for r in val.rows())


def choice(dataset: str, users: int) -> dict:
    """The validation row with the best accuracy for (dataset, users) (ties: the first written)."""
    rows = [r for r in val.rows() if r["dataset"] == dataset and r["users"] == users]
    if not rows:
        raise SystemExit(f"no validation rows for {dataset}, {users} users: run simulations/geyer_validation.py")
    return max(rows, key=lambda r: r["validation_accuracy"])


def command(cell: str, seed: int | None) -> list[str]:
    """The ``fedkl run`` arguments of ``cell`` (``seed`` None: without --seed, for the report)."""
    dataset, users, eps = CELLS[cell]
    c = choice(dataset, users)
    args = ["fedkl", "run", "--dataset", dataset, "--partition", "shards", "--users", str(users)]
    args += ["--algorithm", "dp-fedavg", "--problem", "torch", "--model", c["model"]]
    args += ["--epsilon", f"{eps:g}", "--delta", DELTA_TEXT[users], "--neighbouring", "add-remove"]
    args += ["--sampling-rate", f"{c['sampling_rate']:g}", "--rounds", str(c["rounds"])]
    args += ["--local-epochs", str(c["local_epochs"]), "--batch-size", str(c["batch_size"]), "--lr", f"{c['lr']:g}"]
    if c["clip"] != 1.0:
        args += ["--clip", f"{c['clip']:g}"]
    if c["server_lr"] != 1.0:
        args += ["--server-lr", f"{c['server_lr']:g}"]
    if c.get("server_momentum", 0.0):
        args += ["--server-momentum", f"{c['server_momentum']:g}"]
    if c.get("adaptive_clip"):
        args += ["--adaptive-clip"]
    args += ["--accountant", "rdp"]
    return args + ([] if seed is None else ["--seed", str(seed)])


def run(cell: str, seeds: list[int]) -> None:
    """One ``fedkl run`` process per seed not yet recorded; its record goes to RECORDS/CELL/seedS.json."""
    (RECORDS / cell).mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        record = RECORDS / cell / f"seed{seed}.json"
        if record.exists():
            continue
        with tempfile.TemporaryDirectory(prefix="geyer-") as out:
            args = command(cell, seed)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            t0 = time.time()
            proc = subprocess.Popen([str(FEDKL), *args[1:], "--no-reference", "--out", out], cwd=ROOT, env=env)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.time() - t0
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"{cell} seed {seed} failed: {shlex.join(args)}")
            result = json.loads((Path(out) / "result.json").read_text())
        keep = {k: result[k] for k in ("run_id", "dataset", "users", "partition", "epsilon", "delta", "neighbouring")}
        keep |= {k: result[k] for k in ("test_metric", "trivial_baseline", "seed", "rounds", "algorithm_details")}
        keep |= {"model": result["config"]["model"], "wall_time_s": result["wall_time_s"]}
        keep["usage"] = {
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "wall_s": round(wall, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024),  # ru_maxrss is in KiB on Linux
            "load_avg_1min_at_end": round(os.getloadavg()[0], 2),
        }
        keep["command"] = shlex.join(args)
        record.write_text(json.dumps(keep, indent=1) + "\n")
        print(f"{cell} seed {seed}: {keep['test_metric']['value']:.4f} ({keep['usage']})", flush=True)


def records(cell: str) -> list[dict]:
    """The cell's per-seed records; one run under other settings than today's choice is refused."""
    folder = RECORDS / cell
    out = [json.loads(p.read_text()) for p in sorted(folder.glob("seed*.json"))] if folder.exists() else []
    for r in out:
        if r["command"] != shlex.join(command(cell, r["seed"])):
            raise SystemExit(f"{cell} seed {r['seed']} ran `{r['command']}`, not today's choice: delete its record")
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def _fmt_cell(accs: list[float]) -> str:
    if not accs:
        return "not run"
    m, se = mean_se(accs)
    return f"{m:.3f}" + (f" ± {se:.3f}" if len(accs) > 1 else "") + f" ({len(accs)} seed{'s' * (len(accs) > 1)})"


def _settings(c: dict) -> str:
    model = c["model"].split(":")[-1]
    parts = [f"`{model}`", f"q = {c['sampling_rate']:g}", f"{c['rounds']} rounds", f"E = {c['local_epochs']}"]
    parts += [f"B = {c['batch_size']}", f"lr {c['lr']:g}", f"clip {c['clip']:g}"]
    if c["server_lr"] != 1.0:
        parts.append(f"server lr {c['server_lr']:g}")
    return ", ".join(parts)


def report() -> str:
    """The markdown of every cell from the records (no number typed here)."""
    lines = [
        "# Geyer, Klein & Nabi (2017) on MNIST label shards: fedkl beside the paper",
        "",
        "Generated by `python simulations/geyer_table.py report` from the per-seed records in",
        "`simulations/results/geyer_table/` (each the result.json of one `fedkl run` process and its",
        "`os.wait4` usage). DP-FedAvg (`dp-fedavg`), label shards (`--partition shards`: images sorted by label,",
        "2n shards, two per user), Poisson cohorts, add-remove neighbours, RDP accountant, no server momentum;",
        "test accuracy on the official test set; mean ± standard error over seeds (each seed: its own",
        "partition and training seed; noise from the OS CSPRNG). CPU = user + system time of the run's",
        "process, wall on the shared 2-core machine (`nice -n 10`, other jobs running), peak RSS of the process.",
        "Noise: z = σ / C, the calibrated noise multiplier of the run, and z √d / (q n), the expected norm of the",
        "noise on the released mean update in units of the clip (d parameters, q n the fixed denominator).",
        "",
        "| clients | ε | δ | paper (DP / non-private) | fedkl DP-FedAvg | − paper | noise z; ‖noise‖ / C on the mean | "
        "CPU / wall per seed | peak RSS | settings (chosen on validation) | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    commands, notes = [], []
    for i, (cell, (dataset, users, eps)) in enumerate(CELLS.items(), 1):
        recs = records(cell)
        accs = [r["test_metric"]["value"] for r in recs]
        if dataset == "mnist" and eps == 8.0:
            paper = "{} / {}".format(*PAPER[users])
        else:
            paper = "not in the paper"
        if not _has_rows(dataset, users):
            label = f"{users:,}" + ("" if dataset == "mnist" else f" ({dataset})")
            lines.append(f"| {label} | {eps:g} | {DELTA_TEXT[users]} | {paper} | not run (time) | | | | | | |")
            continue
        c = choice(dataset, users)
        if recs:
            cpu = sum(r["usage"]["cpu_s"] for r in recs) / len(recs)
            wall = sum(r["usage"]["wall_s"] for r in recs) / len(recs)
            time_s = f"{cpu:.0f} s / {wall / 60:.1f} min"
            rss = f"{max(r['usage']['peak_rss_mb'] for r in recs) / 1024:.1f} GB"
            seeds = ", ".join(str(r["seed"]) for r in recs)
            notes.append(f"- ({i}) seed{'s' * (len(recs) > 1)} {seeds}: " + ", ".join(f"{a:.4f}" for a in accs))
            z = recs[0]["algorithm_details"]["noise_multiplier"]
            ratio = z * math.sqrt(parameters(c["model"])) / (c["sampling_rate"] * users)
            noise = f"{z:.2f}; {ratio:.2f}"
            diff = f"{sum(accs) / len(accs) - PAPER[users][0]:+.3f}" if paper[0].isdigit() else ""
        else:
            time_s = rss = noise = diff = ""
        label = f"{users:,}" + ("" if dataset == "mnist" else f" ({dataset})")
        lines.append(
            f"| {label} | {eps:g} | {DELTA_TEXT[users]} | {paper} | {_fmt_cell(accs)} | {diff} | {noise} | {time_s} | {rss} | "
            f"{_settings(c)} (validation {c['validation_accuracy']:.3f}) | ({i}) |"
        )
        commands.append(f"- ({i}) `PYTHONPATH=$PWD {shlex.join(command(cell, None))} --seed S`")
    lines += ["", LIMITS.strip()]
    lines += ["", "Commands (`.venv/bin/fedkl` in this repository; S = the seed):", "", *commands]
    lines += ["", "Per-seed test accuracies (cells numbered as in the table):", "", *notes]
    lines += ["", PAPER_SETTINGS.strip(), "", HOW_CHOSEN.strip(), "", *validation_table()]
    return "\n".join(lines) + "\n"


def validation_table() -> list[str]:
    """Every validation row, by population (from the JSON lines; best first)."""
    out = ["Every validation run (seed 0; CPU of the training call in its process), best first per population:", ""]
    out += ["| dataset | clients | candidate | settings | validation accuracy | CPU |", "|---|---|---|---|---|---|"]
    rows = sorted(val.rows(), key=lambda r: (r["dataset"], r["users"], -r["validation_accuracy"]))
    for r in rows:
        out.append(
            f"| {r['dataset']} | {r['users']:,} | {r['candidate']} | {_settings(r)} | "
            f"{r['validation_accuracy']:.4f} | {r['cpu_s']:.0f} s |"
        )
    return out


LIMITS = """
**Where a cell is not beaten, what limits it** (read with the noise column and the validation runs below).
At 1,000 clients the validation choice is cohorts of ~200 (q = 0.2) over 100 rounds: 0.920 on validation against
0.918 for ~100 (q = 0.1), within one seed's spread (~0.005); on the test set 0.918 +- 0.001 against 0.912 +- 0.001
with q = 0.1 (git history of this file's records), 0.002 short of the paper. Each released mean still carries
noise of about 2.2 clips in norm. Validated lower: cohorts of ~200 over 50 rounds, half the coordinates (`mlp50`),
5 local epochs, a larger server step, server momentum 0.5 (0.916), clip 0.5 (0.894); adaptive clipping at q = 0.1
validated 0.919 (not combined with q = 0.2). Not tried (CPU time on the loaded machine): q = 0.2 with adaptive
clipping or more rounds, server optimizers (`dp-fedadam`), the authors' 4 epochs with a decaying lr.
At 10,000 clients the noise is small (well under one clip), so optimisation is the limit: each client
holds 6 images (2 local steps a round) and 100 rounds of ~300 clients is what fit; a server lr of 3 gained
more than 2 points on validation over plain averaging, and larger server steps, server momentum or more
rounds were not tried (100 rounds take ~2 CPU minutes, 5-10 wall minutes on the shared machine).
The 100-client cell is beaten with a linear model (7,840 coordinates), which validated above the
networks: with every client in every round, the noise on the mean of 100 clipped updates bounds the model
size. The ε = 2 rows (not in the paper) keep each population's ε = 8 settings, not re-chosen at ε = 2: at
100 clients that leaves about 3x the noise per round over the same 20 rounds, far from a tuned setting
(re-choosing the rounds and cohort at ε = 2 on validation is the first thing to try).
"""

PAPER_SETTINGS = """
**The paper's setting.** Geyer, Klein & Nabi, *Differentially private federated learning: a client level
perspective* (arXiv:1712.07557): MNIST sorted by label into 2n shards, two per client, n = 100 / 1,000 /
10,000 clients, ε = 8 with δ = 1e-3 / 1e-5 / 1e-6, DP accuracy about 0.78 / 0.92 / 0.96 against
non-private federated 0.97 / 0.98 / 0.99. The paper's text is not in this session's library
(/work/shared/papers); the per-population settings below are read from the authors' code
(SAP-samples/machine-learning-diff-private-federated-learning, formerly sapmlresearch/DiffPrivate_FedLearning:
`Helper_Functions.PrivAgent`, `sample.py`, `mnist_inference.py`, `Create_clients.py`):
a 784-600-100-10 ReLU network without biases (`simulations/nets.py:geyer_mlp`); local SGD with E = 4 epochs
of batch 10 at lr 0.1 (exponentially decayed by 10x over 27,000 steps); m = 30 / 100 / 300 clients a round
(q = m/n = 0.3 / 0.1 / 0.03), noise σ = 1 relative to the clip; the clip is the MEDIAN of the round's update
norms, per layer (data-dependent and not itself noised, so outside the accountant's guarantee); training
stops when the moments accountant's δ at ε = 8 passes the population's δ. Their client files deal the 50,000
images of the classic split, each repeated n/100 times, so every client holds 500 (repeated) images; the
paper's text and this table give each client 60,000/n distinct images (600 / 60 / 6).
"""

HOW_CHOSEN = """
**How the settings were chosen.** Per population (and per dataset), on held-out TRAINING images only
(`simulations/geyer_validation.py`, rows in `simulations/results/geyer_validation.jsonl`): the first
50,000 training images as label shards (100 x 500, 1,000 x 50, 10,000 x 4 per user), the last 10,000 as
each user's evaluation records, ε = 8 at the cell's δ, seed 0, one run per candidate; the candidate with
the best validation accuracy is run on the official split over seeds. The grid was small (time: 2 shared
cores): cohort rate q and rounds, local lr and epochs, server lr, and the network (`mlp100`, `mlp50`,
`linear`, `small_cnn`). The ε = 2 rows reuse the ε = 8 choice (not re-chosen at ε = 2). fedkl's clip is fixed (1), so
the noise is calibrated to a public bound and every run's (ε, δ) covers the whole training.
"""


def toml() -> str:
    """The study file: the same cells and chosen settings for ``fedkl sweep`` (one process for all runs, so
    no per-run CPU or peak RSS: the committed table comes from ``run`` / ``report`` above)."""

    def when(match: str, dataset: str, users: int) -> list[str]:
        c = choice(dataset, users)
        out = ["", "[[sweep.when]]", f"match = {{{match}}}", f"delta = {val.DELTA[users]:g}"]
        out += [f'model = "{c["model"]}"'] + [f"{k} = {c[k]!r}" for k in FLAGS if k != "model"]
        return out + [f"# validation accuracy {c['validation_accuracy']:.4f} (candidate {c['candidate']!r})"]

    chosen = [(d, n) for d, n in dict.fromkeys((d, n) for d, n, _ in CELLS.values()) if _has_rows(d, n)]
    datasets = list(dict.fromkeys(d for d, _ in chosen))
    lines = [
        "# Geyer, Klein & Nabi (2017), arXiv:1712.07557: client-level (= user-level) DP-FedAvg on MNIST label shards,",
        "# 100 / 1,000 / 10,000 clients at eps = 8, delta = 1e-3 / 1e-5 / 1e-6, plus eps = 2 (same deltas), and",
        "# Fashion-MNIST at 1,000 clients. WRITTEN by `python simulations/geyer_table.py toml`: the settings per",
        "# population are the best candidate on held-out TRAINING images (simulations/geyer_validation.py,",
        "# simulations/results/geyer_validation.jsonl); the eps = 2 rows reuse their population's eps = 8 choice. The",
        "# committed table (simulations/results/geyer_mnist.md) is written by `simulations/geyer_table.py run/report`,",
        "# one process per run for its CPU time and peak memory; this file runs the same points in one sweep:",
        "#   OMP_NUM_THREADS=1 nice -n 10 fedkl sweep simulations/studies/geyer_mnist.toml",
        "#   fedkl report simulations/studies/geyer_mnist.toml",
        'algorithm = "dp-fedavg"',
        'partition = "shards"',
        'problem = "torch"',
        'neighbouring = "add-remove"',
        'accountant = "rdp"',
        "reference = false  # the non-private FedAvg reference doubles the time",
        "",
        "[sweep]",
        'table = "runs/geyer_mnist.csv"',
        f"dataset = {datasets!r}".replace("'", '"'),
        "users = [100, 1000, 10000]",
        "epsilon = [8.0, 2.0]",
        "seed = [0, 1, 2, 3, 4]",
    ]
    if "fashion-mnist" in datasets:
        lines += ["", "[[sweep.exclude]]  # Fashion-MNIST: 1,000 clients at eps = 8 only", 'dataset = "fashion-mnist"']
        lines += ["users = [100, 10000]", "", "[[sweep.exclude]]", 'dataset = "fashion-mnist"', "epsilon = 2.0"]
    for dataset, users in chosen:
        lines += when(f'dataset = "{dataset}", users = {users}', dataset, users)
    lines += [
        "",
        "[report]",
        'kind = "table"',
        'markdown = "runs/geyer_mnist_sweep.md"',
        'title = "Geyer et al. (2017) on label shards: DP-FedAvg test accuracy (fedkl sweep)"',
        'rows = ["dataset", "users"]',
        'columns = "epsilon_target"',
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("cell", choices=sorted(CELLS))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    sub.add_parser("report")
    sub.add_parser("toml")
    sub.add_parser("show")
    a = ap.parse_args(argv)
    if a.what == "run":
        run(a.cell, a.seeds)
    elif a.what == "show":
        for cell in CELLS:
            print(cell, shlex.join(command(cell, 0)))
    elif a.what == "toml":
        TOML.write_text(toml())
        print(f"wrote {TOML}")
    else:
        MARKDOWN.write_text(report())
        print(f"wrote {MARKDOWN}")


if __name__ == "__main__":
    main()
