"""Gradient methods: noisy GD (+ concentration and outlier variants), DP-SGD and adaptive optimizers, DP-FedAvg, DP-FTRL.

Each module registers its algorithms when imported (fedkl/algorithms/catalog.py lists them)."""
