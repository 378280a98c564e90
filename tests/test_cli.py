"""The `fedkl` console script: account agrees with dp-accounting, run writes its results, errors are one line."""

import json
import subprocess
import sys

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from fedkl.cli import main
from fedkl.privacy.charges import GaussianCharge

FEDKL = [sys.executable, "-m", "fedkl.cli"]


def _dp_accounting_eps(z, q, steps, delta):
    step = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        step = dp_accounting.PoissonSampledDpEvent(q, step)
    event = dp_accounting.SelfComposedDpEvent(step, steps)
    out = {}
    for name, acc in (("pld", pld.PLDAccountant()), ("rdp", rdp.RdpAccountant())):
        acc.compose(event)
        out[name] = acc.get_epsilon(delta)
    return out


SETTINGS = [
    (1.2, 0.03547, 100, 1e-5),  # the TFF-tutorial setting of the issue: PLD ~1.71, RDP ~1.99
    (1.0, 0.01, 1000, 1e-5),  # deps.md: RDP 2.10, PLD 1.83
    (4.0, 1.0, 30, 1e-6),  # full participation (no amplification)
    (0.8, 0.1, 50, 1e-4),
]


@pytest.mark.parametrize("z,q,steps,delta", SETTINGS)
def test_account_matches_dp_accounting(capsys, z, q, steps, delta):
    assert (
        main(
            [
                "account",
                "--noise-multiplier",
                str(z),
                "--sampling-rate",
                str(q),
                "--steps",
                str(steps),
                "--delta",
                str(delta),
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    ref = _dp_accounting_eps(z, q, steps, delta)
    for name in ("pld", "rdp"):
        assert res["epsilon"][name] == pytest.approx(ref[name], rel=0.01)
        assert "dp-accounting" in res["accountants"][name]


def test_account_reference_numbers_of_the_issue(capsys):
    main(
        [
            "account",
            "--noise-multiplier",
            "1.2",
            "--sampling-rate",
            "0.03547",
            "--steps",
            "100",
            "--delta",
            "1e-5",
            "--json",
        ]
    )
    res = json.loads(capsys.readouterr().out)
    assert res["epsilon"]["pld"] == pytest.approx(1.71, rel=0.01)
    assert res["epsilon"]["rdp"] == pytest.approx(1.99, rel=0.01)


def test_account_inverse_round_trips(capsys):
    main(
        [
            "account",
            "--epsilon",
            "1.99",
            "--sampling-rate",
            "0.03547",
            "--steps",
            "100",
            "--delta",
            "1e-5",
            "--accountant",
            "rdp",
            "--json",
        ]
    )
    z = json.loads(capsys.readouterr().out)["noise_multiplier"]["rdp"]
    assert z == pytest.approx(1.2, rel=0.01)
    assert _dp_accounting_eps(z, 0.03547, 100, 1e-5)["rdp"] <= 1.99 * (1 + 1e-6)


def test_account_zcdp_conversions(capsys):
    main(["account", "--rho", "0.1", "--delta", "1e-5", "--json"])
    res = json.loads(capsys.readouterr().out)
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.ZCDpEvent(0.1))
    assert res["epsilon"]["cks"] == pytest.approx(acc.get_epsilon(1e-5), rel=0.01)
    assert res["epsilon"]["bun_steinke"] > res["epsilon"]["cks"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["account", "--delta", "2"], "--delta"),
        (["account", "--delta", "1e-5"], "exactly one of"),
        (["account", "--noise-multiplier", "-1", "--delta", "1e-5"], "--noise-multiplier"),
        (["account", "--noise-multiplier", "1", "--sampling-rate", "0", "--delta", "1e-5"], "--sampling-rate"),
        (["run", "--epsilon", "0"], "--epsilon"),
        (["run", "--dataset", "nope"], "--dataset"),
        (["run", "--rounds", "1.5"], "--rounds"),
        (["run", "--kernels", "turbo"], "--kernels"),
        (["frobnicate"], "invalid choice"),
        (["ledger", "inspect", "x.sqlite"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, needle):
    proc = subprocess.run(FEDKL + args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and "--help" in lines[0]


def test_help_on_every_command():
    for args in (["--help"], ["run", "--help"], ["account", "--help"], ["ledger", "--help"]):
        proc = subprocess.run(FEDKL + args, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage" in proc.stdout


def test_run_writes_result_and_ledger_then_refuses_when_budget_is_spent(tmp_path):
    out = tmp_path / "run"
    args = [
        "run",
        "--dataset",
        "synthetic-logistic",
        "--rounds",
        "5",
        "--noise-seed",
        "1",
        "--out",
        str(out),
        "--epsilon",
        "3",
    ]
    proc = subprocess.run(FEDKL + args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "epsilon = " in proc.stdout and "test accuracy" in proc.stdout
    res = json.loads((out / "result.json").read_text())
    for key in (
        "algorithm",
        "dataset",
        "users",
        "epsilon",
        "delta",
        "rho",
        "accountant",
        "test_metric",
        "nonprivate_reference",
        "seed",
        "wall_time_s",
        "noise_rng",
    ):
        assert key in res
    assert res["noise_rng"] == "seeded"
    # the budget (sized by CKS) is spent; the epsilon reported is the exact one of these Gaussian releases
    assert res["epsilon_by_budget_conversion"] == pytest.approx(3.0, rel=1e-6)
    assert res["epsilon"] < res["epsilon_by_budget_conversion"] <= 3.0 * (1 + 1e-9)
    assert res["ledger"]["releases"] == 5
    # a second run on the same ledger has nothing left: clear error, exit code 3, nothing charged
    again = subprocess.run(
        FEDKL + args[:-4] + ["--ledger", str(out / "ledger.sqlite"), "--out", str(tmp_path / "b"), "--epsilon", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 3
    assert "budget" in again.stderr and "spent" in again.stderr
    from fedkl.privacy import PrivacyLedger

    with PrivacyLedger(out / "ledger.sqlite") as ledger:
        assert ledger.num_releases() == 5
        ledger.verify()


def test_run_resumes_a_partly_spent_ledger(tmp_path):
    """A restarted run sees what an earlier run spent and trains on the rest only."""
    from fedkl.runner import RunConfig, run_training

    ledger = str(tmp_path / "shared.sqlite")
    common = dict(
        dataset="synthetic-logistic", epsilon=2.0, delta=1e-5, rounds=4, noise_seed=0, ledger=ledger, reference=False
    )
    first = run_training(RunConfig.from_settings(**common, out=str(tmp_path / "a")), log=lambda s: None)
    from fedkl.privacy import Budget, PrivacyLedger, rho_for_eps_delta

    full = rho_for_eps_delta(2.0, 1e-5)
    assert first["rho"] == pytest.approx(full, rel=1e-9)
    # simulate an interrupted earlier run: a fresh ledger with half the budget already charged
    ledger2 = str(tmp_path / "half.sqlite")
    with PrivacyLedger(ledger2, Budget(2.0, 1e-5)) as led:
        from fedkl.data import load_dataset

        ids = load_dataset("synthetic-logistic", seed=0).train.user_ids
        led.charge(list(ids), GaussianCharge(rho=full / 2), label="earlier")
    second = run_training(
        RunConfig.from_settings(**{**common, "ledger": ledger2}, out=str(tmp_path / "b")), log=lambda s: None
    )
    assert second["rho"] == pytest.approx(full, rel=1e-9)  # total per user = the budget
    assert second["sigma_sum"] == pytest.approx(first["sigma_sum"] * 2**0.5, rel=1e-6)  # half the rho left
    assert second["epsilon"] <= 2.0 * (1 + 1e-9)


def test_run_output_perturbation_on_a_small_synthetic_population(tmp_path):
    """sc-output-pert runs end to end from `fedkl run` and is charged as an (eps, delta) release."""
    from fedkl.runner import RunConfig, run_training

    res = run_training(
        RunConfig.from_settings(
            dataset="synthetic-logistic",
            users=12,
            algorithm="sc-output-pert",
            reg=0.5,
            epsilon=1.0,
            delta=1e-3,
            noise_seed=0,
            out=str(tmp_path / "o"),
            reference=False,
            force=True,
        ),
        log=lambda s: None,
    )  # 12 users: noise swamps it
    assert "basic composition" in res["accountant"]
    assert res["ledger"]["releases"] == 1
    assert res["epsilon"] <= 1.0 * (1 + 1e-9) and res["ledger"]["max_user_epsilon"] <= 1.0 + 1e-9
    with pytest.raises(ValueError, match="--reg"):
        run_training(
            RunConfig.from_settings(
                dataset="synthetic-logistic",
                users=12,
                algorithm="sc-output-pert",
                out=str(tmp_path / "p"),
                reference=False,
            ),
            log=lambda s: None,
        )


@pytest.mark.flower
def test_run_over_flower_backend_matches_inprocess(tmp_path):
    """`fedkl run --backend flower-local` trains the same model and charges the same ledger."""
    import fedkl.flower.backends  # noqa: F401  (the run layer never imports a transport: registered here)
    from fedkl.runner import RunConfig, run_training

    common = dict(dataset="synthetic-logistic", users=12, rounds=3, noise_seed=4, reference=False)
    here = run_training(RunConfig.from_settings(**common, out=str(tmp_path / "i")), log=lambda s: None)
    there = run_training(
        RunConfig.from_settings(**common, backend="flower-local", out=str(tmp_path / "f")), log=lambda s: None
    )
    assert there["backend"] == "flower-local"
    assert there["test_metric"]["value"] == pytest.approx(here["test_metric"]["value"], abs=1e-12)
    assert there["rho"] == pytest.approx(here["rho"], rel=1e-12)
    assert there["ledger"]["releases"] == here["ledger"]["releases"] == 3


def test_plan_ranks_the_algorithms_by_their_public_noise_without_spending(tmp_path, capsys, monkeypatch):
    """fedkl plan builds each algorithm as fedkl run would, ranks them by noise over signal (the
    output-perturbation ratio is the run's own forecast), lists refusals, and writes no ledger."""
    import json

    from fedkl.planner import plan
    from fedkl.runner import RunConfig, run_training

    monkeypatch.chdir(tmp_path)
    args = [
        "plan",
        "--dataset",
        "synthetic-logistic",
        "--users",
        "60",
        "--reg",
        "0.1",
        "--epsilon",
        "4",
        "--algorithms",
        "noisy-gd,sc-output-pert,phased-sco,kl-spider",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    ranked = [r["algorithm"] for r in out["ranked"]]
    assert set(ranked) == {"noisy-gd", "sc-output-pert"} and out["best"] == ranked[0]
    ratios = [r["ratio"] for r in out["ranked"]]
    assert ratios == sorted(ratios)
    unranked = {r["algorithm"]: r["kind"] for r in out["unranked"]}
    assert unranked == {"phased-sco": "refused", "kl-spider": "other"}  # 60 users: too few for its cohorts
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing charged
    # the output-perturbation ratio is the forecast the run itself logs before reading data
    logged = []
    run_training(
        RunConfig.from_settings(
            dataset="synthetic-logistic",
            users=60,
            reg=0.1,
            epsilon=4.0,
            algorithm="sc-output-pert",
            force=True,
            reference=False,
            out=str(tmp_path / "r"),
        ),
        log=logged.append,
    )
    forecast = next(line for line in logged if line.startswith("forecast"))
    sc = next(r for r in out["ranked"] if r["algorithm"] == "sc-output-pert")
    assert f"noise_over_signal {sc['ratio']:.4g}" in forecast
    assert (
        plan({"dataset": "synthetic-logistic", "users": 60, "reg": 0.1, "epsilon": 4.0}, ["noisy-gd"])["ranked"][0][
            "ratio"
        ]
        == next(r for r in out["ranked"] if r["algorithm"] == "noisy-gd")["ratio"]
    )


P002 = ("phased-erm", "phased-sco", "sc-phased-erm", "sc-phased-sco", "sc-output-pert", "mean-output-pert",
        "phased-mean-output-pert")  # fmt: skip


@pytest.mark.parametrize("name", P002)
def test_paper002_refuses_add_remove_before_reading_data(tmp_path, capsys, name):
    """Paper 002's proofs are for replace-one: add-remove is refused in one line, nothing charged
    (it used to run and report 'user-level (add-remove)')."""
    out = tmp_path / "run"
    argv = ["run", "--algorithm", name, "--dataset", "synthetic-logistic", "--users", "300", "--reg", "0.5",
            "--neighbouring", "add-remove", "--force", "--no-reference", "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "proven for --neighbouring replace-one only" in err
    assert not (out / "result.json").exists()


def test_result_says_what_the_relation_means(tmp_path):
    out = tmp_path / "run"
    argv = ["run", "--dataset", "synthetic-logistic", "--users", "20", "--rounds", "2", "--neighbouring",
            "add-remove", "--no-reference", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["clients_see"].startswith("private values only: the current model")
    assert "zero-out" in result["neighbouring_means"] and result["guarantee"]["relations"] == [
        "replace-one",
        "add-remove",
    ]


def test_account_under_replace_one_states_its_convention_and_skips_what_rdp_cannot(capsys):
    argv = ["account", "--noise-multiplier", "2", "--sampling-rate", "0.01", "--steps", "200",
            "--neighbouring", "replace-one", "--delta", "1e-5"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[PLD" in out and "[RDP" not in out and "rdp: no analysis of this schedule under replace-one" in out
    assert "z = sigma / Delta" in out
    assert main(["account", "--epsilon", "2", *argv[3:], "--json"]) == 0  # the inverse, which used to fail
    res = json.loads(capsys.readouterr().out)
    assert set(res["noise_multiplier"]) == {"pld"} and res["noise_multiplier"]["pld"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["account", "--noise-multiplier", "0.01", "--steps", "100000", "--delta", "1e-5"],
        ["account", "--epsilon", "100000", "--steps", "10", "--delta", "1e-5", "--accountant", "pld"],
        ["run", "--algorithm", "dp-sgd", "--epsilon", "100000", "--dataset", "synthetic-logistic", "--users", "30"],
        # the (eps, delta) calibrations of output perturbation evaluate e^eps (an OverflowError traceback before)
        ["run", "--algorithm", "sc-output-pert", "--epsilon", "100000", "--reg", "0.1", "--dataset", "tv16"],
    ],
)
def test_work_that_cannot_finish_in_bounded_memory_is_refused_in_one_line(argv, tmp_path, capsys):
    """Issue 20: these grew to 23 GB / asked for 72.8 TiB / overflowed; now exit 2 with one line, before any
    PLD is built or any budget is spent."""
    if argv[0] == "run":
        assert main([*argv, "--out", str(tmp_path / "run"), "--no-reference"]) == 2
    else:
        with pytest.raises(SystemExit) as exit_:  # argparse's error(): exit 2
            main(argv)
        assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no meaningful privacy" in err[0]
