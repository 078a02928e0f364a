"""torch's memory functions, answered by dtralloc while it is torch's allocator.

Under any pluggable allocator, ``torch.cuda.memory_allocated()`` and its
siblings raise "CUDAPluggableAllocator does not yet support getDeviceStats"
(torch/csrc/cuda/CUDAPluggableAllocator.cpp), and training scripts, HF
Trainer's memory metrics and Lightning's device stats all call them. Those
Python functions (torch/cuda/memory.py, torch/accelerator/memory.py) end in a
few bindings of ``torch._C``; install() replaces exactly these, and nothing
else:

=========================================  ===========================================
binding                                    what reaches it
=========================================  ===========================================
``_cuda_memoryStats(device)``              torch.cuda.memory_stats, memory_stats_as_nested_dict,
                                           memory_allocated, max_memory_allocated,
                                           memory_reserved, max_memory_reserved,
                                           memory_summary, memory_cached, max_memory_cached
``_cuda_resetPeakMemoryStats(device)``     reset_peak_memory_stats, reset_max_memory_allocated,
                                           reset_max_memory_cached
``_cuda_resetAccumulatedMemoryStats(d)``   reset_accumulated_memory_stats
``_cuda_memorySnapshot(mempool_id)``       memory_snapshot, torch.cuda.memory._snapshot,
                                           _dump_snapshot
``_accelerator_getDeviceStats(device)``    torch.accelerator.memory_stats, memory_allocated,
                                           max_memory_allocated, memory_reserved,
                                           max_memory_reserved
``_accelerator_resetPeakStats(device)``    torch.accelerator.reset_peak_memory_stats
``_accelerator_resetAccumulatedStats(d)``  torch.accelerator.reset_accumulated_memory_stats
=========================================  ===========================================

(The ``_accelerator_*`` bindings exist from torch 2.9; where one is missing it
is left alone.) The stats are dtralloc's (dtralloc.memory_stats()), nested the
way torch's binding nests them, so torch's flattening gives back exactly
dtralloc's keys: ``torch.cuda.memory_allocated() ==
dtralloc.memory_stats()["allocated_bytes.all.current"]``. A device dtralloc
never allocated on answers zeros, as torch's allocator does, without creating
a context there. The snapshot is dtralloc.snapshot(); dtralloc has no private
pools, so a snapshot of another pool than (0, 0) is empty. torch 2.11 passes
``mempool_id`` as None or a pair, torch 2.13 as a (pool, pool, include_traces)
triple: both are read.

Each replacement asks, at every call, whether the allocator torch uses
(``torch._C._cuda_getAllocator()``) is still the one install() swapped in, and
otherwise calls torch's own binding: nothing changes for any other allocator.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from . import _core
from .stats import memory_stats, snapshot

_swapped_in: Any = None  # the torch._C._CUDAPluggableAllocator install() swapped in


def _nested(flat: dict) -> dict:
    """{"a.b.c": v} -> {"a": {"b": {"c": v}}}: the shape torch's binding
    returns and torch.cuda.memory_stats() flattens again."""
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


@functools.lru_cache(maxsize=1)
def _zero_stats() -> dict:
    """dtralloc's stats keys, all zero: what a device without a dtralloc
    allocator reports (no allocator is created for the question)."""
    stats = _core.Pool("virtual", 1, "", 0).stats()
    stats["budget_bytes"] = stats["capacity_bytes"] = 0
    return stats


def _device(torch, device) -> int:
    if device is None or device < 0:
        return torch.cuda.current_device()
    return int(device)


def _stats(torch, device) -> dict:
    index = _device(torch, device)
    if _core.existing_global_pool(index) is None:
        return _nested(_zero_stats())
    return _nested(memory_stats(index))


def _reset_peak(torch, device) -> None:
    pool = _core.existing_global_pool(_device(torch, device))
    if pool is not None:
        pool.reset_peak_stats()


def _reset_accumulated(torch, device) -> None:
    pool = _core.existing_global_pool(_device(torch, device))
    if pool is not None:
        pool.reset_accumulated_stats()


def _snapshot(torch, mempool_id=None) -> dict:
    snap = snapshot()
    if mempool_id is None:
        return snap
    pool = tuple(mempool_id[:2])
    include_traces = bool(mempool_id[2]) if len(mempool_id) > 2 else True
    if pool != (0, 0):  # a private pool: dtralloc has none
        snap["segments"] = []
        include_traces = False
    if not include_traces:
        snap["device_traces"] = [[] for _ in snap["device_traces"]]
    return snap


_REPLACEMENTS: dict[str, Callable] = {
    "_cuda_memoryStats": _stats,
    "_cuda_resetPeakMemoryStats": _reset_peak,
    "_cuda_resetAccumulatedMemoryStats": _reset_accumulated,
    "_cuda_memorySnapshot": _snapshot,
    "_accelerator_getDeviceStats": _stats,
    "_accelerator_resetPeakStats": _reset_peak,
    "_accelerator_resetAccumulatedStats": _reset_accumulated,
}


def patch(torch, swapped_in) -> list[str]:
    """Answer torch's memory bindings with dtralloc's figures while
    ``swapped_in`` (the pluggable allocator install() gave torch) is torch's
    allocator. Returns the names replaced."""
    global _swapped_in
    _swapped_in = swapped_in
    replaced = []
    for name, ours in _REPLACEMENTS.items():
        original = getattr(torch._C, name, None)
        if original is None:
            continue
        original = getattr(original, "_dtralloc_replaces", original)  # patched before
        setattr(torch._C, name, _while_installed(torch, name, ours, original))
        replaced.append(name)
    return replaced


def _while_installed(torch, name: str, ours: Callable, original: Callable) -> Callable:
    def binding(*args):
        if _swapped_in is not None and torch._C._cuda_getAllocator() is _swapped_in:
            return ours(torch, *args)
        return original(*args)

    binding.__name__ = binding.__qualname__ = name
    binding._dtralloc_replaces = original
    binding.__doc__ = f"dtralloc's answer while dtralloc is torch's CUDA allocator, else torch's own {name}."
    return binding
