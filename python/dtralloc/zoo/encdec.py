"""An encoder-decoder transformer for sequence-to-sequence training (Vaswani
et al. 2017), torch's nn.Transformer (post-norm, ReLU, dropout 0.1) between
token embeddings with sinusoidal positions and a linear head over the target
vocabulary; teacher forcing with a causal mask, label-smoothed cross-entropy,
AdamW."""
from __future__ import annotations

import math

import torch
from torch import nn

from .workload import Workload, param_millions


def sinusoids(length: int, dim: int) -> torch.Tensor:
    position = torch.arange(length).unsqueeze(1)
    scale = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * scale)
    table[:, 1::2] = torch.cos(position * scale)
    return table


class Seq2Seq(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, ffn: int, dropout: float, length: int):
        super().__init__()
        self.dim = dim
        self.src_embed = nn.Embedding(vocab, dim)
        self.tgt_embed = nn.Embedding(vocab, dim)
        self.register_buffer("pos", sinusoids(length, dim), persistent=False)
        self.transformer = nn.Transformer(dim, heads, layers, layers, ffn, dropout, batch_first=True)
        self.head = nn.Linear(dim, vocab)
        self.drop = nn.Dropout(dropout)

    def embed(self, table: nn.Embedding, tokens):
        return self.drop(table(tokens) * math.sqrt(self.dim) + self.pos[: tokens.shape[1]])

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        out = self.transformer(self.embed(self.src_embed, src), self.embed(self.tgt_embed, tgt),
                               tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


def build(batch: int = 8, src_len: int = 256, tgt_len: int = 256, vocab: int = 16000, dim: int = 512,
          heads: int = 8, layers: int = 6, ffn: int = 2048, dropout: float = 0.1, seed: int = 0) -> Workload:
    """Transformer-base by default (6 + 6 layers, dim 512, 8 heads, FFN 2048, dropout 0.1),
    a 16000-token vocabulary, batch 8 of 256 source and 256 target tokens."""
    torch.manual_seed(seed)
    model = Seq2Seq(vocab, dim, heads, layers, ffn, dropout, max(src_len, tgt_len)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    src = torch.randint(0, vocab, (batch, src_len))
    tgt = torch.randint(0, vocab, (batch, tgt_len + 1))

    def loss_fn(model, src, tgt):
        logits = model(src, tgt[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1),
                                           label_smoothing=0.1)

    return Workload(
        name="encdec",
        description=(
            f"Encoder-decoder transformer (nn.Transformer, {layers} + {layers} layers, dim {dim}, "
            f"{heads} heads, FFN {ffn}, dropout {dropout}, vocab {vocab}, {param_millions(model)} params) "
            f"batch {batch}, {src_len} source / {tgt_len} target tokens, label-smoothed cross-entropy, "
            f"AdamW (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(src, tgt), loss_fn=loss_fn,
    )


SMALL = dict(batch=2, src_len=8, tgt_len=8, vocab=64, dim=32, heads=2, layers=2, ffn=64)
COMPACT = dict(batch=8, src_len=64, tgt_len=64, vocab=4000, dim=192, heads=4, layers=2, ffn=768)
