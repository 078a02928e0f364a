"""An allocator's event history as the dashboard draws it.

Input: the history as columns (``Pool.history()``, ``snapshot(columns=True)``,
or a torch snapshot's list of event dicts converted by :func:`event_columns`)
plus the segments of the snapshot's final moment. Output: a :class:`History`
with block and segment lifetimes, the largest free block after every event
(computed in C++, ``allocator/history_model.h``), and the compacted address
axis the address x time map uses.

A history that does not start with an empty allocator (a ring that wrapped,
``_record_memory_history`` started mid-run) is completed from the final
segments: the state before the first event is what the end state and the
events imply (:func:`initial_state`).
"""
from __future__ import annotations

import bisect

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .. import _core

ACTION_NAMES: tuple = _core.history_action_names()
ACTION = {name: code for code, name in enumerate(ACTION_NAMES)}
_BLOCK_EVENTS = np.array([ACTION[a] for a in ("alloc", "free_requested", "free_completed", "free")], np.uint8)
_BLOCK_FREES = np.array([ACTION[a] for a in ("free_requested", "free_completed", "free")], np.uint8)
_SEGMENT_EVENTS = np.array([ACTION[a] for a in ("segment_alloc", "segment_free", "segment_map", "segment_unmap")],
                           np.uint8)
# torch places blocks in multiples of 512 bytes (CUDACachingAllocator's
# kMinBlockSize); a torch history records requested sizes only.
ROUND_BYTES = 512

COLUMNS = ("action", "addr", "size", "stream", "time_us", "op", "device_free", "block_size")


def empty_columns() -> dict:
    return {"action": np.zeros(0, np.uint8), "addr": np.zeros(0, np.uint64), "size": np.zeros(0, np.int64),
            "stream": np.zeros(0, np.uint64), "time_us": np.zeros(0, np.int64), "op": np.zeros(0, np.int32),
            "device_free": np.zeros(0, np.int64), "block_size": np.zeros(0, np.int64)}


def _frame_label(frames) -> str:
    """The innermost frame of the user's code: what made the tensor."""
    for f in frames or ():
        filename, name = str(f.get("filename", "")), str(f.get("name", ""))
        if not filename or filename.startswith("<") or "/torch/" in filename or "site-packages" in filename \
                or "CUDACachingAllocator" in filename or name.startswith("c10::") or name.startswith("at::"):
            continue
        return f"{name} ({filename.rsplit('/', 1)[-1]}:{f.get('line', '?')})"
    return ""


def event_columns(events: list) -> tuple[dict, list, np.ndarray]:
    """A torch snapshot's event dicts as columns, plus the "made by" labels of
    the alloc events (from their stack frames, when torch recorded them):
    (columns, label table, label index per event; 0 = none)."""
    n = len(events)
    cols = {"action": np.empty(n, np.uint8), "addr": np.empty(n, np.uint64), "size": np.empty(n, np.int64),
            "stream": np.empty(n, np.uint64), "time_us": np.empty(n, np.int64), "op": np.full(n, -1, np.int32),
            "device_free": np.zeros(n, np.int64), "block_size": np.zeros(n, np.int64)}
    other = ACTION["other"]
    action, addr, size, stream, time_us = ([0] * n for _ in range(5))
    labels, label_of = [""], {"": 0}
    made_by = np.zeros(n, np.uint32)
    for i, e in enumerate(events):
        action[i] = ACTION.get(e.get("action"), other)
        addr[i] = int(e.get("addr", 0)) & 0xFFFFFFFFFFFFFFFF
        size[i] = int(e.get("size", 0))
        stream[i] = int(e.get("stream", 0)) & 0xFFFFFFFFFFFFFFFF
        time_us[i] = int(e.get("time_us", 0))
        frames = e.get("frames")
        if frames and action[i] == 0:
            label = _frame_label(frames)
            made_by[i] = label_of.setdefault(label, len(labels))
            if made_by[i] == len(labels):
                labels.append(label)
        if action[i] == ACTION["oom"]:
            cols["device_free"][i] = int(e.get("device_free", 0))
    cols["action"][:] = action
    cols["addr"][:] = addr
    cols["size"][:] = size
    cols["stream"][:] = stream
    cols["time_us"][:] = time_us
    return cols, labels, made_by


def _first_per_address(action: np.ndarray, addr: np.ndarray, kinds: np.ndarray):
    """(addresses, first event index, action of that event) for events of `kinds`."""
    idx = np.flatnonzero(np.isin(action, kinds))
    if idx.size == 0:
        return np.zeros(0, np.uint64), idx, np.zeros(0, np.uint8)
    uniq, first = np.unique(addr[idx], return_index=True)
    return uniq, idx[first], action[idx[first]]


