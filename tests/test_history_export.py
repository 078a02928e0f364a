"""The allocator's history as dashboards read it: op stamps, the columns read
straight out of the ring (Pool.history, snapshot(columns=True)), and the
history model (lifetimes, largest free block per event) checked against the
pool's own stats at moments captured while it ran."""
from __future__ import annotations

import numpy as np
import pytest
from _pool_workload import MiB, drive, expected, make

import dtralloc
from dtralloc.dashboard.history import ACTION, build_history, event_columns

memory_viz = pytest.importorskip("torch.cuda._memory_viz")


def test_op_stamps_mark_every_event_from_the_stamp_on():
    pool = make()
    assert pool.op_stamp == -1
    a = pool.malloc(1000)
    pool.set_op_stamp(7)
    b = pool.malloc(5 * MiB)
    pool.free(a)
    pool.set_op_stamp(8)
    pool.free(b)
    h = pool.history()
    names = [h["action_names"][c] for c in h["action"]]
    assert names == ["segment_alloc", "alloc", "segment_alloc", "alloc", "free_requested", "free_completed",
                     "free_requested", "free_completed"]
    assert h["op"].tolist() == [-1, -1, 7, 7, 7, 7, 8, 8]
    assert h["op"].dtype == np.int32


def test_history_columns_hold_what_the_dict_snapshot_holds():
    pool = make()
    drive(pool, 800, seed=3)
    cols = pool.history()
    dicts = pool.snapshot()["device_traces"][0]
    assert len(dicts) == cols["action"].size > 500
    names = cols["action_names"]
    assert [names[c] for c in cols["action"]] == [e["action"] for e in dicts]
    for key in ("addr", "size", "stream", "time_us"):
        assert cols[key].tolist() == [e[key] for e in dicts], key
    # alloc rows carry the placed block (rounded: >= the request, a 512 multiple).
    alloc = cols["action"] == ACTION["alloc"]
    assert np.all(cols["block_size"][alloc] >= cols["size"][alloc])
    assert np.all(cols["block_size"][alloc] % 512 == 0)
    assert np.all(cols["block_size"][~alloc] == 0)


def test_columns_snapshot_keeps_the_segments_and_reads_the_ring_in_order_after_it_wrapped():
    pool = make("history_entries:300")
    drive(pool, 2000, seed=5)
    snap = pool.snapshot(columns=True)
    plain = pool.snapshot()
    assert snap["segments"] == plain["segments"]
    cols = snap["device_traces"][0]
    assert cols["action"].size == 300 == len(plain["device_traces"][0])
    assert cols["addr"].tolist() == [e["addr"] for e in plain["device_traces"][0]]
    # The default stays what torch's tools read.
    assert "Summary of segments" in memory_viz.segsum(plain) and memory_viz.trace(plain)


def test_oom_rows_keep_device_free():
    pool = make("budget:64M,history_entries:64")
    keep = pool.malloc(40 * MiB)
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(30 * MiB)
    cols = pool.history()
    oom = cols["action"] == ACTION["oom"]
    assert cols["device_free"][oom].tolist() == [64 * MiB - 40 * MiB]
    assert pool.snapshot()["device_traces"][0][-1]["device_free"] == 24 * MiB
    pool.free(keep)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_model_totals_equal_the_pool_stats_where_they_were_taken(seed):
    pool = make("history_entries:100000,max_split_size_mb:64" if seed == 1 else "history_entries:100000")
    captured = drive(pool, 3000, seed=seed)
    h = build_history(pool.history(), [])
    assert h.model["anomalies"] == 0
    assert len(captured) > 50
    for event, stats in captured:
        got = h.totals_at(event)
        assert {k: got[k] for k in expected(stats)} == expected(stats), event


def test_model_of_a_wrapped_ring_starts_from_what_the_end_state_implies():
    pool = make("history_entries:2000")
    captured = drive(pool, 5000, seed=4)
    snap = pool.snapshot(columns=True)
    h = build_history(snap["device_traces"][0], snap["segments"])
    assert h.model["anomalies"] == 0
    first = pool.history_size  # the ring holds the last 2000 events
    total_events = captured[-1][0]  # history_size - 1 stays at 1999 once full: use the final state
    assert first == 2000 and total_events == 1999
    final = pool.stats()
    got = h.totals_at(h.n - 1)
    assert {k: got[k] for k in expected(final)} == expected(final)
    # Blocks from before the ring's first event are in the model (start -1).
    assert np.any(h.model["block_start"] == -1)


