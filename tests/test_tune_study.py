"""Issue 32's study (simulations/studies/tune_private_vs_oracle.toml): `fedkl report` on the committed table
rewrites the committed markdown and figure, and the table holds the three methods for every cell."""

import csv
import os

from fedkl import experiments as ex

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY = "simulations/studies/tune_private_vs_oracle.toml"


def test_the_tune_study_report_reproduces_its_markdown(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    written = ex.run_report(STUDY, out_dir=str(tmp_path))
    md = next(p for p in written if p.endswith(".md"))
    committed = open(os.path.join(REPO, "simulations", "results", os.path.basename(md))).read()
    assert open(md).read() == committed
    assert any(p.endswith(".png") and os.path.getsize(p) > 0 for p in written)
    rows = list(csv.DictReader(open(os.path.join(REPO, "simulations/results/tune_private_vs_oracle_runs.csv"))))
    cells = {(r["dataset"], r["epsilon"], r["seed"]) for r in rows}
    spec = ex.load_sweep(STUDY)
    datasets = {c[0] for c in cells}
    assert datasets == set(spec.axes["dataset"]) and len(datasets - {"movielens-sparse"}) >= 4  # issue 32's study
    assert not datasets & {"movielens", "adult", "tv16"}  # the data the default step sizes were picked on
    assert {"2.0", "8.0"} == {c[1] for c in cells} and {c[2] for c in cells} == {"0", "1", "2", "3", "4"}
    assert len(cells) == len(datasets) * 2 * 5
    for cell in cells:  # every cell has the private search, the defaults and the oracle
        methods = sorted(r["method"] for r in rows if (r["dataset"], r["epsilon"], r["seed"]) == cell)
        assert methods == ["defaults", "oracle", "tune"], cell
    for r in rows:  # the search's epsilon is the total; the others' is their training alone (<= the total)
        assert float(r["epsilon_reported"]) <= float(r["epsilon"]) * (1 + 1e-9)
