"""What the live driver must know about an ATen op, worked out once per overload.

Which arguments it writes (its schema's ``(a!)``, plus the legacy batch norms'
undeclared running statistics), whether it is random
(``Tag.nondeterministic_seeded``), whether its writes replace the whole
storage without reading it (``fill_``, ``copy_``, ``out=`` ...), and whether
its outputs can be recomputed at all (``OpInfo.pin``). The numbers mirror
``OpFlag`` and ``DTRALLOC_PIN_REASONS`` in allocator/bindings/live_session.h.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.autograd.graph

# OpFlag (live_session.h)
RANDOM = 1
OVERWRITES = 2
SCRATCH_WRITES = 4
GRAD_ENABLED = 8
VERSIONS_BUMPED = 16

# PinReason (live_session.h), in order
PIN_NONE, PIN_EXTERNAL, PIN_UNWRITTEN, PIN_EXPORTED, PIN_COLLECTIVE, PIN_PYTHON_DATA, PIN_SIDE_EFFECTS, \
    PIN_NONDETERMINISTIC, PIN_FOREIGN, PIN_RESIZED, PIN_OPAQUE = range(11)

_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)
_BITWISE = getattr(torch.Tag, "nondeterministic_bitwise", None)

# torch.tensor / as_tensor / from_numpy: the data come from Python.
_PYTHON_DATA = {"aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift"}
# Uninitialized memory: recomputing it gives other garbage, so it is pinned
# until an op writes all of it (then that op's output is recomputable).
_UNWRITTEN = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
              "aten::new_empty_strided", "aten::empty_permuted"}
# Ops whose writes do not read the old contents (when they cover the storage).
_OVERWRITING = {"aten::fill_", "aten::zero_", "aten::copy_", "aten::normal_", "aten::uniform_",
                "aten::bernoulli_", "aten::random_", "aten::exponential_", "aten::geometric_",
                "aten::log_normal_", "aten::cauchy_"}
# Ops that write arguments besides making outputs, whose outputs do not read
# what they write: batch norm's running statistics. Their outputs are
# recomputed with scratch copies of those arguments, so the real statistics
# are updated once. Any other op that writes and makes outputs pins them.
_SCRATCH = {"aten::native_batch_norm", "aten::_native_batch_norm_legit", "aten::cudnn_batch_norm",
            "aten::miopen_batch_norm", "aten::_batch_norm_with_update"}
# Legacy batch norms update running_mean / running_var (arguments 3 and 4)
# when `training` (argument 5) is set, without an (a!) in their schemas.
_UNDECLARED_RUNNING_STATS = {"aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"}
# Ops that rebind a tensor to other memory: its storage is pinned afterwards.
_REBINDING = {"aten::set_", "aten::resize_", "aten::resize_as_", "aten::_resize_output_"}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"}

# How a foreach op's outputs depend on its list arguments (OpInfo.per_element).
# NONE: each output reads every input. ELEMENTWISE: output i (or the i-th
# tensor it writes) reads element i of each Tensor[] and Scalar[] argument and
# every single tensor argument, and the op run on those elements alone gives
# it bit for bit (torch's CPU kernels loop over the tensors; on CUDA the
# session checks per call that one element takes the kernel the whole list
# took: LiveSession::elements_of). REDUCTION: the same, for a per-tensor
# reduction (_foreach_norm, _foreach_max): split on CPU only, where it is the
# same loop; torch's CUDA kernel sizes its partial sums by the whole list.
PER_ELEMENT_NONE, PER_ELEMENT_ELEMENTWISE, PER_ELEMENT_REDUCTION = range(3)
_FOREACH_REDUCTIONS = {"aten::_foreach_norm", "aten::_foreach_max"}


class OpInfo(NamedTuple):
    fast: bool                    # nothing to decide per call: record(flags, pin) as they are
    view: bool                    # fast, and every output aliases an input: nothing to record
    flags: int
    pin: int
    write_pos: tuple              # positional indices of written arguments
    write_kw: tuple               # their names, for keyword passing
    undeclared_stats: bool        # legacy batch norm: 3 and 4 written when argument 5 is true
    dropout_pos: Optional[int]    # random only when this argument (dropout_p) is nonzero
    generator_pos: Optional[int]  # the `generator` argument
    overwrites: bool              # writes replace the storage without reading it, if they cover it
    bitwise_nondeterministic: bool
    rebinds: bool
    per_element: int              # PER_ELEMENT_*: a foreach op's output i reads element i of its lists
    bumps_versions: bool          # the session bumps the version counters of what it writes (below)


def _name(func) -> str:
    return func._schema.name


def classify(func) -> OpInfo:
    schema = func._schema
    name = schema.name
    args = schema.arguments
    write_pos = tuple(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
    write_kw = tuple(args[i].name for i in write_pos)
    undeclared = name in _UNDECLARED_RUNNING_STATS
    tags = func.tags
    random = _SEEDED is not None and _SEEDED in tags
    dropout_pos = next((i for i, a in enumerate(args) if a.name == "dropout_p"), None) if random else None
    generator_pos = next((i for i, a in enumerate(args) if a.name == "generator"), None)
    pin = PIN_NONE
    flags = RANDOM if random else 0
    namespace = name.split("::", 1)[0]
    if name in _PYTHON_DATA:
        pin = PIN_PYTHON_DATA
    elif name in _UNWRITTEN:
        pin = PIN_UNWRITTEN
    elif namespace in _COLLECTIVE_NAMESPACES:
        pin = PIN_COLLECTIVE
    elif (write_pos or undeclared) and name in _SCRATCH:
        flags |= SCRATCH_WRITES
    elif write_pos:
        pin = PIN_SIDE_EFFECTS  # applies only to outputs it makes besides what it writes
    overwrites = bool(write_pos) and (name in _OVERWRITING or func._overloadname.startswith("out")
                                      or all(args[i].name == "out" for i in write_pos))
    bitwise = _BITWISE is not None and _BITWISE in tags
    rebinds = name in _REBINDING
    fast = not (write_pos or undeclared or random or bitwise or rebinds)
    # t, detach, expand, view, select, split...: no storage made or written. A
    # pinned alias (lift_fresh: Python data) is still recorded, for its pin,
    # and so is a composite op: its schema says alias, but reached as itself
    # (under inference_mode the mode sees contiguous, reshape, to) it may copy.
    view = (fast and pin == PIN_NONE and bool(schema.returns)
            and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
            and not func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd))
    # An in-place foreach op has no ADInplaceOrView kernel to bump its tensors'
    # version counters: on CPU (and on CUDA where the fused kernel does not
    # apply) torch's kernel runs the per-tensor in-place op for each element,
    # whose ADInplaceOrView kernel bumps it; CUDA's fused kernels bump them
    # explicitly. Under a dispatch mode those inner ops run below
    # ADInplaceOrView and bump nothing, so autograd would not see that the
    # op wrote them (optimizer.step() between a forward and its backward).
    # The session bumps each written tensor once, where the call did not.
    bumps = bool(write_pos) and name.startswith("aten::_foreach_") and not func.has_kernel_for_dispatch_key(
        torch._C.DispatchKey.ADInplaceOrView)
    return OpInfo(fast, view, flags, pin, write_pos, write_kw, undeclared, dropout_pos, generator_pos, overwrites,
                  bitwise, rebinds, _per_element(name, args), bumps)


def bump_versions(writes, before: int) -> bool:
    """After an op of OpInfo.bumps_versions wrote `writes` (a tuple of
    tensors; `before`: the first one's version before the call): bump each
    one's version counter where the call did not. Returns whether it did."""
    if not writes or writes[0]._version != before:
        return False
    torch.autograd.graph.increment_version(writes)
    return True


def _per_element(name: str, args) -> int:
    if not name.startswith("aten::_foreach_"):
        return PER_ELEMENT_NONE
    if not any(isinstance(a.type, torch.ListType) and a.type.getElementType().isSubtypeOf(torch.TensorType.get())
               for a in args):
        return PER_ELEMENT_NONE
    # addcmul/addcdiv's `scalars` tensor holds one scalar per element: the
    # split would have to slice it. Kept whole.
    if any(a.name == "scalars" and not isinstance(a.type, torch.ListType) for a in args):
        return PER_ELEMENT_NONE
    return PER_ELEMENT_REDUCTION if name in _FOREACH_REDUCTIONS else PER_ELEMENT_ELEMENTWISE


def argument(info_pos: int, name: str, args, kwargs):
    if info_pos < len(args):
        return args[info_pos]
    return kwargs.get(name)


def written(func, info: OpInfo, args, kwargs) -> tuple:
    """The tensors the op writes, for this call."""
    out = []
    for i, name in zip(info.write_pos, info.write_kw):  # names from the OpInfo: reading _schema per call cost ~5 µs
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    if info.undeclared_stats and argument(5, "training", args, kwargs):
        for i, n in ((3, "running_mean"), (4, "running_var")):
            value = argument(i, n, args, kwargs)
            if isinstance(value, torch.Tensor):
                out.append(value)
    return tuple(out)


def covers_storage(t: torch.Tensor) -> bool:
    """True when writing `t` writes every byte of its storage (never for a
    tensor without a strided storage: sparse, mkldnn)."""
    return (t.layout == torch.strided and not t.is_mkldnn and t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def generator_for(func, info: OpInfo, args, kwargs) -> Optional[torch.Generator]:
    """The generator a random op draws from: its `generator` argument, else
    the default generator of the device it runs on."""
    if info.generator_pos is not None:
        gen = argument(info.generator_pos, "generator", args, kwargs)
        if gen is not None:
            return gen
    device = None
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            device = a.device
            break
    if device is None:
        d = kwargs.get("device")
        device = torch.device(d) if d is not None else torch.get_default_device()
    return default_generator(device)


def default_generator(device: torch.device) -> Optional[torch.Generator]:
    """The default generator of `device` (None for a device whose generator
    the session cannot restore). The C path asks it for the device of a
    random op's first tensor argument (LiveSession::generator_of)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    if device.type == "cpu":
        return torch.default_generator
    return None
