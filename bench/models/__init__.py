"""The model zoo: training steps of well-known models, for recording traces.

``MODELS[name](**sizes)`` builds a :class:`Workload` (random weights, no download);
its ``step()`` runs one training step. Called with no arguments a builder gives the
realistic size bundled in ``dtralloc/traces``; ``SMALL_SIZES[name]`` is a tiny size
of the same architecture for tests. GPT-2, BERT and Llama need ``transformers``.
"""
from __future__ import annotations

from typing import Callable

from . import bert, gpt2, llama, mlp, resnet, unet
from .workload import Workload

MODELS: dict[str, Callable[..., Workload]] = {
    "gpt2": gpt2.build,
    "bert": bert.build,
    "llama": llama.build,
    "resnet50": resnet.build,
    "unet": unet.build,
    "mlp": mlp.build,
}

SMALL_SIZES: dict[str, dict] = {
    "gpt2": gpt2.SMALL,
    "bert": bert.SMALL,
    "llama": llama.SMALL,
    "resnet50": resnet.SMALL,
    "unet": unet.SMALL,
    "mlp": mlp.SMALL,
}

# Models built on transformers' configs; the others need only torch.
NEEDS_TRANSFORMERS = frozenset({"gpt2", "bert", "llama"})

__all__ = ["MODELS", "NEEDS_TRANSFORMERS", "SMALL_SIZES", "Workload"]
