"""dtralloc.Pool: a pool you drive directly (tests, replay, experiments)."""
from __future__ import annotations

from typing import Callable, Optional

from . import _core
from .config import ConfLike, conf_text

_DEFAULT_SIMULATED_CAPACITY = 1 << 40  # 1 TiB: "any capacity" for host/virtual


class Pool(_core.Pool):
    """A caching pool on one backend.

    Args:
        backend: ``"cuda"`` (device memory through the CUDA runtime),
            ``"host"`` (real host memory, for tests) or ``"virtual"``
            (addresses only, any capacity, for replay).
        capacity: simulated device size in bytes for ``host``/``virtual``
            (a size string such as ``"80G"`` works too); ignored for ``cuda``.
        conf: ``DTRALLOC_CONF`` text or a dict; ``None`` means no settings
            (the environment variable applies to the process-wide allocator,
            not to pools made here).
        device: CUDA device index for the ``cuda`` backend.

    ``malloc(size, stream=0) -> address``, ``free(address)``,
    ``record_stream(address, stream)``, ``stats()``, ``snapshot()``,
    ``empty_cache()``, ``check_invariants()``.
    """

    def __init__(self, backend: str = "host", capacity=None, conf: ConfLike = "", device: int = 0):
        if capacity is None:
            capacity = _DEFAULT_SIMULATED_CAPACITY if backend in ("host", "virtual") else 0
        if isinstance(capacity, str):
            capacity = _core.parse_size(capacity)
        super().__init__(backend, int(capacity), conf_text(conf if conf is not None else ""), device)

    def set_eviction_hook(self, hook: Optional[Callable[[int, int], bool]]) -> None:
        """Install `hook(bytes, stream) -> bool`, asked for room before an OOM.

        It runs without the pool lock held and frees through :meth:`free`;
        returning True makes the pool retry, False lets the OOM happen.
        """
        super().set_eviction_hook(hook)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"Pool(backend={self.backend!r}, budget={_core.format_bytes(self.budget_bytes)}, "
            f"reserved={_core.format_bytes(s['reserved_bytes.all.current'])}, "
            f"allocated={_core.format_bytes(s['allocated_bytes.all.current'])})"
        )
