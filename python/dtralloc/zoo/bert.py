"""BERT (transformers' BertForMaskedLM from a config, random weights), AdamW."""
from __future__ import annotations

import torch

from .workload import Workload, param_millions, require_transformers

# BERT pre-training masks 15% of the tokens; the loss counts only those.
MASK_FRACTION = 0.15


def build(batch: int = 8, seq: int = 512, layers: int = 12, hidden: int = 768,
          heads: int = 12, intermediate: int = 3072, vocab: int = 30522,
          attn: str = "sdpa", seed: int = 0) -> Workload:
    """BERT-base by default (BertConfig defaults: 12 layers, 768 hidden, 12 heads,
    intermediate 3072, vocab 30522, dropout 0.1), masked-LM loss on 15% of tokens."""
    require_transformers("bert")
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=intermediate, vocab_size=vocab,
        max_position_embeddings=max(seq, 512), attn_implementation=attn,
    )
    model = BertForMaskedLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    tokens = torch.randint(0, vocab, (batch, seq))
    masked = torch.rand(batch, seq) < MASK_FRACTION
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
    attention_mask = torch.ones(batch, seq, dtype=torch.long)

    def loss_fn(model, tokens, attention_mask, labels):
        return model(input_ids=tokens, attention_mask=attention_mask, labels=labels).loss

    return Workload(
        name="bert",
        description=(
            f"BERT ({layers} layers, hidden {hidden}, {heads} heads, intermediate {intermediate}, "
            f"vocab {vocab}, {param_millions(model)} params, dropout 0.1, attn_implementation={attn}) "
            f"batch {batch} x seq {seq}, masked-LM loss on {MASK_FRACTION:.0%} of tokens, AdamW (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(tokens, attention_mask, labels), loss_fn=loss_fn,
    )


SMALL = dict(batch=2, seq=32, layers=2, hidden=64, heads=4, intermediate=128, vocab=512)
