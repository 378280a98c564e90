"""Paper 000: KL-condition methods (adaptive GD, SPIDER, proximal point).

Each module registers its algorithms when imported (fedkl/algorithms/catalog.py lists them)."""
