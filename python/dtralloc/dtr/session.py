"""dtralloc.dtr(): live DTR on eager PyTorch under a memory budget.

A session records every op run inside its ``with`` block (a TorchDispatchMode),
owns the tensors autograd saves (saved-tensor hooks hand autograd a handle, the
registry in C++ holds the storage), and, when the pool cannot serve a request
within the budget, evicts saved activations that can be recomputed, chosen by
the same evictor and policy that replay measures. Autograd's unpack brings an
evicted value back by rerunning the ops that made it, bit for bit.
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Optional

import numpy as np
import torch

from .. import _core
from ..config import size_in_bytes
from .recording import HISTORY_EVENTS, SERIES_OPS
from .mode import Mode, pack, unpack_hook
from .runner import helpers, probing
from .verify import VerifyResult, verify

_active = threading.local()      # the session whose `with` block this thread is in
_sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()  # alive (their saved values may be unpacked)
_raw_refcount: Optional[bool] = None


def _check_raw_refcount() -> bool:
    """Whether reading a StorageImpl's strong count straight from memory agrees
    with torch._C._storage_Use_Count on this torch (then evictability checks
    need no call into Python)."""
    global _raw_refcount
    if _raw_refcount is None:
        with probing():
            t = torch.empty(4, device="cpu")
            c = t.untyped_storage()._cdata
            agree = _core.storage_refcount_word(c) == torch._C._storage_Use_Count(c)
            views = [t.view(2, 2), t[1:]]
            agree = agree and _core.storage_refcount_word(c) == torch._C._storage_Use_Count(c)
            del views
            agree = agree and _core.storage_refcount_word(c) == torch._C._storage_Use_Count(c)
        _raw_refcount = bool(agree)
    return _raw_refcount


def _budget_bytes(budget) -> int:
    if budget is None:
        return 0
    if callable(budget):
        raise TypeError(f"dtralloc.dtr: to decorate {getattr(budget, '__qualname__', budget)!r}, call dtr first: "
                        "@dtralloc.dtr() or @dtralloc.dtr(budget=...), not @dtralloc.dtr")
    return size_in_bytes(budget, "dtralloc.dtr")


def _device(device) -> tuple[bool, int, str]:
    """(cuda?, index, name) for dtr(device=...): None picks CUDA when dtralloc
    is torch's allocator, else the CPU mirror."""
    from ..torch_hooks import installed

    if device is None:
        device = "cuda" if installed() else "cpu"
    try:
        with torch._C.DisableTorchFunction():  # torch.device goes through torch function: a user's mode would see it
            d = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:  # torch's words (a number on a machine without CUDA, a typo)
        raise ValueError(f"dtralloc.dtr: device must be 'cpu' or 'cuda[:N]', not {device!r} ({e})") from None
    if d.type == "cpu":
        return False, 0, "cpu"
    if d.type != "cuda":
        raise ValueError(f"dtralloc.dtr: device must be 'cpu' or 'cuda[:N]', not {device!r}")
    if not installed():
        raise RuntimeError(
            "dtralloc.dtr(device='cuda') needs dtralloc as torch's CUDA allocator: call dtralloc.install() "
            "first thing in the program (before any CUDA tensor exists). For a budget over CPU tensors, "
            "or without installing, use dtr(device='cpu').")
    index = d.index if d.index is not None else torch.cuda.current_device()
    return True, index, f"cuda:{index}"


