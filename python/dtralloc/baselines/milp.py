"""Checkmate's MILP (Jain et al. 2020, section 4) on a grouped step, in scipy's sparse form,
and its solve by HiGHS. The formulation is written out in docs/baselines.md."""
from __future__ import annotations

import time
from dataclasses import dataclass

from .grouped import _Graph
from .result import BaselineResult


def _initial_bytes_per_stage(g: _Graph) -> list:
    G = len(g.groups)
    diff = [0] * (G + 1)
    for s in range(len(g.nbytes)):
        if g.initial[s] and g.trace_free[s] >= 0:
            diff[0] += g.nbytes[s]
            if g.trace_free[s] < G:
                diff[g.trace_free[s] + 1] -= g.nbytes[s]
    out, cur = [], 0
    for t in range(G):
        cur += diff[t]
        out.append(cur)
    return out


class _Milp:
    """A MILP in scipy's sparse form, built column by column and row by row."""

    def __init__(self):
        self.cost, self.integer, self.lo, self.hi = [], [], [], []
        self.rows, self.cols, self.vals, self.rlo, self.rhi = [], [], [], [], []
        self.nrow = 0

    def var(self, cost: float = 0.0, integer: bool = True, lb: float = 0.0, ub: float = 1.0) -> int:
        self.cost.append(cost)
        self.integer.append(1 if integer else 0)
        self.lo.append(lb)
        self.hi.append(ub)
        return len(self.cost) - 1

    def row(self, terms, lb: float, ub: float) -> None:
        for c, v in terms:
            self.rows.append(self.nrow)
            self.cols.append(c)
            self.vals.append(v)
        self.rlo.append(lb)
        self.rhi.append(ub)
        self.nrow += 1

    def solve(self, time_limit_s: float, gap: float, relax: bool):
        """scipy's HiGHS on the model; ``relax``: the LP relaxation (no integrality)."""
        try:
            import numpy as np
            from scipy.optimize import Bounds, LinearConstraint, milp
            from scipy.sparse import coo_matrix
        except ImportError as e:
            raise ImportError("the Checkmate baseline solves a MILP with scipy's HiGHS: "
                              "pip install 'dtralloc[baselines]' (or scipy>=1.9)") from e
        n = len(self.cost)
        A = coo_matrix((self.vals, (self.rows, self.cols)), shape=(self.nrow, n)).tocsr()
        integrality = np.zeros(n) if relax else np.array(self.integer)
        options = {"time_limit": float(time_limit_s), "presolve": True}
        if not relax:
            options["mip_rel_gap"] = gap
        return milp(np.array(self.cost), constraints=LinearConstraint(A, np.array(self.rlo), np.array(self.rhi)),
                    integrality=integrality, bounds=Bounds(np.array(self.lo), np.array(self.hi)),
                    options=options)


@dataclass
class _CheckmateModel:
    milp: _Milp
    R: dict      # (stage t, group j) -> column of R[t,j], j < t
    S: dict      # (stage t, storage s) -> column of S[t,s]
    n_free: int  # FREE columns
    pinned: int  # storages whose S is a constant over their must-keep range


