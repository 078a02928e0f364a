"""Record a training step's memory traffic at the storage level; save, load.

``trace = dtralloc.trace.record(step_fn)`` runs ``step_fn()`` once under a
TorchDispatchMode and returns a :class:`Trace`: every ATen op in order (backward
ops included) with the storages it reads, creates, aliases and writes, whether
it is random, its duration and a FLOP / bytes-moved estimate; the moment each
storage dies; which storages existed before the step and which outlive it.
That is what a memory replay needs, and what rematerialization needs to
recompute a storage: the op that made it and that op's inputs.

The file format (``trace.save`` / ``load``) is documented in
``docs/trace-format.md``.
"""
from __future__ import annotations

import json
import lzma
from dataclasses import dataclass, field
from typing import Callable, Optional

FORMAT_NAME = "dtralloc-trace"
FORMAT_VERSION = 1


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


@dataclass
class Trace:
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

    def total_duration_ns(self) -> int:
        return sum(op.duration_ns for op in self.ops)

    def summary(self) -> str:
        from ._core import format_bytes

        initial = sum(s.nbytes for s in self.storages if s.initial)
        return (
            f"{self.meta.get('name', 'trace')}: {len(self.ops)} ops "
            f"({sum(o.backward for o in self.ops)} backward, {sum(o.random for o in self.ops)} random), "
            f"{len(self.storages)} storages, initial {format_bytes(initial)}, "
            f"peak live {format_bytes(self.peak_live_bytes())}, "
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
        with lzma.open(path, "wt", encoding="utf-8", preset=6) as f:
            json.dump(_to_document(self), f, separators=(",", ":"))


def load(path: str) -> Trace:
    """Read a trace written by Trace.save (any supported format version)."""
    try:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except lzma.LZMAError as e:
        raise ValueError(f"{path} is not a dtralloc trace (not xz-compressed: {e})") from e
    except EOFError as e:  # lzma's answer to a file cut short
        raise ValueError(f"{path} is truncated (the xz stream ends early: {e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a dtralloc trace (bad JSON: {e})") from e
    try:
        return _from_document(doc, path)
    except (KeyError, IndexError, TypeError) as e:  # right header, damaged body
        raise ValueError(f"{path} is a damaged dtralloc trace ({type(e).__name__}: {e})") from e


# -- the document form ----------------------------------------------------------

def _csr(lists: list[list[int]]) -> dict:
    """List of int lists as offsets + flat values (compresses well)."""
    offsets, values = [0], []
    for item in lists:
        values.extend(item)
        offsets.append(len(values))
    return {"offsets": offsets, "values": values}


def _uncsr(d: dict) -> list[list[int]]:
    o, v = d["offsets"], d["values"]
    return [v[o[i]:o[i + 1]] for i in range(len(o) - 1)]


def _interned(values: list[str]) -> tuple[list[str], list[int]]:
    table: dict[str, int] = {}
    codes = [table.setdefault(v, len(table)) for v in values]
    return list(table), codes


def _to_document(t: Trace) -> dict:
    op_names, name_codes = _interned([o.name for o in t.ops])
    devices, device_codes = _interned([s.device for s in t.storages])
    dtypes, dtype_codes = _interned([s.dtype for s in t.storages])
    flags = [(o.random << 0) | (o.backward << 1) for o in t.ops]
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "meta": t.meta,
        "storages": {
            "nbytes": [s.nbytes for s in t.storages],
            "device": device_codes,
            "devices": devices,
            "dtype": dtype_codes,
            "dtypes": dtypes,
            "initial": [int(s.initial) for s in t.storages],
            "outlives": [int(s.outlives) for s in t.storages],
            "producer": [s.producer for s in t.storages],
        },
        "ops": {
            "names": op_names,
            "name": name_codes,
            "flags": flags,
            "duration_ns": [o.duration_ns for o in t.ops],
            "flops": [o.flops for o in t.ops],
            "bytes_moved": [o.bytes_moved for o in t.ops],
            "inputs": _csr([o.inputs for o in t.ops]),
            "outputs": _csr([o.outputs for o in t.ops]),
            "created": _csr([o.created for o in t.ops]),
            "mutated": _csr([o.mutated for o in t.ops]),
            "aliased": _csr([o.aliased for o in t.ops]),
            "frees": _csr([o.frees for o in t.ops]),
        },
        "frees_before": t.frees_before,
    }


