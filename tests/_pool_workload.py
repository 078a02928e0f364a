"""A pool driven through mixed traffic, with its stats captured at known
points of its event history: what dashboards and exports must reproduce."""
from __future__ import annotations

import random

import dtralloc

MiB = 1 << 20
SIZES = (100, 1000, 4096, 700 << 10, 3 * MiB, 9 * MiB, 12 * MiB, 40 * MiB)


def drive(pool, steps: int, seed: int = 0, checkpoints: float = 0.05, streams: bool = True) -> list:
    """Mallocs, frees, record_stream, completions and empty_cache in random
    order, with op stamps (one op per 10 steps). Returns [(event index, stats)]:
    the pool's stats right after history event `event index`."""
    rng = random.Random(seed)
    live, captured = [], []
    for i in range(steps):
        pool.set_op_stamp(i // 10)
        r = rng.random()
        if live and r < 0.4:
            pool.free(live.pop(rng.randrange(len(live))))
        elif streams and live and r < 0.43:
            pool.record_stream(rng.choice(live), 7)
        elif streams and r < 0.45:
            pool.complete_events()
        elif r < 0.46:
            pool.empty_cache()
        else:
            live.append(pool.malloc(rng.choice(SIZES)))
        if rng.random() < checkpoints and pool.history_size:
            captured.append((pool.history_size - 1, pool.stats()))
    return captured


def expected(stats: dict) -> dict:
    """The figures of a stats dict, under the names history totals use."""
    return {
        "reserved": stats["reserved_bytes.all.current"],
        "allocated": stats["allocated_bytes.all.current"],
        "requested": stats["requested_bytes.all.current"],
        "largest_free": stats["fragmentation.largest_free_bytes"],
        "free": stats["fragmentation.free_bytes"],
        "pending": stats["active_bytes.all.current"] - stats["allocated_bytes.all.current"],
        "segments": stats["segment.all.current"],
    }


def make(conf: str = "history_entries:100000") -> "dtralloc.Pool":
    return dtralloc.Pool("virtual", capacity="80G", conf=conf)
