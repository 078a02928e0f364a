"""A Llama-style decoder (transformers' LlamaForCausalLM from a config, random
weights): RMSNorm, rotary embeddings, SwiGLU MLP, untied head. AdamW."""
from __future__ import annotations

import torch

from .workload import Workload, causal_lm_loss, param_millions, require_transformers


def build(batch: int = 4, seq: int = 1024, layers: int = 8, hidden: int = 1024,
          heads: int = 16, intermediate: int = 2816, vocab: int = 32000,
          attn: str = "sdpa", seed: int = 0) -> Workload:
    """Smaller than any released Llama (hidden 1024, 8 layers, 16 heads,
    intermediate 2816, vocab 32000) so a step fits on CPU; Llama's default of
    no dropout is kept, so its trace has no random ops."""
    require_transformers("llama")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=intermediate, vocab_size=vocab,
        max_position_embeddings=max(seq, 2048), bos_token_id=1, eos_token_id=2,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    tokens = torch.randint(0, vocab, (batch, seq))

    return Workload(
        name="llama",
        description=(
            f"Llama-style decoder ({layers} layers, hidden {hidden}, {heads} heads, "
            f"intermediate {intermediate}, vocab {vocab}, {param_millions(model)} params, no dropout, "
            f"attn_implementation={attn}) batch {batch} x seq {seq}, causal-LM loss, AdamW (foreach)"
        ),
        model=model, optimizer=optimizer, batch=(tokens,), loss_fn=causal_lm_loss,
    )


SMALL = dict(batch=2, seq=32, layers=2, hidden=64, heads=4, intermediate=176, vocab=512)
