"""The experiment layer (fedkl/experiments/): `fedkl run --config`, `fedkl sweep` (new table vs --resume,
variants, exclusions), `fedkl plot`, `fedkl report` (built-in kinds, report functions loaded by path), one
row per run in a table, plugin runners' own settings, the Flower DP baseline's accounting
(simulations/flower_dp_baseline.py) and the committed studies' reports rewriting their markdown (plugins and
report functions loaded by path: nothing here imports simulations/)."""

import csv
import json
import math
import os
import random
import sys

import pytest

from fedkl import experiments as ex
from fedkl.cli import build_parser, main

PNG = b"\x89PNG\r\n\x1a\n"


def _write(path, text):
    path.write_text(text)
    return str(path)


def _exit_line(capsys, argv):
    """Run the CLI, expect exit 2, return the single stderr line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# --- fedkl run --config ---------------------------------------------------------------------------
def test_config_values_are_typed_and_cli_flags_override(tmp_path):
    cfg = _write(
        tmp_path / "run.toml",
        'dataset = "synthetic-logistic"\nusers = 20\nnoise-seed = 3\n'
        'rounds = 7\nlr = 2\nreference = true\ndelta = "none"\nbias_correction = true\n',
    )
    argv = ["run", "--config", cfg, "--round", "4", "--no-reference"]  # an abbreviated flag counts as given
    args = build_parser().parse_args(argv)
    ex.apply_config_file(args, argv)
    assert args.rounds == 4 and isinstance(args.rounds, int)  # the command line wins
    assert args.lr == 2.0 and isinstance(args.lr, float)  # TOML int -> the flag's float
    assert args.noise_seed == 3 and args.users == 20 and args.delta is None
    assert args.no_reference is True and args.bias_correction is True
    assert args.dataset == "synthetic-logistic" and args.epsilon == 2.0  # untouched default


def test_run_with_config_file_end_to_end(tmp_path):
    cfg = _write(
        tmp_path / "run.toml",
        'dataset = "synthetic-logistic"\nusers = 20\nrounds = 2\nnoise_seed = 1\nreference = false\nepsilon = 1.5\n',
    )
    out = tmp_path / "out"
    assert main(["run", "--config", cfg, "--rounds", "3", "--out", str(out)]) == 0
    res = json.loads((out / "result.json").read_text())
    assert res["config"]["rounds"] == 3 and res["config"]["users"] == 20 and res["config"]["noise_seed"] == 1
    assert res["config"]["reference"] is False and res["nonprivate_reference"] is None
    assert res["epsilon_by_budget_conversion"] == pytest.approx(1.5, rel=1e-6)  # the budget from the file, spent
    assert res["epsilon"] <= 1.5


@pytest.mark.parametrize(
    "text,needle",
    [
        ("learning_rate = 1\n", "unknown key 'learning_rate'"),
        ("rounds = 2.5\n", "'rounds'"),
        ('lr = "fast"\n', "'lr'"),
        ("epsilon = -1\n", "'epsilon'"),
        ('bias_correction = "yes"\n', "'bias_correction'"),
        ('dataset = "mnst"\n', "invalid choice 'mnst'"),
        ("rounds = [1, 2]\n", "single value"),
        ("[sweep]\nseed = [1]\n", "unexpected table [sweep]"),
        ("rounds = \n", "not valid TOML"),
    ],
)
def test_bad_config_exits_2_with_one_line(tmp_path, capsys, text, needle):
    cfg = _write(tmp_path / "bad.toml", text)
    line = _exit_line(capsys, ["run", "--config", cfg])
    assert line.startswith("fedkl run: error: --config:") and needle in line


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert "not found" in _exit_line(capsys, ["run", "--config", str(tmp_path / "nope.toml")])


# --- fedkl sweep: parsing --------------------------------------------------------------------------
SWEEP = """
dataset = "synthetic-logistic"
users = 20
rounds = 2
reference = false

[sweep]
table = "{table}"
noise_seed_offset = 1000
algorithm = ["noisy-gd", "dp-fedavg"]
epsilon = [1, 2]
seed = [0, 1, 2]