def test_torch_layout_dicts_model_reserved_exactly_and_blocks_by_their_requested_sizes():
    """A torch history records requested sizes only; the model places blocks
    at 512-byte rounding, and at their real size when they are still allocated
    in the final segments."""
    pool = make("history_entries:100000")
    drive(pool, 1500, seed=6, streams=False)
    final = pool.stats()
    cols, labels, made_by = event_columns(pool.snapshot()["device_traces"][0])
    h = build_history(cols, pool.snapshot()["segments"], labels, made_by)
    got = h.totals_at(h.n - 1)
    assert got["reserved"] == final["reserved_bytes.all.current"]
    assert got["allocated"] == final["allocated_bytes.all.current"]  # alive blocks: sizes from the segments
    assert got["requested"] == final["requested_bytes.all.current"]


def test_torch_frames_name_what_made_each_block():
    base = 0x7F0000000000
    frame = lambda name, file, line: {"name": name, "filename": file, "line": line}  # noqa: E731
    events = [
        {"action": "segment_alloc", "addr": base, "size": 20 * MiB, "stream": 0, "time_us": 1, "frames": []},
        {"action": "alloc", "addr": base, "size": 3 * MiB, "stream": 0, "time_us": 2,
         "frames": [frame("empty", "/site-packages/torch/nn/functional.py", 10), frame("forward", "/home/me/model.py", 42)]},
        {"action": "alloc", "addr": base + 3 * MiB, "size": 1000, "stream": 0, "time_us": 3, "frames": []},
    ]
    cols, labels, made_by = event_columns(events)
    h = build_history(cols, [], labels, made_by)
    assert [labels[i] for i in h.block_label] == ["forward (model.py:42)", ""]
    assert h.totals_at(2)["allocated"] == 3 * MiB + 1024


def test_inconsistent_histories_are_counted_not_thrown():
    base = 0x10000
    events = [
        {"action": "free_completed", "addr": base, "size": 512},                # a block from before, in no segment
        {"action": "alloc", "addr": base + (1 << 30), "size": 512},            # outside every segment
        {"action": "segment_free", "addr": base + (2 << 30), "size": 2 * MiB},  # a segment from before: fine
        {"action": "mystery", "addr": 0, "size": 0},
    ]
    cols, _, _ = event_columns(events)
    h = build_history(cols, [])
    # The first block cannot be placed nor released, the second not placed,
    # the last action is unknown.
    assert h.model["anomalies"] == 4
    assert h.totals_at(3)["reserved"] == 0 and h.totals_at(-1)["reserved"] == 2 * MiB


def test_largest_free_block_per_event_matches_the_pool_after_every_event():
    pool = make()
    largest = []
    for size in (3 * MiB, 5 * MiB, 1 * MiB, 2 * MiB):
        pool.malloc(size)
        largest.append((pool.history_size - 1, pool.stats()["fragmentation.largest_free_bytes"]))
    h = build_history(pool.history(), [])
    for event, value in largest:
        assert h.model["largest_free"][event] == value


def test_model_follows_unmap_pages_cuts_through_segments():
    # unmap_pages cuts free pages out of segments still in use: the history
    # records segment_unmap for the range, and the model splits the segment
    # there (its blocks untouched), as the pool does. Checked against the
    # pool's stats after every event of a random workload under a budget.
    import random

    pool = make("history_entries:100000,budget:120M,unmap_pages:on")
    rng = random.Random(5)
    live, captured = [], []
    for _ in range(4000):
        if live and rng.random() < 0.45:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(pool.malloc(rng.choice([512, 300 << 10, 3 * MiB, 7 * MiB, 12 * MiB, 26 * MiB])))
            except dtralloc.OutOfMemoryError:
                pass
        captured.append((pool.history_size - 1, pool.stats()))
        pool.check_invariants()
    assert pool.stats()["num_page_releases"] > 20
    cols = pool.history()
    assert int(np.sum(cols["action"] == ACTION["segment_unmap"])) == pool.stats()["num_page_releases"]
    h = build_history(cols, [])
    assert h.model["anomalies"] == 0
    for event, stats in captured:
        got = h.totals_at(event)
        assert {k: got[k] for k in expected(stats)} == expected(stats), event
