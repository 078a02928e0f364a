"""What the C++ live session asks Python to do: rerun an op for a
recompute, make storages, raise torch's version error. (The tensor views it
rebuilds on storages it makes itself, Geometry::view, through the accessors
below.) Every function runs with Python dispatch off, so nothing it does is
recorded as an op of the session (docs/live.md)."""
from __future__ import annotations

import contextlib
import re
import sys
import warnings

import torch

_no_dispatch = torch._C._DisableTorchDispatch


@contextlib.contextmanager
def probing():
    """For the one-time probes of how this torch behaves (they make CPU
    tensors of their own): Python dispatch and torch function off, so that
    neither a default device (torch.set_default_device and `with
    torch.device(...)` are a torch function mode that fills in factories'
    device) nor a mode of the user's changes them or sees them."""
    with torch._C.DisableTorchFunction(), _no_dispatch():
        yield


def detached(t):
    """An external input as a recompute reads it: the same tensor, outside
    autograd (so rerunning the op builds no graph)."""
    with _no_dispatch():
        return t.detach()


@contextlib.contextmanager
def _autocast_off(devices):
    with contextlib.ExitStack() as stack:
        for device_type in devices:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def run(func, args, kwargs, rng, grad_enabled):
    """Rerun an op for a recompute: grad mode as the op saw it (some kernels
    differ with it; the rebuilt inputs never require grad, so no graph is
    built), no autocast (the recorded op already carries the dtypes autocast
    chose), and a random op draws from its generator's state at its first
    run; the generator is left as it was."""
    devices = {a.device.type for a in args if isinstance(a, torch.Tensor) and a.device.type in ("cpu", "cuda")}
    with _no_dispatch(), torch.set_grad_enabled(grad_enabled), _autocast_off(devices or {"cpu"}):
        if rng is None:
            return func(*args, **kwargs)
        generator, state = rng
        current = generator.get_state()
        generator.set_state(state)
        try:
            return func(*args, **kwargs)
        finally:
            generator.set_state(current)


def new_storage(nbytes, like, copy, device):
    """A copy of `like`, or fresh memory (zeroed when there is nothing to copy
    from: a scratch argument the op writes but whose contents do not matter)."""
    with _no_dispatch():
        if copy:
            return like.clone()
        storage = torch.UntypedStorage(nbytes, device=like.device if like is not None else device)
        if like is None:
            storage.fill_(0)
        return storage


def use_count(cdata: int) -> int:
    return torch._C._storage_Use_Count(cdata)


def what_of(t: torch.Tensor):
    """What torch's version error names about a saved tensor (the live session
    reads the same from C++ at pack time: LiveSession::pack)."""
    grad_fn = t.grad_fn
    return (t.dtype, t.device, tuple(t.shape), t.output_nr, grad_fn.name() if grad_fn is not None else None)


def _torch_words() -> tuple:
    """How this torch words its own version error: the hint it ends with, and
    whether it names the op ("output 0 of Exp", torch 2.13) or its backward
    node ("output 0 of ExpBackward0", torch 2.11). Learnt from a real one."""
    try:
        with probing():
            a = torch.zeros(1, requires_grad=True, device="cpu")
            y = a.exp()
            y.add_(1)
            y.sum().backward()
    except RuntimeError as e:
        message = str(e)
        if " Hint: " in message:
            return message[message.index(" Hint: ") + 1:], "of ExpBackward0," not in message
    return ("Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
            "with torch.autograd.set_detect_anomaly(True).", True)


_HINT, _NAMES_THE_OP = _torch_words()


def _view_node(base: torch.Tensor, size, stride, offset):
    """The name of the grad_fn torch gives a view of `base` once the base
    was written in place (torch remakes it on access; the error names it)."""
    with _no_dispatch(), torch.enable_grad():
        node = base.as_strided(size, stride, offset).grad_fn
    return node.name() if node is not None else None


def _op_name(node: str) -> str:
    """How torch 2.13's error names a backward node: ExpBackward0 -> Exp,
    PowBackward2 -> Pow2; C++ nodes (torch::autograd::CopySlices) as they are."""
    return re.sub(r"Backward([0-9]*)$", lambda m: "" if m.group(1) in ("", "0") else m.group(1), node)


