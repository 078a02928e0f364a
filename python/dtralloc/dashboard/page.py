"""The page: runs -> one self-contained HTML file.

Small things (labels, figures, phases) travel as JSON. Columns travel as
binary blobs: narrowed to the smallest integer type that holds them (sizes
and addresses in 512-byte units where everything is a multiple of 512),
delta-coded where they ascend, byte-shuffled (all first bytes, then all
second bytes: a column of small numbers becomes long runs of zeros) and
gzipped. What the browser can rebuild is not stored: a block's address is
mostly a back-reference (it starts where an earlier block started or ended),
and the (block size, waste) pairs are a table indexed in order of frequency.
The gzip streams travel as text inside <script type="application/octet-stream">
elements, 7 bits per ASCII character (:func:`text7`: 1.18 times the bytes
where base64 takes 4/3). The page decodes them with the browser's own
DecompressionStream. The drawing is hand-written canvas code in
assets/dashboard.js; nothing is fetched.
"""
from __future__ import annotations

import datetime
import gzip
import html
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Optional

import numpy as np

from .history import ACTION, History
from .runs import EVLOG, SERIES, Run

# Blocks, segments and addresses of every allocator here are multiples of
# 512 bytes (kMinBlockSize); in those units a uint32 spans 2 TiB.
UNIT = 512
# zlib level 6: within a few % of level 9 on these columns at a third of the time.
_GZIP_LEVEL = 6
_INT_TYPES = (("u8", np.uint8), ("i8", np.int8), ("u16", np.uint16), ("i16", np.int16),
              ("u32", np.uint32), ("i32", np.int32))


_compressor: Optional[ThreadPoolExecutor] = None


def _compress_pool() -> ThreadPoolExecutor:
    """Worker threads for the columns' compression (zlib lets go of the GIL),
    one set for the process; 4 at most: a page has a few big columns."""
    global _compressor
    if _compressor is None:
        _compressor = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                         thread_name_prefix="dtralloc-dashboard")
    return _compressor


class Blobs:
    """The binary columns of one page. Each column is compressed on a worker
    thread as soon as it is added: the page's build waits for the slowest
    column, not for their sum."""

    def __init__(self):
        self.items: list = []  # futures of the columns' text
        self.raw_bytes = 0

    def add(self, values, delta: bool = False, kind: Optional[str] = None) -> dict:
        """Store an integer (or float) column; returns its reference for the
        JSON: {"b": blob, "t": type, "n": length, "d": delta-coded}; a
        delta-coded integer column stores its steps in the type that holds
        them ("t") and names the type of its values ("a"), which the page
        sums them into: an ascending column of a 16M-event history (op
        stamps, times, event indexes) is then one byte a value, not four,
        for the browser to inflate."""
        a = np.asarray(values)
        if kind is None:
            kind, a = _narrow(a)
        else:
            a = a.astype(dict(_INT_TYPES + (("f64", np.float64),))[kind])
        ref = {"t": kind, "n": int(a.size), "d": int(delta)}
        if delta and a.size:
            if kind == "f64":
                a = np.diff(a, prepend=0.0)
            else:
                ref["t"], a = _narrow(np.diff(a.astype(np.int64), prepend=0))
                ref["a"] = kind
        raw = np.ascontiguousarray(a)
        self.raw_bytes += raw.nbytes
        if raw.itemsize > 1:  # the byte shuffle
            raw = raw.view(np.uint8).reshape(-1, raw.itemsize).T
        self.items.append(_compress_pool().submit(_pack, np.ascontiguousarray(raw)))
        return {"b": len(self.items) - 1, **ref}

    def texts(self) -> list[str]:
        return [f.result() for f in self.items]


def _pack(raw: np.ndarray) -> str:
    return text7(gzip.compress(raw.tobytes(), compresslevel=_GZIP_LEVEL, mtime=0))


# The 7-bit values a <script> element's text cannot hold as themselves: NUL
# (the HTML parser makes it U+FFFD), CR (it becomes LF) and "<" (it could
# end the element); and the escape itself. The page's decoder (dashboard.js,
# text7decode) has the same list.
_TEXT7_ESCAPE = 127
_TEXT7_ESCAPED = (0, 13, 60, _TEXT7_ESCAPE)


