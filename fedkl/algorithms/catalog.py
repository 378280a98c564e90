"""Every algorithm ``fedkl run`` knows: importing this module registers them all
(:mod:`fedkl.algorithms.registry`). A new algorithm adds its module's import here."""

from __future__ import annotations

# each module registers its algorithms on import: a new algorithm adds its one line here
import fedkl.algorithms.frank_wolfe.gll_phased  # noqa: F401
import fedkl.algorithms.frank_wolfe.noisy_fw  # noqa: F401
import fedkl.algorithms.frank_wolfe.pg_mirror_descent  # noqa: F401
import fedkl.algorithms.frank_wolfe.vr_frank_wolfe  # noqa: F401
import fedkl.algorithms.gradient.concentrated_gd  # noqa: F401
import fedkl.algorithms.gradient.dp_adaptive  # noqa: F401
import fedkl.algorithms.gradient.dp_fedavg  # noqa: F401
import fedkl.algorithms.gradient.dp_fedopt  # noqa: F401
import fedkl.algorithms.gradient.dp_ftrl  # noqa: F401
import fedkl.algorithms.gradient.noisy_gd  # noqa: F401
import fedkl.algorithms.gradient.outlier_gd  # noqa: F401
import fedkl.algorithms.kl.kl_adaptive_gd  # noqa: F401
import fedkl.algorithms.kl.kl_spider  # noqa: F401
import fedkl.algorithms.kl.prox_point  # noqa: F401
import fedkl.algorithms.localization.fkt_phased  # noqa: F401
import fedkl.algorithms.localization.fkt_reduction  # noqa: F401
import fedkl.algorithms.localization.fkt_snowball  # noqa: F401
import fedkl.algorithms.output_perturbation.mean_output_pert  # noqa: F401
import fedkl.algorithms.output_perturbation.phased_erm  # noqa: F401
import fedkl.algorithms.output_perturbation.phased_sco  # noqa: F401
import fedkl.algorithms.output_perturbation.sc_output_pert  # noqa: F401
import fedkl.algorithms.output_perturbation.sc_phased  # noqa: F401
from fedkl.algorithms.registry import REGISTRY, algorithm_spec

ALGORITHMS = tuple(REGISTRY)  # the built-in algorithms (REGISTRY also holds any registered later)

__all__ = ["ALGORITHMS", "REGISTRY", "algorithm_spec"]
