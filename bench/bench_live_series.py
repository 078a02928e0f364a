"""What the live session's per-op recording (dtr(series=...): the per-op
series, the event log, op stamps) adds per ATen op, side by side in one run:
short batches alternate dtr(device="cpu", series=0) and dtr(device="cpu")
(recording on), and the least disturbed (minimum) batch of each is kept, so
load from other processes on a shared machine cancels out better than with
whole-workload rounds. No budget: what every session pays.

    python bench/bench_live_series.py [--batches 150] [--out bench/results/live_series-DATE-cpu.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from dtralloc.dtr import dtr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit, header  # noqa: E402
from bench_live_overhead import ops_of, workloads  # noqa: E402  the same three workloads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args()
    rows = []
    for name, fn in workloads().items():
        ops = ops_of(fn)
        best = {"off": float("inf"), "on": float("inf")}
        for i in range(args.batches):
            for arm in (("off", "on") if i % 2 == 0 else ("on", "off")):
                with dtr(device="cpu", series=0 if arm == "off" else 1 << 20):
                    fn()  # warm: the first call of a kernel allocates more
                    start = time.perf_counter_ns()
                    fn()
                    best[arm] = min(best[arm], time.perf_counter_ns() - start)
        off, on = best["off"] / ops / 1e3, best["on"] / ops / 1e3
        rows.append(f"| {name} | {ops} | {off:.3f} | {on:.3f} | {on - off:+.3f} |")
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    report = "\n".join([
        header("Live session recording cost, per ATen op (CPU)", cmd),
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; minimum over {args.batches} "
        f"alternating batches per arm.", "",
        "| workload | ATen ops | recording off µs/op | recording on µs/op | added µs/op |",
        "|---|---|---|---|---|", *rows, ""])
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
