"""The one thing every zoo model is: a Workload whose ``step()`` is a training step;
and the helpers the builders share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Workload:
    """A model, its optimizer and one fixed batch.

    ``step()`` is a whole training step as a training loop runs it:
    ``zero_grad(set_to_none=True)``, forward, loss, backward, ``optimizer.step()``.
    The batch is made once at build time, so it is an initial storage of a trace,
    like a batch the data loader handed over before the step began.

    Optimizers are built with ``foreach=True``: that is torch's default on CUDA,
    the device these traces stand for (on CPU the default is a per-parameter
    loop, with a different op sequence and smaller optimizer temporaries).
    """

    name: str
    description: str          # model, sizes, attention kernel, optimizer
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple              # positional inputs of loss_fn after the model
    loss_fn: Callable[..., torch.Tensor]

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model, *self.batch)
        loss.backward()
        self.optimizer.step()

    def parameter_count(self) -> int:
        return parameter_count(self.model)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def param_millions(model: torch.nn.Module) -> str:
    """The model's parameter count for a description, e.g. "124.4M"."""
    return f"{parameter_count(model) / 1e6:.1f}M"


def causal_lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss of a transformers causal LM on its own input.

    use_cache=False: a training step keeps no KV cache (it would hold a copy
    of every layer's keys and values until the step ends).
    """
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def chunked_causal_lm_loss(model, tokens: torch.Tensor, chunks: int) -> torch.Tensor:
    """causal_lm_loss's value, with the LM head and the cross-entropy run over
    the tokens in `chunks` pieces (chunked_lm_loss); equal to it up to the
    order of the float sums."""
    hidden = model.base_model(input_ids=tokens, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    return chunked_lm_loss(hidden, head.weight, head.bias, tokens, chunks)


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias, tokens: torch.Tensor,
                    chunks: int) -> torch.Tensor:
    """Mean next-token cross-entropy of ``F.linear(hidden, weight, bias)`` on
    `tokens` (batch x seq; position t predicts token t + 1), computed in
    `chunks` pieces over the batch's tokens.

    An unchunked loss makes the logits (tokens x vocab: GPT-2 small at batch
    24 x 1024, 4.9 GB in float32), their log-softmax and, in the backward, two
    gradients of that size, of which three are alive at once while the
    log-softmax's backward runs. No memory saving elsewhere can make room for
    that. In pieces, each piece's logits and log-softmax are values of their
    own: under dtralloc.dtr() the evictor can take them and the backward
    brings one piece back at a time.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunked_lm_loss: chunks is a number of pieces >= 1, not {chunks!r}")
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = tokens[:, 1:].reshape(-1)
    total = None
    for h_part, t_part in zip(h.chunk(chunks), targets.chunk(chunks)):
        part = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h_part, weight, bias), t_part,
                                                 reduction="sum")
        total = part if total is None else total + part
    return total / targets.numel()


def require_transformers(model: str) -> None:
    """Raise an ImportError that names the extra to install when ``transformers``,
    which builds ``model`` from its config, is missing."""
    try:
        import transformers  # noqa: F401  (cheap: transformers imports its models lazily)
    except ImportError as e:
        raise ImportError(
            f"the {model} zoo model is built from a transformers config and transformers is "
            f'not installed: pip install "dtralloc[zoo]"'
        ) from e
