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
            conf: str = "", pattern: str = "pair"):
    """Median ns per malloc+free pair of the pool for one size mix.

    pattern "pair": malloc then free at once, nothing else live (each pair
    splits a cached block and merges it back: the pool's worst cache hit).
    pattern "steady": a working set of 4 blocks of every size stays live and
    one block at a time is freed and allocated again (exact-size reuse, no
    split or merge: the steady state of a training loop).
    """
    pool = Pool(backend=backend, capacity=1 << 40, conf=conf)
    if pattern == "pair":
        return _core.bench_pool_pairs(pool, sizes, pairs, threads, repeats, True)
    if pattern == "steady":
        return _core.bench_pool_churn(pool, sizes, 4, pairs, threads, repeats, True)
    raise ValueError(f"unknown pattern {pattern!r}; use 'pair' or 'steady'")


def run_hot_path_bench(quick: bool = False) -> str:
    pairs, repeats = (50_000, 3) if quick else (300_000, 9)
    mixes = (("training-step mix", TRAINING_STEP_SIZES), ("random mix", random_sizes()))
    out = [
        "dtralloc hot path: ns per malloc+free pair (cache hit), median of "
        f"{repeats} runs x {pairs} pairs per thread, virtual backend",
        f"{'pattern':<8}{'size mix':<19}{'threads':>8}{'dtralloc':>10}{'+history':>10}{'libc':>9}{'ratio':>8}",
    ]
    for pattern in ("steady", "pair"):
        for label, sizes in mixes:
            for threads in (1, 2, 4):
                pool_ns = measure(sizes, threads, pairs, repeats, pattern=pattern)
                history_ns = measure(sizes, threads, pairs, repeats, conf="history_entries:16384",
                                     pattern=pattern)
                libc_ns = _core.bench_libc_pairs(sizes, pairs, threads, repeats)
                out.append(f"{pattern:<8}{label:<19}{threads:>8}{pool_ns:>10.1f}{history_ns:>10.1f}"
                           f"{libc_ns:>9.1f}{pool_ns / libc_ns:>8.2f}")
    out.append("steady = working set live, one block freed and reallocated at a time (exact reuse); "
               "pair = malloc+free with nothing else live (split + merge every time)")
    out.append("dtralloc = defaults; +history = with the event history on (history_entries:16384); "
               "ratio = dtralloc / libc malloc+free of the same sizes")
    out.append("target: dtralloc <= 100 ns single-threaded")
    return "\n".join(out)
