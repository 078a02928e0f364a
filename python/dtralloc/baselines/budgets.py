"""The smallest budget at which each static method gives a feasible plan."""
from __future__ import annotations

from ..trace import Trace
from .checkmate import _checkmate_lower_bound, checkmate
from .grouped import _graph
from .result import METHODS
from .simple_plans import checkpoint_sqrt_n


def min_feasible_budget(trace: Trace, method: str, tol: float = 0.01,
                        time_limit_s: float = 60.0, **kw) -> dict:
    """Smallest budget, as a fraction of the no-eviction live-byte peak, at which
    ``method`` gives a feasible plan.

    * ``no_eviction``: 1.0.
    * ``checkpoint_sqrt_n``: the plan's peak is fixed, so exactly its peak / the
      no-eviction peak.
    * ``checkmate``: first the simple lower bound of :func:`checkmate`, then
      bisection in bytes between it and the no-eviction peak, to within ``tol``
      of the peak; a solve that ends without a plan counts as infeasible
      (``exact`` is then False and the answer is an upper bound). ``lower`` /
      ``upper`` bracket the answer (infeasible at ``lower``, feasible at ``upper``).

    Returns ``{"method", "fraction", "bytes", "exact", "lower", "upper", "solves"}``.
    """
    g = _graph(trace)
    base_peak = g.simulate(g.original(), trace_frees=True)
    if method == "no_eviction":
        return {"method": method, "fraction": 1.0, "bytes": base_peak, "exact": True,
                "lower": 1.0, "upper": 1.0, "solves": []}
    if method == "checkpoint_sqrt_n":
        r = checkpoint_sqrt_n(trace, **kw)
        f = r.peak_bytes / base_peak
        return {"method": method, "fraction": f, "bytes": r.peak_bytes, "exact": True,
                "lower": f, "upper": f, "solves": []}
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
            return {"method": method, "fraction": None, "bytes": None, "exact": False,
                    "lower": lo_b / base_peak, "upper": 1.0, "solves": solves, "status": "too large"}
        if r.feasible:
            hi_b = mid_b
        else:
            exact = exact and r.feasible is not None
            lo_b = mid_b
        mid_b = (lo_b + hi_b) // 2
    return {"method": method, "fraction": hi_b / base_peak, "bytes": hi_b, "exact": exact,
            "lower": lo_b / base_peak, "upper": hi_b / base_peak, "solves": solves}
