"""Statistics, summaries and snapshots of the process-wide allocators.

Keys and layout follow torch (``torch.cuda.memory_stats()``,
``torch.cuda.memory._snapshot()``), so torch's own tools read them; dtralloc
adds ``budget_bytes`` and ``fragmentation.*`` keys.
"""
from __future__ import annotations

import collections

from . import _core
from ._native import global_pool


def _current_device() -> int:
    try:
        import torch

        # Only ask torch once CUDA is up: torch.cuda.current_device() would
        # initialize CUDA, after which dtralloc.install() is too late.
        if torch.cuda.is_initialized():
            return torch.cuda.current_device()
    except ImportError:
        pass
    return 0


def _device_index(device) -> int:
    """Device index from None (current device), an int, 'cuda', 'cuda:N' or a
    torch.device, the way torch.cuda.memory_stats reads its argument."""
    if device is None:
        return _current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):  # before getattr: str has an .index method
        kind, _, index = device.partition(":")
        if kind == "cuda" and (not index or index.isdigit()):
            return int(index) if index else _current_device()
    elif getattr(device, "type", None) == "cuda":  # torch.device
        return device.index if device.index is not None else _current_device()
    raise ValueError(
        f"dtralloc: cannot read a CUDA device index from {device!r}; pass an int, 'cuda', "
        "'cuda:N' or a torch.device of type cuda"
    )


def _pool(device):
    return global_pool(_device_index(device))


def memory_stats(device=None) -> "collections.OrderedDict[str, object]":
    """Stats of the allocator serving `device` (torch's key names, sorted)."""
    return collections.OrderedDict(sorted(_pool(device).stats().items()))


def reset_peak_memory_stats(device=None) -> None:
    _pool(device).reset_peak_stats()


def reset_accumulated_memory_stats(device=None) -> None:
    _pool(device).reset_accumulated_stats()


def record_memory_history(max_entries: int = 16384, device=None) -> None:
    """Keep the newest `max_entries` alloc/free/segment events of `device` for
    snapshot()'s ``device_traces`` (0 stops recording), like torch's
    ``torch.cuda.memory._record_memory_history(max_entries=...)``. Off by
    default, as in torch: it costs about 15 ns per malloc+free pair. Starting
    or resizing clears what was recorded. ``history_entries:N`` in
    DTRALLOC_CONF turns it on from the start."""
    _pool(device).record_history(int(max_entries))


def empty_cache() -> None:
    """Release every cached, entirely free segment on every device."""
    for device in range(64):
        pool = _core.existing_global_pool(device)
        if pool is not None:
            pool.empty_cache()


def snapshot() -> dict:
    """All devices' segments and event history, in torch's snapshot layout.

    ``torch.cuda._memory_viz.segsum(dtralloc.snapshot())`` and friends work on it,
    and it can be pickled for https://pytorch.org/memory_viz.
    """
    return _core.global_snapshot()


def _fmt(n: int) -> str:
    return _core.format_bytes(int(n)) if n >= 0 else "-" + _core.format_bytes(int(-n))


def format_summary(stats: dict, title: str) -> str:
    """A torch-style table of one stats dict (from memory_stats or Pool.stats)."""
    rows = [
        ("Allocated memory", "allocated_bytes", True),
        ("Active memory", "active_bytes", True),
        ("Requested memory", "requested_bytes", True),
        ("Reserved memory", "reserved_bytes", True),
        ("Non-releasable memory", "inactive_split_bytes", True),
        ("Allocations", "allocation", False),
        ("Active allocs", "active", False),
        ("Reserved segments", "segment", False),
        ("Non-releasable allocs", "inactive_split", False),
    ]
    cols = ("current", "peak", "allocated", "freed")
    heads = ("Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed")
    width = 78
    cell = 12
    label_width = width - 4 - cell * len(cols)  # "| " + label + cells + " |"
    out = ["=" * width, f"|{title:^{width - 2}}|", "=" * width]
    out.append(f"| {'Metric':<{label_width}}" + "".join(f"{h:>{cell}}" for h in heads) + " |")
    for label, key, is_bytes in rows:
        out.append("-" * width)
        for pool in ("all", "large_pool", "small_pool"):
            name = label if pool == "all" else f"  from {pool.replace('_', ' ')}"
            vals = [stats[f"{key}.{pool}.{c}"] for c in cols]
            cells = [(_fmt(v) if is_bytes else str(v)) for v in vals]
            out.append(f"| {name:<{label_width}}" + "".join(f"{c:>{cell}}" for c in cells) + " |")
    out.append("=" * width)
    frag = stats["fragmentation.external"]
    notes = [
        f"Budget {_fmt(stats['budget_bytes'])}",
        f"largest free block {_fmt(stats['fragmentation.largest_free_bytes'])}",
        f"fragmentation {frag:.2f}",
        f"OOMs {stats['num_ooms']}",
        f"alloc retries {stats['num_alloc_retries']}",
        f"device allocs {stats['num_device_alloc']}",
        f"frees {stats['num_device_free']}",
        f"time in them {(stats['device_alloc_ns'] + stats['device_free_ns']) / 1e6:.1f} ms",
        f"invalid frees {stats['num_invalid_frees']}",
    ]
    out.extend(_pack_line(notes[:3], width) + _pack_line(notes[3:], width))
    out.append("=" * width)
    return "\n".join(out)


def _pack_line(items, width: int) -> list:
    """Table rows "| a  b  c |" of `width` characters, wrapping between items."""
    lines, current = [], ""
    for item in items:
        candidate = f"{current}  {item}" if current else item
        if current and len(candidate) > width - 4:
            lines.append(current)
            candidate = item
        current = candidate
    lines.append(current)
    return [f"| {line:<{width - 4}} |" for line in lines]


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """Human-readable table of memory_stats(device), like torch.cuda.memory_summary."""
    index = _device_index(device)
    text = format_summary(memory_stats(index), f"dtralloc memory summary, device {index}")
    if abbreviated:
        return "\n".join(line for line in text.splitlines() if "from " not in line)
    return text
