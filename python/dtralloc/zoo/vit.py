"""A vision transformer (Dosovitskiy et al. 2021), own code: a patch-embedding
convolution, a class token and learned positions, pre-norm encoder blocks
(torch's scaled_dot_product_attention, GELU MLP, dropout), a linear head on
the class token; AdamW."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .layers import SelfAttention
from .workload import Workload, param_millions


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, dim: int, layers: int, heads: int, mlp: int,
                 classes: int, dropout: float):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp, dropout) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.norm(self.blocks(self.drop(x)))
        return self.head(x[:, 0])


def build(batch: int = 32, image: int = 224, patch: int = 16, dim: int = 384, layers: int = 12,
          heads: int = 6, mlp: int = 1536, classes: int = 1000, dropout: float = 0.1,
          seed: int = 0) -> Workload:
    """ViT-S/16 by default (12 layers, dim 384, 6 heads, MLP 1536) on 224x224, dropout 0.1."""
    torch.manual_seed(seed)
    model = ViT(image, patch, dim, layers, heads, mlp, classes, dropout).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, foreach=True)
    images = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, classes, (batch,))

    def loss_fn(model, images, labels):
        return F.cross_entropy(model(images), labels)

    return Workload(
        name="vit",
        description=(
            f"ViT/{patch} ({layers} layers, dim {dim}, {heads} heads, MLP {mlp}, dropout {dropout}, "
            f"{classes} classes, {param_millions(model)} params) batch {batch} at {image}x{image}, "
            f"cross-entropy, AdamW (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(images, labels), loss_fn=loss_fn,
    )


SMALL = dict(batch=2, image=32, patch=8, dim=32, layers=2, heads=2, mlp=64, classes=10)
COMPACT = dict(batch=4, image=224, patch=16, dim=192, layers=4, heads=3, mlp=768, classes=100)
