"""Worker process for tests/test_cuda_vmm.py: the cuda backend's VMM segments
(CUDA's virtual memory API) over the fake runtime, which also exports the
driver's cuMem* functions (allocator/fake_cudart/fake_cudart.cpp).

The runtime is loaded once per process, so each scenario runs in a fresh
interpreter:

    DTRALLOC_CUDART=<fake runtime> [DTRALLOC_CONF=...] python _vmm_worker.py SCENARIO

A scenario raises on failure and prints ``PASS <name>`` when done.
"""
from __future__ import annotations

import ctypes
import sys
import threading

import _scenario_main
import dtralloc
from dtralloc import _core
from dtralloc.testing import FakeCudaRuntime

MiB = 1 << 20
PAGE = 2 * MiB
fake = FakeCudaRuntime()


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def no_vmm_leak() -> None:
    live = fake.vmm_live()
    check(live == {"reservations": 0, "handles": 0, "mappings": 0}, f"VMM objects left: {live}")
    check(fake.used_bytes(0) == 0, f"{fake.used_bytes(0)} bytes still used on the fake device")


def scenario_pages_go_back_and_the_rest_stays():
    """unmap_pages:on over VMM segments: a 20 MiB segment holding 3 MiB gives
    its 16 MiB of whole free pages back to the device (really unmapped, the
    device's used bytes drop), the 18 MiB request gets its segment, and the
    bytes that stayed are intact and still accessible."""
    pool = dtralloc.Pool("cuda", conf="budget:24M,unmap_pages:on,history_entries:100")
    keep = pool.malloc(3 * MiB)
    ctypes.memset(keep, 0x5A, 3 * MiB)
    pool.free(pool.malloc(4 * MiB))
    check(fake.used_bytes(0) == 20 * MiB, f"used {fake.used_bytes(0)}")
    check(fake.calls("cudaMalloc") == 0, "a VMM pool called cudaMalloc")
    big = pool.malloc(18 * MiB)
    ctypes.memset(big, 0x11, 18 * MiB)
    stats = pool.stats()
    check(stats["num_page_releases"] == 1, f"page releases {stats['num_page_releases']}")
    check(stats["reserved_bytes.all.current"] == 22 * MiB, "reserved bytes")
    check(fake.used_bytes(0) == 22 * MiB, f"the device still holds {fake.used_bytes(0)} bytes")
    check(ctypes.string_at(keep, 3 * MiB) == b"\x5a" * (3 * MiB), "bytes beside the cut changed")
    check(fake.vmm_accessible(keep, 4 * MiB), "the kept pages are no longer mapped")
    check(not fake.vmm_accessible(keep + 4 * MiB, PAGE), "a page given back is still mapped")
    # The release waited for the device, as cudaFree would.
    check(fake.calls("cudaDeviceSynchronize") >= 1, "no device synchronize before cuMemUnmap")
    pool.check_invariants()
    pool.free(keep)
    pool.free(big)
    pool.empty_cache()
    check(pool.stats()["reserved_bytes.all.current"] == 0, "segments left")
    no_vmm_leak()


def scenario_only_unmap_pages_on_makes_vmm_segments():
    """VMM segments where unmap_pages is on as given, cudaMalloc'd ones under
    auto whatever the policy and budget (a VMM segment costs a GPU a driver
    call or two per 2 MiB page to make and release: backend_cuda.cpp)."""
    expected = {"": False, "budget:64M": False, "policy:dtr,budget:64M": False,
                "policy:dtralloc,budget:64M": False, "policy:dtralloc": False,
                "unmap_pages:on": True, "policy:dtralloc,budget:64M,unmap_pages:on": True}
    for conf, vmm in expected.items():
        before = (fake.calls("cuMemCreate"), fake.calls("cudaMalloc"))
        pool = dtralloc.Pool("cuda", conf=conf)
        pool.free(pool.malloc(MiB))
        made = (fake.calls("cuMemCreate") - before[0], fake.calls("cudaMalloc") - before[1])
        check(made == ((1, 0) if vmm else (0, 1)), f"conf {conf!r}: {made} (cuMemCreate, cudaMalloc) calls")
        pool.empty_cache()
    no_vmm_leak()


