"""Worker process for tests/test_cuda_async.py: the cuda backend's async
segments (async_segments:on, CUDA's stream-ordered allocator) over the fake
runtime, which also exports cudaMemPoolCreate, cudaMallocFromPoolAsync,
cudaFreeAsync and the rest (allocator/fake_cudart/fake_cudart.cpp).

The runtime is loaded once per process, so each scenario runs in a fresh
interpreter:

    DTRALLOC_CUDART=<fake runtime> [DTRALLOC_CONF=...] python _async_worker.py SCENARIO

A scenario raises on failure and prints ``PASS <name>`` when done.
"""
from __future__ import annotations

import ctypes
import sys

import _scenario_main
import dtralloc
from dtralloc import _core
from dtralloc.testing import FakeCudaRuntime

MiB = 1 << 20
ASYNC = "policy:dtralloc,budget:64M,async_segments:on"
STREAM_A = 0xA000  # stream handles the fake never dereferences
STREAM_B = 0xB000
fake = FakeCudaRuntime()
WAITS = ("cudaFree", "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def waits() -> dict:
    return {name: fake.calls(name) for name in WAITS}


def no_leak() -> None:
    check(fake.live_allocations() == 0, f"{fake.live_allocations()} allocations left")
    check(fake.pool_live()["held"] == 0, f"freed memory still held: {fake.pool_live()}")
    check(fake.used_bytes(0) == 0, f"{fake.used_bytes(0)} bytes still used on the fake device")


def scenario_segments_are_made_and_given_back_without_waiting():
    """Under a budget the pool gives a cached segment back to make one of
    another size. With async segments neither side calls cudaMalloc or
    cudaFree, nor waits for the device, where the driver's pool reuses what
    was freed (a larger freed segment for a smaller one on the same stream).
    Where it cannot and grows past the budget instead (device_pool_reserved_bytes
    shows it), the pool waits for the device once, so that the freed memory
    goes back and the excess lasts that one allocation; empty_cache() gives
    everything back to the device."""
    pool = dtralloc.Pool("cuda", conf=ASYNC)
    before = waits()
    a = pool.malloc(40 * MiB)
    ctypes.memset(a, 0x11, 40 * MiB)
    pool.free(a)
    b = pool.malloc(30 * MiB)  # the cached 40 MiB block is oversize for it: the pool remakes
    ctypes.memset(b, 0x22, 30 * MiB)
    stats = pool.stats()
    check(stats["num_device_free"] == 1 and stats["num_device_alloc"] == 2,
          f"{stats['num_device_alloc']} segments made, {stats['num_device_free']} given back")
    check(fake.calls("cudaMallocFromPoolAsync") == 2 and fake.calls("cudaFreeAsync") == 1,
          f"{fake.calls('cudaMallocFromPoolAsync')} async allocations, {fake.calls('cudaFreeAsync')} async frees")
    check(fake.calls("cudaMalloc") == 0, "an async pool called cudaMalloc")
    check(waits() == before, f"the pool waited for the device: {before} -> {waits()}")
    # The 30 MiB segment took the 40 MiB freed on the same stream: the device
    # holds 40 MiB, not 70.
    check(stats["device_pool_reserved_bytes.current"] == 40 * MiB, f"driver pool {stats}")
    check(fake.used_bytes(0) == 40 * MiB, f"device holds {fake.used_bytes(0)}")
    check(stats["num_device_pool_waits"] == 0, "a wait where the driver reused")
    pool.free(b)
    c = pool.malloc(50 * MiB)  # the 30 MiB segment goes back; 50 MiB does not fit in the 40 held
    ctypes.memset(c, 0x33, 50 * MiB)
    stats = pool.stats()
    check(stats["reserved_bytes.all.current"] == 50 * MiB, "the pool's reserved bytes")
    # The driver held the freed 40 MiB beside the new 50 (90 > 64), so the
    # pool waited once and the 40 MiB went back.
    check(stats["device_pool_reserved_bytes.peak"] == 90 * MiB, f"the driver's peak: {stats}")
    check(stats["device_pool_reserved_bytes.current"] == 50 * MiB, f"the driver still holds {stats}")
    check(stats["num_device_pool_waits"] == 1, f"{stats['num_device_pool_waits']} waits")
    check(fake.used_bytes(0) == 50 * MiB, f"device holds {fake.used_bytes(0)}")
    after = waits()
    check(after["cudaDeviceSynchronize"] == before["cudaDeviceSynchronize"] + 1 and after["cudaFree"] == 0,
          f"{before} -> {after}")
    pool.reset_peak_stats()
    check(pool.stats()["device_pool_reserved_bytes.peak"] == 50 * MiB, "reset to the current value")
    pool.free(c)
    pool.empty_cache()  # waits once, then trims: the device gets everything back
    stats = pool.stats()
    check(stats["reserved_bytes.all.current"] == 0, "segments left in the pool")
    check(stats["device_pool_reserved_bytes.current"] == 0, f"the driver still holds {stats}")
    check(fake.calls("cudaMemPoolTrimTo") == 2, "empty_cache did not trim the driver's pool (the wait above trimmed once)")
    pool.check_invariants()
    no_leak()


def scenario_only_async_segments_on_uses_the_stream_ordered_allocator():
    """cudaMalloc'd segments unless async_segments is on as given (auto is
    off); the driver's pool keys appear in the stats only then."""
    expected = {"": False, "policy:dtralloc,budget:64M": False, "async_segments:auto": False,
                "async_segments:off": False, "async_segments:on": True, ASYNC: True,
                "policy:dtralloc,budget:64M,arena:on,async_segments:on": True}
    for conf, is_async in expected.items():
        before = (fake.calls("cudaMallocFromPoolAsync"), fake.calls("cudaMalloc"))
        pool = dtralloc.Pool("cuda", conf=conf)
        pool.free(pool.malloc(MiB))
        made = (fake.calls("cudaMallocFromPoolAsync") - before[0], fake.calls("cudaMalloc") - before[1])
        check(made == ((1, 0) if is_async else (0, 1)), f"conf {conf!r}: {made} (async, cudaMalloc) calls")
        check(("device_pool_reserved_bytes.current" in pool.stats()) == is_async, f"conf {conf!r}: stats keys")
        pool.empty_cache()
        del pool
    no_leak()
    check(fake.pool_live()["pools"] == 0, f"memory pools left: {fake.pool_live()}")


def scenario_refused_where_it_cannot_run():
    """A device without memory pools refuses async_segments:on with a
    ConfigError naming why, from Pool('cuda') and from install()'s check;
    unmap_pages:on beside it is refused whatever the device."""
    fake.set_memory_pools(False)
    for call in (lambda: dtralloc.Pool("cuda", conf="async_segments:on"),
                 lambda: _core.check_cuda_config("policy:dtralloc,budget:1G,async_segments:on")):
        try:
            call()
        except dtralloc.ConfigError as e:
            check("does not support memory pools" in str(e) and "async_segments" in str(e), str(e))
        else:
            raise AssertionError("async_segments:on was accepted on a device without memory pools")
    _core.check_cuda_config("policy:dtralloc,budget:1G")  # off needs nothing
    fake.set_memory_pools(True)
    _core.check_cuda_config("async_segments:on")
    try:
        dtralloc.Pool("cuda", conf="async_segments:on,unmap_pages:on")
    except dtralloc.ConfigError as e:
        check("exclude each other" in str(e), str(e))
    else:
        raise AssertionError("async_segments:on beside unmap_pages:on was accepted")


def scenario_out_of_memory_waits_once_then_answers():
    """A device that is full while the driver still holds frees that have not
    run yet: the backend waits for the device once and asks again, which
    then succeeds. Past the device for real, the pool's ordinary
    out-of-memory error, and nothing leaks."""
    fake.set_capacity(64 * MiB)
    pool = dtralloc.Pool("cuda", conf="async_segments:on")
    pool.free(pool.malloc(40 * MiB, STREAM_A))  # cached on stream A
    syncs = fake.calls("cudaDeviceSynchronize")
    # Stream B cannot take A's cached segment; the device has 24 MiB left. The
    # pool gives A's segment back (a free on stream A the driver holds) and
    # asks again: stream B cannot reuse it before it ran, so the backend waits.
    b = pool.malloc(40 * MiB, STREAM_B)
    ctypes.memset(b, 0x44, 40 * MiB)
    check(fake.calls("cudaDeviceSynchronize") > syncs, "no wait for the device before answering out of memory")
    check(fake.used_bytes(0) == 40 * MiB, f"device holds {fake.used_bytes(0)}")
    try:
        pool.malloc(30 * MiB, STREAM_B)
    except dtralloc.OutOfMemoryError:
        pass
    else:
        raise AssertionError("a request past the device's capacity was served")
    pool.free(b)
    pool.empty_cache()
    pool.check_invariants()
    no_leak()


def scenario_a_capturing_stream_keeps_its_segment():
    """A segment whose stream is capturing a CUDA graph is not given back
    (the free would become a node of the graph): empty_cache() raises naming
    the capture and the segment stays whole in the pool; after the capture,
    it goes back."""
    pool = dtralloc.Pool("cuda", conf="async_segments:on")
    pool.free(pool.malloc(4 * MiB, STREAM_A))
    fake.set_stream_capture(STREAM_A, 1)
    try:
        pool.empty_cache()
    except RuntimeError as e:
        check("capturing a CUDA graph" in str(e), str(e))
    else:
        raise AssertionError("a capturing stream's segment was given back")
    check(fake.calls("cudaFreeAsync") == 0, "cudaFreeAsync was called on a capturing stream")
    check(pool.stats()["reserved_bytes.all.current"] == 20 * MiB, "the segment left the pool")
    pool.check_invariants()
    fake.set_stream_capture(STREAM_A, 0)
    pool.empty_cache()
    no_leak()


def scenario_torch_entry_points_get_async_segments():
    """The process-wide allocator behind libdtralloc.so (what install() hands
    torch) makes async segments under DTRALLOC_CONF=...,async_segments:on,
    and memory_stats() reports the driver's pool."""
    malloc, free = _scenario_main.global_malloc_free()
    ptr = malloc(5 * MiB, 0, None)
    check(ptr is not None, "dtralloc_malloc returned NULL")
    ctypes.memset(ptr, 3, 5 * MiB)
    check(fake.calls("cudaMallocFromPoolAsync") == 1 and fake.calls("cudaMalloc") == 0,
          "the global pool did not use the stream-ordered allocator")
    free(ptr, 5 * MiB, 0, None)
    stats = dtralloc.memory_stats()
    check(stats["num_device_alloc"] == 1, "stats do not show the segment")
    check(stats["device_pool_reserved_bytes.current"] == 20 * MiB, f"driver pool: {stats}")


if __name__ == "__main__":
    sys.exit(_scenario_main.run(globals(), sys.argv))
