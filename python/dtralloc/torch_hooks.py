"""dtralloc.install(): make torch allocate CUDA memory through dtralloc."""
from __future__ import annotations

import ctypes
from typing import Optional

from . import _core
from ._native import library_path
from .config import ConfLike, conf_text

_installed_conf: Optional[str] = None

# torch's optional hooks and the C functions that serve them.
_HOOKS = (
    ("_set_init_fn", "dtralloc_init"),
    ("_set_reset_fn", "dtralloc_empty_cache"),
    ("_set_memory_fraction_fn", "dtralloc_set_memory_fraction"),
    ("_set_base_alloc_fn", "dtralloc_base_alloc"),
    ("_set_record_stream_fn", "dtralloc_record_stream"),
)


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
    lib = ctypes.CDLL(library_path())
    for setter, symbol in _HOOKS:
        set_fn = getattr(allocator._allocator, setter, None)
        if set_fn is not None:  # older torch versions lack some hooks
            set_fn(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise InstallError(
            "torch refused to swap its allocator (it was already initialized). Call "
            f"dtralloc.install() before the first CUDA allocation. torch said: {e}"
        ) from e
    _installed_conf = text
