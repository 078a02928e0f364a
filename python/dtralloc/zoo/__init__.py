"""The model zoo: training steps of well-known models, for recording traces.

    >>> from dtralloc import zoo
    >>> trace = zoo.record_model("resnet50", small=True)   # warm-up step, then one recorded step
    >>> workload = zoo.build("gpt2")                        # a Workload; workload.step() trains once

GPT-2 (``gpt2``), BERT (``bert``), a Llama-style decoder (``llama``), ResNet-50
(``resnet50``), a UNet (``unet``), an MLP (``mlp``), an LSTM language model
(``lstm``), a vision transformer (``vit``), an encoder-decoder transformer
(``encdec``), a VGG-style conv-BN net without residuals (``convbn``) and a
mixture-of-experts LM with top-k routing (``moe``), with random weights (no
download). GPT-2, BERT and Llama are built from ``transformers`` configs
(``pip install "dtralloc[zoo]"``); the others need only torch. The bundled
traces (``dtralloc.traces``) are one step of each, recorded by
``bench/record_zoo.py``, at GPU scale and, for the torch-only newcomers, at
compact scale (``COMPACT_SIZES``, 70-150 MiB a step) too.

The rooms: ``workload`` (Workload and the builders' helpers), one module per
model, ``registry`` (MODELS, SMALL_SIZES, COMPACT_SIZES, build, record_model).
"""
from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("dtralloc.zoo builds PyTorch models and needs torch: pip install torch") from e

from .registry import (
    COMPACT_SIZES,
    COMPACT_SUFFIX,
    MODELS,
    NEEDS_TRANSFORMERS,
    SMALL_SIZES,
    build,
    effective_sizes,
    record_model,
    scale_sizes,
)
from .workload import Workload

__all__ = ["COMPACT_SIZES", "COMPACT_SUFFIX", "MODELS", "NEEDS_TRANSFORMERS", "SMALL_SIZES", "Workload", "build",
           "effective_sizes", "record_model", "scale_sizes"]
