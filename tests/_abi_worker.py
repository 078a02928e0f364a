"""Worker process for tests/test_c_abi.py and tests/test_install.py.

The process-wide allocators behind libdtralloc.so load the CUDA runtime once
per process, so every scenario runs in a fresh interpreter:

    DTRALLOC_CUDART=<fake runtime> [DTRALLOC_CONF=...] python _abi_worker.py SCENARIO

A scenario drives the allocator exactly as torch's CUDAPluggableAllocator does:
it takes the *addresses* of the C symbols (as
``torch.cuda.memory.CUDAPluggableAllocator`` and ``dtralloc.install()`` do) and
calls them through function pointers with torch's own prototypes
(torch/csrc/cuda/CUDAPluggableAllocator.h). It then checks through the Python
API (memory_stats, snapshot, empty_cache, _core.global_pool) that both reach
the very same pool, and through the fake runtime's counters that every
cudaMalloc/cudaFree is accounted for. A scenario raises on failure and prints
``PASS <name>`` when done; the parent asserts on the exit code and stderr.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import random
import sys
import tempfile
import threading
import types

import _scenario_main
import dtralloc
from dtralloc import _core
from dtralloc.testing import FakeCudaRuntime

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
SMALL_SEGMENT = 2 * MiB  # allocator/block_pool.h: kSmallBuffer
LARGE_SEGMENT = 20 * MiB  # kLargeBuffer, for 1..10 MiB requests
OTHER_STREAM = 0x5000  # a cudaStream_t value; the fake never dereferences it

# torch's std::function prototypes (CUDAPluggableAllocator.h), as C types.
_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_INIT_FN = ctypes.CFUNCTYPE(None, ctypes.c_int)
_RESET_FN = ctypes.CFUNCTYPE(None)
_FRACTION_FN = ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int)
_BASE_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t))
_RECORD_STREAM_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)

# (attribute here, C symbol, prototype): the functions torch is given.
TORCH_ENTRY_POINTS = (
    ("malloc", "dtralloc_malloc", _ALLOC_FN),
    ("free", "dtralloc_free", _FREE_FN),
    ("init", "dtralloc_init", _INIT_FN),
    ("reset", "dtralloc_empty_cache", _RESET_FN),
    ("set_memory_fraction", "dtralloc_set_memory_fraction", _FRACTION_FN),
    ("_base_alloc", "dtralloc_base_alloc", _BASE_ALLOC_FN),
    ("record_stream", "dtralloc_record_stream", _RECORD_STREAM_FN),
)


def symbol_address(lib: ctypes.CDLL, name: str) -> int:
    """What CUDAPluggableAllocator.__init__ does with a symbol name."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class TorchView:
    """libdtralloc.so seen the way torch sees it: function pointers.

    ctypes calls through CFUNCTYPE pointers release the GIL, so Python
    threads really do run the allocator concurrently.
    """

    def __init__(self, addresses: dict[str, int] | None = None):
        self.lib = ctypes.CDLL(dtralloc.library_path())
        for attr, symbol, proto in TORCH_ENTRY_POINTS:
            address = (addresses or {}).get(symbol) or symbol_address(self.lib, symbol)
            setattr(self, attr, proto(address))
        self.lib.dtralloc_last_error.restype = ctypes.c_char_p
        self.lib.dtralloc_last_error.argtypes = []
        self.lib.dtralloc_invalid_free_count.restype = ctypes.c_longlong
        self.lib.dtralloc_invalid_free_count.argtypes = []

    def base_alloc(self, ptr: int) -> tuple[int | None, int]:
        size = ctypes.c_size_t(12345)
        base = self._base_alloc(ptr, ctypes.byref(size))
        return base, size.value

    def last_error(self) -> str:
        return self.lib.dtralloc_last_error().decode()

    def invalid_frees(self) -> int:
        return self.lib.dtralloc_invalid_free_count()


class Captured:
    text = ""


@contextlib.contextmanager
def captured_stderr():
    """Capture what C code writes on fd 2 (and echo it for the parent)."""
    sys.stderr.flush()
    saved = os.dup(2)
    out = Captured()
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.text = tmp.read().decode(errors="replace")
            sys.stderr.write(out.text)
            sys.stderr.flush()


def stats(device: int = 0) -> dict:
    return dtralloc.memory_stats(device)


def check(cond: bool, message: str = "") -> None:
    """assert that survives python -O."""
    if not cond:
        raise AssertionError(message)


def eq(actual, expected, what: str) -> None:
    check(actual == expected, f"{what}: expected {expected!r}, got {actual!r}")


def expect_error(fn, error_type, *texts: str) -> str:
    """fn() raises error_type whose message holds every text; returns it."""
    try:
        fn()
    except error_type as e:
        for text in texts:
            check(text in str(e), f"{text!r} not in {e}")
        return str(e)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {error_type.__name__}")


def fill(addr: int, size: int, byte: int) -> None:
    ctypes.memset(addr, byte, size)