def text7(data: bytes) -> str:
    """`data` as ASCII text for a <script> element, 7 bits per character.

    The bytes are read as a stream of 7-bit values (big-endian), each one
    character, except the values the element cannot hold
    (_TEXT7_ESCAPED[k]): those are DEL followed by the digit k. On random
    bytes (a gzip stream) that is 8/7 * (1 + 4/128) = 1.18 of the bytes,
    where base64 takes 4/3. Plain ASCII on purpose: two-byte characters
    (base-122's way, 8/7 exactly) made Chromium's parser keep the page's
    text as UTF-16 and took it 3 s longer to parse 33 MB."""
    b = np.frombuffer(data, np.uint8)
    n = b.size
    if n == 0:
        return ""
    rows = -(-n // 7)
    padded = np.zeros(rows * 7, np.uint8)
    padded[:n] = b
    v = np.zeros(rows, np.uint64)
    for k in range(7):  # 7 bytes = 56 bits = 8 values
        v |= padded[k::7].astype(np.uint64) << np.uint64(8 * (6 - k))
    shifts = np.arange(49, -1, -7, dtype=np.uint64)
    values = ((v[:, None] >> shifts[None, :]) & np.uint64(127)).astype(np.uint8).reshape(-1)
    values = values[:-(-n * 8 // 7)]
    escaped = np.isin(values, _TEXT7_ESCAPED)
    if not escaped.any():
        return values.tobytes().decode("ascii")
    out = np.empty(values.size + int(escaped.sum()), np.uint8)
    at = np.arange(values.size) + np.cumsum(escaped) - escaped  # each value's place, after the escapes before it
    out[at] = values
    out[at[escaped]] = _TEXT7_ESCAPE
    digit = np.zeros(128, np.uint8)
    digit[list(_TEXT7_ESCAPED)] = ord("0") + np.arange(len(_TEXT7_ESCAPED))
    out[at[escaped] + 1] = digit[values[escaped]]
    return out.tobytes().decode("ascii")


def _narrow(a: np.ndarray) -> tuple[str, np.ndarray]:
    """The smallest type that holds `a`; f64 when none does (exact up to 2**53)."""
    if a.dtype.kind == "f":
        return "f64", a.astype(np.float64)
    if a.dtype.kind == "b":
        a = a.astype(np.uint8)
    if a.size == 0:
        return "u8", a.astype(np.uint8)
    lo, hi = int(a.min()), int(a.max())
    for name, t in _INT_TYPES:
        info = np.iinfo(t)
        if info.min <= lo and hi <= info.max:
            return name, a.astype(t)
    return "f64", a.astype(np.float64)


def _factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values, index of each value into them); one value (one
    stream, the common case) without a sort."""
    if values.size == 0 or np.all(values == values[0]):
        return values[:1].copy(), np.zeros(values.size, np.int64)
    return np.unique(values, return_inverse=True)


def _factorize_by_count(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """As _factorize, the commonest value first: the indexes of a skewed
    column are then mostly small, and their high bytes (after the shuffle)
    mostly zero. On 5.3M blocks of random sizes, 12.1 bits a block in gzip
    instead of 14.7."""
    table, idx = _factorize(values)
    if table.size < 2:
        return table, idx
    counts = np.bincount(idx, minlength=table.size)
    order = np.argsort(-counts, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return table[order], rank[idx]


def address_refs(y: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Where each block's address comes from, given the blocks' addresses
    `y` and ends `end` (in start order): 2d when block i starts where block
    i - d started, 2d + 1 when it starts where block i - d ended (the nearest
    such earlier block, d >= 1), 0 when neither (its address travels as
    itself). An allocator places a block where a freed one was or right
    after a live one, so nearly every block has a reference, and a near one:
    on 5.3M blocks of random sizes 12.8 bits a block in gzip instead of 24.2
    for the addresses themselves."""
    n = y.size
    if n == 0:
        return np.zeros(0, np.int64)
    # Entry 3i asks for block i's address; 3i + 1 and 3i + 2 offer its start
    # and end to the blocks after it. Sorted by address, then by entry, each
    # address's group lists its entries in block order, so the nearest
    # earlier offer is the running maximum of offer positions in the group.
    span = 3 * n
    keys = np.empty(span, np.uint64)
    keys[0::3], keys[1::3], keys[2::3] = y, y, end
    if int(keys.max()) < (1 << 64) // span:
        # (address, entry) as one integer: a plain sort, half the time of a
        # stable argsort of the addresses.
        keys *= np.uint64(span)
        keys += np.arange(span, dtype=np.uint64)
        keys.sort()
        order = (keys % np.uint64(span)).astype(np.int64)
        k = keys // np.uint64(span)
    else:
        order = np.argsort(keys, kind="stable")
        k = keys[order]
    new_group = np.r_[True, k[1:] != k[:-1]]
    base = (np.cumsum(new_group) - 1) * np.int64(span + 1)  # running maxima never cross a group
    offer = np.where(order % 3 != 0, order + base, base - 1)
    nearest = np.maximum.accumulate(offer) - base  # -1: no offer yet in the group
    asks = order % 3 == 0
    i, j = order[asks] // 3, nearest[asks]
    out = np.zeros(n, np.int64)
    found = j >= 0
    out[i[found]] = 2 * (i[found] - j[found] // 3) + (j[found] % 3 - 1)
    return out


def _add_runs(blobs: Blobs, values: np.ndarray) -> dict:
    """A per-event column that seldom changes (the largest free block, op
    stamps, times) as the events where it changes and its values from there
    on: {"runs": {"at": ..., "v": ..., "t": type}, "n": length}; the page
    expands it. Dense (delta-coded) when it changes at more than a quarter
    of the events. What it saves is the browser's time, not the page's
    bytes: gzip packs a column of zero steps well, but the page inflates
    every step (16M events of largest-free steps: 64 MB, 0.7 s)."""
    v = np.asarray(values)
    if v.size == 0:
        return blobs.add(v, delta=True)
    at = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    if at.size * 4 > v.size:
        return blobs.add(v, delta=True)
    return {"runs": {"at": blobs.add(at, delta=True), "v": blobs.add(v[at], delta=True), "t": _narrow(v)[0]},
            "n": int(v.size)}


def _units(values: np.ndarray) -> tuple[np.ndarray, int]:
    """`values` in 512-byte units when all are multiples of 512, else bytes."""
    v = np.asarray(values).astype(np.int64)
    if v.size == 0 or not np.any(v % UNIT):
        return v // UNIT, UNIT
    return v, 1


def _history_payload(h: History, blobs: Blobs, event_x: Optional[np.ndarray]) -> dict:
    m = h.model
    n = h.n
    start, req, done = m["block_start"], m["block_free_requested"], m["block_free_completed"]
    y = h.block_y.astype(np.int64)
    size = m["block_size"]
    unit = UNIT if not (np.any(y % UNIT) or np.any(size % UNIT) or np.any(h.segment_y.astype(np.int64) % UNIT)
                        or np.any(m["segment_size"] % UNIT)) else 1
    streams, stream_idx = _factorize(np.concatenate([m["block_stream"], m["segment_stream"]]))
    nb = start.size
    # (block size, requested size) pairs repeat (a training step asks for the
    # same sizes again and again): a table of the distinct pairs and an index.
    waste = size - m["block_requested"]
    if size.size and (int(waste.min()) < 0 or int(waste.max()) >= 1 << 32 or int(size.max() // unit) >= 1 << 31):
        raise ValueError("dtralloc.dashboard: a block larger than 1 TiB or smaller than its request")
    keys, kind_idx = _factorize_by_count((size // unit) << 32 | waste)
    kinds = np.stack([keys >> 32, keys & 0xFFFFFFFF], axis=1)
    refs = address_refs(y // unit, (y + size) // unit)
    blocks = {
        "start": blobs.add(start, delta=True),
        "req": blobs.add(req - start),
        "done": blobs.add(done - req),
        "y_ref": blobs.add(refs),
        "y_raw": blobs.add(y[refs == 0] // unit),
        "kind": blobs.add(kind_idx.reshape(-1)),
        "kind_size": blobs.add(kinds[:, 0] if len(kinds) else kinds.reshape(-1)),
        "kind_waste": blobs.add(kinds[:, 1] if len(kinds) else kinds.reshape(-1)),
        "stream": blobs.add(stream_idx[:nb]),
    }
    if h.block_label is not None and len(h.labels) > 1:
        blocks["label"] = blobs.add(h.block_label)
    segments = {
        "start": blobs.add(m["segment_start"]),
        "end": blobs.add(m["segment_end"]),
        "y": blobs.add(h.segment_y.astype(np.int64) // unit),
        "size": blobs.add(m["segment_size"] // unit),
        "stream": blobs.add(stream_idx[nb:]),
    }
    largest, lunit = _units(m["largest_free"])
    out = {
        "n": n, "unit": unit, "blocks": blocks, "segments": segments,
        "largest": _add_runs(blobs, largest), "largest_unit": lunit,
        "initial_largest": int(m["initial_largest_free"]),
        "ranges": [[hex(int(lo)), hex(int(hi)), int(off) // unit] for lo, hi, off in h.ranges.tolist()],
        "compact": h.compact_bytes // unit,
        "streams": [hex(int(s)) for s in streams.tolist()],
        "labels": h.labels if h.block_label is not None else [],
        "oom": [[int(e), int(h.cols["size"][e]), int(h.cols["device_free"][e])] for e in h.oom_events()[:10000]],
        "anomalies": int(m["anomalies"]),
    }
    if n and np.any(h.cols["time_us"]):
        t = h.cols["time_us"].astype(np.int64)
        out["t0"] = int(t[0])
        out["time"] = _add_runs(blobs, t - t[0])
    if n and np.any(h.cols["op"] >= 0):
        out["op"] = _add_runs(blobs, h.cols["op"])
    if event_x is not None:
        out["x_event"] = blobs.add(event_x, delta=True)
    return out


def _run_payload(run: Run, blobs: Blobs) -> dict:
    out = {
        "label": run.label, "kind": run.kind, "x_kind": run.x_kind, "n_x": run.n_x, "domain": run.domain,
        "figures": run.figures, "phases": [list(p) for p in run.phases], "notes": run.notes,
    }
    if run.series:
        out["series"] = {k: blobs.add(run.series[k]) for k in SERIES}
    if run.op_names is not None:
        table, idx = np.unique(np.array(run.op_names, dtype=object).astype(str), return_inverse=True)
        out["op_names"] = {"table": table.tolist(), "idx": blobs.add(idx)}
    if run.evlog is not None and len(run.evlog["op"]):
        ev = run.evlog
        out["evlog"] = {k: blobs.add(np.asarray(ev[k], np.float64) if k == "score" else
                                     np.asarray(ev[k]).astype(np.int64), delta=(k == "op"))
                        for k in EVLOG}
    if run.history is not None:
        out["history"] = _history_payload(run.history, blobs, run.x_event)
    return out


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def build_page(runs: list[Run], title: str, sweep: Optional[dict] = None, source: str = "") -> tuple[str, dict]:
    """The HTML of the page and a few facts about it (raw and page bytes)."""
    from .._version import __version__

    blobs = Blobs()
    meta = {
        "title": title, "source": source, "version": __version__,
        "generated": datetime.datetime.now().isoformat(timespec="seconds"),
        "runs": [_run_payload(r, blobs) for r in runs],
        "sweep": sweep or {},
        "actions": list(ACTION),
    }
    meta_json = json.dumps(meta, separators=(",", ":")).replace("</", "<\\/")
    parts = [f'<script type="application/octet-stream" id="dtralloc-blob-{i}">{b}</script>'
             for i, b in enumerate(blobs.texts())]
    fill = {"TITLE": html.escape(title), "CSS": _asset("dashboard.css"), "RUNS_TABLE": _runs_table(runs),
            "META": meta_json, "BLOBS": "\n".join(parts), "JS": _asset("dashboard.js")}
    # One pass, so that nothing inserted (a label, the script) is read as a placeholder.
    page = re.sub(r"\{\{([A-Z_]+)\}\}", lambda m: fill[m.group(1)], _asset("page.html"))
    return page, {"raw_bytes": blobs.raw_bytes, "blobs": len(blobs.items)}


def _attr(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    return html.escape(str(v), quote=True)


# The machine-readable figures: one element per run, attributes named as in
# dtralloc.replay's result ("none" where the result holds None).
DATA_ATTRIBUTES = (("data-policy", "policy"), ("data-budget-bytes", "budget_bytes"),
                   ("data-peak-reserved-bytes", "peak_reserved_bytes"),
                   ("data-peak-allocated-bytes", "peak_allocated_bytes"),
                   ("data-evictions", "evictions"), ("data-remats", "remats"),
                   ("data-compute-overhead", "compute_overhead"), ("data-feasible", "feasible"),
                   ("data-ooms", "ooms"))


def _runs_table(runs: list[Run]) -> str:
    """Rows written by Python (not by the script): scripts and tests read the
    figures even without running the page's code."""
    rows = []
    for i, r in enumerate(runs):
        attrs = " ".join(f'{name}="{_attr(r.figures.get(key))}"' for name, key in DATA_ATTRIBUTES)
        rows.append(f'<tr class="run-row" data-run="{i}" data-kind="{r.kind}" {attrs}>'
                    f'<td class="run-label">{html.escape(r.label)}</td></tr>')
    return "\n".join(rows)