class _Segments:
    """Address ranges start -> end, with the starts kept sorted for lookups."""

    def __init__(self):
        self.end: dict = {}
        self.starts: list = []

    def add(self, lo: int, hi: int) -> None:
        if lo not in self.end:
            bisect.insort(self.starts, lo)
        self.end[lo] = hi

    def remove(self, lo: int) -> None:
        del self.end[lo]
        del self.starts[bisect.bisect_left(self.starts, lo)]

    def holding(self, a: int):
        """(start, end) of the range holding address `a`, or None."""
        k = bisect.bisect_right(self.starts, a) - 1
        return (self.starts[k], self.end[self.starts[k]]) if k >= 0 and a < self.end[self.starts[k]] else None


def _walk_segments(cols: dict):
    """Replays the segment events: returns (the segments alive after the
    last event; those a release or unmap shows existed before the first, as
    (addr, size, stream)). An unmap inside a known segment cuts it in two
    (dtralloc's unmap_pages, a range of torch's expandable segments)."""
    action, addr, size, stream = cols["action"], cols["addr"], cols["size"], cols["stream"]
    alive = _Segments()
    before = []
    makes = (ACTION["segment_alloc"], ACTION["segment_map"])
    for e in np.flatnonzero(np.isin(action, _SEGMENT_EVENTS)).tolist():
        a, n = int(addr[e]), int(size[e])
        if action[e] in makes:
            alive.add(a, a + n)
            continue
        holder = alive.holding(a)
        if holder is None:  # made before the history began
            before.append((a, n, int(stream[e])))
            continue
        lo, hi = holder
        alive.remove(lo)
        if action[e] == ACTION["segment_unmap"]:
            if lo < a:
                alive.add(lo, a)
            if a + n < hi:
                alive.add(a + n, hi)
    return alive, before


