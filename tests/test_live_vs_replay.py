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
from dtralloc.dtr import dtr
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
