"""The zoo's registry: each model's builder and tiny size, and recording one step.

``MODELS[name](**sizes)`` builds a :class:`Workload` (random weights, no download);
its ``step()`` runs one training step. Called with no arguments a builder gives the
realistic size bundled in ``dtralloc/traces``; ``SMALL_SIZES[name]`` is a tiny size
of the same architecture for tests and smoke runs.
"""
from __future__ import annotations

import gc
import inspect
import time
from typing import Callable, Optional

import torch

from ..trace import Trace
from ..trace.recorder import record
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

# Models built on transformers' configs (the `zoo` extra); the others need only torch.
NEEDS_TRANSFORMERS = frozenset({"gpt2", "bert", "llama"})


def _builder(name: str) -> Callable[..., Workload]:
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; available: {', '.join(MODELS)}")
    return MODELS[name]


def effective_sizes(name: str, sizes: dict) -> dict:
    """Every builder keyword of model ``name`` with the value used: its default unless in ``sizes``."""
    params = inspect.signature(_builder(name)).parameters
    return {k: sizes.get(k, p.default) for k, p in params.items()}


def build(name: str, small: bool = False, **sizes) -> Workload:
    """Model ``name`` at its bundled size, or at ``SMALL_SIZES[name]`` with ``small``;
    ``sizes`` override single builder keywords (``batch=4``)."""
    builder = _builder(name)
    return builder(**{**(SMALL_SIZES[name] if small else {}), **sizes})


def record_model(name: str, small: bool = False, sizes: Optional[dict] = None, warmup: bool = True,
                 echo: Callable[[str], None] = lambda message: None) -> Trace:
    """Build model ``name`` (see :func:`build`), run one warm-up step (so optimizer
    state exists and lazy initialisation is done, as in any step after the first)
    and record the next one. ``meta`` carries the model's description, the sizes
    used and torch's thread count, as in the bundled traces. ``echo`` hears
    progress as it happens."""
    sizes = {**(SMALL_SIZES[name] if small else {}), **(sizes or {})}
    echo(f"building {name} with {sizes or 'default sizes'}")
    workload = build(name, **sizes)
    echo(workload.description)
    if warmup:
        workload.step()
        echo("warm-up step done")
    gc.collect()  # what the warm-up left behind is not the recorded step's
    start = time.perf_counter()
    trace = record(workload.step, name=name)
    trace.meta.update(description=workload.description, sizes=effective_sizes(name, sizes),
                      torch_threads=torch.get_num_threads())
    echo(f"recorded one step in {time.perf_counter() - start:.1f}s")
    return trace
