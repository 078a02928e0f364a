"""Replay a trace's memory traffic through the real pool on the virtual backend.

``dtralloc.replay(trace, budget=None, policy="none", conf=None)`` first
allocates the storages alive at the start of the step, then replays every
allocation and free in order through the same C++ pool that serves torch,
with addresses only (an 80 GB device fits on a laptop). It answers "how would
this step fragment, and how much memory does it really need?".

The rooms: ``run`` (replay, min_feasible_budget, feasible_budgets, overhead_grid, resident_floor, and the
trace as the driver's columns), ``result`` (ReplayResult, a C++ class whose
figures allocator/replay_driver.h declares once; the policy table; the text
tables).
"""
from __future__ import annotations

from .result import POLICIES, POLICY_TABLE, ReplayResult, format_policies_markdown, format_results, table_row
from .run import (feasibility_holes, feasible_budgets, min_feasible_budget, overhead_grid, replay, replay_columns,
                  resident_floor)

__all__ = ["POLICIES", "POLICY_TABLE", "ReplayResult", "feasibility_holes", "feasible_budgets",
           "format_policies_markdown", "format_results", "min_feasible_budget", "overhead_grid", "replay",
           "replay_columns", "resident_floor", "table_row"]
