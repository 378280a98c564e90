"""The public noise-to-signal forecast of a gradient method, before any data is read.

For gradient methods (noisy GD, DP-SGD/RMSProp/Adam, DP-FedAvg): the norm of one round's noise on the
averaged clipped update, ``sigma_sum sqrt(d) / (expected cohort)``, against the largest update the
data could make (the clip C), divided by ``sqrt(rounds)`` (independent noise averages down over the
rounds; a heuristic, not a bound). ``fedkl plan`` ranks algorithms by it and ``fedkl run`` warns,
before any budget is spent, when it is above :data:`LEARNS_LITTLE`. Output-perturbation algorithms
have their own ``forecast`` method instead (``noise_over_signal``: the first release's noise norm over
the farthest the data could move the model); ``fedkl run`` refuses it above 1 (unless forced) and warns
above :data:`LEARNS_LITTLE` (phased-mean-output-pert on MovieLens at eps = 2 forecasts 0.91, and two of
four noise seeds land below the majority class).

The rule for networks (a non-convex problem: ``--problem torch`` or ``mlp``), stated: the same ratio --
the noise std of the released mean update, ``sigma_sum / E[cohort]`` per coordinate, times ``sqrt(d)``,
over the clip C, over ``sqrt(rounds)`` -- against its own threshold :data:`NETWORK_LEARNS_LITTLE`. The
``sqrt(d)`` treats every coordinate as one the update needs, which a convex model's gradient spreads over
but a network's does not (its updates concentrate on few directions; isotropic noise on the many others
mostly cancels across rounds), so the GLM threshold over-warns there. Documented on the networks measured
(docs/how-to/own-model.md: DP-FedAvg, ``mlp100``, MNIST label shards, 1,000 users, one seed each; majority
class 0.11): ratio 0.28 -> test accuracy 0.90, 0.68 -> 0.82, 0.95 (``geyer_mlp``) -> 0.87, 1.45 -> 0.77,
4.36 -> 0.49, 18.5 -> 0.16; the threshold, 8, lies between the last two (a heuristic, like the GLMs'). Plus one
certain condition, for networks only (:func:`network_step_warning`): a step size that is the algorithm's
default was chosen on GLM tuning data (tune_step_sizes.toml), not for any network (dp-sgd's 4.0 on the
README's CNN: 0.086, below the majority class 0.114, with no noise warning: ratio 0.02).
"""

from __future__ import annotations

import math

from fedkl.algorithms.contract import Clip, Rounds

# above this ratio `fedkl run` warns that the model is predicted to learn little. A heuristic, read off
# the public datasets of simulations/studies/tune_step_sizes.toml at eps = 2: on adult (ratio 0.52-0.60 for the
# gradient methods) no step size beats the majority class; tv16 (0.18-0.21) and MovieLens (0.03) learn.
LEARNS_LITTLE = 0.5
# the same ratio's threshold for networks (module docstring; docs/how-to/own-model.md lists the runs behind it)
NETWORK_LEARNS_LITTLE = 8.0


def learns_little_threshold(convex: bool) -> float:
    """The forecast ratio above which ``fedkl run`` warns: :data:`LEARNS_LITTLE` for convex problems (GLMs),
    :data:`NETWORK_LEARNS_LITTLE` for networks (module docstring)."""
    return LEARNS_LITTLE if convex else NETWORK_LEARNS_LITTLE


def network_step_warning(algorithm: str, lr: float | None, default_lr: float | None) -> str | None:
    """For a network: a warning when its step size is the algorithm's default (chosen on GLM tuning data,
    never on a network), else None."""
    if default_lr is None or lr != default_lr:
        return None
    return (
        f"{algorithm}'s default step size {default_lr:g} was chosen on convex (GLM) tuning data, not for a "
        "network: pick --lr for your model (e.g. on held-out users, or `fedkl tune`)"
    )


def gradient_forecast(alg, params, n: int, dim: int, neighbouring: str) -> tuple[float, str] | None:
    """``(ratio, why)`` for a built gradient method ``alg`` with ``params`` on ``n`` users and ``dim``
    parameters (public values only), or None when ``alg`` is not one. A gradient method's Params are a
    :class:`Rounds` and a :class:`Clip` (a type test, not duck typing: registration keeps one definition of
    each hyperparameter name, so wherever ``rounds`` and ``clip`` exist they are these mixins' fields)."""
    if not isinstance(params, Rounds) or not isinstance(params, Clip):
        return None
    rounds, clip = params.rounds, params.clip
    if alg.guarantee.charges == "schedule":  # Poisson-sampled schedules: z = sigma / sensitivity on the sum
        z = alg.schedule().noise_multiplier
        q = params.sampling_rate
        sensitivity = clip if neighbouring == "add-remove" else 2 * clip
        per_round = z * sensitivity * math.sqrt(dim) / (q * n) / clip
        why = f"noise multiplier {z:.3g} on a cohort of ~{q * n:.0f} users"
    elif isinstance(alg.sigma, float):
        per_round = alg.sigma * math.sqrt(dim) / n / clip
        why = f"noise std {alg.sigma:.3g} on the sum of {n} clipped gradients"
    else:
        return None
    return per_round / math.sqrt(rounds), (
        f"per round the noise on the mean clipped update is {per_round:.3g}x "
        f"the clip ({why}), averaged over {rounds} rounds"
    )


__all__ = [
    "LEARNS_LITTLE",
    "NETWORK_LEARNS_LITTLE",
    "gradient_forecast",
    "learns_little_threshold",
    "network_step_warning",
]
