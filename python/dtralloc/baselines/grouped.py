"""The grouped-step model every static plan works on (docs/baselines.md, "Model of the step").

A trace becomes a sequence of groups: each op that creates storages starts a
group, the ops after it that create none join it. :class:`_Graph` holds the
groups with the facts every plan needs (what each reads and creates, what it
costs, whether and until when it may be recomputed) and measures a schedule's
live bytes (:meth:`_Graph.profile`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..trace import Trace

BLOCK = 512  # bytes; every live storage is counted rounded up to this (the pool's smallest block)


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
