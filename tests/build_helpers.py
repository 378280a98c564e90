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


class _Small(Mapping):
    """name -> the algorithm's small, fast setting: its class's ``small`` declaration (issue 29; the schedules
    the theorems set are data-independent, so a short run exercises every query and release kind the
    algorithm makes; "users": the population when 12 users are too few for the algorithm's plan). A view of
    the registry, not a second table."""

    def __getitem__(self, name):
        return dict(REGISTRY[name].small)

    def __iter__(self):
        return iter(REGISTRY)

    def __len__(self):
        return len(REGISTRY)


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
