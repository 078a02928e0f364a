"""Session.verify(): does a training step give the same bits in a session as plainly?

`dtr(chaos=True)` exists to answer that for a model before a long run, but
the answer needs care: the step must start from the same parameters,
gradients, optimizer state and random generators each time, every result
must be compared bit for bit (NaN where NaN was), and a step that is not
deterministic by itself would blame the session for its own noise. verify()
does all of it: it runs the step plainly twice (a control), then once in the
session, each time from the state it found, compares everything, and puts
the state back as it was.

What is compared: the step's return value (tensors and plain values in any
nesting of tuples, lists, dicts and dataclasses; other objects are listed,
not compared), and for each object given: a module's
parameters, their gradients and its buffers; an optimizer's (or any object
with state_dict()/load_state_dict(): a scheduler, a GradScaler) state; a
tensor and its gradient. And the random generators: torch's CPU generator,
each initialized CUDA device's, numpy's global one and Python's `random`.
Copies are kept in host memory, so checking a GPU model costs no device
memory beyond the step's own (and host memory for two copies of that
state: the start and the plain run's; the other runs are compared value
by value). The plain runs run without the session, so the step must fit
without it: check with chaos=True at a batch that fits plainly.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

_SCALARS = (bool, int, float, complex, str, type(None))


@dataclass
class VerifyResult:
    """What Session.verify() found. True (``bool(result)``) when the step in
    the session gave the plain run's bits everywhere."""

    exact: bool
    # Whether two plain runs agreed (None: not checked, control=False). When
    # they did not, the step is not deterministic by itself, and `exact`
    # is False: there is nothing to compare the session with.
    deterministic: Optional[bool]
    compared: int                                         # values compared per run
    differences: list = field(default_factory=list)       # session against plain, one line each
    nondeterminism: list = field(default_factory=list)    # plain against plain, one line each
    unchecked: list = field(default_factory=list)         # returned objects neither tensors nor plain values
    stats: dict = field(default_factory=dict)             # the session's stats() after its run
    # Where the session's run differs from the plain one: whether a run under
    # a dispatch mode that only calls each op (and saved-tensor hooks that
    # return what they get) gives the session's bits. True: torch computes
    # so under any dispatch mode, and the session adds nothing to it
    # (docs/live.md, Known limits). False: the session differs from that
    # too. None: not run (nothing differed, or the step is not deterministic).
    same_as_any_mode: Optional[bool] = None

    def __bool__(self) -> bool:
        return self.exact

    def __str__(self) -> str:
        s = self.stats
        ran = (f"{_count(s.get('evictions', 0), 'eviction')}, {_count(s.get('remats', 0), 'recompute')}, "
               f"{_count(s.get('rng_replays', 0), 'random op')} replayed")
        if self.deterministic is False:
            lines = [f"not checked: the step is not deterministic by itself; two plain runs differ in "
                     f"{len(self.nondeterminism)} of {self.compared:,} values:"]
            lines += [f"  {d}" for d in self.nondeterminism[:_SHOWN]]
            lines += _more(self.nondeterminism)
            lines.append("Make it deterministic to check it: seed what it draws (data order, masks), "
                         "torch.use_deterministic_algorithms(True) on a GPU, torch.set_num_threads(1) on a CPU "
                         "(multithreaded BLAS may sum in another order from run to run).")
            return "\n".join(lines)
        if self.exact:
            text = f"bit-exact: {self.compared:,} values equal to the plain run's ({ran})"
            if not s.get("evictions"):
                text += ("; nothing was evicted, so nothing was recomputed: check with dtr(chaos=True), "
                         "or a budget the step needs to evict under")
            if self.unchecked:
                text += f"; not compared: {', '.join(self.unchecked[:_SHOWN])}"
            return text
        lines = [f"NOT bit-exact: {len(self.differences)} of {self.compared:,} values differ from the plain run's "
                 f"({ran}):"]
        lines += [f"  {d}" for d in self.differences[:_SHOWN]]
        lines += _more(self.differences)
        if self.same_as_any_mode:
            lines.append("The same bits come out under a dispatch mode that only calls each op: torch computes them "
                         "so under any dispatch mode (a few derivative formulas round differently there: "
                         "docs/live.md, Known limits); the session's recomputes add no difference of their own.")
        elif self.same_as_any_mode is False:
            lines.append("A dispatch mode that only calls each op gives the plain run's bits where the session "
                         "does not: the difference is the session's. Please report it with this output and the "
                         "step (dtralloc's issues).")
        return "\n".join(lines)


_SHOWN = 20


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


def _more(lines) -> list:
    return [f"  ... and {len(lines) - _SHOWN} more"] if len(lines) > _SHOWN else []


