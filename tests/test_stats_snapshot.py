"""Observability: memory_stats keys and values, fragmentation, snapshot layout
(read by torch's own torch.cuda._memory_viz), the event ring buffer, the OOM
message and the summary table.

The promise is "torch's memory tools read dtralloc's output", so the tests
feed dtralloc's dicts to torch's functions and check what they print.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import io
import inspect
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
from conftest import MiB, blocks_by_address

import dtralloc
from dtralloc.stats import format_summary

memory_viz = pytest.importorskip("torch.cuda._memory_viz")

# --------------------------------------------------------------------------
# torch.cuda.memory_stats() key names, hard-coded from the docstring of
# torch/cuda/memory.py::memory_stats (torch 2.13). The docstring's
# "allocated.{...}" is a typo in torch for "allocation.{...}": torch's own
# memory_summary reads "allocation.all.current".

_POOLS = ("all", "large_pool", "small_pool")
_METRICS = ("current", "peak", "allocated", "freed")
TORCH_POOL_STATS = (
    "allocation",
    "allocated_bytes",
    "segment",
    "reserved_bytes",
    "active",
    "active_bytes",
    "inactive_split",
    "inactive_split_bytes",
    "requested_bytes",
)
TORCH_PLAIN_STATS = ("oversize_allocations", "oversize_segments")
TORCH_SCALARS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "num_oom_rejections",
    "max_split_size",
)
TORCH_STAT_KEYS = frozenset(
    [f"{s}.{p}.{m}" for s in TORCH_POOL_STATS for p in _POOLS for m in _METRICS]
    + [f"{s}.{m}" for s in TORCH_PLAIN_STATS for m in _METRICS]
    + list(TORCH_SCALARS)
)
# dtralloc's own additions (DESIGN.md section 2 and stats.h).
DTRALLOC_EXTRA_KEYS = frozenset(
    {
        "budget_bytes",
        "capacity_bytes",
        "num_invalid_frees",
        "num_eviction_calls",
        "num_page_releases",
        "num_long_lived",
        "num_split_limit_overrides",
        "num_device_pool_waits",
        "device_alloc_ns",
        "device_free_ns",
        "fragmentation.largest_free_bytes",
        "fragmentation.free_bytes",
        "fragmentation.external",
        "fragmentation.reserved_unallocated_bytes",
    }
)

# torch.cuda.memory._snapshot() layout (TypedDicts in its docstring, plus the
# fields torch's C++ emits and _memory_viz reads).
SEGMENT_KEYS = {"address", "total_size", "stream", "segment_type", "segment_pool_id",
                "allocated_size", "active_size", "requested_size", "blocks", "device"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
TRACE_KEYS = {"action", "addr", "size", "stream", "frames", "time_us"}
BLOCK_STATES = {"active_allocated", "active_pending_free", "inactive"}
TRACE_ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom"}


def busy_pool(make_pool, **kw):
    """A pool in a mixed state: small and large segments, two streams, a
    split segment with holes, a pending block, an oversize-free cache."""
    pool = make_pool(**kw)
    held = [pool.malloc(n) for n in (700, 5000, 3 * MiB, 2 * MiB + 1, 4 * MiB, 12 * MiB)]
    held.append(pool.malloc(9000, stream=2))
    pool.free(held.pop(3))  # a hole between 3 MiB and 4 MiB
    pending = pool.malloc(6000)
    pool.record_stream(pending, 5)
    pool.free(pending)
    pool.free(pool.malloc(30 * MiB))  # a whole free cached segment
    return pool, held


# --------------------------------------------------------------------------
# keys


def test_stats_have_every_key_torch_reports(make_pool):
    pool, _ = busy_pool(make_pool)
    missing = sorted(TORCH_STAT_KEYS - set(pool.stats()))
    assert not missing, f"keys torch.cuda.memory_stats() has and dtralloc lacks: {missing}"


def test_extra_keys_are_only_dtralloc_own(make_pool):
    pool, _ = busy_pool(make_pool)
    extra = set(pool.stats()) - TORCH_STAT_KEYS
    assert extra == DTRALLOC_EXTRA_KEYS


def test_stat_values_are_ints_like_torch(make_pool):
    pool, _ = busy_pool(make_pool)
    for key, value in pool.stats().items():
        if key == "fragmentation.external":
            assert isinstance(value, float) and 0.0 <= value < 1.0
        elif key == "max_split_size":
            assert value == -1 or value > 0
        else:
            assert isinstance(value, int) and value >= 0, (key, value)


def test_torch_memory_summary_reads_dtralloc_stats(make_pool, monkeypatch):
    import torch

    pool, _ = busy_pool(make_pool)
    monkeypatch.setattr(torch.cuda.memory, "memory_stats", lambda device=None: pool.stats())
    text = torch.cuda.memory_summary(device=0)
    s = pool.stats()
    reserved_kib = s["reserved_bytes.all.current"] // 1024
    assert re.search(rf"GPU reserved memory\s*\|\s*{reserved_kib} KiB", text), text
    assert re.search(rf"Allocations\s*\|\s*{s['allocation.all.current']} ", text), text


# --------------------------------------------------------------------------
# values


def test_counters_follow_a_scripted_sequence(make_pool):
    pool = make_pool()
    a = pool.malloc(1000)        # 1024 B, small pool
    b = pool.malloc(3 * MiB)     # large pool
    pool.free(a)
    c = pool.malloc(500)         # 512 B
    s = pool.stats()
    assert s["allocated_bytes.all.current"] == 3 * MiB + 512
    assert s["allocated_bytes.all.peak"] == 3 * MiB + 1024
    assert s["allocated_bytes.all.allocated"] == 3 * MiB + 1024 + 512
    assert s["allocated_bytes.all.freed"] == 1024
    assert s["allocated_bytes.small_pool.current"] == 512
    assert s["allocated_bytes.large_pool.current"] == 3 * MiB
    assert s["requested_bytes.all.current"] == 3 * MiB + 500
    assert s["allocation.all.current"] == 2
    assert s["allocation.all.allocated"] == 3
    assert s["allocation.all.freed"] == 1
    assert s["active.all.current"] == 2
    assert s["segment.small_pool.current"] == 1 and s["segment.large_pool.current"] == 1
    assert s["reserved_bytes.all.current"] == 22 * MiB
    assert s["num_device_alloc"] == 2 and s["num_device_free"] == 0
    assert s["num_ooms"] == 0 and s["num_alloc_retries"] == 0

    pool.reset_peak_stats()
    assert pool.stats()["allocated_bytes.all.peak"] == 3 * MiB + 512
    pool.free(b)
    pool.free(c)
    pool.empty_cache()
    s = pool.stats()
    assert s["reserved_bytes.all.current"] == 0
    assert s["reserved_bytes.all.freed"] == 22 * MiB
    assert s["num_device_free"] == 2
    pool.reset_accumulated_stats()
    s = pool.stats()
    assert s["allocated_bytes.all.allocated"] == 0 and s["allocated_bytes.all.freed"] == 0
    assert s["num_device_alloc"] == 0 and s["num_device_free"] == 0
    assert s["reserved_bytes.all.peak"] == 22 * MiB  # peaks are reset separately


def test_fragmentation_keys(make_pool):
    pool = make_pool()
    blocks = [pool.malloc(2 * MiB) for _ in range(5)]  # 10 MiB of a 20 MiB segment
    pool.free(blocks[1])
    pool.free(blocks[3])
    s = pool.stats()
    # free: 2 + 2 + 10 (tail) = 14 MiB, the largest piece 10 MiB
    assert s["fragmentation.largest_free_bytes"] == 10 * MiB
    assert s["fragmentation.free_bytes"] == 14 * MiB
    assert s["fragmentation.external"] == pytest.approx(1 - 10 / 14)
    assert s["fragmentation.reserved_unallocated_bytes"] == 14 * MiB
    # A block waiting on another stream is reserved and unallocated, not free.
    pool.record_stream(blocks[0], 3)
    pool.free(blocks[0])
    s = pool.stats()
    assert s["fragmentation.free_bytes"] == 14 * MiB
    assert s["fragmentation.reserved_unallocated_bytes"] == 16 * MiB
    pool.complete_events()  # 0 merges with 1: free 4 + 2 + 10
    s = pool.stats()
    assert s["fragmentation.free_bytes"] == 16 * MiB
    assert s["fragmentation.external"] == pytest.approx(1 - 10 / 16)
    for i in (2, 4):
        pool.free(blocks[i])
    s = pool.stats()
    assert s["fragmentation.external"] == 0.0  # one free block: no external fragmentation
    assert s["fragmentation.largest_free_bytes"] == 20 * MiB


def test_empty_pool_has_zero_fragmentation(make_pool):
    s = make_pool().stats()
    assert s["fragmentation.external"] == 0.0
    assert s["fragmentation.largest_free_bytes"] == 0


# --------------------------------------------------------------------------
# snapshot layout


def test_snapshot_layout_matches_torch(make_pool):
    pool, held = busy_pool(make_pool)
    snap = pool.snapshot()
    assert set(snap) >= {"segments", "device_traces"}
    assert len(snap["device_traces"]) == 1
    for seg in snap["segments"]:
        assert set(seg) >= SEGMENT_KEYS
        assert seg["segment_type"] in ("small", "large")
        assert seg["device"] == 0
        addr = seg["address"]
        for block in seg["blocks"]:
            assert set(block) >= BLOCK_KEYS
            assert block["state"] in BLOCK_STATES
            assert block["address"] == addr  # blocks tile the segment
            addr += block["size"]
            if block["state"] != "active_allocated":
                assert block["requested_size"] == block["size"]  # what torch reports
        assert addr == seg["address"] + seg["total_size"]
    for entry in snap["device_traces"][0]:
        assert set(entry) >= TRACE_KEYS
        assert entry["action"] in TRACE_ACTIONS
    pickle.loads(pickle.dumps(snap))  # can be saved for pytorch.org/memory_viz
    for h in held:
        assert blocks_by_address(pool)[h][1]["state"] == "active_allocated"


def test_snapshot_totals_equal_stats(make_pool):
    pool, _ = busy_pool(make_pool)
    snap, s = pool.snapshot(), pool.stats()
    segs = snap["segments"]
    assert sum(x["total_size"] for x in segs) == s["reserved_bytes.all.current"]
    assert sum(x["allocated_size"] for x in segs) == s["allocated_bytes.all.current"]
    assert sum(x["active_size"] for x in segs) == s["active_bytes.all.current"]
    assert sum(x["requested_size"] for x in segs) == s["requested_bytes.all.current"]
    assert len(segs) == s["segment.all.current"]
    small = [x for x in segs if x["segment_type"] == "small"]
    assert sum(x["total_size"] for x in small) == s["reserved_bytes.small_pool.current"]
    states = [b["state"] for x in segs for b in x["blocks"]]
    assert states.count("active_allocated") == s["allocation.all.current"]
    assert states.count("active_pending_free") == 1
    assert {x["stream"] for x in segs} == {0, 2}


# --------------------------------------------------------------------------
# torch's _memory_viz on dtralloc's snapshot


def _identity(text):
    return text


def test_memory_viz_segsum_reports_the_totals(make_pool):
    pool, _ = busy_pool(make_pool)
    snap, s = pool.snapshot(), pool.stats()
    text = memory_viz.segsum(snap)  # raises if blocks do not add up to segments
    Bytes = memory_viz.Bytes
    requested_active = sum(b["requested_size"] for seg in snap["segments"] for b in seg["blocks"]
                           if b["state"] == "active_allocated")
    assert s["requested_bytes.all.current"] == requested_active
    assert f"segments: {s['segment.all.current']}\n" in text
    assert f"total_reserved: {Bytes(s['reserved_bytes.all.current'])}\n" in text
    assert f"total_allocated: {Bytes(requested_active)}\n" in text
    free = s["reserved_bytes.all.current"] - requested_active
    assert f"total_free: {Bytes(free)}" in text
    # Segments of 20 MiB and more get a line each.
    big = [seg for seg in snap["segments"] if seg["total_size"] >= 20 * MiB]
    assert len(re.findall(r"^\[.*\] .* allocated, .* free", text, re.M)) == len(big)


@pytest.mark.parametrize("fn", ["segments", "memory"])
def test_memory_viz_flamegraph_input_covers_every_byte(make_pool, fn):
    pool, _ = busy_pool(make_pool)
    snap, s = pool.snapshot(), pool.stats()
    text = getattr(memory_viz, fn)(snap, format_flamegraph=_identity)
    per_state = {}
    for line in text.strip().splitlines():
        frames, count = line.rsplit(" ", 1)
        state = next(p for p in frames.split(";") if p in BLOCK_STATES)
        per_state[state] = per_state.get(state, 0) + int(count)
        assert frames.startswith("stream_")
    assert sum(per_state.values()) == s["reserved_bytes.all.current"]
    # allocated blocks: requested bytes plus <gaps> (rounding) = block sizes
    assert per_state["active_allocated"] == s["allocated_bytes.all.current"]
    assert per_state["active_pending_free"] == s["active_bytes.all.current"] - s["allocated_bytes.all.current"]


def test_memory_viz_trace_replays_the_history(make_pool):
    pool = make_pool(backend="virtual", capacity="1G", conf="budget:64M,history_entries:1024")
    a = pool.malloc(3 * MiB)
    b = pool.malloc(700)
    pool.free(b)
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(100 * MiB)
    pool.free(a)
    pool.empty_cache()
    snap = pool.snapshot()
    text = memory_viz.trace(snap)
    Bytes = memory_viz.Bytes
    trace = snap["device_traces"][0]
    assert "Device 0 ----" in text
    assert f"{len(trace)} entries" in text
    assert text.count("= cudaMalloc(") == 2
    assert text.count("cudaFree(") == 2
    assert text.count("del ") == 2
    assert text.count("# free completed for") == 2
    assert f"= cudaMalloc({a}, {Bytes(20 * MiB)})" in text
    # OOM: the request and what the budget still allowed once the retry had
    # released the cached small segment (64 - 20 MiB).
    assert f"raise OutOfMemoryError # {Bytes(100 * MiB)} requested, {Bytes(44 * MiB)} free in CUDA" in text


def test_memory_viz_html_plots_embed_the_snapshot(make_pool):
    pool, _ = busy_pool(make_pool)
    snap = pool.snapshot()
    for html in (memory_viz.trace_plot(snap), memory_viz.segment_plot(snap),
                 memory_viz.trace_plot(snap, plot_segments=True)):
        payload = re.search(r"const local_files = (\[.*?\])\n", html).group(1)
        buffer = base64.b64decode(json.loads(payload)[0]["base64"])
        assert pickle.loads(buffer) == snap


def test_every_free_completed_follows_a_free_requested(make_pool):
    # torch's filter_alloc_free_pairs prints a complaint for an unpaired event.
    if "filter_freed" not in inspect.signature(memory_viz.trace_plot).parameters:
        pytest.skip("this torch's trace_plot has no filter_freed (torch 2.9 added it)")
    pool, held = busy_pool(make_pool)
    pool.complete_events()
    for h in held:
        pool.free(h)
    pool.empty_cache()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        filtered = memory_viz.trace_plot(copy.deepcopy(pool.snapshot()), filter_freed=True)
    assert "without free_requested" not in out.getvalue()
    assert filtered


# --------------------------------------------------------------------------
# device_traces ring buffer


def test_trace_records_each_kind_of_event_in_order(make_pool):
    pool = make_pool(backend="virtual", capacity="1G", conf="budget:64M,history_entries:1024")
    a = pool.malloc(1000)
    pool.record_stream(a, 1)
    pool.free(a)
    pool.complete_events()
    pool.empty_cache()
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(65 * MiB, stream=3)
    trace = pool.snapshot()["device_traces"][0]
    # As torch records them: alloc and free entries carry the requested size,
    # segment entries the segment size, oom the request that failed.
    assert [(e["action"], e["size"]) for e in trace] == [
        ("segment_alloc", 2 * MiB),
        ("alloc", 1000),
        ("free_requested", 1000),
        ("free_completed", 1000),
        ("segment_free", 2 * MiB),
        ("oom", 65 * MiB),
    ]
    assert all(e["addr"] == a for e in trace[:5])
    assert trace[-1]["stream"] == 3
    assert trace[-1]["device_free"] == 64 * MiB  # what the budget still allowed
    times = [e["time_us"] for e in trace]
    assert times == sorted(times)


def test_ring_buffer_keeps_the_newest_entries(make_pool):
    pool = make_pool(backend="virtual", conf="history_entries:8")
    for i in range(1, 21):
        pool.malloc(512 * i)  # alloc sizes 512, 1024, ... identify the events
    trace = pool.snapshot()["device_traces"][0]
    assert len(trace) == 8
    assert [e["size"] for e in trace] == [512 * i for i in range(13, 21)]  # oldest first
    assert all(e["action"] == "alloc" for e in trace)


def test_ring_buffer_not_yet_full_exactly_full_and_wrapped(make_pool):
    pool = make_pool(backend="virtual", conf="history_entries:4")

    def sizes():
        return [e["size"] for e in pool.snapshot()["device_traces"][0]]

    pool.malloc(512)  # segment_alloc + alloc
    assert sizes() == [2 * MiB, 512]
    pool.malloc(1024)
    pool.malloc(1536)
    assert sizes() == [2 * MiB, 512, 1024, 1536]
    pool.malloc(2048)
    assert sizes() == [512, 1024, 1536, 2048]


def test_no_history_when_history_entries_is_zero(make_pool):
    pool = make_pool(backend="virtual", conf="history_entries:0")
    pool.free(pool.malloc(100))
    assert pool.snapshot()["device_traces"] == [[]]
    assert memory_viz.trace(pool.snapshot()) == ""


def test_device_index_shapes_the_snapshot(make_pool):
    pool = make_pool(backend="virtual", device=2, conf="history_entries:16")
    pool.malloc(100)
    snap = pool.snapshot()
    assert [len(t) for t in snap["device_traces"]] == [0, 0, 2]
    assert snap["segments"][0]["device"] == 2
    assert "Device 2 ----" in memory_viz.trace(snap)


# --------------------------------------------------------------------------
# the OOM message


def _field(message, label, value):
    return re.search(rf"{label}[^.]*?\b{re.escape(value)}", message, re.I)


def test_oom_message_explains_fragmentation(make_pool):
    pool = make_pool(backend="virtual", capacity="1G", conf="budget:40M")
    # Two 20 MiB segments, each [8 free][8 used][4 free]: 24 MiB free, 8 MiB at most in one piece.
    x1, x2, y1, y2 = (pool.malloc(8 * MiB) for _ in range(4))
    pool.free(x1)
    pool.free(y1)
    with pytest.raises(dtralloc.OutOfMemoryError) as excinfo:
        pool.malloc(9 * MiB, stream=0)
    msg = str(excinfo.value)
    assert _field(msg, "allocate", "9 MiB"), msg
    assert _field(msg, "budget", "40 MiB"), msg
    assert _field(msg, "reserved", "40 MiB"), msg
    assert _field(msg, "allocated", "16 MiB"), msg
    assert _field(msg, "largest free block", "8 MiB"), msg
    assert _field(msg, "fragmentation", "0.67"), msg
    assert "max_split_size_mb" in msg  # what to try for fragmentation
    assert "budget" in msg.split("Budget", 1)[1]  # ...and for the budget
    s = pool.stats()
    assert s["num_ooms"] == 1
    assert s["fragmentation.external"] == pytest.approx(1 - 8 / 24)


def test_oom_message_suggests_raising_the_budget(make_pool):
    pool = make_pool(backend="virtual", capacity="1G", conf="budget:64M")
    held = pool.malloc(50 * MiB)
    with pytest.raises(dtralloc.OutOfMemoryError) as excinfo:
        pool.malloc(20 * MiB, stream=7)
    msg = str(excinfo.value)
    assert _field(msg, "allocate", "20 MiB"), msg
    assert _field(msg, "budget", "64 MiB"), msg
    assert _field(msg, "reserved", "50 MiB"), msg
    assert _field(msg, "allocated", "50 MiB"), msg
    assert "0x7" in msg  # the stream
    assert re.search(r"DTRALLOC_CONF=budget", msg), msg
    assert "max_split_size_mb" not in msg  # not fragmented: don't send users the wrong way
    pool.free(held)


# --------------------------------------------------------------------------
# summaries


def test_format_summary_shows_the_numbers(make_pool):
    pool = make_pool(backend="virtual", capacity="1G", conf="budget:512M")
    a = pool.malloc(3 * MiB)
    pool.malloc(2 * MiB)
    pool.free(a)
    pool.malloc(5 * MiB)
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(600 * MiB)
    text = format_summary(pool.stats(), "my pool")
    lines = text.splitlines()
    assert "my pool" in lines[1]
    assert {len(line) for line in lines} == {78}, "every line of the table has the same width"

    def row(label):
        return next(line for line in lines if line.startswith(f"| {label}"))

    # current, peak, total allocated, total freed
    assert row("Allocated memory").split()[-9:-1] == ["7", "MiB", "7", "MiB", "10", "MiB", "3", "MiB"]
    assert row("  from small pool").split()[-9:-1] == ["0", "B"] * 4
    assert row("Reserved memory").split()[-9:-1] == ["20", "MiB", "20", "MiB", "20", "MiB", "0", "B"]
    assert row("Allocations").split()[-5:-1] == ["2", "2", "3", "1"]
    assert re.search(r"Budget 512 MiB", text)
    assert re.search(r"largest free block 10 MiB", text)
    assert re.search(r"OOMs 1\b", text)
    assert re.search(r"fragmentation 0\.23\b", text)  # free 3 + 10 MiB, largest 10


def test_format_summary_keeps_its_frame_with_large_numbers(make_pool):
    stats = make_pool().stats()
    stats.update({k: 10**12 for k in stats if k.startswith("num_")})
    stats["allocated_bytes.all.peak"] = 5 * 2**40
    lines = format_summary(stats, "t").splitlines()
    assert {len(line) for line in lines} == {78}
    assert "1000000000000" in "".join(lines)


def test_global_memory_stats_and_summary_in_a_fresh_process():
    """dtralloc.memory_stats / memory_summary / snapshot / empty_cache on the
    process-wide allocator (cuda backend, the project's fake CUDA runtime),
    with every way torch users name a device."""
    from dtralloc.testing import fake_cudart_path

    code = r"""
import torch, dtralloc
from dtralloc import _core
pool = _core.global_pool(0)
a = pool.malloc(3 << 20)
for dev in (None, 0, "cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0)):
    assert dtralloc.memory_stats(dev)["allocated_bytes.all.current"] == 3 << 20, dev
stats = dtralloc.memory_stats()
assert list(stats) == sorted(stats)
full, short = dtralloc.memory_summary(), dtralloc.memory_summary(abbreviated=True)
assert "from large pool" in full and "from large pool" not in short
assert "Allocated memory" in short
snap = dtralloc.snapshot()
assert sum(s["total_size"] for s in snap["segments"]) == 20 << 20
pool.free(a)
dtralloc.empty_cache()
assert dtralloc.memory_stats(0)["reserved_bytes.all.current"] == 0
try:
    dtralloc.memory_stats("cpu")
except ValueError as e:
    assert "cpu" in str(e)
else:
    raise AssertionError("cpu is not a CUDA device")
print("ok")
"""
    env = dict(os.environ, DTRALLOC_CUDART=fake_cudart_path())
    env.pop("DTRALLOC_CONF", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_history_is_off_by_default_and_record_history_turns_it_on(make_pool):
    pool = make_pool(backend="virtual", capacity="1G")
    pool.free(pool.malloc(1000))
    assert pool.history_entries == 0 and pool.snapshot()["device_traces"] == [[]]
    pool.record_history(3)
    a = pool.malloc(2000)
    pool.free(a)
    actions = [(e["action"], e["size"]) for e in pool.snapshot()["device_traces"][0]]
    assert actions == [("alloc", 2000), ("free_requested", 2000), ("free_completed", 2000)]
    pool.malloc(4000)  # the ring keeps the newest three
    assert [e["action"] for e in pool.snapshot()["device_traces"][0]] == [
        "free_requested", "free_completed", "alloc"]
    pool.record_history(0)
    assert pool.snapshot()["device_traces"] == [[]]
    with pytest.raises(ValueError, match="at most"):
        pool.record_history(1 << 40)
