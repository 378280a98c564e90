"""Paper 003 (Feldman, Koren, Talwar 2020): localization (snowball, phased SGD/ERM, strongly convex reductions).

| name | problem class | guarantee | rate (excess population loss; rho_p = sqrt(2 rho)) |
|---|---|---|---|
| ``fkt-snowball`` | convex, L-Lipschitz, beta-smooth (eta <= 2/beta) | user-level rho-zCDP of the LAST iterate (amplification by iteration), charged per batch as (eps, delta) | O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))) (Thm 3.6; ``constant``: x log n, Thm 3.5) |
| ``fkt-snowball-sc`` | each f_u lam-strongly convex, smooth | same | O((L^2 log^2 n/lam)(1/n + d/(rho_p^2 n^2))) (Thm 5.4) |
| ``fkt-phased-sgd`` | convex, Lipschitz, smooth | user-level rho-zCDP of every phase output; each user in one phase | O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))), < n gradients (Thm 4.4) |
| ``fkt-phased-erm`` | convex, Lipschitz (smooth: gd solver; any: subgradient) | same (pure zCDP: the solver's accuracy is proven, no delta) | O(L D (1/sqrt(n) + sqrt(d)/(rho_p n))) (Thm 4.8) |
| ``fkt-sc-reduction`` | F lam-strongly convex (+ the inner algorithm's) | same | O((L^2/lam)(1/n + d/(rho_p^2 n^2))) (Thm 5.1) |
| ``fkt-sc-localization`` | F lam-strongly convex, smooth, beta/lam <= n/(k ln n) | same | O((L^2 ln n lnln n/lam)(1/n + d lnln n/(rho_p^2 n^2))) (Thm 5.3) |

Each algorithm is one registered class (:mod:`fedkl.algorithms.contract`): ``fkt-snowball`` and
``fkt-snowball-sc`` in :mod:`~fedkl.algorithms.localization.fkt_snowball`, ``fkt-phased-sgd``,
``fkt-phased-erm`` and ``fkt-sc-localization`` in :mod:`~fedkl.algorithms.localization.fkt_phased`,
``fkt-sc-reduction`` in :mod:`~fedkl.algorithms.localization.fkt_reduction`; each module registers its
classes when imported (fedkl/algorithms/catalog.py lists them). Every one reads its Params (the domain
and the strong convexity of :class:`~fedkl.algorithms.localization.fkt_common.FKTParams`, plus its own)
and the run's ``neighbouring`` and ``seed`` (cohort hashing) and ``reg`` (through the problem); the
schedules, steps and the clip (= the problem's Lipschitz constant L) are set by the theorems from
public constants: no ``rounds``, ``lr`` or ``clip``. Each algorithm class declares
``composition="parallel"`` in its ``guarantee``: the runner gives it a Releaser without the run-wide
zCDP filter; the per-user ledger enforces each user's budget.
"""
