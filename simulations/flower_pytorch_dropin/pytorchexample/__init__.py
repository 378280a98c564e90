"""pytorchexample: Flower's PyTorch quickstart app with fedkl's user-level DP (README "Drop-in")."""
