"""dtralloc.Pool: torch's block-pool policy, streams, the budget and its
fallback ladder, the eviction hook, and robustness against bad frees.

Sizes and addresses are checked against the documented rule (conftest's
torch_round_size / torch_segment_size), never against the pool's own numbers.
"""
from __future__ import annotations

import ctypes

import pytest
from conftest import (
    KiB,
    MiB,
    blocks_by_address,
    stats_delta,
    torch_pool_kind,
    torch_round_size,
    torch_segment_size,
)

import dtralloc


def held_block(pool, addr):
    seg, block = blocks_by_address(pool)[addr]
    assert block["state"] == "active_allocated"
    return seg, block


# --------------------------------------------------------------------------
# sizes: rounding, small / large pool, segment sizes


SIZES = [1, 511, 512, 513, 4000, 1 * MiB - 1, 1 * MiB, 1 * MiB + 1, 3 * MiB + 7,
         10 * MiB - 512, 10 * MiB - 511, 10 * MiB, 10 * MiB + 1, 33 * MiB + 5]


@pytest.mark.parametrize("size", SIZES)
def test_request_is_rounded_and_served_from_the_documented_segment(make_pool, size):
    pool = make_pool()
    addr = pool.malloc(size)
    rounded = torch_round_size(size)
    seg, block = held_block(pool, addr)
    assert addr % 512 == 0
    assert block["requested_size"] == size
    assert seg["segment_type"] == torch_pool_kind(rounded)
    assert seg["total_size"] == torch_segment_size(rounded)
    s = pool.stats()
    pool_key = "small_pool" if rounded <= MiB else "large_pool"
    other = "large_pool" if pool_key == "small_pool" else "small_pool"
    assert s["requested_bytes.all.current"] == size
    assert s[f"allocated_bytes.{pool_key}.current"] == block["size"]
    assert s[f"allocated_bytes.{other}.current"] == 0
    assert s[f"reserved_bytes.{pool_key}.current"] == torch_segment_size(rounded)
    # The block is the rounded size, except where torch keeps a remainder of
    # at most 1 MiB attached instead of splitting it off (large pool).
    assert rounded <= block["size"] <= rounded + (0 if rounded <= MiB else MiB)
    pool.free(addr)


def test_small_requests_share_one_2mib_segment(make_pool):
    pool = make_pool()
    addrs = [pool.malloc(1000) for _ in range(2048)]  # 2048 * 1024 B = 2 MiB exactly
    s = pool.stats()
    assert s["segment.small_pool.current"] == 1
    assert s["reserved_bytes.all.current"] == 2 * MiB
    assert sorted(addrs) == [addrs[0] + i * 1024 for i in range(2048)]
    extra = pool.malloc(1000)
    assert pool.stats()["segment.small_pool.current"] == 2
    for a in addrs + [extra]:
        pool.free(a)


def test_large_requests_are_carved_from_20mib_segments(make_pool):
    pool = make_pool()
    a = pool.malloc(2 * MiB)
    b = pool.malloc(3 * MiB)
    c = pool.malloc(4 * MiB)
    assert (b - a, c - b) == (2 * MiB, 3 * MiB)
    assert pool.stats()["segment.large_pool.current"] == 1
    for x in (a, b, c):
        pool.free(x)


def test_huge_requests_get_their_own_segment_rounded_to_2mib(make_pool):
    pool = make_pool(backend="virtual", capacity="4G")
    a = pool.malloc(10 * MiB)
    b = pool.malloc(10 * MiB)
    segs = pool.snapshot()["segments"]
    assert sorted(s["total_size"] for s in segs) == [10 * MiB, 10 * MiB]
    c = pool.malloc(101 * MiB + 3)
    assert blocks_by_address(pool)[c][0]["total_size"] == 102 * MiB
    for x in (a, b, c):
        pool.free(x)


@pytest.mark.parametrize("divisions", [2, 4, 8, 16])
@pytest.mark.parametrize("size", [1000, 5000, 6145, 1200 * 1024, 5 * MiB + 1, 33 * MiB, 64 * MiB, 3 * MiB - 1])
def test_roundup_power2_divisions(make_pool, divisions, size):
    pool = make_pool(backend="virtual", conf=f"roundup_power2_divisions:{divisions}")
    addr = pool.malloc(size)
    rounded = torch_round_size(size, divisions)
    _, block = held_block(pool, addr)
    assert rounded <= block["size"] <= rounded + (0 if rounded <= MiB else MiB)
    assert pool.stats()["requested_bytes.all.current"] == size
    pool.free(addr)


def test_zero_size_and_null_free(make_pool):
    pool = make_pool()
    assert pool.malloc(0) == 0
    pool.free(0)  # a no-op, like free(NULL)
    assert pool.stats()["num_invalid_frees"] == 0
    assert pool.stats()["segment.all.current"] == 0


def test_an_impossible_size_is_refused_not_served():
    """A request near 2**64 bytes (dtralloc_malloc(-1) through the C ABI) must
    fail; rounding must not wrap around to a tiny block."""
    pool = dtralloc.Pool("virtual", capacity="1G")  # no make_pool: nothing real to leak
    for size in (2**64 - 1, 2**64 - 300, 2**63):
        with pytest.raises(dtralloc.OutOfMemoryError):
            pool.malloc(size)
        pool.check_invariants()
    assert pool.stats()["allocation.all.current"] == 0


# --------------------------------------------------------------------------
# best fit, split, coalesce


def test_best_fit_picks_the_smallest_free_block_that_fits(make_pool):
    pool = make_pool()
    # One 20 MiB segment: [2][x][4][x][3][x][rest]; free the 2, 4, 3 MiB holes.
    a2, x1, a4, x2, a3, x3 = (pool.malloc(int(n * MiB)) for n in (2, 1.5, 4, 1.5, 3, 1.5))
    assert pool.stats()["segment.all.current"] == 1
    for a in (a2, a4, a3):
        pool.free(a)
    assert pool.malloc(int(2.5 * MiB)) == a3  # 3 MiB is the best fit, not 4
    assert pool.malloc(int(1.5 * MiB)) == a2  # 2 MiB hole
    assert pool.malloc(4 * MiB) == a4


