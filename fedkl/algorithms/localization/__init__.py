"""Paper 003: localization (snowball, phased SGD/ERM, strongly convex reductions).

Each module registers its algorithms when imported (fedkl/algorithms/catalog.py lists them)."""
