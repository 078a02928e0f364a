"""Record one training step of each zoo model into python/dtralloc/traces/.

    python bench/record_zoo.py                 # every bundled trace: each model at GPU
                                               # scale, and the compact ones
    python bench/record_zoo.py gpt2 mlp        # some models, at GPU scale
    python bench/record_zoo.py vit --compact   # vit-compact.dtrace (COMPACT_SIZES, 70-150 MiB)
    python bench/record_zoo.py --small         # tiny sizes (tests, smoke runs)
    python bench/record_zoo.py gpt2 --size batch=4 --out /tmp/traces

Each model runs a warm-up step first (so optimizer state exists and lazy
initialisation is done, as in any step after the first), then one recorded step.
With several models, each is recorded in its own child process, one after the
other, so the peak RSS printed is that model's own.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

from dtralloc.zoo import COMPACT_SIZES, COMPACT_SUFFIX, MODELS
from dtralloc.zoo import record_model as record_zoo_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED_DIR = os.path.join(REPO, "python", "dtralloc", "traces")
SMALL_DIR = os.path.join(tempfile.gettempdir(), "dtralloc-zoo-small")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _progress(name: str, t0: float, message: str) -> None:
    print(f"[{name} {time.perf_counter() - t0:7.1f}s] {message}", flush=True)


def record_model(name: str, sizes: dict, small: bool, out_dir: str, compact: bool = False):
    """Build, warm up, record and save one model; return (trace, path)."""
    from dtralloc._core import format_bytes

    t0 = time.perf_counter()
    trace = record_zoo_model(name, small=small, compact=compact, sizes=sizes, echo=lambda message: _progress(
        name, t0, f"{message}, peak RSS {format_bytes(peak_rss_bytes())}"))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{trace.meta['name']}.dtrace")
    trace.save(path)
    _progress(name, t0, f"wrote {path} ({format_bytes(os.path.getsize(path))})")
    print(trace.summary(), flush=True)
    return trace, path


def _parse_sizes(items: list[str]) -> dict:
    sizes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--size wants key=value, got {item!r}")
        sizes[key] = int(value) if value.lstrip("-").isdigit() else value
    return sizes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help=f"models to record (default: all of {', '.join(MODELS)}, "
                        f"and with no scale given, the compact ones too)")
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--small", action="store_true", help="tiny sizes of the same architectures")
    scale.add_argument("--compact", action="store_true",
                       help=f"COMPACT_SIZES, 70-150 MiB a step ({', '.join(COMPACT_SIZES)})")
    parser.add_argument("--size", action="append", default=[], metavar="KEY=VALUE",
                        help="override a builder keyword, e.g. batch=4 (repeatable)")
    parser.add_argument("--out", help=f"output folder (default {BUNDLED_DIR}, or {SMALL_DIR} with --small)")
    args = parser.parse_args(argv)

    names = args.models or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; available: {', '.join(MODELS)}")
    if args.compact and any(n not in COMPACT_SIZES for n in names):
        parser.error(f"only {', '.join(COMPACT_SIZES)} have a compact size")
    out_dir = args.out or (SMALL_DIR if args.small else BUNDLED_DIR)
    # (model, scale flag) per recording; everything bundled when nothing is named.
    flag = "--small" if args.small else "--compact" if args.compact else ""
    jobs = [(n, flag) for n in names]
    if not args.models and not flag:
        jobs += [(n, "--compact") for n in COMPACT_SIZES]

    if len(jobs) > 1:  # one child per recording: a clean heap and its own peak RSS
        failed = []
        for name, job_flag in jobs:
            cmd = [sys.executable, os.path.abspath(__file__), name, "--out", out_dir]
            cmd += [job_flag] * bool(job_flag) + [f"--size={s}" for s in args.size]
            if subprocess.call(cmd) != 0:
                failed.append(name + (COMPACT_SUFFIX if job_flag == "--compact" else ""))
        if failed:
            print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1 if failed else 0

    name = names[0]
    t0 = time.perf_counter()
    record_model(name, _parse_sizes(args.size), args.small, out_dir, compact=args.compact)
    print(f"[{name}] total {time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_bytes() / 2**30:.2f} GiB",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
