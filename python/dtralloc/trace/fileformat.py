"""The trace file: xz-compressed columnar JSON (documented in docs/trace-format.md).

This module is the one place that knows the document's layout. It reads and
writes the parts of a trace (storages, ops, frees before the first op, meta);
:class:`~dtralloc.trace.model.Trace` wraps them, so this module needs only the
records and the model can call it without an import circle.
"""
from __future__ import annotations

import json
import lzma

from .records import Op, Storage

FORMAT_NAME = "dtralloc-trace"
FORMAT_VERSION = 1

Parts = tuple  # (storages: list[Storage], ops: list[Op], frees_before: list[int], meta: dict)


def write(trace, path: str) -> None:
    """Write ``trace`` (anything with storages, ops, frees_before and meta) to ``path``."""
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as f:
        json.dump(_to_document(trace), f, separators=(",", ":"))


def read(path: str) -> Parts:
    """The parts of the trace in ``path`` (any supported format version);
    ValueError naming what is wrong with a file that is not one."""
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


def _to_document(t) -> dict:
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


def _from_document(doc: dict, where: str = "trace") -> Parts:
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
    return storages, ops, list(doc.get("frees_before", [])), dict(doc.get("meta", {}))
