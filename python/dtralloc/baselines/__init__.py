"""Static rematerialization baselines, measured on the same traces as the dynamic policies.

Three plans, each answering "what would this training step cost under a memory
budget if the whole schedule were fixed in advance?": :func:`no_eviction` (the
trace as recorded), :func:`checkpoint_sqrt_n` (Chen et al. 2016) and
:func:`checkmate` (the optimal static plan, Checkmate's MILP, Jain et al.
2020; on large graphs a labelled bound on it). :func:`first_eviction_packed`
is where a pool that never fragments would first evict; :func:`min_feasible_budget`
is each method's smallest feasible budget.

Memory here is **live bytes** (each storage rounded up to 512 B), not the
pool's reserved bytes: read docs/baselines.md (the accounting, the model of
the step, the MILP) before comparing with ``dtralloc.replay``.

The rooms: ``grouped`` (the grouped-step model), ``result``, ``simple_plans``
(no eviction, Chen), ``checkmate`` with ``milp`` and ``contraction``,
``packed``, ``budgets``, ``trace_cuts``.
"""
from __future__ import annotations

from .budgets import min_feasible_budget
from .checkmate import CHECKMATE_MODES, MAX_GROUPS, checkmate
from .grouped import BLOCK
from .packed import PackedEviction, first_eviction_packed
from .result import METHODS, BaselineResult
from .simple_plans import checkpoint_sqrt_n, no_eviction
from .trace_cuts import without_optimizer

__all__ = ["BLOCK", "CHECKMATE_MODES", "MAX_GROUPS", "METHODS", "BaselineResult", "PackedEviction",
           "checkmate", "checkpoint_sqrt_n", "first_eviction_packed", "min_feasible_budget",
           "no_eviction", "without_optimizer"]
