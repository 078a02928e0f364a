"""Recording a step: dtralloc.trace.record and the TorchDispatchMode behind it.

torch is imported here and nowhere else in dtralloc.trace, so a trace loads
and replays without torch; ``dtralloc.trace.record`` imports this module on
first use.

Storage identity is the StorageImpl (``untyped_storage()._cdata``); its death
is observed with a weakref on the storage's Python object, which torch keeps
alive for as long as any tensor or autograd node still holds the StorageImpl.
Deaths are attached to the op after which they happened.
"""
from __future__ import annotations

import datetime
import threading
import time
import weakref
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._version import __version__
from .model import Trace
from .records import Op, Storage

try:  # FLOP formulas for matmul/conv/attention; others count one per element
    from torch.utils.flop_counter import flop_registry as _FLOP_REGISTRY
except ImportError:  # pragma: no cover - very old torch
    _FLOP_REGISTRY = {}

_RANDOM_TAG = getattr(torch.Tag, "nondeterministic_seeded", None)

# torch.tensor / as_tensor / from_numpy allocate (or wrap) a storage outside any
# dispatch mode and then hand the new tensor to aten::lift_fresh. Its storage is
# born there, during the step: registering it as an input would wrongly make it
# an initial storage (alive before the step, allocated first on replay).
_LIFT_FRESH = torch.ops.aten.lift_fresh.default

