"""One engine, one set of decisions: a zoo model's step run live under
dtr(device="cpu") and its recorded trace replayed agree where they see the
same sequence (bench/bench_live_vs_replay.py measures the rest).

The replay runs Trace.session_view(): the CPU mirror pool holds only what
the session allocates, so the storages alive before the step take no bytes.
"""
from __future__ import annotations

import gc

import torch

import dtralloc
from dtralloc.dtr import PHASES, dtr
from dtralloc.trace.recorder import record
from dtralloc.zoo import build

# vit at its compact width, batch 2 and 2 layers: a 30 MiB step, a fraction of
# a second on one core. At 0.8 of its peak the `size` policy evicts (3 values
# on torch 2.13) where live and replay see the same sequence. At tighter
# budgets they part where the trace does not show what the live session
# sees (autograd holds a backward node's unpacked saved tensors while the
# node runs; the program holds its own references): the bench reports where.
SIZES = dict(batch=2, layers=2)
FRACTION = 0.8
POLICY = "size"  # reads no op cost: the choices depend on the sequence alone


def _events(columns) -> list[tuple[int, int]]:
    return list(zip(columns["kind"].tolist(), columns["bytes"].tolist()))


def test_live_and_replay_agree_on_peak_and_decisions():
    torch.manual_seed(0)
    w = build("vit", compact=True, **SIZES)
    w.step()
    gc.collect()
    trace = record(w.step).session_view()

    probe = dtr(device="cpu")
    with probe:
        w.step()
    live = probe.stats()
    assert live["evictions"] == 0
    assert len(probe.events()["kind"]) == 0  # nothing to log without a budget
    plain = dtralloc.replay(trace)
    assert live["peak_bytes"] == plain.peak_reserved_bytes
    assert live["peak_allocated_bytes"] == plain.peak_allocated_bytes

    budget = int(FRACTION * live["peak_bytes"])
    replayed = dtralloc.replay(trace, budget=budget, policy=POLICY)
    session = dtr(budget=budget, policy=POLICY, device="cpu")
    gc.collect()
    with session:
        w.step()
    got = session.stats()
    assert replayed.feasible and replayed.evictions > 0
    assert (got["evictions"], got["remats"], got["eviction_calls"]) == \
        (replayed.evictions, replayed.remats, replayed.eviction_calls)
    assert _events(session.events()) == _events(replayed.events)


def _unevictable_by_op(trace, live_series, replayed) -> list[tuple[str, int, int, int]]:
    """(op name, phase, live, replay) bytes no eviction could free after each
    op the two share, matched in order by name (the live series records only
    ops that make or write a storage; the replay's has every op)."""
    names = [trace.ops[i].name for i in replayed.series["op"]]
    replay_held = replayed.series["allocated"] - replayed.series["evictable"]
    live_held = live_series["allocated"] - live_series["evictable"]
    rows, j = [], 0
    for i, name in enumerate(live_series["name"].tolist()):
        name = name.replace("aten.", "aten::", 1).removesuffix(".default")
        while j < len(names) and names[j] != name:
            j += 1
        assert j < len(names), f"live op {i} ({name}) not in the replay"
        rows.append((name, int(live_series["phase"][i]), int(live_held[i]), int(replay_held[j])))
        j += 1
    return rows


def test_gradients_are_the_programs_in_both():
    """A parameter's gradient is the program's from the op that makes it:
    live, no eviction can free it; the replay pins what outlives the step
    (pin_outliving). Through the backward, what no eviction could free
    after each op then agrees within a few KiB; replayed as recomputable (as before
    2026-11-23) the gradients were on offer in the replay alone, 14 MiB of
    them by the end of this step's backward, and the replay fitted budgets
    the session could not (bench/results/live_vs_replay-*)."""
    torch.manual_seed(0)
    w = build("convbn", compact=True, batch=2)
    w.step()
    gc.collect()
    trace = record(w.step).session_view()
    session = dtr(budget=1 << 40, device="cpu")  # a budget: evictability is tracked; nothing evicted
    with session:
        w.step()
    assert session.stats()["evictions"] == 0
    series = session.series()
    backward = PHASES.index("backward")
    pinned = _unevictable_by_op(trace, series, dtralloc.replay(trace, budget=1 << 40, policy="dtralloc"))
    before = _unevictable_by_op(trace, series, dtralloc.replay(trace, budget=1 << 40, policy="dtralloc",
                                                                pin_outliving=False))
    # Within 4 KiB: a few bytes of scalars (the loss) and a small mm output
    # the program holds between two ops, which the trace cannot show.
    in_backward = [r for r in pinned if r[1] == backward]
    assert len(in_backward) > 20
    assert max(abs(live - replay) for _, _, live, replay in in_backward) <= 4096
    gap = max(live - replay for _, phase, live, replay in before if phase == backward)
    assert gap >= sum(p.numel() * p.element_size() for p in w.model.parameters()) // 2, gap
