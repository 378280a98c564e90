"""Polytope domains W = conv(V) with a linear minimization oracle (paper 001, Alg 3: noisy
Frank–Wolfe): the l1 ball, the scaled simplex, and a polytope given by its vertices.

A Frank–Wolfe method never projects: each step moves towards the vertex ``v`` minimizing ``<v, g>``.
What a private selection needs from the domain is public and data-free:

* ``center`` ``c``: a fixed point of W, the iterates' start;
* ``scores(g)``: ``<v_j - c, g>`` for every vertex ``j`` (vector of length ``num_vertices``). Scoring
  relative to ``c`` does not change the argmin (it subtracts ``<c, g>`` from every score), but it
  bounds each score's sensitivity by ``||v_j - c||_1 * ||g - g'||_inf`` (docs/derivations/paper-001.md §6, pitfall 11):
* ``l1_radius`` = ``max_j ||v_j - c||_1``: the factor of that sensitivity (the l1 ball's radius r,
  not its diameter 2r);
* ``l2_bound`` = ``max_j ||v_j||_2`` >= ``||w||_2`` on W (for a problem whose Lipschitz constant
  needs a parameter bound);
* ``vertex(j)`` and ``lmo(g)`` (the exact argmin, non-private).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch


class PolytopeDomain(ABC):
    """``W = conv(V)`` in ``R^dim`` with ``num_vertices`` vertices (module docstring)."""

    name: str = "polytope"

    def __init__(self, dim: int, dtype: torch.dtype = torch.float64) -> None:
        if int(dim) != dim or dim < 1:
            raise ValueError(f"the domain's dimension must be a positive integer, got {dim}")
        self.dim = int(dim)
        self.dtype = dtype

    @property
    @abstractmethod
    def num_vertices(self) -> int: ...

    @property
    @abstractmethod
    def center(self) -> torch.Tensor: ...

    @property
    @abstractmethod
    def l1_radius(self) -> float:
        """``max_j ||v_j - center||_1``."""

    @property
    @abstractmethod
    def l2_bound(self) -> float:
        """``max_j ||v_j||_2`` (every point of W has at most this l2 norm)."""

    @abstractmethod
    def vertex(self, j: int) -> torch.Tensor: ...

    @abstractmethod
    def scores(self, g: torch.Tensor) -> torch.Tensor:
        """``<v_j - center, g>`` for every vertex j, shape ``(num_vertices,)``."""

    def lmo(self, g: torch.Tensor) -> int:
        """The exact linear minimization oracle ``argmin_j <v_j, g>`` (non-private)."""
        return int(torch.argmin(self.scores(g)))

    def _check_vector(self, g: torch.Tensor) -> torch.Tensor:
        g = torch.as_tensor(g).to(self.dtype)
        if g.shape != (self.dim,):
            raise ValueError(f"{self.name}: expected a vector of shape ({self.dim},), got {tuple(g.shape)}")
        return g

    def _check_index(self, j: int) -> int:
        if int(j) != j or not 0 <= j < self.num_vertices:
            raise ValueError(f"{self.name}: vertex index must be in [0, {self.num_vertices}), got {j}")
        return int(j)

    def describe(self) -> dict:
        return {"domain": self.name, "vertices": self.num_vertices, "l1_radius": self.l1_radius}


class L1Ball(PolytopeDomain):
    """``{w : ||w||_1 <= radius}``: vertices ``+radius e_i`` (index i) and ``-radius e_i`` (index dim + i),
    ``J = 2 dim``, centre 0, ``l1_radius = radius``."""

    name = "l1-ball"

    def __init__(self, dim: int, radius: float, dtype: torch.dtype = torch.float64) -> None:
        super().__init__(dim, dtype)
        if not (radius > 0 and math.isfinite(radius)):
            raise ValueError(f"the l1 ball's radius must be finite and > 0, got {radius}")
        self.radius = float(radius)

    @property
    def num_vertices(self) -> int:
        return 2 * self.dim

    @property
    def center(self) -> torch.Tensor:
        return torch.zeros(self.dim, dtype=self.dtype)

    @property
    def l1_radius(self) -> float:
        return self.radius

    @property
    def l2_bound(self) -> float:
        return self.radius

    def vertex(self, j: int) -> torch.Tensor:
        j = self._check_index(j)
        v = torch.zeros(self.dim, dtype=self.dtype)
        v[j % self.dim] = self.radius if j < self.dim else -self.radius
        return v

    def scores(self, g: torch.Tensor) -> torch.Tensor:
        g = self._check_vector(g)
        return torch.cat([self.radius * g, -self.radius * g])

    def describe(self) -> dict:
        return {**super().describe(), "radius": self.radius}


class Simplex(PolytopeDomain):
    """``{w >= 0 : sum w = radius}``: vertices ``radius e_i``, ``J = dim``, centre ``(radius/dim) 1``,
    ``l1_radius = 2 radius (dim - 1)/dim``."""

    name = "simplex"

    def __init__(self, dim: int, radius: float = 1.0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__(dim, dtype)
        if not (radius > 0 and math.isfinite(radius)):
            raise ValueError(f"the simplex's scale must be finite and > 0, got {radius}")
        self.radius = float(radius)

    @property
    def num_vertices(self) -> int:
        return self.dim

    @property
    def center(self) -> torch.Tensor:
        return torch.full((self.dim,), self.radius / self.dim, dtype=self.dtype)

    @property
    def l1_radius(self) -> float:
        return 2.0 * self.radius * (self.dim - 1) / self.dim

    @property
    def l2_bound(self) -> float:
        return self.radius

    def vertex(self, j: int) -> torch.Tensor:
        v = torch.zeros(self.dim, dtype=self.dtype)
        v[self._check_index(j)] = self.radius
        return v

    def scores(self, g: torch.Tensor) -> torch.Tensor:
        g = self._check_vector(g)
        return self.radius * g - torch.dot(self.center, g)

    def describe(self) -> dict:
        return {**super().describe(), "radius": self.radius}


class VertexPolytope(PolytopeDomain):
    """``conv(rows of vertices)`` for a public ``(J, dim)`` vertex matrix; centre = the vertex mean."""

    name = "vertex-polytope"

    def __init__(self, vertices: torch.Tensor, dtype: torch.dtype = torch.float64) -> None:
        V = torch.as_tensor(vertices).to(dtype)
        if V.dim() != 2 or V.shape[0] < 1:
            raise ValueError(f"vertices must be a (J, d) matrix with J >= 1, got shape {tuple(V.shape)}")
        if not torch.isfinite(V).all():
            raise ValueError("vertices contain NaN or inf")
        super().__init__(V.shape[1], dtype)
        self.vertices = V.clone()
        self._center = V.mean(0)

    @property
    def num_vertices(self) -> int:
        return int(self.vertices.shape[0])

    @property
    def center(self) -> torch.Tensor:
        return self._center.clone()

    @property
    def l1_radius(self) -> float:
        return float((self.vertices - self._center).abs().sum(1).max())

    @property
    def l2_bound(self) -> float:
        return float(self.vertices.norm(dim=1).max())

    def vertex(self, j: int) -> torch.Tensor:
        return self.vertices[self._check_index(j)].clone()

    def scores(self, g: torch.Tensor) -> torch.Tensor:
        g = self._check_vector(g)
        return (self.vertices - self._center) @ g


DOMAINS = ("l1-ball", "simplex")


def make_domain(name: str, dim: int, radius: float) -> PolytopeDomain:
    """The named domain of ``dim`` coordinates and scale ``radius`` (a vertex polytope is built from
    its vertex matrix with :class:`VertexPolytope`)."""
    if name == "l1-ball":
        return L1Ball(dim, radius)
    if name == "simplex":
        return Simplex(dim, radius)
    raise ValueError(f"unknown domain {name!r}; valid: {', '.join(DOMAINS)} (or a VertexPolytope object)")


__all__ = ["DOMAINS", "L1Ball", "PolytopeDomain", "Simplex", "VertexPolytope", "make_domain"]
