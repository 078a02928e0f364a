"""FSDP2 under a live DTR budget (CPU, one gloo rank): the smallest budget
two training steps fit in, bit-exact with plain eager.

Three model families (FAMILIES: MLP blocks with dropout; pre-norm
transformer blocks with a fused qkv and SDPA with dropout; residual conv
blocks with GroupNorm), each block an FSDP2 unit, AdamW with its step
outside the session, with reshard_after_forward True (FSDP's default) and
False, and the same model without FSDP for comparison. For each, a step's
session without a budget gives its peak (the pool's reserved bytes, caching included); then
budgets from that peak down, `--step` MiB apart, each on a fresh model: two
steps inside dtr(device="cpu", budget=...), against the same two steps
plainly (losses and updated parameters, torch.equal), with the evictions,
recomputes and step time over plain (the faster of its steps over the faster
of a plain run's, made just before it). The sweep goes on below the first
budget that runs out of memory (placement makes the edge uneven) and stops
after `--misses` of them in a row.

FSDP frees each unsharded parameter after its forward and after its
backward by resizing its storage (live_saved.cpp, resizing): what reads it
is pinned until it dies, or, where a copy of the parameter pins less, the
recipes that read it read a copy (Note [copy before a resize]; the
"copies" column counts them). One intra-op thread: at two, MKL's sgemm
gave other bits now and then (docs/live.md, Known limits).

    python bench/bench_fsdp_budget.py [--model mlp|gpt|conv ...] [--step 2] [--misses 3]
        [--out bench/results/fsdp_budget-DATE-cpu.md]
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


class _MlpBlock(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512), nn.Dropout(0.1))


class _GptBlock(nn.Module):
    """Pre-norm causal self-attention (fused qkv split into heads, SDPA with
    dropout) and an MLP, each with its residual."""

    def __init__(self, dim: int = 256, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(0.1))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class _ConvBlock(nn.Module):
    """Conv, GroupNorm, GELU, conv, GroupNorm, with the residual."""

    def __init__(self, channels: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.GroupNorm(8, 2 * channels),
                                  nn.GELU(), nn.Conv2d(2 * channels, channels, 3, padding=1),
                                  nn.GroupNorm(8, channels))

    def forward(self, x):
        return torch.relu(x + self.body(x))


class _Mean(nn.Module):
    """The mean over `dims`: the head's input is 2-D, so the model's output
    is no view (FSDP2 warns of a root module returning one)."""

    def __init__(self, *dims: int):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return x.mean(dim=self.dims)


# family: (what a block is, how many, the head after them, the batch, what it is in words)
FAMILIES = {
    "mlp": (_MlpBlock, 6, lambda: nn.Linear(512, 4), (256, 512),
            "six blocks Linear(512, 1024) + GELU + Linear(1024, 512) + Dropout(0.1); batch 256x512"),
    "gpt": (_GptBlock, 4, lambda: nn.Sequential(_Mean(1), nn.Linear(256, 4)), (8, 128, 256),
            "four pre-norm transformer blocks (dim 256, 4 heads, fused qkv, causal SDPA with dropout 0.1, MLP 1024), "
            "the mean over tokens into Linear(256, 4); batch 8x128x256"),
    "conv": (_ConvBlock, 4, lambda: nn.Sequential(_Mean(2, 3), nn.Linear(32, 4)), (8, 32, 48, 48),
             "four residual conv blocks (3x3 conv 32 to 64 and back, GroupNorm, GELU), the spatial mean into "
             "Linear(32, 4); batch 8x32x48x48"),
}


def build(mode: str, family: str = "mlp") -> nn.Module:
    block, count, head, batch, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = nn.Sequential(*[block() for _ in range(count)], head())
    if mode != "no FSDP":
        from torch.distributed.fsdp import fully_shard

        reshard = mode == "FSDP2, reshard after forward"
        for unit in model[:count]:
            fully_shard(unit, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        with torch.no_grad():
            model(torch.zeros(1, *batch[1:]))  # FSDP's lazy init, outside any session
    return model


def train(mode: str, steps: int, session=None, family: str = "mlp"):
    """(losses + updated parameters, seconds per step, session stats per step)."""
    model = build(mode, family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    losses, seconds, stats = [], [], []
    for _ in range(steps):
        x = torch.randn(*FAMILIES[family][3])
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


def sweep(family: str, mode: str, steps: int, step_mib: float, misses: int, log) -> dict:
    plain, _, _ = train(mode, steps, family=family)
    _, _, unbounded = train(mode, 1, lambda: dtralloc.dtr(device="cpu"), family)
    peak = unbounded[0]["peak_bytes"]
    rows = []
    budget = peak
    missed = 0
    while missed < misses and budget > step_mib * MiB:
        _, plain_s, _ = train(mode, steps, family=family)  # next to each budget's run: the load on the machine drifts
        try:
            got, seconds, stats = train(mode, steps, lambda: dtralloc.dtr(device="cpu", budget=int(budget)), family)
        except dtralloc.OutOfMemoryError as e:
            pinned = next((line.split(":")[0].strip() for line in str(e).splitlines()
                           if "overwritten in place" in line), "0 B")
            rows.append(dict(budget=budget, fits=False, pinned=pinned))
            missed += 1
        else:
            same = all(torch.equal(a, b) for a, b in zip(plain, got))
            rows.append(dict(budget=budget, fits=True, same=same,
                             evictions=sum(s["evictions"] for s in stats), remats=sum(s["remats"] for s in stats),
                             copies=sum(s["resize_copies"] for s in stats),
                             ratio=min(seconds) / min(plain_s)))
            missed = 0
        r = rows[-1]
        log(f"{family}, {mode}: budget {budget / MiB:.0f} MiB: " + ("fits" if r["fits"] else "out of memory"))
        budget -= step_mib * MiB
    fitting = [r for r in rows if r["fits"]]
    return dict(family=family, mode=mode, peak=peak, rows=rows, smallest=min(r["budget"] for r in fitting) if fitting else None,
                all_same=all(r["same"] for r in fitting))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="training steps per run (default 2)")
    ap.add_argument("--step", type=float, default=2.0, help="MiB between budgets (default 2)")
    ap.add_argument("--misses", type=int, default=3,
                    help="stop after this many budgets in a row that run out of memory (default 3)")
    ap.add_argument("--model", action="append", choices=sorted(FAMILIES),
                    help="model family (repeat for several; default: all of " + ", ".join(FAMILIES) + ")")
    ap.add_argument("--out", help="also write the report here (markdown)")
    args = ap.parse_args()
    if args.steps < 1 or args.step <= 0 or args.misses < 1:
        ap.error("--steps and --misses must be at least 1, --step above 0")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = [sweep(family, mode, args.steps, args.step, args.misses,
                         lambda m: print(m, file=sys.stderr, flush=True))
                   for family in args.model or list(FAMILIES)
                   for mode in ("FSDP2, reshard after forward", "FSDP2, no reshard after forward", "no FSDP")]
    finally:
        dist.destroy_process_group()

    command = "python bench/bench_fsdp_budget.py " + " ".join(sys.argv[1:])
    out = [header("FSDP2 under a live DTR budget (CPU, one gloo rank)", command.strip()),
           f"torch {torch.__version__}, one intra-op thread; {args.steps} AdamW steps per run, budgets {args.step:g} MiB "
           "apart. Each block is an FSDP2 unit. Models:\n"]
    out += [f"- {family}: {FAMILIES[family][4]}" for family in dict.fromkeys(r["family"] for r in results)]
    out += ["", "| model | FSDP | peak without a budget | smallest budget that fits | of the peak | "
            "bit-exact at every fitting budget |", "|---|---|---|---|---|---|"]
    for r in results:
        small = f"{r['smallest'] / MiB:.0f} MiB" if r["smallest"] else "none"
        frac = f"{r['smallest'] / r['peak']:.2f}" if r["smallest"] else "-"
        out.append(f"| {r['family']} | {r['mode']} | {r['peak'] / MiB:.0f} MiB | {small} | {frac} | "
                   f"{'yes' if r['all_same'] else 'NO'} |")
    for r in results:
        out += ["", f"## {r['family']}: {r['mode']}", "",
                "| budget | fits | evictions | recomputes | copies | step time over plain (min) | bit-exact | "
                "pinned: read a value overwritten for good (at the OOM) |",
                "|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            if row["fits"]:
                out.append(f"| {row['budget'] / MiB:.0f} MiB | yes | {row['evictions']} | {row['remats']} | "
                           f"{row['copies']} | {row['ratio']:.2f} | {'yes' if row['same'] else 'NO'} | |")
            else:
                out.append(f"| {row['budget'] / MiB:.0f} MiB | out of memory | | | | | | {row['pinned']} |")
    emit("\n".join(out) + "\n", args.out)


if __name__ == "__main__":
    main()
