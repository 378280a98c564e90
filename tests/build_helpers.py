"""Build one registered algorithm the way the runner does, for tests that inspect its configuration;
and SMALL, a small fast setting per registered algorithm."""

from __future__ import annotations

from collections.abc import Mapping

from fedkl.algorithms.registry import REGISTRY, BuildContext, algorithm_spec


def build(cfg, rho_total: float, *, problem, dataset, delta: float, ledger=None, user_ids=()):
    """``cfg``'s algorithm built from its Params with ``rho_total`` zCDP left and, with ``ledger``,
    the (eps, delta) every listed user can still afford (as :func:`fedkl.runner.train_federation`)."""
    approx = ledger.approx_left(user_ids) if ledger is not None else (0.0, 0.0)
    conversion = ledger.budget.conversion if ledger is not None else "cks"
    context = BuildContext(
        problem=problem,
        feature_bound=dataset.feature_bound,
        user_ids=tuple(user_ids),
        delta=delta,
        rho_left=rho_total,
        approx_left=approx,
        conversion=conversion,
        neighbouring=cfg.neighbouring,
        seed=cfg.seed,
    )
    return algorithm_spec(cfg.algorithm).build(cfg.params, context)


# small, fast settings per algorithm (the schedules the theorems set are data-independent, so a
# short run exercises every query and release kind the algorithm makes). The dp-accounting schedules
# use RDP here: PLD calibration at the tiny populations of this test takes a minute per run.
# "users": the population when 12 users are too few for the algorithm's plan.
SCHEDULED = {"neighbouring": "add-remove", "sampling_rate": 0.5, "accountant": "rdp"}
_LEGACY_SMALL = {  # transitional (issue 29): an Algorithm class declares its own ``small``
    "noisy-gd": {},
    "noisy-gd-conc": {"conc_records": 20},
    "noisy-gd-outlier": {"users": 300, "conc_records": 10, "outlier_test_share": 0.5},  # its PTR test needs n >> noise
    "noisy-fw": {"fw_rounds": 4},
    "vr-fw": {"users": 20, "vrfw_rounds": 3, "vrfw_batch": 4},  # 18 users in 7 slots: anchors and (g, diff) pairs
    "vr-fw-lp": {"users": 20, "vrfw_rounds": 3, "vrfw_batch": 4},
    "gll-phased-sgd": {"radius": 2.0},
    "pg-mirror-descent": {"pgmd_outer_rounds": 3, "pgmd_inner_rounds": 2},
    "dp-sgd": SCHEDULED,
    "dp-rmsprop": {**SCHEDULED, "lr": 0.05},
    "dp-adam": {**SCHEDULED, "lr": 0.05},
    "dp-adambc": {**SCHEDULED, "lr": 0.05},
    "dp-fedavg": {**SCHEDULED, "local_steps": 2, "batch_size": 3},
    "dp-ftrl": {"neighbouring": "add-remove", "min_separation": 2, "max_participations": 2, "local_steps": 2},
    "sc-output-pert": {"reg": 0.5},
    "phased-erm": {"reg": 0.1, "p002_delta_rule": "fixed", "p002_phases": 2, "p002_lam": 0.05},
    "phased-sco": {"reg": 0.1, "p002_delta_rule": "fixed", "p002_phases": 1, "p002_min_cohort": 4, "p002_lam": 0.05},
    "sc-phased-erm": {"reg": 0.5, "p002_delta_rule": "scaled", "p002_phases": 1},
    "sc-phased-sco": {"reg": 0.5, "p002_delta_rule": "scaled", "p002_phases": 1, "p002_min_cohort": 4},
    "mean-output-pert": {"users": 40, "mean_rho_fraction": 0.5},
    "phased-mean-output-pert": {"users": 60, "mean_rho_fraction": 0.5},
    "kl-adaptive-gd": {"reg": 0.1, "kl_max_rounds": 3},
    "kl-spider": {"reg": 0.1, "kl_max_rounds": 4, "kl_contraction_constant": 1.0, "kl_floor_constant": 1.0},
    "kl-prox-point": {"reg": 0.1, "kl_prox_steps": 2, "rounds": 2},
    "fkt-snowball": {"radius": 2.0},
    "fkt-snowball-sc": {"radius": 2.0, "reg": 0.1},
    "fkt-phased-sgd": {"radius": 2.0},
    "fkt-phased-erm": {"radius": 2.0},
    "fkt-sc-reduction": {"radius": 2.0, "reg": 0.1, "users": 48},
    "fkt-sc-localization": {"radius": 2.0, "reg": 0.1},
}


class _Small(Mapping):
    """name -> the algorithm's small setting: its class's ``small`` declaration (issue 29), else the legacy
    table above (algorithms not yet converted)."""

    def __getitem__(self, name):
        spec = REGISTRY[name]
        return dict(spec.small) if spec.small is not None else _LEGACY_SMALL[name]

    def __iter__(self):
        return iter([n for n, s in REGISTRY.items() if s.small is not None or n in _LEGACY_SMALL])

    def __len__(self):
        return len(list(iter(self)))


SMALL = _Small()


def counting_federation(problem, dataset):
    """An InProcessFederation whose ``calls`` counts every query it answers (tests of refusals that
    must come before any data is read)."""
    from fedkl.federation.inprocess import InProcessFederation

    class Counting(InProcessFederation):
        calls = 0

        def compute(self, query, users=None):
            self.calls += 1
            return super().compute(query, users)

    return Counting(problem, dataset)


def small_config(name: str, out, **extra):
    """A RunConfig of ``name`` at its SMALL setting on synthetic-logistic (seeded, no reference),
    writing to ``out``."""
    from fedkl.runner import RunConfig

    kw = {**SMALL[name], **extra}
    base = dict(dataset="synthetic-logistic", problem="logistic", algorithm=name, epsilon=3.0, rounds=3, lr=0.5,
                clip=1.0, seed=2, noise_seed=5, reference=False, force=True, users=kw.pop("users", 12))  # fmt: skip
    return RunConfig.from_settings(strict=False, **{**base, **kw}, out=str(out))
