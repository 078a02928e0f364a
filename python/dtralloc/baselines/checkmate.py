"""checkmate(): the optimal static plan under a budget from Checkmate's MILP, or a
labelled bound on it (LP relaxation below, contracted graph above) where the
graph is too large to solve exactly."""
from __future__ import annotations

from ..trace import Trace
from .contraction import _contract_runs, _Contracted
from .grouped import _Graph, _graph
from .milp import _build_and_solve, _initial_bytes_per_stage
from .result import BaselineResult, _name, _resolve_budget


CHECKMATE_MODES = ("exact", "lp_bound", "restricted")


# Default group limits. 200: the exact MILP of unet (140 groups) solves in under
# a minute on 2 cores, resnet50's (360) finds no plan in 120 s. 80: contracted
# bert/gpt2/llama solve at 0.9 and 0.7 of the peak in 20-90 s; at 200
# super-groups bert found no plan in 120 s.
MAX_GROUPS = {"exact": 200, "lp_bound": None, "restricted": 80}


def checkmate(trace: Trace, budget: int | float, time_limit_s: float = 60.0,
              max_groups: int | None = None, mip_rel_gap: float = 1e-4,
              mode: str = "exact") -> BaselineResult:
    """The optimal static rematerialization plan under ``budget`` (Checkmate's MILP),
    or, with ``mode``, a labelled bound on it for graphs too large to solve.

    ``budget``: bytes (int) or a share (float) of the live-byte peak of the
    trace as recorded (``result.live_peak_bytes``). The budget bounds live
    bytes (512 B rounding per storage), not allocator segments.
    ``time_limit_s`` bounds the HiGHS solve. ``max_groups`` defaults to
    ``MAX_GROUPS[mode]`` (200 exact, 80 restricted).

    ``mode="exact"`` (``method`` ``"checkmate"``): the MILP of the whole graph.
    ``status``: ``"optimal"``; ``"time limit"`` (the best plan found so far is
    reported, ``feasible`` is None when none was found); ``"infeasible"``
    (proved, or the budget is below a simple lower bound: resident initial
    storages plus what one stage must hold at once); ``"too large"`` (more
    than ``max_groups`` groups; nothing solved).

    ``mode="lp_bound"`` (``method`` ``"checkmate_lp_bound"``): the LP
    relaxation of the same MILP, on the whole graph (``max_groups`` does not
    apply). Not a plan: ``compute_overhead`` is a **lower bound** on the
    overhead of every static plan, ``peak_bytes``/``recompute_ops``/``feasible``
    are None. ``status``: ``"lower bound"``; ``"infeasible"`` (the relaxation
    is infeasible, so no static plan fits); ``"time limit"`` (no bound).

    ``mode="restricted"`` (``method`` ``"checkmate_restricted"``): the graph is
    contracted to at most ``max_groups`` super-groups (runs of consecutive
    groups kept, dropped and recomputed as a unit, memory counted
    conservatively; see :class:`_Contracted`) and that MILP is solved. The plan
    is expanded and replayed through the simulator, so ``peak_bytes`` and
    ``compute_overhead`` are those of a real plan: an **upper bound** on the
    static optimum. ``status``: ``"restricted optimal"`` (optimal among
    contracted plans), ``"restricted time limit"``, ``"restricted infeasible"``
    (no contracted plan fits; says nothing about other plans). When the graph
    has at most ``max_groups`` groups nothing is contracted and the statuses are
    the exact ones. ``details["contracted_groups"]`` is the super-group count.
    """
    if mode not in CHECKMATE_MODES:
        raise ValueError(f"unknown checkmate mode {mode!r}; use one of {', '.join(CHECKMATE_MODES)} "
                         "('exact' solves the MILP, 'lp_bound' its relaxation, 'restricted' "
                         "a contracted graph)")
    if max_groups is None:
        max_groups = MAX_GROUPS[mode] or 0
    elif isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 1:
        raise ValueError(f"max_groups must be a positive int (how many groups the MILP may have), "
                         f"got {max_groups!r}")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be positive seconds, got {time_limit_s!r}")
    g = _graph(trace)
    base_peak = g.simulate(g.original(), trace_frees=True)
    b = _resolve_budget(budget, base_peak)
    if b is None:
        raise ValueError("checkmate needs a budget: bytes (int) or a share (float) of the live-byte "
                         "peak of the trace as recorded")
    method = {"exact": "checkmate", "lp_bound": "checkmate_lp_bound",
              "restricted": "checkmate_restricted"}[mode]
    res = BaselineResult(method, None, b, None, None, g.baseline_compute, None, base_peak,
                         name=_name(trace), details={"groups": len(g.groups), "mode": mode})
    if mode == "exact" and len(g.groups) > max_groups:
        res.status = "too large"
        return res
    lb = _checkmate_lower_bound(g)
    res.details["lower_bound_bytes"] = lb
    if b < lb:
        res.feasible, res.status = False, "infeasible"
        res.details["infeasible_reason"] = "budget below the bytes one stage must hold"
        return res
    if b >= base_peak:  # the trace itself is a plan with no recomputation
        if mode == "lp_bound":
            res.status, res.compute_overhead = "lower bound", 0.0
            return res
        peak = g.simulate(g.original(), trace_frees=False)
        res.feasible, res.status = True, "optimal"
        res.peak_bytes, res.compute_overhead, res.recompute_ops = peak, 0.0, 0
        res.details["solved"] = False
        return res
    if mode == "lp_bound":
        return _solve_checkmate_lp(g, b, time_limit_s, res)
    if mode == "restricted" and len(g.groups) > max_groups:
        return _solve_checkmate_restricted(g, b, time_limit_s, max_groups, mip_rel_gap, res)
    return _solve_checkmate(g, b, time_limit_s, mip_rel_gap, res)


