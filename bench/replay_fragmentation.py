"""Fragmentation of real training steps under dtralloc's pool, by replay.

For every bundled trace (python/dtralloc/traces), replay the step through the
pool on the virtual backend under the defaults and under a few DTRALLOC_CONF
variants, side by side: peak reserved / peak allocated and fragmentation.

On a GPU machine it also runs each zoo model's step under torch's native
allocator, reads torch.cuda.max_memory_reserved(), records the same step on
the GPU and replays it, so replayed and real peaks can be compared.

    python bench/replay_fragmentation.py [--traces NAME ...] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time

VARIANTS = [
    "",
    "max_split_size_mb:64",
    "roundup_power2_divisions:4",
    "max_split_size_mb:64,roundup_power2_divisions:4",
]

GPU_RUN = textwrap.dedent(
    """
    import sys, torch, dtralloc
    from dtralloc.zoo import MODELS
    torch.set_default_device("cuda")           # the zoo builds its models and batches on the default device
    w = MODELS[sys.argv[1]]()
    w.step()                                   # warm-up: optimizer state exists
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    w.step(); torch.cuda.synchronize()
    native_reserved = torch.cuda.max_memory_reserved()
    native_allocated = torch.cuda.max_memory_allocated()
    trace = dtralloc.trace.record(w.step, name=sys.argv[1])
    r = dtralloc.replay(trace)
    print(native_reserved, native_allocated, r.peak_reserved_bytes, r.peak_allocated_bytes)
    """
)


def replay_table(names):
    import dtralloc
    from dtralloc.replay import format_results
    from dtralloc.traces import list_bundled, load_bundled

    names = names or list_bundled()
    results = []
    for i, name in enumerate(names, 1):
        trace = load_bundled(name)
        for conf in VARIANTS:
            t0 = time.perf_counter()
            results.append(dtralloc.replay(trace, conf=conf))
            print(f"[{i}/{len(names)}] {name:<10} {conf or '(defaults)':<48} "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return format_results(results)


def gpu_table(names) -> str:
    try:
        import torch
    except ImportError:
        return "GPU: torch not installed, skipped."
    if not torch.cuda.is_available():
        return "GPU: no CUDA device visible to torch, skipped (replay figures above are CPU-recorded traces)."
    from dtralloc._core import format_bytes as fb

    lines = [f"GPU ({torch.cuda.get_device_name()}): native allocator vs. replay of the same step recorded there",
             f"{'model':<10}{'native reserved':>17}{'native alloc':>14}{'replay reserved':>17}"
             f"{'replay alloc':>14}{'replay/native reserved':>24}"]
    from dtralloc.traces import list_bundled

    for name in names or list_bundled():
        out = subprocess.run([sys.executable, "-c", GPU_RUN, name], capture_output=True, text=True)
        if out.returncode != 0:
            lines.append(f"{name:<10} failed: {out.stderr.strip().splitlines()[-1] if out.stderr else '?'}")
            continue
        nr, na, rr, ra = (int(v) for v in out.stdout.split()[-4:])
        if nr == 0:  # the step allocated nothing on the GPU: no ratio to give
            lines.append(f"{name:<10} failed: torch's allocator reserved nothing on the GPU during the step")
            continue
        lines.append(f"{name:<10}{fb(nr):>17}{fb(na):>14}{fb(rr):>17}{fb(ra):>14}{rr / nr:>24.3f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="*", help="bundled trace names (default: all)")
    parser.add_argument("--out", help="also write the report (markdown) here")
    args = parser.parse_args()
    command = "python bench/replay_fragmentation.py" + (
        " --traces " + " ".join(args.traces) if args.traces else "")
    from _report import emit, header

    report = (
        header("Replay fragmentation of the bundled traces", command) + "\n"
        "Columns: peak reserved / peak allocated over the step; mean over ops of "
        "1 - allocated/reserved and of 1 - largest free block / free bytes (external).\n\n"
        "```\n" + replay_table(args.traces) + "\n```\n\n```\n" + gpu_table(args.traces) + "\n```\n"
    )
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