def test_split_remainder_stays_cached_as_inactive_split(make_pool):
    pool = make_pool()
    a = pool.malloc(6 * MiB)
    s = pool.stats()
    # 20 MiB segment, 6 MiB used: the 14 MiB rest is a free split block.
    assert s["inactive_split.large_pool.current"] == 1
    assert s["inactive_split_bytes.large_pool.current"] == 14 * MiB
    assert s["fragmentation.reserved_unallocated_bytes"] == 14 * MiB
    pool.free(a)
    s = pool.stats()
    assert s["inactive_split.all.current"] == 0  # whole again: releasable
    assert s["inactive_split_bytes.all.current"] == 0


def test_large_remainder_of_one_mib_or_less_is_not_split(make_pool):
    pool = make_pool()
    a = pool.malloc(9 * MiB)
    b = pool.malloc(9 * MiB)  # rest of the segment: 2 MiB
    pool.free(a)
    c = pool.malloc(int(8.5 * MiB))  # 0.5 MiB would be left: not worth a block
    assert c == a
    _, block = held_block(pool, c)
    assert block["size"] == 9 * MiB
    assert block["requested_size"] == int(8.5 * MiB)
    assert pool.stats()["allocated_bytes.all.current"] == 18 * MiB
    pool.free(c)
    pool.free(b)


def test_small_pool_splits_down_to_512_bytes(make_pool):
    pool = make_pool()
    x = pool.malloc(MiB)  # the largest small-pool request
    y = pool.malloc(MiB - 512)
    z = pool.malloc(512)  # the last 512 B of the 2 MiB small segment
    assert pool.stats()["segment.small_pool.current"] == 1
    assert z == x + 2 * MiB - 512
    for q in (x, y, z):
        pool.free(q)


def test_freed_neighbours_coalesce_at_once(make_pool):
    pool = make_pool()
    blocks = [pool.malloc(MiB * 2) for _ in range(5)]
    for i in (1, 3):
        pool.free(blocks[i])
    s = pool.stats()
    assert s["inactive_split.all.current"] == 3  # two holes + the tail
    pool.free(blocks[2])  # joins both holes into one 6 MiB block
    s = pool.stats()
    assert s["inactive_split.all.current"] == 2
    assert s["fragmentation.largest_free_bytes"] == 10 * MiB  # tail: 20 - 10
    by_addr = blocks_by_address(pool)
    assert by_addr[blocks[1]][1]["size"] == 6 * MiB
    assert by_addr[blocks[1]][1]["state"] == "inactive"
    pool.free(blocks[0])
    pool.free(blocks[4])
    [seg] = pool.snapshot()["segments"]
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [(20 * MiB, "inactive")]
    pool.check_invariants()


def test_empty_cache_releases_only_entirely_free_segments(make_pool):
    pool = make_pool()
    keep = pool.malloc(MiB * 3)
    gone = pool.malloc(MiB * 18)  # more than the 17 MiB left: own segment
    small = pool.malloc(100)
    pool.free(gone)
    pool.free(small)
    before = pool.stats()
    pool.empty_cache()
    s = pool.stats()
    assert s["segment.all.current"] == 1
    assert s["reserved_bytes.all.current"] == 20 * MiB
    assert s["num_device_free"] - before["num_device_free"] == 2
    assert pool.owns(keep)
    pool.free(keep)


# --------------------------------------------------------------------------
# streams and record_stream


def test_blocks_never_cross_streams(make_pool):
    pool = make_pool()
    a = pool.malloc(MiB, stream=1)
    pool.free(a)
    b = pool.malloc(MiB, stream=2)  # the cached block belongs to stream 1
    assert b != a
    segs = {s["stream"]: s for s in pool.snapshot()["segments"]}
    assert set(segs) == {1, 2}
    assert pool.malloc(MiB, stream=1) == a
    big = pool.malloc(5 * MiB, stream=3)
    assert blocks_by_address(pool)[big][0]["stream"] == 3


def test_record_stream_defers_reuse_until_the_event_completes(make_pool):
    pool = make_pool(conf="history_entries:1024")
    a = pool.malloc(4096)
    pool.record_stream(a, 7)
    pool.free(a)
    s = pool.stats()
    assert s["allocation.all.current"] == 0
    assert s["allocated_bytes.all.current"] == 0
    assert s["active.all.current"] == 1  # still in use on stream 7
    assert s["active_bytes.all.current"] == 4096
    assert blocks_by_address(pool)[a][1]["state"] == "active_pending_free"
    actions = [e["action"] for e in pool.snapshot()["device_traces"][0]]
    assert actions[-1] == "free_requested"
    b = pool.malloc(4096)
    assert b != a  # pending memory must not be handed out
    pool.check_invariants()
    pool.complete_events()
    assert pool.stats()["active.all.current"] == 1  # only b
    assert blocks_by_address(pool)[a][1]["state"] == "inactive"
    assert [e["action"] for e in pool.snapshot()["device_traces"][0]][-1] == "free_completed"
    assert pool.malloc(4096) == a


def test_record_stream_on_the_own_stream_frees_at_once(make_pool):
    pool = make_pool()
    a = pool.malloc(4096, stream=3)
    pool.record_stream(a, 3)
    pool.free(a)
    assert pool.stats()["active.all.current"] == 0
    assert pool.malloc(4096, stream=3) == a


def test_pending_block_is_not_merged_until_its_event_completes(make_pool):
    pool = make_pool()
    a, b, c = (pool.malloc(4096) for _ in range(3))
    pool.record_stream(b, 1)
    pool.free(a)
    pool.free(b)
    pool.free(c)
    states = [(blk["address"], blk["state"]) for blk in pool.snapshot()["segments"][0]["blocks"]]
    assert states[:2] == [(a, "inactive"), (b, "active_pending_free")]
    pool.check_invariants()
    pool.complete_events()
    [seg] = pool.snapshot()["segments"]
    assert [blk["state"] for blk in seg["blocks"]] == ["inactive"]


def test_block_used_on_several_streams_waits_for_all(make_pool):
    pool = make_pool()
    a = pool.malloc(8192)
    pool.record_stream(a, 1)
    pool.record_stream(a, 2)
    pool.record_stream(a, 2)  # recorded twice: one event
    pool.free(a)
    assert pool.stats()["active.all.current"] == 1
    pool.empty_cache()  # synchronizes: events complete, then releases
    s = pool.stats()
    assert s["active.all.current"] == 0
    assert s["segment.all.current"] == 0
    assert s["num_sync_all_streams"] == 1


