"""Example networks for ``fedkl run --problem torch --model simulations/nets.py:NAME`` (README,
"Your own network"). A factory takes ``(input_dim, num_outputs)`` and returns a torch.nn.Module
mapping flat feature rows to logits; no BatchNorm (batch statistics mix users' records)."""

import math

import torch


def small_cnn(input_dim: int, num_outputs: int) -> torch.nn.Module:
    """Two 5x5 conv layers (GroupNorm, ReLU) and a linear head, for square grey images (MNIST: 784)."""
    side = math.isqrt(input_dim)
    if side * side != input_dim:
        raise ValueError(f"small_cnn needs square images, got {input_dim} features")

    class SmallCNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Conv2d(1, 8, 5, stride=2, padding=2),
                torch.nn.GroupNorm(2, 8),
                torch.nn.ReLU(),
                torch.nn.Conv2d(8, 16, 5, stride=2, padding=2),
                torch.nn.GroupNorm(4, 16),
                torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(4),
                torch.nn.Flatten(),
                torch.nn.Linear(16 * 4 * 4, num_outputs),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x.view(-1, 1, side, side))

    return SmallCNN()
