"""Runs: what one dashboard page compares.

A run is one allocator timeline: a replay of a trace under one policy and
budget (x axis: the trace's ops), a finished live dtr() session (x axis: the
ops it recorded), or one device of a memory snapshot (x axis: its events).
Every run carries its headline figures; replays and live sessions also carry
the per-op series and the eviction log the engine records (the same columns),
snapshots their event history (history.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .history import ACTION, History, build_history, event_columns

from ..dtr.recording import PHASES

# The per-op series a replay and a live session record (ReplayResult.series,
# Session.series()).
SERIES = ("reserved", "allocated", "evictable", "largest_free", "free")
# The eviction log's columns (ReplayResult.events, Session.events()).
EVLOG = ("op", "kind", "value", "bytes", "addr", "plan", "score", "window_addr", "window_bytes")


@dataclass
class Run:
    label: str
    kind: str                          # "replay" | "live" | "snapshot"
    x_kind: str                        # "op" | "event"
    n_x: int
    domain: str                        # runs of one domain share the cursor's x
    figures: dict = field(default_factory=dict)
    series: dict = field(default_factory=dict)     # per x (replays, live): SERIES, numpy int64
    phases: list = field(default_factory=list)     # (first x, end x, phase name)
    op_names: Optional[list] = None                # per op (replays, live)
    history: Optional[History] = None
    x_event: Optional[np.ndarray] = None           # per x: events done at its sample point
    evlog: Optional[dict] = None
    notes: list = field(default_factory=list)


def trace_phases(trace) -> list:
    """Forward / backward / optimizer bands of a trace's ops: backward is what
    the recorder marked so, forward what precedes the first backward op, the
    optimizer what follows the last one."""
    flags = [bool(getattr(op, "backward", False)) for op in trace.ops]
    n = len(flags)
    if not any(flags):
        return [(0, n, "forward")] if n else []
    first = flags.index(True)
    last = n - 1 - flags[::-1].index(True)
    bands = [(0, first, "forward"), (first, last + 1, "backward"), (last + 1, n, "optimizer")]
    return [b for b in bands if b[1] > b[0]]


def phase_bands(phase: np.ndarray) -> list:
    """(first x, end x, name) for each run of equal phase codes (PHASES)."""
    phase = np.asarray(phase)
    if phase.size == 0:
        return []
    starts = np.flatnonzero(np.diff(phase.astype(np.int64), prepend=-1))
    ends = np.append(starts[1:], phase.size)
    return [(int(a), int(b), PHASES[int(phase[a])]) for a, b in zip(starts, ends)]


def live_run(session, label: str) -> Run:
    """A run from a dtr() session: its per-op series, its event log, and the
    history of its pool (the CPU mirror's with dtr(history=True); on CUDA the
    installed pool's, when it records one)."""
    stats = session.stats()
    s = session.series()
    op = np.asarray(s["op"], np.int64)
    # x is the engine's op index (the events' and the history's op stamps).
    # An op that ran out of memory has no sample: it shows its predecessor's.
    n = int(op[-1]) + 1 if op.size else 0
    at = np.maximum(np.searchsorted(op, np.arange(n), side="right") - 1, 0)
    names = np.where(op[at] == np.arange(n), s["name"][at], "") if n else s["name"]
    figures = live_figures(stats)
    run = Run(label, "live", "op", max(n, 1), f"live:{id(session)}", figures,
              {k: np.asarray(s[k], np.int64)[at] for k in SERIES}, phase_bands(np.asarray(s["phase"])[at]),
              [str(x) for x in names])
    run.evlog = {k: np.asarray(v) for k, v in session.events().items()}
    if stats["series_dropped"]:
        run.notes.append(f"The series holds the first {n} recorded ops; {stats['series_dropped']} later ones "
                         "were not sampled (dtr(series=N) keeps more).")
    snap = session.pool_snapshot()
    cols = snap["device_traces"][-1]
    events = len(cols["op"]) if isinstance(cols, dict) else 0
    if "event" in s and events:
        run.history = build_history(cols, snap["segments"])
        # A ring that wrapped lost its oldest events: the samples count from
        # the session's first event, the history from its oldest kept one.
        lost = max(int(stats["history_recorded"]) - events, 0)
        run.x_event = np.clip(np.asarray(s["event"], np.int64)[at] - lost, 0, events)
        if lost > 0:
            run.notes.append(f"The pool's history ring dropped its {lost} oldest events (dtr(history=N) keeps "
                             "more); the address views start after them.")
    else:
        run.notes.append("No allocator history: the address map, the address x time map and the tensor list are "
                         "empty. Run the session with dtralloc.dtr(..., history=True) (device='cpu'), or record "
                         "the CUDA pool's history (dtralloc.record_memory_history()).")
    return run


def live_figures(stats: dict) -> dict:
    """The figures of a live session, exactly as Session.stats() reports them."""
    return {
        "policy": stats["policy"],
        "budget_bytes": stats["budget_bytes"] or None,
        "peak_reserved_bytes": int(stats["peak_bytes"]),
        "peak_allocated_bytes": int(stats["peak_allocated_bytes"]),
        "evictions": int(stats["evictions"]),
        "remats": int(stats["remats"]),
        "compute_overhead": float(stats["compute_overhead"]),
        "feasible": stats["ooms"] == 0,
        "oom_op": None,
        "ooms": int(stats["ooms"]),
        "no_eviction_peak_reserved_bytes": 0,
    }


def sample_events(op_column: np.ndarray, action: np.ndarray, n_ops: int) -> np.ndarray:
    """For each op, how many history events precede the moment the replay
    sampled its series: after the op's last allocation, before its frees (an
    op that allocates nothing is sampled before its first event)."""
    op = op_column.astype(np.int64)
    allocs = np.flatnonzero(action == ACTION["alloc"])
    out = np.searchsorted(op, np.arange(n_ops), side="left")  # first event of each op (op stamps ascend)
    if allocs.size:
        last_alloc = np.full(n_ops, -1, np.int64)
        stamped = op[allocs]
        ok = (stamped >= 0) & (stamped < n_ops)
        np.maximum.at(last_alloc, stamped[ok], allocs[ok])
        out = np.where(last_alloc >= 0, last_alloc + 1, out)
    return out.astype(np.int64)


def replay_run(trace, result, label: str, min_budget: Optional[float] = None) -> Run:
    """A run from dtralloc.replay(trace, ..., history=True)."""
    series = {k: np.asarray(result.series[k], np.int64) for k in SERIES}
    # The x axis is the trace's ops, shared with the other runs of the trace;
    # a replay that ran out of memory has no samples after its OOM op.
    n = len(trace.ops)
    name = str(trace.meta.get("name", "trace"))
    figures = replay_figures(result)
    figures["min_feasible_budget"] = min_budget
    run = Run(label, "replay", "op", n, f"trace:{name}:{len(trace.ops)}", figures, series,
              trace_phases(trace), [op.name for op in trace.ops])
    run.evlog = {k: np.asarray(result.events[k]) for k in EVLOG}
    hist = getattr(result, "history", None)
    if hist is not None:
        run.history = build_history(hist)
        if "event" in result.series:  # the replay says where each op was sampled
            run.x_event = np.full(n, len(run.history.cols["op"]), np.int64)
            run.x_event[result.series["op"]] = result.series["event"]
        else:
            run.x_event = sample_events(run.history.cols["op"], run.history.cols["action"], n)
    else:
        run.notes.append("This replay carries no allocator history (dtralloc.replay(..., history=True) is "
                         "not in this build), so the address map, the address x time map and the tensor "
                         "list are empty; the timeline, fragmentation and eviction markers come from the "
                         "per-op series and the eviction log.")
    if not result.feasible:
        run.notes.append(f"OOM at op {result.oom_op}: {result.oom_message}")
    return run


def replay_figures(result) -> dict:
    """The figures of a replay, exactly as dtralloc.replay returns them."""
    return {
        "policy": result.policy,
        "budget_bytes": result.budget_bytes,
        "peak_reserved_bytes": int(result.peak_reserved_bytes),
        "peak_allocated_bytes": int(result.peak_allocated_bytes),
        "evictions": int(result.evictions),
        "remats": int(result.remats),
        "compute_overhead": float(result.compute_overhead),
        "feasible": bool(result.feasible),
        "oom_op": result.oom_op,
        "ooms": 0 if result.feasible else 1,
        "no_eviction_peak_reserved_bytes": int(result.no_eviction_peak_reserved_bytes),
    }


def snapshot_runs(snapshot: dict, name: str) -> list[Run]:
    """One run per device of a torch (or dtralloc) memory snapshot that has
    segments or history."""
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError("dtralloc.dashboard: not a memory snapshot: expected a dict with 'segments' and "
                         "'device_traces' (torch.cuda.memory._snapshot(), _dump_snapshot's pickle, or "
                         "dtralloc.snapshot())")
    traces = snapshot.get("device_traces") or []
    segments = snapshot.get("segments") or []
    devices = sorted({int(s.get("device", 0)) for s in segments} |
                     {i for i, t in enumerate(traces) if len(t)})
    runs = []
    for d in devices:
        events = traces[d] if d < len(traces) else []
        final = [s for s in segments if int(s.get("device", 0)) == d]
        if isinstance(events, dict):  # dtralloc's columns (snapshot(columns=True))
            history = build_history(events, final)
        else:
            cols, labels, made_by = event_columns(events)
            history = build_history(cols, final, labels, made_by)
        runs.append(snapshot_run(history, f"{name} · cuda:{d}"))
    if not runs:
        raise ValueError("dtralloc.dashboard: the snapshot has no segments and no history on any device")
    return runs


def snapshot_run(history: History, label: str) -> Run:
    m = history.model
    oom = history.oom_events()
    figures = {
        "policy": None, "budget_bytes": None,
        "peak_reserved_bytes": int(m["peak_reserved"]),
        "peak_allocated_bytes": int(m["peak_allocated"]),
        "evictions": 0, "remats": 0, "compute_overhead": 0.0, "feasible": oom.size == 0,
        "oom_op": None, "ooms": int(oom.size), "events": history.n,
        "anomalies": int(m["anomalies"]),
    }
    run = Run(label, "snapshot", "event", max(history.n, 1), f"events:{label}", figures, history=history)
    if history.n == 0:
        run.notes.append("No event history: only the segments at the moment of the snapshot. Record with "
                         "torch.cuda.memory._record_memory_history() or dtralloc.record_memory_history().")
    if m["anomalies"]:
        run.notes.append(f"{m['anomalies']} events do not add up (a free of an unknown block, an allocation "
                         "outside every known segment); the maps show them as well as they allow.")
    return run