def test_oom_path_waits_for_pending_events(make_pool):
    pool = make_pool(backend="virtual", conf="budget:40M")
    a = pool.malloc(30 * MiB)
    pool.record_stream(a, 5)
    pool.free(a)
    b = pool.malloc(30 * MiB)  # only possible once a's event is waited for
    assert b == a
    s = pool.stats()
    assert s["num_sync_all_streams"] == 1
    assert s["num_ooms"] == 0


# --------------------------------------------------------------------------
# the budget and the fallback ladder


def test_budget_caps_reserved_and_fails_with_oom(make_pool):
    pool = make_pool(backend="virtual", capacity="1G", conf="budget:64M")
    held = [pool.malloc(20 * MiB) for _ in range(3)]
    with pytest.raises(dtralloc.OutOfMemoryError) as excinfo:
        pool.malloc(20 * MiB)
    assert isinstance(excinfo.value, MemoryError)
    s = pool.stats()
    assert s["reserved_bytes.all.current"] <= 64 * MiB
    assert s["reserved_bytes.all.peak"] <= 64 * MiB
    assert s["num_ooms"] == 1
    for h in held:
        pool.free(h)
    pool.malloc(20 * MiB)  # fine again


def test_budget_fraction_of_capacity(make_pool):
    pool = make_pool(backend="virtual", capacity="100M", conf="budget:0.5")
    assert pool.budget_bytes == 50 * MiB
    a = pool.malloc(40 * MiB)
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(12 * MiB)
    pool.free(a)


def test_set_memory_fraction_lowers_the_budget(make_pool):
    pool = make_pool(backend="virtual", capacity="1G")
    pool.set_memory_fraction(0.25)
    assert pool.budget_bytes == 256 * MiB
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(300 * MiB)
    with pytest.raises(ValueError):
        pool.set_memory_fraction(1.5)


def test_without_a_budget_the_capacity_is_the_limit(make_pool):
    pool = make_pool(backend="host", capacity="30M")
    assert pool.budget_bytes == 30 * MiB
    a = pool.malloc(15 * MiB)  # own segment of 16 MiB
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(15 * MiB)  # would need another 16 MiB
    pool.free(a)


def test_cached_segments_are_released_and_the_malloc_retried(make_pool):
    pool = make_pool(backend="virtual", conf="budget:64M")
    a = pool.malloc(40 * MiB)
    pool.free(a)  # cached, entirely free, but on the wrong stream for what follows
    b = pool.malloc(40 * MiB, stream=1)
    s = pool.stats()
    assert s["num_alloc_retries"] == 1
    assert s["num_device_free"] == 1
    assert s["reserved_bytes.all.current"] == 40 * MiB
    assert s["num_ooms"] == 0
    pool.free(b)


def test_the_retry_gives_back_only_what_the_budget_needs(make_pool):
    """Step 4 under a budget: the smallest whole free segment that makes room
    alone goes, else the largest ones until there is room; the others stay
    cached for the sizes they fit (each cudaFree waits for the device, and a
    segment given back is made again when its size comes back)."""
    pool = make_pool(backend="virtual", conf="budget:100M,unmap_pages:off,policy:dtralloc")
    held = [pool.malloc(n * MiB) for n in (30, 20, 12, 24)]  # a segment each, 86 MiB
    for a in held[:3]:
        pool.free(a)
    big = pool.malloc(32 * MiB)  # 86 + 32 > 100: 18 MiB must go, and 20 alone does
    s = pool.stats()
    assert s["num_alloc_retries"] == 1 and s["num_device_free"] == 1
    assert sorted(seg["total_size"] for seg in pool.snapshot()["segments"]) == [12 * MiB, 24 * MiB, 30 * MiB,
                                                                             32 * MiB]
    pool.free(held[3])
    pool.free(big)
    pool.malloc(70 * MiB)  # 98 + 70 > 100: 68 MiB; none alone, the largest first: 32, 30, 24
    assert pool.stats()["num_device_free"] == 4
    assert sorted(seg["total_size"] for seg in pool.snapshot()["segments"]) == [12 * MiB, 70 * MiB]
    pool.check_invariants()


@pytest.mark.parametrize("conf", ["unmap_pages:off,policy:dtralloc", "budget:100M,unmap_pages:off"])
def test_as_torch_the_retry_gives_back_every_whole_free_segment(make_pool, conf):
    """Where the device refused (no budget set), or under torch's policy: as
    torch, everything cached whole goes."""
    pool = make_pool(backend="virtual", capacity="100M", conf=conf)
    held = [pool.malloc(n * MiB) for n in (30, 20, 12, 24)]
    for a in held[:3]:
        pool.free(a)
    pool.malloc(32 * MiB)
    assert pool.stats()["num_device_free"] == 3


def test_no_release_while_the_budget_has_room(make_pool):
    pool = make_pool(backend="virtual", conf="budget:1G")
    a = pool.malloc(40 * MiB)
    pool.free(a)
    pool.malloc(40 * MiB, stream=1)
    s = pool.stats()
    assert s["num_alloc_retries"] == 0
    assert s["reserved_bytes.all.current"] == 80 * MiB


def test_split_segments_are_not_released_by_the_retry(make_pool):
    pool = make_pool(backend="virtual", conf="budget:40M")
    a = pool.malloc(5 * MiB)
    b = pool.malloc(5 * MiB)  # same 20 MiB segment, 10 MiB free in it
    pool.free(a)
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(30 * MiB)  # 20 + 30 > 40: the split segment stays
    assert pool.owns(b)
    assert pool.stats()["segment.all.current"] == 1
    pool.free(b)


# --------------------------------------------------------------------------
# max_split_size_mb, max_non_split_rounding_mb, garbage_collection_threshold


def test_oversize_block_is_not_used_for_small_requests(make_pool):
    pool = make_pool(backend="virtual", conf="max_split_size_mb:40")
    a = pool.malloc(100 * MiB)
    pool.free(a)
    b = pool.malloc(5 * MiB)
    assert blocks_by_address(pool)[b][0]["address"] != a
    s = pool.stats()
    assert s["oversize_segments.current"] == 1
    assert s["oversize_allocations.current"] == 0
    pool.free(b)


