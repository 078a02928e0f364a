"""A CUDA build of torch, as far as dtralloc reaches into it, on top of the
real CPU-only torch installed here.

Only the C bindings (``torch._C.*``) that a CPU build lacks, or answers for
the CPU, are stood in for. Each carries exactly the name and arguments of the
real binding and the behaviour torch's C++ has under a CUDAPluggableAllocator;
the file and function it mirrors is named at each one. torch's own Python
layer runs unchanged on top: ``torch.cuda.memory.CUDAPluggableAllocator``,
``change_current_allocator``, ``memory_stats``, ``memory_allocated``,
``memory_summary``, ``memory_snapshot``, ``torch.cuda.memory._snapshot``,
``torch.accelerator.memory_stats`` ... So a test that passes here passes
against torch's real Python code, and against its C++ as far as this file
restates it.

``TorchCudaSide`` is not a stand-in for anything Python can see: it does what
torch's C++ ``CUDAPluggableAllocator`` (torch/csrc/cuda/CUDAPluggableAllocator.cpp)
does with the function addresses it was given, so a test can make "torch"
allocate, free, empty its cache or record a stream through them.

Versions: read against torch 2.13's sources (the torch here) and checked for
torch 2.11 (the GPU machine's): the setter names, their prototypes and the
createCustomAllocator / changeCurrentAllocator behaviour are the same in both.
"""
from __future__ import annotations

import ctypes
import weakref

# torch/csrc/cuda/Module.cpp, registerCudaPluggableAllocator: the methods of
# torch._C._CUDAPluggableAllocator, in the order torch defines them, each
# taking a function's address (uint64_t) and the prototype torch casts it to.
SETTERS = (
    "set_init_fn",  # void(int)
    "set_reset_fn",  # void()
    "set_memory_fraction_fn",  # void(double, int)
    "set_base_alloc_fn",  # void*(void*, size_t*)
    "set_record_stream_fn",  # void(void*, cudaStream_t)
    "set_begin_allocate_to_pool",  # void(int, MempoolId_t, std::function<bool(cudaStream_t)>)
    "set_end_allocate_to_pool_fn",  # void(int, MempoolId_t)
    "set_release_pool",  # void(int, MempoolId_t)
)

# The prototypes torch calls through (CUDAPluggableAllocator.h), as ctypes
# types; the begin-allocate-to-pool hook takes a std::function by value and
# cannot be called from ctypes.
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
PROTOTYPES = {
    "set_init_fn": ctypes.CFUNCTYPE(None, ctypes.c_int),
    "set_reset_fn": ctypes.CFUNCTYPE(None),
    "set_memory_fraction_fn": ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int),
    "set_base_alloc_fn": ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)),
    "set_record_stream_fn": ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p),
}


def _pluggable_unsupported(what: str) -> RuntimeError:
    """TORCH_CHECK(false, ...) of CUDAPluggableAllocator::<what>, which torch's
    exception translation raises as RuntimeError with this text."""
    return RuntimeError(
        f"CUDAPluggableAllocator does not yet support {what}. "
        "If you need it, please file an issue describing your use case."
    )


class _State:
    """Process state of torch's C++ side that the bindings share."""

    def __init__(self, device_count: int):
        self.device_count = device_count
        self.current_device = 0
        self.cuda_initialized = False
        # c10::cuda::CUDACachingAllocator::allocator: None while torch's own
        # (native) allocator is current; else the pluggable one swapped in.
        self.current = None
        self.allocators: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Allocator:
    """One C++ CUDAPluggableAllocator: the addresses it holds and its state."""

    def __init__(self, alloc_fn: int, free_fn: int):
        self.alloc_fn = alloc_fn
        self.free_fn = free_fn
        self.hooks: dict[str, int] = {}
        self.initialized = False
        self.metadata: dict[int, tuple[int, int, int]] = {}  # ptr -> (size, device, stream)


