"""`dtralloc demo`: replay the bundled training steps through the pool.

Each bundled trace is one recorded training step of a real model (GPT-2,
BERT, a Llama-style decoder, ResNet-50, a UNet, an MLP). The demo replays
every one of them through dtralloc's pool on the virtual backend under the
default policy and a few DTRALLOC_CONF variants, and prints how much memory
each step really reserves against what it allocates, and how fragmented the
cache gets. Then it replays them under budgets below their peak with the
main eviction policies, and prints what recomputation costs. Last, the live
part (demo_live.py): a small model trained for a few steps on CPU under
dtralloc.dtr() at half its peak, losses identical to the plain run. No GPU
needed.
"""
from __future__ import annotations

import sys
import time

from .replay import ReplayResult, format_results, replay
from .traces import list_bundled, load_bundled

DEMO_CONFS = ["", "max_split_size_mb:64", "roundup_power2_divisions:4"]
DEMO_BUDGETS = [0.7, 0.5]
DEMO_POLICIES = ["dtr", "coop", "dtralloc"]


def run_demo(traces=None, confs=None, policies=None, budgets=None, echo=print, live=True) -> list[ReplayResult]:
    names = traces or list_bundled()
    confs = DEMO_CONFS if confs is None else confs
    policies = DEMO_POLICIES if policies is None else policies
    budgets = DEMO_BUDGETS if budgets is None else budgets
    unknown = [n for n in names if n not in list_bundled()]
    if unknown:
        raise ValueError(f"unknown bundled trace(s) {', '.join(unknown)}; "
                         f"available: {', '.join(list_bundled())}")
    echo(f"dtralloc demo: {len(names)} recorded training steps x {len(confs)} settings, "
         "replayed through the pool on a virtual device")
    results = []
    total = len(names) * len(confs)
    start = time.perf_counter()
    for i, name in enumerate(names):
        trace = load_bundled(name)
        for j, conf in enumerate(confs):
            done = i * len(confs) + j + 1
            echo(f"  [{done:>2}/{total}] {name:<9} {conf or '(defaults)':<28}", end="", flush=True)
            t0 = time.perf_counter()
            results.append(replay(trace, conf=conf))
            echo(f" {time.perf_counter() - t0:5.2f}s")
    echo("")
    echo(format_results(results))
    echo("")
    echo("reserved/allocated: peak reserved over peak allocated (1.0 = no cache overhead); "
         "mean 1-alloc/res and ext. frag: averaged over the step's ops.")
    if policies:
        echo("")
        echo(f"Under a budget below the peak: {len(policies)} eviction policies x budgets "
             f"{', '.join(str(b) for b in budgets)} of each step's no-eviction peak")
        evicting = []
        total = len(names) * len(policies) * len(budgets)
        done = 0
        for name in names:
            trace = load_bundled(name)
            for policy in policies:
                for budget in budgets:
                    done += 1
                    echo(f"  [{done:>2}/{total}] {name:<9} {policy:<9} {budget}", end="", flush=True)
                    t0 = time.perf_counter()
                    evicting.append(replay(trace, budget=budget, policy=policy))
                    echo(f" {time.perf_counter() - t0:5.2f}s")
        echo("")
        echo(format_results(evicting))
        echo("")
        echo("overhead: recompute cost over one pass of the step; OOM rows: the policy cannot fit "
             "the step in that budget.")
        results += evicting
    if live:
        from .demo_live import run_live_demo

        echo("")
        run_live_demo(echo)
    echo(f"done in {time.perf_counter() - start:.1f}s")
    return results


def main(argv=None) -> int:  # pragma: no cover - exercised through the CLI
    run_demo()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
