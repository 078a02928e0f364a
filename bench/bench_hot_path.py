"""Hot-path benchmark: ns per malloc+free pair on a cache hit.

CPU part (always): dtralloc's pool on the virtual backend, single- and
multi-threaded, for the size mix of a GPT-2 training step and for a random
mix, median of repeated runs, next to the C library's malloc/free on the same
sizes. GPU part (when torch sees a GPU): a torch.empty/del loop under torch's
native caching allocator and under dtralloc, each in a fresh process (an
allocator can be swapped only before CUDA starts), and their ratio.

    python bench/bench_hot_path.py [--quick] [--out bench/results/hot_path-DATE.md]

Targets: <= 100 ns per pair single-threaded on the CPU pool; on a GPU within
1.1x of native end to end.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

GPU_LOOP = textwrap.dedent(
    """
    import sys, time, torch
    if sys.argv[1] == "dtralloc":
        import dtralloc
        dtralloc.install()
    sizes = [int(s) for s in sys.argv[2].split(",")]
    iters = int(sys.argv[3])
    dev = torch.device("cuda")
    for s in sizes:  # warm the cache
        del torch.empty(s, dtype=torch.uint8, device=dev)
    samples = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for i in range(iters):
            x = torch.empty(sizes[i % len(sizes)], dtype=torch.uint8, device=dev)
            del x
        torch.cuda.synchronize()
        samples.append((time.perf_counter_ns() - t0) / iters)
    samples.sort()
    print(samples[len(samples) // 2])
    """
)


def gpu_section(quick: bool) -> str:
    try:
        import torch
    except ImportError:
        return "GPU: torch not installed, skipped."
    if not torch.cuda.is_available():
        return "GPU: no CUDA device visible to torch, skipped."
    from dtralloc.microbench import TRAINING_STEP_SIZES

    iters = 20_000 if quick else 200_000
    sizes = ",".join(str(s) for s in TRAINING_STEP_SIZES)
    result = {}
    for which in ("native", "dtralloc"):
        out = subprocess.run(
            [sys.executable, "-c", GPU_LOOP, which, sizes, str(iters)],
            check=True, capture_output=True, text=True,
        )
        result[which] = float(out.stdout.strip().splitlines()[-1])
    ratio = result["dtralloc"] / result["native"]
    return (
        f"GPU ({torch.cuda.get_device_name()}): torch.empty+del, training-step mix, "
        f"median of 7 x {iters}\n"
        f"  native {result['native']:.0f} ns   dtralloc {result['dtralloc']:.0f} ns   "
        f"ratio {ratio:.3f} (target <= 1.10)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    args = parser.parse_args()

    from dtralloc.microbench import run_hot_path_bench

    from _report import emit, header

    command = "python bench/bench_hot_path.py" + (" --quick" if args.quick else "")
    body = run_hot_path_bench(quick=args.quick) + "\n\n" + gpu_section(args.quick)
    emit(header("dtralloc hot-path benchmark", command) + "\n```\n" + body + "\n```\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
