"""Paper 002: user-level output perturbation with deletion-stability tests and phased localization.

Each module registers its algorithms when imported (fedkl/algorithms/catalog.py lists them)."""