def _from_document(doc: dict, where: str = "trace") -> Trace:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ValueError(f"{where} is not a dtralloc trace (no '{FORMAT_NAME}' header)")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{where} has trace format version {version}; this dtralloc reads version "
            f"{FORMAT_VERSION}. Re-record the trace or upgrade dtralloc."
        )
    s, o = doc["storages"], doc["ops"]
    storages = [
        Storage(nbytes, s["devices"][dev], s["dtypes"][dt], bool(ini), bool(out), prod)
        for nbytes, dev, dt, ini, out, prod in zip(
            s["nbytes"], s["device"], s["dtype"], s["initial"], s["outlives"], s["producer"]
        )
    ]
    columns = {k: _uncsr(o[k]) for k in ("inputs", "outputs", "created", "mutated", "aliased", "frees")}
    ops = [
        Op(
            name=o["names"][code],
            inputs=columns["inputs"][i],
            outputs=columns["outputs"][i],
            created=columns["created"][i],
            mutated=columns["mutated"][i],
            aliased=columns["aliased"][i],
            random=bool(o["flags"][i] & 1),
            backward=bool(o["flags"][i] & 2),
            duration_ns=o["duration_ns"][i],
            flops=o["flops"][i],
            bytes_moved=o["bytes_moved"][i],
            frees=columns["frees"][i],
        )
        for i, code in enumerate(o["name"])
    ]
    return Trace(storages, ops, list(doc.get("frees_before", [])), dict(doc.get("meta", {})))


# -- recording ------------------------------------------------------------------

def record(step_fn: Callable[[], object], name: Optional[str] = None, time_ops: bool = True) -> Trace:
    """Run ``step_fn()`` once and return its trace.

    ``step_fn`` should run one training step (forward, backward, optimizer
    step) of an eager model on any device. Storages alive before the call and
    touched by it are "initial"; storages alive after it "outlive" the step.
    Keep references you want to outlive the step outside ``step_fn`` (its
    return value is held until recording ends, so it outlives the step too).
    """
    from ._recorder import Recorder

    recorder = Recorder(time_ops=time_ops)
    with recorder:
        result = step_fn()
        recorder.flush_frees()
    trace = recorder.finish(name or getattr(step_fn, "__name__", "step"))
    del result
    return trace


# -- torch memory snapshots -------------------------------------------------------

def import_torch_snapshot(snapshot, device: int = 0, name: Optional[str] = None) -> Trace:
    """An allocation-only Trace from a torch memory snapshot.

    ``snapshot`` is the dict from ``torch.cuda.memory._snapshot()`` or the path
    of a pickle written by ``torch.cuda.memory._dump_snapshot``. Each ``alloc``
    event becomes an op creating one storage; ``free_completed`` (or ``free``
    / ``free_requested`` in snapshots without it) frees it. Blocks freed in the
    history but allocated before it began, and blocks still allocated in the
    final segments, become initial storages. Ops carry no compute costs.
    """
    import pickle

    if isinstance(snapshot, (str, bytes)) or hasattr(snapshot, "__fspath__"):
        path = snapshot
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        name = name or str(path)
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        raise ValueError("not a torch memory snapshot: expected a dict with 'device_traces' "
                         "(from torch.cuda.memory._snapshot() or _dump_snapshot)")
    traces = snapshot["device_traces"]
    if device >= len(traces) or not traces[device]:
        have = [i for i, t in enumerate(traces) if t]
        raise ValueError(f"the snapshot has no allocation history for device {device} "
                         f"(devices with history: {have or 'none'}; record with "
                         "torch.cuda.memory._record_memory_history() before the step)")
    events = traces[device]
    actions = {e["action"] for e in events}
    free_action = next(a for a in ("free_completed", "free", "free_requested", None)
                       if a is None or a in actions)
    dev = f"cuda:{device}"
    trace = Trace(meta={"name": name or "torch-snapshot", "source": "torch memory snapshot",
                        "devices": [dev], "durations": "none"})
    live: dict[int, int] = {}

    def new_storage(size: int, initial: bool) -> int:
        trace.storages.append(Storage(int(size), dev, "unknown", initial,
                                      producer=-1 if initial else len(trace.ops)))
        return len(trace.storages) - 1

    for e in events:
        action, addr = e["action"], e.get("addr")
        if action == "alloc":
            sid = new_storage(e["size"], False)
            trace.ops.append(Op(name="snapshot::alloc", outputs=[sid], created=[sid]))
            live[addr] = sid
        elif action == free_action:
            sid = live.pop(addr, None)
            if sid is None:  # allocated before the history began
                sid = new_storage(e["size"], True)
            (trace.ops[-1].frees if trace.ops else trace.frees_before).append(sid)
    known = set(live)
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated" and block["address"] not in known:
                live[block["address"]] = new_storage(block["size"], True)
    for sid in live.values():
        trace.storages[sid].outlives = True
    trace.validate()
    return trace
