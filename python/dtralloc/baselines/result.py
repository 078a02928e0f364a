"""What a static baseline reports (BaselineResult), and the budget argument every plan takes."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..trace import Trace

METHODS = ("no_eviction", "checkpoint_sqrt_n", "checkmate")


@dataclass
class BaselineResult:
    """One static plan for one (trace, budget). Memory is live bytes (docs/baselines.md)."""

    method: str                        # no_eviction | checkpoint_sqrt_n | checkmate
                                       # | checkmate_lp_bound | checkmate_restricted
    feasible: bool | None              # None: unknown (too large, solver gave up, or a bound)
    budget_bytes: int | None           # None: no budget
    peak_bytes: int | None             # live-byte peak of the plan (512 B rounding per storage)
    compute_overhead: float | None     # recomputed cost / baseline_compute (lp_bound: a bound)
    baseline_compute: float            # sum of op costs (duration_ns if > 0, else flops)
    recompute_ops: int | None          # trace ops re-executed by the plan
    baseline_peak_bytes: int = 0       # no-eviction live-byte peak (trace frees)
    status: str = "ok"                 # checkmate: see checkmate() for each mode's statuses
    solve_seconds: float = 0.0         # checkmate: wall time of the HiGHS solve
    name: str = ""                     # trace name
    details: dict = field(default_factory=dict)

    @property
    def peak_fraction(self) -> float | None:
        """peak_bytes / baseline_peak_bytes."""
        if self.peak_bytes is None or not self.baseline_peak_bytes:
            return None
        return self.peak_bytes / self.baseline_peak_bytes


def _resolve_budget(budget, baseline_peak: int) -> int | None:
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise TypeError("budget must be None, bytes (int) or a fraction (float), not a bool")
    if isinstance(budget, float):
        if not budget > 0 or math.isnan(budget) or math.isinf(budget):
            raise ValueError(f"a fractional budget must be positive (a share of the no-eviction peak); got {budget}")
        return max(1, int(budget * baseline_peak))
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        return budget
    raise TypeError(f"budget must be None, int or float, not {type(budget).__name__}")


def _name(trace: Trace) -> str:
    return str(trace.meta.get("name", ""))
