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
  plans, on graphs small enough to solve. On larger graphs it gives a lower
  bound (LP relaxation) or an upper bound (a contracted graph's optimal plan)
  instead, labelled as such (see the last section).

:func:`first_eviction_packed` is not a plan but a reference for the dynamic
policies' fragmentation figure: where a pool that never fragments would first
have to evict, and how much of the budget would be free there.

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
its deadline and the last stage at which one of its outputs may still be read,
and only where its inputs can be in memory; ``S[t,s]`` up to the last stage that
may read s). The outputs of a group that cannot be recomputed are in memory
from creation to their last original read in every plan, so their ``S`` there is
the constant 1, folded into the stage's resident bytes. None of this changes the
set of plans or the optimum. The solved plan is replayed through the same
schedule simulator as Chen's, which checks that every read finds its storage
and gives ``peak_bytes``. Graphs with more than ``max_groups`` groups are not
solved (status ``"too large"``).

Larger graphs: a bound from each side (``checkmate(..., mode=...)``)
--------------------------------------------------------------------
The exact MILP grows as groups squared; on 2 cores it solves unet (140 groups)
in under a minute and finds no plan for resnet50 (360) in minutes. For
bert/gpt2/llama (800-1000 groups) two labelled stand-ins bracket the static
optimum ``OPT``; neither is ``OPT`` and neither may be reported as it:

* ``mode="lp_bound"`` -- the LP relaxation of the exact MILP of the whole
  graph: ``compute_overhead <= OPT``. Not a plan (no peak, no schedule);
  status ``"lower bound"``. Checkmate's relaxation is weak (it may be far below
  ``OPT``), so "dynamic overhead / LP bound" overstates the dynamic policy's gap.
* ``mode="restricted"`` -- the exact MILP of a *contracted* graph: runs of
  consecutive groups merged into at most ``max_groups`` super-groups, each kept,
  dropped and recomputed as a unit, with memory counted so that it never undercounts
  the expanded plan (see ``_Contracted``). The optimum is a real plan,
  expanded to the original groups and replayed through the simulator:
  ``compute_overhead >= OPT``, ``peak_bytes <= budget``; statuses
  ``"restricted optimal"`` / ``"restricted time limit"`` /
  ``"restricted infeasible"`` (no contracted plan fits: says nothing about
  ``OPT``). ``result.method`` is ``"checkmate_lp_bound"`` /
  ``"checkmate_restricted"``, never ``"checkmate"``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .trace import Trace

BLOCK = 512  # bytes; every live storage is counted rounded up to this

METHODS = ("no_eviction", "checkpoint_sqrt_n", "checkmate")


@dataclass
class BaselineResult:
    """One static plan for one (trace, budget). Memory is live bytes (see module doc)."""

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
        (See :meth:`profile`.)"""
        return max(self.profile(seq, trace_frees))

    def profile(self, seq: list, trace_frees: bool) -> list:
        """Live bytes before the first group (index 0) and right after each entry
        of a schedule (index p + 1); raise ValueError if a read finds nothing.

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
        out, live = [], 0
        for p in range(P + 1):
            live += diff[p]
            out.append(live)
        return out

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


# -- no eviction ---------------------------------------------------------------------

def no_eviction(trace: Trace, budget: None | float = None) -> BaselineResult:
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

def checkpoint_sqrt_n(trace: Trace, budget: None | float = None,
                      segments: int | None = None) -> BaselineResult:
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

CHECKMATE_MODES = ("exact", "lp_bound", "restricted")


# Default group limits. 200: the exact MILP of unet (140 groups) solves in under
# a minute on 2 cores, resnet50's (360) finds no plan in 120 s. 80: contracted
# bert/gpt2/llama solve at 0.9 and 0.7 of the peak in 20-90 s; at 200
# super-groups bert found no plan in 120 s.
MAX_GROUPS = {"exact": 200, "lp_bound": None, "restricted": 80}


