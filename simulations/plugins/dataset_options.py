"""External sweep runner ``with-data-options``: one ``fedkl run`` point on a dataset loaded with loader
options that ``fedkl run`` has no flag for (``fedkl.data.load_dataset(dataset, **options)``: e.g.
Shakespeare's ``min_chars`` / ``max_per_user``, flights' ``departure_delay`` / ``min_records`` /
``max_records``). Used by simulations/studies/correlated_noise_adaptive.toml.

Own settings: ``method`` (the fedkl algorithm trained) and ``data_options`` (``"key=value,..."``;
values parsed as bool ``true``/``false``, int, float, else string). Every other setting of the point
that differs from its ``fedkl run`` default (rounds, lr, sampling_rate, factorization, problem, model,
neighbouring, noise_seed, ...) is passed unchanged to ``fedkl.train`` on the loaded
``FederatedDataset``: the same code path as ``fedkl run`` (ledger, accountant, noise), only the data
differ. The dataset's split seed is the point's ``seed``."""

from __future__ import annotations

import shutil
import tempfile

import fedkl
from fedkl.data import load_dataset
from fedkl.experiments import register_runner, runner_result
from fedkl.experiments.config import run_fields

NAME = "with-data-options"
SKIP = {"dataset", "algorithm", "seed", "out", "ledger", "users"}


def parse_options(text: str) -> dict:
    out: dict = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"{NAME}: data_options item {item!r} is not key=value")
        value: object = raw
        if raw in ("true", "false"):
            value = raw == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    pass
        out[key.strip()] = value
    return out


def run(s, log) -> dict:
    ds = load_dataset(s.dataset, seed=int(s.seed), **parse_options(s.data_options))
    defaults = {name: f.default for name, f in run_fields().items()}
    settings = {k: getattr(s, k) for k in defaults if k not in SKIP and getattr(s, k) != defaults[k]}
    out = tempfile.mkdtemp(prefix="fedkl-dataopt-")
    try:
        r = fedkl.train(ds, algorithm=s.method, log=None, out=out, **settings)
        res = r.result
    finally:
        shutil.rmtree(out, ignore_errors=True)
    log(f"{NAME} {s.dataset} {s.method}: test {res['test_metric']}")
    return runner_result(
        s.method,
        s.dataset,
        ds.train.num_users,
        res["epsilon"],
        res["delta"],
        int(s.seed),
        res.get("rounds"),
        {"data_options": s.data_options},
        test_metric=res["test_metric"],
        test_metrics=res["test_metrics"],
        trivial_baseline=res["trivial_baseline"],
        nonprivate_reference=res.get("nonprivate_reference"),
        neighbouring=res["neighbouring"],
    )


register_runner(
    NAME,
    run,
    columns=("data_options",),
    description=__doc__.splitlines()[0],
    settings={"method": "noisy-gd", "data_options": ""},
)