def verify(session, step: Callable, state: tuple, pass_session: bool, control: bool) -> VerifyResult:
    keeper = _Keeper(state)
    plain_ctx = contextlib.nullcontext if pass_session else lambda: None
    try:
        # Only the plain run is kept whole; the others are compared with it
        # value by value as they are copied out, so the host holds two
        # copies of the state (the start and the plain run's), not four.
        plain = list(keeper.run(step, plain_ctx(), pass_session))
        nondeterminism = _differences(plain, keeper.run(step, plain_ctx(), pass_session)) if control else []
        kept = {}  # the session's values where they differ from the plain run's
        differences = _differences(plain, keeper.run(step, session, pass_session), kept)
        deterministic = None if not control else not nondeterminism
        same_as_any_mode = None
        if differences and deterministic is not False and not differences[0].startswith(_MISALIGNED):
            # The session's bits are those of plain where they agree, and the kept ones elsewhere.
            session_bits = [(name, kept.get(i, value)) for i, (name, value) in enumerate(plain)]
            same_as_any_mode = not _differences(session_bits, keeper.run(step, _AnyMode(), pass_session))
    finally:
        keeper.restore()
    unchecked = [f"{name} (a {value.type_name})" for name, value in plain if isinstance(value, _Unchecked)]
    return VerifyResult(exact=not differences and deterministic is not False, deterministic=deterministic,
                        compared=len(plain) - len(unchecked), differences=differences,
                        nondeterminism=nondeterminism, unchecked=unchecked, stats=session.stats(),
                        same_as_any_mode=same_as_any_mode)