def test_oversize_request_takes_a_cached_block_within_the_rounding_limit(make_pool):
    pool = make_pool(backend="virtual", conf="max_split_size_mb:40")
    a = pool.malloc(100 * MiB)
    pool.free(a)
    b = pool.malloc(90 * MiB)  # 100 < 90 + 20: taken whole, not split
    assert b == a
    _, block = held_block(pool, b)
    assert block["size"] == 100 * MiB
    assert pool.stats()["oversize_allocations.current"] == 1
    pool.free(b)
    c = pool.malloc(70 * MiB)  # 100 >= 70 + 20: too wasteful, new segment
    assert c != a
    pool.free(c)


def test_max_non_split_rounding_mb_widens_the_limit(make_pool):
    pool = make_pool(backend="virtual", conf="max_split_size_mb:40,max_non_split_rounding_mb:50")
    a = pool.malloc(100 * MiB)
    pool.free(a)
    assert pool.malloc(70 * MiB) == a


def test_max_non_split_rounding_none_means_no_limit(make_pool):
    """`none` is an accepted value ("or none"); it must mean no limit, so any
    cached oversize block that fits is reused. (A limit of 'none' stored as
    SIZE_MAX must not overflow `rounded + limit` into 'never'.)"""
    pool = make_pool(backend="virtual", conf="max_split_size_mb:40,max_non_split_rounding_mb:none")
    a = pool.malloc(100 * MiB)
    pool.free(a)
    assert pool.malloc(90 * MiB) == a
    assert pool.stats()["segment.all.current"] == 1


def test_oversize_cached_segment_is_released_for_a_new_one(make_pool):
    pool = make_pool(backend="virtual", conf="budget:150M,max_split_size_mb:40")
    a = pool.malloc(100 * MiB)
    pool.free(a)
    b = pool.malloc(60 * MiB)  # can't take the 100 MiB block; 100 + 60 > 150
    s = pool.stats()
    assert s["reserved_bytes.all.current"] == 60 * MiB
    assert s["num_device_free"] == 1
    assert s["num_ooms"] == 0
    pool.free(b)


def test_split_oversize_takes_the_low_end_of_a_cached_oversize_segment(make_pool):
    """split_oversize:on: where the budget leaves no room for an oversize
    request's own segment, it is cut from a whole free oversize segment whose
    rest is oversize too, instead of giving that segment back (a cudaFree,
    which waits for the device) and making its own. The rest serves oversize
    requests only; freed, the two merge and the segment is whole again."""
    pool = make_pool(backend="virtual", conf="budget:210M,max_split_size_mb:40,split_oversize:on,unmap_pages:off")
    a = pool.malloc(200 * MiB)
    pool.free(a)
    b = pool.malloc(100 * MiB)  # 200 >= 100 + 20: not taken whole; 200 + 100 > 210: no segment of its own
    assert b == a
    small = pool.malloc(5 * MiB)  # the 100 MiB rest is oversize: a small request leaves it alone
    assert blocks_by_address(pool)[small][0]["address"] != a
    c = pool.malloc(100 * MiB)  # the rest, exactly
    assert c == a + 100 * MiB
    s = pool.stats()
    assert s["num_device_free"] == 0 and s["num_alloc_retries"] == 0 and s["num_ooms"] == 0
    pool.free(b)
    pool.free(c)
    assert pool.malloc(200 * MiB) == a  # whole again: served from the cache
    assert pool.stats()["num_device_free"] == 0


def test_split_oversize_leaves_no_small_rest(make_pool):
    """The rest must be oversize too: a 30 MiB rest (under max_split_size_mb)
    could be taken by small requests, which would pin the segment; then the
    segment is given back and made again, as with split_oversize:off."""
    pool = make_pool(backend="virtual", conf="budget:150M,max_split_size_mb:40,split_oversize:on,unmap_pages:off")
    a = pool.malloc(100 * MiB)
    pool.free(a)
    pool.malloc(70 * MiB)
    assert pool.stats()["num_device_free"] == 1


def _oversize_rest_beside_a_tensor(make_pool):
    """A pool whose only free room is a 50 MiB block (oversize: at least
    max_split_size_mb) in a segment that also holds a tensor, with no room in
    the budget for a segment of a 5 MiB request's own."""
    pool = make_pool(backend="virtual", conf="budget:104M,max_split_size_mb:40,split_oversize:on,unmap_pages:off")
    a = pool.malloc(100 * MiB)
    pool.free(a)
    held = pool.malloc(50 * MiB)  # split_oversize: the low end; the 50 MiB rest stays free
    assert held == a and pool.stats()["reserved_bytes.all.current"] == 100 * MiB
    return pool, a


def test_the_last_step_before_an_oom_splits_a_block_the_split_limit_kept(make_pool):
    """Note [split_any_block]: where every other step failed, a request
    smaller than max_split_size_mb splits the oversize free block instead of
    failing beside it (an OOM before)."""
    pool, a = _oversize_rest_beside_a_tensor(make_pool)
    c = pool.malloc(5 * MiB)
    assert c == a + 50 * MiB
    s = pool.stats()
    assert s["num_split_limit_overrides"] == 1 and s["num_ooms"] == 0 and s["num_device_alloc"] == 1
    d = pool.malloc(45 * MiB)  # the rest of it: an oversize-sized request no split rule would give 45 of 45
    assert d == a + 55 * MiB
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(5 * MiB)  # nothing is left, and no room for a 6 MiB segment: still an OOM
    pool.check_invariants()


def test_eviction_comes_before_splitting_a_kept_block(make_pool):
    """With an eviction hook the override is the step after it: what the
    hook frees serves first, and only a hook that frees nothing leads to it."""
    pool, a = _oversize_rest_beside_a_tensor(make_pool)
    calls = []
    pool.set_eviction_hook(lambda nbytes, stream: calls.append(nbytes) or False)
    pool.malloc(5 * MiB)
    assert calls == [5 * MiB] and pool.stats()["num_split_limit_overrides"] == 1

    pool, a = _oversize_rest_beside_a_tensor(make_pool)
    held = [a]

    def hook(nbytes, stream):  # frees the tensor beside the kept block: its segment is whole again
        if not held:
            return False
        pool.free(held.pop())
        return True

    pool.set_eviction_hook(hook)
    pool.malloc(5 * MiB)  # the whole segment is given back and the request gets one of its own
    s = pool.stats()
    assert not held and s["num_split_limit_overrides"] == 0 and s["num_device_free"] == 1


