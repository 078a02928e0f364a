"""dtralloc.install(): make torch allocate CUDA memory through dtralloc."""
from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Optional

from . import _core, torch_memory
from ._native import library_path, prefer_torch_cuda_runtime
from .config import ConfLike, conf_text

_installed_conf: Optional[str] = None

# The setters of torch._C._CUDAPluggableAllocator (torch/csrc/cuda/Module.cpp,
# registerCudaPluggableAllocator) and the C functions of include/dtralloc.h
# that serve them, each with the prototype torch casts the address to.
# Required: without any of these torch silently skips the call
# (tensor.record_stream() would do nothing and a block still used on a side
# stream be handed out again; torch.cuda.empty_cache() and
# set_per_process_memory_fraction() would do nothing).
_REQUIRED_HOOKS = (
    ("set_init_fn", "dtralloc_init"),
    ("set_reset_fn", "dtralloc_empty_cache"),
    ("set_memory_fraction_fn", "dtralloc_set_memory_fraction"),
    ("set_base_alloc_fn", "dtralloc_base_alloc"),
    ("set_record_stream_fn", "dtralloc_record_stream"),
)
# Refuses a CUDA graph capture (or torch.cuda.MemPool) at its start, before
# cudaStreamBeginCapture; torch 2.2 and later have it. set_end_allocate_to_pool_fn
# and set_release_pool are left unset: torch calls them only for a capture
# that began, and none does.
_CAPTURE_HOOK = ("set_begin_allocate_to_pool", "dtralloc_begin_allocate_to_pool")


class InstallError(RuntimeError):
    """dtralloc.install() could not swap torch's allocator."""


def installed() -> bool:
    """True once install() has swapped torch's allocator in this process."""
    return _installed_conf is not None


def install(conf: ConfLike = None) -> None:
    """Route every torch CUDA allocation through dtralloc.

    Call it first thing, before any CUDA tensor exists: torch cannot swap an
    allocator that has already served memory. ``conf`` is DTRALLOC_CONF text
    or a dict and defaults to the environment variable. A bad setting raises
    ConfigError naming the key. Calling it again with the same conf is a no-op.

    Afterwards torch's memory functions (torch.cuda.memory_allocated(),
    memory_stats(), memory_summary(), reset_peak_memory_stats(),
    memory_snapshot(), ...) answer with dtralloc's figures: see
    dtralloc.torch_memory for exactly what is replaced.
    """
    global _installed_conf
    text = conf_text(conf)
    _core.describe_config(text)  # validate before touching torch
    if _installed_conf is not None:
        if text == _installed_conf:
            return
        raise InstallError(
            f"dtralloc is already installed with DTRALLOC_CONF={_installed_conf!r}; "
            f"it cannot be reinstalled with {text!r} in the same process"
        )
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise InstallError("dtralloc.install() needs PyTorch: pip install torch") from e
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise InstallError(
            f"this torch ({torch.__version__}) is built without CUDA, so it has no CUDA "
            "allocator to replace; install a CUDA build of torch (dtralloc.Pool works without one)"
        )
    if torch.cuda.is_initialized():
        raise InstallError(
            "dtralloc.install() was called after CUDA was initialized, and torch cannot swap "
            "an allocator that already served memory. Call dtralloc.install() at the top of "
            "your program, before any tensor is created on or moved to the GPU."
        )
    prefer_torch_cuda_runtime()
    _core.check_cuda_config(text)  # loads the runtime torch was built against
    try:
        _core.configure(text)
    except RuntimeError as e:
        # dtralloc itself already serves memory under another configuration
        # (memory_stats(), cupy, or the C ABI created the allocator first).
        raise InstallError(
            f"{e}. dtralloc.memory_stats() and CuPy create the allocator too: "
            "call dtralloc.install() before them, or pass the configuration already in force"
        ) from e
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        library_path(), "dtralloc_malloc_or_throw", "dtralloc_free"
    )
    _wire_hooks(torch, allocator.allocator())
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise InstallError(
            "torch refused to swap its allocator (it was already initialized). Call "
            f"dtralloc.install() before the first CUDA allocation. torch said: {e}"
        ) from e
    torch_memory.patch(torch, allocator.allocator())
    refuse_captures(torch, allocator.allocator())
    _installed_conf = text


