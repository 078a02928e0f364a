"""GPT-2 (transformers' GPT2LMHeadModel from a config, random weights), AdamW."""
from __future__ import annotations

import torch

from .workload import Workload, causal_lm_loss, param_millions, require_transformers


def build(batch: int = 2, seq: int = 1024, layers: int = 12, hidden: int = 768,
          heads: int = 12, vocab: int = 50257, attn: str = "sdpa", seed: int = 0) -> Workload:
    """GPT-2 small by default (GPT2Config defaults: 12 layers, 768 hidden, 12 heads,
    vocab 50257, dropout 0.1 everywhere), causal-LM loss on random token ids."""
    require_transformers("gpt2")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
        n_positions=max(seq, 1024), bos_token_id=vocab - 1, eos_token_id=vocab - 1,
        attn_implementation=attn,
    )
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    tokens = torch.randint(0, vocab, (batch, seq))

    return Workload(
        name="gpt2",
        description=(
            f"GPT-2 ({layers} layers, hidden {hidden}, {heads} heads, vocab {vocab}, "
            f"{param_millions(model)} params, dropout 0.1, attn_implementation={attn}) "
            f"batch {batch} x seq {seq}, causal-LM loss, AdamW (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(tokens,), loss_fn=causal_lm_loss,
    )


SMALL = dict(batch=2, seq=32, layers=2, hidden=64, heads=4, vocab=512)
