"""The plans that need no solver: the trace as recorded (no_eviction) and Chen et al.'s sqrt(n) checkpointing."""
from __future__ import annotations

import math

from ..trace import Trace
from .grouped import _Graph, _graph
from .result import BaselineResult, _name, _resolve_budget


def no_eviction(trace: Trace, budget: None | int | float = None) -> BaselineResult:
    """The trace as recorded: no recomputation, storages freed where the trace frees them.

    ``peak_bytes`` is the live-byte peak (512 B rounding per storage; not
    allocator segments), and so ``live_peak_bytes`` too. ``details["last_use_peak_bytes"]``: the same schedule
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


def checkpoint_sqrt_n(trace: Trace, budget: None | int | float = None,
                      segments: int | None = None) -> BaselineResult:
    """Chen et al. (2016) checkpointing: sqrt(n) forward segments, each recomputed once.

    The forward pass is the groups before the first op flagged ``backward``;
    ``n`` counts those that allocate. They are cut into ``segments`` (default
    ``round(sqrt(n))``) runs of near-equal count. Kept: storages read by a
    later segment's forward ops (the checkpoints) and everything that cannot be
    recomputed (docs/baselines.md, "What is never recomputed"). Every other
    storage of a forward segment is freed after its last forward read; the
    first time anything after the forward pass reads one of them, the segment
    is recomputed (only the groups needed for its dropped storages that are
    read later, and what they need), once. The plan's live-byte peak is fixed;
    ``feasible`` says whether it fits ``budget`` (bytes, or a share of the
    live-byte peak of the trace as recorded, ``result.live_peak_bytes``; None:
    always).
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
