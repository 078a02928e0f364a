"""Recorded training steps bundled with dtralloc: one ``<name>.dtrace`` per zoo model.

    >>> from dtralloc.traces import list_bundled, load_bundled
    >>> list_bundled()[:6]
    ['bert', 'convbn', 'convbn-compact', 'encdec', 'encdec-compact', 'gpt2']
    >>> trace = load_bundled("gpt2")

Each is one step (after a warm-up step) of a model of :mod:`dtralloc.zoo`, recorded
on CPU by ``bench/record_zoo.py``: every model at GPU scale, and the torch-only
newcomers at compact scale too (``<name>-compact``, 70-150 MiB a step);
``trace.meta["description"]`` names the model, its sizes and its optimizer.
Replaying one needs neither torch nor the model.
"""
from __future__ import annotations

import os

SUFFIX = ".dtrace"
_HERE = os.path.dirname(os.path.abspath(__file__))


def list_bundled() -> list[str]:
    """Names of the bundled traces, sorted."""
    return sorted(f[: -len(SUFFIX)] for f in os.listdir(_HERE) if f.endswith(SUFFIX))


def bundled_path(name: str) -> str:
    """The file of bundled trace ``name``; ValueError naming the choices if there is none."""
    path = os.path.join(_HERE, name + SUFFIX)
    if os.path.basename(name) != name or not os.path.isfile(path):
        available = ", ".join(list_bundled()) or "none (the package was installed without its traces)"
        raise ValueError(f"no bundled trace named {name!r}; available: {available}")
    return path


def load_bundled(name: str):
    """The bundled trace ``name`` as a :class:`dtralloc.trace.Trace`."""
    from ..trace import load

    return load(bundled_path(name))


__all__ = ["bundled_path", "list_bundled", "load_bundled"]
