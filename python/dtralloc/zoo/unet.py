"""UNet (Ronneberger et al. 2015 with BatchNorm and padded convs), own code,
4 down / 4 up levels, pixel-wise cross-entropy, SGD with momentum."""
from __future__ import annotations

import torch
from torch import nn

from .workload import Workload, param_millions


def double_conv(in_ch: int, out_ch: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch), nn.ReLU(inplace=True),
        nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False), nn.BatchNorm2d(out_ch), nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, in_ch: int = 3, classes: int = 4, base: int = 64, levels: int = 4):
        super().__init__()
        widths = [base * 2 ** i for i in range(levels + 1)]
        self.inc = double_conv(in_ch, widths[0])
        self.down = nn.ModuleList(double_conv(widths[i], widths[i + 1]) for i in range(levels))
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in reversed(range(levels))
        )
        self.up_conv = nn.ModuleList(double_conv(2 * widths[i], widths[i]) for i in reversed(range(levels)))
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(self.pool(skips[-1])))
        x = skips.pop()
        for up, conv in zip(self.up, self.up_conv):
            x = conv(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)


def build(batch: int = 4, image: int = 256, base: int = 64, levels: int = 4,
          classes: int = 4, seed: int = 0) -> Workload:
    """UNet with 4 down / 4 up levels, base 64 channels (64..1024), on 256x256 RGB."""
    torch.manual_seed(seed)
    model = UNet(3, classes, base, levels).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4, foreach=True)
    images = torch.randn(batch, 3, image, image)
    masks = torch.randint(0, classes, (batch, image, image))

    def loss_fn(model, images, masks):
        return nn.functional.cross_entropy(model(images), masks)

    return Workload(
        name="unet",
        description=(
            f"UNet ({levels} down / {levels} up levels, base {base} channels, BatchNorm, "
            f"{classes} classes, {param_millions(model)} params) batch {batch} at {image}x{image}, "
            f"pixel-wise cross-entropy, SGD momentum 0.9 (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(images, masks), loss_fn=loss_fn,
    )


SMALL = dict(batch=2, image=32, base=4, levels=4, classes=3)
