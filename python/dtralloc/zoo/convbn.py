"""A plain conv net: VGG's stacks of 3x3 convolutions with batch norm and
ReLU (Simonyan and Zisserman 2015; BN as in torchvision's vgg*_bn), max-pool
between stages, no residual connection, a global-average-pooled linear head;
SGD with momentum."""
from __future__ import annotations

import torch
from torch import nn

from .workload import Workload, param_millions


class ConvBN(nn.Module):
    def __init__(self, stages: tuple, base: int, classes: int):
        super().__init__()
        layers, in_ch = [], 3
        for i, convs in enumerate(stages):
            out_ch = min(base * 2 ** i, 8 * base)
            for _ in range(convs):
                layers += [nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch),
                           nn.ReLU(inplace=True)]
                in_ch = out_ch
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_ch, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


def build(batch: int = 16, image: int = 224, base: int = 64, stages: tuple = (2, 2, 3, 3, 3),
          classes: int = 1000, seed: int = 0) -> Workload:
    """VGG-16's 13 conv layers by default (stages 2-2-3-3-3, width 64..512), each with BN; batch 16."""
    torch.manual_seed(seed)
    model = ConvBN(tuple(stages), base, classes).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, foreach=True)
    images = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, classes, (batch,))

    def loss_fn(model, images, labels):
        return nn.functional.cross_entropy(model(images), labels)

    return Workload(
        name="convbn",
        description=(
            f"Conv-BN net (VGG layout, stages {'-'.join(map(str, stages))}, width {base}, BatchNorm, "
            f"no residuals, {classes} classes, {param_millions(model)} params) batch {batch} at "
            f"{image}x{image}, cross-entropy, SGD momentum 0.9 (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(images, labels), loss_fn=loss_fn,
    )


SMALL = dict(batch=2, image=32, base=4, stages=(1, 1, 1), classes=10)
COMPACT = dict(batch=5, image=112, base=32, stages=(2, 2, 3, 3, 3), classes=100)
