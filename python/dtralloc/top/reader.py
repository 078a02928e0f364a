"""Reading the files dtralloc's allocators publish (allocator/publisher.h).

Every process that uses dtralloc publishes, per device, a small file
/dev/shm/dtralloc-<pid>-<device>[-<n>] (/tmp without /dev/shm): the process-wide
allocators always, a Pool after ``Pool.publish()``. Its layout comes from
``_core.publisher_layout()``; this module only follows it.
"""
from __future__ import annotations

import glob
import mmap
import os
import re
import struct
import time
from dataclasses import dataclass, field
from typing import Optional

from .. import _core

LAYOUT = _core.publisher_layout()
DIRS = ("/dev/shm", "/tmp")
_NAME = re.compile(r"dtralloc-(\d+)-(\d+)(?:-(\d+))?$")
_MAGIC = b"DTRALLOC"
_SEQ = 16
# A frame being written is retried; a writer holds it for microseconds.
_READ_ATTEMPTS = 200


@dataclass
class Frame:
    path: str
    label: str
    header: dict                                  # DTRALLOC_PUBLISHED_FIELDS
    samples: list = field(default_factory=list)   # oldest first, dicts of DTRALLOC_PUBLISHED_SAMPLE
    segments: list = field(default_factory=list)  # dicts of DTRALLOC_PUBLISHED_SEGMENT, address order

    def __getitem__(self, key):
        return self.header[key]

    @property
    def pid(self) -> int:
        return self.header["pid"]

    @property
    def device(self) -> int:
        return self.header["device"]

    @property
    def fragmentation(self) -> float:
        free = self.header["free_bytes"]
        return 1.0 - self.header["largest_free_bytes"] / free if free else 0.0

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.header["time_us"] / 1e6)


def published_paths(pid: Optional[int] = None) -> list[str]:
    """Files of processes that are alive, ordered by pid, device, pool."""
    found = []
    for d in DIRS:
        for path in glob.glob(os.path.join(d, "dtralloc-*")):
            m = _NAME.search(os.path.basename(path))
            if not m:
                continue
            p, dev, n = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
            if (pid is None or p == pid) and pid_alive(p):
                found.append((p, dev, n, path))
    return [f[3] for f in sorted(found)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def read_frame(path: str) -> Optional[Frame]:
    """One consistent frame, or None when the file is gone or not ours."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < LAYOUT["file_bytes"]:
                return None
            with mmap.mmap(f.fileno(), LAYOUT["file_bytes"], prot=mmap.PROT_READ) as m:
                if m[:8] != _MAGIC or struct.unpack_from("=I", m, 8)[0] != LAYOUT["version"]:
                    return None
                for _ in range(_READ_ATTEMPTS):
                    seq0 = struct.unpack_from("=Q", m, _SEQ)[0]
                    if seq0 & 1:
                        time.sleep(0.0002)
                        continue
                    data = m[:LAYOUT["file_bytes"]]
                    if struct.unpack_from("=Q", m, _SEQ)[0] == seq0:
                        return _parse(path, data)
    except (FileNotFoundError, PermissionError, ValueError):
        return None
    return None


def _parse(path: str, data: bytes) -> Frame:
    L = LAYOUT
    label = data[L["label_offset"]:L["label_offset"] + L["label_bytes"]].split(b"\0", 1)[0].decode("utf-8", "replace")
    names = L["header_fields"]
    header = dict(zip(names, struct.unpack_from(f"={len(names)}q", data, L["header_fields_offset"])))
    sf, gf = L["sample_fields"], L["segment_fields"]
    frames = min(header["frame"], L["samples"])
    samples = []
    for k in range(frames):  # oldest first
        slot = (header["sample_next"] - frames + k) % L["samples"]
        values = struct.unpack_from(f"={len(sf)}q", data, L["samples_offset"] + 8 * len(sf) * slot)
        samples.append(dict(zip(sf, values)))
    segments = []
    for k in range(header["segment_count"]):
        values = struct.unpack_from(f"={len(gf)}q", data, L["segments_offset"] + 8 * len(gf) * k)
        segments.append(dict(zip(gf, values)))
    return Frame(path, label, header, samples, segments)


def frame_json(frame: Frame, peak: Optional[dict] = None) -> dict:
    """One frame for scripts: every header field, plus derived figures."""
    out = {"path": frame.path, "label": frame.label, **frame.header,
           "fragmentation": frame.fragmentation, "age_s": frame.age_s,
           "segment_table": frame.segments}
    if peak:
        out.update(peak)
    return out
