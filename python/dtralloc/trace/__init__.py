"""Record a training step's memory traffic at the storage level; save, load.

``trace = dtralloc.trace.record(step_fn)`` runs ``step_fn()`` once under a
TorchDispatchMode and returns a :class:`Trace` (see :mod:`.model` for what it
holds); ``trace.save(path)`` / ``load(path)`` write and read the file format
documented in ``docs/trace-format.md``; :func:`import_torch_snapshot` turns a
torch memory snapshot into an allocation-only trace.

The rooms: ``records`` (Storage, Op), ``model`` (Trace: queries, validation),
``fileformat`` (the document), ``recorder`` (recording; the only one that
imports torch), ``torch_snapshot``.
"""
from __future__ import annotations

from .fileformat import FORMAT_NAME, FORMAT_VERSION
from .model import Trace, load
from .records import Op, Storage
from .torch_snapshot import import_torch_snapshot

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "Op", "Storage", "Trace", "import_torch_snapshot", "load", "record"]


def __getattr__(name: str):
    # `record` needs torch; importing it on first use keeps `import dtralloc`
    # and trace loading torch-free (PEP 562 module __getattr__).
    if name == "record":
        from .recorder import record

        globals()["record"] = record
        return record
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
