"""Replay a trace's memory traffic through the real pool on the virtual backend.

``dtralloc.replay(trace, budget=None, policy="none", conf=None)`` first
allocates the storages alive at the start of the step, then replays every
allocation and free in order through the same C++ pool that serves torch,
with addresses only (an 80 GB device fits on a laptop). It answers "how would
this step fragment, and how much memory does it really need?".

The rooms: ``run`` (replay, min_feasible_budget, resident_floor and the runs
behind them), ``result`` (ReplayResult, format_results).
"""
from __future__ import annotations

from .result import ReplayResult, format_results
from .run import POLICIES, min_feasible_budget, replay, resident_floor

__all__ = ["POLICIES", "ReplayResult", "format_results", "min_feasible_budget", "replay", "resident_floor"]