def test_arena_reserves_what_the_budget_leaves_once_and_serves_every_size_in_it(make_pool):
    """arena:on (Note [arena]): the first large request the cache cannot
    serve under a budget reserves the rest of the budget in one segment;
    every size is served in it from then on, small requests too (they have
    no room for small segments), and the pool calls the device no more."""
    pool = make_pool(backend="virtual", conf="budget:300M,arena:on")
    first = pool.malloc(30 * MiB)
    s = pool.stats()
    assert s["num_device_alloc"] == 1 and s["reserved_bytes.all.current"] == 300 * MiB
    arena = blocks_by_address(pool)[first][0]["address"]
    live = [first]
    for size in (512, 100 * KiB, 5 * MiB, 100 * MiB, 700 * KiB, 60 * MiB, 3 * MiB):
        live.append(pool.malloc(size))
    for i, addr in enumerate(list(live)):
        if i % 2:
            pool.free(addr)
            live.remove(addr)
    for size in (90 * MiB, 2 * MiB, 256):
        live.append(pool.malloc(size))
    assert {blocks_by_address(pool)[a][0]["address"] for a in live} == {arena}
    s = pool.stats()
    assert s["num_device_alloc"] == 1 and s["num_device_free"] == 0
    assert len(pool.snapshot()["segments"]) == 1
    pool.check_invariants()


def test_arena_puts_small_requests_at_its_top_and_large_ones_best_fit(make_pool):
    """Small tensors scattered through an arena would cut every window the
    evictor could free for a large one: they take the top of the highest free
    block, large requests the best fit from the bottom (Note [arena])."""
    pool = make_pool(backend="virtual", conf="budget:300M,arena:on")
    first = pool.malloc(30 * MiB)
    arena = blocks_by_address(pool)[first][0]["address"]
    assert first == arena
    small = pool.malloc(512)
    assert small == arena + 300 * MiB - 512  # the very top
    below = pool.malloc(700 * KiB)
    assert below == small - 700 * KiB
    big = pool.malloc(5 * MiB)
    assert big == arena + 30 * MiB  # best fit: the low end of the free middle
    pool.free(first)
    hole = pool.malloc(100 * KiB)  # the highest free block is the middle's, not the hole at the bottom
    assert hole == below - 100 * KiB
    assert len(pool.snapshot()["segments"]) == 1
    pool.check_invariants()


def test_arena_stays_at_the_budget_and_goes_with_empty_cache(make_pool):
    """Steps 3-4 (give cached segments back and make one) leave the arena
    alone: a request it cannot hold fails without a device call, and once
    its room is free it serves from the arena. empty_cache() gives the arena
    back; the next miss makes it again."""
    pool = make_pool(backend="virtual", conf="budget:100M,arena:on")
    x = pool.malloc(60 * MiB)
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(60 * MiB)
    s = pool.stats()
    assert s["num_device_free"] == 0 and s["reserved_bytes.all.current"] == 100 * MiB
    pool.free(x)
    assert pool.malloc(90 * MiB) == x
    assert pool.stats()["num_device_alloc"] == 1
    pool.free(x)
    pool.empty_cache()
    s = pool.stats()
    assert s["num_device_free"] == 1 and s["reserved_bytes.all.current"] == 0
    pool.malloc(10 * MiB)
    s = pool.stats()
    assert s["num_device_alloc"] == 2 and s["reserved_bytes.all.current"] == 100 * MiB


def test_arena_takes_what_segments_made_before_the_budget_leave(make_pool):
    """Made under a budget set later (a memory fraction here, a dtr()
    session's budget on CUDA): whole free cached segments are given back
    first, the segments still in use stay, and the arena is the rest."""
    pool = make_pool(backend="virtual", capacity="1G", conf="arena:on")
    cached = pool.malloc(40 * MiB)
    kept = pool.malloc(20 * MiB)
    pool.free(cached)
    assert pool.stats()["num_device_alloc"] == 2  # no budget: segments of their own sizes
    pool.set_memory_fraction(0.25)  # 256 MiB
    pool.malloc(100 * MiB)
    s = pool.stats()
    assert s["num_device_free"] == 1  # the cached 40 MiB segment
    assert s["reserved_bytes.all.current"] == 256 * MiB
    segments = sorted(seg["total_size"] for seg in pool.snapshot()["segments"])
    assert segments == [20 * MiB, 236 * MiB]
    assert blocks_by_address(pool)[kept][0]["total_size"] == 20 * MiB


def test_an_empty_arena_goes_when_the_budget_falls_below_it(make_pool):
    pool = make_pool(backend="virtual", capacity="1G", conf="arena:on")
    pool.set_memory_fraction(0.5)
    x = pool.malloc(10 * MiB)
    assert pool.stats()["reserved_bytes.all.current"] == 512 * MiB
    pool.set_memory_fraction(0.375)  # the arena holds x: it stays, over the new budget
    assert pool.stats()["reserved_bytes.all.current"] == 512 * MiB
    pool.check_invariants()
    pool.free(x)
    pool.set_memory_fraction(0.25)  # empty now: given back, made again at the next miss
    s = pool.stats()
    assert s["num_device_free"] == 1 and s["reserved_bytes.all.current"] == 0
    pool.malloc(10 * MiB)
    assert pool.stats()["reserved_bytes.all.current"] == 256 * MiB


def test_arena_serves_small_requests_while_no_budget_is_in_force(make_pool):
    """A dtr() session's budget comes and goes; the arena made under it stays.
    A small request between sessions takes the arena's top, not a small
    segment beside it: that one would take reserved past the next session's
    budget (on an H200, 2026-11-30, GPT-2's probes under arena:on held M + 2 MiB)."""
    pool = make_pool(backend="virtual", capacity="1G", conf="arena:on")
    pool.set_memory_fraction(0.25)  # a session's budget: 256 MiB
    x = pool.malloc(100 * MiB)
    arena = blocks_by_address(pool)[x][0]["address"]
    pool.set_memory_fraction(1.0)  # the session ended
    small = pool.malloc(4096)
    assert pool.stats()["num_device_alloc"] == 1
    assert blocks_by_address(pool)[small][0]["address"] == arena
    pool.set_memory_fraction(0.25)  # the next session
    s = pool.stats()
    assert s["reserved_bytes.all.current"] == s["reserved_bytes.all.peak"] == 256 * MiB
    pool.check_invariants()


