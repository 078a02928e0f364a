"""A recurrent language model: embedding, a stacked LSTM (torch's nn.LSTM,
dropout between layers), a linear head over the vocabulary; Adam.

On CPU torch runs nn.LSTM as its per-timestep ops (a gate matmul, the gate
nonlinearities and the cell update for every step of every layer), so the
trace has many small, short-lived tensors per step of the sequence, unlike
the transformers' few large ones per layer.
"""
from __future__ import annotations

import torch
from torch import nn

from .workload import Workload, param_millions


class LstmLM(nn.Module):
    def __init__(self, vocab: int, embed: int, hidden: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embed, hidden, layers, dropout=dropout, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        out, _ = self.lstm(self.drop(self.embed(tokens)))
        return self.head(self.drop(out))


def build(batch: int = 64, seq: int = 64, vocab: int = 16000, embed: int = 512, hidden: int = 1024,
          layers: int = 2, dropout: float = 0.2, seed: int = 0) -> Workload:
    """A 2-layer LSTM LM of hidden 1024 over a 16000-token vocabulary,
    batch 64 x 64 steps, next-token cross-entropy."""
    torch.manual_seed(seed)
    model = LstmLM(vocab, embed, hidden, layers, dropout).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, vocab, (batch, seq + 1))

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    return Workload(
        name="lstm",
        description=(
            f"LSTM LM ({layers} layers, embed {embed}, hidden {hidden}, vocab {vocab}, dropout {dropout}, "
            f"{param_millions(model)} params) batch {batch} x seq {seq}, next-token cross-entropy, Adam (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(tokens,), loss_fn=loss_fn,
    )


SMALL = dict(batch=2, seq=8, vocab=64, embed=16, hidden=32, layers=2)
COMPACT = dict(batch=16, seq=64, vocab=2000, embed=128, hidden=384, layers=2)
