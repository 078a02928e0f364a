"""The zoo's registry: each model's builder and tiny size, and recording one step.

``MODELS[name](**sizes)`` builds a :class:`Workload` (random weights, no download);
its ``step()`` runs one training step. Three scales of each architecture:

* the builder's defaults: GPU scale (0.8-9 GiB a step), bundled in
  ``dtralloc/traces`` as ``<name>.dtrace``;
* ``COMPACT_SIZES[name]`` (``compact=True``): 70-150 MiB a step, bundled as
  ``<name>-compact.dtrace``. At this scale the pool's granularity (2 MiB small
  segments, 20 MiB large ones) is a large share of a budget, which GPU-scale
  traces do not show;
* ``SMALL_SIZES[name]`` (``small=True``): tiny, for tests and smoke runs.
"""
from __future__ import annotations

import gc
import inspect
import time
from typing import Callable, Optional

import torch

from ..trace import Trace
from ..trace.recorder import record
from . import bert, convbn, encdec, gpt2, llama, lstm, mlp, moe, resnet, unet, vit
from .workload import Workload

MODELS: dict[str, Callable[..., Workload]] = {
    "gpt2": gpt2.build,
    "bert": bert.build,
    "llama": llama.build,
    "resnet50": resnet.build,
    "unet": unet.build,
    "mlp": mlp.build,
    "lstm": lstm.build,
    "vit": vit.build,
    "encdec": encdec.build,
    "convbn": convbn.build,
    "moe": moe.build,
}

SMALL_SIZES: dict[str, dict] = {
    "gpt2": gpt2.SMALL,
    "bert": bert.SMALL,
    "llama": llama.SMALL,
    "resnet50": resnet.SMALL,
    "unet": unet.SMALL,
    "mlp": mlp.SMALL,
    "lstm": lstm.SMALL,
    "vit": vit.SMALL,
    "encdec": encdec.SMALL,
    "convbn": convbn.SMALL,
    "moe": moe.SMALL,
}

# 70-150 MiB a step (the no-eviction peak reserved), the architectures not
# built on transformers. Activations are a third to two thirds of each peak;
# the rest is parameters, gradients and optimizer state.
COMPACT_SIZES: dict[str, dict] = {
    "lstm": lstm.COMPACT,
    "vit": vit.COMPACT,
    "encdec": encdec.COMPACT,
    "convbn": convbn.COMPACT,
    "moe": moe.COMPACT,
}
COMPACT_SUFFIX = "-compact"  # a compact recording's trace name: "vit-compact"

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


def scale_sizes(name: str, small: bool = False, compact: bool = False) -> dict:
    """The builder keywords of a scale: ``{}`` (GPU scale), ``SMALL_SIZES[name]``
    or ``COMPACT_SIZES[name]``."""
    _builder(name)
    if small and compact:
        raise ValueError("dtralloc.zoo: choose one scale, small (tiny) or compact (70-150 MiB), not both")
    if compact:
        if name not in COMPACT_SIZES:
            raise ValueError(f"zoo model {name!r} has no compact size; models with one: {', '.join(COMPACT_SIZES)}")
        return COMPACT_SIZES[name]
    return SMALL_SIZES[name] if small else {}


def build(name: str, small: bool = False, compact: bool = False, **sizes) -> Workload:
    """Model ``name`` at its bundled size, at ``SMALL_SIZES[name]`` with ``small``
    or at ``COMPACT_SIZES[name]`` with ``compact``; ``sizes`` override single
    builder keywords (``batch=4``)."""
    return _builder(name)(**{**scale_sizes(name, small, compact), **sizes})


def record_model(name: str, small: bool = False, sizes: Optional[dict] = None, warmup: bool = True,
                 echo: Callable[[str], None] = lambda message: None, compact: bool = False) -> Trace:
    """Build model ``name`` (see :func:`build`), run one warm-up step (so optimizer
    state exists and lazy initialisation is done, as in any step after the first)
    and record the next one. ``meta`` carries the model's description, the sizes
    used and torch's thread count, as in the bundled traces; a compact step is
    named ``<name>-compact``. ``echo`` hears progress as it happens."""
    sizes = {**scale_sizes(name, small, compact), **(sizes or {})}
    echo(f"building {name} with {sizes or 'default sizes'}")
    workload = build(name, **sizes)
    echo(workload.description)
    if warmup:
        workload.step()
        echo("warm-up step done")
    gc.collect()  # what the warm-up left behind is not the recorded step's
    start = time.perf_counter()
    trace = record(workload.step, name=name + (COMPACT_SUFFIX if compact else ""))
    trace.meta.update(description=workload.description, sizes=effective_sizes(name, sizes),
                      torch_threads=torch.get_num_threads())
    echo(f"recorded one step in {time.perf_counter() - start:.1f}s")
    return trace
