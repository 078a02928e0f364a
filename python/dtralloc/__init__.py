"""dtralloc: a caching GPU memory allocator for PyTorch and CuPy.

Quick start::

    import dtralloc
    dtralloc.install()          # before the first CUDA allocation
    ...                         # train as usual
    print(dtralloc.memory_summary())

Everything tunable goes through ``DTRALLOC_CONF="key:value,..."`` (run
``python -m dtralloc config`` for the table). :class:`Pool` drives a pool
directly, on the ``cuda``, ``host`` or ``virtual`` backend.
"""
from __future__ import annotations

from ._native import ConfigError, InvalidPointerError, OutOfMemoryError, library_path
from .config import describe_config, effective_config
from .cupy_hooks import cupy_allocator, install_cupy
from .dashboard import dashboard
from .pool import Pool
from .replay import POLICIES, ReplayResult, min_feasible_budget, replay, resident_floor
from . import trace
from .stats import (
    empty_cache,
    memory_stats,
    memory_summary,
    record_memory_history,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    snapshot,
)
from .torch_hooks import install, installed

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "InvalidPointerError",
    "OutOfMemoryError",
    "POLICIES",
    "Pool",
    "ReplayResult",
    "cupy_allocator",
    "dashboard",
    "describe_config",
    "effective_config",
    "empty_cache",
    "install",
    "install_cupy",
    "installed",
    "library_path",
    "memory_stats",
    "memory_summary",
    "record_memory_history",
    "replay",
    "resident_floor",
    "min_feasible_budget",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "snapshot",
    "trace",
]
