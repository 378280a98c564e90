"""Every algorithm ``fedkl run`` knows: importing this module registers them all
(:mod:`fedkl.algorithms.registry`). A new algorithm adds its module's import here."""

from __future__ import annotations

from fedkl.algorithms import (  # noqa: F401  (each module registers its algorithms on import)
    concentrated_gd,
    dp_adaptive,
    dp_fedavg,
    dp_ftrl,
    fkt,
    gll_phased,
    kl_methods,
    mean_output_pert,
    noisy_fw,
    noisy_gd,
    outlier_gd,
    p002,
    pg_mirror_descent,
    vr_frank_wolfe,
)
from fedkl.algorithms.registry import REGISTRY, algorithm_spec

ALGORITHMS = tuple(REGISTRY)  # the built-in algorithms (REGISTRY also holds any registered later)

__all__ = ["ALGORITHMS", "REGISTRY", "algorithm_spec"]
