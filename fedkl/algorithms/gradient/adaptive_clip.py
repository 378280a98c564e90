"""Quantile-adaptive clipping for DP-FedAvg (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021,
"Differentially private learning with adaptive clipping"; the geometric update of TensorFlow
Privacy's ``QuantileEstimatorQuery`` / TFF's adaptive-clip aggregator), released with the model
update in ONE Gaussian of the schedule, so that the schedule's accounting covers both.

Round t, clip C_t (public: C_0 = --clip, then a function of earlier releases only). The server
receives each sampled user's clipped delta, re-clips it to C_t (``clip_rows``) and forms, for every
user i, the contribution

    x_i = [ h_i / C_t ; a * c_i ]   (d + 1 coordinates),
    c_i = b_i - 1/2,  b_i = 1[ ||h_i|| <= C_t (1 - TIE) ],   c_i = 0 for a failed user,

where ``h_i`` is the RE-CLIPPED row the server holds, so b_i is computed by the server from what it
received, never reported by a client (``TIE`` = 1e-6: a clipped row has norm C_t up to rounding, or, clipped
in float32, up to twice the float32 clip's margin inside the ball, so an update of norm within a relative 1e-6
of C_t counts as clipped). It releases

    Y_t = sum_i x_i + N(0, (z Delta)^2 I_{d+1})

with z the schedule's noise multiplier and Delta the L2 sensitivity of sum_i x_i, and uses

    model:  Delta_t = C_t * Y_t[:d] / (q n)                      (= (S_t + N(0, (z Delta C_t)^2 I)) / (q n))
    count:  b_bar   = clamp(Y_t[d] / (a q n) + 1/2, 0, 1)         (= (sum_i c_i + N(0, sigma_b^2)) / (q n) + 1/2)
    clip:   C_{t+1} = C_t * exp(-eta_C (b_bar - gamma))

(q n: the public expected cohort, never the realised count; the clamp and the update are TF
Privacy's). Before the clamp, b_bar is unbiased for the population's fraction F of update norms
below C_t: E[sum_i c_i] = q n (F - 1/2) under Poisson sampling with rate q (failed users aside).
Everything after the release is post-processing.

Theorem (sensitivity). Let r = sqrt(1 + a^2/4). Then
(i)  add-remove: Delta = r;  (ii) replace-one: Delta = 2 r = sqrt(4 + a^2); both tight.
Proof. ||h_i|| <= C_t (server re-clip), so ||h_i / C_t|| <= 1, and c_i is in {-1/2, 0, 1/2}, so
||x_i||^2 <= 1 + a^2/4 = r^2, with equality for a user whose update is clipped (norm C_t, c_i = -1/2).
(i) Adding or removing user i changes the sum by x_i: norm <= r. (ii) Replacing user i by i'
changes it by x_i - x_i' = [(h_i - h_i')/C_t ; a (c_i - c_i')], whose squared norm is
<= 2^2 + a^2 (|c_i - c_i'| <= 1), i.e. <= 4 + a^2 = (2r)^2; equality for h_i clipped (c_i = -1/2) and
h_i' = -h_i (1 - 2 TIE) (c_i' = +1/2), up to that factor. No other user's x_j changes: b_j depends only on
user j's answer and on C_t, a public function of earlier releases. []
So ``Delta = sum_sensitivity(r, relation)``: the schedule of :mod:`fedkl.algorithms.gradient.poisson_schedule`
with per-user norm bound r releases Y_t with noise multiplier z, and its accounting (one
PoissonSampled Gaussian(z) per round, composed T times; Poisson amplification under add-remove)
covers the model update AND the count; the adaptivity of C_t is covered by adaptive composition.

Choice of a (the count's effective noise is the user's sigma_b). The count's noise is
z Delta / a; setting it to sigma_b:
  add-remove:  z sqrt(1 + a^2/4) = sigma_b a  <=>  a = z / sqrt(sigma_b^2 - z^2/4),  needs sigma_b > z/2;
  replace-one: z sqrt(4 + a^2)   = sigma_b a  <=>  a = 2 z / sqrt(sigma_b^2 - z^2),  needs sigma_b > z.
Otherwise no a exists and the setting is refused before anything is read or charged. The model
update's noise multiplier is then z r (add-remove), i.e. 1/(z r)^2 = 1/z^2 - 1/(2 sigma_b)^2: Andrew
et al.'s Theorem 1 (their z_Delta), derived here from one vector release instead of two.
"""

from __future__ import annotations

import math

import torch

from fedkl.federation.clipping import clip_rows
from fedkl.problems.rowwise import row_norms

# an update whose norm is within this relative distance of the clip counts as clipped. A row scaled onto the
# ball in float64 has norm C up to rounding, on either side; one clipped in float32 (--dtype float32, a torch
# model's clients) lands inside, by the margin m = low_precision_margin(float32, d) ~ 2.4e-7 up to twice that
# (fedkl.federation.clipping._low_precision_clip, proof (3)): 1e-6 > 2 m for d < 1e9. (At 1e-9 every clipped
# float32 update counted as below the clip: the clip shrank every round, whatever the data.)
TIE = 1e-6


def count_scale(noise_multiplier: float, count_noise: float, neighbouring: str) -> float:
    """``a`` such that the count coordinate's noise ``z Delta(a) / a`` equals ``count_noise``
    (module docstring); ValueError where none exists."""
    z, s = noise_multiplier, count_noise
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"the count noise must be finite and > 0, got {s}")
    need = z if neighbouring == "replace-one" else z / 2
    if not s > need:
        what = f"z = {z:.4g}" if neighbouring == "replace-one" else f"z/2 = {need:.4g} (z = {z:.4g})"
        raise ValueError(
            f"adaptive clipping: the count noise {s:g} must exceed {what} under {neighbouring}, z being the "
            "schedule's noise multiplier at this budget; raise --clip-count-noise or the budget, or use the fixed clip"
        )
    return (2 * z if neighbouring == "replace-one" else z) / math.sqrt(s * s - need * need)


def norm_bound(scale: float) -> float:
    """``r = sqrt(1 + a^2/4)``: the norm bound of one user's contribution ``[h/C ; a c]``."""
    return math.sqrt(1.0 + scale * scale / 4.0)


def contributions(values: torch.Tensor, clip: float, failed: torch.Tensor, scale: float) -> torch.Tensor:
    """Every user's ``[h_i / C ; a c_i]`` (rows) from its answer ``values[i]``: re-clipped to ``clip``
    here, the indicator computed from the re-clipped row, ``c_i = 0`` where ``failed`` (a boolean
    mask) or the answer is not finite."""
    rows, bad = clip_rows(values, clip)
    below = row_norms(rows) <= clip * (1 - TIE)
    c = torch.where(failed | bad, torch.zeros_like(rows[:, 0]), below.to(rows.dtype) - 0.5)
    return torch.cat([rows / clip, (scale * c).unsqueeze(1)], dim=1)


def next_clip(clip: float, count: float, scale: float, quantile: float, lr: float) -> tuple[float, float]:
    """``(C_{t+1}, b_bar)`` from the released count coordinate over the public cohort, ``Y_t[d] / (q n)``."""
    below = min(1.0, max(0.0, count / scale + 0.5))
    return clip * math.exp(-lr * (below - quantile)), below
