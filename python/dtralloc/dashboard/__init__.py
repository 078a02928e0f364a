"""Fragmentation dashboards: one self-contained HTML page per run or snapshot.

``dtralloc.dashboard(x)`` (and ``dtralloc dashboard INPUT... -o report.html``)
draws, for a trace replayed under budgets and policies, for a live dtr()
session, or for a memory snapshot (torch's or dtralloc's): the headline figures, a timeline of
allocated / evictable / cached-free bytes under the budget with the
forward/backward/optimizer bands, fragmentation (largest free block, total
free, 1 - largest/free), markers for evictions, remats, segment events and
OOMs, the address map at a cursor with the tensors alive there, an address x
time map, runs side by side, and overhead-against-budget curves. The page
loads nothing: no CDN, no fonts, no requests. In a notebook the returned
object displays inline.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .result import DEFAULT_BUDGETS, DEFAULT_POLICIES, SWEEP_FRACTIONS, Dashboard

__all__ = ["DEFAULT_BUDGETS", "DEFAULT_POLICIES", "SWEEP_FRACTIONS", "Dashboard", "dashboard"]


def dashboard(*inputs, budgets: Optional[Sequence] = None, policies: Optional[Sequence[str]] = None,
              conf=None, sweep: bool = True, min_budget: bool = True, trace=None,
              title: Optional[str] = None) -> Dashboard:
    """Build a dashboard page.

    Each input is one of:
      * a trace (``dtralloc.trace.Trace``, a ``.dtrace`` path or a bundled
        trace name): replayed with no budget, and under every policy x budget
        (default: ``dtralloc`` at 0.5 of the no-eviction peak);
      * a memory snapshot: the dict of ``torch.cuda.memory._snapshot()`` or
        ``dtralloc.snapshot()``, or the pickle ``_dump_snapshot`` writes;
      * a ``dtralloc.Pool`` (its segments and event history now);
      * a replay result from ``dtralloc.replay(trace, ..., history=True)``
        (pass ``trace=`` for op names and phases);
      * a ``dtralloc.dtr()`` session (finished or not): its per-op series
        with phases and op names, its evictions and remats, and its pool's
        history for the address views (``dtr(..., history=True)`` on CPU);
      * nothing: the process-wide allocators (``dtralloc.snapshot()``).

    ``budgets``: fractions of the no-eviction peak (0.5), bytes (6 << 30),
    sizes ("6G") or None (no budget); the command line's "0.5,6G,none" is
    parsed by the command. ``sweep``: also replay each policy on a
    budget grid for the overhead curves. ``min_budget``: find each policy's
    smallest feasible budget (a bisection of replays).
    """
    from .build import build

    return build(list(inputs), budgets=budgets, policies=policies, conf=conf, sweep=sweep,
                 min_budget=min_budget, trace=trace, title=title)
