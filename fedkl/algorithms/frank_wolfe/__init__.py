"""Paper 001: Frank-Wolfe and mirror-descent methods over polytopes and l_p balls.

Each module registers its algorithms when imported (fedkl/algorithms/catalog.py lists them)."""
