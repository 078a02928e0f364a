"""What late op costs do to live eviction, and what carried costs give back:
live dtr() sessions on CPU, with their ops timed on a simulated GPU.

A CUDA session prices each op by its time on the GPU, which arrives only when
the GPU has run it (allocator/op_timer.h); until then, by its launch, or
since 2026-11-30 by the GPU's time for the same op in the last step of the
same kind (Note [carried costs], allocator/bindings/live_session.cpp; Note
[recent steps], allocator/bindings/recent_steps.h). bench/replay_cost_lag.py
measures that in the replay; this bench runs the live driver itself: a CPU
session whose ops are timed on a simulated GPU that runs a fixed number of
marks behind the host (LiveSession.simulate_gpu_timer,
allocator/simulated_timing.h), the code a CUDA session runs on its events.

* clock          a plain CPU session: each op priced at its own time at once
* lag N          each op priced at a launch (5% of the step's mean op time)
                 until the simulated GPU, N marks behind, has timed it
* lag N, carried the same, each op priced until then at the time the last
                 step of its kind measured for it (the steps before ran too)

Per model and budget (a fraction of the step's no-eviction peak), each
configuration runs --steps training steps, a session each, in every round;
rounds alternate the configurations. A cell is the median over rounds of the
last step's recompute seconds (the wall clock of the recomputes the session
ran: what eviction cost), and its evictions. Times on a shared two-core
machine move by 10-30% from run to run; the ratios within a round are what
to read.

    python bench/live_cost_lag.py [--models gpt2 resnet50 ...] [--budgets 0.7 0.5] [--lag 300]
        [--rounds 3] [--steps 3] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _report import emit, header  # noqa: E402

DEFAULT_MODELS = ("gpt2", "bert", "llama", "vit", "encdec", "unet")
DEFAULT_BUDGETS = (0.8, 0.65)  # above each default model's lowest (bench/results/live_lowest_budget-*)
DEFAULT_LAG = 300  # bench/replay_cost_lag.py's carried lag: the host a few layers ahead
LAUNCH_FRACTION = 0.05  # replay(cost_lag=...)'s default launch: 5% of the mean op cost
CONFIGS = ("clock", "late", "carried")


def _session(config: str, budget: int, lag: int, launch_ns: float):
    from dtralloc.dtr import dtr

    s = dtr(budget=budget, device="cpu")
    if config != "clock":
        s._core.simulate_gpu_timer(lag, launch_ns, config == "carried")
    return s


def _steps(w, config: str, budget: int, lag: int, launch_ns: float, steps: int) -> dict:
    """`steps` training steps, a session each; the last one's stats, or
    {"oom": ...} where a step ran out of the budget."""
    import dtralloc
    from dtralloc import _core

    s = None
    for _ in range(steps):
        gc.collect()
        s = _session(config, budget, lag, launch_ns)
        try:
            with s:
                w.step()
        except dtralloc.OutOfMemoryError as e:
            return {"oom": str(e).splitlines()[0]}
        _core.simulated_gpu_synchronize()  # the step's end: torch.cuda.synchronize(), loss.item()
    return s.stats()


def measure_model(name: str, budgets, lag: int, rounds: int, steps: int, echo) -> dict:
    import torch
    from bench_live_vs_replay import BENCH_SIZES

    from dtralloc.dtr import dtr
    from dtralloc.zoo import build

    torch.manual_seed(0)
    w = build(name, **BENCH_SIZES[name])
    w.step()  # optimizer state and lazy initialisation exist, as in any later step
    probe = dtr(device="cpu")
    with probe:
        w.step()
    st = probe.stats()
    peak, ops = st["peak_bytes"], len(probe.series()["op"])
    launch_ns = LAUNCH_FRACTION * st["op_seconds"] * 1e9 / max(1, ops)
    echo(f"{name}: peak {peak / 2**20:.1f} MiB, {ops} recorded ops, launch {launch_ns / 1e3:.1f} µs")
    cells = {(f, c): [] for f in budgets for c in CONFIGS}
    for r in range(rounds):
        for f in budgets:
            for c in CONFIGS:
                cells[(f, c)].append(_steps(w, c, int(f * peak), lag, launch_ns, steps))
        echo(f"{name}: round {r + 1}/{rounds}: " + ", ".join(
            f"{f:g} {c} " + ("OOM" if "oom" in cells[(f, c)][-1] else
                             f"{cells[(f, c)][-1]['recompute_seconds'] * 1e3:.1f} ms")
            for f in budgets for c in CONFIGS))
    return {"name": name, "sizes": BENCH_SIZES[name], "description": w.description, "peak": peak, "ops": ops,
            "launch_ns": launch_ns, "cells": cells}


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(cell: list) -> dict:
    """Median recompute seconds and evictions over the rounds that fit;
    None where any round ran out of memory."""
    if any("oom" in x for x in cell):
        return None
    return {"recompute_s": _median([x["recompute_seconds"] for x in cell]),
            "evictions": _median([x["evictions"] for x in cell]),
            "carried": _median([x["carried_costs"] for x in cell]),
            "timed": _median([x["gpu_timed_ops"] for x in cell])}


def report(models: list, budgets, lag: int, rounds: int, steps: int, command: str) -> str:
    lines = [header("Late op costs in live eviction (CPU, simulated GPU timing)", command), ""]
    lines.append(__doc__.split("\n\n")[1].replace("\n", " ") + "\n")
    lines.append(f"Lag {lag} marks; {steps} steps per configuration, the last measured; median of {rounds} rounds.\n")
    lines.append(f"| model | budget | clock: recompute ms (evictions) | lag {lag}: recompute ms (evictions), x clock "
                 f"| lag {lag}, carried: recompute ms (evictions), x clock | carried ops / ops |")
    lines.append("|---|---|---|---|---|---|")
    ratios = {"late": [], "carried": []}
    for m in models:
        for f in budgets:
            s = {c: summarize(m["cells"][(f, c)]) for c in CONFIGS}

            def show(c):
                x = s[c]
                if x is None:
                    return "OOM"
                text = f"{x['recompute_s'] * 1e3:.1f} ({x['evictions']:g})"
                base = s["clock"]
                if c != "clock" and base is not None and base["recompute_s"] > 0:
                    ratio = x["recompute_s"] / base["recompute_s"]
                    ratios[c].append(ratio)
                    text += f", {ratio:.2f}x"
                return text

            carried = "-" if s["carried"] is None else f"{s['carried']['carried']:g} / {m['ops']}"
            lines.append(f"| {m['name']} | {f:g} | {show('clock')} | {show('late')} | {show('carried')} | {carried} |")
    lines.append("")
    for c, label in (("late", f"lag {lag}"), ("carried", f"lag {lag}, carried")):
        xs = ratios[c]
        if xs:
            lines.append(f"- {label}: recompute seconds over the clock's, median {statistics.median(xs):.2f}x "
                         f"({min(xs):.2f}-{max(xs):.2f}x) over {len(xs)} cells")
    lines.append("")
    lines.append("Models: " + "; ".join(f"{m['name']} {m['description']} (peak {m['peak'] / 2**20:.1f} MiB, "
                                         f"{m['ops']} recorded ops, launch {m['launch_ns'] / 1e3:.1f} µs)"
                                         for m in models))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    p.add_argument("--budgets", nargs="+", type=float, default=list(DEFAULT_BUDGETS))
    p.add_argument("--lag", type=int, default=DEFAULT_LAG, help="marks the simulated GPU runs behind the host")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps per configuration and round (the last is measured)")
    p.add_argument("--out", help="write the report here (Markdown) as well as to stdout")
    args = p.parse_args(argv)
    from bench_live_vs_replay import BENCH_SIZES

    unknown = [m for m in args.models if m not in BENCH_SIZES]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(BENCH_SIZES)}")
    if any(not 0 < f <= 1 for f in args.budgets):
        p.error("--budgets are fractions of the step's peak, in (0, 1]")
    if args.lag < 0 or args.rounds < 1 or args.steps < 2:
        p.error("--lag >= 0, --rounds >= 1 and --steps >= 2 (the first step has nothing to carry)")

    def echo(msg):
        print(msg, file=sys.stderr, flush=True)

    from bench_live_vs_replay import measure_available

    models, skipped = measure_available(
        args.models, lambda name: measure_model(name, args.budgets, args.lag, args.rounds, args.steps, echo))
    command = "python bench/live_cost_lag.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(models, args.budgets, args.lag, args.rounds, args.steps, command.strip())
    text += "".join(f"\nSkipped {name}: {why}.\n" for name, why in skipped.items())
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