def scenario_without_vmm_auto_runs_and_on_is_refused():
    """Where the device cannot (no VMM support, a granularity that does not
    divide 2 MiB), auto runs on cudaMalloc'd segments as everywhere and on is
    a ConfigError naming why, from Pool('cuda') and from install()'s check."""
    fake.set_vmm(False)
    pool = dtralloc.Pool("cuda", conf="policy:dtralloc,budget:64M")
    pool.free(pool.malloc(MiB))
    check(fake.calls("cudaMalloc") == 1 and fake.calls("cuMemCreate") == 0, "auto did not use cudaMalloc")
    pool.empty_cache()
    for conf in ("unmap_pages:on", "policy:dtralloc,budget:64M,unmap_pages:on"):
        try:
            dtralloc.Pool("cuda", conf=conf)
        except dtralloc.ConfigError as e:
            check("does not support virtual memory management" in str(e) and "unmap_pages" in str(e), str(e))
        else:
            raise AssertionError(f"Pool('cuda', conf={conf!r}) accepted unmap_pages:on without VMM")
    try:
        _core.check_cuda_config("unmap_pages:on")  # what install() calls
    except dtralloc.ConfigError as e:
        check("does not support virtual memory management" in str(e), str(e))
    else:
        raise AssertionError("check_cuda_config accepted unmap_pages:on without VMM")
    _core.check_cuda_config("policy:dtralloc,budget:64M")  # auto is fine
    fake.set_vmm(True, 4 * MiB)  # pages the driver cannot map one by one
    try:
        dtralloc.Pool("cuda", conf="unmap_pages:on")
    except dtralloc.ConfigError as e:
        check("4194304 bytes" in str(e) and "2 MiB pages" in str(e), str(e))
    else:
        raise AssertionError("a 4 MiB granularity was accepted")
    fake.set_vmm(True)
    _core.check_cuda_config("unmap_pages:on")
    try:  # a device that does not exist is named as such, not as missing VMM
        dtralloc.Pool("cuda", conf="unmap_pages:on", device=3)
    except RuntimeError as e:
        check("CUDA device 3 does not exist" in str(e), str(e))
    else:
        raise AssertionError("Pool('cuda', device=3) was created on a one-device runtime")
    no_vmm_leak()


def scenario_out_of_memory_midway_leaves_nothing_behind():
    """A device that runs out partway through a segment's pages is an
    out-of-memory answer: the pages already mapped and the reservation go
    back, and the pool raises its OOM; the next malloc works. So is an
    injected cuMemCreate failure."""
    pool = dtralloc.Pool("cuda", conf="unmap_pages:on")
    fake.set_capacity(64 * MiB)
    hold = pool.malloc(58 * MiB)  # 29 pages; 3 more fit
    created = fake.calls("cuMemCreate")
    try:
        pool.malloc(10 * MiB)  # a 20 MiB segment: 10 pages
    except dtralloc.OutOfMemoryError:
        pass
    else:
        raise AssertionError("no out-of-memory error")
    check(fake.calls("cuMemCreate") >= created + 4, "the segment did not fail at its 4th page")
    check(fake.vmm_live()["reservations"] == 1, f"a reservation leaked: {fake.vmm_live()}")
    check(fake.used_bytes(0) == 58 * MiB, f"pages leaked: {fake.used_bytes(0)}")
    pool.free(hold)
    pool.empty_cache()
    no_vmm_leak()
    # Two: a standard segment the device refuses is asked again at the
    # request's own size (Note [The device is the limit]), whose first page
    # fails too.
    fake.fail_next_mem_creates(2)
    try:
        pool.malloc(4 * MiB)
    except dtralloc.OutOfMemoryError:
        pass
    else:
        raise AssertionError("an injected cuMemCreate failure was not an out-of-memory error")
    ptr = pool.malloc(4 * MiB)
    ctypes.memset(ptr, 1, 4 * MiB)
    pool.free(ptr)
    pool.empty_cache()
    no_vmm_leak()
    # One: the 20 MiB segment is refused, the 4 MiB one of its own size made.
    fake.fail_next_mem_creates(1)
    ptr = pool.malloc(4 * MiB)
    check(fake.used_bytes(0) == 4 * MiB, f"not a segment of the request's own size: {fake.used_bytes(0)}")
    pool.free(ptr)
    pool.empty_cache()
    no_vmm_leak()


def scenario_a_thread_without_a_context_allocates():
    """Driver calls need a current context; a thread the runtime never used
    has none, and the backend makes the device's current first."""
    pool = dtralloc.Pool("cuda", conf="unmap_pages:on")
    fake.reset()  # no context anywhere, nor on this thread
    out = {}

    def worker():
        try:
            ptr = pool.malloc(6 * MiB)
            ctypes.memset(ptr, 7, 6 * MiB)
            pool.free(ptr)
            pool.empty_cache()
        except BaseException as e:  # reported below
            out["error"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    check("error" not in out, repr(out.get("error")))
    check(fake.calls("cuMemCreate") == 10, "the thread made no 20 MiB VMM segment")
    check(fake.calls("cudaSetDevice") >= 1, "no context was made current")
    no_vmm_leak()


def scenario_torch_entry_points_get_vmm_segments():
    """The process-wide allocator behind libdtralloc.so (what install() hands
    torch) makes VMM segments under DTRALLOC_CONF=...,unmap_pages:on"""
    malloc, free = _scenario_main.global_malloc_free()
    ptr = malloc(5 * MiB, 0, None)
    check(ptr is not None, "dtralloc_malloc returned NULL")
    ctypes.memset(ptr, 3, 5 * MiB)
    check(fake.calls("cuMemCreate") > 0 and fake.calls("cudaMalloc") == 0, "the global pool did not use VMM")
    free(ptr, 5 * MiB, 0, None)
    check(dtralloc.memory_stats()["num_device_alloc"] == 1, "stats do not show the segment")


if __name__ == "__main__":
    sys.exit(_scenario_main.run(globals(), sys.argv))
