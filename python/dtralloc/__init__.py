"""dtralloc: a caching GPU memory allocator for PyTorch and CuPy.

Quick start::

    import dtralloc
    dtralloc.install()          # before the first CUDA allocation
    ...                         # train as usual
    print(dtralloc.memory_summary())

Everything tunable goes through ``DTRALLOC_CONF="key:value,..."`` (run
``python -m dtralloc config`` for the table). :class:`Pool` drives a pool
directly, on the ``cuda``, ``host`` or ``virtual`` backend.
:mod:`dtralloc.trace` records a training step, :func:`replay` runs one through
the pool; :func:`dtr` trains under a budget, evicting and recomputing live
(needs torch; loaded on first use, so ``import dtralloc`` never imports torch);
``dtralloc.baselines`` and ``dtralloc.zoo`` (need torch) are imported by name.
This module only re-exports.
"""
from __future__ import annotations

from . import trace
from ._native import ConfigError, InvalidPointerError, OutOfMemoryError, library_path
from ._version import __version__
from .config import describe_config, effective_config
from .cupy_hooks import cupy_allocator, install_cupy
from .dashboard import dashboard
from .dtr import dtr
from .pool import Pool
from .replay import (POLICIES, ReplayResult, feasibility_holes, feasible_budgets, min_feasible_budget, overhead_grid,
                     replay, resident_floor)
from .stats import (
    empty_cache,
    memory_stats,
    memory_summary,
    record_memory_history,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    snapshot,
)
from .torch_hooks import InstallError, install, installed



def __getattr__(name):
    # The live session needs torch: its class is loaded on first use.
    if name == "Session":
        from .dtr.session import Session

        return Session
    raise AttributeError(f"module 'dtralloc' has no attribute {name!r}")


__all__ = [
    # errors users can cause, each naming the cause and the fix
    "ConfigError",          # a bad DTRALLOC_CONF key or value (a ValueError)
    "InstallError",         # install() too late, twice with another conf, or without CUDA torch
    "InvalidPointerError",  # a free of an address the pool did not hand out (a ValueError)
    "OutOfMemoryError",     # a Pool request over the budget or the device (a MemoryError)
    "POLICIES",
    "Pool",
    "ReplayResult",
    "Session",
    "cupy_allocator",
    "dashboard",
    "describe_config",
    "dtr",
    "effective_config",
    "empty_cache",
    "feasibility_holes",
    "feasible_budgets",
    "install",
    "install_cupy",
    "installed",
    "library_path",
    "memory_stats",
    "memory_summary",
    "min_feasible_budget",
    "overhead_grid",
    "record_memory_history",
    "replay",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "resident_floor",
    "snapshot",
    "trace",
]
