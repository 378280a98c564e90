"""Guarantees that would mean nothing are refused in one line, in the user's terms, before anything is
charged (issue 31): delta >= 1/n (it allows publishing one user's data outright) unless --allow-large-delta,
which the privacy line then says; a file of one user; and a data file column left out of the features is
named, never dropped silently."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fedkl.cli import main

RUN = ["run", "--dataset", "synthetic-logistic", "--users", "4", "--rounds", "2", "--no-reference", "--force"]


def test_delta_of_at_least_one_over_n_is_refused_before_anything_is_charged(tmp_path, capsys):
    assert main([*RUN, "--delta", "0.25", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "delta = 0.25 is at least 1/n = 0.25 for n = 4 users" in err and "one user's data outright" in err
    assert "\n" not in err and not (tmp_path / "o").exists()  # no folder, no ledger: nothing charged


def test_allow_large_delta_runs_and_says_so_next_to_epsilon(tmp_path, capsys):
    assert main([*RUN, "--delta", "0.5", "--allow-large-delta", "--out", str(tmp_path / "o")]) == 0
    (line,) = [s for s in capsys.readouterr().out.splitlines() if s.startswith("privacy:")]
    assert "delta = 0.5" in line and "WARNING: delta >= 1/n = 0.25 (--allow-large-delta)" in line


def test_the_default_delta_is_below_one_over_n_from_two_users():
    from fedkl.runner import check_delta, default_delta

    for n in (2, 3, 4, 10, 10**6):
        check_delta(default_delta(n), n)  # accepted
        assert default_delta(n) < 1 / n
    with pytest.raises(ValueError, match="at least 1/n"):
        check_delta(1 / 3, 3)


def _csv(tmp_path, users) -> str:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(
        {
            "user": np.repeat(users, 20),
            "x1": rng.uniform(-0.5, 0.5, 20 * len(users)),
            "x2": rng.uniform(-0.5, 0.5, 20 * len(users)),
            "city": rng.choice(["Oslo", "Lyon"], 20 * len(users)),
            "y": rng.integers(0, 2, 20 * len(users)),
        }
    )
    path = tmp_path / "d.csv"
    frame.to_csv(path, index=False)
    return str(path)


FILE = ["--user-column", "user", "--label-column", "y", "--task", "binary", "--rounds", "2", "--no-reference"]


def test_a_one_user_file_is_refused_in_the_users_terms(tmp_path, capsys):
    assert main(["run", "--dataset", _csv(tmp_path, ["u1"]), *FILE, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "the data hold 1 user(s)" in err and "at least 2" in err and "\n" not in err
    assert "budget delta" not in err and not (tmp_path / "o").exists()


def test_a_text_column_left_out_of_the_features_is_named(tmp_path, capsys):
    users = [f"u{i}" for i in range(8)]
    assert main(["run", "--dataset", _csv(tmp_path, users), *FILE, "--force", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "note: d.csv: column(s) 'city' not used (not numeric" in out and "--feature-columns" in out


def test_from_dataframe_names_the_columns_it_leaves_out(tmp_path):
    from fedkl.data.custom import from_dataframe

    frame = pd.read_csv(_csv(tmp_path, ["a", "b", "c"]))
    with pytest.warns(UserWarning, match="column\\(s\\) 'city' not used"):
        ds = from_dataframe(frame, user="user", label="y", task="binary")
    assert ds.train.X.shape[1] == 2