def _checkmate_model(g: _Graph, budget: int) -> _CheckmateModel:
    """Checkmate's MILP for ``g`` under ``budget`` bytes (formulation: docs/baselines.md).

    Only columns that can be nonzero in some plan are created; every pruning
    below keeps the feasible set of plans and the optimum exactly:

    * ``R[t,j]``: j recomputable, j < t <= min(deadline, last stage that may
      read one of j's outputs), and every input of j can be in memory at t
      (kept there, pinned, or itself recomputable at t).
    * ``S[t,s]``: from the stage after s is created to the last stage that
      may read it (an original read, or a recomputation that is itself
      useful then). A storage of a group that cannot be recomputed is in
      memory from its creation to its last original read in every plan (the
      dependency and keep constraints force it), so there S is the constant 1,
      folded into the stage's resident bytes; only the optional tail (kept
      longer for later recomputations) has columns.
    """
    groups, nb = g.groups, g.nbytes
    G = len(groups)
    init_at = _initial_bytes_per_stage(g)
    live = [s for s in range(len(nb)) if not g.initial[s] and nb[s] > 0]
    readers_orig: dict[int, list] = {}
    readers_rc: dict[int, list] = {}
    for j, grp in enumerate(groups):
        for s in grp.reads:
            readers_orig.setdefault(s, []).append(j)
        if grp.recomputable:
            for s in grp.recompute_reads:
                readers_rc.setdefault(s, []).append(j)
    # last_orig: last stage whose original group reads s (G: s outlives the step);
    # last_need: that, or the last stage at which a recomputation reading s is
    # useful (r_last). Readers come after producers: fill from the back.
    last_orig: dict[int, int] = {}
    last_need: dict[int, int] = {}
    r_last: dict[int, int] = {}
    created_live: list = [[s for s in grp.created if not g.initial[s] and nb[s] > 0] for grp in groups]
    for j in range(G - 1, -1, -1):
        for s in created_live[j]:
            lo_ = G if g.outlives[s] else max(readers_orig.get(s, [-1]))
            last_orig[s] = lo_
            last_need[s] = max([lo_] + [r_last[k] for k in readers_rc.get(s, []) if k in r_last])
        if groups[j].recomputable:
            useful = max((last_need[s] for s in created_live[j]), default=-1)
            last = min(groups[j].deadline, useful, G - 1)
            if last > j:
                r_last[j] = last
    pinned = {s for s in live if g.producer[s] >= 0 and not groups[g.producer[s]].recomputable}
    pinned_at = [0] * (G + 1)  # bytes of pinned storages entering each stage
    for s in pinned:
        p = g.producer[s]
        for t in range(p + 1, min(last_orig[s], G - 1) + 1):
            pinned_at[t] += nb[s]

    def kept(t: int, s: int) -> bool:  # S[t,s] is the constant 1
        return s in pinned and g.producer[s] < t <= last_orig[s]

    m = _Milp()
    base = g.baseline_compute or 1.0
    S = {}
    for s in live:
        first = g.producer[s] + 1
        if s in pinned:
            first = max(first, last_orig[s] + 1)
        for t in range(first, last_need[s] + 1):
            S[t, s] = m.var()

    def available(t: int, s: int) -> bool:
        return g.initial[s] or nb[s] == 0 or kept(t, s) or (t, s) in S or (t, g.producer[s]) in R

    R = {}
    runs_at: list = [[] for _ in range(G)]
    for t in range(1, G):
        for j in range(t):
            if r_last.get(j, -1) >= t and all(available(t, s) for s in groups[j].recompute_reads):
                R[t, j] = m.var(groups[j].recompute_cost / base)
                runs_at[t].append(j)
    inf = float("inf")
    # outliving storages are in memory after the last stage
    for s in live:
        if g.outlives[s] and (G, s) in S:
            m.lo[S[G, s]] = 1.0
    # keep only what exists: S[t+1,s] <= S[t,s] + R[t,p]
    for (t, s), v in S.items():
        if (t - 1, s) not in S:
            continue  # t is the stage after s's creation, or S[t-1,s] is the constant 1
        terms = [(v, 1.0), (S[t - 1, s], -1.0)]
        if (t - 1, g.producer[s]) in R:
            terms.append((R[t - 1, g.producer[s]], -1.0))
        m.row(terms, -inf, 0.0)
    # dependencies: every read finds its storage kept or recomputed in the stage
    for t in range(G):
        for j in runs_at[t] + [t]:
            for s in (groups[j].reads if j == t else groups[j].recompute_reads):
                if g.initial[s] or nb[s] == 0 or kept(t, s):
                    continue
                terms = []
                if (t, s) in S:
                    terms.append((S[t, s], 1.0))
                if (t, g.producer[s]) in R:
                    terms.append((R[t, g.producer[s]], 1.0))
                if j == t:
                    m.row(terms, 1.0, inf)
                else:
                    m.row(terms + [(R[t, j], -1.0)], 0.0, inf)
    # memory, in units of the budget
    scale = 1.0 / budget
    n_free = 0
    S_at: list = [[] for _ in range(G + 1)]
    for (t, s), v in S.items():
        S_at[t].append((v, s))
    for t in range(G):
        reads_t = groups[t].reads
        resident = (init_at[t] + pinned_at[t]) * scale
        u_prev = m.var(integer=False, lb=0.0, ub=inf)  # U entering the stage
        m.row([(u_prev, 1.0)] + [(v, -nb[s] * scale) for v, s in S_at[t]], resident, resident)
        frees_prev = []
        for j in runs_at[t] + [t]:
            u = m.var(integer=False, lb=0.0, ub=1.0)  # U <= budget
            terms = [(u, 1.0), (u_prev, -1.0)] + [(c, nb[s] * scale) for c, s in frees_prev]
            if j == t:
                m.row(terms, groups[t].nbytes * scale, groups[t].nbytes * scale)
                break
            m.row(terms + [(R[t, j], -groups[j].nbytes * scale)], 0.0, 0.0)
            u_prev = u
            frees_prev = []
            for s in groups[j].recompute_reads:
                if g.initial[s] or nb[s] == 0 or s in reads_t or kept(t + 1, s):
                    continue
                f = m.var()
                n_free += 1
                m.row([(f, 1.0), (R[t, j], -1.0)], -inf, 0.0)
                for j2 in runs_at[t]:
                    if j2 > j and s in groups[j2].recompute_reads:
                        m.row([(f, 1.0), (R[t, j2], 1.0)], -inf, 1.0)
                if (t + 1, s) in S:
                    m.row([(f, 1.0), (S[t + 1, s], 1.0)], -inf, 1.0)
                frees_prev.append((f, s))
    return _CheckmateModel(m, R, S, n_free, len(pinned))


def _build_and_solve(g, budget: int, time_limit_s: float, gap: float, relax: bool,
                     res: BaselineResult):
    """Build Checkmate's model of ``g`` (a graph or a contracted one), solve it
    (its LP relaxation when ``relax``), and record the model's size and the
    solve in ``res``. Returns the model and scipy's result."""
    model = _checkmate_model(g, budget)
    m = model.milp
    res.details.update(variables=len(m.cost), constraints=m.nrow, r_vars=len(model.R),
                       s_vars=len(model.S), free_vars=model.n_free, pinned_storages=model.pinned)
    t0 = time.perf_counter()
    sol = m.solve(time_limit_s, gap, relax=relax)
    res.solve_seconds = time.perf_counter() - t0
    res.details["solved"] = True
    res.details["milp_message"] = sol.message
    return model, sol
