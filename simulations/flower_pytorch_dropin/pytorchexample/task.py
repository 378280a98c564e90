"""pytorchexample: the task of Flower's PyTorch quickstart (model, data, local training, evaluation), unchanged in
shape; its data loading is replaced (the quickstart downloads CIFAR-10 through flwr_datasets; here every partition
draws its own small synthetic classification set, so the example runs offline and in seconds)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES, RECORDS = 8, 3, 40


class Net(nn.Module):
    """A small MLP (the quickstart's CNN reads 32x32 images; these records are 8 features)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 16)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def load_data(partition_id: int, num_partitions: int, batch_size: int) -> tuple[DataLoader, DataLoader]:
    """Partition ``partition_id``'s records (one person's, on their own device): RECORDS synthetic ones whose
    labels follow one rule shared by every partition, 80% to train and 20% to test. Replace this function by
    the node's own data."""
    g = torch.Generator().manual_seed(1000 + partition_id)
    x = torch.randn(RECORDS, FEATURES, generator=g)
    rule = torch.arange(FEATURES * CLASSES, dtype=torch.float32).reshape(FEATURES, CLASSES).sin()
    y = (x @ rule).argmax(dim=1)
    cut = RECORDS * 4 // 5
    train = DataLoader(TensorDataset(x[:cut], y[:cut]), batch_size=batch_size, shuffle=True, generator=g)
    return train, DataLoader(TensorDataset(x[cut:], y[cut:]), batch_size=batch_size)


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    """``epochs`` of SGD with momentum on the cross-entropy; returns the mean training loss."""
    net.to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        for x, y in trainloader:
            optimizer.zero_grad()
            loss = loss_fn(net(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
    return total / max(batches, 1)


def test(net: nn.Module, testloader: DataLoader, device: torch.device) -> tuple[float, float]:
    """The mean cross-entropy and the accuracy of ``net`` on ``testloader``."""
    net.to(device)
    net.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in testloader:
            logits = net(x.to(device))
            loss += loss_fn(logits, y.to(device)).item()
            correct += int((logits.argmax(dim=1) == y.to(device)).sum())
            count += len(y)
    return loss / max(count, 1), correct / max(count, 1)
