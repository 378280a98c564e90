"""Example networks for ``fedkl run --problem torch --model simulations/nets.py:NAME`` (docs/how-to/own-model.md).
A factory takes ``(input_dim, num_outputs)`` and returns a torch.nn.Module mapping flat feature rows to logits;
no BatchNorm (batch statistics mix users' records)."""

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


def small_gru(input_dim: int, num_outputs: int) -> torch.nn.Module:
    """A one-layer GRU (hidden 32, 16-dim symbol embedding) over the context positions of
    ``fedkl.data.shakespeare``'s features (an intercept, then one one-hot block of ``num_outputs``
    symbols per position, oldest first), and a linear head on the last hidden state. The GRU cell is
    written from Linear layers (standard GRU equations), so torch.func's per-record vmap applies."""
    blocks, rest = divmod(input_dim - 1, num_outputs)
    if rest or blocks < 1:
        raise ValueError(f"small_gru needs 1 + {num_outputs} * context features, got {input_dim}")

    class SmallGRU(torch.nn.Module):
        def __init__(self, embed: int = 16, hidden: int = 32) -> None:
            super().__init__()
            self.hidden = hidden
            self.embed = torch.nn.Linear(num_outputs, embed, bias=False)
            self.gates_x = torch.nn.Linear(embed, 3 * hidden)
            self.gates_h = torch.nn.Linear(hidden, 3 * hidden)
            self.head = torch.nn.Linear(hidden, num_outputs)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.reshape(-1, input_dim)
            steps = x[:, 1:].reshape(-1, blocks, num_outputs) * math.sqrt(blocks + 1)  # undo the row scaling
            h = x.new_zeros(x.shape[0], self.hidden)
            for t in range(blocks):
                xr, xz, xn = self.gates_x(self.embed(steps[:, t])).chunk(3, dim=-1)
                hr, hz, hn = self.gates_h(h).chunk(3, dim=-1)
                r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
                h = (1 - z) * torch.tanh(xn + r * hn) + z * h
            return self.head(h)

    return SmallGRU()


def geyer_mlp(input_dim: int, num_outputs: int) -> torch.nn.Module:
    """The network of Geyer, Klein & Nabi (2017)'s code (sapmlresearch/DiffPrivate_FedLearning,
    ``mnist_fully_connected_model``): two ReLU hidden layers of 600 and 100 units and a linear output,
    no biases (531,400 parameters on MNIST). fedkl's image rows are projected to unit norm; the input is
    multiplied by 10 (a public constant: MNIST pixel rows in [0, 1] have norm about 9) so the layers see
    the pixel scale the original network was initialised for (torch's default initialisation)."""

    class GeyerMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Linear(input_dim, 600, bias=False),
                torch.nn.ReLU(),
                torch.nn.Linear(600, 100, bias=False),
                torch.nn.ReLU(),
                torch.nn.Linear(100, num_outputs, bias=False),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(10.0 * x)

    return GeyerMLP()


def mlp100(input_dim: int, num_outputs: int) -> torch.nn.Module:
    """A one-hidden-layer ReLU network, 100 units, no biases (79,400 parameters on MNIST): fewer
    coordinates to add noise to than :func:`geyer_mlp`. Input multiplied by 10 as there."""

    class MLP100(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Linear(input_dim, 100, bias=False),
                torch.nn.ReLU(),
                torch.nn.Linear(100, num_outputs, bias=False),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(10.0 * x)

    return MLP100()


def _context_steps(x: torch.Tensor, input_dim: int, num_outputs: int) -> torch.Tensor:
    """``(batch, context, num_outputs)`` one-hot steps of ``fedkl.data.shakespeare`` feature rows (intercept
    dropped, the ``1 / sqrt(context + 1)`` row scaling undone)."""
    blocks, rest = divmod(input_dim - 1, num_outputs)
    if rest or blocks < 1:
        raise ValueError(f"needs 1 + {num_outputs} * context features (fedkl.data.shakespeare), got {input_dim}")
    x = x.reshape(-1, input_dim)
    return x[:, 1:].reshape(-1, blocks, num_outputs) * math.sqrt(blocks + 1)


def char_mlp(input_dim: int, num_outputs: int, embed: int = 8, hidden: int = 128) -> torch.nn.Module:
    """A feed-forward character model for ``fedkl.data.shakespeare`` (Bengio et al. 2003's neural n-gram,
    at character level): a shared 8-dim embedding of each context symbol (LEAF's LSTM embeds in 8 too),
    concatenated, one ReLU layer of 128 units, a linear head (25,540 parameters at context 20: few
    coordinates to add DP noise to). No recurrence: on this 2-core CPU, local SGD at batch 20 and context 20
    cost 0.03 CPU s per 1,000 records even for a twice-wider version (16-dim embeddings, 256 units) against
    0.31 for a one-layer 128-unit ``torch.nn.GRU``, which is what let a non-private run fit in minutes
    (``simulations/studies/shakespeare.py``); LEAF's own model is a 2-layer LSTM of 256 units over 80
    characters."""
    blocks = (input_dim - 1) // num_outputs
    _context_steps(torch.zeros(1, input_dim), input_dim, num_outputs)

    class CharMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(num_outputs, embed, bias=False)
            self.body = torch.nn.Sequential(
                torch.nn.Linear(blocks * embed, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, num_outputs)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(self.embed(_context_steps(x, input_dim, num_outputs)).flatten(1))

    return CharMLP()


def linear(input_dim: int, num_outputs: int) -> torch.nn.Module:
    """Multinomial logistic regression as a network (one linear layer, no bias; 7,840 parameters on MNIST):
    the fewest coordinates to add noise to, for small populations. Input multiplied by 10 as in :func:`mlp100`."""

    class Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(input_dim, num_outputs, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(10.0 * x)

    return Linear()


def mlp50(input_dim: int, num_outputs: int) -> torch.nn.Module:
    """:func:`mlp100` with 50 hidden units (39,700 parameters on MNIST): half the coordinates to add noise to."""

    class MLP50(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Linear(input_dim, 50, bias=False),
                torch.nn.ReLU(),
                torch.nn.Linear(50, num_outputs, bias=False),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(10.0 * x)

    return MLP50()