[[sweep.when]]
match = {{algorithm = "dp-fedavg"}}
local-steps = 3
"""


def test_sweep_is_the_cartesian_product_with_conditional_settings(tmp_path):
    path = _write(tmp_path / "s.toml", SWEEP.format(table=tmp_path / "t.csv"))
    spec = ex.load_sweep(path)
    points = spec.points()
    assert len(points) == 2 * 2 * 3
    combos = {(p["algorithm"], p["epsilon"], p["seed"]) for p in points}
    assert len(combos) == 12 and all(isinstance(p["epsilon"], float) for p in points)
    for p in points:
        assert p["noise_seed"] == p["seed"] + 1000 and p["rounds"] == 2 and p["users"] == 20
        assert p.get("local_steps") == (3 if p["algorithm"] == "dp-fedavg" else None)
    assert len({ex.run_key(p) for p in points}) == 12
    # --set replaces an axis; a single value replaces the base
    spec2 = ex.load_sweep(path, sets=["seed=5", "epsilon=0.5,4", "rounds=4"])
    pts = spec2.points()
    assert len(pts) == 2 * 2 * 1 and {p["seed"] for p in pts} == {5} and {p["rounds"] for p in pts} == {4}
    assert {p["epsilon"] for p in pts} == {0.5, 4.0}
    assert "local_steps" in spec.columns() and spec.columns()[:2] == ["run_key", "status"]


@pytest.mark.parametrize(
    "extra,needle",
    [
        ("colour = [1]\n", "unknown key 'colour'"),
        ("lr = []\n", "non-empty list"),
        ("lr = 3\n", "non-empty list"),
        ("lr = [1, -1]\n", "'lr'"),
        ("out = ['a']\n", "cannot be swept"),
        ("seed = [1, 1]\n", "twice"),
    ],
)
def test_bad_sweep_keys_exit_2(tmp_path, capsys, extra, needle):
    path = _write(tmp_path / "s.toml", f'rounds = 2\n[sweep]\ntable = "{tmp_path / "t.csv"}"\n{extra}')
    line = _exit_line(capsys, ["sweep", path])
    assert line.startswith("fedkl sweep: error:") and needle in line


def test_sweep_needs_a_table_and_a_sweep_section(tmp_path, capsys):
    assert "needs a [sweep] table" in _exit_line(capsys, ["sweep", _write(tmp_path / "a.toml", "rounds = 2\n")])
    line = _exit_line(capsys, ["sweep", _write(tmp_path / "b.toml", "[sweep]\nseed = [1]\n")])
    assert "table must name a .csv" in line


# --- fedkl sweep: running, resuming, rows -----------------------------------------------------------
CALLS = []


def _fake_runner(cfg, log):
    """Deterministic stand-in for a training: accuracy grows with epsilon; fails for seed 99."""
    CALLS.append(cfg)
    if cfg.seed == 99:
        raise RuntimeError("boom")
    acc = 0.6 + 0.05 * math.log2(cfg.epsilon) + 0.001 * cfg.seed
    return {
        "algorithm": cfg.algorithm,
        "dataset": cfg.dataset,
        "users": 7,
        "epsilon": cfg.epsilon,
        "delta": 1e-3,
        "test_metric": {"name": "accuracy", "value": acc},
        "test_metrics": {"accuracy": acc, "loss": 1 - acc},
        "nonprivate_reference": {"accuracy": 0.9, "loss": 0.2} if cfg.reference else None,
        "trivial_baseline": {"accuracy": 0.5},
        "rounds": cfg.rounds,
        "table_extra": {"fake_extra": 42},
    }


@pytest.fixture
def fake_runner():
    ex.register_runner("fake-alg", _fake_runner, columns=("fake_extra",))
    CALLS.clear()
    yield CALLS
    ex.EXTERNAL_RUNNERS.pop("fake-alg", None)


def test_sweep_rows_resume_restart_and_errors(tmp_path, fake_runner):
    table = tmp_path / "r" / "t.csv"
    path = _write(
        tmp_path / "s.toml",
        f'algorithm = "fake-alg"\ndataset = "tv16"\n[sweep]\ntable = "{table}"\nepsilon = [1, 2, 4]\nseed = [0, 1]\n',
    )
    logs = []
    res = ex.run_sweep(ex.load_sweep(path), log=logs.append)
    assert res["ran"] == 6 and res["errors"] == 0 and len(fake_runner) == 6
    rows = list(csv.DictReader(open(table)))
    assert len(rows) == 6 and {r["status"] for r in rows} == {"ok"}
    r0 = next(r for r in rows if r["epsilon_target"] == "4.0" and r["seed"] == "1")
    assert float(r0["test_metric"]) == pytest.approx(0.6 + 0.1 + 0.001) and r0["fake_extra"] == "42"
    assert float(r0["excess_loss"]) == pytest.approx((1 - 0.701) - 0.2) and r0["metric"] == "accuracy"
    # the reference is computed once per (dataset, seed, ...) and reused for the other runs
    assert sum(c.reference for c in fake_runner) == 2
    assert all(float(r["reference_metric"]) == 0.9 for r in rows)
    assert any("[6/6]" in line and "ETA" in line for line in logs)
    assert len(open(str(table)[:-4] + ".jsonl").read().splitlines()) == 6
    # resume: nothing new; a new axis value runs only the new points
    assert ex.run_sweep(ex.load_sweep(path), log=logs.append, resume=True)["ran"] == 0
    res = ex.run_sweep(ex.load_sweep(path, sets=["epsilon=1,2,4,8"]), log=logs.append, resume=True)
    assert res["ran"] == 2 and res["skipped"] == 6 and len(list(csv.DictReader(open(table)))) == 8
    # an error is a row; --retry-errors runs it again, --restart starts over
    bad = ex.load_sweep(path, sets=["seed=99", "epsilon=1"])
    assert ex.run_sweep(bad, log=logs.append, resume=True)["errors"] == 1
    last = list(csv.DictReader(open(table)))[-1]
    assert last["status"] == "error" and "RuntimeError: boom" in last["error"]
    assert ex.run_sweep(bad, log=logs.append, resume=True)["ran"] == 0
    assert ex.run_sweep(bad, log=logs.append, retry_errors=True)["ran"] == 1
    assert ex.run_sweep(ex.load_sweep(path), log=logs.append, restart=True)["ran"] == 6
    assert len(list(csv.DictReader(open(table)))) == 6


def test_a_table_written_by_another_config_is_refused(tmp_path, fake_runner):
    table = tmp_path / "t.csv"
    path = _write(tmp_path / "s.toml", f'algorithm = "fake-alg"\n[sweep]\ntable = "{table}"\nseed = [0]\n')
    ex.run_sweep(ex.load_sweep(path), log=lambda s: None)
    other = _write(tmp_path / "o.toml", f'algorithm = "fake-alg"\n[sweep]\ntable = "{table}"\nlr = [1, 2]\n')
    with pytest.raises(ex.ConfigError, match="other columns"):
        ex.run_sweep(ex.load_sweep(other), log=lambda s: None, resume=True)


# --- fedkl plot -------------------------------------------------------------------------------------
def _write_rows(path, rows):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return str(path)


def test_slope_plot_fits_the_true_exponent(tmp_path, capsys):
    rng = random.Random(0)
    rows = []
    for alg, b in (("a", -0.5), ("b", -1.0)):
        for n in (100, 200, 400, 800, 1600, 3200):
            for seed in range(3):
                y = 3.0 * n**b * math.exp(rng.gauss(0, 0.05))
                rows.append({"status": "ok", "algorithm": alg, "users": n, "seed": seed, "excess_loss": y})
    rows.append({"status": "error", "algorithm": "a", "users": 100, "seed": 9, "excess_loss": 1e6})  # ignored
    table = _write_rows(tmp_path / "t.csv", rows)
    fits = ex.plot_table(table, "slope", str(tmp_path / "s.png"), theory_slope=-0.5)
    assert fits["a"]["slope"] == pytest.approx(-0.5, abs=0.03)
    assert fits["b"]["slope"] == pytest.approx(-1.0, abs=0.03)
    png = (tmp_path / "s.png").read_bytes()
    assert png.startswith(PNG) and len(png) > 5000
    # the CLI prints the fitted slopes and writes markdown
    assert main(["plot", table, "--kind", "slope", "--theory-slope", "-1", "--markdown", str(tmp_path / "s.md")]) == 0
    out = capsys.readouterr().out
    printed = {
        ln.split(":")[0]: float(ln.split("fitted slope ")[1].split()[0])
        for ln in out.splitlines()
        if "fitted slope" in ln
    }
    assert printed == {
        "a": pytest.approx(fits["a"]["slope"], abs=1e-4),
        "b": pytest.approx(fits["b"]["slope"], abs=1e-4),
    }
    assert (tmp_path / "t_slope.png").stat().st_size > 5000
    assert f"| b | {fits['b']['slope']:.3f} | -1.0 |" in (tmp_path / "s.md").read_text()


def test_privacy_utility_plot_reports_mean_and_std_over_seeds(tmp_path):
    rows = []
    for ds in ("d1", "d2"):
        for alg, base in (("x", 0.6), ("y", 0.7)):
            for eps in (0.5, 1.0, 2.0):
                for seed, delta in enumerate((-0.01, 0.0, 0.01)):
                    rows.append(
                        {
                            "status": "ok",
                            "dataset": ds,
                            "algorithm": alg,
                            "users": 10,
                            "epsilon_target": eps,
                            "seed": seed,
                            "metric": "accuracy",
                            "test_metric": base + 0.1 * eps + delta,
                            "reference_metric": 0.9,
                            "trivial_metric": 0.5,
                        }
                    )
    table = _write_rows(tmp_path / "t.csv", rows)
    out = tmp_path / "pu.png"
    summary = ex.plot_table(table, "privacy-utility", str(out), markdown=str(tmp_path / "pu.md"))
    x, mean, std, count = summary["d2"]["y"][2]
    assert (x, count) == (2.0, 3) and mean == pytest.approx(0.9) and std == pytest.approx(0.01)
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 5000
    md = (tmp_path / "pu.md").read_text()
    assert "| d1 (10 users) | x | 0.650 ± 0.010 (n=3)" in md and "non-private reference" in md
    only = ex.plot_table(table, "privacy-utility", str(out), where=["dataset=d1", "algorithm=x"])
    assert list(only) == ["d1"] and list(only["d1"]) == ["x"]


def test_plot_errors_exit_2(tmp_path, capsys):
    table = _write_rows(tmp_path / "t.csv", [{"status": "ok", "algorithm": "a", "users": 1, "excess_loss": 1}])
    assert "no column 'nope'" in _exit_line(capsys, ["plot", table, "--kind", "slope", "--y", "nope"])
    assert "two or more" in _exit_line(capsys, ["plot", table, "--kind", "slope"])
    assert "not found" in _exit_line(capsys, ["plot", str(tmp_path / "x.csv"), "--kind", "slope"])


# --- a real sweep, end to end ------------------------------------------------------------------------
def test_real_sweep_end_to_end(tmp_path, capsys):
    table = tmp_path / "real.csv"
    path = _write(
        tmp_path / "s.toml",
        'dataset = "synthetic-logistic"\nusers = 20\nrounds = 3\nreference = true\n'
        f'[sweep]\ntable = "{table}"\nnoise_seed_offset = 1000\n'
        "epsilon = [1, 4]\nseed = [0, 1]\n",
    )
    assert main(["sweep", path]) == 0
    out = capsys.readouterr().out
    assert "[4/4]" in out and "ETA" in out
    rows = list(csv.DictReader(open(table)))
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok"}
    for r in rows:
        assert r["algorithm"] == "noisy-gd" and r["users"] == "20" and r["noise_seed"] == str(int(r["seed"]) + 1000)
        # the budget is spent (sized by CKS); the epsilon reported is the exact one of the Gaussian releases
        assert 0.5 * float(r["epsilon_target"]) < float(r["epsilon"]) <= float(r["epsilon_target"]) * (1 + 1e-9)
        assert 0 <= float(r["test_metric"]) <= 1 and float(r["reference_metric"]) > 0.5
    # the reference of a (dataset, seed) is identical whichever run computed it
    by_seed = {}
    for r in rows:
        by_seed.setdefault(r["seed"], set()).add(r["reference_metric"])
    assert all(len(v) == 1 for v in by_seed.values())
    # the same seeds give the same model: a fresh table reproduces the metrics exactly
    assert main(["sweep", path, "--table", str(tmp_path / "again.csv")]) == 0
    again = {r["run_key"]: r["test_metric"] for r in csv.DictReader(open(tmp_path / "again.csv"))}
    assert again == {r["run_key"]: r["test_metric"] for r in rows}
    assert main(["sweep", path, "--resume"]) == 0 and "0 to run" in capsys.readouterr().out
    assert main(["plot", str(table), "--kind", "privacy-utility"]) == 0
    assert (tmp_path / "real_privacy-utility.png").read_bytes().startswith(PNG)


# --- the Flower baseline -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flower_baseline():
    ex.load_plugin(os.path.join(os.path.dirname(__file__), "..", "simulations", "flower_dp_baseline.py"))
    import sys

    return next(m for k, m in sys.modules.items() if k.startswith("fedkl_plugin_") and hasattr(m, "real_epsilon"))


@pytest.mark.flower
def test_flower_mean_moves_by_2C_over_m(flower_baseline):
    demo = flower_baseline.sensitivity_demo(m=8, clip=0.5)
    assert demo["released_distance"] == pytest.approx(2 * 0.5 / 8, rel=1e-9)
    assert demo["assumed_sensitivity"] == pytest.approx(0.5 / 8)


@pytest.mark.flower
def test_flower_real_epsilon_full_participation_is_the_z_over_2_gaussian(flower_baseline):
    import dp_accounting

    z, rounds, delta, n = 4.0, 10, 1e-3, 30
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z / 2), rounds))
    assert flower_baseline.real_epsilon(z, rounds, delta, n, n) == pytest.approx(acc.get_epsilon(delta), rel=0.02)
    assert flower_baseline.real_epsilon(z, rounds, delta, n, n) > flower_baseline.claimed_epsilon(
        z, rounds, delta, n, n
    )


@pytest.mark.flower
def test_flower_baseline_trains_in_a_sweep_and_reports_both_epsilons(tmp_path, flower_baseline):
    table = tmp_path / "f.csv"
    path = _write(
        tmp_path / "s.toml",
        'dataset = "synthetic-logistic"\nusers = 12\nrounds = 2\nreference = false\n'
        f'[sweep]\ntable = "{table}"\nnoise_seed_offset = 7\n'
        'plugins = ["simulations/flower_dp_baseline.py"]\n'
        'algorithm = ["flower-dp-fixed", "flower-dp-fixed-as-claimed"]\nepsilon = [2]\n',
    )
    cwd = os.getcwd()
    os.chdir(os.path.join(os.path.dirname(__file__), ".."))
    try:
        res = ex.run_sweep(ex.load_sweep(path), log=lambda s: None)
    finally:
        os.chdir(cwd)
    assert res["errors"] == 0
    real, claimed = list(csv.DictReader(open(table)))
    assert float(real["epsilon"]) == pytest.approx(2.0, rel=1e-4) and float(real["flower_claimed_epsilon"]) < 2.0
    assert float(claimed["flower_claimed_epsilon"]) == pytest.approx(2.0, rel=1e-4)
    assert float(claimed["epsilon"]) > 2.0 and claimed["flower_sample_size"] == "12"
    # z calibrated to Flower's claim is smaller than z calibrated to the real epsilon
    assert float(claimed["flower_noise_multiplier"]) < float(real["flower_noise_multiplier"])


# --- issue 20: a sweep writes a new table unless told to resume; a table holds one row per run ----------
def test_an_existing_table_is_refused_unless_resume_or_restart(tmp_path, capsys, fake_runner):
    table = tmp_path / "t.csv"
    path = _write(tmp_path / "s.toml", f'algorithm = "fake-alg"\n[sweep]\ntable = "{table}"\nseed = [0, 1]\n')
    assert main(["sweep", path]) == 0 and len(fake_runner) == 2
    before = table.read_text()
    line = _exit_line(capsys, ["sweep", path])
    assert "already holds 2 rows" in line and "--resume" in line and "--restart" in line
    assert table.read_text() == before and len(fake_runner) == 2  # nothing ran, nothing appended
    assert main(["sweep", path, "--set", "seed=0,1,2", "--resume"]) == 0 and len(fake_runner) == 3
    assert "give one of them" in _exit_line(capsys, ["sweep", path, "--restart", "--resume"])
    assert main(["sweep", path, "--restart"]) == 0 and len(fake_runner) == 5
    assert len(list(csv.DictReader(open(table)))) == 2
    # another table is a new table: the same points run again
    assert main(["sweep", path, "--table", str(tmp_path / "new.csv")]) == 0 and len(fake_runner) == 7
    # rows of the same runs under other keys (a default changed since): resuming would run them twice
    rows = list(csv.DictReader(open(table)))
    _write_rows(table, [{**r, "run_key": "old-" + r["run_key"]} for r in rows])
    line = _exit_line(capsys, ["sweep", path, "--resume"])
    assert "2 of the points to run are already in it under another run key" in line and len(fake_runner) == 7
    assert main(["sweep", path, "--resume", "--set", "seed=5"]) == 0 and len(fake_runner) == 8  # a new point runs


def test_duplicated_runs_in_a_table_are_an_error_not_averaged(tmp_path, capsys):
    base = {"status": "ok", "algorithm": "a", "users": 10, "seed": 0, "epsilon_target": 1.0, "test_metric": 0.6}
    rows = [
        {**base, "run_key": "k0"},
        {**base, "run_key": "k1", "seed": 1},
        {**base, "run_key": "k2", "test_metric": 0.9},  # same configuration as k0 under a new key
    ]
    table = _write_rows(tmp_path / "t.csv", rows)
    line = _exit_line(capsys, ["plot", table, "--kind", "privacy-utility", "--panel", "none"])
    assert "lines 2 and 4 are the same run (configuration)" in line
    same_key = _write_rows(tmp_path / "k.csv", [{**base, "run_key": "k0"}, {**base, "run_key": "k0", "seed": 1}])
    with pytest.raises(ex.ConfigError, match="run_key k0"):
        ex.plot_table(same_key, "privacy-utility", str(tmp_path / "k.png"), panel=None)
    # an error row and its ok retry are one run, not a duplicate
    retried = _write_rows(tmp_path / "r.csv", [{**base, "run_key": "k0", "status": "error"}, {**base, "run_key": "k0"}])
    assert ex.plot_table(retried, "privacy-utility", str(tmp_path / "r.png"), panel=None)[""]["a"][0][3] == 1


# --- sweep variants and exclusions ------------------------------------------------------------------------
def test_variants_are_named_configurations_and_exclude_drops_points(tmp_path, fake_runner):
    table = tmp_path / "t.csv"
    path = _write(
        tmp_path / "s.toml",
        f'algorithm = "fake-alg"\n[sweep]\ntable = "{table}"\nseed = [0, 1]\nepsilon = [1, 2]\n'
        '[[sweep.variants]]\nname = "short"\nrounds = 2\n'
        '[[sweep.variants]]\nname = "long"\nrounds = 20\nlr = 0.5\n'
        '[[sweep.exclude]]\nvariant = "long"\nepsilon = [1]\n',
    )
    spec = ex.load_sweep(path)
    points = spec.points()
    assert [(p["variant"], p["rounds"], p["epsilon"], p["seed"]) for p in points] == [
        ("short", 2, 1.0, 0),
        ("short", 2, 2.0, 0),
        ("short", 2, 1.0, 1),
        ("short", 2, 2.0, 1),
        ("long", 20, 2.0, 0),
        ("long", 20, 2.0, 1),
    ]
    assert ex.run_sweep(spec, log=lambda s: None)["ran"] == 6
    rows = list(csv.DictReader(open(table)))
    assert [r["variant"] for r in rows] == ["short"] * 4 + ["long"] * 2
    assert {r["rounds"] for r in rows if r["variant"] == "long"} == {"20"} and rows[-1]["lr"] == "0.5"
    assert {c.rounds for c in fake_runner} == {2, 20}


def test_a_runner_declares_its_own_settings_as_sweep_keys(tmp_path):
    """A plugin runner's own settings (beyond fedkl run's) are sweep keys and axes, checked against
    their defaults' types, given to the runner at their defaults when unset, and part of the run key."""
    seen = []

    def runner(settings, log):
        seen.append((settings.records, settings.scale, settings.label))
        return {**_fake_runner(settings, log), "table_extra": {"fake_extra": settings.records * settings.scale}}

    ex.register_runner("own-alg", runner, columns=("fake_extra",), settings={"records": 1, "scale": 0.5, "label": ""})
    try:
        with pytest.raises(ValueError, match="already a fedkl run setting"):
            ex.register_runner("bad-alg", runner, settings={"rounds": 3})
        table = tmp_path / "t.csv"
        path = _write(
            tmp_path / "s.toml", f'algorithm = "own-alg"\nscale = 2\n[sweep]\ntable = "{table}"\nrecords = [1, 10]\n'
        )
        spec = ex.load_sweep(path)
        assert ex.run_sweep(spec, log=lambda s: None)["ran"] == 2
        assert seen == [(1, 2.0, ""), (10, 2.0, "")]
        rows = list(csv.DictReader(open(table)))
        assert [(r["records"], r["fake_extra"]) for r in rows] == [("1", "2.0"), ("10", "20.0")]
        assert len({ex.run_key(p) for p in spec.points()}) == 2
        assert ex.run_key({"algorithm": "own-alg"}) == ex.run_key({"algorithm": "own-alg", "records": 1})
        bad = _write(tmp_path / "b.toml", f'algorithm = "own-alg"\n[sweep]\ntable = "{table}"\nrecords = [1.5]\n')
        with pytest.raises(ex.ConfigError, match="'records': expected int"):
            ex.load_sweep(bad)
    finally:
        ex.EXTERNAL_RUNNERS.pop("own-alg", None)


