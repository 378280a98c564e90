"""Build one registered algorithm the way the runner does, for tests that inspect its configuration."""

from __future__ import annotations

from fedkl.algorithms.registry import BuildContext, algorithm_spec


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
