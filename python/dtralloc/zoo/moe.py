"""A mixture-of-experts language model, own code: pre-norm decoder blocks
whose feed-forward layer is a set of expert MLPs behind a learned top-k
router (Shazeer et al. 2017; Switch/Mixtral style). Each token goes to its k
best experts: the router's top-k picks them, ``nonzero`` finds each expert's
tokens, an index gathers them and ``index_add_`` scatters the weighted
results back. How many tokens each expert gets depends on the data, so the
experts' tensor sizes differ from step to step and between recordings. A
load-balancing loss (Switch's) keeps the router from collapsing. AdamW."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .layers import SelfAttention
from .workload import Workload, param_millions


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(experts))

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)  # data-dependent count
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot].unsqueeze(1))
        # Switch's balance loss: fraction of tokens routed to each expert times its mean probability.
        routed = F.one_hot(chosen[:, 0], len(self.experts)).float().mean(dim=0)
        balance = len(self.experts) * (routed * probs.mean(dim=0)).sum()
        return out.view(shape), balance


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, experts: int, top_k: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal=True)
        self.norm2 = nn.LayerNorm(dim)
        self.moe = MoE(dim, hidden, experts, top_k)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        moe, balance = self.moe(self.norm2(x))
        return x + self.drop(moe), balance


class MoeLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int, experts: int,
                 top_k: int, dropout: float, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, experts, top_k, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        balance = 0
        for block in self.blocks:
            x, b = block(x)
            balance = balance + b
        return self.head(self.norm(x)), balance / len(self.blocks)


BALANCE_WEIGHT = 0.01  # Switch Transformer's alpha


def build(batch: int = 8, seq: int = 512, vocab: int = 16000, dim: int = 512, layers: int = 4,
          heads: int = 8, hidden: int = 1024, experts: int = 8, top_k: int = 2, dropout: float = 0.1,
          seed: int = 0) -> Workload:
    """4 blocks of dim 512, 8 heads, 8 experts of hidden 1024 with top-2 routing,
    a 16000-token vocabulary, batch 8 x 512 tokens, causal-LM loss plus 0.01 x
    the balance loss."""
    torch.manual_seed(seed)
    model = MoeLM(vocab, dim, layers, heads, hidden, experts, top_k, dropout, seq).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    tokens = torch.randint(0, vocab, (batch, seq + 1))

    def loss_fn(model, tokens):
        logits, balance = model(tokens[:, :-1])
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        return lm + BALANCE_WEIGHT * balance

    return Workload(
        name="moe",
        description=(
            f"MoE LM ({layers} blocks, dim {dim}, {heads} heads, {experts} experts of hidden {hidden}, "
            f"top-{top_k} routing, dropout {dropout}, vocab {vocab}, {param_millions(model)} params) "
            f"batch {batch} x seq {seq}, causal-LM loss + {BALANCE_WEIGHT} x balance loss, AdamW (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(tokens,), loss_fn=loss_fn,
    )


SMALL = dict(batch=2, seq=8, vocab=64, dim=16, layers=2, heads=2, hidden=32, experts=4, top_k=2)
COMPACT = dict(batch=4, seq=128, vocab=4000, dim=256, layers=2, heads=4, hidden=256, experts=8, top_k=2)
