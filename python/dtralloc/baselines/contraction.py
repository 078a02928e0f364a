"""Restricted Checkmate: a grouped step with runs of consecutive groups merged into
super-groups, so the MILP of a graph too large to solve becomes one that solves
(an upper bound on the static optimum; docs/baselines.md, "Larger graphs")."""
from __future__ import annotations

from .grouped import _Graph, _Group


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
