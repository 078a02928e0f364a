"""`dtralloc demo`: a training-like allocation pattern through the pool.

Until real recorded traces are bundled, the demo drives a synthetic
transformer training step (forward saves activations, backward frees them
and makes gradients) with a sequence length that changes from step to step,
the classic source of fragmentation, on the `virtual` backend (an 80 GB
device simulated by address arithmetic). It runs the same steps under
several DTRALLOC_CONF settings and prints peak reserved, peak allocated,
fragmentation and device allocation calls side by side.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from .pool import Pool
from . import _core


@dataclass
class DemoRow:
    conf: str
    peak_allocated: int
    peak_reserved: int
    mean_fragmentation: float
    device_allocs: int
    segments: int
    seconds: float


def _transformer_step(pool: Pool, rng: random.Random, seq: int, layers: int, hidden: int,
                      batch: int, params: list[int], track) -> None:
    f32 = 4
    act = batch * seq * hidden * f32
    saved = []
    for _ in range(layers):  # forward
        tmp = [pool.malloc(act), pool.malloc(batch * 12 * seq * seq * 2)]
        saved.append(pool.malloc(act))                  # attention output
        saved.append(pool.malloc(4 * act))              # MLP activation
        saved.append(pool.malloc(batch * seq * f32))    # layernorm stats
        for t in tmp:
            pool.free(t)
        track()
    grads = []
    for i in range(layers):  # backward, last layer first
        g = pool.malloc(4 * act)
        for _ in range(3):
            pool.free(saved.pop())
        grads.append(pool.malloc(params[i % len(params)]))
        pool.free(g)
        track()
    for g in grads:  # optimizer consumed the gradients
        pool.free(g)
    track()


def run_demo_conf(conf: str, steps: int = 8, seed: int = 0) -> DemoRow:
    pool = Pool(backend="virtual", capacity=80 << 30, conf=conf)
    rng = random.Random(seed)
    hidden, layers, batch = 1024, 24, 8
    params = [4 * hidden * hidden * 4, 8 * hidden * hidden * 4]
    weights = [pool.malloc(p) for p in params * layers]  # live for the whole run
    fragmentation = []

    def track():
        s = pool.stats()
        reserved = s["reserved_bytes.all.current"]
        if reserved:
            fragmentation.append(1 - s["allocated_bytes.all.current"] / reserved)

    start = time.perf_counter()
    for _ in range(steps):
        seq = rng.choice([384, 512, 640, 768, 896, 1024])
        _transformer_step(pool, rng, seq, layers, hidden, batch, params, track)
    elapsed = time.perf_counter() - start
    pool.check_invariants()
    s = pool.stats()
    for w in weights:
        pool.free(w)
    return DemoRow(conf or "(defaults)", s["allocated_bytes.all.peak"], s["reserved_bytes.all.peak"],
                   sum(fragmentation) / len(fragmentation), s["num_device_alloc"], s["segment.all.current"], elapsed)


DEMO_CONFS = ["", "max_split_size_mb:256", "roundup_power2_divisions:4", "garbage_collection_threshold:0.6,budget:20G"]


def run_demo(confs=None, steps: int = 8, echo=print) -> list[DemoRow]:
    confs = DEMO_CONFS if confs is None else confs
    echo(f"dtralloc demo: synthetic 24-layer transformer, {steps} training steps with varying "
         "sequence length, virtual 80 GB device")
    rows = []
    for i, conf in enumerate(confs, 1):
        echo(f"  [{i}/{len(confs)}] {conf or '(defaults)'} ...", end="", flush=True)
        row = run_demo_conf(conf, steps)
        echo(f" {row.seconds:.2f}s")
        rows.append(row)
    fb = _core.format_bytes
    echo("")
    echo(f"{'DTRALLOC_CONF':<44}{'peak alloc':>12}{'peak reserved':>15}{'reserved/alloc':>16}"
         f"{'mean frag':>12}{'cudaMallocs':>13}")
    for r in rows:
        echo(f"{r.conf:<44}{fb(r.peak_allocated):>12}{fb(r.peak_reserved):>15}"
             f"{r.peak_reserved / r.peak_allocated:>16.3f}{r.mean_fragmentation:>12.3f}{r.device_allocs:>13}")
    echo("\nmean frag = 1 - allocated/reserved averaged over every layer boundary; lower is better.")
    return rows
