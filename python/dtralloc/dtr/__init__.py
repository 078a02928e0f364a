"""Live DTR on eager PyTorch: ``dtralloc.dtr()``.

    import dtralloc
    with dtralloc.dtr(budget="512M", device="cpu") as s:
        loss = model(x); loss.backward()
    s.stats()

The rooms: ``session`` (dtr(), Session), ``mode`` (the dispatch mode and the
saved-tensor hooks), ``ops`` (what each ATen op writes, draws, pins),
``runner`` (what the C++ half asks Python to do: rerun an op, rebuild a view).
The design is docs/live.md.
"""
from __future__ import annotations

from .session import Session, dtr

__all__ = ["Session", "dtr"]
