"""What a static baseline reports (BaselineResult), and the budget argument every plan takes.

Every memory figure here is **live bytes** (each storage rounded up to 512 B),
never the pool's reserved bytes, and a fractional budget is a share of
``BaselineResult.live_peak_bytes``: the live-byte peak of the trace as
recorded. (``dtralloc.replay``'s fractions are of its no-eviction peak
*reserved*, ``DTRALLOC_CONF=budget:0.5`` is half the device: three references,
so a result always carries ``budget_bytes``.)
"""
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
    budget_bytes: int | None           # the budget in bytes, a fraction resolved; None: no budget
    peak_bytes: int | None             # live-byte peak of this plan (512 B rounding per storage)
    compute_overhead: float | None     # recomputed cost / baseline_compute (lp_bound: a bound)
    baseline_compute: float            # sum of op costs (duration_ns if > 0, else flops)
    recompute_ops: int | None          # trace ops re-executed by the plan
    live_peak_bytes: int = 0           # live-byte peak of the trace as recorded (no eviction, the
                                       # trace's frees): 1.0 of every fractional budget here
    status: str = "ok"                 # checkmate: see checkmate() for each mode's statuses
    solve_seconds: float = 0.0         # checkmate: wall time of the HiGHS solve
    name: str = ""                     # trace name
    details: dict = field(default_factory=dict)

    @property
    def peak_fraction(self) -> float | None:
        """peak_bytes / live_peak_bytes: this plan's peak as a share of the recorded one."""
        if self.peak_bytes is None or not self.live_peak_bytes:
            return None
        return self.peak_bytes / self.live_peak_bytes


def _resolve_budget(budget, live_peak_bytes: int) -> int | None:
    """``budget`` in bytes: an int is bytes, a float a share of ``live_peak_bytes``."""
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise TypeError("budget must be None, bytes (int) or a share of the live-byte peak (float), "
                        "not a bool")
    if isinstance(budget, float):
        if not budget > 0 or math.isnan(budget) or math.isinf(budget):
            raise ValueError(f"a fractional budget must be positive (a share of the live-byte peak of the "
                             f"trace as recorded, result.live_peak_bytes); got {budget}")
        return max(1, int(budget * live_peak_bytes))
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        return budget
    raise TypeError(f"budget must be None, int or float, not {type(budget).__name__}")


def _name(trace: Trace) -> str:
    return str(trace.meta.get("name", ""))
