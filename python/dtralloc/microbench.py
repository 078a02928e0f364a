"""Hot-path microbenchmark: nanoseconds per malloc+free pair on a cache hit.

The loops run in C++ (allocator/microbench.cpp); Python only picks the sizes
and prints. Used by `dtralloc bench` and bench/bench_hot_path.py.
"""
from __future__ import annotations

import random

from . import _core
from .pool import Pool

# Tensor sizes of one GPT-2-small training step (batch 8, seq 1024, fp32):
# activations, attention scores, weights, grads, small bias/norm vectors.
TRAINING_STEP_SIZES = [
    8 * 1024 * 768 * 4,        # hidden states
    8 * 1024 * 3072 * 4,       # MLP activations
    8 * 12 * 1024 * 1024 * 2,  # attention scores (fp16)
    768 * 768 * 4,             # projection weight
    768 * 3072 * 4,            # MLP weight
    768 * 4,                   # bias / layernorm
    3072 * 4,
    8 * 1024 * 4,              # loss / mask vectors
    50257 * 768 * 4,           # embedding
    64,                        # scalars
]


def random_sizes(n: int = 256, seed: int = 0) -> list[int]:
    """Log-uniform sizes from 64 B to 64 MiB, fixed seed."""
    rng = random.Random(seed)
    return [int(2 ** rng.uniform(6, 26)) for _ in range(n)]


def measure(sizes, threads: int = 1, pairs: int = 200_000, repeats: int = 7, backend: str = "virtual",
            conf: str = ""):
    """(dtralloc ns/pair, libc ns/pair) medians for one size mix."""
    pool = Pool(backend=backend, capacity=1 << 40, conf=conf)
    pool_ns = _core.bench_pool_pairs(pool, sizes, pairs, threads, repeats, True)
    libc_ns = _core.bench_libc_pairs(sizes, pairs, threads, repeats)
    return pool_ns, libc_ns


def run_hot_path_bench(quick: bool = False) -> str:
    pairs, repeats = (50_000, 3) if quick else (300_000, 9)
    rows = []
    for label, sizes in (("training-step mix", TRAINING_STEP_SIZES), ("random mix", random_sizes())):
        for threads in (1, 2, 4):
            pool_ns, libc_ns = measure(sizes, threads, pairs, repeats)
            quiet_ns, _ = measure(sizes, threads, pairs, repeats, conf="history_entries:0")
            rows.append((label, threads, pool_ns, quiet_ns, libc_ns))
    out = [
        "dtralloc hot path: ns per malloc+free pair (cache hit), median of "
        f"{repeats} runs x {pairs} pairs per thread, virtual backend",
        f"{'size mix':<20}{'threads':>8}{'dtralloc':>11}{'no history':>12}{'libc':>9}{'ratio':>8}",
    ]
    for label, threads, pool_ns, quiet_ns, libc_ns in rows:
        out.append(f"{label:<20}{threads:>8}{pool_ns:>11.1f}{quiet_ns:>12.1f}{libc_ns:>9.1f}"
                   f"{pool_ns / libc_ns:>8.2f}")
    out.append("dtralloc = defaults (event history on); no history = history_entries:0")
    out.append("ratio = dtralloc / libc malloc+free on the same sizes; "
               "target: dtralloc <= 100 ns single-threaded")
    return "\n".join(out)