def checkmate(trace: Trace, budget: float, time_limit_s: float = 60.0,
              max_groups: int | None = None, mip_rel_gap: float = 1e-4,
              mode: str = "exact") -> BaselineResult:
    """The optimal static rematerialization plan under ``budget`` (Checkmate's MILP),
    or, with ``mode``, a labelled bound on it for graphs too large to solve.

    ``budget``: bytes (int) or a fraction of the no-eviction live-byte peak
    (float). The budget bounds live bytes (512 B rounding per storage), not
    allocator segments. ``time_limit_s`` bounds the HiGHS solve. ``max_groups``
    defaults to ``MAX_GROUPS[mode]`` (200 exact, 80 restricted).

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
        raise ValueError("checkmate needs a budget (bytes or a fraction of the no-eviction peak)")
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
    """Checkmate's MILP for ``g`` under ``budget`` bytes (see the module doc).

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


# -- restricted Checkmate: a contracted graph -------------------------------------------

class _Contracted:
    """``g`` with runs of consecutive groups merged into super-groups.

    Each super-group runs, and is recomputed, as a unit: its members in order.
    It has the fields of :class:`_Graph` that :func:`_checkmate_model` reads,
    chosen so that every plan of the contracted MILP, expanded to its members,
    is a plan of ``g`` whose live bytes stay within the MILP's accounting:

    * recomputable only if every member is; deadline: the super-group holding
      the earliest member deadline (a recomputation runs before the stage's
      first member, so that member's deadline is met);
    * reads: the members' reads not created inside the run;
    * ``nbytes`` (the bytes the MILP adds when the super-group runs): the peak,
      over its members, of the bytes created so far inside the run and still
      live -- storages read outside the run from their creation on, the others
      until their last read inside the run. Storages entering the stage are
      counted for the whole stage, and initial storages live to the end of the
      super-group in which the trace frees them: both over-count, never under.
    """

    def __init__(self, g: _Graph, runs: list):
        self.base = g
        self.runs = runs                # runs[k]: original groups of super-group k, in order
        self.nbytes, self.initial, self.outlives = g.nbytes, g.initial, g.outlives
        self.baseline_compute, self.initial_bytes = g.baseline_compute, g.initial_bytes
        K, G = len(runs), len(g.groups)
        self.super_of = super_of = [0] * G
        for k, run in enumerate(runs):
            for j in run:
                super_of[j] = k
        self.producer = [super_of[p] if p >= 0 else -1 for p in g.producer]
        self.trace_free = [f if f < 0 else (K if f >= G else super_of[f]) for f in g.trace_free]
        readers_outside: dict[int, set] = {}
        for j, grp in enumerate(g.groups):
            for s in grp.reads | grp.recompute_reads:
                readers_outside.setdefault(s, set()).add(super_of[j])
        self.groups = []
        for k, run in enumerate(runs):
            members = [g.groups[j] for j in run]
            created = [s for m in members for s in m.created]
            own = set(created)
            last_inside = {}
            for i, m in enumerate(members):
                for s in m.reads:
                    if s in own:
                        last_inside[s] = i
            live = [0] * (len(members) + 1)
            for i, m in enumerate(members):
                for s in m.created:
                    visible = g.outlives[s] or bool(readers_outside.get(s, set()) - {k})
                    end = len(members) - 1 if visible else max(i, last_inside.get(s, i))
                    live[i] += g.nbytes[s]
                    live[end + 1] -= g.nbytes[s]
            acc = peak = 0
            for v in live[:-1]:
                acc += v
                peak = max(peak, acc)
            grp = _Group([i for m in members for i in m.ops], created,
                         set().union(*(m.reads for m in members)) - own,
                         set().union(*(m.recompute_reads for m in members)) - own,
                         sum(m.cost for m in members), sum(m.recompute_cost for m in members),
                         sum(m.recompute_nops for m in members))
            grp.recomputable = all(m.recomputable for m in members)
            grp.deadline = min(super_of[m.deadline] for m in members)
            grp.nbytes = peak
            self.groups.append(grp)

    def expand(self, seq: list) -> list:
        """A contracted schedule as a schedule of the original groups."""
        return [(j, orig) for k, orig in seq for j in self.runs[k]]


