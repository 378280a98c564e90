"""fedkl as a library, in one screen: user-level DP logistic regression on MovieLens.

    .venv/bin/python simulations/quickstart.py [--epsilon 2] [--rounds 10] [--out runs/quickstart]

Every piece is explicit: the data (users as the unit), the problem (with its constants), the
federation (here the in-process backend), the ledger (per-user, durable), the release gate and the
algorithm. Swap the federation for another backend and nothing else changes.
"""

from __future__ import annotations

import argparse
import os

from fedkl.algorithms.contract import BuildContext
from fedkl.algorithms.gradient.noisy_gd import NoisyGDParams, NoisyGradientDescent
from fedkl.data import load_dataset
from fedkl.federation.inprocess import InProcessFederation
from fedkl.privacy import Budget, NoiseSource, PrivacyLedger, Releaser, ZCDPFilter
from fedkl.problems import make_problem


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="movielens")
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default="runs/quickstart")
    p.add_argument("--noise-seed", type=int, default=None, help="reproducible, NOT secure noise")
    args = p.parse_args(argv)

    data = load_dataset(args.dataset)  # users are the unit of privacy
    problem = make_problem("logistic", data)  # L0 = R, L1 = R^2/4 under ||x|| <= R
    print(problem.constants(data.feature_bound))
    federation = InProcessFederation(problem, data)  # or, later, a Flower-backed federation
    n = federation.num_users
    delta = 1.0 / n**1.1

    os.makedirs(args.out, exist_ok=True)
    ledger = PrivacyLedger(os.path.join(args.out, "ledger.sqlite"), Budget(args.epsilon, delta))
    rho = ledger.rho_left(federation.user_ids)  # what every user can still spend
    if rho <= 0:
        raise SystemExit(
            f"the users' budget in {ledger.path} is spent (the ledger persists across runs); "
            "choose another --out for a new experiment"
        )
    releaser = Releaser(ledger, NoiseSource(args.noise_seed), ZCDPFilter(rho))
    algorithm = NoisyGradientDescent(NoisyGDParams(rounds=args.rounds, lr=4.0, clip=1.0), BuildContext.fresh(rho=rho))
    result = algorithm.run(federation, releaser, problem.init_params())

    metrics = federation.evaluate(result.w, "test")  # evaluation only: not a private release
    summary = ledger.summary()
    print(
        f"{n} users, eps = {summary['max_user_epsilon']:.3f}, delta = {delta:.2g}, "
        f"test accuracy = {metrics['accuracy']:.4f}"
    )
    ledger.close()
    return {"epsilon": summary["max_user_epsilon"], "delta": delta, **metrics}


if __name__ == "__main__":
    main()
