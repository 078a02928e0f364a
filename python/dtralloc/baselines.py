"""Static rematerialization baselines, measured on the same traces as the dynamic policies.

Three plans, each answering "what would this training step cost under a memory
budget if the whole schedule were fixed in advance?":

* :func:`no_eviction` -- the trace as recorded; its peak is the reference
  every fractional budget is a share of.
* :func:`checkpoint_sqrt_n` -- Chen et al. 2016: cut the forward pass into
  about sqrt(n) segments, keep only what crosses segment boundaries, recompute
  a segment once when the backward pass first needs something inside it.
* :func:`checkmate` -- the optimal static plan under a budget, from a MILP in
  the formulation of Checkmate (Jain et al. 2020), solved by HiGHS through
  ``scipy.optimize.milp``; the lower bound on compute overhead among static
  plans, on graphs small enough to solve.

:func:`min_feasible_budget` gives, per method, the smallest budget (a fraction
of the no-eviction peak) at which the plan fits.

Memory accounting (read this before comparing with ``dtralloc.replay``)
-----------------------------------------------------------------------
The static baselines count **live bytes, not allocator segments**: memory at a
point of the schedule is the sum of the sizes of the live storages, each
rounded up to 512 B (the pool's smallest block), sampled right after each op
has allocated its outputs and before anything is freed -- the same instant the
replay samples the pool. There is no fragmentation, no caching and no segment
rounding here; a budget that a static plan meets may still OOM in the real
pool. ``peak_bytes`` of every result is this live-byte peak.

Model of the step
-----------------
* **Groups.** Ops that create no storage (views, ``detach``, in-place ops,
  ``_local_scalar_dense``, the optimizer's ``_foreach_*_``) are contracted
  into the group of the nearest preceding op that creates storages. A group
  allocates only at its start, so per-op live bytes peak where they did in the
  trace, and the no-eviction peak of the grouped step equals the trace's. Every
  plan below is a sequence of group executions: each group once in trace order,
  plus recomputations.
* **Cost.** An op costs ``duration_ns`` when it was measured (> 0), else its
  ``flops``. The baseline compute is the sum over all ops. Recomputing a group
  re-runs its leading (allocating) op and the in-place ops of the group that
  write its own outputs (the dropout mask's ``bernoulli_`` / ``div_``, an
  in-place ``relu_``); views and scalar reads are not re-run. ``compute_overhead``
  is the recomputed cost divided by the baseline compute.
* **Initial storages** (parameters, optimizer state, inputs) are resident from
  the start to their free in the trace (the end for those that outlive the
  step) and are never dropped or recomputed.
* **Freeing.** The plans free a non-initial storage right after its last read
  in the plan (at the end for storages that outlive the step). A static plan
  knows the whole schedule, so dropping a storage that is not read again costs
  nothing; storages the trace keeps alive past their last read (autograd's
  references) are therefore freed earlier by every plan than by the trace.
  ``no_eviction`` follows the trace's frees; its ``details["last_use_peak_bytes"]``
  is the peak of the same schedule with frees at last use.
* **What is never recomputed** (kept from creation to its last use instead):
  the outputs of a group that

  - contains a random op (``bernoulli_``, ``dropout``, ...): recomputing it
    would draw new numbers;
  - writes in place to a storage it did not create (batch norm's running
    statistics, gradient accumulation, the optimizer): recomputing it would
    apply the update twice;
  - creates a storage that a later group writes in place: the recomputed value
    would be the pre-update one;
  - allocates nothing but 0-byte storages.

  A recomputable group may also be recomputed only until the first later group
  that writes in place to one of the storages it reads (after that its inputs
  hold other values); this is its *deadline*. 0-byte storages carry no memory
  and are treated as always available.
* The unit of keeping and dropping is the storage; the unit of recomputation is
  the group (a group with several outputs recomputes all of them).

Checkmate's MILP (Jain et al. 2020, section 4), on groups t = 0..T-1
---------------------------------------------------------------------
Stage t runs any earlier groups chosen for recomputation, in order, then group
t itself. Binary ``R[t,j]`` (recompute group j in stage t; ``R[t,t] = 1``),
binary ``S[t,s]`` (storage s is in memory entering stage t), binary
``FREE[t,s,j]`` (free s right after group j of stage t), continuous ``U``:

* minimise  sum_{t, j<t} C_j R[t,j]
* dependencies: ``R[t,j] <= R[t,p(s)] + S[t,s]`` for each storage s read by j
  (``1 <= ...`` for j = t);
* keep only what exists: ``S[t+1,s] <= S[t,s] + R[t,p(s)]``;
  storages that outlive the step are in memory after the last stage;
* memory, exactly the paper's accounting with frees inside a stage: entering
  stage t, ``U = init_t + sum_s M_s S[t,s]``; after each group j of the stage
  ``U += M_j R[t,j]`` and ``U <= budget``; then ``U -= sum_s M_s FREE[t,s,j]``.
  ``FREE[t,s,j] <= R[t,j]``, ``<= 1 - R[t,j']`` for every later reader j' of s
  in the stage (so j is its last reader there), ``<= 1 - S[t+1,s]``, and 0 when
  group t itself reads s. FREE only lowers U, so the solver sets it whenever
  freeing is allowed; a storage counted twice (kept and recomputed) is freed
  once, which over-counts and stays sound.

Only variables that can matter are created (``R[t,j]`` for recomputable j up to
its deadline and the last stage that may read its outputs; ``S[t,s]`` up to the
last stage that may read s). The solved plan is replayed through the same
schedule simulator as Chen's, which checks that every read finds its storage
and gives ``peak_bytes``. Graphs with more than ``max_groups`` groups are not
solved (status ``"too large"``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from .trace import Trace

BLOCK = 512  # bytes; every live storage is counted rounded up to this

METHODS = ("no_eviction", "checkpoint_sqrt_n", "checkmate")


@dataclass
class BaselineResult:
    """One static plan for one (trace, budget). Memory is live bytes (see module doc)."""

    method: str                        # "no_eviction" | "checkpoint_sqrt_n" | "checkmate"
    feasible: Optional[bool]           # None: unknown (graph too large, or solver gave up)
    budget_bytes: Optional[int]        # None: no budget
    peak_bytes: Optional[int]          # live-byte peak of the plan (512 B rounding per storage)
    compute_overhead: Optional[float]  # recomputed cost / baseline_compute
    baseline_compute: float            # sum of op costs (duration_ns if > 0, else flops)
    recompute_ops: Optional[int]       # trace ops re-executed by the plan
    baseline_peak_bytes: int = 0       # no-eviction live-byte peak (trace frees)
    status: str = "ok"                 # checkmate: optimal | time limit | infeasible | too large
    solve_seconds: float = 0.0         # checkmate: wall time of the MILP solve
    name: str = ""                     # trace name
    details: dict = field(default_factory=dict)

    @property
    def peak_fraction(self) -> Optional[float]:
        """peak_bytes / baseline_peak_bytes."""
        if self.peak_bytes is None or not self.baseline_peak_bytes:
            return None
        return self.peak_bytes / self.baseline_peak_bytes


# -- the grouped step ----------------------------------------------------------------

def _round(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK if nbytes > 0 else 0


def _op_cost(op) -> float:
    return float(op.duration_ns if op.duration_ns > 0 else op.flops)


@dataclass
class _Group:
    ops: list                     # trace op indices; ops[0] allocates (except a leading group)
    created: list                 # storages allocated by ops[0]
    reads: set                    # storages read by any op of the group (inputs and mutated), not own
    recompute_reads: set          # the same, for the ops re-run by a recomputation
    cost: float                   # all ops
    recompute_cost: float         # ops re-run by a recomputation
    recompute_nops: int
    recomputable: bool = True
    deadline: int = 0             # last stage at which it may be recomputed
    forward: bool = True          # no op of the group ran in autograd's backward
    nbytes: int = 0               # rounded bytes of created


class _Graph:
    """A trace as groups of ops, with the facts every plan needs."""

    def __init__(self, trace: Trace):
        self.trace = trace
        st = trace.storages
        self.nbytes = [_round(s.nbytes) for s in st]
        self.initial = [s.initial for s in st]
        self.outlives = [s.outlives for s in st]
        groups: list[_Group] = []
        group_of_op = []
        for i, op in enumerate(trace.ops):
            if op.created or not groups:
                groups.append(_Group([i], list(op.created), set(), set(), 0.0, 0.0, 0))
            else:
                groups[-1].ops.append(i)
            group_of_op.append(len(groups) - 1)
        self.groups = groups
        self.group_of_op = group_of_op
        G = len(groups)
        self.producer = [-1] * len(st)  # group creating each storage; -1: initial
        for g, grp in enumerate(groups):
            for s in grp.created:
                self.producer[s] = g
        # Stage (group) after which the trace frees each storage; G: never (outlives).
        self.trace_free = [G] * len(st)
        for sid in trace.frees_before:
            self.trace_free[sid] = -1
        for i, op in enumerate(trace.ops):
            for sid in op.frees:
                self.trace_free[sid] = group_of_op[i]
        # Groups that write each storage in place.
        writers: dict[int, list[int]] = {}
        for g, grp in enumerate(groups):
            for i in grp.ops:
                for sid in trace.ops[i].mutated:
                    if not writers.get(sid) or writers[sid][-1] != g:
                        writers.setdefault(sid, []).append(g)
        self.first_phase_backward = next(
            (g for g, grp in enumerate(groups) if any(trace.ops[i].backward for i in grp.ops)), G)
        for g, grp in enumerate(groups):
            own = set(grp.created)
            leader = grp.ops[0]
            rerun = []
            for k, i in enumerate(grp.ops):
                op = trace.ops[i]
                grp.cost += _op_cost(op)
                reads = set(op.inputs) | set(op.mutated)
                grp.reads |= reads - own
                if (k == 0 and op.created) or (op.mutated and set(op.mutated) <= own):
                    rerun.append(i)
                    grp.recompute_reads |= reads - own
                if op.random:
                    grp.recomputable = False
                if not set(op.mutated) <= own:
                    grp.recomputable = False
            if not trace.ops[leader].created:
                grp.recomputable = False
            grp.recompute_cost = sum(_op_cost(trace.ops[i]) for i in rerun)
            grp.recompute_nops = len(rerun)
            grp.nbytes = sum(self.nbytes[s] for s in grp.created)
            if grp.nbytes == 0:
                grp.recomputable = False
            if any(w != g for s in grp.created for w in writers.get(s, [])):
                grp.recomputable = False
            grp.forward = g < self.first_phase_backward
            deadline = G - 1
            for s in grp.recompute_reads:
                later = [w for w in writers.get(s, []) if w > g]
                if later:
                    deadline = min(deadline, later[0])
                if self.initial[s]:
                    deadline = min(deadline, self.trace_free[s])
            grp.deadline = deadline
        self.baseline_compute = sum(grp.cost for grp in groups)
        self.initial_bytes = sum(self.nbytes[s] for s in range(len(st))
                                 if self.initial[s] and self.trace_free[s] >= 0)

    # -- schedules -------------------------------------------------------------------
    def simulate(self, seq: list, trace_frees: bool) -> int:
        """Live-byte peak of a schedule; raise ValueError if a read finds nothing.

        ``seq`` is a list of ``(group, original)``: each group appears exactly
        once with ``original=True``, in index order; recomputations
        (``original=False``) may appear anywhere after their original.
        ``trace_frees``: the final instance of each storage lives until its
        free in the trace (no_eviction); else it is freed after its last read.
        """
        groups, nb = self.groups, self.nbytes
        P = len(seq)
        pos_of_original = [0] * len(groups)
        for p, (g, orig) in enumerate(seq):
            if orig:
                pos_of_original[g] = p
        last_start: dict[int, int] = {}
        last_read: dict[int, int] = {}
        diff = [0] * (P + 3)

        def close(s: int, start: int, final: bool) -> None:
            end = last_read.get(s, start)
            if final:
                if self.outlives[s]:
                    end = P
                elif trace_frees or self.initial[s]:
                    f = self.trace_free[s]
                    end = max(end, pos_of_original[f] if 0 <= f < len(groups) else P)
            # alive at samples start+1 .. end+1 (sample p+1: right after group p)
            diff[start + 1] += nb[s]
            diff[end + 2] -= nb[s]

        for s in range(len(nb)):
            if self.initial[s] and self.trace_free[s] >= 0:
                last_start[s] = -1
        for p, (g, orig) in enumerate(seq):
            grp = groups[g]
            for s in (grp.reads if orig else grp.recompute_reads):
                if nb[s] == 0:
                    continue
                if s not in last_start:
                    raise ValueError(f"plan reads storage {s} (group {g}) while it is not in memory")
                last_read[s] = p
            for s in grp.created:
                if nb[s] == 0:
                    continue
                if s in last_start:
                    close(s, last_start[s], False)
                last_start[s] = p
                last_read.pop(s, None)
        for s, start in last_start.items():
            close(s, start, True)
        # diff index 0: before the first group; index p+1: right after group p ran.
        live = peak = 0
        for p in range(P + 1):
            live += diff[p]
            peak = max(peak, live)
        return peak

    def original(self) -> list:
        return [(g, True) for g in range(len(self.groups))]


_GRAPHS: dict = {}


def _graph(trace: Trace) -> _Graph:
    key = id(trace)
    hit = _GRAPHS.get(key)
    if hit is not None and hit.trace is trace:
        return hit
    if len(_GRAPHS) > 16:
        _GRAPHS.clear()
    g = _GRAPHS[key] = _Graph(trace)
    return g


def _resolve_budget(budget, baseline_peak: int) -> Optional[int]:
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


# -- no eviction ---------------------------------------------------------------------

def no_eviction(trace: Trace, budget: Union[None, float] = None) -> BaselineResult:
    """The trace as recorded: no recomputation, storages freed where the trace frees them.

    ``peak_bytes`` is the live-byte peak (512 B rounding per storage; not
    allocator segments). ``details["last_use_peak_bytes"]``: the same schedule
    with every non-initial storage freed after its last read.
    """
    g = _graph(trace)
    peak = g.simulate(g.original(), trace_frees=True)
    last_use = g.simulate(g.original(), trace_frees=False)
    b = _resolve_budget(budget, peak)
    return BaselineResult("no_eviction", True if b is None else peak <= b, b, peak, 0.0,
                          g.baseline_compute, 0, peak, name=_name(trace),
                          details={"last_use_peak_bytes": last_use, "groups": len(g.groups),
                                   "initial_bytes": g.initial_bytes})


# -- Chen et al.: sqrt(n) checkpointing ------------------------------------------------

def checkpoint_sqrt_n(trace: Trace, budget: Union[None, float] = None,
                      segments: Optional[int] = None) -> BaselineResult:
    """Chen et al. (2016) checkpointing: sqrt(n) forward segments, each recomputed once.

    The forward pass is the groups before the first op flagged ``backward``;
    ``n`` counts those that allocate. They are cut into ``segments`` (default
    ``round(sqrt(n))``) runs of near-equal count. Kept: storages read by a
    later segment's forward ops (the checkpoints) and everything that cannot be
    recomputed (see the module doc). Every other storage of a forward segment
    is freed after its last forward read; the first time anything after the
    forward pass reads one of them, the segment is recomputed (only the groups
    needed for its dropped storages that are read later, and what they need),
    once. The plan's live-byte peak is fixed; ``feasible`` says whether it fits
    ``budget`` (bytes, or a fraction of the no-eviction peak; None: always).
    """
    g = _graph(trace)
    base_peak = g.simulate(g.original(), trace_frees=True)
    fwd = [i for i in range(g.first_phase_backward) if g.groups[i].nbytes > 0]
    n = len(fwd)
    k = max(1, min(n, segments if segments is not None else round(math.sqrt(n)))) if n else 1
    seg_of = {}
    for idx, grp_i in enumerate(fwd):
        seg_of[grp_i] = idx * k // n
    # groups of the forward pass that allocate nothing get their predecessor's segment
    cur = 0
    for i in range(g.first_phase_backward):
        if i in seg_of:
            cur = seg_of[i]
        else:
            seg_of[i] = cur
    blocked: set = set()  # groups Chen may not recompute (deadline passed)
    while True:
        seq, recomputed = _chen_schedule(g, seg_of, blocked)
        bad = [j for (j, orig), pos_stage in zip(seq, _stages(seq)) if not orig and g.groups[j].deadline < pos_stage]
        if not bad:
            break
        blocked |= set(bad)
    peak = g.simulate(seq, trace_frees=False)
    cost = sum(g.groups[j].recompute_cost for j in recomputed)
    nops = sum(g.groups[j].recompute_nops for j in recomputed)
    b = _resolve_budget(budget, base_peak)
    return BaselineResult("checkpoint_sqrt_n", True if b is None else peak <= b, b, peak,
                          cost / g.baseline_compute if g.baseline_compute else 0.0,
                          g.baseline_compute, nops, base_peak, name=_name(trace),
                          details={"segments": k, "forward_groups": n,
                                   "recomputed_groups": len(recomputed)})


def _stages(seq: list) -> list:
    """For each entry of a schedule, the stage (original group) it runs in or before."""
    out, nxt = [0] * len(seq), 0
    for p in range(len(seq) - 1, -1, -1):
        g, orig = seq[p]
        if orig:
            nxt = g
        out[p] = nxt
    return out


def _chen_schedule(g: _Graph, seg_of: dict, blocked: set):
    groups, F = g.groups, g.first_phase_backward
    crossing = set()  # storages read by a later segment's forward groups: checkpoints
    for i in range(F):
        for s in groups[i].reads:
            p = g.producer[s]
            if p >= 0 and p < F and seg_of[p] != seg_of[i]:
                crossing.add(s)

    def dropped(s: int) -> bool:
        p = g.producer[s]
        return (0 <= p < F and groups[p].recomputable and p not in blocked
                and s not in crossing and g.nbytes[s] > 0 and not g.outlives[s])

    needed_later = set()
    for i in range(F, len(groups)):
        needed_later |= {s for s in groups[i].reads if dropped(s)}
    done: set = set()
    seq, recomputed = [], []
    for i in range(len(groups)):
        if i >= F:
            for seg in sorted({seg_of[g.producer[s]] for s in groups[i].reads if s in needed_later}):
                if seg in done:
                    continue
                done.add(seg)
                todo = {g.producer[s] for s in needed_later if seg_of[g.producer[s]] == seg}
                stack = list(todo)
                while stack:
                    j = stack.pop()
                    for s in groups[j].recompute_reads:
                        if dropped(s) and g.producer[s] not in todo:
                            todo.add(g.producer[s])
                            stack.append(g.producer[s])
                for j in sorted(todo):
                    seq.append((j, False))
                    recomputed.append(j)
        seq.append((i, True))
    return seq, recomputed


# -- Checkmate MILP ------------------------------------------------------------------

def checkmate(trace: Trace, budget: float, time_limit_s: float = 60.0,
              max_groups: int = 200, mip_rel_gap: float = 1e-4) -> BaselineResult:
    """The optimal static rematerialization plan under ``budget`` (Checkmate's MILP).

    ``budget``: bytes (int) or a fraction of the no-eviction live-byte peak
    (float). The budget bounds live bytes (512 B rounding per storage), not
    allocator segments. ``status``: ``"optimal"``; ``"time limit"`` (the best
    plan found so far is reported, ``feasible`` is None when none was found);
    ``"infeasible"`` (proved, or the budget is below a simple lower bound:
    resident initial storages plus what one stage must hold at once);
    ``"too large"`` (more than ``max_groups`` groups; nothing solved).
    """
    g = _graph(trace)
    base_peak = g.simulate(g.original(), trace_frees=True)
    b = _resolve_budget(budget, base_peak)
    if b is None:
        raise ValueError("checkmate needs a budget (bytes or a fraction of the no-eviction peak)")
    res = BaselineResult("checkmate", None, b, None, None, g.baseline_compute, None, base_peak,
                         name=_name(trace), details={"groups": len(g.groups)})
    if len(g.groups) > max_groups:
        res.status = "too large"
        return res
    lb = _checkmate_lower_bound(g)
    res.details["lower_bound_bytes"] = lb
    if b < lb:
        res.feasible, res.status = False, "infeasible"
        res.details["infeasible_reason"] = "budget below the bytes one stage must hold"
        return res
    if b >= base_peak:  # the trace itself is a plan with no recomputation
        peak = g.simulate(g.original(), trace_frees=False)
        res.feasible, res.status = True, "optimal"
        res.peak_bytes, res.compute_overhead, res.recompute_ops = peak, 0.0, 0
        res.details["solved"] = False
        return res
    return _solve_checkmate(g, b, time_limit_s, mip_rel_gap, res)


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


def _solve_checkmate(g: _Graph, budget: int, time_limit_s: float, gap: float,
                     res: BaselineResult) -> BaselineResult:
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError as e:
        raise ImportError("the Checkmate baseline solves a MILP with scipy's HiGHS: "
                          "pip install 'dtralloc[baselines]' (or scipy>=1.9)") from e

    groups, nb = g.groups, g.nbytes
    G = len(groups)
    nS = len(nb)
    init_at = _initial_bytes_per_stage(g)
    live = [s for s in range(nS) if not g.initial[s] and nb[s] > 0]
    # last stage at which each storage may be read (by an original or a recomputation)
    readers_orig: dict[int, list] = {}
    readers_rc: dict[int, list] = {}
    for j, grp in enumerate(groups):
        for s in grp.reads:
            readers_orig.setdefault(s, []).append(j)
        if grp.recomputable:
            for s in grp.recompute_reads:
                readers_rc.setdefault(s, []).append(j)
    last_need = {}
    for s in live:
        ln = max(readers_orig.get(s, [-1]))
        for j in readers_rc.get(s, []):
            ln = max(ln, groups[j].deadline)
        if g.outlives[s]:
            ln = G
        last_need[s] = ln
    # iterate: a recomputation of j is useful until the last stage reading its outputs
    r_last = {}
    for j, grp in enumerate(groups):
        if grp.recomputable:
            useful = max((last_need[s] for s in grp.created if s in last_need), default=-1)
            r_last[j] = min(grp.deadline, useful, G - 1)

    col_cost, col_int, lo, hi = [], [], [], []

    def var(cost=0.0, integer=True, lb=0.0, ub=1.0) -> int:
        col_cost.append(cost)
        col_int.append(1 if integer else 0)
        lo.append(lb)
        hi.append(ub)
        return len(col_cost) - 1

    base = g.baseline_compute or 1.0
    R = {}
    for j, last in r_last.items():
        for t in range(j + 1, last + 1):
            R[t, j] = var(groups[j].recompute_cost / base)
    S = {}
    for s in live:
        p = g.producer[s]
        for t in range(p + 1, last_need[s] + 1):
            S[t, s] = var()
    rows, cols, vals, rlo, rhi = [], [], [], [], []
    nrow = 0

    def constraint(terms, lb, ub):
        nonlocal nrow
        for c, v in terms:
            rows.append(nrow)
            cols.append(c)
            vals.append(v)
        rlo.append(lb)
        rhi.append(ub)
        nrow += 1

    inf = np.inf
    # outliving storages are in memory after the last stage
    for s in live:
        if g.outlives[s]:
            lo[S[G, s]] = 1.0
    # keep only what exists: S[t+1,s] <= S[t,s] + R[t,p]
    for (t, s), v in S.items():
        p = g.producer[s]
        if t == p + 1:
            continue
        terms = [(v, 1.0), (S[t - 1, s], -1.0)]
        if (t - 1, p) in R:
            terms.append((R[t - 1, p], -1.0))
        constraint(terms, -inf, 0.0)
    # dependencies
    for t in range(G):
        runs = [j for j in range(t) if (t, j) in R] + [t]
        for j in runs:
            reads = groups[j].reads if j == t else groups[j].recompute_reads
            for s in reads:
                if g.initial[s] or nb[s] == 0:
                    continue
                p = g.producer[s]
                terms = []
                if (t, s) in S:
                    terms.append((S[t, s], 1.0))
                if (t, p) in R:
                    terms.append((R[t, p], 1.0))
                if j == t:
                    constraint(terms, 1.0, inf)   # sum >= 1
                else:
                    constraint(terms + [(R[t, j], -1.0)], 0.0, inf)
    # memory, in units of the budget
    scale = 1.0 / budget
    n_free = 0
    for t in range(G):
        runs = [j for j in range(t) if (t, j) in R]
        reads_t = groups[t].reads
        # U0: entering the stage
        entering = [(S[t, s], nb[s] * scale) for s in live if (t, s) in S]
        u_prev = var(integer=False, lb=0.0, ub=inf)
        constraint([(u_prev, 1.0)] + [(c, -v) for c, v in entering], init_at[t] * scale, init_at[t] * scale)
        frees_prev = []
        for j in runs + [t]:
            u = var(integer=False, lb=0.0, ub=1.0)  # U <= budget
            terms = [(u, 1.0), (u_prev, -1.0)] + [(c, nb[s] * scale) for c, s in frees_prev]
            if j == t:
                constraint(terms, groups[t].nbytes * scale, groups[t].nbytes * scale)
            else:
                constraint(terms + [(R[t, j], -groups[j].nbytes * scale)], 0.0, 0.0)
            u_prev = u
            if j == t:
                break
            frees_prev = []
            for s in groups[j].recompute_reads:
                if g.initial[s] or nb[s] == 0 or s in reads_t:
                    continue
                f = var()
                n_free += 1
                constraint([(f, 1.0), (R[t, j], -1.0)], -inf, 0.0)
                for j2 in runs:
                    if j2 > j and s in groups[j2].recompute_reads:
                        constraint([(f, 1.0), (R[t, j2], 1.0)], -inf, 1.0)
                if (t + 1, s) in S:
                    constraint([(f, 1.0), (S[t + 1, s], 1.0)], -inf, 1.0)
                frees_prev.append((f, s))
    nvar = len(col_cost)
    A = coo_matrix((vals, (rows, cols)), shape=(nrow, nvar)).tocsr()
    res.details.update(variables=nvar, constraints=nrow, r_vars=len(R), s_vars=len(S), free_vars=n_free)
    t0 = time.perf_counter()
    sol = milp(np.array(col_cost), constraints=LinearConstraint(A, np.array(rlo), np.array(rhi)),
               integrality=np.array(col_int), bounds=Bounds(np.array(lo), np.array(hi)),
               options={"time_limit": float(time_limit_s), "mip_rel_gap": gap, "presolve": True})
    res.solve_seconds = time.perf_counter() - t0
    res.details["solved"] = True
    res.details["milp_message"] = sol.message
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
    x = sol.x
    seq = []
    for t in range(G):
        for j in range(t):
            if (t, j) in R and x[R[t, j]] > 0.5:
                seq.append((j, False))
        seq.append((t, True))
    recomputed = [j for j, orig in seq if not orig]
    res.peak_bytes = g.simulate(seq, trace_frees=False)
    res.compute_overhead = sum(groups[j].recompute_cost for j in recomputed) / base
    res.recompute_ops = sum(groups[j].recompute_nops for j in recomputed)
    res.feasible = res.peak_bytes <= budget
    res.details["recomputed_groups"] = len(recomputed)
    res.details["schedule"] = seq
    return res


# -- trace helpers -------------------------------------------------------------------

def without_optimizer(trace: Trace) -> Trace:
    """The step cut after its last backward op: forward and backward only.

    The optimizer step often sets the no-eviction peak (Adam's ``_foreach_sqrt``
    allocates a copy of the second moments while every gradient is alive), and no
    rematerialization can lower it; cutting it off leaves the part of the step
    that remat can act on. Storages created by the removed ops are dropped (ids
    renumbered); storages alive after the cut outlive the new trace.
    """
    from dataclasses import replace

    last = max((i for i, op in enumerate(trace.ops) if op.backward), default=len(trace.ops) - 1)
    keep_ops = trace.ops[: last + 1]
    keep = [sid for sid, st in enumerate(trace.storages) if st.initial or 0 <= st.producer <= last]
    new_id = {sid: k for k, sid in enumerate(keep)}
    alive = {sid for sid, st in enumerate(trace.storages) if st.initial} - set(trace.frees_before)

    def m(ids):
        return [new_id[i] for i in ids]

    ops = []
    for op in keep_ops:
        ops.append(replace(op, inputs=m(op.inputs), outputs=m(op.outputs), created=m(op.created),
                           mutated=m(op.mutated), aliased=m(op.aliased), frees=m(op.frees)))
        alive |= set(op.created)
        alive -= set(op.frees)
    storages = [replace(trace.storages[sid], outlives=sid in alive) for sid in keep]
    meta = dict(trace.meta)
    meta["name"] = f"{trace.meta.get('name', 'trace')} (no optimizer)"
    out = Trace(storages, ops, m(trace.frees_before), meta)
    out.validate()
    return out


# -- minimum feasible budgets ------------------------------------------------------------

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


__all__ = ["METHODS", "BaselineResult", "checkmate", "checkpoint_sqrt_n", "min_feasible_budget",
           "no_eviction", "without_optimizer"]