class _AnyMode:
    """What any runtime built on a dispatch mode and saved-tensor hooks does
    to a step: a TorchDispatchMode that only calls each op, and hooks that
    return what they get. Entered where the session would be."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _CallOnly(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        self._hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        self._mode = _CallOnly()
        self._hooks.__enter__()
        try:
            self._mode.__enter__()
        except BaseException:
            self._hooks.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self._mode.__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)


class _Keeper:
    """The state a step starts from: taken once, put back before each run
    and at the end; and what a run leaves, as named host copies."""

    def __init__(self, objects: tuple):
        self.objects = []
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.nn.Module):
                kind = "module"
            elif isinstance(obj, torch.Tensor):
                kind = "tensor"
            elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
                kind = "state"
            else:
                raise TypeError(
                    f"dtralloc.dtr: verify() takes the step's state as modules, optimizers (or anything with "
                    f"state_dict() and load_state_dict(): schedulers, a GradScaler) and tensors; argument "
                    f"{i + 1} is a {type(obj).__name__}")
            label = type(obj).__name__
            if sum(type(o) is type(obj) for o in objects) > 1:
                label += f" #{sum(type(o) is type(obj) for o in objects[:i]) + 1}"
            self.objects.append((kind, obj, label))
        self.start = self._take()
        self.rng = _rng_states()

    def _take(self) -> list:
        taken = []
        for kind, obj, _ in self.objects:
            if kind == "module":
                taken.append(([_host(p) for p in obj.parameters()],
                              [None if p.grad is None else _host(p.grad) for p in obj.parameters()],
                              [_host(b) for b in obj.buffers()]))
            elif kind == "tensor":
                taken.append((_host(obj), None if obj.grad is None else _host(obj.grad)))
            else:
                taken.append(_on_host(obj.state_dict()))
        return taken

    def restore(self) -> None:
        with torch.no_grad():
            for (kind, obj, _), saved in zip(self.objects, self.start):
                if kind == "module":
                    params, grads, buffers = saved
                    for p, data, grad in zip(obj.parameters(), params, grads):
                        p.copy_(data)
                        p.grad = None if grad is None else grad.to(p.device, copy=True)
                    for b, data in zip(obj.buffers(), buffers):
                        b.copy_(data)
                elif kind == "tensor":
                    data, grad = saved
                    obj.copy_(data)
                    obj.grad = None if grad is None else grad.to(obj.device, copy=True)
                else:
                    # A copy each time: load_state_dict may keep the tensors it
                    # is given (an optimizer's, where no cast is needed), and
                    # the step would then write into the starting state.
                    obj.load_state_dict(copy.deepcopy(saved))
        _set_rng_states(self.rng)

    def run(self, step: Callable, ctx, pass_session: bool):
        """One run from the starting state. Yields what it left, (name,
        value) with tensors copied to the host one at a time."""
        self.restore()
        if pass_session:
            out = step(ctx)
        elif ctx is None:
            out = step()
        else:
            with ctx:
                out = step()
        return self._results(out)

    def _results(self, out):
        yield from _flatten("the step's return value", out)
        for kind, obj, name in self.objects:
            if kind == "module":
                for pname, p in obj.named_parameters():
                    yield f"{name} parameter {pname}", _host(p)
                    yield f"{name} gradient of {pname}", None if p.grad is None else _host(p.grad)
                for bname, b in obj.named_buffers():
                    yield f"{name} buffer {bname}", _host(b)
            elif kind == "tensor":
                yield name, _host(obj)
                yield f"{name}'s gradient", None if obj.grad is None else _host(obj.grad)
            else:
                yield from _flatten(name, obj.state_dict())
        yield from _rng_states().items()


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _on_host(tree):
    if isinstance(tree, torch.Tensor):
        return _host(tree)
    if isinstance(tree, dict):
        return {k: _on_host(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(_on_host(v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_on_host(v) for v in tree)
    return tree


def _flatten(name: str, tree):
    """Tensors and plain values in nested dicts, lists, tuples and
    dataclasses, each named by its path. Any other object is named with
    its type and not compared (its repr may hold an address, which differs
    from run to run)."""
    if isinstance(tree, torch.Tensor):
        yield name, _host(tree)
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(f"{name}[{k!r}]", v)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(f"{name}[{i}]", v)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            yield from _flatten(f"{name}.{f.name}", getattr(tree, f.name))
    elif isinstance(tree, _SCALARS):
        yield name, tree
    else:
        yield name, _Unchecked(type(tree).__name__)


@dataclass(frozen=True)
class _Unchecked:
    """A value verify() does not compare (neither a tensor nor a plain value)."""
    type_name: str


def _rng_states() -> dict:
    states = {"torch's CPU generator": torch.get_rng_state(), "numpy's global generator": np.random.get_state(),
              "Python's random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            states[f"the CUDA generator of device {i}"] = torch.cuda.get_rng_state(i)
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch's CPU generator"])
    np.random.set_state(states["numpy's global generator"])
    random.setstate(states["Python's random"])
    for name, state in states.items():
        if name.startswith("the CUDA generator of device "):
            torch.cuda.set_rng_state(state, int(name.rsplit(" ", 1)[1]))


_MISALIGNED = "the runs left different things to compare"


def _differences(want: list, got, kept: Optional[dict] = None) -> list:
    """What differs between `want` (a run's values) and the run `got`
    yields, one line each; `kept` gets got's value at each index that
    differs."""
    lines, names, aligned = [], [], True
    for i, (name, value) in enumerate(got):
        names.append(name)
        if i >= len(want) or want[i][0] != name:
            aligned = False
        elif aligned and (why := _why_differ(want[i][1], value)):
            lines.append(f"{name}: {why}")
            if kept is not None:
                kept[i] = value
    if not aligned or len(names) != len(want):
        odd = {n for n, _ in want} ^ set(names)
        return [f"{_MISALIGNED} (the step returned or made other values): "
                f"{', '.join(sorted(odd)[:5]) or 'the same names in another order'}"]
    return lines


def _why_differ(a, b) -> Optional[str]:
    """None if `a` and `b` are the same bits (NaN where NaN), else what differs."""
    if isinstance(a, _Unchecked) or isinstance(b, _Unchecked):
        return None if a == b else _kinds(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return _kinds(a, b)
        if a.is_nested or b.is_nested:
            if not (a.is_nested and b.is_nested) or a.size(0) != b.size(0):
                return _kinds(a, b)
            whys = [_why_differ(x, y) for x, y in zip(a.unbind(), b.unbind())]
            differ = [f"component {i}: {w}" for i, w in enumerate(whys) if w]
            return "; ".join(differ) if differ else None
        if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout:
            return _kinds(a, b)
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        if torch.equal(a, b):
            return None
        if a.is_floating_point() or a.is_complex():
            both_nan = a.isnan() & b.isnan()
            differ = (a != b) & ~both_nan
            if not differ.any():
                return None
            gap = (a.to(torch.complex128 if a.is_complex() else torch.float64)
                   - b.to(torch.complex128 if b.is_complex() else torch.float64)).abs()
            gap = gap[differ]
            finite = gap[gap.isfinite()]
            largest = f"largest difference {finite.max().item():.3g}" if finite.numel() else "NaN or inf in one run"
            return f"{int(differ.sum())} of {a.numel()} elements differ ({largest})"
        differ = a != b
        return f"{int(differ.sum())} of {a.numel()} elements differ"
    if isinstance(a, tuple) and len(a) > 2 and isinstance(a[1], np.ndarray):  # numpy's generator state
        same = len(b) == len(a) and a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
        return None if same else "a different state after the run"
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    if type(a) is not type(b) or a != b:
        return f"{a!r} in the plain run, {b!r} in this one" if isinstance(a, _SCALARS) else \
            "a different state after the run"
    return None


def _kinds(a, b) -> str:
    """What each run left, where they are not the same kind of value."""
    return f"{_what(a)} in the plain run, {_what(b)} in this one"


def _what(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a nested {x.dtype} tensor" if x.is_nested else f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    if isinstance(x, _Unchecked):
        return f"a {x.type_name} (not compared)"
    return "none" if x is None else type(x).__name__
