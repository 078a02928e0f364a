"""An MLP classifier: hidden layers of Linear + ReLU + Dropout, Adam."""
from __future__ import annotations

import torch
from torch import nn

from .workload import Workload, param_millions


def build(batch: int = 256, features: int = 4096, width: int = 4096, layers: int = 4,
          classes: int = 1000, dropout: float = 0.1, seed: int = 0) -> Workload:
    """4 hidden layers of 4096 with dropout 0.1 by default, on 4096 input features."""
    torch.manual_seed(seed)
    blocks, in_dim = [], features
    for _ in range(layers):
        blocks += [nn.Linear(in_dim, width), nn.ReLU(), nn.Dropout(dropout)]
        in_dim = width
    model = nn.Sequential(*blocks, nn.Linear(in_dim, classes)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    inputs = torch.randn(batch, features)
    labels = torch.randint(0, classes, (batch,))

    def loss_fn(model, inputs, labels):
        return nn.functional.cross_entropy(model(inputs), labels)

    return Workload(
        name="mlp",
        description=(
            f"MLP ({features} inputs, {layers} hidden layers of {width} with ReLU and dropout "
            f"{dropout}, {classes} classes, {param_millions(model)} params) batch {batch}, "
            f"cross-entropy, Adam (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(inputs, labels), loss_fn=loss_fn,
    )


SMALL = dict(batch=8, features=32, width=64, layers=4, classes=10)
