"""The publisher behind `dtralloc top` (allocator/publisher.h): one file per
process and device, frames that equal the pool's stats, a seqlock that never
hands out a torn frame, and files that go away with their publisher."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from _pool_workload import MiB, drive, make

from dtralloc import _core
from dtralloc._native import fake_cudart_path
from dtralloc.top.reader import LAYOUT, published_paths, read_frame

WORKER = os.path.join(os.path.dirname(__file__), "_publisher_worker.py")


def settled_frame(pool, path):
    """A frame taken after the pool stopped changing."""
    time.sleep(0.03)  # several 5 ms periods
    return read_frame(path)


def test_a_published_pool_reads_back_as_its_stats():
    pool = make("budget:30G,history_entries:0")
    drive(pool, 600, seed=1, checkpoints=0)
    path = pool.publish(5.0, "pool virtual")
    assert path == pool.published_path
    assert os.path.basename(path).startswith(f"dtralloc-{os.getpid()}-0")
    assert os.path.getsize(path) == LAYOUT["file_bytes"]
    f = settled_frame(pool, path)
    s = pool.stats()
    assert f.label == "pool virtual" and f.pid == os.getpid() and f.device == 0
    assert f["period_us"] == 5000 and f["frame"] >= 2
    for key, stat in [("reserved_bytes", "reserved_bytes.all.current"), ("allocated_bytes", "allocated_bytes.all.current"),
                      ("active_bytes", "active_bytes.all.current"), ("requested_bytes", "requested_bytes.all.current"),
                      ("peak_reserved_bytes", "reserved_bytes.all.peak"),
                      ("peak_allocated_bytes", "allocated_bytes.all.peak"),
                      ("largest_free_bytes", "fragmentation.largest_free_bytes"),
                      ("free_bytes", "fragmentation.free_bytes"), ("segments", "segment.all.current"),
                      ("allocations", "allocation.all.current"), ("num_device_alloc", "num_device_alloc"),
                      ("num_device_free", "num_device_free"), ("budget_bytes", "budget_bytes")]:
        assert f[key] == s[stat], key
    # The segment table: one row per segment, as the snapshot walks them.
    snap = {seg["address"]: seg for seg in pool.snapshot()["segments"]}
    assert f["segment_count"] == len(snap) == len(f.segments)
    for row in f.segments:
        seg = snap[row["addr"]]
        free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        assert row["size"] == seg["total_size"] and row["allocated_bytes"] == seg["allocated_size"]
        assert row["free_bytes"] == sum(free) and row["largest_free_bytes"] == max(free, default=0)
        assert row["blocks"] == len(seg["blocks"]) and row["small_pool"] == (seg["segment_type"] == "small")
    pool.publish(0, "")
    assert not os.path.exists(path) and pool.published_path == ""


def test_counts_from_a_dtr_session_reach_the_frames():
    pool = make()
    path = pool.publish(5.0, "pool")
    pool.add_published_counts(3, 1)
    pool.add_published_counts(2, 0)
    f = settled_frame(pool, path)
    assert (f["evictions"], f["remats"]) == (5, 1)
    assert f.samples[-1]["evictions"] == 5


def test_samples_hold_the_peak_between_two_reads():
    pool = make()
    path = pool.publish(2.0, "pool")
    time.sleep(0.02)
    before = read_frame(path)
    big = pool.malloc(1 << 30)
    time.sleep(0.02)
    pool.free(big)
    after = settled_frame(pool, path)
    assert after["allocated_bytes"] == 0
    newer = [s for s in after.samples if s["time_us"] > before["time_us"]]
    assert max(s["allocated_bytes"] for s in newer) == 1 << 30
    times = [s["time_us"] for s in after.samples]
    assert times == sorted(times) and len(times) >= 10


def test_two_pools_of_one_device_get_files_of_their_own_and_lose_them_when_freed():
    a, b = make(), make()
    pa, pb = a.publish(5.0, "a"), b.publish(5.0, "b")
    assert pa != pb and os.path.exists(pa) and os.path.exists(pb)
    assert pa in published_paths(os.getpid()) and pb in published_paths(os.getpid())
    del a
    import gc

    gc.collect()
    assert not os.path.exists(pa) and os.path.exists(pb)


def test_frames_are_never_torn_while_the_pool_runs_flat_out():
    """The GIL-free C++ churn loop changes the pool while frames are read;
    every frame must be one moment (the sample it appended is its header)."""
    pool = make()
    path = pool.publish(0.2, "pool")
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            _core.bench_pool_churn(pool, [4096, 3 * MiB, 12 * MiB], 4, 20000, 1, 1, True)

    t = threading.Thread(target=churn)
    t.start()
    frames = []
    try:
        deadline = time.time() + 1.0
        while time.time() < deadline:
            f = read_frame(path)
            assert f is not None
            frames.append(f)
    finally:
        stop.set()
        t.join()
    assert len({f["frame"] for f in frames}) > 20
    for f in frames:
        last = f.samples[-1]
        assert last["time_us"] == f["time_us"]
        assert (last["reserved_bytes"], last["allocated_bytes"]) == (f["reserved_bytes"], f["allocated_bytes"])
        assert f["allocated_bytes"] <= f["reserved_bytes"]
        if f["segments_time_us"] == f["time_us"]:  # the table was taken in this frame
            assert sum(s["size"] for s in f.segments) == f["reserved_bytes"]


def _worker(kind: str, env=None):
    proc = subprocess.Popen([sys.executable, WORKER, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    line = proc.stdout.readline()
    assert line, "the worker died before publishing"
    return proc, json.loads(line)


def test_the_process_wide_allocator_publishes_by_itself_and_its_file_goes_at_exit():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    env["DTRALLOC_CUDART"] = fake_cudart_path()
    proc, info = _worker("global", env)
    try:
        path = info["path"]
        assert os.path.basename(path) == f"dtralloc-{proc.pid}-0"
        f = read_frame(path)
        assert f.label == "cuda" and f.pid == proc.pid
        assert f["allocated_bytes"] == info["stats"]["allocated_bytes.all.current"]
        assert f["reserved_bytes"] == info["stats"]["reserved_bytes.all.current"]
    finally:
        proc.communicate("exit\n", timeout=30)
    assert proc.returncode == 0
    assert not os.path.exists(path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_leaves_the_parents_file_alone():
    """A DataLoader worker is a fork of the training process; its exit must
    not remove the file the training process still writes."""
    proc = subprocess.run([sys.executable, WORKER, "fork"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.splitlines()[-1])
    assert info["after_child_exit"] is True and info["after_parent_stops"] is False
