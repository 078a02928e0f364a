"""The smallest budget at which each static method gives a feasible plan."""
from __future__ import annotations

from ..trace import Trace
from .checkmate import _checkmate_lower_bound, checkmate
from .grouped import _graph
from .result import METHODS
from .simple_plans import checkpoint_sqrt_n


def min_feasible_budget(trace: Trace, method: str, tol: float = 0.01,
                        time_limit_s: float = 60.0, **kw) -> dict:
    """Smallest budget at which ``method`` gives a feasible plan, as a share
    (``"fraction"``) of the live-byte peak of the trace as recorded
    (``"live_peak_bytes"``, as ``BaselineResult.live_peak_bytes``) and in bytes
    (``"budget_bytes"``).

    * ``no_eviction``: 1.0.
    * ``checkpoint_sqrt_n``: the plan's peak is fixed, so exactly its peak / the
      live-byte peak.
    * ``checkmate``: first the simple lower bound of :func:`checkmate`, then
      bisection in bytes between it and the live-byte peak, to within ``tol``
      of the peak; a solve that ends without a plan counts as infeasible
      (``exact`` is then False and the answer is an upper bound). ``lower`` /
      ``upper`` bracket the answer (infeasible at ``lower``, feasible at ``upper``).

    Returns ``{"method", "fraction", "budget_bytes", "live_peak_bytes", "exact",
    "lower", "upper", "solves"}`` (and ``"status": "too large"`` when the
    MILP is not solved).
    """
    g = _graph(trace)
    base_peak = g.simulate(g.original(), trace_frees=True)

    def answer(fraction, budget_bytes, exact, lower, upper, solves, **more) -> dict:
        return {"method": method, "fraction": fraction, "budget_bytes": budget_bytes,
                "live_peak_bytes": base_peak, "exact": exact, "lower": lower, "upper": upper,
                "solves": solves, **more}

    if method == "no_eviction":
        return answer(1.0, base_peak, True, 1.0, 1.0, [])
    if method == "checkpoint_sqrt_n":
        r = checkpoint_sqrt_n(trace, **kw)
        f = r.peak_bytes / base_peak
        return answer(f, r.peak_bytes, True, f, f, [])
    if method != "checkmate":
        raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")
    lo_b, hi_b = _checkmate_lower_bound(g) - 1, base_peak  # infeasible at lo_b, feasible at hi_b
    solves = []
    exact = True
    mid_b = lo_b + 1
    while hi_b - lo_b > max(1, tol * base_peak):
        r = checkmate(trace, mid_b, time_limit_s=time_limit_s, **kw)
        solves.append((mid_b / base_peak, r.status, r.solve_seconds))
        if r.status == "too large":
            return answer(None, None, False, lo_b / base_peak, 1.0, solves, status="too large")
        if r.feasible:
            hi_b = mid_b
        else:
            exact = exact and r.feasible is not None
            lo_b = mid_b
        mid_b = (lo_b + hi_b) // 2
    return answer(hi_b / base_peak, hi_b, exact, lo_b / base_peak, hi_b / base_peak, solves)
