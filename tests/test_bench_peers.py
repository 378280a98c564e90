"""The pure parts of simulations/bench_peers.py: the scaling-exponent fit, the ratios, the table, the data.

No timing is asserted (the benchmark itself is run by hand; see its docstring)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedkl.experiments.report import load_function

# loaded by path (the library and tests never import simulations/ as a package)
_FILE = str(Path(__file__).resolve().parents[1] / "simulations" / "bench_peers.py")
loglog_slope = load_function(_FILE + ":loglog_slope")
ratio_rows = load_function(_FILE + ":ratio_rows")
exponents = load_function(_FILE + ":exponents")
markdown = load_function(_FILE + ":markdown")
make_data = load_function(_FILE + ":make_data")


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0])
def test_loglog_slope_recovers_a_power_law(power):
    xs = np.array([30.0, 100.0, 300.0, 1000.0])
    assert loglog_slope(xs, 0.7 * xs**power) == pytest.approx(power, abs=1e-12)


def test_loglog_slope_is_least_squares_through_noisy_points():
    xs, ys = [1.0, 10.0, 100.0], [1.0, 20.0, 100.0]  # log10: (0, 0), (1, 1.301), (2, 2)
    assert loglog_slope(xs, ys) == pytest.approx(1.0, abs=1e-12)  # the fitted line through three points
    assert loglog_slope(xs[:2], ys[:2]) == pytest.approx(np.log10(20.0))


@pytest.mark.parametrize("xs, ys", [([1.0], [1.0]), ([2.0, 2.0], [1.0, 3.0]), ([1.0, 2.0], [0.0, 1.0])])
def test_loglog_slope_refuses_what_it_cannot_fit(xs, ys):
    with pytest.raises(ValueError):
        loglog_slope(xs, ys)


def _row(impl, n, m, t):
    return {"impl": impl, "users": n, "records": m, "min_s": t, "median_s": 1.5 * t}


def test_ratios_are_to_fedkl_fast_at_the_same_point_and_exponents_per_axis():
    rows = [
        _row("fedkl-fast", 100, 10, 1.0),
        _row("peer", 100, 10, 30.0),
        _row("fedkl-fast", 1000, 10, 10.0),
        _row("peer", 1000, 10, 3000.0),  # peer grows like n^2, fedkl like n
        _row("fedkl-fast", 100, 100, 4.0),
        {"impl": "peer", "users": 100, "records": 100, "note": "not run"},
    ]
    ratio_rows(rows)
    assert [r["x_fast"] for r in rows] == [1.0, 30.0, 1.0, 300.0, 1.0, None]
    slopes = exponents(rows, users_fixed_m=10, records_fixed_n=100)
    assert slopes["fedkl-fast"]["users"] == pytest.approx(1.0)
    assert slopes["peer"]["users"] == pytest.approx(2.0)
    assert slopes["fedkl-fast"]["records"] == pytest.approx(np.log10(4.0))
    assert slopes["peer"]["records"] is None  # one point ran: no fit


def test_markdown_has_one_line_per_row_and_marks_a_failed_check():
    rows = ratio_rows([_row("fedkl-fast", 100, 10, 0.002), {"impl": "pfl", "users": 100, "records": 10, "note": "x"}])
    checks = [
        {"impl": "floor", "max_abs_diff": 0.0, "max_abs_ref": 1e-2},
        {"impl": "pfl", "max_abs_diff": 3e-4, "max_abs_ref": 1e-2},
    ]
    md = markdown(rows, exponents(rows, 10, 100), checks, ["note line"])
    assert "| 100 | 10 | fedkl-fast | 2.00 | 3.00 | 1.00 |" in md
    assert "| 100 | 10 | pfl | — | — | — |" in md
    assert "| pfl | 3.00e-04 | 3.00e-02 | NO |" in md and "| floor | 0.00e+00 | 0.00e+00 | yes |" in md
    assert md.rstrip().endswith("note line")


def test_the_data_are_the_same_in_every_child_and_in_the_unit_ball():
    X, y = make_data(7, 5, 4, seed=3)
    X2, y2 = make_data(7, 5, 4, seed=3)
    assert X.shape == (7, 5, 4) and y.shape == (7, 5)
    assert np.array_equal(X, X2) and np.array_equal(y, y2)
    assert np.linalg.norm(X, axis=2).max() <= 1.0 + 1e-12 and set(np.unique(y)) <= {-1.0, 1.0}
