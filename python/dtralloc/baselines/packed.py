"""Where a pool that never fragments would first have to evict: the reference for
the dynamic policies' fragmentation figure at budgets with few forced evictions."""
from __future__ import annotations

from dataclasses import dataclass

from ..trace import Trace
from .grouped import _round


@dataclass
class PackedEviction:
    """Where :func:`first_eviction_packed` finds the first allocation that does not fit."""

    op: int                # trace op allocating it; -1: the storages alive before the step
    op_name: str
    request_bytes: int     # that storage's size (512 B rounding)
    free_bytes: int        # budget - live bytes just before it
    budget_bytes: int

    @property
    def free_fraction(self) -> float:
        """free_bytes / budget_bytes: what ``ReplayResult.free_share_at_evictions`` would
        average if this were the only forced eviction."""
        return self.free_bytes / self.budget_bytes


def first_eviction_packed(trace: Trace, budget_bytes: int) -> PackedEviction | None:
    """The first forced eviction of a pool that never fragments, or None if the
    step fits ``budget_bytes`` without evicting.

    Storages are allocated and freed in the replay's order (those alive before
    the step, then per op its created storages, then what the trace frees after
    it), each rounded up to 512 B, and reserved memory is always exactly the
    live bytes. The first storage that would take them past the budget is
    where such a pool must evict. Its ``free_fraction`` is the reference for
    ``ReplayResult.free_share_at_evictions`` at budgets with few forced evictions: there
    the free share at a call is set mostly by when the call comes and how big
    its request is, and a pool that packs better can show *more* of it (it is
    forced later, next to a bigger request), not less.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int (bytes; for a fraction f of the "
                         f"no-eviction peak pass int(f * dtralloc.replay(trace).peak_reserved_bytes)), "
                         f"got {budget_bytes!r}")
    sizes = [_round(s.nbytes) for s in trace.storages]
    live: dict[int, int] = {}
    total = 0

    def take(sid: int, op: int, name: str) -> PackedEviction | None:
        nonlocal total
        if total + sizes[sid] > budget_bytes:
            return PackedEviction(op, name, sizes[sid], budget_bytes - total, budget_bytes)
        live[sid] = sizes[sid]
        total += sizes[sid]
        return None

    for sid, s in enumerate(trace.storages):
        if s.initial and (hit := take(sid, -1, "(before the step)")):
            return hit
    for sid in trace.frees_before:
        total -= live.pop(sid, 0)
    for i, op in enumerate(trace.ops):
        for sid in op.created:
            if hit := take(sid, i, op.name):
                return hit
        for sid in op.frees:
            total -= live.pop(sid, 0)
    return None