def test_arena_serves_what_it_has_room_for_while_sessions_come_and_go(make_pool):
    """Random mallocs and frees of every size while a budget (a session's)
    comes and goes: once the arena exists, a request it has room for never
    makes a segment, budget or not (a large one it has no room for does
    while no budget is in force: nothing else could serve it), and the
    pool's invariants hold (I4: no segment past the budget while one is)."""
    import random

    rng = random.Random(7)
    pool = make_pool(backend="virtual", capacity="1G", conf="arena:on")
    live, arena_at = [], None
    for i in range(3000):
        if i % 200 == 0:  # a session starts (a budget) or ends (none)
            pool.set_memory_fraction(0.25 if (i // 200) % 2 == 0 else 1.0)
        # The arena: the one segment of 100 MiB or more (requests here are under 40).
        arena = max(pool.snapshot()["segments"], key=lambda seg: seg["total_size"], default=None)
        if arena is None or arena["total_size"] < 100 * MiB:
            arena = None
        elif arena_at is None:
            arena_at = i
        if live and rng.random() < 0.45:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice((512, 4096, 200 << 10, 900 << 10)) if rng.random() < 0.6 else \
                rng.randrange(1, 40) * MiB
            room = max((b["size"] for b in arena["blocks"] if b["state"] == "inactive"), default=0) if arena else 0
            made = pool.stats()["num_device_alloc"]
            try:
                live.append(pool.malloc(size))
            except dtralloc.OutOfMemoryError:
                continue
            if room >= size + 4096:  # the arena could serve it (its top, rounded): no new segment
                assert pool.stats()["num_device_alloc"] == made, (i, size, room)
        pool.check_invariants()
    assert arena_at is not None and arena_at < 200
    for ptr in live:
        pool.free(ptr)


def test_arena_fragmented_oom_points_at_arena_off_not_at_max_split_size(make_pool):
    """max_split_size_mb must stay none in an arena (a ConfigError otherwise),
    so a fragmented arena's out-of-memory error names arena:off instead."""
    pool = make_pool(backend="virtual", capacity="1G", conf="budget:100M,arena:on")
    a, b, c, d = (pool.malloc(n * MiB) for n in (30, 10, 30, 30))
    pool.free(a)
    pool.free(c)  # 60 MiB free, in two 30 MiB pieces
    with pytest.raises(dtralloc.OutOfMemoryError) as e:
        pool.malloc(50 * MiB)
    assert "fragmented in the arena" in str(e.value) and "arena:off" in str(e.value), str(e.value)
    assert "max_split_size_mb" not in str(e.value), str(e.value)
    pool.free(b)
    pool.free(d)


def test_arena_without_a_budget_changes_nothing(make_pool):
    pool = make_pool(backend="virtual", capacity="1G", conf="arena:on")
    pool.malloc(30 * MiB)
    pool.malloc(30 * MiB)
    s = pool.stats()
    assert s["num_device_alloc"] == 2 and s["reserved_bytes.all.current"] == 60 * MiB


@pytest.mark.parametrize("conf, names", [
    ("arena:on,max_split_size_mb:64", "max_split_size_mb:none"),
    ("arena:on,small_in_large:off", "small_in_large on"),
    ("arena:on,unmap_pages:on", "unmap_pages:on exclude each other"),
])
def test_arena_refuses_settings_that_would_break_it(make_pool, conf, names):
    """Refused where the settings are read (dtralloc config, install(), a
    Pool), each naming the setting to drop."""
    with pytest.raises(dtralloc.ConfigError, match=names):
        dtralloc.describe_config(f"budget:100M,{conf}")
    with pytest.raises(dtralloc.ConfigError, match=names):
        make_pool(backend="virtual", conf=f"budget:100M,{conf}")


def test_async_segments_is_refused_beside_unmap_pages_and_auto_is_off(make_pool):
    """async_segments (cuda: the stream-ordered allocator; tests/test_cuda_async.py
    runs it over the fake runtime) frees segments only whole, so unmap_pages:on
    beside it is a ConfigError wherever the settings are read; auto resolves off."""
    for conf in ("async_segments:on,unmap_pages:on", "unmap_pages:on,async_segments:on"):
        with pytest.raises(dtralloc.ConfigError, match="async_segments:on and unmap_pages:on exclude each other"):
            dtralloc.describe_config(f"budget:100M,{conf}")
        with pytest.raises(dtralloc.ConfigError, match="exclude each other"):
            make_pool(backend="virtual", conf=f"budget:100M,{conf}")
    options = {o["name"]: o for o in dtralloc.describe_config("async_segments:auto")}
    assert options["async_segments"]["value"] == "auto" and options["async_segments"]["default"] == "off"
    assert dtralloc.effective_config("policy:dtralloc,budget:1G")["async_segments"] == "off"
    assert dtralloc.effective_config("async_segments:on")["async_segments"] == "on"


def test_async_segments_changes_nothing_on_the_simulated_backends():
    """Host and virtual segments never wait for a device: a replay (virtual)
    with async_segments:on evicts and places exactly as without it."""
    from dtralloc.replay import replay

    base = replay("resnet50", budget=0.5, policy="dtralloc", conf="split_oversize:on,unmap_pages:off")
    on = replay("resnet50", budget=0.5, policy="dtralloc", conf="split_oversize:on,unmap_pages:off,async_segments:on")
    assert base.feasible and base.evictions > 0
    assert (on.evictions, on.remats, on.device_alloc_calls, on.device_free_calls, on.peak_reserved_bytes) == \
        (base.evictions, base.remats, base.device_alloc_calls, base.device_free_calls, base.peak_reserved_bytes)
    assert on.remat_cost == base.remat_cost


def test_arena_runs_a_replay_under_its_budget_with_no_segment_given_back():
    """The evictor makes room by windows of the arena and never plans to
    give it back; the GPU's default pool settings (cudaMalloc'd segments)
    give segments back and make others at the same budget."""
    from dtralloc.replay import replay

    arena = replay("resnet50", budget=0.5, policy="dtralloc", conf="arena:on", check_invariants=True)
    assert arena.feasible and arena.evictions > 0
    assert arena.device_alloc_calls == 1 and arena.device_free_calls == 0
    segments = replay("resnet50", budget=0.5, policy="dtralloc", conf="split_oversize:on,unmap_pages:off")
    assert segments.feasible and segments.device_free_calls > 0


@pytest.mark.parametrize("conf, splits", [
    ("policy:dtralloc", False),                    # virtual: pages go back (unmap_pages:auto), auto stays off
    ("policy:dtralloc,unmap_pages:off", False),    # resolved for the backend, not for unmap_pages' setting
    ("policy:dtralloc,split_oversize:on", True),
    ("split_oversize:on", True),
    ("", False),
])
def test_split_oversize_auto_is_off_where_the_backend_gives_pages_back(make_pool, conf, splits):
    """auto resolves on only under the dtralloc policy with a budget on a
    backend that frees segments whole (cuda's cudaMalloc'd ones; there
    bench/segment_churn.py shows it on: no segment made after the first
    step); host and virtual pools (replays, CPU sessions) keep torch's way."""
    pool = make_pool(backend="virtual", conf=f"{conf},budget:210M,max_split_size_mb:40".lstrip(","))
    a = pool.malloc(200 * MiB)
    pool.free(a)
    pool.malloc(100 * MiB)
    s = pool.stats()
    assert s["num_device_free"] == (0 if splits else 1)  # given back to make its own, or cut from it
    assert s["reserved_bytes.all.current"] == (200 if splits else 100) * MiB


def test_garbage_collection_releases_least_recently_freed_first(make_pool):
    pool = make_pool(backend="virtual", conf="budget:100M,garbage_collection_threshold:0.6,history_entries:1024")
    old = pool.malloc(30 * MiB)
    new = pool.malloc(30 * MiB)
    pool.free(old)
    pool.free(new)
    pool.malloc(12 * MiB, stream=1)  # 60 + 12 > 60: release the oldest (30 + 12 <= 60)
    segs = pool.snapshot()["segments"]
    assert sorted(s["total_size"] for s in segs) == [12 * MiB, 30 * MiB]
    trace = pool.snapshot()["device_traces"][0]
    [freed] = [e for e in trace if e["action"] == "segment_free"]
    assert freed["addr"] == old
    assert pool.stats()["num_alloc_retries"] == 0


def test_without_garbage_collection_the_cache_is_kept(make_pool):
    pool = make_pool(backend="virtual", conf="budget:100M")
    a, b = pool.malloc(30 * MiB), pool.malloc(30 * MiB)
    pool.free(a)
    pool.free(b)
    pool.malloc(12 * MiB, stream=1)
    assert pool.stats()["reserved_bytes.all.current"] == 72 * MiB


# --------------------------------------------------------------------------
# the eviction hook


class Holder:
    """A simple evictor: holds blocks and frees them, oldest first, on request."""

    def __init__(self, pool, frees_per_call=1, answer=None):
        self.pool = pool
        self.held = []
        self.calls = []
        self.frees_per_call = frees_per_call
        self.answer = answer

    def __call__(self, nbytes, stream):
        self.calls.append((nbytes, stream))
        freed = 0
        while self.held and freed < self.frees_per_call:
            self.pool.free(self.held.pop(0))
            freed += 1
        return bool(freed) if self.answer is None else self.answer


def test_hook_that_frees_enough_makes_the_malloc_succeed(make_pool):
    pool = make_pool(backend="virtual", conf="budget:64M")
    hook = Holder(pool)
    hook.held = [pool.malloc(20 * MiB) for _ in range(3)]
    pool.set_eviction_hook(hook)
    a = pool.malloc(30 * MiB, stream=0)
    # Asked with the rounded size and the stream; retried while it freed something.
    assert hook.calls == [(30 * MiB, 0), (30 * MiB, 0)]
    s = pool.stats()
    assert s["num_eviction_calls"] == 2
    assert s["num_ooms"] == 0
    assert s["reserved_bytes.all.current"] <= 64 * MiB
    assert len(hook.held) == 1
    pool.free(a)


def test_hook_is_not_called_when_the_pool_can_serve(make_pool):
    pool = make_pool(backend="virtual", conf="budget:64M")
    hook = Holder(pool)
    pool.set_eviction_hook(hook)
    pool.free(pool.malloc(10 * MiB))
    assert hook.calls == []
    assert pool.stats()["num_eviction_calls"] == 0


def test_hook_returning_false_gives_oom(make_pool):
    pool = make_pool(backend="virtual", conf="budget:64M")
    blocker = pool.malloc(50 * MiB)
    calls = []

    def hook(nbytes, stream):
        calls.append((nbytes, stream))
        return False

    pool.set_eviction_hook(hook)
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(30 * MiB, stream=4)
    assert calls == [(30 * MiB, 4)]
    s = pool.stats()
    assert s["num_eviction_calls"] == 1
    assert s["num_ooms"] == 1
    pool.free(blocker)


def test_hook_that_keeps_freeing_too_little_ends_in_oom(make_pool):
    pool = make_pool(backend="virtual", conf="budget:64M")
    hook = Holder(pool)
    hook.held = [pool.malloc(2 * MiB) for _ in range(3)]  # one segment: never whole-free
    keep = pool.malloc(40 * MiB)
    pool.set_eviction_hook(hook)
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(30 * MiB)
    assert len(hook.calls) == 4  # three frees, then a call that found nothing
    assert pool.stats()["num_eviction_calls"] == 4
    pool.free(keep)


def test_hook_raising_propagates_and_leaves_the_pool_consistent(make_pool):
    pool = make_pool(backend="host", capacity="1G", conf="budget:64M")
    held = [pool.malloc(20 * MiB) for _ in range(3)]
    ctypes.memset(held[0], 0x5A, 20 * MiB)

    class Boom(RuntimeError):
        pass

    def hook(nbytes, stream):
        pool.free(held.pop())  # it did some work before failing
        raise Boom("evictor failed")

    pool.set_eviction_hook(hook)
    before = pool.stats()
    with pytest.raises(Boom, match="evictor failed"):
        pool.malloc(30 * MiB)
    pool.check_invariants()
    s = pool.stats()
    assert s["num_ooms"] == before["num_ooms"]  # not an OOM: the hook's error
    assert s["num_eviction_calls"] == before["num_eviction_calls"] + 1
    assert s["allocation.all.current"] == 2
    assert ctypes.string_at(held[0], 20 * MiB) == b"\x5a" * (20 * MiB)
    pool.set_eviction_hook(None)
    a = pool.malloc(10 * MiB)  # the pool still works
    pool.free(a)


def test_hook_can_be_removed(make_pool):
    pool = make_pool(backend="virtual", conf="budget:64M")
    hook = Holder(pool)
    hook.held = [pool.malloc(60 * MiB)]
    pool.set_eviction_hook(hook)
    pool.set_eviction_hook(None)
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(30 * MiB)
    assert hook.calls == []


# --------------------------------------------------------------------------
# bad frees


def _all_but_invalid(stats):
    return {k: v for k, v in stats.items() if k != "num_invalid_frees"}


@pytest.mark.parametrize("kind", ["double", "unknown", "interior", "pending", "record_stream"])
def test_bad_pointer_is_rejected_counted_and_changes_nothing(make_pool, kind):
    pool = make_pool()
    keep = pool.malloc(3000)
    victim = pool.malloc(3000)
    ctypes.memset(keep, 0x33, 3000)
    pool.free(victim)
    if kind == "pending":
        victim = pool.malloc(3000)
        pool.record_stream(victim, 9)
        pool.free(victim)  # freed, waiting on stream 9
    snap_before = pool.snapshot()["segments"]
    before = pool.stats()
    bad = {"double": victim, "unknown": 0x1000, "interior": keep + 512,
           "pending": victim, "record_stream": victim}[kind]
    with pytest.raises(dtralloc.InvalidPointerError) as excinfo:
        if kind == "record_stream":
            pool.record_stream(bad, 1)
        else:
            pool.free(bad)
    assert isinstance(excinfo.value, ValueError)
    assert hex(bad) in str(excinfo.value)
    after = pool.stats()
    assert after["num_invalid_frees"] == before["num_invalid_frees"] + 1
    assert stats_delta(_all_but_invalid(before), _all_but_invalid(after)) == {}
    assert pool.snapshot()["segments"] == snap_before
    pool.check_invariants()
    assert ctypes.string_at(keep, 3000) == b"\x33" * 3000
    pool.free(keep)


def test_owns(make_pool):
    pool = make_pool()
    a = pool.malloc(100)
    assert pool.owns(a)
    assert not pool.owns(a + 512)
    pool.free(a)
    assert not pool.owns(a)


# --------------------------------------------------------------------------
# the Pool object


def test_host_memory_is_real_and_writable(make_pool):
    pool = make_pool(backend="host")
    assert pool.host_accessible
    a = pool.malloc(3 * MiB + 5)
    b = pool.malloc(700)
    ctypes.memset(a, 0xAB, 3 * MiB + 5)
    ctypes.memset(b, 0xCD, 700)
    assert ctypes.string_at(a, 3 * MiB + 5) == b"\xab" * (3 * MiB + 5)
    assert ctypes.string_at(b, 700) == b"\xcd" * 700


def test_pool_properties_and_repr(make_pool):
    pool = make_pool(backend="virtual", capacity="2G", conf="budget:1G", device=3)
    assert (pool.backend, pool.device, pool.capacity_bytes, pool.budget_bytes) == ("virtual", 3, 2 << 30, 1 << 30)
    assert not pool.host_accessible
    text = repr(pool)
    assert "virtual" in text and "1 GiB" in text


def test_bad_backend_and_capacity_are_value_errors():
    with pytest.raises(ValueError, match="backend"):
        dtralloc.Pool(backend="tpu", capacity="1G")
    with pytest.raises(ValueError, match="capacity"):
        dtralloc.Pool(backend="host", capacity=0)


def test_unmap_pages_cuts_free_pages_out_and_keeps_what_is_around_them():
    # A 20 MiB segment holds a 3 MiB block and 17 MiB free; the budget (24
    # MiB) has no room for an 18 MiB segment. With unmap_pages:on the 16 MiB
    # of whole free pages go back (the segment keeps [0, 4 MiB)), the request
    # gets its segment, and the bytes of the block that stayed are intact.
    for conf in ("unmap_pages:off", "unmap_pages:on"):
        pool = dtralloc.Pool("host", capacity="1G", conf="budget:24M,history_entries:100," + conf)
        keep = pool.malloc(3 * MiB)
        ctypes.memset(keep, 0x5A, 3 * MiB)
        pool.free(pool.malloc(4 * MiB))
        if conf == "unmap_pages:off":
            with pytest.raises(dtralloc.OutOfMemoryError, match="Tried to allocate 18"):
                pool.malloc(18 * MiB)
            assert pool.stats()["num_page_releases"] == 0
            continue
        big = pool.malloc(18 * MiB)
        ctypes.memset(big, 0x11, 18 * MiB)
        s = pool.stats()
        assert s["num_page_releases"] == 1 and s["reserved_bytes.all.current"] == 22 * MiB
        assert ctypes.string_at(keep, 3 * MiB) == b"\x5a" * (3 * MiB)
        segments = {seg["address"]: seg["total_size"] for seg in pool.snapshot()["segments"]}
        assert segments == {keep: 4 * MiB, big: 18 * MiB}
        unmap = [e for e in pool.snapshot()["device_traces"][0] if e["action"] == "segment_unmap"]
        assert [(e["addr"], e["size"]) for e in unmap] == [(keep + 4 * MiB, 16 * MiB)]
        pool.check_invariants()
        pool.free(keep)
        pool.free(big)
        pool.empty_cache()
        assert pool.stats()["reserved_bytes.all.current"] == 0
        pool.check_invariants()


def test_unmap_pages_does_nothing_when_giving_back_every_free_page_would_not_do():
    pool = dtralloc.Pool("virtual", capacity="1G", conf="budget:24M,unmap_pages:on")
    keep = pool.malloc(3 * MiB)
    pool.free(pool.malloc(4 * MiB))
    with pytest.raises(dtralloc.OutOfMemoryError):
        pool.malloc(22 * MiB)  # 4 MiB under the budget + 16 MiB of pages < 22
    assert pool.stats()["num_page_releases"] == 0 and pool.stats()["reserved_bytes.all.current"] == 20 * MiB
    pool.free(keep)
