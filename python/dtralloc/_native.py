"""Locating and loading the native parts: _core and libdtralloc.so."""
from __future__ import annotations

import os

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
