"""Test helpers: the fake CUDA runtime the project builds (no GPU needed).

The fake implements exactly the CUDA runtime functions dtralloc resolves (and
the driver's cuDevicePrimaryCtxGetState), on host memory, plus controls:
capacity, injected cudaMalloc failures, call counters, deferred events, stream
capture, which devices have a primary context, the driver's VMM calls and
the stream-ordered allocator's memory pools. Point dtralloc at it with
``DTRALLOC_CUDART=dtralloc.testing.fake_cudart_path()`` before the first use
of the cuda backend in the process.
"""
from __future__ import annotations

import ctypes

from ._native import fake_cudart_path

__all__ = ["FakeCudaRuntime", "fake_cudart_path"]


class FakeCudaRuntime:
    """ctypes handle on the fake runtime's control functions.

    The object is the very library dtralloc loads (same path, same dlopen
    handle), so what tests set here is what the allocator sees.
    """

    def __init__(self, path: str | None = None):
        self.path = path or fake_cudart_path()
        self.lib = ctypes.CDLL(self.path)
        lib = self.lib
        lib.fakecuda_set_capacity.argtypes = [ctypes.c_size_t]
        lib.fakecuda_set_device_count.argtypes = [ctypes.c_int]
        lib.fakecuda_fail_next_mallocs.argtypes = [ctypes.c_int]
        lib.fakecuda_call_count.argtypes = [ctypes.c_char_p]
        lib.fakecuda_call_count.restype = ctypes.c_long
        lib.fakecuda_used_bytes.argtypes = [ctypes.c_int]
        lib.fakecuda_used_bytes.restype = ctypes.c_size_t
        lib.fakecuda_live_allocations.restype = ctypes.c_int
        lib.fakecuda_live_events.restype = ctypes.c_int
        lib.fakecuda_set_stream_capture.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.fakecuda_set_stream_capture.restype = ctypes.c_int
        lib.cuDevicePrimaryCtxGetState.argtypes = [
            ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_int)]
        lib.cuDevicePrimaryCtxGetState.restype = ctypes.c_int
        lib.fakecuda_set_vmm.argtypes = [ctypes.c_int, ctypes.c_size_t]
        lib.fakecuda_fail_next_mem_creates.argtypes = [ctypes.c_int]
        lib.fakecuda_vmm_live.argtypes = [ctypes.c_char_p]
        lib.fakecuda_vmm_live.restype = ctypes.c_int
        lib.fakecuda_vmm_accessible.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        lib.fakecuda_vmm_accessible.restype = ctypes.c_int
        lib.fakecuda_set_free_wait_ns.argtypes = [ctypes.c_longlong]
        lib.fakecuda_set_memory_pools.argtypes = [ctypes.c_int]
        lib.fakecuda_pool_live.argtypes = [ctypes.c_char_p]
        lib.fakecuda_pool_live.restype = ctypes.c_int

    def reset(self) -> None:
        self.lib.fakecuda_reset()

    def set_capacity(self, nbytes: int) -> None:
        self.lib.fakecuda_set_capacity(nbytes)

    def set_device_count(self, n: int) -> None:
        self.lib.fakecuda_set_device_count(n)

    def fail_next_mallocs(self, n: int) -> None:
        self.lib.fakecuda_fail_next_mallocs(n)

    def calls(self, function: str) -> int:
        return self.lib.fakecuda_call_count(function.encode())

    def used_bytes(self, device: int = 0) -> int:
        return self.lib.fakecuda_used_bytes(device)

    def live_allocations(self) -> int:
        return self.lib.fakecuda_live_allocations()

    def live_events(self) -> int:
        """Events created and not yet destroyed (a leak check for record_stream)."""
        return self.lib.fakecuda_live_events()

    def complete_events(self) -> None:
        self.lib.fakecuda_complete_events()

    def set_free_wait_ns(self, ns: int) -> None:
        """cudaFree waits this long first, as the real one waits for the work
        launched before it (0: not at all, the default again after reset())."""
        self.lib.fakecuda_set_free_wait_ns(ns)

    def set_stream_capture(self, stream: int, status: int) -> None:
        """Mark `stream` (not 0) of the current device as capturing a CUDA
        graph (1), invalidated (2) or not capturing (0)."""
        if self.lib.fakecuda_set_stream_capture(stream, status) != 0:
            raise ValueError(f"fake runtime: cannot set the capture status of stream {stream:#x}")

    def has_context(self, device: int) -> bool:
        """Whether `device` has a primary context (cuDevicePrimaryCtxGetState)."""
        flags, active = ctypes.c_uint(), ctypes.c_int()
        if self.lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) != 0:
            raise ValueError(f"fake runtime: no device {device}")
        return active.value == 1

    def set_vmm(self, supported: bool, granularity: int = 2 << 20) -> None:
        """Whether devices support CUDA's virtual memory API, and the
        allocation granularity they report."""
        self.lib.fakecuda_set_vmm(int(supported), granularity)

    def fail_next_mem_creates(self, n: int) -> None:
        """The next `n` cuMemCreate calls fail with CUDA_ERROR_OUT_OF_MEMORY."""
        self.lib.fakecuda_fail_next_mem_creates(n)

    def vmm_live(self) -> dict:
        """Live VMM objects: reservations, handles (physical pages not yet
        freed) and mappings."""
        return {k: self.lib.fakecuda_vmm_live(k.encode()) for k in ("reservations", "handles", "mappings")}

    def vmm_accessible(self, address: int, nbytes: int) -> bool:
        """Whether every byte of the range is mapped and readable/writable."""
        return self.lib.fakecuda_vmm_accessible(address, nbytes) == 1

    def set_memory_pools(self, supported: bool) -> None:
        """Whether devices support the stream-ordered allocator's memory pools
        (cudaDevAttrMemoryPoolsSupported; async_segments needs them)."""
        self.lib.fakecuda_set_memory_pools(int(supported))

    def pool_live(self) -> dict:
        """Memory pools not yet gone, and the freed allocations they still hold
        (given back to the device at a synchronize or a trim)."""
        return {k: self.lib.fakecuda_pool_live(k.encode()) for k in ("pools", "held")}
