"""Route CuPy allocations into the same pool torch uses."""
from __future__ import annotations

from ._native import global_pool


class _Allocation:
    """Owner object of one pool block: frees it when CuPy lets go."""

    __slots__ = ("pool", "address")

    def __init__(self, pool, address: int):
        self.pool = pool
        self.address = address

    def __del__(self):
        if self.address:
            self.pool.free(self.address)
            self.address = 0


def cupy_allocator(size: int):
    """A ``cupy.cuda.set_allocator`` function backed by dtralloc's pool.

    Memory comes from the process-wide allocator of CuPy's current device, on
    CuPy's current stream, so CuPy and torch share one cache and one budget.
    """
    import cupy

    device = cupy.cuda.Device().id
    if size == 0:
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
    stream = cupy.cuda.get_current_stream().ptr
    pool = global_pool(device)
    address = pool.malloc(size, stream)
    owner = _Allocation(pool, address)
    memory = cupy.cuda.UnownedMemory(address, size, owner, device)
    return cupy.cuda.MemoryPointer(memory, 0)


def install_cupy() -> None:
    """Make CuPy allocate device memory through dtralloc."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("dtralloc.install_cupy() needs CuPy (pip install cupy-cuda12x)") from e
    cupy.cuda.set_allocator(cupy_allocator)
