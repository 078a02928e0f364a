"""Hand-made models for the live DTR tests, each exercising what the issue
names: ReLU(inplace) and dropout; a fused qkv split into views and SDPA with
dropout; a conv net with BatchNorm (running statistics written in place); an
LSTM (multi-output RNN kernels with a workspace)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class InplaceDropoutMLP(nn.Module):
    def __init__(self, d=128, n=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(self.act(layer(x)))
        return x


class FusedQKVBlock(nn.Module):
    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)  # three views of one storage
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.ln2(x))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x):
        return self.net(x)


class LSTMLM(nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True, dropout=0.1)
        self.out = nn.Linear(d, vocab)

    def forward(self, x):
        return self.out(self.lstm(self.emb(x))[0])


def build(name: str, batch: int = 1):
    """(model, loss function of the model): the inputs are made here, once.
    `batch` scales the batch: 1 for chaos runs (every value recomputed, so
    small and quick), 8 for budget sweeps (a peak of tens of MiB, so that
    budgets well above the pool's 2 MiB granularity still force evictions)."""
    torch.manual_seed(0)
    if name == "mlp_inplace_dropout":
        model, x = InplaceDropoutMLP(), torch.randn(128 * batch, 128)
        return model, lambda m: m(x).square().mean()
    if name == "transformer_sdpa_dropout":
        model, x = nn.Sequential(FusedQKVBlock(), FusedQKVBlock()), torch.randn(2 * batch, 32, 64)
        return model, lambda m: m(x).square().mean()
    if name == "convnet_batchnorm":
        model, x, y = ConvBN(), torch.randn(4 * batch, 3, 16, 16), torch.randint(0, 10, (4 * batch,))
        return model, lambda m: F.cross_entropy(m(x), y)
    if name == "lstm":
        model = LSTMLM()
        x, y = torch.randint(0, 50, (2 * batch, 16)), torch.randint(0, 50, (2 * batch, 16))
        return model, lambda m: F.cross_entropy(m(x).flatten(0, 1), y.flatten())
    raise ValueError(name)


NAMES = ("mlp_inplace_dropout", "transformer_sdpa_dropout", "convnet_batchnorm", "lstm")