def _wire_hooks(torch, binding) -> None:
    """Hands torch's pluggable allocator every hook, by torch's setter names;
    raises InstallError, before anything is swapped, when a required one is
    missing from this torch."""
    missing = [setter for setter, _ in _REQUIRED_HOOKS if not callable(getattr(binding, setter, None))]
    if missing:
        raise InstallError(
            f"this torch ({torch.__version__}) has no {', '.join(missing)} on its pluggable "
            "allocator, so it would silently skip what dtralloc must do there (record_stream, "
            "empty_cache, memory fraction, base allocation, init). dtralloc needs torch 2.1 or "
            "newer; nothing was changed"
        )
    lib = ctypes.CDLL(library_path())
    for setter, symbol in _REQUIRED_HOOKS:
        getattr(binding, setter)(_address(lib, symbol))
    setter, symbol = _CAPTURE_HOOK
    if callable(getattr(binding, setter, None)):
        getattr(binding, setter)(_address(lib, symbol))
    else:
        warnings.warn(
            f"this torch ({torch.__version__}) has no {setter} on its pluggable allocator: "
            "dtralloc refuses torch.cuda.graph and CUDAGraph.capture_begin in Python, but a "
            "capture begun below them (torch._C._CUDAGraph) only at its first cache miss, so "
            "one served from the cache alone shares blocks with the rest of the program. Do "
            "not capture CUDA graphs under dtralloc, or use torch 2.2 or newer",
            RuntimeWarning,
            stacklevel=3,
        )


# Where torch begins a CUDA graph capture in Python, each refused there while
# dtralloc is torch's allocator (refuse_captures). torch.cuda.graph (which
# make_graphed_callables and torch.compile(mode="reduce-overhead") enter)
# makes its capture stream current and then calls CUDAGraph.capture_begin,
# whose C++ puts the CUDA generators into capture mode before it asks the
# allocator (the begin-allocate-to-pool hook): a refusal there leaves every
# later CUDA random op failing ("Offset increment outside graph capture")
# and the capture stream current. Refused here, nothing has changed yet.
_CAPTURE_ENTRIES = (
    ("graph", "__enter__", "torch.cuda.graph was about to begin a CUDA graph capture"),
    ("CUDAGraph", "capture_begin", "CUDAGraph.capture_begin was about to begin a CUDA graph capture"),
)


def refuse_captures(torch, swapped_in) -> list[str]:
    """Refuse torch's CUDA graph captures in Python, before torch changes any
    state, while ``swapped_in`` (the allocator install() gave torch) is
    torch's allocator. Returns the methods replaced ("graph.__enter__", ...).
    A capture begun below torch's Python (torch._C._CUDAGraph) is still
    refused by the allocator's hook, as before."""
    graphs = getattr(getattr(torch, "cuda", None), "graphs", None)
    replaced = []
    for owner_name, method, what in _CAPTURE_ENTRIES:
        owner = getattr(graphs, owner_name, None)
        original = getattr(owner, "__dict__", {}).get(method)
        if original is None:
            continue
        original = getattr(original, "_dtralloc_replaces", original)  # patched before
        setattr(owner, method, _refusing(torch, swapped_in, original, what))
        replaced.append(f"{owner_name}.{method}")
    return replaced


def _refusing(torch, swapped_in, original, what: str):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        current = getattr(torch._C, "_cuda_getAllocator", None)
        if current is not None and current() is swapped_in:
            raise RuntimeError(
                _core.graph_capture_refusal(what)
                + " Refused before the capture began: the current stream and the CUDA "
                "random generators are as they were."
            )
        return original(self, *args, **kwargs)

    method._dtralloc_replaces = original
    return method


def _address(lib: ctypes.CDLL, symbol: str) -> int:
    """The address of a C function, as torch's setters take it (uint64_t)."""
    return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
