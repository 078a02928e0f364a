"""Torch memory snapshots as traces: what torch's allocator history can tell a replay."""
from __future__ import annotations

import pickle
from typing import Optional

from .model import Trace
from .records import Op, Storage


def import_torch_snapshot(snapshot, device: int = 0, name: Optional[str] = None) -> Trace:
    """An allocation-only Trace from a torch memory snapshot.

    ``snapshot`` is the dict from ``torch.cuda.memory._snapshot()`` or the path
    of a pickle written by ``torch.cuda.memory._dump_snapshot``. Each ``alloc``
    event becomes an op creating one storage; ``free_completed`` (or ``free``
    / ``free_requested`` in snapshots without it) frees it. Blocks freed in the
    history but allocated before it began, and blocks still allocated in the
    final segments, become initial storages. Ops carry no compute costs.
    """
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
