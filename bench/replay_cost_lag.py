"""What the GPU's late op costs do to eviction, by replay, and what carrying
the step before's costs gives back.

A live CUDA session prices an op by its time on the GPU, which arrives only
when the GPU has run it (allocator/op_timer.h); until then the op is priced
at its launch. Where the kernels are the slower side, the host runs ahead by
hundreds of ops, so when the budget fills late in the forward the last
layers' outputs all look nearly free to recompute. Since 2026-11-30 a
session prices each op, until then, at what the GPU measured for the same op
in the step before (Note [carried costs], allocator/bindings/live_session.cpp).
No GPU has run that yet; this bench measures the mechanism in the replay,
which decides with what it knows when it evicts and charges every recompute
at the op's own cost (``replay(cost_lag=...)``):

* no lag         every op priced at its own cost from the start (the replay as it was)
* lag N          each op priced at a launch (5% of the trace's mean op cost)
                 until N ops later, in every step: a live session before carried costs
* lag N, carried the same in the first step; from the second on, each op priced at
                 its own cost from the start (the step before's): a live session now

Each cell is the last step's recompute overhead (the step run twice in one
pool, --steps), dtralloc policy, at a budget that is a fraction of the
step's no-eviction peak. The traces are the bundled ones and their other
recordings (bench/recordings/N, the same models recorded again: op
durations vary from one recording to the next).

    python bench/replay_cost_lag.py [--traces gpt2 resnet50 ...] [--budgets 0.7 0.5 0.4] [--lags 100 300 1000]
        [--recordings 1 2] [--policy dtralloc] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _report import emit, header  # noqa: E402

DEFAULT_BUDGETS = (0.7, 0.5, 0.4)
DEFAULT_LAGS = (100, 300, 1000)
CARRIED_LAG = 300  # the lag of the "carried" column: a few hundred ops, the host ahead by a few layers


def cell(trace, budget: float, policy: str, steps: int, lag: int = 0, carried: bool = True):
    """The last step's recompute overhead, or None where a step did not fit."""
    from dtralloc.replay import replay

    r = replay(trace, budget=budget, policy=policy, steps=steps, cost_lag=lag, carried_costs=carried)
    return r.last_step_compute_overhead if r.feasible else None


def traces_of(names, recordings) -> list:
    """(label, trace path) for each name: the bundled recording, then each
    bench/recordings/N one that exists."""
    import dtralloc.traces as bundled

    out = []
    for name in names:
        out.append((name, bundled.bundled_path(name) if name in bundled.list_bundled() else name))
        for n in recordings:
            path = os.path.join(HERE, "recordings", str(n), f"{name}.dtrace")
            if os.path.exists(path):
                out.append((f"{name} (recording {n})", path))
    return out


def _fmt(x) -> str:
    return "OOM" if x is None else f"{x:.3f}"


def report(rows: list, lags, command: str, policy: str, steps: int) -> str:
    columns = ["no lag"] + [f"lag {n}" for n in lags] + [f"lag {CARRIED_LAG}, carried"]
    title = "Late op costs (a GPU's timing events) in the replay, and the step before's costs carried"
    lines = [header(title, command),
             f"Last step's recompute overhead (the step run {steps} times in one pool), `{policy}` policy; "
             f"budget: a fraction of the step's no-eviction peak. lag N: each op priced at a launch (5% of the "
             f"trace's mean op cost) until N ops later, every step; carried: from the second step on, at its own "
             f"cost from the start. OOM: a step did not fit.", "",
             "| trace | budget | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for label, budget, cells in rows:
        lines.append(f"| {label} | {budget:g} | " + " | ".join(_fmt(cells[c]) for c in columns) + " |")
    lines.append("")
    base = "no lag"
    for c in columns[1:]:
        ratios = [cells[c] / cells[base] for _, _, cells in rows
                  if cells[c] is not None and cells[base] is not None and cells[base] > 0]
        fits = sum(cells[c] is not None for _, _, cells in rows)
        if ratios:
            lines.append(f"- {c}: over no lag, median {statistics.median(ratios):.2f}x, range "
                         f"{min(ratios):.2f}-{max(ratios):.2f}x ({len(ratios)} cells); "
                         f"{fits} of {len(rows)} fit (no lag: {sum(cells[base] is not None for _, _, cells in rows)})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=["gpt2", "bert", "llama", "encdec", "moe", "vit", "resnet50",
                                                        "unet", "convbn", "lstm"],
                        help="bundled trace names or trace files")
    parser.add_argument("--budgets", nargs="+", type=float, default=list(DEFAULT_BUDGETS))
    parser.add_argument("--lags", nargs="+", type=int, default=list(DEFAULT_LAGS),
                        help="how many ops late an op's own cost arrives")
    parser.add_argument("--recordings", nargs="*", type=int, default=[1, 2],
                        help="also bench/recordings/N's recording of each trace (default: 1 2)")
    parser.add_argument("--policy", default="dtralloc")
    parser.add_argument("--steps", type=int, default=2, help="the step this many times in one pool (default 2)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    if any(not 0 < b <= 1 for b in args.budgets):
        parser.error("--budgets are fractions of the peak in (0, 1]")
    if any(n < 1 for n in args.lags):
        parser.error("--lags are numbers of ops >= 1")
    if args.steps < 2:
        parser.error("--steps must be at least 2: carried costs start at the second step")
    rows = []
    for label, path in traces_of(args.traces, args.recordings):
        for budget in args.budgets:
            print(f"[replay_cost_lag] {label} at {budget:g}", file=sys.stderr, flush=True)
            cells = {"no lag": cell(path, budget, args.policy, args.steps)}
            for n in args.lags:
                cells[f"lag {n}"] = cell(path, budget, args.policy, args.steps, n, carried=False)
            cells[f"lag {CARRIED_LAG}, carried"] = cell(path, budget, args.policy, args.steps, CARRIED_LAG)
            rows.append((label, budget, cells))
    command = "python bench/replay_cost_lag.py " + " ".join(argv if argv is not None else sys.argv[1:])
    emit(report(rows, args.lags, command.strip(), args.policy, args.steps), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
