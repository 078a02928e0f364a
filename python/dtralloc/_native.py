"""Locating and loading the native parts: _core, libdtralloc.so, and the CUDA
runtime the process-wide allocators use."""
from __future__ import annotations

import os
import sys

from . import _core

OutOfMemoryError = _core.OutOfMemoryError
InvalidPointerError = _core.InvalidPointerError
ConfigError = _core.ConfigError

_HERE = os.path.dirname(os.path.abspath(_core.__file__))


def library_path() -> str:
    """Path of libdtralloc.so, the file torch's CUDAPluggableAllocator loads."""
    return _native_file("libdtralloc.so")


def fake_cudart_path() -> str:
    """Path of the fake CUDA runtime built for tests (host memory, no GPU)."""
    return _native_file("libdtralloc_fakecudart.so")


def _native_file(name: str) -> str:
    path = os.path.join(_HERE, name)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"dtralloc: {name} is missing next to {_core.__file__}; the install is "
            "incomplete. Reinstall with `pip install .` from the source tree."
        )
    return path


def global_pool(device: int):
    """The process-wide allocator of ``device`` (created on first use), the
    one torch and CuPy allocate from. Before dtralloc loads a CUDA runtime it
    prefers the major version of the torch in the process: with no runtime
    loaded yet, libcudart.so.13 could otherwise win over the .12 a CUDA 12
    torch needs."""
    if not _core.cuda_runtime_path():
        prefer_torch_cuda_runtime()
    return _core.global_pool(device)


def prefer_torch_cuda_runtime() -> None:
    """Tell the runtime search which CUDA major version the imported torch was
    built against (torch.version.cuda, e.g. '12.8'); nothing without one."""
    version = getattr(getattr(sys.modules.get("torch"), "version", None), "cuda", None)
    if isinstance(version, str) and version.split(".")[0].isdigit():
        _core.prefer_cuda_runtime_major(int(version.split(".")[0]))