@pytest.mark.parametrize(
    "extra,needle",
    [
        ("[[sweep.variants]]\nrounds = 2\n", "needs `name"),
        ('[[sweep.variants]]\nname = "a"\nseed = 3\n', "also a [sweep] axis"),
        ('[[sweep.variants]]\nname = "a"\nrounds = 2.5\n', "'rounds'"),
        ("[[sweep.exclude]]\nseed = [0, 1]\n", "leaves no point"),
        ('[[sweep.exclude]]\nlr = "fast"\n', "'lr'"),
        ('[report]\nkind = "pie"\nmarkdown = "x.md"\n', "kind 'pie'"),
    ],
)
def test_bad_variants_exclusions_and_reports_exit_2(tmp_path, capsys, extra, needle):
    path = _write(tmp_path / "s.toml", f'[sweep]\ntable = "{tmp_path / "t.csv"}"\nseed = [0, 1]\n' + extra)
    _write_rows(tmp_path / "t.csv", [{"status": "ok", "run_key": "k", "algorithm": "a", "test_metric": 1}])
    assert needle in _exit_line(capsys, ["report", path])


# --- fedkl report: built-in kinds and report functions loaded by path ---------------------------------------
def _study(tmp_path, report: str) -> str:
    rows = []
    for alg, base in (("x", 0.6), ("y", 0.7)):
        for eps in (1.0, 4.0):
            for seed, d in enumerate((-0.02, 0.0, 0.02)):
                rows.append(
                    {
                        "run_key": f"{alg}{eps}{seed}",
                        "status": "ok",
                        "algorithm": alg,
                        "dataset": "d",
                        "users": 10,
                        "seed": seed,
                        "epsilon_target": eps,
                        "metric": "accuracy",
                        "test_metric": base + 0.01 * eps + d,
                    }
                )
    rows.append({**rows[0], "run_key": "bad", "seed": 7, "status": "error", "test_metric": 0.0})
    _write_rows(tmp_path / "t.csv", rows)
    return _write(tmp_path / "study.toml", f'[sweep]\ntable = "{tmp_path / "t.csv"}"\nseed = [0, 1, 2]\n' + report)


