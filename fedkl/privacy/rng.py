"""Randomness for privacy noise.

Every noise draw in fedkl goes through a :class:`NoiseSource`. In ``secure`` mode (the default) the
uniform bits come from the operating system's CSPRNG (``os.urandom``), so nobody who sees the code,
the seed or earlier outputs can predict or subtract the noise. In ``seeded`` mode (tests and
reproducible experiments only) the bits come from NumPy's PCG64 seeded generator; result files
record which mode produced them.

Both modes share the same transformations (uniform -> Gaussian, Laplace, discrete), so the seeded
mode exercises exactly the code the secure mode runs.

Known limitation (stated, not hidden): noise is added in IEEE float64. We do not implement the
snapping mechanism of Mironov (2012) against floating-point attacks on the low-order bits.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

_TWO_POW_52 = float(2**52)


class NoiseSource:
    """Source of privacy noise.

    Args:
        seed: ``None`` for the secure (os.urandom) source; an int for the seeded, reproducible,
            NOT secure source.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._gen = None if seed is None else np.random.Generator(np.random.PCG64(seed))

    @property
    def mode(self) -> str:
        """``"secure"`` or ``"seeded"``: written into every result file."""
        return "secure" if self._gen is None else "seeded"

    def describe(self) -> dict:
        return {"noise_rng": self.mode, "noise_seed": self.seed}

    # --- uniform bits ------------------------------------------------------------------------
    def _raw_uint64(self, n: int) -> np.ndarray:
        if self._gen is None:
            return np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
        return self._gen.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)

    def uniform(self, n: int) -> np.ndarray:
        """``n`` float64 uniforms on the OPEN interval (0, 1): ``(k + 1/2) / 2^52`` for 52 random bits k.

        52, not 53, bits: ``k + 1/2`` is then exact in float64 (with 53 bits, ``2^53 - 1/2`` rounds
        to ``2^53`` and the "uniform" is exactly 1.0, which made Laplace noise infinite).
        """
        bits = self._raw_uint64(n) >> np.uint64(12)
        return (bits.astype(np.float64) + 0.5) / _TWO_POW_52

    # --- continuous noise --------------------------------------------------------------------
    def gaussian(self, shape: tuple[int, ...] | int, std: float) -> torch.Tensor:
        """i.i.d. N(0, std^2) of the given shape, float64 (Box-Muller on secure uniforms)."""
        if not (std >= 0 and math.isfinite(std)):
            raise ValueError(f"std must be finite and >= 0, got {std}")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = int(np.prod(shape)) if shape else 1
        half = (n + 1) // 2
        u1, u2 = self.uniform(half), self.uniform(half)
        radius = np.sqrt(-2.0 * np.log(u1))
        z = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])[:n]
        return torch.from_numpy(std * z).reshape(shape)

    def laplace(self, shape: tuple[int, ...] | int, scale: float) -> torch.Tensor:
        """i.i.d. Laplace(0, scale) of the given shape, float64 (inverse CDF)."""
        if not (scale >= 0 and math.isfinite(scale)):
            raise ValueError(f"scale must be finite and >= 0, got {scale}")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = int(np.prod(shape)) if shape else 1
        u = self.uniform(n) - 0.5
        z = -scale * np.sign(u) * np.log1p(-2.0 * np.abs(u))
        return torch.from_numpy(z).reshape(shape)

    # --- discrete ----------------------------------------------------------------------------
    def categorical(self, log_weights: np.ndarray) -> int:
        """One index drawn with probability proportional to ``exp(log_weights)`` (inverse CDF)."""
        lw = np.asarray(log_weights, dtype=np.float64)
        if lw.ndim != 1 or lw.size == 0 or np.isnan(lw).any() or not np.isfinite(lw.max()):
            raise ValueError("log_weights must be a non-empty 1-D array with a finite maximum and no NaN")
        p = np.exp(lw - lw.max())
        cdf = np.cumsum(p / p.sum())
        idx = int(np.searchsorted(cdf, self.uniform(1)[0], side="right"))
        return min(idx, lw.size - 1)