class StandIn:
    """The stood-in bindings, and where they were put into torch.

    ``apply(set_attr)`` puts every binding into ``torch._C`` (and the CUDA
    init flag into ``torch.cuda``) through ``set_attr``: a monkeypatch that
    undoes it after a test, or the builtin setattr in a worker process.
    ``setters`` models a torch whose binding lacks some of them.
    """

    def __init__(self, torch, device_count: int = 1, setters=SETTERS):
        self.torch = torch
        self.state = _State(device_count)
        self.setters = tuple(setters)
        state = self.state

        # torch._C._cuda_CUDAAllocator: the base class, no methods of its own.
        base = type("_cuda_CUDAAllocator", (), {"__slots__": ("__weakref__",)})

        def make_setter(name):
            def setter(self, func_ptr):
                # pybind11 converts the argument to uint64_t.
                if isinstance(func_ptr, bool) or not isinstance(func_ptr, int) or not 0 <= func_ptr < 1 << 64:
                    raise TypeError(f"{name}(): incompatible function arguments: {func_ptr!r}")
                state.allocators[self].hooks[name] = func_ptr

            setter.__name__ = name
            return setter

        # torch._C._CUDAPluggableAllocator with exactly torch's setters.
        self.binding_class = type(
            "_CUDAPluggableAllocator", (base,), {"__slots__": (), **{n: make_setter(n) for n in self.setters}}
        )

    # ---- torch/csrc/cuda/Module.cpp, registerCudaPluggableAllocator --------

    def _cuda_customAllocator(self, malloc_ptr: int, free_ptr: int):
        """createCustomAllocator (CUDAPluggableAllocator.cpp): a new allocator,
        init(device_count) at once; that file's device_count is 0 and no init
        hook is set yet, so nothing is called, but the allocator is now
        initialized, and can never replace another one after a swap."""
        obj = self.binding_class()
        allocator = _Allocator(malloc_ptr, free_ptr)
        allocator.initialized = True
        self.state.allocators[obj] = allocator
        return obj

    def _cuda_changeCurrentAllocator(self, allocator):
        """changeCurrentAllocator: TORCH_CHECK that the current allocator is
        not initialized, then swap."""
        state = self.state
        current_initialized = (
            state.cuda_initialized if state.current is None else state.allocators[state.current].initialized
        )
        if current_initialized:
            raise RuntimeError("Can't swap an already initialized allocator")
        state.current = allocator

    def _cuda_getAllocator(self):
        """getCurrentAllocator: the pluggable allocator swapped in (pybind11
        returns the Python object that already wraps it), None before."""
        return self.state.current

    def _require_pluggable(self, what: str):
        if self.state.current is None:
            raise AssertionError("stand-in: torch's native CUDA allocator is not modelled")
        raise _pluggable_unsupported(what)

    def _unsupported(what: str):  # noqa: N805 - a factory used in the class body
        """A binding that reaches a CUDAPluggableAllocator method torch leaves
        unsupported (TORCH_CHECK(false, ...))."""
        return lambda self, *args: self._require_pluggable(what)

    # torch/csrc/cuda/Module.cpp and memory_snapshot.cpp, each reaching the
    # CUDAPluggableAllocator method named.
    _cuda_memoryStats = _unsupported("getDeviceStats")  # (device: int)
    _cuda_resetAccumulatedMemoryStats = _unsupported("resetAccumulatedStats")  # (device: int)
    _cuda_resetPeakMemoryStats = _unsupported("resetPeakStats")  # (device: int)
    _cuda_memorySnapshot = _unsupported("snapshot")  # (mempool_id)

    def _cuda_getDevice(self) -> int:
        return self.state.current_device

    def _cuda_getDeviceCount(self) -> int:
        return self.state.device_count

    # ---- torch/csrc/DeviceAccelerator.cpp (the accelerator is CUDA) --------

    def _accelerator_isAllocatorInitialized(self) -> bool:
        return self.state.cuda_initialized

    def _accelerator_getDeviceIndex(self) -> int:
        return self.state.current_device

    _accelerator_getDeviceStats = _unsupported("getDeviceStats")  # (device_index: int)
    _accelerator_resetAccumulatedStats = _unsupported("resetAccumulatedStats")  # (device_index: int)
    _accelerator_resetPeakStats = _unsupported("resetPeakStats")  # (device_index: int)
    del _unsupported

    BINDINGS = (
        "_cuda_customAllocator",
        "_cuda_changeCurrentAllocator",
        "_cuda_getAllocator",
        "_cuda_memoryStats",
        "_cuda_resetAccumulatedMemoryStats",
        "_cuda_resetPeakMemoryStats",
        "_cuda_memorySnapshot",
        "_cuda_getDevice",
        "_cuda_getDeviceCount",
        "_accelerator_isAllocatorInitialized",
        "_accelerator_getDeviceIndex",
        "_accelerator_getDeviceStats",
        "_accelerator_resetAccumulatedStats",
        "_accelerator_resetPeakStats",
    )

    def apply(self, set_attr) -> "StandIn":
        for name in self.BINDINGS:
            set_attr(self.torch._C, name, getattr(self, name))
        set_attr(self.torch._C, "_CUDAPluggableAllocator", self.binding_class)
        set_attr(self.torch.cuda, "_initialized", False)
        return self

    def allocator_of(self, binding) -> _Allocator:
        return self.state.allocators[binding]