def _contract_runs(g: _Graph, max_groups: int) -> list:
    """Cut the groups into at most ``max_groups`` runs of consecutive groups.

    Greedy: merge the adjacent pair whose merged stage would hold the fewest
    bytes (the most bytes live at one of its groups in the no-eviction schedule
    with frees at last use, plus everything the run creates), so stages near
    the peak, where the budget binds, stay fine-grained. Merging a recomputable
    group with one that is not makes it unrecomputable; that costs a penalty of
    half the peak, so it comes after the merges that lose nothing. A heuristic:
    it shapes how good the restricted plan is, never whether it is valid.
    """
    import heapq

    G = len(g.groups)
    runs = [[j] for j in range(G)]
    if G <= max_groups:
        return runs
    mem = g.profile(g.original(), trace_frees=False)[1:]  # right after each group
    peak = max(mem) if mem else 0
    made = [grp.nbytes for grp in g.groups]
    nxt = list(range(1, G + 1))
    prv = list(range(-1, G - 1))
    first = list(range(G))  # run headed by group a: groups a .. last[a]
    last = list(range(G))
    rec = [grp.recomputable for grp in g.groups]
    version = [0] * G

    def score(a: int) -> float:
        b = nxt[a]
        mixed = rec[a] != rec[b]
        return (max(mem[a:last[b] + 1]) + sum(made[a:last[b] + 1])
                + (peak / 2 if mixed else 0))

    heap = [(score(a), a, 0) for a in range(G - 1)]
    heapq.heapify(heap)
    count = G
    while count > max_groups:
        _, a, v = heapq.heappop(heap)
        if v != version[a] or first[a] != a or nxt[a] >= G:
            continue
        b = nxt[a]
        last[a] = last[b]
        rec[a] = rec[a] and rec[b]
        nxt[a] = nxt[b]
        if nxt[a] < G:
            prv[nxt[a]] = a
        first[b] = -1
        count -= 1
        version[a] += 1
        if nxt[a] < G:
            heapq.heappush(heap, (score(a), a, version[a]))
        if prv[a] >= 0:
            p = prv[a]
            version[p] += 1
            heapq.heappush(heap, (score(p), p, version[p]))
    return [list(range(a, last[a] + 1)) for a in range(G) if first[a] == a]


# -- a pool that never fragments --------------------------------------------------------

@dataclass
class PackedEviction:
    """Where :func:`first_eviction_packed` finds the first allocation that does not fit."""

    op: int                # trace op allocating it; -1: the storages alive before the step
    op_name: str
    request_bytes: int     # that storage's size (512 B rounding)
    free_bytes: int        # budget - live bytes just before it
    budget_bytes: int

    @property
    def free_fraction(self) -> float:
        """free_bytes / budget_bytes: what ``ReplayResult.fragmentation`` would
        average if this were the only forced eviction."""
        return self.free_bytes / self.budget_bytes


def first_eviction_packed(trace: Trace, budget_bytes: int) -> PackedEviction | None:
    """The first forced eviction of a pool that never fragments, or None if the
    step fits ``budget_bytes`` without evicting.

    Storages are allocated and freed in the replay's order (those alive before
    the step, then per op its created storages, then what the trace frees after
    it), each rounded up to 512 B, and reserved memory is always exactly the
    live bytes. The first storage that would take them past the budget is
    where such a pool must evict. Its ``free_fraction`` is the reference for
    ``ReplayResult.fragmentation`` at budgets with few forced evictions: there
    the free share at a call is set mostly by when the call comes and how big
    its request is, and a pool that packs better can show *more* of it (it is
    forced later, next to a bigger request), not less.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int (bytes; for a fraction f of the "
                         f"no-eviction peak pass int(f * dtralloc.replay(trace).peak_reserved_bytes)), "
                         f"got {budget_bytes!r}")
    sizes = [_round(s.nbytes) for s in trace.storages]
    live: dict[int, int] = {}
    total = 0

    def take(sid: int, op: int, name: str) -> PackedEviction | None:
        nonlocal total
        if total + sizes[sid] > budget_bytes:
            return PackedEviction(op, name, sizes[sid], budget_bytes - total, budget_bytes)
        live[sid] = sizes[sid]
        total += sizes[sid]
        return None

    for sid, s in enumerate(trace.storages):
        if s.initial and (hit := take(sid, -1, "(before the step)")):
            return hit
    for sid in trace.frees_before:
        total -= live.pop(sid, 0)
    for i, op in enumerate(trace.ops):
        for sid in op.created:
            if hit := take(sid, i, op.name):
                return hit
        for sid in op.frees:
            total -= live.pop(sid, 0)
    return None


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


__all__ = ["CHECKMATE_MODES", "MAX_GROUPS", "METHODS", "BaselineResult", "checkmate", "checkpoint_sqrt_n", "min_feasible_budget",
           "no_eviction", "without_optimizer"]
