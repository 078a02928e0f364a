"""Hot-path benchmark: ns per malloc+free pair on a cache hit.

CPU part (always): dtralloc's pool on the virtual backend, single- and
multi-threaded, for the size mix of a GPT-2 training step and for a random
mix, median of repeated runs, next to the C library's malloc/free on the same
sizes. GPU part (when torch sees a GPU): a torch.empty/del loop under torch's
native caching allocator and under dtralloc, each in a fresh process (an
allocator can be swapped only before CUDA starts), and their ratio.

    python bench/bench_hot_path.py [--quick] [--out bench/results/hot_path-DATE.md]
    python bench/bench_hot_path.py --gpu      # the GPU part alone (seconds)

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
        torch.empty(s, dtype=torch.uint8, device=dev)
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


def publisher_section(quick: bool) -> str:
    """The hot path with and without the publisher behind `dtralloc top`
    (allocator/publisher.h), side by side: the same loops on two pools, one
    publishing every 5 ms (the default) and one every 0.5 ms (10x more
    often), measured in alternation so that drift hits all of them alike."""
    import statistics

    import dtralloc
    from dtralloc import _core
    from dtralloc.microbench import TRAINING_STEP_SIZES, random_sizes

    pairs, rounds = (50_000, 5) if quick else (100_000, 31)
    rows = [f"{'pattern':<8}{'size mix':<19}{'threads':>8}{'off':>8}{'5 ms':>8}{'0.5 ms':>8}"
            f"{'5 ms/off':>10}{'0.5 ms/off':>12}   (min: off, 5 ms, 0.5 ms, ratios)"]
    for pattern in ("steady", "pair"):
        for label, sizes in (("training-step mix", TRAINING_STEP_SIZES), ("random mix", random_sizes())):
            for threads in (1, 2):
                pools = {}
                for name, period_ms in (("off", 0), ("5 ms", 5.0), ("0.5 ms", 0.5)):
                    pools[name] = dtralloc.Pool(backend="virtual", capacity=1 << 40)
                    if period_ms:
                        pools[name].publish(period_ms, "bench")
                samples = {name: [] for name in pools}
                for _ in range(rounds):
                    for name, pool in pools.items():
                        if pattern == "pair":
                            ns = _core.bench_pool_pairs(pool, sizes, pairs, threads, 1, True)
                        else:
                            ns = _core.bench_pool_churn(pool, sizes, 4, pairs, threads, 1, True)
                        samples[name].append(ns)
                med = {name: statistics.median(v) for name, v in samples.items()}
                low = {name: min(v) for name, v in samples.items()}
                rows.append(f"{pattern:<8}{label:<19}{threads:>8}{med['off']:>8.1f}{med['5 ms']:>8.1f}"
                            f"{med['0.5 ms']:>8.1f}{med['5 ms'] / med['off']:>10.3f}{med['0.5 ms'] / med['off']:>12.3f}"
                            f"   ({low['off']:.1f}, {low['5 ms']:.1f}, {low['0.5 ms']:.1f}: "
                            f"{low['5 ms'] / low['off']:.3f}, {low['0.5 ms'] / low['off']:.3f})")
                for pool in pools.values():
                    pool.publish(0)
    rows.append(f"ns per malloc+free pair: median (and min) of {rounds} alternating runs x {pairs} pairs per "
                "thread; off = no publisher; 5 ms = the default period of dtralloc top's publisher; 0.5 ms = "
                "ten times as often. The hot path has no publisher code: its thread takes the pool lock once "
                "per period.")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    parser.add_argument("--publisher", action="store_true",
                        help="only the publisher comparison (dtralloc top's publisher off and on)")
    parser.add_argument("--gpu", action="store_true",
                        help="only the GPU part (torch.empty/del under torch's allocator and dtralloc's; "
                             "seconds, where the CPU parts take minutes)")
    args = parser.parse_args()
    if args.gpu and args.publisher:
        parser.error("--gpu and --publisher each choose one part: give one")

    from dtralloc.microbench import run_hot_path_bench

    from _report import emit, header

    command = "python bench/bench_hot_path.py" + (" --quick" if args.quick else "") + \
        (" --publisher" if args.publisher else "") + (" --gpu" if args.gpu else "")
    if args.gpu:
        emit(header("dtralloc hot path on the GPU", command) + "\n```\n" + gpu_section(args.quick) + "\n```\n",
             args.out)
        return 0
    if args.publisher:
        body = "publisher (dtralloc top) off and on:\n" + publisher_section(args.quick)
        emit(header("dtralloc hot path with and without the publisher", command) + "\n```\n" + body + "\n```\n",
             args.out)
        return 0
    body = (run_hot_path_bench(quick=args.quick) + "\n\n" + "publisher (dtralloc top) off and on:\n" +
            publisher_section(args.quick) + "\n\n" + gpu_section(args.quick))
    emit(header("dtralloc hot-path benchmark", command) + "\n```\n" + body + "\n```\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
