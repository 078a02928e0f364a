"""The lowest budget a live dtr() training step fits in, per zoo model, on two
(or more) pool settings side by side: by default the defaults and `arena:on`.

Note [arena] (docs/allocator.md) keeps `arena:on` off by default on the
replays' word: over 48 recorded traces an arena needs higher budgets (mean
lowest 0.541 of the peak, against 0.512 on the GPU's default settings) and
has more feasibility holes, while it saves every cudaMalloc/cudaFree at the
budget, which only a GPU can price. This bench asks the first half of that
of live sessions instead of replays: the same engine, with the program's and
autograd's references as they really are (docs/live.md, Live against replay).

Per model (bench_live_vs_replay.py's sizes) and setting, in a process of its
own (the pool reads its settings once a process, from DTRALLOC_CONF): a
warm-up step; the no-budget peak P of a session's step (the CPU mirror's
peak reserved bytes: what the session allocates); then budgets from P down
in steps of --step, each two training steps inside dtr(budget, device="cpu"),
a session each (the second places by what the first kept, as in a training
loop), until one runs out of memory. Reported: the lowest budget from which
every budget up to P runs, and, at each budget both settings ran, the second
step's evictions and recompute seconds. Bits are not compared here: the tests
do that (tests/test_dtr*.py); times on a shared CPU mean little, so neither
is step time.

    python bench/live_lowest_budget.py [--models resnet50 gpt2] [--confs "" arena:on]
        [--step 0.05] [--floor 0.2] [--out bench/results/live_lowest_budget-DATE-cpu.md]
    python bench/live_lowest_budget.py --smoke      # two small models, a few seconds each
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFS = ("", "arena:on")
# --smoke: small enough to run in seconds, large enough that the peak spans
# several of the mirror pool's segments (at the zoo's own small sizes a whole
# step fits in one 2 MiB segment).
SMOKE_SIZES = {"mlp": dict(batch=256, features=512, width=1024, layers=4, classes=10),
               "convbn": dict(batch=8, image=64, base=16, stages=(2, 2), classes=10)}


def child(name: str, conf: str, step: float, floor: float, smoke: bool) -> dict:
    """One model on one setting (DTRALLOC_CONF is set by the parent)."""
    import torch

    import dtralloc
    from dtralloc.zoo import build

    sys.path.insert(0, HERE)
    from bench_live_vs_replay import BENCH_SIZES, _live

    sizes = (SMOKE_SIZES if smoke else BENCH_SIZES)[name]
    torch.manual_seed(0)
    w = build(name, **sizes)
    w.step()  # optimizer state and lazy initialisation, as in any later step
    gc.collect()
    with dtralloc.dtr(device="cpu") as probe:
        w.step()
    peak = probe.stats()["peak_bytes"]
    cells = {}
    lowest = None
    k = 0
    while True:
        fraction = round(1.0 - k * step, 6)
        if fraction < floor - 1e-9:
            break
        budget = max(1, int(fraction * peak))
        first = _live(w.step, budget, "dtralloc")
        second = _live(w.step, budget, "dtralloc") if "oom" not in first else first
        fits = "oom" not in second
        cells[f"{fraction:g}"] = {"fits": fits, "evictions": second["evictions"], "remats": second["remats"],
                                  "recompute_seconds": second["recompute_seconds"],
                                  "oom": first.get("oom") or second.get("oom")}
        if not fits:
            break
        lowest = fraction
        k += 1
    return {"name": name, "conf": conf, "sizes": sizes,
            "description": w.description, "peak": peak, "lowest": lowest, "cells": cells}


def run_child(name: str, conf: str, args) -> dict:
    env = dict(os.environ, DTRALLOC_CONF=conf, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, conf, "--step", str(args.step),
           "--floor", str(args.floor)] + (["--smoke"] if args.smoke else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"name": name, "conf": conf, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _label(conf: str) -> str:
    return f"`{conf}`" if conf else "defaults"


def report(results: list[dict], confs: list[str], command: str) -> str:
    sys.path.insert(0, HERE)
    from _report import header

    from dtralloc import _core

    lines = [header("Lowest live dtr() budget, pool settings side by side (CPU)", command), ""]
    lines.append("Per model and setting, a process of its own: budgets from the session's no-budget peak P down, "
                 "two training steps each (a session a step); *lowest* is the lowest fraction of P from which "
                 "every budget up to P ran. Evictions and recompute seconds are the second step's.")
    lines.append("")
    by = {(r["name"], r["conf"]): r for r in results}
    names = list(dict.fromkeys(r["name"] for r in results))
    lines.append("| model | P | " + " | ".join(f"lowest, {_label(c)}" for c in confs) + " |")
    lines.append("|---|---|" + "---|" * len(confs))
    for name in names:
        row = [name]
        peaks = {by[name, c].get("peak") for c in confs if (name, c) in by and "peak" in by[name, c]}
        row.append(" / ".join(_core.format_bytes(p) for p in sorted(peaks)) or "-")
        for c in confs:
            r = by.get((name, c), {})
            row.append(f"error: {r['error']}" if "error" in r else
                       (f"{r['lowest']:g}" if r.get("lowest") is not None else "none fits"))
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("At each budget (fraction of P) the settings ran: evictions / recompute seconds of the second "
                 "step, or OOM.")
    lines.append("")
    lines.append("| model | budget | " + " | ".join(_label(c) for c in confs) + " |")
    lines.append("|---|---|" + "---|" * len(confs))
    for name in names:
        fractions = []
        for c in confs:
            for f in by.get((name, c), {}).get("cells", {}):
                if f not in fractions:
                    fractions.append(f)
        for f in sorted(fractions, key=float, reverse=True):
            cells = []
            for c in confs:
                cell = by.get((name, c), {}).get("cells", {}).get(f)
                cells.append("-" if cell is None else
                             ("OOM" if not cell["fits"] else f"{cell['evictions']} / {cell['recompute_seconds']:.3f}"))
            lines.append(f"| {name} | {f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Models:")
    lines.append("")
    for name in names:
        r = next((by[name, c] for c in confs if "description" in by.get((name, c), {})), None)
        if r:
            lines.append(f"- {name}: {r['description']} ({r['sizes']})")
    lines.append("")
    lines.append("Settings: " + ", ".join(f"{_label(c)} (DTRALLOC_CONF={c!r})" for c in confs)
                 + "; every other setting at its default (auto resolves arena:on's companions: docs/allocator.md, Note [arena]).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", help="zoo models (default: bench_live_vs_replay's; --smoke: mlp convbn)")
    parser.add_argument("--confs", nargs="+", default=list(DEFAULT_CONFS),
                        help='DTRALLOC_CONF per setting, "" for the defaults (default: "" arena:on)')
    parser.add_argument("--step", type=float, default=0.05, help="budget step, a fraction of P (default: %(default)s)")
    parser.add_argument("--floor", type=float, default=0.2, help="lowest fraction tried (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="two small models (mlp, convbn), seconds")
    parser.add_argument("--out", help="also write the report here")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "CONF"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.step < 1 or not 0 < args.floor <= 1:
        parser.error("--step is in (0, 1) and --floor in (0, 1]")
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.step, args.floor, args.smoke)), flush=True)
        return 0
    sys.path.insert(0, HERE)
    from bench_live_vs_replay import BENCH_SIZES

    sizes = SMOKE_SIZES if args.smoke else BENCH_SIZES
    models = args.models or list(sizes)
    unknown = [m for m in models if m not in sizes]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {sorted(sizes)}")
    from bench_live_vs_replay import measure_available

    def measure(name):
        rows = []
        for conf in args.confs:
            rows.append(run_child(name, conf, args))
            r = rows[-1]
            print(f"{name} [{_label(conf)}]: " + (f"error: {r['error']}" if "error" in r else
                  f"peak {r['peak']} B, lowest {r['lowest']}"), file=sys.stderr, flush=True)
        return rows

    per_model, skipped = measure_available(models, measure)
    results = [r for rows in per_model for r in rows]
    command = "python bench/live_lowest_budget.py " + " ".join(
        a if a and " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:]))
    text = report(results, args.confs, command.strip())
    if skipped:
        text += "\nSkipped: " + "; ".join(f"{name} ({why})" for name, why in skipped.items()) + "\n"
    from _report import emit

    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