def version_error(what, now: int, expected: int):
    """Raise torch's own "modified by an inplace operation" error: with
    saved-tensor hooks installed torch no longer checks versions itself."""
    if isinstance(what, str):
        subject = what
    else:
        dtype, device, shape, output_nr, grad_fn = what
        if isinstance(grad_fn, tuple):  # a saved view that is gone: (its base, size, stride, offset)
            grad_fn = _view_node(*grad_fn)
        with _no_dispatch():
            type_name = torch.empty((0,), dtype=dtype, device=device).type()
        subject = f"[{type_name} {list(shape)}]"
        if grad_fn is not None:
            node = _op_name(grad_fn) if _NAMES_THE_OP else grad_fn
            subject += f", which is output {output_nr} of {node},"
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {subject} is at version {now}; expected version {expected} instead. {_HINT}")


def _accessors() -> dict:
    """The descriptors behind the tensor and storage attributes the C++ half
    reads per op (called directly, with no lookup by name)."""
    tensor, storage = torch._C.TensorBase, torch._C.StorageBase
    return {"untyped_storage": tensor.untyped_storage, "size": tensor.size, "stride": tensor.stride,
            "storage_offset": tensor.storage_offset, "dtype": tensor.__dict__["dtype"],
            "_version": tensor.__dict__["_version"], "device": tensor.__dict__["device"],
            "layout": tensor.__dict__["layout"], "strided": torch.strided, "is_nested": tensor.__dict__["is_nested"],
            "grad_fn": tensor.__dict__["grad_fn"], "output_nr": tensor.__dict__["output_nr"],
            "_base": tensor.__dict__["_base"], "nbytes": storage.nbytes, "data_ptr": storage.data_ptr,
            "_cdata": storage.__dict__["_cdata"], "is_contiguous": tensor.is_contiguous, "numel": tensor.numel,
            "element_size": tensor.element_size, "get_device": tensor.get_device, "is_conj": tensor.is_conj,
            "is_neg": tensor.is_neg, "set_": tensor.set_, "_conj": tensor._conj, "_neg_view": tensor._neg_view,
            "detach": tensor.detach,
            "storage_device": storage.__dict__["device"], "empty": torch.empty,
            "_fix_weakref": getattr(storage, "_fix_weakref", None),
            "_DisableTorchDispatch": _no_dispatch, "Tensor": torch.Tensor,
            "disabled_torch_dispatch": torch._C._disabled_torch_dispatch_impl}


_shared_pyrefs = None


def shared_storage_pyrefs() -> int:
    """The references torch itself holds to a storage's Python object while
    some tensor shares its StorageImpl (1 on torch 2.13, which keeps the
    object alive that way; 0 where it does not). The registry owns a storage
    through its Python object; a saved alias (Note [saved alias]) shares it,
    and the evictability check must not take torch's own reference then for
    the program's. -1 where the count is neither (a torch whose preservation
    works otherwise): sessions then keep no saved alias, as before it
    existed (a write to a saved tensor the program dropped goes unseen), and
    a warning says so once."""
    global _shared_pyrefs
    if _shared_pyrefs is None:
        storage = torch.UntypedStorage(8, device="cpu")
        alone = sys.getrefcount(storage)
        with probing():
            t = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)
        shared = sys.getrefcount(storage) - alone
        del t
        if sys.getrefcount(storage) != alone or shared not in (0, 1):
            warnings.warn(f"dtralloc.dtr: this torch ({torch.__version__}) keeps {shared} references to a "
                          "storage's Python object while tensors share it, which the session cannot count: it "
                          "keeps no alias of saved tensors, so an in-place write to a saved tensor your code "
                          "has dropped is not detected. Please report your torch version.",
                          RuntimeWarning, stacklevel=2)
            shared = -1
        _shared_pyrefs = shared
    return _shared_pyrefs


def helpers(device: str) -> dict:
    return {"detached": detached, "run": run, "new_storage": new_storage, "use_count": use_count,
            "shared_pyrefs": shared_storage_pyrefs(),
            "version_error": version_error, "tensor_type": torch.Tensor,
            "device": device, "accessors": _accessors(),
            "next_sequence_nr": getattr(torch._C._autograd, "_get_sequence_nr", None),
            # CUDA: the raw handle of torch's current stream on a device,
            # where the session marks each op's end (op costs, op_timer.h).
            "current_stream": getattr(torch._C, "_cuda_getCurrentRawStream", None)}
