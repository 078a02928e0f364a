"""Fragmentation dashboards: one self-contained HTML page per run or snapshot.

``dtralloc.dashboard(x)`` (and ``dtralloc dashboard INPUT... -o report.html``)
draws, for a trace replayed under budgets and policies or for a memory
snapshot (torch's or dtralloc's): the headline figures, a timeline of
allocated / evictable / cached-free bytes under the budget with the
forward/backward/optimizer bands, fragmentation (largest free block, total
free, 1 - largest/free), markers for evictions, remats, segment events and
OOMs, the address map at a cursor with the tensors alive there, an address x
time map, runs side by side, and overhead-against-budget curves. The page
loads nothing: no CDN, no fonts, no requests. In a notebook the returned
object displays inline.
"""
from __future__ import annotations

import html as _html
import os
from typing import Optional, Sequence, Union

# Budgets every policy is replayed at for the overhead-vs-budget curves (on
# top of the runs' own): a 0.1 grid is what the policy tables in bench/ use,
# and replays of the bundled traces take milliseconds each.
SWEEP_FRACTIONS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DEFAULT_POLICIES = ("dtralloc",)
DEFAULT_BUDGETS = (0.5,)


class Dashboard:
    """A built page. ``save(path)`` writes it; in Jupyter it displays inline."""

    def __init__(self, html: str, runs: list, facts: dict):
        self.html = html
        self.runs = runs        # the runs' figures, as the page's data-run elements hold them
        self.facts = facts      # sizes: raw column bytes, blobs

    def save(self, path: Union[str, os.PathLike]) -> str:
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)
        return path

    def _repr_html_(self) -> str:
        # An iframe keeps the page's script and styles apart from the notebook's.
        return (f'<iframe srcdoc="{_html.escape(self.html, quote=True)}" sandbox="allow-scripts" '
                'style="width:100%;height:1100px;border:1px solid #ddd"></iframe>')

    def __repr__(self) -> str:
        return f"<dtralloc.Dashboard: {len(self.runs)} runs, {len(self.html) / 2**20:.2f} MiB>"


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
      * nothing: the process-wide allocators (``dtralloc.snapshot()``).

    ``budgets``: fractions of the no-eviction peak (0.5), bytes (6 << 30),
    sizes ("6G") or None (no budget). ``sweep``: also replay each policy on a
    budget grid for the overhead curves. ``min_budget``: find each policy's
    smallest feasible budget (a bisection of replays).
    """
    from .build import build

    return build(list(inputs), budgets=budgets, policies=policies, conf=conf, sweep=sweep,
                 min_budget=min_budget, trace=trace, title=title)
