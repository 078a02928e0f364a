"""FSDP2 under a live DTR budget (CPU, one gloo rank): the smallest budget
two training steps fit in, bit-exact with plain eager.

A six-block model (Linear(512, 1024), GELU, Linear(1024, 512), dropout;
batch 256; AdamW, its step outside the session), each block an FSDP2 unit,
with reshard_after_forward True (FSDP's default) and False, and the same
model without FSDP for comparison. For each, a step's session without a
budget gives its peak (the pool's reserved bytes, caching included); then
budgets from that peak down, `--step` MiB apart, each on a fresh model: two
steps inside dtr(device="cpu", budget=...), against the same two steps
plainly (losses and updated parameters, torch.equal), with the evictions,
recomputes and step time over plain. The sweep goes on below the first
budget that runs out of memory (placement makes the edge uneven) and stops
after `--misses` of them in a row.

FSDP frees each unsharded parameter after its forward and after its
backward by resizing its storage (live_saved.cpp, resizing): what reads it
is pinned until it dies. One intra-op thread: at two, MKL's sgemm gave
other bits now and then (docs/live.md, Known limits).

    python bench/bench_fsdp_budget.py [--step 2] [--misses 3] [--out bench/results/fsdp_budget-DATE-cpu.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import dtralloc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit, header  # noqa: E402

MiB = 2**20
BATCH = (256, 512)


def build(mode: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512), nn.Dropout(0.1))
                            for _ in range(6)], nn.Linear(512, 4))
    if mode != "no FSDP":
        from torch.distributed.fsdp import fully_shard

        reshard = mode == "FSDP2, reshard after forward"
        for block in model[:6]:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        with torch.no_grad():
            model(torch.zeros(1, BATCH[1]))  # FSDP's lazy init, outside any session
    return model


def train(mode: str, steps: int, session=None):
    """(losses + updated parameters, seconds per step, session stats per step)."""
    model = build(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    losses, seconds, stats = [], [], []
    for _ in range(steps):
        x = torch.randn(*BATCH)
        start = time.perf_counter()
        if session is None:
            loss = model(x).square().mean()
            loss.backward()
        else:
            with session() as s:
                loss = model(x).square().mean()
                loss.backward()
            stats.append(s.stats())
        seconds.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    return losses + params, seconds, stats


def sweep(mode: str, steps: int, step_mib: float, misses: int, log) -> dict:
    plain, plain_s, _ = train(mode, steps)
    _, _, unbounded = train(mode, 1, lambda: dtralloc.dtr(device="cpu"))
    peak = unbounded[0]["peak_bytes"]
    rows = []
    budget = peak
    missed = 0
    while missed < misses and budget > step_mib * MiB:
        try:
            got, seconds, stats = train(mode, steps, lambda: dtralloc.dtr(device="cpu", budget=int(budget)))
        except dtralloc.OutOfMemoryError as e:
            pinned = next((line.split(":")[0].strip() for line in str(e).splitlines()
                           if "overwritten in place" in line), "0 B")
            rows.append(dict(budget=budget, fits=False, pinned=pinned))
            missed += 1
        else:
            same = all(torch.equal(a, b) for a, b in zip(plain, got))
            rows.append(dict(budget=budget, fits=True, same=same,
                             evictions=sum(s["evictions"] for s in stats), remats=sum(s["remats"] for s in stats),
                             ratio=min(seconds) / min(plain_s)))
            missed = 0
        r = rows[-1]
        log(f"{mode}: budget {budget / MiB:.0f} MiB: " + ("fits" if r["fits"] else "out of memory"))
        budget -= step_mib * MiB
    fitting = [r for r in rows if r["fits"]]
    return dict(mode=mode, peak=peak, rows=rows, smallest=min(r["budget"] for r in fitting) if fitting else None,
                all_same=all(r["same"] for r in fitting))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="training steps per run (default 2)")
    ap.add_argument("--step", type=float, default=2.0, help="MiB between budgets (default 2)")
    ap.add_argument("--misses", type=int, default=3,
                    help="stop after this many budgets in a row that run out of memory (default 3)")
    ap.add_argument("--out", help="also write the report here (markdown)")
    args = ap.parse_args()
    if args.steps < 1 or args.step <= 0 or args.misses < 1:
        ap.error("--steps and --misses must be at least 1, --step above 0")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = [sweep(mode, args.steps, args.step, args.misses, lambda m: print(m, file=sys.stderr, flush=True))
                   for mode in ("FSDP2, reshard after forward", "FSDP2, no reshard after forward", "no FSDP")]
    finally:
        dist.destroy_process_group()

    command = "python bench/bench_fsdp_budget.py " + " ".join(sys.argv[1:])
    out = [header("FSDP2 under a live DTR budget (CPU, one gloo rank)", command.strip()),
           f"torch {torch.__version__}, one intra-op thread; {args.steps} AdamW steps per run, "
           f"batch {BATCH[0]}x{BATCH[1]}, six blocks Linear(512, 1024) + GELU + Linear(1024, 512) + Dropout(0.1).\n",
           "| model | peak without a budget | smallest budget that fits | of the peak | bit-exact at every fitting budget |",
           "|---|---|---|---|---|"]
    for r in results:
        small = f"{r['smallest'] / MiB:.0f} MiB" if r["smallest"] else "none"
        frac = f"{r['smallest'] / r['peak']:.2f}" if r["smallest"] else "-"
        out.append(f"| {r['mode']} | {r['peak'] / MiB:.0f} MiB | {small} | {frac} | {'yes' if r['all_same'] else 'NO'} |")
    for r in results:
        out += ["", f"## {r['mode']}", "",
                "| budget | fits | evictions | recomputes | step time over plain (min) | bit-exact | pinned: read a value overwritten for good (at the OOM) |",
                "|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            if row["fits"]:
                out.append(f"| {row['budget'] / MiB:.0f} MiB | yes | {row['evictions']} | {row['remats']} | "
                           f"{row['ratio']:.2f} | {'yes' if row['same'] else 'NO'} | |")
            else:
                out.append(f"| {row['budget'] / MiB:.0f} MiB | out of memory | | | | | {row['pinned']} |")
    emit("\n".join(out) + "\n", args.out)


if __name__ == "__main__":
    main()
