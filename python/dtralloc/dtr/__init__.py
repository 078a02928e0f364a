"""Live DTR on eager PyTorch: ``dtralloc.dtr()``.

    import dtralloc
    with dtralloc.dtr(budget="512M", device="cpu") as s:
        loss = model(x); loss.backward()
    s.stats()

The rooms: ``session`` (Session: the context manager), ``verify`` (Session.verify:
a step in the session against the same step plainly, bit for bit), ``mode`` (the dispatch
mode and the saved-tensor hooks), ``ops`` (what each ATen op writes, draws,
pins), ``runner`` (what the C++ half asks Python to do: rerun an op, rebuild a
view). This module imports no torch until dtr() is called, so ``import
dtralloc`` stays light. The design is docs/live.md.
"""
from __future__ import annotations

from typing import Optional, Union

from .recording import HISTORY_EVENTS, PHASES, SERIES_OPS


def dtr(budget: Union[None, int, str] = None, policy: Optional[str] = None, device=None, chaos: bool = False,
        check_invariants: bool = False, series: int = SERIES_OPS, history: Union[bool, int] = False):
    """Live DTR: what is made inside the block may be evicted and recomputed.

    Args:
        budget: bytes or a size such as "512M" / "20G". On CUDA it caps the
            installed pool's reserved bytes for the session (default: the
            pool's own budget). With device="cpu" it caps the bytes of every
            storage the session allocates, placed in a virtual pool with the
            pool's settings (None: no cap).
        policy: eviction policy (default: DTRALLOC_CONF's, else "dtralloc").
        device: "cpu" for the CPU mirror, "cuda" / "cuda:N" for the installed
            pool; None: CUDA when dtralloc.install() ran, else CPU.
        chaos: evict every evictable value at every op: run it once to check
            that a model is safe to rematerialize (slow).
        check_invariants: check the engine, pool and registry after every op.
        series: how many ops the per-op series and the event log keep
            (``Session.series()`` / ``events()``; the first ones); 0: none.
        history: device="cpu": keep the mirror pool's alloc/free history
            (True: HISTORY_EVENTS events, or a number), each event stamped
            with its op, for the address views of ``dtralloc.dashboard(s)``.
            On CUDA the installed pool's own history is used
            (``dtralloc.record_memory_history()`` / DTRALLOC_CONF).

    Returns a :class:`~dtralloc.dtr.session.Session`, a context manager whose
    ``stats()`` report evictions, remats, rng_replays, peak_bytes,
    budget_bytes, recompute_seconds, ... It also decorates a function
    (``@dtralloc.dtr(budget="16G")``): each call then runs in a session of
    its own, made with these arguments, the latest being the wrapper's
    ``last_session``.
    """
    from .session import Session

    return Session(budget, policy, device, chaos, check_invariants, series, history)


def __getattr__(name):
    if name == "Session":
        from .session import Session

        return Session
    if name == "VerifyResult":
        from .verify import VerifyResult

        return VerifyResult
    raise AttributeError(f"module 'dtralloc.dtr' has no attribute {name!r}")


__all__ = ["HISTORY_EVENTS", "PHASES", "SERIES_OPS", "Session", "VerifyResult", "dtr"]
