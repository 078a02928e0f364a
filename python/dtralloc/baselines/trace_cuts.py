"""Trace transforms for the baselines: the step without its optimizer."""
from __future__ import annotations

from dataclasses import replace

from ..trace import Trace


def without_optimizer(trace: Trace) -> Trace:
    """The step cut after its last backward op: forward and backward only.

    The optimizer step often sets the no-eviction peak (Adam's ``_foreach_sqrt``
    allocates a copy of the second moments while every gradient is alive), and no
    rematerialization can lower it; cutting it off leaves the part of the step
    that remat can act on. Storages created by the removed ops are dropped (ids
    renumbered); storages alive after the cut outlive the new trace.
    """
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
