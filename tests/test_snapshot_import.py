"""dtralloc.trace.import_torch_snapshot: torch memory snapshots (the dict of
torch.cuda.memory._snapshot(), or the pickle _dump_snapshot writes) become
allocation-only traces that validate and replay.

Two sources: a snapshot written by hand in torch's layout (device_traces with
segment_alloc / alloc / free_requested / free_completed events, segments with
their blocks), and the snapshot of a dtralloc.Pool, which uses the same layout.
"""
from __future__ import annotations

import pickle
import random

import pytest
from conftest import MiB

import dtralloc
from dtralloc.trace import import_torch_snapshot

BASE = 0x7F0000000000


def _event(action, addr, size, **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": []}
    e.update(extra)
    return e


def _block(addr, size, state):
    return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": []}


def _hand_snapshot() -> dict:
    """One 20 MiB segment at BASE, history recorded after two blocks existed:

    * OLD (1 MiB at BASE) was allocated before the history and is freed in it;
    * KEPT (2 MiB at BASE+1M) was allocated before the history, never freed;
    * A (4 MiB) is allocated and freed, its address reused by C (3 MiB);
    * B (5 MiB) is allocated and still allocated at the end.
    """
    old, kept, a, b = BASE, BASE + MiB, BASE + 3 * MiB, BASE + 7 * MiB
    events = [
        _event("alloc", a, 4 * MiB),
        _event("free_requested", old, MiB),
        _event("free_completed", old, MiB),
        _event("alloc", b, 5 * MiB),
        _event("free_requested", a, 4 * MiB),
        _event("free_completed", a, 4 * MiB),
        _event("alloc", a, 3 * MiB),  # C
        _event("segment_alloc", BASE + 32 * MiB, 2 * MiB),  # not an allocation
        _event("oom", 0, 64 * MiB, device_free=0),
    ]
    blocks = [_block(old, MiB, "inactive"), _block(kept, 2 * MiB, "active_allocated"),
              _block(a, 3 * MiB, "active_allocated"), _block(a + 3 * MiB, MiB, "inactive"),
              _block(b, 5 * MiB, "active_allocated"), _block(b + 5 * MiB, 8 * MiB, "inactive")]
    segment = {"device": 0, "address": BASE, "total_size": 20 * MiB, "allocated_size": 10 * MiB,
               "active_size": 10 * MiB, "requested_size": 10 * MiB, "stream": 0,
               "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
               "frames": [], "blocks": blocks}
    other_device = dict(segment, device=1, blocks=[_block(BASE, 7 * MiB, "active_allocated")])
    return {"segments": [segment, other_device], "device_traces": [events, []],
            "allocator_settings": {}}


def test_hand_made_snapshot_imports_as_allocation_only_trace():
    trace = import_torch_snapshot(_hand_snapshot(), name="hand")
    trace.validate()
    assert trace.meta["name"] == "hand" and trace.meta["devices"] == ["cuda:0"]
    assert [op.name for op in trace.ops] == ["snapshot::alloc"] * 3
    by_size = {s.nbytes: s for s in trace.storages}
    assert sorted(by_size) == [MiB, 2 * MiB, 3 * MiB, 4 * MiB, 5 * MiB]
    assert len(trace.storages) == 5, "device 1's block is not this device's"
    # Existed before the history began: OLD (freed in it) and KEPT (never freed).
    assert [s.nbytes for s in trace.storages if s.initial] == [MiB, 2 * MiB]
    assert not by_size[MiB].outlives and by_size[2 * MiB].outlives
    a, b, c = (op.created[0] for op in trace.ops)
    assert [trace.storages[s].nbytes for s in (a, b, c)] == [4 * MiB, 5 * MiB, 3 * MiB]
    # Frees land after the allocation that preceded them; free_requested is
    # ignored when free_completed exists (no double free).
    old = trace.storages.index(by_size[MiB])
    assert trace.ops[0].frees == [old] and trace.ops[1].frees == [a] and trace.ops[2].frees == []
    assert [trace.storages[s].outlives for s in (a, b, c)] == [False, True, True]
    assert all(op.flops == 0 and op.duration_ns == 0 and not op.backward for op in trace.ops)


def test_hand_made_snapshot_replays_from_a_pickle(tmp_path):
    path = tmp_path / "snapshot.pickle"
    with open(path, "wb") as f:
        pickle.dump(_hand_snapshot(), f)
    for source in (path, str(path)):
        trace = import_torch_snapshot(source)
        assert trace.meta["name"] == str(path)
        r = dtralloc.replay(trace, check_invariants=True)
        # Initial 1+2 MiB, then 4 and 5 MiB live together (the 1 MiB died).
        assert r.feasible and r.peak_allocated_bytes == 11 * MiB == trace.peak_live_bytes()
        assert len(r.reserved_fragmentation) == 3
        assert not dtralloc.replay(trace, budget=0.5).feasible


def test_free_action_fallbacks():
    """Snapshots without free_completed use free (older torch) or free_requested."""
    renames = {"free": {"free_completed": "free", "free_requested": None},
               "free_requested": {"free_completed": None}}
    for action, rename in renames.items():
        snap = _hand_snapshot()
        snap["device_traces"][0] = [dict(e, action=rename.get(e["action"], e["action"]))
                                    for e in snap["device_traces"][0]
                                    if rename.get(e["action"], "") is not None]
        assert sum(e["action"] == action for e in snap["device_traces"][0]) == 2
        trace = import_torch_snapshot(snap)
        trace.validate()
        freed = [[trace.storages[s].nbytes for s in op.frees] for op in trace.ops]
        assert freed == [[MiB], [4 * MiB], []], action


def test_snapshot_without_history_is_a_clear_error(tmp_path):
    snap = _hand_snapshot()
    with pytest.raises(ValueError, match=r"no allocation history for device 1.*devices with history: \[0\]"):
        import_torch_snapshot(snap, device=1)
    with pytest.raises(ValueError, match="device 5"):
        import_torch_snapshot(snap, device=5)
    snap["device_traces"] = [[]]
    with pytest.raises(ValueError, match="no allocation history.*_record_memory_history"):
        import_torch_snapshot(snap)
    for not_a_snapshot in ({"segments": []}, [1, 2], {"device_trace": []}):
        with pytest.raises(ValueError, match="not a torch memory snapshot"):
            import_torch_snapshot(not_a_snapshot)
    path = tmp_path / "list.pickle"
    path.write_bytes(pickle.dumps([{"action": "alloc"}]))
    with pytest.raises(ValueError, match="not a torch memory snapshot"):
        import_torch_snapshot(path)


def _drive(pool, rng: random.Random, n: int, sizes) -> list[int]:
    live = []
    for _ in range(n):
        if live and rng.random() < 0.45:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(pool.malloc(rng.choice(sizes)))
    return live


SIZES = (100, 4000, 300_000, 2 * MiB, 5 * MiB, 12 * MiB + 7)


def test_dtralloc_pool_snapshot_imports_and_replays(make_pool, tmp_path):
    pool = make_pool("host", capacity="1G", conf="history_entries:16384")
    live = _drive(pool, random.Random(1), 300, SIZES)
    snap, stats = pool.snapshot(), pool.stats()
    path = tmp_path / "pool.pickle"
    path.write_bytes(pickle.dumps(snap))
    trace = import_torch_snapshot(path)
    trace.validate()
    mallocs = sum(e["action"] == "alloc" for e in snap["device_traces"][0])
    assert len(trace.ops) == mallocs
    assert not any(s.initial for s in trace.storages), "the history covers the pool's whole life"
    assert sum(s.outlives for s in trace.storages) == len(live)
    # The trace's live bytes follow the events exactly: its peak lies between
    # the pool's requested and allocated (rounded, unsplit) peaks.
    assert stats["requested_bytes.all.peak"] <= trace.peak_live_bytes() <= stats["allocated_bytes.all.peak"]
    r = dtralloc.replay(trace, check_invariants=True)
    assert r.feasible and r.peak_allocated_bytes >= trace.peak_live_bytes()
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes


def test_wrapped_history_makes_earlier_blocks_initial(make_pool):
    pool = make_pool("host", capacity="1G", conf="history_entries:40")
    live = _drive(pool, random.Random(2), 200, SIZES[:4])
    snap = pool.snapshot()
    assert len(snap["device_traces"][0]) == 40
    trace = import_torch_snapshot(snap)
    trace.validate()
    initial = [s for s in trace.storages if s.initial]
    assert initial, "blocks allocated before the kept history"
    # Every block still allocated at the end is a storage that outlives.
    assert sum(s.outlives for s in trace.storages) == len(live)
    assert dtralloc.replay(trace, check_invariants=True).feasible
