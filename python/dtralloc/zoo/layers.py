"""Layers the zoo's own transformers share."""
from __future__ import annotations

from torch import nn
from torch.nn import functional as F


class SelfAttention(nn.Module):
    """Multi-head self-attention: one fused q/k/v projection, torch's
    scaled_dot_product_attention (causal or not), an output projection."""

    def __init__(self, dim: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(attn.transpose(1, 2).reshape(b, n, d))