def initial_state(cols: dict, final_segments: list) -> dict:
    """The segments and blocks that existed before the first event.

    An address whose first segment (block) event releases it held a segment
    (block) before the history began; an address with no such event holds
    before what it holds at the end."""
    action, addr, size = cols["action"], cols["addr"], cols["size"]
    blk_addr, blk_first, blk_action = _first_per_address(action, addr, _BLOCK_EVENTS)
    final_blocks = {}
    known, seg_rows = _walk_segments(cols)  # seg_rows: (addr, size, stream)
    blk_rows = []  # (addr, block size, requested, pending)
    for seg in final_segments:
        a = int(seg["address"])
        if not known.holding(a):
            seg_rows.append((a, int(seg["total_size"]), int(seg.get("stream", 0)) & 0xFFFFFFFFFFFFFFFF))
        for b in seg.get("blocks", ()):
            if b.get("state") in ("active_allocated", "active_pending_free"):
                final_blocks[int(b["address"])] = (int(b["size"]), int(b.get("requested_size", b["size"])),
                                                   b["state"] == "active_pending_free")
    touched_blocks = set(blk_addr.tolist())
    for a, (bsize, requested, pending) in final_blocks.items():
        if a not in touched_blocks:
            blk_rows.append((a, bsize, requested, pending))
    for i in np.flatnonzero(np.isin(blk_action, _BLOCK_FREES)):
        e = blk_first[i]
        requested = int(size[e])
        bsize = -(-max(requested, 1) // ROUND_BYTES) * ROUND_BYTES
        pending = action[e] == ACTION["free_completed"]  # its free was requested before the history
        blk_rows.append((int(blk_addr[i]), bsize, requested, bool(pending)))
    seg_rows.sort()
    blk_rows.sort()
    return {
        "initial_segment_addr": np.array([r[0] for r in seg_rows], np.uint64),
        "initial_segment_size": np.array([r[1] for r in seg_rows], np.int64),
        "initial_segment_stream": np.array([r[2] for r in seg_rows], np.uint64),
        "initial_block_addr": np.array([r[0] for r in blk_rows], np.uint64),
        "initial_block_size": np.array([r[1] for r in blk_rows], np.int64),
        "initial_block_requested": np.array([r[2] for r in blk_rows], np.int64),
        "initial_block_pending": np.array([r[3] for r in blk_rows], np.uint8),
    }


@dataclass
class History:
    """One device's history, modelled (see the module docstring)."""
    n: int                          # events
    cols: dict                      # the event columns
    model: dict                     # _core.history_model's output
    ranges: np.ndarray              # (k, 3) uint64: address lo, hi, compact offset
    block_y: np.ndarray             # compact offset of every block lifetime
    segment_y: np.ndarray           # ... and of every segment lifetime
    labels: list = field(default_factory=lambda: [""])   # "made by" strings
    block_label: Optional[np.ndarray] = None             # index into labels per block

    @property
    def compact_bytes(self) -> int:
        return int(self.ranges[-1, 2] + self.ranges[-1, 1] - self.ranges[-1, 0]) if len(self.ranges) else 0

    def oom_events(self) -> np.ndarray:
        return np.flatnonzero(self.cols["action"] == ACTION["oom"])

    def totals_at(self, event: int) -> dict:
        """Exact figures after `event` (-1: before the first), from the
        lifetimes: what the page's readouts must show there."""
        m = self.model
        start, req, done, bsize = m["block_start"], m["block_free_requested"], m["block_free_completed"], \
            m["block_size"]
        alive = (start <= event) & (event < done)
        allocated_mask = alive & (event < req)
        seg_alive = (m["segment_start"] <= event) & (event < m["segment_end"])
        reserved = int(m["segment_size"][seg_alive].sum())
        allocated = int(bsize[allocated_mask].sum())
        pending = int(bsize[alive & ~(event < req)].sum())
        largest = int(m["initial_largest_free"] if event < 0 else m["largest_free"][event])
        return {"reserved": reserved, "allocated": allocated, "pending": pending,
                "requested": int(m["block_requested"][allocated_mask].sum()),
                "free": reserved - allocated - pending, "largest_free": largest,
                "segments": int(seg_alive.sum()), "blocks": int(allocated_mask.sum())}


def _known_block_sizes(cols: dict, final_segments: list) -> None:
    """Torch records requested sizes only; a block allocated in the history
    and still allocated at the end has its placed size in the final
    segments. Fills cols["block_size"] for those allocs (a new array)."""
    action, addr, block_size = cols["action"], cols["addr"], cols["block_size"]
    idx = np.flatnonzero(np.isin(action, _BLOCK_EVENTS))
    if idx.size == 0 or np.all(block_size[action == ACTION["alloc"]] > 0):
        return
    final = {int(b["address"]): int(b["size"]) for seg in final_segments for b in seg.get("blocks", ())
             if b.get("state") in ("active_allocated", "active_pending_free")}
    if not final:
        return
    block_size = cols["block_size"] = block_size.copy()  # the caller's columns stay as they were
    rev = idx[::-1]
    uniq, last_rev = np.unique(addr[rev], return_index=True)
    last = rev[last_rev]  # the last block event of each address
    for e in last[action[last] == ACTION["alloc"]].tolist():
        size = final.get(int(addr[e]))
        if size and block_size[e] == 0:
            block_size[e] = size


def _compact(addrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Address ranges every segment ever covered, merged, with their offset on
    an axis without the gaps between them: (k, 3) rows lo, hi, offset."""
    if addrs.size == 0:
        return np.zeros((0, 3), np.uint64)
    order = np.argsort(addrs, kind="stable")
    lo = addrs[order].astype(np.uint64)
    hi = lo + sizes[order].astype(np.uint64)
    rows = []
    cur_lo, cur_hi = int(lo[0]), int(hi[0])
    for a, b in zip(lo[1:].tolist(), hi[1:].tolist()):
        if a <= cur_hi:
            cur_hi = max(cur_hi, b)
        else:
            rows.append((cur_lo, cur_hi))
            cur_lo, cur_hi = a, b
    rows.append((cur_lo, cur_hi))
    out = np.zeros((len(rows), 3), np.uint64)
    offset = 0
    for i, (a, b) in enumerate(rows):
        out[i] = (a, b, offset)
        offset += b - a
    return out


def compact_offsets(ranges: np.ndarray, addrs: np.ndarray) -> np.ndarray:
    """Offset of each address on the compacted axis (0 outside every range)."""
    if len(ranges) == 0 or addrs.size == 0:
        return np.zeros(addrs.size, np.uint64)
    i = np.searchsorted(ranges[:, 0], addrs, side="right") - 1
    i = np.clip(i, 0, len(ranges) - 1)
    inside = (addrs >= ranges[i, 0]) & (addrs < ranges[i, 1])
    return np.where(inside, ranges[i, 2] + (addrs - ranges[i, 0]), 0).astype(np.uint64)


def build_history(cols: dict, final_segments: list = (), labels: Optional[list] = None,
                  made_by: Optional[np.ndarray] = None, round_bytes: int = ROUND_BYTES) -> History:
    """Model a history (columns as Pool.history() gives them)."""
    cols = {k: np.ascontiguousarray(cols[k]) for k in COLUMNS if k in cols}
    n = int(cols["action"].size)
    for k, v in empty_columns().items():
        if k not in cols:
            cols[k] = np.zeros(n, v.dtype) if k != "op" else np.full(n, -1, np.int32)
    final_segments = list(final_segments)
    init = initial_state(cols, final_segments)
    _known_block_sizes(cols, final_segments)
    model = _core.history_model(cols["action"], cols["addr"], cols["size"], cols["block_size"], cols["stream"],
                                round_bytes=round_bytes, **init)
    ranges = _compact(model["segment_addr"], model["segment_size"])
    history = History(n, cols, model, ranges, compact_offsets(ranges, model["block_addr"]),
                      compact_offsets(ranges, model["segment_addr"]))
    if labels is not None and made_by is not None:
        history.labels = labels
        start = model["block_start"]
        history.block_label = np.where(start >= 0, made_by[np.clip(start, 0, max(n - 1, 0))] if n else 0,
                                       0).astype(np.uint32)
    return history