def _outer_pack_hook() -> Optional[str]:
    """The name of the pack hook on top of this thread's stack of saved-tensor
    hooks (torch.autograd.graph.saved_tensors_hooks and what builds on it),
    or None where there is none. torch's accessor is private: torch 2.8, 2.13
    and 2.14 have it (checked), taking whether to look past Dynamo's
    tracing (yes); one without the argument is asked without it, and a
    torch without the accessor starts sessions as before."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        hooks = top(True)
    except TypeError:  # an accessor that takes no argument
        hooks = top()
    if not hooks:
        return None
    pack = hooks[0]
    return f"{getattr(pack, '__module__', None) or '?'}.{getattr(pack, '__qualname__', None) or repr(pack)}"


def _explain_saved_hooks_refusal(error) -> None:
    """torch.func.grad, vjp, jacrev and hessian refuse to run while any
    saved-tensor hooks are installed (torch/_functorch/vmap.py,
    doesnt_support_saved_tensors_hooks) and say so without naming who
    installed them: a session does. The error keeps its type and text; a note
    says where the hooks come from and what runs instead."""
    if (isinstance(error, RuntimeError) and "torch.func" in str(error) and "saved tensor hooks" in str(error)
            and hasattr(error, "add_note")):  # add_note: Python 3.11
        error.add_note(
            "dtralloc.dtr: the session's saved-tensor hooks are what torch.func refuses here. Call "
            "torch.func.grad/vjp/jacrev/hessian outside the dtr() block, or use torch.autograd.grad "
            "(or torch.autograd.functional) inside it; torch.vmap, torch.func.jvp and forward-mode AD "
            "run inside a session.")


def _policy(policy: Optional[str]) -> str:
    from ..replay import POLICIES

    if policy is None:  # the pool's setting, else ours
        configured = {o["name"]: o["value"] for o in _core.describe_config(_core.config_text())}["policy"]
        policy = configured if configured != "none" else "dtralloc"
    if policy not in POLICIES:
        raise ValueError(f"dtralloc.dtr: unknown policy {policy!r}; available: {', '.join(POLICIES)}")
    return policy


def _fused_foreach(cuda: bool) -> bool:
    """Whether the session's device runs a foreach op's whole list through
    one fused kernel or through torch's per-tensor loop (CUDA), so that a
    call splits by element only where each element alone would take the
    list's route (LiveSession::elements_of). Tests replace this to run
    CUDA's rules on CPU, whose foreach kernels always loop."""
    return cuda