# Legacy batch norms update running_mean / running_var (arguments 3 and 4) in
# place when `training` (argument 5) is set, but their schemas carry no (a!)
# annotation for it (torch's functionalization special-cases them too).
_UNDECLARED_RUNNING_STATS = frozenset({"aten::native_batch_norm", "aten::cudnn_batch_norm",
                                       "aten::miopen_batch_norm"})


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Recorder(TorchDispatchMode):
    def __init__(self, time_ops: bool = True):
        super().__init__()
        self.time_ops = time_ops
        self.storages: list[Storage] = []
        self.ops: list[Op] = []
        self.frees_before: list[int] = []
        self._sid_of: dict[int, int] = {}         # StorageImpl address -> storage id
        self._refs: dict[int, weakref.ref] = {}   # storage id -> weakref while alive
        self._dead: list[int] = []                # deaths not yet attached to an op
        self._lock = threading.Lock()             # deaths arrive on autograd threads too
        self._cuda_events: list[tuple[int, object, object]] = []
        self._started = datetime.datetime.now(datetime.timezone.utc)

    # -- storages --------------------------------------------------------------
    def _died(self, sid: int) -> None:
        with self._lock:
            self._dead.append(sid)

    def _storage_id(self, t: torch.Tensor, producer: int) -> tuple[int, bool]:
        """(storage id, created now). producer -1 registers an initial storage."""
        st = t.untyped_storage()
        key = st._cdata
        with self._lock:
            sid = self._sid_of.get(key)
            ref = self._refs.get(sid) if sid is not None else None
            if ref is not None and ref() is not None:
                return sid, False
        sid = len(self.storages)
        self.storages.append(
            Storage(
                nbytes=st.nbytes(),
                device=str(t.device),
                dtype=str(t.dtype).replace("torch.", ""),
                initial=producer < 0,
                producer=producer,
            )
        )
        with self._lock:
            self._sid_of[key] = sid
            self._refs[sid] = weakref.ref(st, lambda _ref, sid=sid: self._died(sid))
        return sid, True

    def flush_frees(self) -> None:
        with self._lock:
            dead, self._dead = self._dead, []
            for sid in dead:
                self._refs.pop(sid, None)
        if self.ops:
            self.ops[-1].frees.extend(dead)
        else:
            self.frees_before.extend(dead)

    # -- ops -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # record_function markers: no memory, no compute
            return func(*args, **kwargs)
        self.flush_frees()
        index = len(self.ops)
        in_tensors = _tensors((args, kwargs))
        if func is _LIFT_FRESH:  # the output's storage is created by this op, see above
            inputs = []
        else:
            inputs = list(dict.fromkeys(self._storage_id(t, -1)[0] for t in in_tensors))
        mutated, written = self._mutated_storages(func, args, kwargs)

        cuda = self.time_ops and any(t.is_cuda for t in in_tensors)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter_ns()
        out = func(*args, **kwargs)
        duration = time.perf_counter_ns() - t0 if self.time_ops else 0
        out_tensors = _tensors(out)
        if cuda or (self.time_ops and any(t.is_cuda for t in out_tensors)):
            if not cuda:
                start = end = None
            else:
                end.record()
                self._cuda_events.append((index, start, end))

        op = Op(name=self._name(func), inputs=inputs, mutated=mutated, duration_ns=duration)
        for t in out_tensors:
            sid, created = self._storage_id(t, index)
            op.outputs.append(sid)
            if created:
                op.created.append(sid)
            elif sid in inputs and sid not in mutated:
                op.aliased.append(sid)
        op.created = list(dict.fromkeys(op.created))
        op.random = self._is_random(func, args, kwargs)
        op.backward = torch._C._current_graph_task_id() != -1
        if op.outputs and not op.created and not op.mutated and set(op.aliased) == set(op.outputs):
            pass  # a view: moves nothing, computes nothing
        else:
            op.bytes_moved = sum(_nbytes(t) for t in in_tensors) + sum(_nbytes(t) for t in out_tensors)
            op.flops = self._flops(func, args, kwargs, out, out_tensors or written)
        self.ops.append(op)
        self.flush_frees()
        return out

    @staticmethod
    def _name(func) -> str:
        packet = func._schema.name  # "aten::add"
        overload = func._overloadname
        return packet if overload == "default" else f"{packet}.{overload}"

    def _mutated_storages(self, func, args, kwargs) -> tuple[list[int], list[torch.Tensor]]:
        schema = func._schema

        def value(i: int):
            return args[i] if i < len(args) else kwargs.get(schema.arguments[i].name)

        written = [i for i, arg in enumerate(schema.arguments)
                   if arg.alias_info is not None and arg.alias_info.is_write]
        if schema.name in _UNDECLARED_RUNNING_STATS and value(5):
            written += [3, 4]
        tensors = [t for i in written for t in _tensors(value(i))]
        sids = [self._storage_id(t, -1)[0] for t in tensors]
        return list(dict.fromkeys(sids)), tensors

    @staticmethod
    def _is_random(func, args, kwargs) -> bool:
        if _RANDOM_TAG is None or _RANDOM_TAG not in func.tags:
            return False
        # Fused attention carries the tag even when its dropout is off.
        for i, arg in enumerate(func._schema.arguments):
            if arg.name == "dropout_p":
                p = args[i] if i < len(args) else kwargs.get("dropout_p", 0.0)
                return bool(p)
        return True

    @staticmethod
    def _flops(func, args, kwargs, out, result_tensors) -> int:
        """torch's formula where one exists, else one per element written
        (outputs, or the tensors an in-place op writes)."""
        formula = _FLOP_REGISTRY.get(func._overloadpacket)
        if formula is not None:
            try:
                return int(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not fit this overload
                pass
        return sum(t.numel() for t in result_tensors)

    # -- end -------------------------------------------------------------------
    def finish(self, name: str) -> Trace:
        self.flush_frees()
        if self._cuda_events:
            torch.cuda.synchronize()
            for index, start, end in self._cuda_events:
                self.ops[index].duration_ns = int(start.elapsed_time(end) * 1e6)
        with self._lock:
            for sid, ref in self._refs.items():
                if ref() is not None:
                    self.storages[sid].outlives = True
        devices = sorted({s.device for s in self.storages})
        meta = {
            "name": name,
            "torch": torch.__version__,
            "dtralloc": __version__,
            "devices": devices,
            "recorded_at": self._started.isoformat(timespec="seconds"),
            "durations": "cuda events" if self._cuda_events else ("wall clock" if self.time_ops else "none"),
        }
        trace = Trace(self.storages, self.ops, self.frees_before, meta)
        trace.validate()
        return trace


def record(step_fn: Callable[[], object], name: Optional[str] = None, time_ops: bool = True) -> Trace:
    """Run ``step_fn()`` once and return its trace.

    ``step_fn`` should run one training step (forward, backward, optimizer
    step) of an eager model on any device. Storages alive before the call and
    touched by it are "initial"; storages alive after it "outlive" the step.
    Keep references you want to outlive the step outside ``step_fn`` (its
    return value is held until recording ends, so it outlives the step too).
    """
    recorder = Recorder(time_ops=time_ops)
    with recorder:
        result = step_fn()
        recorder.flush_frees()
    trace = recorder.finish(name or getattr(step_fn, "__name__", "step"))
    del result
    return trace
