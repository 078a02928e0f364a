"""ResNet-50 (He et al. 2016, torchvision's v1.5 layout: stride on the 3x3 conv),
own code, BatchNorm, SGD with momentum."""
from __future__ import annotations

import torch
from torch import nn

from .workload import Workload, param_millions

EXPANSION = 4  # a bottleneck's output has 4x its inner width


class Bottleneck(nn.Module):
    def __init__(self, in_ch: int, width: int, stride: int):
        super().__init__()
        out_ch = width * EXPANSION
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, blocks=(3, 4, 6, 3), base: int = 64, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(base), nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages, in_ch = [], base
        for i, n in enumerate(blocks):
            width = base * 2 ** i
            for j in range(n):
                stages.append(Bottleneck(in_ch, width, stride=2 if (j == 0 and i > 0) else 1))
                in_ch = width * EXPANSION
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def build(batch: int = 64, image: int = 224, base: int = 64, classes: int = 1000,
          blocks: tuple = (3, 4, 6, 3), seed: int = 0) -> Workload:
    """ResNet-50 by default: bottleneck blocks 3-4-6-3, width 64, 1000 classes."""
    torch.manual_seed(seed)
    model = ResNet(tuple(blocks), base, classes).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)
    images = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, classes, (batch,))

    def loss_fn(model, images, labels):
        return nn.functional.cross_entropy(model(images), labels)

    depth = 3 * sum(blocks) + 2
    return Workload(
        name="resnet50",
        description=(
            f"ResNet-{depth} (bottleneck blocks {'-'.join(map(str, blocks))}, width {base}, "
            f"BatchNorm, {classes} classes, {param_millions(model)} params) batch {batch} at "
            f"{image}x{image}, cross-entropy, SGD momentum 0.9 (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(images, labels), loss_fn=loss_fn,
    )


SMALL = dict(batch=2, image=32, base=8, classes=10, blocks=(1, 1, 1, 1))