class Session:
    """A dtr() session; use it as a context manager, or as a decorator (each
    call in a session of its own). ``stats()`` works during and after the
    block; backward may run after the block (the session lives as long as a
    saved value needs it)."""

    def __init__(self, budget=None, policy: Optional[str] = None, device=None, chaos: bool = False,
                 check_invariants: bool = False, series: int = SERIES_OPS, history=False):
        for flag, value in (("chaos", chaos), ("check_invariants", check_invariants)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"dtralloc.dtr: {flag} is True or False, not {value!r}")
        chaos, check_invariants = bool(chaos), bool(check_invariants)
        cuda, index, name = _device(device)
        if isinstance(series, bool) or not isinstance(series, int) or series < 0:
            raise TypeError(f"dtralloc.dtr: series is a number of ops (0: none), not {series!r}")
        history_events = HISTORY_EVENTS if history is True else int(history or 0)
        if history_events < 0:
            raise ValueError(f"dtralloc.dtr: history is True, False or a number of events, not {history!r}")
        self.device = name
        # As given: a function this session decorates runs each call in a new one made so (__call__).
        self._arguments = (budget, policy, device, chaos, check_invariants, series, history)
        self.budget_bytes = _budget_bytes(budget)
        self.policy = _policy(policy)
        self.chaos = chaos
        self._core = _core.LiveSession(cuda, index, self.budget_bytes, _core.config_text(), self.policy, chaos,
                                       check_invariants, helpers(name), series, history_events,
                                       _fused_foreach(cuda))
        self._core.use_raw_refcount(_check_raw_refcount())
        self._record, self._pack, self._fast_dispatch = self._core.fast_calls()
        self._mode: Optional[Mode] = None
        self._hooks = None
        self._entered = False

    def __enter__(self) -> "Session":
        if self._entered:
            raise RuntimeError("dtralloc.dtr: a session can be entered once; make a new one with dtralloc.dtr()")
        if getattr(_active, "session", None) is not None:
            raise RuntimeError("dtralloc.dtr: sessions do not nest; this thread is already inside one")
        autograd = torch._C._autograd
        if hasattr(autograd, "_saved_tensors_hooks_is_enabled") and not autograd._saved_tensors_hooks_is_enabled():
            raise RuntimeError(
                "dtralloc.dtr: saved-tensor hooks are disabled here (torch.autograd.graph."
                "disable_saved_tensors_hooks, as torch.func's transforms do, with the message "
                f"{autograd._saved_tensors_hooks_get_disabled_error_message()!r}), and a session owns saved tensors "
                "through them. Enter the session outside that code, or run that code without one.")
        outer = _outer_pack_hook()
        if outer is not None:
            raise RuntimeError(
                f"dtralloc.dtr: saved-tensor hooks are already active in this thread ({outer}: "
                "torch.autograd.graph.saved_tensors_hooks, save_on_cpu, or checkpoint's own). torch applies only "
                "the innermost hooks, so the session's would replace them for everything inside its block: what "
                "they do (offloading, compressing) would be lost, and gradients could differ from the same code "
                "without the session. Enter the session outside them (with dtralloc.dtr(): with save_on_cpu(): "
                "...): they then apply to what they wrap, as without the session, and the session owns what is "
                "saved outside them.")
        self._entered = True
        self._core.start()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack(self), unpack_hook)
        self._hooks.__enter__()
        self._mode = Mode(self, self._fast_dispatch)
        self._mode.__enter__()
        _active.session = self
        _sessions.add(self)
        _exports.attach()
        return self

    def __exit__(self, *exc) -> None:
        _active.session = None
        _explain_saved_hooks_refusal(exc[1])
        try:
            self._mode.__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)
            _exports.detach()
            # The C++ half holds the mode's methods while the mode is active;
            # dropping them here breaks the session -> core -> mode -> session
            # cycle that Python's collector cannot see through C++.
            self._core.set_dispatch_helpers(None, None, None, None)
            self._core.end_block()
            # The mode refers back to the session, and its per-op entry point
            # (a method bound to the mode, in the mode's own dict) back to the
            # mode: both cycles go, so the session dies with its last
            # reference rather than at the collector's next pass (on CUDA its
            # budget holds the shared pool for as long as it lives).
            self._mode.__dict__.pop("__torch_dispatch__", None)
            self._mode = None
            self._hooks = None
        self._core.flush_deaths()

    def stats(self) -> dict:
        """evictions, remats, rng_replays, hold_restarts (recomputes that ran out of
        memory and started over from an emptied pool), long_lived (requests
        placed at the high end as the step before kept them: docs/live.md),
        device_calls and device_call_seconds (segments the pool made and gave
        back since the session began, and the host time inside those calls:
        on CUDA cudaMalloc and cudaFree, whose wait for the device is in it;
        with async_segments:on calls that do not wait, and device_pool_waits
        the times the pool waited for the driver to give freed segments back:
        docs/allocator.md, Note [async segments]),
        resize_copies (storages resized outside the dispatcher whose contents
        were copied for the recomputes that read them: docs/live.md),
        split_foreach_ops (foreach calls recorded with a recipe per element:
        docs/live.md), gpu_timed_ops and carried_costs (CUDA: ops the GPU
        priced, and ops first priced at the step before's GPU time for the
        same op: docs/live.md, "On a GPU"), peak_bytes, budget_bytes (0 for
        a CPU session without a budget), recompute_seconds, ..."""
        return self._core.stats()

    def series(self) -> dict:
        """The pool sampled after each recorded op, as numpy columns with
        ReplayResult.series's names and meanings: op (the engine's op index,
        the events' and the history's op stamps), reserved, allocated,
        evictable, largest_free, free (bytes), event (with a history: events
        recorded before the sample); and phase (codes into
        ``dtralloc.dtr.PHASES``: forward, backward, optimizer) and name (the
        ATen op). Only ops that make or write a storage are recorded (views
        change no memory); the first ``dtr(series=N)`` of them."""
        d = self._core.series()
        names = np.asarray(d.pop("names") or [""], dtype=str)
        d["name"] = names[d.pop("name_index")]
        return d

    def events(self) -> dict:
        """The evictor's calls, the evictions and the recomputes, as numpy
        columns named as ReplayResult.events: op, kind (0 room asked, 1
        evicted, 2 recomputed), value, bytes, addr, plan (0 none, 1 window, 2
        segment release, 3 single), score, window_addr, window_bytes."""
        return self._core.events()

    def pool_snapshot(self) -> dict:
        """The session's pool now (the CPU mirror, or the installed CUDA
        pool) as ``Pool.snapshot(columns=True)``: its segments, and its
        history as columns, each event stamped with the op it happened in."""
        return self._core.pool_snapshot()

    def evict_all(self) -> int:
        """Evict every value that can be evicted now; returns how many."""
        return self._core.evict_all()

    def check_invariants(self) -> None:
        """Raise if the engine, the pool or the registry disagree (DESIGN.md §3)."""
        self._core.check_invariants()

    def verify(self, step, *state, pass_session: bool = False, control: bool = True) -> VerifyResult:
        """Check that ``step()`` gives the same bits in this session as plainly.

        Runs the step plainly twice (a control: a step that is not
        deterministic by itself cannot be checked), then once in this
        session, each run from the state it found: the parameters,
        gradients and buffers of the modules in `state`, the optimizers'
        (and schedulers', a GradScaler's) state, the tensors', and the
        random generators (torch's, numpy's, Python's). Then it compares
        the step's return value and all of that bit for bit, and puts the
        state back as it was before the call::

            result = dtralloc.dtr(chaos=True).verify(train_step, model, optimizer)
            print(result)          # bit-exact: 1,204 values equal ... / NOT bit-exact: ...
            assert result

        pass_session: call ``step(ctx)`` with the context to run in (this
        session in the checked run, ``contextlib.nullcontext()`` in the
        plain ones) instead of entering the session around the whole step:
        for a step that enters it around its forward alone (docs/live.md).
        control: False skips the second plain run (a step that differs
        from itself then reads as a difference of the session's).
        Where the session's run differs, the step runs once more under a
        dispatch mode that only calls each op: ``same_as_any_mode`` says
        whether torch itself computes so under any mode (docs/live.md,
        Known limits) or the difference is the session's.

        The plain runs run without the session, so the step must fit
        without it: check with chaos=True at a batch that fits plainly.
        Like ``with``, this enters the session, which can be entered once.
        Returns a :class:`VerifyResult`, true when bit-exact; an error the
        step raises (out of memory under a budget) propagates, the state
        put back first.
        """
        if self._entered:
            raise RuntimeError("dtralloc.dtr: verify() runs the step in this session, which was already entered; "
                               "make a new one with dtralloc.dtr()")
        if not callable(step):
            raise TypeError(f"dtralloc.dtr: verify() takes the step to run first (a callable), not {step!r}")
        return verify(self, step, state, bool(pass_session), bool(control))

    def __call__(self, fn):
        """``@dtralloc.dtr(...)`` on a function: each call runs in a session
        of its own, made with these arguments (a session is entered once), as
        ``with dtralloc.dtr(...):`` around the call would. The wrapper's
        ``last_session`` is the latest call's session, for its stats()."""
        if not callable(fn):
            raise TypeError(f"dtralloc.dtr: a session decorates a function, not {fn!r}; "
                            "around a block of code, use `with dtralloc.dtr(...):`")
        if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(f"dtralloc.dtr: cannot decorate {getattr(fn, '__qualname__', fn)}, a generator or "
                            "coroutine function: its body runs after the call returns, outside the session. "
                            "Decorate the function that runs the step, or use `with dtralloc.dtr(...):` inside it")
        if self._entered:
            raise RuntimeError("dtralloc.dtr: this session was already entered; decorate with a new one "
                               "(@dtralloc.dtr(...))")
        arguments = self._arguments

        @functools.wraps(fn)
        def in_a_session(*args, **kwargs):
            session = Session(*arguments)
            with session:
                # Only now: the previous call's session lives until this one
                # started, as `s` of `with dtr() as s` does in a loop (on CUDA
                # it hands its op costs over then: docs/live.md).
                in_a_session.last_session = session
                return fn(*args, **kwargs)

        in_a_session.last_session = None
        return in_a_session

    def __repr__(self) -> str:
        s = self.stats()
        return (f"<dtralloc.dtr session device={self.device} policy={self.policy} "
                f"budget={_core.format_bytes(s['budget_bytes']) if s['budget_bytes'] else 'none'} "
                f"evictions={s['evictions']} remats={s['remats']}>")


