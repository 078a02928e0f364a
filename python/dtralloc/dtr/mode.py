"""The dispatch mode and the saved-tensor hooks of a dtr() session.

Per op the mode runs the op, times it, and makes one call into C++
(LiveSession.record) that registers everything the op read, made and wrote.
Random ops first save their generator's state; ops that write first let the
session bring back and pin what reads an unrecomputable value about to be
overwritten. Everything else lives in C++ (allocator/bindings/live_session.h).
"""
from __future__ import annotations

import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _core
from . import ops

_ns = time.perf_counter_ns
_grad_enabled = torch.is_grad_enabled  # ops.GRAD_ENABLED == 1 << 3
_INFO: dict = {}


class Mode(TorchDispatchMode):
    def __init__(self, session, fast_dispatch):
        super().__init__()
        self._session = session
        self._record = session._record  # a plain CPython function bound to the session
        # The per-op path in C (allocator/bindings/live.cpp): torch looks
        # __torch_dispatch__ up on the instance, so this one takes precedence
        # over the class's below; it calls _slow for the ops it does not
        # run itself (rebinding ops, bitwise nondeterministic ones:
        # _classify_for_c; random ops on a device it finds no generator for).
        self.__dict__["__torch_dispatch__"] = types.MethodType(fast_dispatch, self)
        session._core.set_dispatch_helpers(_classify_for_c, self._slow, self._on_error,
                                           lambda t: ops.default_generator(t.device))

    def _slow(self, func, types, args, kwargs):
        return self._dispatch(func, _info(func), args, kwargs or {})

    # What a TorchDispatchMode must define; the instance's C entry point
    # above answers in its place, and this full path (which also serves the
    # fast ops correctly) is what is left without it.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._slow(func, types, args, kwargs)

    def _on_error(self, e):
        if isinstance(e, RuntimeError):
            self._oom(e)

    def _dispatch(self, func, info, args, kwargs):
        core = self._session._core
        flags, pin, rng = info.flags | (_grad_enabled() << 3), info.pin, None
        if info.dropout_pos is not None and not ops.argument(info.dropout_pos, "dropout_p", args, kwargs):
            flags &= ~ops.RANDOM  # fused attention carries the tag even with its dropout off
        if flags & ops.RANDOM:
            generator = ops.generator_for(func, info, args, kwargs)
            if generator is None:  # a device whose generator we cannot restore: never recompute
                flags &= ~ops.RANDOM
                pin = ops.PIN_NONDETERMINISTIC
            else:
                rng = (generator, generator.get_state())
        if info.bitwise_nondeterministic and _on_cuda(args) and not _deterministic():
            pin = ops.PIN_NONDETERMINISTIC
        writes = ops.written(func, info, args, kwargs)
        if writes:
            core.before_write(writes)
            if info.overwrites and all(ops.covers_storage(t) for t in writes):
                flags |= ops.OVERWRITES
        before = writes[0]._version if info.bumps_versions and writes else 0
        start = _ns()
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            self._oom(e)
            raise
        cost = _ns() - start
        if info.bumps_versions and ops.bump_versions(writes, before):
            flags |= ops.VERSIONS_BUMPED
        self._record(func, args, kwargs, out, writes, flags, pin, float(cost), rng)
        if info.rebinds:
            for t in writes:
                core.exported(t)  # its memory may have moved: never recompute it
        return out

    def _oom(self, e: RuntimeError) -> None:
        # On CUDA the pool's OOM comes through torch: say what the budget holds.
        if _core.OUT_OF_MEMORY_TEXT in str(e) and self._session.device != "cpu":
            raise _core.OutOfMemoryError(f"{e}\n{self._session._core.oom_report()}") from e


def _info(func) -> ops.OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = ops.classify(func)
    return info


def _classify_for_c(func):
    """(fast, flags, pin, call, view, writes, random, per_element) for the C path
    (LiveSession::dispatch). Ops that write or are random run in C as well,
    which does what _dispatch does for them: `writes` = (positions, names,
    legacy batch norm's undeclared running statistics, whether the writes
    overwrite when they cover their storage, whether the session bumps their
    version counters: OpInfo.bumps_versions) gathers what they write as
    ops.written does; `random` = (dropout_p's position, the generator's;
    -1 where none) finds the generator whose state is saved first, as
    ops.generator_for does. Both None: the plain fast path, or (not fast)
    this Python path: ops that rebind a tensor to other memory, and bitwise
    nondeterministic ones (pinned on CUDA per call). `per_element`:
    ops.PER_ELEMENT_*, how a foreach op's outputs read its lists."""
    info = _info(func)
    # OpOverload.__call__ only forwards to ._op: calling that saves a Python frame per op.
    call = func._op if type(func).__call__ is torch._ops.OpOverload.__call__ else func
    writes = random = None
    if not info.fast and not (info.bitwise_nondeterministic or info.rebinds):
        writes = (info.write_pos, info.write_kw, info.undeclared_stats, info.overwrites, info.bumps_versions)
        if info.flags & ops.RANDOM:
            random = (-1 if info.dropout_pos is None else info.dropout_pos,
                      -1 if info.generator_pos is None else info.generator_pos)
    return info.fast, info.flags, info.pin, call, info.view, writes, random, info.per_element


def _deterministic() -> bool:
    """Whether CUDA kernels are bitwise deterministic now. With warn_only=True
    torch only warns and still runs the nondeterministic kernels (flash
    attention's backward, for one, is deterministic only without warn_only)."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _on_cuda(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)


def pack(session):
    fast_pack = session._pack

    def pack_hook(t):
        handle = fast_pack(t)
        if handle is None:  # not the session's: made outside it; autograd keeps the tensor itself
            return (t, t._version)
        return handle

    return pack_hook


def unpack_hook(saved):
    if type(saved) is tuple:
        t, version = saved
        if t._version != version:
            from .runner import version_error, what_of

            version_error(what_of(t), t._version, version)
        return t
    return saved.unpack()