def verify(addr: int, size: int, byte: int) -> None:
    """The block still holds its pattern: head, tail and a middle sample."""
    span = min(size, 64 * KiB)
    for start in {0, size - span, (size - span) // 2}:
        got = ctypes.string_at(addr + start, span)
        if got != bytes([byte]) * span:
            raise AssertionError(f"block {addr:#x}+{start} (size {size}) lost its pattern {byte:#x}")


def fake_counts_match(fake: FakeCudaRuntime, devices=(0,), failed_mallocs: int = 0) -> None:
    """Every successful cudaMalloc/cudaFree is one num_device_alloc/_free."""
    allocs = sum(stats(d)["num_device_alloc"] for d in devices)
    frees = sum(stats(d)["num_device_free"] for d in devices)
    eq(fake.calls("cudaMalloc") - failed_mallocs, allocs, "cudaMalloc calls vs num_device_alloc")
    eq(fake.calls("cudaFree"), frees, "cudaFree calls vs num_device_free")


def segment_of(addr: int, device: int | None = None) -> dict:
    for seg in dtralloc.snapshot()["segments"]:
        if seg["address"] <= addr < seg["address"] + seg["total_size"]:
            if device is None or seg["device"] == device:
                return seg
    raise AssertionError(f"{addr:#x} is in no segment of dtralloc.snapshot()")


def block_state(addr: int) -> str:
    for block in segment_of(addr)["blocks"]:
        if block["address"] == addr:
            return block["state"]
    raise AssertionError(f"no block starts at {addr:#x}")


def drain(abi: TorchView, fake: FakeCudaRuntime, devices=(0,)) -> None:
    """Everything is freed: empty_cache gives every byte back to the fake."""
    for d in devices:
        _core.global_pool(d).check_invariants()
        eq(stats(d)["allocated_bytes.all.current"], 0, f"allocated bytes on device {d}")
    abi.reset()
    eq(fake.live_allocations(), 0, "fake live allocations after empty_cache")
    eq(fake.live_events(), 0, "fake live events after empty_cache")
    for d in devices:
        eq(fake.used_bytes(d), 0, f"fake used bytes on device {d}")
        eq(stats(d)["reserved_bytes.all.current"], 0, f"reserved bytes on device {d}")


# ---- scenarios -------------------------------------------------------------


def scenario_round_trip():
    fake = FakeCudaRuntime()
    abi = TorchView()
    abi.init(1)  # torch's lazy CUDA init calls this first
    eq(abi.last_error(), "", "last error after init")

    p = abi.malloc(1000, 0, None)
    check(p is not None and p % 512 == 0, f"malloc(1000) gave {p!r}")
    eq(fake.calls("cudaMalloc"), 1, "cudaMalloc calls after first malloc")
    eq(fake.used_bytes(0), SMALL_SEGMENT, "fake used bytes")
    fill(p, 1000, 0xAB)
    verify(p, 1000, 0xAB)

    # The Python API sees the block the C ABI handed out.
    s = stats()
    eq(s["allocated_bytes.all.current"], 1024, "allocated bytes")
    eq(s["requested_bytes.all.current"], 1000, "requested bytes")
    eq(s["allocation.small_pool.current"], 1, "small-pool allocations")
    eq(s["reserved_bytes.all.current"], SMALL_SEGMENT, "reserved bytes")
    eq(s["num_device_alloc"], 1, "num_device_alloc")
    seg = segment_of(p)
    eq(seg["device"], 0, "segment device")
    eq(seg["segment_type"], "small", "segment type")
    eq(block_state(p), "active_allocated", "block state")
    actions = [e["action"] for e in dtralloc.snapshot()["device_traces"][0]]
    check(actions[-2:] == ["segment_alloc", "alloc"], f"trace {actions}")

    # Freed blocks are cached: the same size comes back without a cudaMalloc.
    abi.free(p, 1000, 0, None)
    eq(stats()["allocated_bytes.all.current"], 0, "allocated after free")
    eq(stats()["reserved_bytes.all.current"], SMALL_SEGMENT, "reserved after free (cached)")
    eq(fake.calls("cudaFree"), 0, "cudaFree calls after free")
    eq(abi.malloc(1000, 0, None), p, "second malloc of the same size")
    eq(fake.calls("cudaMalloc"), 1, "cudaMalloc calls after second malloc")
    abi.free(p, 1000, 0, None)

    # Size 0 is NULL and touches nothing.
    eq(abi.malloc(0, 0, None), None, "malloc(0)")
    eq(abi.last_error(), "", "last error after malloc(0)")
    eq(fake.calls("cudaMalloc"), 1, "cudaMalloc calls after malloc(0)")
    abi.free(None, 0, 0, None)  # torch may free a NULL data pointer

    # A large request gets its own segment, also cached.
    q = abi.malloc(30 * MiB, 0, None)
    eq(fake.calls("cudaMalloc"), 2, "cudaMalloc calls after 30 MiB")
    eq(segment_of(q)["total_size"], 30 * MiB, "30 MiB segment size")
    abi.free(q, 30 * MiB, 0, None)
    eq(abi.malloc(30 * MiB, 0, None), q, "30 MiB again")
    eq(fake.calls("cudaMalloc"), 2, "cudaMalloc calls after 30 MiB again")
    abi.free(q, 30 * MiB, 0, None)

    # Both doors lead into one pool: _core's pool and the C ABI free each other's blocks.
    pool = _core.global_pool(0)
    a = pool.malloc(4096, 0)
    check(pool.owns(a), "pool owns its block")
    abi.free(a, 4096, 0, None)
    check(not pool.owns(a), "C ABI free released the pool block")
    b = abi.malloc(4096, 0, None)
    check(pool.owns(b), "pool owns a C ABI block")
    pool.free(b)

    # base_alloc (torch's getBaseAllocation, used for CUDA IPC).
    p1 = abi.malloc(1000, 0, None)
    p2 = abi.malloc(2000, 0, None)
    seg = segment_of(p2)
    eq(abi.base_alloc(p2), (seg["address"], SMALL_SEGMENT), "base_alloc of the second block")
    eq(abi.base_alloc(p1), (seg["address"], SMALL_SEGMENT), "base_alloc of the first block")
    eq(abi.base_alloc(0x10), (0x10, 0), "base_alloc of an unknown pointer")

    # Summary and reset functions act on the same pool.
    check("dtralloc memory summary, device 0" in dtralloc.memory_summary(0), "summary title")
    abi.free(p1, 1000, 0, None)
    abi.free(p2, 2000, 0, None)
    dtralloc.reset_peak_memory_stats(0)
    eq(stats()["allocated_bytes.all.peak"], 0, "peak after reset_peak_memory_stats")

    # Python's empty_cache releases what the C ABI cached.
    check(fake.live_allocations() > 0, "something is cached before empty_cache")
    dtralloc.empty_cache()
    eq(fake.live_allocations(), 0, "fake live allocations after dtralloc.empty_cache()")
    fake_counts_match(fake)

    # And torch's empty_cache hook (reset_fn) does the same.
    p = abi.malloc(5 * MiB, 0, None)
    abi.free(p, 5 * MiB, 0, None)
    eq(fake.live_allocations(), 1, "one cached segment")
    abi.reset()
    eq(fake.live_allocations(), 0, "fake live allocations after the reset hook")
    fake_counts_match(fake)
    eq(abi.invalid_frees(), 0, "invalid frees")
    eq(abi.last_error(), "", "last error")
    _core.global_pool(0).check_invariants()


def _expect_oom(abi: TorchView, size: int, device: int = 0, stream=None) -> str:
    with captured_stderr() as err:
        ptr = abi.malloc(size, device, stream)
    eq(ptr, None, f"malloc({size}) under the budget")
    check("CUDA out of memory." in err.text, f"no OOM message on stderr: {err.text!r}")
    check("(in dtralloc_malloc)" in err.text, f"stderr does not name the entry point: {err.text!r}")
    last = abi.last_error()
    check(last.startswith("dtralloc: CUDA out of memory."), f"last_error: {last!r}")
    check(last in err.text, "last_error is the message printed on stderr")
    return last


def scenario_budget_absolute():  # DTRALLOC_CONF=budget:64M
    fake = FakeCudaRuntime()
    abi = TorchView()
    a = abi.malloc(60 * MiB, 0, None)
    check(a is not None, "60 MiB fits a 64 MiB budget")
    s = stats()
    eq(s["budget_bytes"], 64 * MiB, "budget_bytes")
    eq(s["capacity_bytes"], GiB, "capacity_bytes (the fake's default)")

    message = _expect_oom(abi, 8 * MiB)  # a 20 MiB segment would pass the budget
    check("Budget 64 MiB" in message and "budget" in message.split("device capacity")[1], message)
    s = stats()
    eq(s["num_ooms"], 1, "num_ooms")
    eq(s["reserved_bytes.all.current"], 60 * MiB, "reserved after OOM")
    eq(fake.calls("cudaMalloc"), 1, "the budget refused before cudaMalloc")
    oom = [e for e in dtralloc.snapshot()["device_traces"][0] if e["action"] == "oom"]
    eq(len(oom), 1, "oom entries in the snapshot trace")
    eq(oom[0]["device_free"], 4 * MiB, "oom device_free (room left under the budget)")

    # A fraction above the configured budget leaves the budget alone.
    abi.set_memory_fraction(0.5, 0)
    eq(stats()["budget_bytes"], 64 * MiB, "budget after fraction 0.5 of 1 GiB")

    # The next success clears last_error; the cached 60 MiB block serves 8 MiB.
    abi.free(a, 60 * MiB, 0, None)
    b = abi.malloc(8 * MiB, 0, None)
    check(b is not None, "8 MiB from the cached 60 MiB segment")
    eq(abi.last_error(), "", "last_error after a successful malloc")
    eq(fake.calls("cudaMalloc"), 1, "no new cudaMalloc for the split")
    _core.global_pool(0).check_invariants()
    abi.free(b, 8 * MiB, 0, None)
    fake_counts_match(fake)
    drain(abi, fake)


def scenario_device_call_time():
    """device_alloc_ns / device_free_ns: the host time inside cudaMalloc and
    cudaFree, the wait cudaFree makes for the device included."""
    fake = FakeCudaRuntime()
    abi = TorchView()
    eq((stats()["device_alloc_ns"], stats()["device_free_ns"]), (0, 0), "before any device call")
    wait_ns = 30_000_000  # 30 ms of work queued before each cudaFree
    fake.set_free_wait_ns(wait_ns)
    try:
        a = abi.malloc(40 * MiB, 0, None)
        s = stats()
        check(0 < s["device_alloc_ns"] < wait_ns, f"one cudaMalloc: {s['device_alloc_ns']} ns")
        eq(s["device_free_ns"], 0, "no cudaFree yet")
        abi.free(a, 40 * MiB, 0, None)
        eq(stats()["device_free_ns"], 0, "a free to the cache calls no cudaFree")
        abi.reset()  # torch.cuda.empty_cache(): the cached segment goes back
        s = stats()
        eq(s["num_device_free"], 1, "num_device_free")
        check(wait_ns <= s["device_free_ns"] < 20 * wait_ns, f"one cudaFree that waited: {s['device_free_ns']} ns")
    finally:
        fake.set_free_wait_ns(0)
    fake_counts_match(fake)
    _core.global_pool(0).reset_accumulated_stats()  # torch.cuda.reset_accumulated_memory_stats()
    eq((stats()["device_alloc_ns"], stats()["device_free_ns"]), (0, 0), "after reset_accumulated_stats")
    drain(abi, fake)


def scenario_budget_fraction():  # DTRALLOC_CONF=budget:0.5
    fake = FakeCudaRuntime()
    fake.set_capacity(256 * MiB)  # before the allocator exists: it reads the capacity once
    abi = TorchView()
    a = abi.malloc(100 * MiB, 0, None)
    check(a is not None, "100 MiB fits half of 256 MiB")
    s = stats()
    eq(s["budget_bytes"], 128 * MiB, "budget_bytes")
    eq(s["capacity_bytes"], 256 * MiB, "capacity_bytes")
    _expect_oom(abi, 40 * MiB)
    eq(stats()["num_ooms"], 1, "num_ooms")
    eq(fake.calls("cudaMalloc"), 1, "cudaMalloc calls")
    abi.free(a, 100 * MiB, 0, None)
    fake_counts_match(fake)
    drain(abi, fake)


def scenario_cudamalloc_failures():
    fake = FakeCudaRuntime()
    abi = TorchView()
    failed = 0
    # Two cached segments: a small one and a large one.
    p = abi.malloc(1000, 0, None)
    q = abi.malloc(12 * MiB, 0, None)
    abi.free(p, 1000, 0, None)
    abi.free(q, 12 * MiB, 0, None)
    eq(fake.live_allocations(), 2, "cached segments")

    # One failure: the pool releases its cache and retries.
    fake.fail_next_mallocs(1)
    failed += 1
    with captured_stderr() as err:
        big = abi.malloc(30 * MiB, 0, None)
    check(big is not None, "the retry after releasing the cache succeeds")
    eq(err.text, "", "a recovered failure prints nothing")
    eq(abi.last_error(), "", "last_error after a recovered failure")
    eq(fake.lib.cudaGetLastError(), 0, "the runtime's last error is cleared for torch")
    s = stats()
    eq(s["num_alloc_retries"], 1, "num_alloc_retries")
    eq(s["num_device_free"], 2, "both cached segments were released")
    eq(s["num_ooms"], 0, "num_ooms")
    eq(fake.live_allocations(), 1, "only the new segment is live")
    fake_counts_match(fake, failed_mallocs=failed)

    # Still failing after the retry: NULL, an OOM, nothing corrupted.
    p = abi.malloc(1000, 0, None)
    abi.free(p, 1000, 0, None)  # something to release on the retry
    attempts = fake.calls("cudaMalloc")
    fake.fail_next_mallocs(1000)
    _expect_oom(abi, 30 * MiB)
    attempts = fake.calls("cudaMalloc") - attempts
    failed += attempts
    check(2 <= attempts <= 3, f"{attempts} cudaMalloc attempts for one failing request")
    s = stats()
    eq(s["num_alloc_retries"], 2, "num_alloc_retries")
    eq(s["num_ooms"], 1, "num_ooms")
    eq(s["reserved_bytes.all.current"], 30 * MiB, "the cached small segment was released")
    eq(fake.lib.cudaGetLastError(), 0, "the runtime's last error is cleared for torch")
    _core.global_pool(0).check_invariants()

    # Nothing cached to release: no retry is counted, the malloc fails.
    attempts = fake.calls("cudaMalloc")
    _expect_oom(abi, 30 * MiB)
    failed += fake.calls("cudaMalloc") - attempts
    eq(stats()["num_alloc_retries"], 2, "no retry without a cache")
    eq(stats()["num_ooms"], 2, "num_ooms")
    fake.fail_next_mallocs(0)

    # Once cudaMalloc works again, so does the same request.
    again = abi.malloc(30 * MiB, 0, None)
    check(again is not None, "malloc after the failures")
    verify_ptrs = [(big, 30 * MiB, 0x11), (again, 30 * MiB, 0x22)]
    for addr, size, byte in verify_ptrs:
        fill(addr, size, byte)
    for addr, size, byte in verify_ptrs:
        verify(addr, size, byte)
        abi.free(addr, size, 0, None)
    fake_counts_match(fake, failed_mallocs=failed)
    drain(abi, fake)


def scenario_memory_fraction():
    fake = FakeCudaRuntime()
    abi = TorchView()
    abi.set_memory_fraction(0.25, 0)  # torch.cuda.set_per_process_memory_fraction
    eq(stats()["budget_bytes"], 256 * MiB, "budget after fraction 0.25 of 1 GiB")
    _expect_oom(abi, 300 * MiB)
    eq(stats()["num_ooms"], 1, "num_ooms")
    a = abi.malloc(200 * MiB, 0, None)
    check(a is not None, "200 MiB fits 256 MiB")
    abi.set_memory_fraction(1.0, 0)
    eq(stats()["budget_bytes"], GiB, "budget after fraction 1.0")
    b = abi.malloc(300 * MiB, 0, None)
    check(b is not None, "300 MiB fits after raising the fraction")

    for bad in (1.5, -0.1):
        with captured_stderr() as err:
            abi.set_memory_fraction(bad, 0)
        check("memory fraction must be in [0, 1]" in err.text, f"fraction {bad}: {err.text!r}")
        check("dtralloc_set_memory_fraction" in err.text, err.text)
        check("memory fraction" in abi.last_error(), abi.last_error())
        eq(stats()["budget_bytes"], GiB, f"budget after the bad fraction {bad}")

    # torch accepts 0.0: no memory at all for this process.
    abi.set_memory_fraction(0.0, 0)
    eq(stats()["budget_bytes"], 0, "budget after fraction 0.0")
    _expect_oom(abi, 1 * MiB)
    abi.set_memory_fraction(1.0, 0)

    with captured_stderr() as err:
        abi.set_memory_fraction(0.5, 3)  # the fake has one device
    check("CUDA device 3 does not exist" in err.text, err.text)
    eq(dtralloc.snapshot()["device_traces"].__len__(), 1, "no allocator for the missing device")

    abi.free(a, 200 * MiB, 0, None)
    abi.free(b, 300 * MiB, 0, None)
    fake_counts_match(fake)
    drain(abi, fake)


def scenario_record_stream():
    fake = FakeCudaRuntime()
    abi = TorchView()
    live_events = fake.live_events

    # A block used on another stream is not reused until its event completes.
    p = abi.malloc(1000, 0, None)
    abi.record_stream(p, OTHER_STREAM)
    abi.free(p, 1000, 0, None)
    eq(fake.calls("cudaEventRecord"), 1, "events recorded at free")
    eq(live_events(), 1, "live events")
    eq(block_state(p), "active_pending_free", "state of the freed block")
    s = stats()
    eq(s["allocated_bytes.all.current"], 0, "allocated while pending")
    eq(s["active_bytes.all.current"], 1024, "active while pending")
    q = abi.malloc(1000, 0, None)
    check(q is not None and q != p, "a pending block is not handed out again")
    fake.complete_events()  # the other stream's kernels finished
    r = abi.malloc(1000, 0, None)
    eq(r, p, "the block returns once its event completed")
    eq(live_events(), 0, "the completed event was destroyed")

    # torch.cuda.Stream.synchronize() on the other stream completes it too.
    abi.record_stream(r, OTHER_STREAM)
    abi.free(r, 1000, 0, None)
    fake.lib.cudaStreamSynchronize(ctypes.c_void_p(OTHER_STREAM))
    eq(abi.malloc(1000, 0, None), p, "reuse after cudaStreamSynchronize")

    # record_stream on the block's own stream needs no event.
    events_before = fake.calls("cudaEventRecord")
    abi.record_stream(p, None)
    abi.free(p, 1000, 0, None)
    eq(fake.calls("cudaEventRecord"), events_before, "no event for the block's own stream")
    eq(abi.malloc(1000, 0, None), p, "immediate reuse")

    # Blocks allocated on a stream stay on that stream.
    s1 = abi.malloc(1000, 0, OTHER_STREAM)
    eq(segment_of(s1)["stream"], OTHER_STREAM, "segment stream")
    abi.free(s1, 1000, 0, OTHER_STREAM)
    t = abi.malloc(1000, 0, None)
    check(segment_of(t)["stream"] == 0, "a default-stream request does not take another stream's block")

    # empty_cache waits for pending events, then releases.
    abi.record_stream(t, OTHER_STREAM)
    abi.free(t, 1000, 0, None)
    abi.free(q, 1000, 0, None)
    abi.free(p, 1000, 0, None)
    eq(live_events(), 1, "one pending event")
    abi.reset()
    eq(stats()["num_sync_all_streams"], 1, "num_sync_all_streams")
    eq(live_events(), 0, "events after empty_cache")
    eq(fake.live_allocations(), 0, "fake live allocations after empty_cache")

    # record_stream of something dtralloc does not hold is reported, not fatal.
    before = abi.invalid_frees()
    with captured_stderr() as err:
        abi.record_stream(0xDEAD000, OTHER_STREAM)
    check("record_stream on a pointer no dtralloc allocator holds" in err.text, err.text)
    eq(abi.invalid_frees(), before + 1, "invalid count after a bad record_stream")
    abi.record_stream(None, OTHER_STREAM)  # NULL: nothing to do
    eq(abi.invalid_frees(), before + 1, "NULL record_stream is ignored")
    fake_counts_match(fake)
    drain(abi, fake)


def scenario_capture():
    """Through the C ABI: a miss on a capturing stream is refused (NULL, the
    refusal on stderr and in last_error) before any cudaMalloc; a hit is
    served; once the capture ends the same request works."""
    fake = FakeCudaRuntime()
    abi = TorchView()
    warm = abi.malloc(4096, 0, OTHER_STREAM)
    abi.free(warm, 4096, 0, OTHER_STREAM)
    fake.set_stream_capture(OTHER_STREAM, 1)
    mallocs = fake.calls("cudaMalloc")
    hit = abi.malloc(4096, 0, OTHER_STREAM)
    eq(hit, warm, "a cache hit during capture")
    with captured_stderr() as err:
        eq(abi.malloc(8 * MiB, 0, OTHER_STREAM), None, "a miss during capture")
    for text in ("is capturing a CUDA graph", "dtralloc.install()"):
        check(text in err.text and text in abi.last_error(), err.text)
    eq(fake.calls("cudaMalloc"), mallocs, "no cudaMalloc during capture")
    fake.set_stream_capture(OTHER_STREAM, 0)
    big = abi.malloc(8 * MiB, 0, OTHER_STREAM)
    check(big is not None, "after the capture")
    abi.free(big, 8 * MiB, 0, OTHER_STREAM)
    abi.free(hit, 4096, 0, OTHER_STREAM)
    drain(abi, fake)


def scenario_invalid_free():
    fake = FakeCudaRuntime()
    abi = TorchView()
    p = abi.malloc(1000, 0, None)
    q = abi.malloc(4096, 0, None)
    fill(q, 4096, 0x5A)
    abi.free(p, 1000, 0, None)

    cases = [
        ("double free", (p, 1000, 0, None), "already freed"),
        ("unknown pointer", (0xDEAD0000, 64, 0, None), "has not allocated"),
        ("interior pointer", (q + 512, 512, 0, None), "has not allocated"),
        ("device without allocator", (q, 4096, 7, None), "which has no dtralloc allocator"),
    ]
    for n, (what, args, text) in enumerate(cases, start=1):
        with captured_stderr() as err:
            abi.free(*args)
        check(text in err.text and "(in dtralloc_free)" in err.text, f"{what}: {err.text!r}")
        check(abi.last_error() in err.text and abi.last_error(), f"{what}: last_error {abi.last_error()!r}")
        eq(abi.invalid_frees(), n, f"invalid frees after the {what}")
    eq(stats()["num_invalid_frees"], 3, "num_invalid_frees of device 0 (device 7 has no pool)")

    with captured_stderr() as err:
        abi.free(None, 0, 0, None)
    eq(err.text, "", "free(NULL) prints nothing")
    eq(abi.invalid_frees(), 4, "free(NULL) is not an invalid free")

    # Nothing was corrupted: q is intact and still allocated, p's block is reused.
    pool = _core.global_pool(0)
    pool.check_invariants()
    verify(q, 4096, 0x5A)
    eq(stats()["allocated_bytes.all.current"], 4096, "allocated bytes")
    eq(abi.malloc(1000, 0, None), p, "the double-freed block is handed out once")
    abi.free(p, 1000, 0, None)
    abi.free(q, 4096, 0, None)
    pool.check_invariants()
    fake_counts_match(fake)
    drain(abi, fake)


def scenario_two_devices():
    fake = FakeCudaRuntime()
    fake.set_device_count(2)
    abi = TorchView()
    current = ctypes.c_int(-1)

    p0 = abi.malloc(1000, 0, None)
    p1 = abi.malloc(1000, 1, None)
    check(p0 and p1 and p0 != p1, "one block per device")
    fake.lib.cudaGetDevice(ctypes.byref(current))
    eq(current.value, 0, "the caller's current device is restored")
    eq(fake.used_bytes(0), SMALL_SEGMENT, "device 0 used bytes")
    eq(fake.used_bytes(1), SMALL_SEGMENT, "device 1 used bytes")
    for d in (0, 1):
        eq(stats(d)["allocated_bytes.all.current"], 1024, f"device {d} allocated")
        eq(_core.global_pool(d).device, d, "pool device")
    eq(segment_of(p1)["device"], 1, "snapshot device of p1")
    eq(len(dtralloc.snapshot()["device_traces"]), 2, "device traces")

    # Freeing on the wrong device is rejected and leaves both pools intact.
    with captured_stderr() as err:
        abi.free(p1, 1000, 0, None)
    check("has not allocated" in err.text, err.text)
    eq(stats(1)["allocated_bytes.all.current"], 1024, "device 1 still holds p1")
    eq(stats(0)["num_invalid_frees"], 1, "counted on device 0")

    # record_stream and budgets are per device.
    abi.record_stream(p1, OTHER_STREAM)
    abi.free(p1, 1000, 1, None)
    eq(block_state(p1), "active_pending_free", "p1 pending on device 1")
    # A device-1 block used on the default stream while device 0 is current:
    # the event must be created and recorded on device 1 (the fake rejects
    # recording another device's event on stream 0).
    s1 = abi.malloc(1000, 1, OTHER_STREAM)
    abi.record_stream(s1, None)
    with captured_stderr() as err:
        abi.free(s1, 1000, 1, OTHER_STREAM)
    eq(err.text, "", "record_stream on device 1's default stream")
    eq(block_state(s1), "active_pending_free", "s1 pending on device 1")
    abi.set_memory_fraction(0.5, 1)
    eq(stats(1)["budget_bytes"], 512 * MiB, "device 1 budget")
    eq(stats(0)["budget_bytes"], GiB, "device 0 budget unchanged")
    _expect_oom(abi, 600 * MiB, device=1)
    big = abi.malloc(600 * MiB, 0, None)
    check(big is not None, "device 0 keeps its own budget")
    abi.free(big, 600 * MiB, 0, None)

    for bad, text in ((2, "CUDA device 2 does not exist"), (-1, "out of range")):
        with captured_stderr() as err:
            eq(abi.malloc(1000, bad, None), None, f"malloc on device {bad}")
        check(text in err.text, err.text)
        check(text in abi.last_error(), abi.last_error())

    abi.free(p0, 1000, 0, None)
    eq((stats(0)["num_ooms"], stats(1)["num_ooms"]), (0, 1), "num_ooms per device")
    drain(abi, fake, devices=(0, 1))
    fake_counts_match(fake, devices=(0, 1))


def scenario_bad_conf():  # DTRALLOC_CONF is invalid; `import dtralloc` above already worked
    fake = FakeCudaRuntime()
    abi = TorchView()
    conf = os.environ["DTRALLOC_CONF"]
    with captured_stderr() as err:
        abi.init(1)
    check("DTRALLOC_CONF" in err.text and "(in dtralloc_init)" in err.text, err.text)
    for _ in range(2):  # a bad conf is not remembered as good
        with captured_stderr() as err:
            eq(abi.malloc(1000, 0, None), None, "malloc with a bad DTRALLOC_CONF")
        check("DTRALLOC_CONF" in err.text and "(in dtralloc_malloc)" in err.text, err.text)
        check(abi.last_error() in err.text and "DTRALLOC_CONF" in abi.last_error(), abi.last_error())
    with captured_stderr() as err:
        abi.set_memory_fraction(0.5, 0)
    check("DTRALLOC_CONF" in err.text, err.text)
    abi.reset()  # no allocator: nothing to do
    abi.free(None, 0, 0, None)
    eq(fake.calls("cudaMalloc"), 0, "no device memory was touched")
    expect_error(lambda: dtralloc.memory_stats(0), dtralloc.ConfigError, "DTRALLOC_CONF")
    # Fixing the variable in the process fixes the allocator (nothing was cached).
    os.environ["DTRALLOC_CONF"] = "budget:64M"
    p = abi.malloc(1000, 0, None)
    check(p is not None, "malloc after fixing DTRALLOC_CONF")
    eq(stats()["budget_bytes"], 64 * MiB, "budget from the fixed conf")
    abi.free(p, 1000, 0, None)
    drain(abi, fake)


def scenario_missing_runtime():  # DTRALLOC_CUDART points at nothing
    abi = TorchView()
    path = os.environ["DTRALLOC_CUDART"]
    for _ in range(2):
        with captured_stderr() as err:
            eq(abi.malloc(1000, 0, None), None, "malloc without a runtime")
        check(f"DTRALLOC_CUDART={path} could not be loaded" in err.text, err.text)
        check("DTRALLOC_CUDART" in abi.last_error(), abi.last_error())
    expect_error(lambda: dtralloc.memory_stats(0), RuntimeError, "DTRALLOC_CUDART")
    eq(_core.cuda_device_count(), 0, "cuda_device_count without a runtime")
    dtralloc.empty_cache()  # nothing exists; must not raise
    abi.reset()


def scenario_no_device():
    fake = FakeCudaRuntime()
    fake.set_device_count(0)
    abi = TorchView()
    with captured_stderr() as err:
        eq(abi.malloc(1000, 0, None), None, "malloc without devices")
    check("sees no usable GPU" in err.text, err.text)
    # A failed creation is not remembered: a device appearing later is used.
    fake.set_device_count(1)
    p = abi.malloc(1000, 0, None)
    check(p is not None, "malloc once a device exists")
    abi.free(p, 1000, 0, None)
    drain(abi, fake)


def scenario_threads():
    fake = FakeCudaRuntime()
    abi = TorchView()
    n_threads, n_ops = 4, 300
    barrier = threading.Barrier(n_threads + 1)
    errors: list[str] = []
    done = threading.Event()

    def pick_size(rng: random.Random) -> int:
        r = rng.random()
        if r < 0.70:
            return rng.randint(1, 64 * KiB)
        if r < 0.97:
            return rng.randint(64 * KiB, 2 * MiB)
        return rng.randint(2 * MiB, 16 * MiB)

    def worker(tid: int) -> None:
        rng = random.Random(1234 + tid)
        stream = None if tid == 0 else 0x1000 * tid  # threads 1..3 use their own streams
        live: list[tuple[int, int, int]] = []
        try:
            barrier.wait()
            for i in range(n_ops):
                if live and (len(live) >= 12 or rng.random() < 0.45):
                    addr, size, byte = live.pop(rng.randrange(len(live)))
                    verify(addr, size, byte)
                    if rng.random() < 0.1:
                        abi.record_stream(addr, OTHER_STREAM + tid)
                    abi.free(addr, size, 0, stream)
                else:
                    size = pick_size(rng)
                    addr = abi.malloc(size, 0, stream)
                    if not addr:
                        errors.append(f"thread {tid}: malloc({size}) failed: {abi.last_error()}")
                        continue
                    byte = (tid * 64 + i) % 255 + 1
                    fill(addr, size, byte)
                    live.append((addr, size, byte))
                if i % 40 == 0:
                    fake.complete_events()
            for addr, size, byte in live:
                verify(addr, size, byte)
                abi.free(addr, size, 0, stream)
        except Exception as e:  # reported by the main thread
            errors.append(f"thread {tid}: {e!r}")

    def observer() -> None:
        # Stats, snapshots and empty_cache from a fifth thread, concurrently.
        barrier.wait()
        while not done.is_set():
            try:
                s = stats()
                check(s["allocated_bytes.all.current"] <= s["reserved_bytes.all.current"], "allocated <= reserved")
                dtralloc.snapshot()
                abi.reset()
            except Exception as e:
                errors.append(f"observer: {e!r}")
                return

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    watcher = threading.Thread(target=observer)
    for t in threads + [watcher]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    check(not errors, "\n".join(errors))
    s = stats()
    eq(s["num_invalid_frees"], 0, "num_invalid_frees")
    eq(s["num_ooms"], 0, "num_ooms")
    eq(s["allocation.all.current"], 0, "live allocations")
    check(s["allocation.all.allocated"] >= n_threads * n_ops // 2, "allocations happened")
    eq(abi.invalid_frees(), 0, "invalid frees")
    drain(abi, fake)
    fake_counts_match(fake)


def _in_child(fn) -> int:
    """Runs fn in a forked child; its exit status (0 when fn returned)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        except BaseException:  # reported by the parent through the status
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def scenario_fork():
    """fork() after dtralloc served CUDA memory: the child inherits a copy of
    the pool, but not the device memory or CUDA context behind it. It must not
    hand out the parent's blocks; it says why and what to do instead."""
    fake = FakeCudaRuntime()
    abi = TorchView()

    def fresh_child():  # forked before any allocator existed: dtralloc works
        p = abi.malloc(1000, 0, None)
        check(p is not None, f"malloc in a child forked before any CUDA use: {abi.last_error()}")
        abi.free(p, 1000, 0, None)

    eq(_in_child(fresh_child), 0, "child forked before any allocation")

    p = abi.malloc(1000, 0, None)
    q = abi.malloc(5 * MiB, 0, None)
    abi.free(q, 5 * MiB, 0, None)  # cached in the parent's pool

    def inherited_child():
        with captured_stderr() as err:
            eq(abi.malloc(5 * MiB, 0, None), None, "malloc in the forked child")
        for text in ("fork", "spawn"):
            check(text in abi.last_error(), abi.last_error())
        check("fork" in err.text, err.text)
        invalid = abi.invalid_frees()
        with captured_stderr() as err:
            abi.free(p, 1000, 0, None)  # a tensor the child inherited dies
            abi.record_stream(p, OTHER_STREAM)
            abi.reset()  # torch.cuda.empty_cache()
        eq(err.text, "", "frees of inherited memory are dropped quietly")
        eq(abi.invalid_frees(), invalid, "not counted as invalid frees")
        expect_error(lambda: dtralloc.memory_stats(0), RuntimeError, "fork")
        check(_core.existing_global_pool(0) is None, "the inherited allocator is gone")
        eq(dtralloc.snapshot()["segments"], [], "nothing of the parent's pool in the child's snapshot")

    eq(_in_child(inherited_child), 0, "child forked after allocations")
    # The parent is untouched.
    eq(block_state(p), "active_allocated", "the parent's block")
    eq(abi.malloc(5 * MiB, 0, None), q, "the parent's cache")
    abi.free(q, 5 * MiB, 0, None)
    abi.free(p, 1000, 0, None)
    drain(abi, fake)


# ---- CuPy ------------------------------------------------------------------


class FakeCupy:
    """The slice of CuPy that dtralloc.cupy_hooks uses, with CuPy's signatures:
    cupy.cuda.UnownedMemory(ptr, size, owner, device_id=-1) and
    cupy.cuda.MemoryPointer(mem, offset) (cupy/cuda/memory.pyx)."""

    def __init__(self):
        self.device = 0
        self.stream = 0
        self.allocator = "unset"
        state = self
        cupy = types.ModuleType("cupy")
        cuda = types.ModuleType("cupy.cuda")

        class Device:
            def __init__(self, device=None):
                self.id = state.device if device is None else device

        class Stream:
            def __init__(self, ptr):
                self.ptr = ptr

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                if device_id < 0:
                    if ptr == 0:
                        raise RuntimeError("UnownedMemory requires explicit device ID for a null pointer.")
                    raise AssertionError("dtralloc must pass device_id (CuPy would query the pointer)")
                self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem, offset):
                check(mem.ptr != 0 or offset == 0, "MemoryPointer of a null pointer with an offset")
                self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id

        def set_allocator(allocator=None):
            state.allocator = allocator

        cuda.Device = Device
        cuda.UnownedMemory = UnownedMemory
        cuda.MemoryPointer = MemoryPointer
        cuda.set_allocator = set_allocator
        cuda.get_current_stream = lambda: Stream(state.stream)
        cupy.cuda = cuda
        sys.modules["cupy"] = cupy
        sys.modules["cupy.cuda"] = cuda


def scenario_cupy():  # DTRALLOC_CONF=budget:64M
    fake = FakeCudaRuntime()
    fake.set_device_count(2)
    cupy = FakeCupy()
    abi = TorchView()
    dtralloc.install_cupy()
    check(cupy.allocator is dtralloc.cupy_allocator, "install_cupy sets dtralloc.cupy_allocator")
    alloc = cupy.allocator

    mp = alloc(1000)
    check(mp.ptr != 0 and mp.mem.size == 1000 and mp.device_id == 0, "memory pointer")
    fill(mp.ptr, 1000, 0x3C)
    eq(stats()["allocated_bytes.all.current"], 1024, "allocated after the CuPy malloc")
    # torch (the C ABI) allocates from the very same pool and segment.
    t = abi.malloc(1000, 0, None)
    eq(segment_of(t)["address"], segment_of(mp.ptr)["address"], "CuPy and torch share a segment")
    verify(mp.ptr, 1000, 0x3C)
    addr = mp.ptr
    del mp
    gc.collect()
    eq(stats()["allocated_bytes.all.current"], 1024, "dropping the MemoryPointer freed the block")
    eq(block_state(addr), "inactive", "CuPy's block after the drop")
    eq(abi.malloc(1000, 0, None), addr, "torch reuses the block CuPy dropped")
    abi.free(addr, 1000, 0, None)

    # Offsets into the memory keep it alive (CuPy's views).
    mp = alloc(4096)
    view = type(mp)(mp.mem, 512)
    eq(view.ptr, mp.ptr + 512, "view pointer")
    del mp
    gc.collect()
    eq(stats()["allocated_bytes.all.current"], 1024 + 4096, "a view keeps the block")
    del view
    gc.collect()
    eq(stats()["allocated_bytes.all.current"], 1024, "block freed with its last view")

    # Size 0: a null pointer with a device, no pool traffic.
    before = stats()["allocation.all.allocated"]
    z = alloc(0)
    eq((z.ptr, z.mem.size, z.device_id), (0, 0, 0), "size-0 memory pointer")
    eq(stats()["allocation.all.allocated"], before, "size 0 does not allocate")
    del z

    # CuPy's current stream and device are honoured.
    cupy.stream = OTHER_STREAM
    s = alloc(1000)
    eq(segment_of(s.ptr)["stream"], OTHER_STREAM, "segment stream of a CuPy block")
    cupy.stream = 0
    cupy.device = 1
    d1 = alloc(1000)
    eq(d1.device_id, 1, "device of a CuPy block")
    eq(stats(1)["allocated_bytes.all.current"], 1024, "device 1 allocated")
    check(fake.used_bytes(1) > 0, "device 1 memory came from the fake")
    cupy.device = 0

    # Out of memory is a MemoryError, which CuPy's callers expect.
    expect_error(lambda: alloc(100 * MiB), dtralloc.OutOfMemoryError, "CUDA out of memory.")
    check(issubclass(dtralloc.OutOfMemoryError, MemoryError), "a MemoryError")

    del s, d1
    gc.collect()
    abi.free(t, 1000, 0, None)
    drain(abi, fake, devices=(0, 1))
    fake_counts_match(fake, devices=(0, 1))


# ---- install() against torch with stood-in CUDA bindings ---------------------


def cuda_torch():
    """The real (CPU-only) torch with the CUDA bindings of tests/_torch_standin.py."""
    import torch
    from _torch_standin import StandIn

    return torch, StandIn(torch).apply(setattr)


def scenario_install_wiring():  # DTRALLOC_CONF is unset; install() gets budget:64M
    """dtralloc.install() under torch's own Python code; then torch's C++ side
    (as _torch_standin.TorchCudaSide restates it) calls what it was given."""
    from _torch_standin import TorchCudaSide

    fake = FakeCudaRuntime()
    torch, standin = cuda_torch()
    dtralloc.install("budget:64M")
    check(dtralloc.installed(), "installed()")
    eq(_core.config_text(), "budget:64M", "configuration in force")
    dtralloc.install("budget:64M")  # same conf: a no-op

    lib = ctypes.CDLL(dtralloc.library_path())
    side = TorchCudaSide(standin)
    # torch gets the throwing entry point (torch turns the C++ exception into
    # a Python RuntimeError); ctypes cannot catch one, so the requests below
    # that must fail go through its NULL-returning twin (TorchView).
    eq(side.allocator.alloc_fn, symbol_address(lib, "dtralloc_malloc_or_throw"), "the malloc torch got")
    eq(side.allocator.free_fn, symbol_address(lib, "dtralloc_free"), "the free torch got")
    abi = TorchView()
    side.lazy_init()  # torch's first CUDA use calls the init hook
    check(torch.cuda.is_initialized(), "CUDA initialized")
    p = side.malloc(60 * MiB)
    check(p is not None, "malloc through the function torch was given")
    _expect_oom(abi, 8 * MiB)  # the conf given to install() is in force
    side.set_memory_fraction(0.03125, 0)  # 32 MiB of the fake's 1 GiB
    eq(stats()["budget_bytes"], 32 * MiB, "budget via the installed fraction hook")
    side.record_stream(p, OTHER_STREAM)
    side.raw_delete(p)
    eq(block_state(p), "active_pending_free", "a block recorded on another stream waits for it")
    fake.complete_events()
    eq(side.base_allocation(0x10), (0x10, 0), "installed base_alloc hook")
    q = side.malloc(1000)
    eq(side.base_allocation(q), (segment_of(q)["address"], SMALL_SEGMENT), "base_alloc of a block")
    side.raw_delete(q)
    check(side.hook("set_reset_fn") is not None, "reset hook")
    side.empty_cache()
    eq(fake.live_allocations(), 0, "empty_cache through the installed reset hook")
    eq(fake.live_events(), 0, "events after empty_cache")
    eq(stats()["reserved_bytes.all.current"], 0, "reserved after empty_cache")
    expect_error(lambda: dtralloc.install("budget:32M"), dtralloc.torch_hooks.InstallError, "already installed")


def scenario_torch_memory_functions():
    """After install(), torch's own memory functions (torch/cuda/memory.py,
    torch/accelerator/memory.py, unchanged) answer with dtralloc's figures,
    keyed as torch keys them, and only while dtralloc is torch's allocator."""
    from _torch_standin import TorchCudaSide

    fake = FakeCudaRuntime()
    fake.set_device_count(2)
    torch, standin = cuda_torch()
    standin.state.device_count = 2
    dtralloc.install("")
    side = TorchCudaSide(standin)
    side.lazy_init()
    big = side.malloc(3 * MiB)
    small = side.malloc(1000)
    ours = dtralloc.memory_stats(0)
    for device in (None, 0, "cuda", "cuda:0", torch.device("cuda", 0)):
        eq(torch.cuda.memory_allocated(device), ours["allocated_bytes.all.current"], f"memory_allocated({device!r})")
    eq(torch.cuda.memory_allocated(), 3 * MiB + 1024, "memory_allocated")
    eq(torch.cuda.max_memory_allocated(), ours["allocated_bytes.all.peak"], "max_memory_allocated")
    eq(torch.cuda.memory_reserved(), ours["reserved_bytes.all.current"], "memory_reserved")
    eq(torch.cuda.max_memory_reserved(), ours["reserved_bytes.all.peak"], "max_memory_reserved")
    eq(dict(torch.cuda.memory_stats()), dict(ours), "torch.cuda.memory_stats() keys and values")
    eq(torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"], 3 * MiB + 1024, "nested")
    summary = torch.cuda.memory_summary()  # torch's own table, from dtralloc's stats
    check("PyTorch CUDA memory summary, device ID 0" in summary, summary)
    check("Allocated memory" in summary and "GPU reserved memory" in summary, summary)
    if hasattr(torch.accelerator, "memory_allocated"):  # torch 2.9+
        eq(torch.accelerator.memory_allocated(0), ours["allocated_bytes.all.current"], "torch.accelerator")
        eq(torch.accelerator.max_memory_reserved(), ours["reserved_bytes.all.peak"], "torch.accelerator peak")

    side.raw_delete(big)
    eq(torch.cuda.max_memory_allocated(), 3 * MiB + 1024, "the peak outlives the free")
    torch.cuda.reset_peak_memory_stats()
    eq(torch.cuda.max_memory_allocated(), 1024, "peak after reset_peak_memory_stats")
    eq(dtralloc.memory_stats(0)["allocated_bytes.all.peak"], 1024, "dtralloc's own peak was reset")
    torch.cuda.reset_accumulated_memory_stats(0)
    eq(torch.cuda.memory_stats()["allocation.all.allocated"], 0, "after reset_accumulated_memory_stats")
    if hasattr(torch.accelerator, "reset_peak_memory_stats"):  # torch 2.9+
        torch.accelerator.reset_peak_memory_stats(0)

    eq(torch.cuda.memory_snapshot(), dtralloc.snapshot()["segments"], "memory_snapshot")
    snap = torch.cuda.memory._snapshot()
    eq(snap["segments"], dtralloc.snapshot()["segments"], "torch.cuda.memory._snapshot segments")
    check("device_traces" in snap, "device_traces")
    eq(torch._C._cuda_memorySnapshot((7, 0))["segments"], [], "a private pool: dtralloc has none")

    # A device dtralloc never allocated on: zeros, and no allocator (nor
    # context) made for the question.
    eq(torch.cuda.memory_allocated(1), 0, "memory_allocated(1)")
    eq(torch.cuda.memory_stats(1)["num_device_alloc"], 0, "memory_stats(1)")
    check(_core.existing_global_pool(1) is None, "no allocator was created on device 1")
    check(not fake.has_context(1), "no context on device 1")

    # Not dtralloc's turn: torch's own binding answers (here, another pluggable
    # allocator's 'does not yet support').
    other = torch._C._cuda_customAllocator(1, 2)
    mine, standin.state.current = standin.state.current, other
    expect_error(torch.cuda.memory_allocated, RuntimeError, "does not yet support getDeviceStats")
    standin.state.current = mine
    eq(torch.cuda.memory_allocated(), 1024, "dtralloc's again")
    side.raw_delete(small)
    side.empty_cache()
    eq(fake.live_allocations(), 0, "everything given back")


def scenario_install_after_dtralloc_use():
    """The allocator already exists (memory_stats created it): install() must
    keep its configuration or say why it cannot, as an InstallError."""
    FakeCudaRuntime()
    torch, standin = cuda_torch()
    eq(stats()["budget_bytes"], GiB, "budget before install")
    expect_error(lambda: dtralloc.install("budget:64M"), dtralloc.torch_hooks.InstallError,
                 "already runs with DTRALLOC_CONF=''", "call dtralloc.install() before them")
    check(not dtralloc.installed() and standin.state.current is None, "torch untouched after the refusal")
    dtralloc.install("")  # the configuration in force: fine
    check(dtralloc.installed() and standin.state.current is not None, "installed with the conf in force")


def scenario_live_sessions_end_in_any_order():
    """dtr() sessions on the CUDA pool (dtralloc/dtr/session.py makes them
    this way) end in any order: a training loop's `with dtralloc.dtr(...) as s:`
    drops the previous step's session only after the next one has started.
    The pool's budget is the newest live session's that sets one, the pool's
    own once none is left, and ended sessions leave nothing behind. The
    pool's auto settings resolve for the newest session's policy under that
    budget (max_split_size shows it: 32 MiB under dtralloc's placement,
    none under the pool's own configuration here, which names no policy)."""
    import torch
    from dtralloc.dtr.runner import helpers

    FakeCudaRuntime()
    own = stats()["budget_bytes"]
    eq(stats()["max_split_size"], -1, "the pool's own max_split_size (budget:512M, no policy)")

    # A CUDA build of torch without a GPU (torch 2.11+cu130 on a CPU machine)
    # has _cuda_getCurrentRawStream, and calling it fails ("driver version is
    # insufficient"): the sessions here time no ops on torch's streams.
    on_cuda = helpers("cuda:0")
    if not torch.cuda.is_available():
        on_cuda["current_stream"] = None

    def started(budget, policy="dtralloc"):
        s = _core.LiveSession(True, 0, budget, _core.config_text(), policy, False, False, on_cuda)
        s.start()
        return s

    s = None
    for step in range(1000):  # the loop's order: start the next, then drop the previous
        budget = (64 + step % 3) * MiB
        previous = s
        s = started(budget)
        del previous
        if step % 100 == 0:
            gc.collect()
        eq(stats()["budget_bytes"], budget, f"budget at step {step}")
        eq(_core.live_sessions_on_device(0), 1, f"live sessions at step {step}")
        eq(stats()["max_split_size"], 32 * MiB, f"dtralloc placement at step {step}")
    del s
    eq(stats()["budget_bytes"], own, "the pool's own budget after the loop")
    eq(stats()["max_split_size"], -1, "the pool's own placement after the loop")
    eq(_core.live_sessions_on_device(0), 0, "no live session after the loop")

    # Older sessions still alive (a backward after the block needs them).
    a = started(64 * MiB)
    b = started(0)  # sets no budget: a's stays
    eq(stats()["budget_bytes"], 64 * MiB, "a session without a budget keeps the older one's")
    c = started(32 * MiB)
    eq(stats()["budget_bytes"], 32 * MiB, "the newest budget")
    d = started(0, "dtr")
    eq((stats()["budget_bytes"], stats()["max_split_size"]), (32 * MiB, -1),
       "the newest session's policy (dtr places as torch) under the newest budget")
    del d
    eq(stats()["max_split_size"], 32 * MiB, "c's placement again")
    del a
    eq(stats()["budget_bytes"], 32 * MiB, "an older session ending leaves the newest budget")
    del c
    eq(stats()["budget_bytes"], own, "the last session with a budget ended: the pool's own")
    eq(_core.live_sessions_on_device(0), 1, "b is live")
    b.stop()
    eq(_core.live_sessions_on_device(0), 0, "b stopped")
    eq(stats()["max_split_size"], -1, "the pool's own placement once none is live")
    del b

    # torch.cuda.set_per_process_memory_fraction caps whichever budget is in
    # force, set before a session or during it, and outlives the session.
    abi = TorchView()
    abi.set_memory_fraction(48 / 1024, 0)  # 48 MiB of the fake's 1 GiB
    e = started(0)
    eq(stats()["budget_bytes"], 48 * MiB, "a session without a budget keeps the cap")
    f = started(64 * MiB)
    eq(stats()["budget_bytes"], 48 * MiB, "a session's budget above the cap is capped")
    abi.set_memory_fraction(1.0, 0)
    eq(stats()["budget_bytes"], 64 * MiB, "the session's budget once the cap is lifted")
    abi.set_memory_fraction(32 / 1024, 0)
    eq(stats()["budget_bytes"], 32 * MiB, "a cap set during the session")
    del e, f
    eq(stats()["budget_bytes"], 32 * MiB, "the cap outlives the sessions")
    abi.set_memory_fraction(1.0, 0)
    eq(stats()["budget_bytes"], own, "the pool's own budget")


if __name__ == "__main__":
    sys.exit(_scenario_main.run(globals(), sys.argv))
