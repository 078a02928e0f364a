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
