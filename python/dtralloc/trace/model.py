"""A trace: one training step's memory traffic at the storage level, and its queries.

A :class:`Trace` holds every ATen op of the step in order (backward ops
included) with the storages it reads, creates, aliases and writes, whether it
is random, its duration and a FLOP / bytes-moved estimate; the moment each
storage dies; which storages existed before the step and which outlive it.
That is what a memory replay needs, and what rematerialization needs to
recompute a storage: the op that made it and that op's inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .. import _core
from . import fileformat
from .records import Op, Storage


@dataclass
class Trace:
    """One recorded step; ``save`` writes it, :func:`load` reads it back."""

    storages: list[Storage] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    frees_before: list[int] = field(default_factory=list)  # died before the first op
    meta: dict = field(default_factory=dict)

    # -- queries -------------------------------------------------------------
    def initial_storages(self) -> list[int]:
        return [i for i, s in enumerate(self.storages) if s.initial]

    def live_bytes_timeline(self) -> list[int]:
        """Bytes of live storages after each op (initial ones included)."""
        live = sum(s.nbytes for s in self.storages if s.initial)
        live -= sum(self.storages[i].nbytes for i in self.frees_before)
        out = []
        for op in self.ops:
            live += sum(self.storages[i].nbytes for i in op.created)
            out.append(live)
            live -= sum(self.storages[i].nbytes for i in op.frees)
        return out

    def peak_live_bytes(self) -> int:
        """Peak of live storage bytes, counted right after each op's outputs."""
        timeline = self.live_bytes_timeline()
        start = sum(s.nbytes for s in self.storages if s.initial)
        return max(timeline + [start])

    def session_view(self) -> "Trace":
        """This step as a CPU ``dtr(device="cpu")`` session's mirror pool sees
        it: storages alive before the step (parameters, optimizer state, the
        batch) were made outside the session, take no memory there and are
        pinned (docs/live.md), so here they keep their ids and lose their
        bytes. Replaying the result at a budget in bytes is the replay of that
        session's budget; the full trace counts them, as a GPU pool does."""
        storages = [replace(s, nbytes=0) if s.initial else s for s in self.storages]
        return Trace(storages, self.ops, self.frees_before, {**self.meta, "view": "session"})

    def total_duration_ns(self) -> int:
        return sum(op.duration_ns for op in self.ops)

    def summary(self) -> str:
        initial = sum(s.nbytes for s in self.storages if s.initial)
        return (
            f"{self.meta.get('name', 'trace')}: {len(self.ops)} ops "
            f"({sum(o.backward for o in self.ops)} backward, {sum(o.random for o in self.ops)} random), "
            f"{len(self.storages)} storages, initial {_core.format_bytes(initial)}, "
            f"peak live {_core.format_bytes(self.peak_live_bytes())}, "
            f"{self.total_duration_ns() / 1e6:.1f} ms recorded"
        )

    def validate(self) -> None:
        """Raise ValueError if the trace is not self-consistent."""
        n = len(self.storages)
        alive = [s.initial for s in self.storages]
        born = [s.initial for s in self.storages]

        def kill(sid: int, where: str) -> None:
            if not 0 <= sid < n:
                raise ValueError(f"{where}: storage id {sid} out of range")
            if not alive[sid]:
                raise ValueError(f"{where}: storage {sid} dies while not alive")
            alive[sid] = False

        for sid in self.frees_before:
            kill(sid, "frees_before")
        for i, op in enumerate(self.ops):
            for sid in op.inputs + op.outputs + op.mutated + op.created:
                if not 0 <= sid < n:
                    raise ValueError(f"op {i} ({op.name}): storage id {sid} out of range")
            for sid in op.created:
                if born[sid]:
                    raise ValueError(f"op {i} ({op.name}): storage {sid} created twice")
                if self.storages[sid].producer != i:
                    raise ValueError(f"op {i} ({op.name}): storage {sid} names another producer")
                born[sid] = alive[sid] = True
            for sid in op.inputs:
                if not alive[sid]:
                    raise ValueError(f"op {i} ({op.name}) reads dead storage {sid}")
            for sid in op.frees:
                kill(sid, f"op {i} ({op.name})")
        for sid, s in enumerate(self.storages):
            if s.outlives != alive[sid]:
                raise ValueError(f"storage {sid}: outlives={s.outlives} but the trace says alive={alive[sid]}")

    # -- files ---------------------------------------------------------------
    def save(self, path: str) -> None:
        """Write the trace (xz-compressed JSON, columnar; docs/trace-format.md)."""
        fileformat.write(self, path)


def load(path: str) -> Trace:
    """Read a trace written by Trace.save (any supported format version)."""
    return Trace(*fileformat.read(path))