class _Exports:
    """While a session is active, a tensor whose data leave the dispatcher
    (data_ptr, numpy, dlpack) is pinned: code outside torch's dispatch could
    write it, and a recompute would not see that. A storage resized outside
    the dispatcher (``UntypedStorage.resize_``, which FSDP uses to free and
    refill unsharded parameters) loses its contents: what depends on them is
    brought back first and pinned (LiveSession::resizing)."""

    # (owner, method, what each live session's C++ half is told first)
    _METHODS = ((torch.Tensor, "data_ptr", "exported"), (torch.Tensor, "numpy", "exported"),
                (torch.Tensor, "__dlpack__", "exported"), (torch.UntypedStorage, "resize_", "resizing"))

    def __init__(self):
        self._depth = 0
        self._originals = {}

    def attach(self):
        self._depth += 1
        if self._depth > 1:
            return
        for owner, name, tell in self._METHODS:
            original = getattr(owner, name)
            self._originals[owner, name] = original
            setattr(owner, name, self._wrap(original, tell))

    def detach(self):
        self._depth -= 1
        if self._depth:
            return
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()

    @staticmethod
    def _wrap(original, tell):
        def wrapped(self, *args, **kwargs):
            for session in list(_sessions):
                getattr(session._core, tell)(self)
            return original(self, *args, **kwargs)

        wrapped.__name__ = original.__name__
        wrapped.__doc__ = original.__doc__
        return wrapped


_exports = _Exports()