class TorchCudaSide:
    """What torch's C++ does with the addresses install() handed it.

    Mirrors CUDAPluggableAllocator.cpp (malloc, raw_delete, init, emptyCache,
    setMemoryFraction, getBaseAllocation, recordStream) and torch's lazy CUDA
    init (torch.cuda._lazy_init -> CUDACachingAllocator::init(device_count)).
    ctypes cannot catch a C++ exception: call ``malloc`` only for requests
    that succeed (dtralloc_malloc_or_throw throws on the others).
    """

    def __init__(self, standin: StandIn):
        self.standin = standin
        binding = standin.state.current
        assert binding is not None, "install() did not swap the allocator"
        self.allocator = standin.allocator_of(binding)
        self._alloc = ALLOC_FN(self.allocator.alloc_fn)
        self._free = FREE_FN(self.allocator.free_fn)

    def hook(self, setter: str):
        address = self.allocator.hooks.get(setter)
        return PROTOTYPES[setter](address) if address else None

    def lazy_init(self) -> None:
        """torch's first CUDA use: the allocator's init(device_count), then
        CUDA counts as initialized (torch.cuda.is_initialized())."""
        state = self.standin.state
        if (init := self.hook("set_init_fn")) is not None:
            init(state.device_count)
        state.cuda_initialized = True
        self.standin.torch.cuda._initialized = True

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int | None:
        """CUDAPluggableAllocator::malloc: no check for NULL (torch's own)."""
        ptr = self._alloc(size, device, stream or None)
        self.allocator.metadata[ptr] = (size, device, stream)
        return ptr

    def raw_delete(self, ptr: int) -> None:
        if ptr not in self.allocator.metadata:
            raise RuntimeError("Trying to free a pointer not allocated here")
        size, device, stream = self.allocator.metadata.pop(ptr)
        self._free(ptr, size, device, stream or None)

    def empty_cache(self) -> None:
        if (reset := self.hook("set_reset_fn")) is not None:
            reset()

    def set_memory_fraction(self, fraction: float, device: int) -> None:
        if (fn := self.hook("set_memory_fraction_fn")) is not None:
            fn(fraction, device)

    def base_allocation(self, ptr: int) -> tuple[int, int]:
        fn = self.hook("set_base_alloc_fn")
        if fn is None:
            return ptr, 0
        size = ctypes.c_size_t(0)
        return fn(ptr, ctypes.byref(size)), size.value

    def record_stream(self, ptr: int, stream: int) -> None:
        if (fn := self.hook("set_record_stream_fn")) is not None:
            fn(ptr, stream or None)