def test_builtin_table_report_is_mean_std_per_group(tmp_path, capsys):
    path = _study(
        tmp_path,
        f'[report]\nkind = "table"\nmarkdown = "{tmp_path / "r.md"}"\nrows = ["algorithm"]\n'
        'columns = "epsilon_target"\ndigits = 3\ntitle = "Fixture"\nnote = "Held-out accuracy."\n',
    )
    assert main(["report", path]) == 0 and "wrote" in capsys.readouterr().out
    assert (tmp_path / "r.md").read_text() == (
        "# Fixture\n\n"
        "| algorithm | epsilon_target = 1.0 | epsilon_target = 4.0 |\n|---|---|---|\n"
        "| x | 0.610 ± 0.020 (n=3) | 0.640 ± 0.020 (n=3) |\n"
        "| y | 0.710 ± 0.020 (n=3) | 0.740 ± 0.020 (n=3) |\n\nHeld-out accuracy.\n"
    )
    # --out-dir writes the same file elsewhere (to compare a regenerated report with a committed one)
    assert main(["report", path, "--out-dir", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "r.md").read_text() == (tmp_path / "r.md").read_text()


def test_builtin_curve_report_draws_and_tabulates(tmp_path):
    path = _study(
        tmp_path, f'[report]\nkind = "curve"\nfigure = "{tmp_path / "c.png"}"\nmarkdown = "{tmp_path / "c.md"}"\n'
    )
    assert ex.run_report(path) == [str(tmp_path / "c.png"), str(tmp_path / "c.md")]
    assert (tmp_path / "c.png").read_bytes().startswith(PNG)
    assert "| d (10 users) | y | 0.710 ± 0.020 (n=3) | 0.740 ± 0.020 (n=3) |" in (tmp_path / "c.md").read_text()


def test_report_function_is_loaded_by_file_path(tmp_path, capsys):
    fn = _write(
        tmp_path / "my_report.py",
        "def report(study):\n"
        "    path = study.output('markdown')\n"
        "    best = max(study.rows, key=lambda r: float(r['test_metric']))\n"
        "    open(path, 'w').write(f\"{len(study.rows)} rows; best {best['algorithm']} {study.option('label')}\\n\")\n"
        "    return [path]\n",
    )
    path = _study(tmp_path, f'[report]\nfunction = "{fn}:report"\nmarkdown = "{tmp_path / "f.md"}"\nlabel = "L"\n')
    assert ex.run_report(path) == [str(tmp_path / "f.md")]
    assert (tmp_path / "f.md").read_text() == "12 rows; best y L\n"  # the error row is not reported
    import sys

    assert not any(name == "my_report" or name.startswith("simulations") for name in sys.modules)
    reads = _write(tmp_path / "reads.py", "def report(study):\n    return [study.rows[0]['lam']]\n")
    bad = _study(tmp_path, f'[report]\nfunction = "{reads}:report"\nmarkdown = "x.md"\n')
    assert "the report reads 'lam' which" in _exit_line(capsys, ["report", bad])
    bad = _study(tmp_path, f'[report]\nfunction = "{fn}:nope"\nmarkdown = "x.md"\n')
    assert "has no function 'nope'" in _exit_line(capsys, ["report", bad])
    bad = _study(tmp_path, '[report]\nfunction = "simulations.reports:report"\nmarkdown = "x.md"\n')
    assert "'path/to/file.py:function'" in _exit_line(capsys, ["report", bad])


def test_report_without_a_report_table_or_table_exits_2(tmp_path, capsys):
    path = _write(tmp_path / "s.toml", f'[sweep]\ntable = "{tmp_path / "t.csv"}"\nseed = [0]\n')
    assert "has no [report] table" in _exit_line(capsys, ["report", path])
    path = _write(
        tmp_path / "s.toml", f'[sweep]\ntable = "{tmp_path / "t.csv"}"\nseed = [0]\n[report]\nkind = "table"\n'
    )
    assert "fedkl sweep" in _exit_line(capsys, ["report", path])


def test_no_library_or_test_file_imports_simulations():
    """fedkl/ and tests/ never import the simulations/ scripts (a report or plugin is loaded by path)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    offenders = []
    for path in [*root.joinpath("fedkl").rglob("*.py"), *root.joinpath("tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("insert", "append"):
                if ast.unparse(node.func.value) == "sys.path":
                    offenders.append(f"{path.relative_to(root)}: sys.path edit")
            offenders += [f"{path.relative_to(root)}: import {n}" for n in names if n.split(".")[0] == "simulations"]
    assert offenders == []


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "study",
    [
        "compare_optimizers",
        "paper002_movielens",
        "mean_output_pert_movielens",
        "paper004_eps",
        "paper002_slopes",
        "paper002_compare",
        "paper002_sc_slopes",
        "paper004_repro",
        "paper002_crossover_tuning",
        "paper002_crossover",
        "paper002_crossover_today",
        "paper002_crossover_silos",
        "paper002_delta_selection",
        "paper002_delta_fix",
        "paper002_crossover_grid",
        "tune_step_sizes",
        "p001_sparse_fw",
        "p001_sparse_fw_movielens",
        "audit",
        "correlated_noise_adaptive",
        "concentrated_gd",
        "concentrated_vs_p002",
    ],
)
def test_a_committed_study_report_reproduces_its_markdown(study, tmp_path, monkeypatch):
    """`fedkl report` on a study's committed table (no training) rewrites its committed markdown: every
    line but the one naming the command and its duration (the report function and plugin are loaded by
    path from the repository root, as `fedkl report` does)."""
    monkeypatch.chdir(REPO)
    runners, modules = dict(ex.EXTERNAL_RUNNERS), set(sys.modules)
    try:
        written = ex.run_report(f"simulations/studies/{study}.toml", out_dir=str(tmp_path))
    finally:  # the study's plugins and report modules do not outlive the test
        ex.EXTERNAL_RUNNERS.clear()
        ex.EXTERNAL_RUNNERS.update(runners)
        for name in set(sys.modules) - modules:
            if name.startswith(("fedkl_plugin_", "fedkl_report_")):
                del sys.modules[name]
    mds = [p for p in written if p.endswith(".md")]
    assert mds
    for md in mds:  # a study may write several (paper004_repro: paper004.md and paper004_quick.md)
        committed = open(os.path.join(REPO, "simulations", "results", os.path.basename(md))).read().splitlines()
        mine = open(md).read().splitlines()
        assert len(mine) == len(committed)
        differ = [i for i, (a, b) in enumerate(zip(mine, committed)) if a != b]
        assert all(mine[i].startswith(("Generated by", "Regenerate")) for i in differ), [mine[i] for i in differ]


STUDIES = sorted(
    name[: -len(".toml")] for name in os.listdir(os.path.join(REPO, "simulations", "studies")) if name.endswith(".toml")
)


@pytest.mark.parametrize("study", STUDIES)
def test_every_study_loads_with_its_report(study, monkeypatch):
    """Every study file loads (its plugins, values and [report]) into distinct points."""
    monkeypatch.chdir(REPO)
    runners, modules = dict(ex.EXTERNAL_RUNNERS), set(sys.modules)
    try:
        spec = ex.load_sweep(f"simulations/studies/{study}.toml")
        keys = [ex.run_key(p) for p in spec.points()]
    finally:
        ex.EXTERNAL_RUNNERS.clear()
        ex.EXTERNAL_RUNNERS.update(runners)
        for name in set(sys.modules) - modules:
            if name.startswith(("fedkl_plugin_", "fedkl_report_")):
                del sys.modules[name]
    assert spec.report and keys and len(set(keys)) == len(keys)


def test_the_crossover_runner_maps_its_noise_setting_to_fedkl_settings():
    """simulations/plugins/paper002_crossover.py: ``noise = "tight"`` keeps the committed table's settings,
    ``"today"`` asks fedkl for the profile calibration, the private Delta, the optimal phase split and the
    Newton local solver; the baselines read neither; another value is refused."""
    from fedkl.experiments.report import load_function

    runners, modules = dict(ex.EXTERNAL_RUNNERS), set(sys.modules)
    try:  # the plugin registers its runners on import: they do not outlive the test
        settings_for = load_function(os.path.join(REPO, "simulations/plugins/paper002_crossover.py:settings_for"))
    finally:
        ex.EXTERNAL_RUNNERS.clear()
        ex.EXTERNAL_RUNNERS.update(runners)
        for name in set(sys.modules) - modules:
            if name.startswith("fedkl_plugin_"):
                del sys.modules[name]
    args = (254, 1000, 8.0, 1 / 1000**1.1, {}, 0.1)
    assert settings_for("phased-erm", *args, "tight") == {
        "p002_records": 254,
        "p002_calibration": "tight",
        "p002_phase_split": "equal",  # the committed table's split (the default is optimal since issue 13)
    }
    assert settings_for("phased-erm", *args, "today") == {
        "p002_records": 254,
        "p002_calibration": "profile",
        "p002_delta_select": "sparse-vector",
        "p002_phase_split": "optimal",
    }
    assert "p002_phase_split" not in settings_for("sc-phased-sco", *args, "today")
    sc = settings_for("sc-output-pert", *args, "today")
    assert (
        sc["p002_delta_select"] == "sparse-vector"
        and sc["stability_delta"] == settings_for("sc-output-pert", *args, "tight")["stability_delta"]
    )
    assert settings_for("mean-output-pert", *args, "today")["mean_local_solver"] == "newton"
    assert settings_for("mean-output-pert", *args, "today")["mean_lam_rule"] == "fixed"  # the committed tables' lam = 1
    assert settings_for("mean-output-pert", *args, "today-lam")["mean_lam_rule"] == "predicted-error"
    assert settings_for("phased-mean-output-pert", *args, "today")["mean_calibration"] == "profile"
    assert settings_for("mean-output-pert", *args, "tight")["mean_calibration"] == "tight"
    assert settings_for("noisy-gd", *args, "today") == settings_for("noisy-gd", *args, "tight")
    with pytest.raises(ValueError, match="noise must be one of"):
        settings_for("phased-erm", *args, "loud")