def _solve_checkmate_lp(g: _Graph, budget: int, time_limit_s: float,
                        res: BaselineResult) -> BaselineResult:
    res.details["bound"] = "lower: LP relaxation of the exact MILP, not a plan"
    _, sol = _build_and_solve(g, budget, time_limit_s, 0.0, True, res)
    if sol.status == 2:
        res.feasible, res.status = False, "infeasible"
    elif sol.status == 0:
        res.status, res.compute_overhead = "lower bound", max(0.0, float(sol.fun))
    else:
        res.status = "time limit" if sol.status == 1 else f"solver status {sol.status}"
    return res


def _solve_checkmate_restricted(g: _Graph, budget: int, time_limit_s: float, max_groups: int,
                                gap: float, res: BaselineResult) -> BaselineResult:
    cg = _Contracted(g, _contract_runs(g, max_groups))
    res.details.update(contracted_groups=len(cg.groups),
                       bound="upper: optimal among plans of the contracted graph")
    lb = _checkmate_lower_bound(cg)
    res.details["restricted_lower_bound_bytes"] = lb
    if budget < lb:
        res.feasible, res.status = None, "restricted infeasible"
        res.details["infeasible_reason"] = "budget below the bytes one contracted stage must hold"
        return res
    model, sol = _build_and_solve(cg, budget, time_limit_s, gap, False, res)
    if sol.status == 2:
        res.status = "restricted infeasible"
        return res
    if sol.x is None:
        res.status = "restricted time limit" if sol.status == 1 else f"solver status {sol.status}"
        return res
    res.status = "restricted optimal" if sol.status == 0 else "restricted time limit"
    return _replay_plan(g, cg.expand(_schedule(len(cg.groups), model.R, sol.x)), budget, res)


def _checkmate_lower_bound(g: _Graph) -> int:
    """Bytes every plan needs at some stage: resident initial storages, the group's
    outputs and its inputs, storages that cannot be recomputed and are still to be
    read (or outlive the step), and, after the last stage, the storages that outlive."""
    G = len(g.groups)
    init_at = _initial_bytes_per_stage(g)
    # storages that cannot be recomputed are in memory from their creation to their last read
    pinned = [0] * (G + 2)
    last_read = {}
    for j, grp in enumerate(g.groups):
        for s in grp.reads:
            last_read[s] = j
    for s in range(len(g.nbytes)):
        p = g.producer[s]
        if p < 0 or g.groups[p].recomputable or g.nbytes[s] == 0:
            continue
        end = G if g.outlives[s] else last_read.get(s, p)
        if end > p:  # present entering stages p+1 .. end
            pinned[p + 1] += g.nbytes[s]
            pinned[min(end, G) + 1] -= g.nbytes[s]
    lb = init_at[0] if G else g.initial_bytes
    cur = 0
    for t, grp in enumerate(g.groups):
        cur += pinned[t]
        need = init_at[t] + grp.nbytes + cur
        need += sum(g.nbytes[s] for s in grp.reads if not g.initial[s]
                    and not (g.producer[s] >= 0 and not g.groups[g.producer[s]].recomputable))
        lb = max(lb, need)
    end = sum(g.nbytes[s] for s in range(len(g.nbytes)) if g.outlives[s])
    return max(lb, end)


def _solve_checkmate(g: _Graph, budget: int, time_limit_s: float, gap: float,
                     res: BaselineResult) -> BaselineResult:
    model, sol = _build_and_solve(g, budget, time_limit_s, gap, False, res)
    if sol.status == 2:
        res.feasible, res.status = False, "infeasible"
        return res
    if sol.x is None:
        res.status = "time limit" if sol.status == 1 else f"solver status {sol.status}"
        return res
    res.status = "optimal" if sol.status == 0 else "time limit"
    if sol.status == 1:
        res.details["mip_gap"] = getattr(sol, "mip_gap", None)
        res.details["dual_bound_overhead"] = getattr(sol, "mip_dual_bound", None)
    return _replay_plan(g, _schedule(len(g.groups), model.R, sol.x), budget, res)


def _schedule(n_groups: int, R: dict, x) -> list:
    """The plan in solved R columns: each stage's recomputations, then the stage."""
    seq = []
    for t in range(n_groups):
        seq += [(j, False) for j in range(t) if (t, j) in R and x[R[t, j]] > 0.5]
        seq.append((t, True))
    return seq


def _replay_plan(g: _Graph, seq: list, budget: int, res: BaselineResult) -> BaselineResult:
    """A schedule as a plan measured by the simulator."""
    groups = g.groups
    recomputed = [j for j, orig in seq if not orig]
    res.peak_bytes = g.simulate(seq, trace_frees=False)
    res.compute_overhead = sum(groups[j].recompute_cost for j in recomputed) / (g.baseline_compute or 1.0)
    res.recompute_ops = sum(groups[j].recompute_nops for j in recomputed)
    res.feasible = res.peak_bytes <= budget
    res.details["recomputed_groups"] = len(recomputed)
    res.details["schedule"] = seq
    return res
