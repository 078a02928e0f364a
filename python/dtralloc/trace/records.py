"""Storage and Op: the two records a trace is made of (see docs/trace-format.md)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Storage:
    """One allocation: a torch StorageImpl seen during the step."""

    nbytes: int
    device: str
    dtype: str
    initial: bool          # alive before the step (parameters, optimizer state, inputs)
    outlives: bool = False  # still alive when the step returned
    producer: int = -1     # index of the op that created it; -1 when initial


@dataclass
class Op:
    """One ATen op call."""

    name: str                                         # e.g. "aten::mm" or "aten::add_.Tensor"
    inputs: list[int] = field(default_factory=list)   # storages read (tensor arguments)
    outputs: list[int] = field(default_factory=list)  # storage of each tensor output, in order
    created: list[int] = field(default_factory=list)  # outputs whose storage this op allocated
    mutated: list[int] = field(default_factory=list)  # storages written in place (schema alias_info)
    aliased: list[int] = field(default_factory=list)  # outputs that are views of an input storage
    random: bool = False                              # torch.Tag.nondeterministic_seeded
    backward: bool = False                            # ran inside autograd's backward pass
    duration_ns: int = 0
    flops: int = 0
    bytes_moved: int = 0
    frees: list[int] = field(default_factory=list)    # storages that died after this op
