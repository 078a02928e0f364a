"""dtralloc against dtr over several recordings of the same models.

Recorded op durations differ from one recording to the next, so a policy
whose choice flips on small cost differences can win on the bundled trace of
a model and lose on the next recording of it. This bench replays the bundled
traces and any number of re-recordings (`--record N` records the zoo N more
times with bench/record_zoo.py; or pass saved traces) and checks, per trace,
what the policy bench targets for dtralloc (bench/replay_policies.py):

* holes: budgets on the 0.005 grid that fail above the lowest that runs;
* scan minimum (every grid budget from there up runs) <= dtr's;
* excess over the resident floor, (min - floor) / (dtr's min - floor);
* overhead <= 1.05x dtr's at 0.9, 0.7, 0.5, 0.4, 0.3, 0.2 where both run.

It also lists dtralloc's overhead spikes (not a target of the issue): budgets
on the grid where the step runs but recomputes more than its own compute, and
more than SPIKE_RATIO times what a budget at most SPIKE_SPAN above costs. A
user there gets a step several times slower than with a little more memory.

`--conf` changes dtralloc's pool settings only (dtr keeps the defaults), to
try a setting against every recording before changing a default. Budgets
are fractions of the step's no-eviction peak under the default settings,
whatever `--conf` says: a setting that raises that peak (an explicit
max_split_size_mb applies without a budget too, and took bert's to 1.03x
and lstm's to 1.11x of the default's at 40 MiB) would otherwise be judged
at more bytes than the default, and look better for it.

`--steps N` asks it of a training loop: each budget runs the step N times in
one pool (replay(steps=N): what a step kept dies as the next begins), fits
when every step does, and costs what the last step recomputes; fractions are
of the peak of N steps. A pool that no longer starts empty can rank settings
otherwise than one step from an empty pool does. `--empty-cache-between-steps`
gives the cache back between steps, as a loop calling torch.cuda.empty_cache()
after each step does (docs/allocator.md, Note [one step or a loop]).

    python bench/replay_recordings.py --traces bundled bench/recordings/1 bench/recordings/2 [--jobs 2] [--out FILE]
    python bench/replay_recordings.py --record 2 --dir /tmp/recordings      # the bundled traces and 2 new recordings
    python bench/replay_recordings.py --traces gpt2 bench/recordings/1/gpt2.dtrace --conf segment_fit:off
    python bench/replay_recordings.py ... --save all.json; then, after a dtralloc-only change: ... --dtr-from all.json
    python bench/replay_recordings.py --traces bundled --steps 3 --conf max_split_size_mb:none

bench/recordings/1 and 2 are two recordings of every zoo model made on
2026-11-23 (`python bench/record_zoo.py --out bench/recordings/N`, then the
compact ones with `--compact lstm vit encdec convbn moe`), kept so that
policy changes are judged against the same recordings.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import time
from multiprocessing import Pool
from types import SimpleNamespace

# One definition of the targets and how they are measured: the policy bench's.
from replay_policies import (BUDGETS, EXCESS_TARGET, FINE_STEP, FLOOR_BOUND, OVERHEAD_TARGET, excess_ratio,
                             mean_excess, scan_cell, scan_of, verdict)

HERE = os.path.dirname(os.path.abspath(__file__))
# What record_zoo.py records with no model named: every model at GPU scale, and the compact ones.
RECORD_ARGS = ([], ["--compact", "lstm", "vit", "encdec", "convbn", "moe"])


# An overhead spike (see the top): overhead over SPIKE_OVERHEAD and over
# SPIKE_RATIO times the least overhead at up to SPIKE_SPAN above.
SPIKE_OVERHEAD, SPIKE_RATIO, SPIKE_SPAN = 1.0, 3.0, 0.025


def spikes(overheads: dict) -> list:
    """[(budget, its overhead, the least just above)] from {fraction: overhead or None}."""
    out = []
    for b, o in sorted(overheads.items()):
        above = [v for f, v in overheads.items() if b < f <= b + SPIKE_SPAN + 1e-9 and v is not None]
        if o is not None and above and o > SPIKE_OVERHEAD and o > SPIKE_RATIO * min(above):
            out.append((b, o, min(above)))
    return out


# What the replays here modelled, saved with the figures: a --dtr-from file
# measured under another model does not compare (replay(pin_outliving=...)).
MODEL_KEY, MODEL = "_replay", {"pin_outliving": True, "pin_past_backward": True}


def measure(job):
    """One policy on one trace: overhead per budget, the 0.005 grid from 1.0
    to the floor, as fractions of the default pool's no-eviction peak (of
    `steps` steps)."""
    import dtralloc
    from dtralloc.traces import load_bundled

    trace_arg, policy, conf, steps, empty = job
    t0 = time.perf_counter()
    trace = dtralloc.trace.load(trace_arg) if trace_arg.endswith(".dtrace") else load_bundled(trace_arg)
    reference = dtralloc.replay(trace, policy="none", steps=steps, empty_cache_between_steps=empty).peak_reserved_bytes
    floor = dtralloc.resident_floor(trace)  # a share of one step's peak
    if steps > 1:
        floor *= dtralloc.replay(trace, policy="none").peak_reserved_bytes / reference
    # One replay per grid point gives feasibility, holes, the overheads at
    # BUDGETS (on the grid: k * FINE_STEP, the same bytes as replay(budget=b))
    # and the spikes.
    on_grid = dtralloc.overhead_grid(trace, policy, conf=conf, step=FINE_STEP, lowest=max(0.0, floor - FINE_STEP),
                                     reference_bytes=reference, steps=steps, empty_cache_between_steps=empty)
    overhead = {}
    for b in BUDGETS:
        if b in on_grid:
            overhead[b] = on_grid[b]
        else:  # below the grid, under the floor: replayed all the same, not assumed to fail
            r = dtralloc.replay(trace, budget=max(1, int(b * reference)), policy=policy, conf=conf, steps=steps,
                                empty_cache_between_steps=empty)
            overhead[b] = (r.last_step_compute_overhead if steps > 1 else r.compute_overhead) if r.feasible else None
    grid = {f: o is not None for f, o in on_grid.items()}
    lowest = min((f for f, fits in grid.items() if fits), default=None)
    return trace_arg, policy, dict(floor=floor, overhead=overhead, scan=scan_of(grid), lowest=lowest,
                                   holes=dtralloc.feasibility_holes(grid), spikes=spikes(on_grid),
                                   seconds=time.perf_counter() - t0)


def label(trace_arg: str) -> str:
    if os.path.sep not in trace_arg and not trace_arg.endswith(".dtrace"):
        return f"{trace_arg} (bundled)"
    return f"{os.path.basename(trace_arg)[:-len('.dtrace')]} ({os.path.basename(os.path.dirname(trace_arg))})"


def family(trace_arg: str) -> str:
    return os.path.basename(trace_arg).removesuffix(".dtrace")


def tables(traces, results) -> tuple:
    """The measured figures as the policy bench keys them (its `grid` and `floors`)."""
    grid, floors = {}, {}
    for t in traces:
        floors[t, "resident floor"] = results[(t, "dtralloc")]["floor"]
        for policy in ("dtralloc", "dtr"):
            r = results[(t, policy)]
            for key in ("scan", "lowest", "holes"):
                floors[t, policy, key] = r[key]
            for b in BUDGETS:
                overhead = r["overhead"][b]
                grid[t, policy, b] = SimpleNamespace(feasible=overhead is not None, compute_overhead=overhead)
    return grid, floors


def fmt_worst(t, worst, grid) -> str:
    if worst is None:
        return "-"
    b, ratio = worst
    mine, dtr = grid[t, "dtralloc", b].compute_overhead, grid[t, "dtr", b].compute_overhead
    return f"{'inf' if ratio == float('inf') else f'{ratio:.2f}'} at {b} ({mine:.3f} / {dtr:.3f})"


def report(traces, results, conf, command, note=None, steps: int = 1, empty: bool = False) -> str:
    import dtralloc
    from _report import header

    grid, floors = tables(traces, results)
    out = [header("dtralloc against dtr over several recordings", command)]
    out.append(f"dtralloc {dtralloc.__version__} from {os.path.dirname(dtralloc.__file__)}\n")
    if note:
        out.append(f"note: {note}\n")
    if conf:
        out.append(f"dtralloc's pool settings: `{conf}` (dtr: the defaults); budgets are fractions of the "
                   f"step's no-eviction peak on the default settings\n")
    if steps > 1:
        out.append(f"each budget runs the step {steps} times in one pool, as a training loop: it fits when every "
                   f"step does, its overhead is the last step's, and fractions are of the peak of {steps} steps"
                   + (", the cache given back between steps" if empty else "") + "\n")
    out.append(
        f"Per trace: the resident floor; dtralloc's and dtr's scan minimum on the {FINE_STEP} grid (every budget "
        "from there up runs; the lowest that runs in brackets where a hole lies between); dtralloc's holes; "
        f"its excess over the floor as a share of dtr's (`floor`: dtr within {FLOOR_BOUND} of the floor); its "
        f"worst overhead over dtr's at {', '.join(map(str, BUDGETS))} where both run and one recomputes "
        f"(dtralloc's / dtr's; target <= {OVERHEAD_TARGET}; inf: only dtralloc recomputes). The targets and "
        "how they are measured are bench/replay_policies.py's. Last, not a target: dtralloc's overhead spikes on "
        f"the grid (the step recomputes more than its compute and more than {SPIKE_RATIO:g}x what a budget at "
        f"most {SPIKE_SPAN} above costs: budget (its overhead / the least above)).\n")
    out.append("| trace | floor | dtralloc | dtr | holes | excess / dtr's | worst overhead / dtr's | met | spikes |")
    out.append("|---|---|---|---|---|---|---|---|---|")

    missed, holes, spiked = [], 0, 0
    for t in traces:
        found = results[(t, "dtralloc")]["spikes"]  # dtralloc is always measured here, never loaded
        spiked += len(found)
        spike_text = ", ".join(f"{b:g} ({o:.2f} / {low:.2f})" for b, o, low in found) or "-"
        worst, _, met = verdict(t, grid, floors)
        ratio = excess_ratio(t, "dtralloc", floors)
        hole_list = floors[t, "dtralloc", "holes"]
        hole_text = str(len(hole_list)) + (f" ({', '.join(f'{h:g}' for h in hole_list)})" if hole_list else "")
        excess_text = "floor" if ratio is None else f"{ratio:.2f}"
        out.append(f"| {label(t)} | {floors[t, 'resident floor']:.3f} | {scan_cell(t, 'dtralloc', floors)} | "
                   f"{scan_cell(t, 'dtr', floors)} | {hole_text} | {excess_text} | {fmt_worst(t, worst, grid)} | "
                   f"{'yes' if met else 'no'} | {spike_text} |")
        holes += len(hole_list)
        if not met:
            missed.append(label(t))
    out.append("")
    out.append("Per model, over its recordings: dtralloc's and dtr's scan minimum (each recording), dtralloc's holes in "
               "all, its worst overhead over dtr's, and in how many recordings every target is met.\n")
    out.append("| model | recordings | dtralloc min | dtr min | holes | worst overhead / dtr's | met |")
    out.append("|---|---|---|---|---|---|---|")
    families = {}
    for t in traces:
        families.setdefault(family(t), []).append(t)
    for name, members in families.items():
        verdicts = {t: verdict(t, grid, floors) for t in members}
        worst = max(((t, v[0]) for t, v in verdicts.items() if v[0] is not None), key=lambda x: x[1][1], default=None)
        worst_text = fmt_worst(*worst, grid) if worst else "-"
        holes_all = sum(len(floors[t, "dtralloc", "holes"]) for t in members)
        met = sum(v[2] for v in verdicts.values())
        out.append(f"| {name} | {len(members)} | {', '.join(scan_cell(t, 'dtralloc', floors) for t in members)} | "
                   f"{', '.join(scan_cell(t, 'dtr', floors) for t in members)} | {holes_all} | {worst_text} | "
                   f"{met} of {len(members)} |")
    out.append("")
    mean, counted = mean_excess(traces, floors)
    out.append(f"{len(traces)} traces; dtralloc holes in all: {holes}; excess over the floor, dtralloc's summed over "
               f"dtr's, on the {counted} not floor-bound: {'-' if mean is None else f'{mean:.2f}'} "
               f"(target <= {EXCESS_TARGET}); traces missing a target: {', '.join(missed) if missed else 'none'}; "
               f"dtralloc's overhead spikes in all: {spiked}.\n")
    return "\n".join(out)


def record(times: int, directory: str) -> list[str]:
    paths = []
    for k in range(1, times + 1):
        out = os.path.join(directory, str(k))
        for args in RECORD_ARGS:
            print(f"recording {' '.join(args) or 'the zoo at GPU scale'} into {out}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, os.path.join(HERE, "record_zoo.py"), *args, "--out", out],
                           check=True, stdout=subprocess.DEVNULL)
        paths += sorted(glob.glob(os.path.join(out, "*.dtrace")))
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", nargs="*",
                        help="bundled trace names, saved traces, folders of them (every *.dtrace inside), or "
                             "'bundled' for every bundled trace (the default)")
    parser.add_argument("--record", type=int, default=0, metavar="N", help="also record the zoo N more times")
    parser.add_argument("--dir", default=None, help="where --record writes (required with --record)")
    parser.add_argument("--conf", default=None, help="DTRALLOC_CONF settings for dtralloc's replays only")
    parser.add_argument("--steps", type=int, default=1, metavar="N",
                        help="run each budget's step N times in one pool and judge the last (a training loop's "
                             "steady state; default 1: one step from an empty pool)")
    parser.add_argument("--empty-cache-between-steps", action="store_true",
                        help="with --steps: give back the cached segments between steps, as a loop calling "
                             "torch.cuda.empty_cache() after each step does")
    parser.add_argument("--jobs", type=int, default=2, help="replays in parallel (worker processes)")
    parser.add_argument("--out", default=None, help="also write the report here")
    parser.add_argument("--note", default=None, help="a line for the report's header (what build, why)")
    parser.add_argument("--save", default=None, metavar="JSON", help="also write every figure measured here")
    parser.add_argument("--dtr-from", default=None, metavar="JSON",
                        help="take dtr's figures from a --save file instead of measuring them again (dtr is the "
                             "slow half; a change to dtralloc alone does not move them)")
    args = parser.parse_args(argv)
    if args.record < 0:
        parser.error("--record must be 0 or more")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.empty_cache_between_steps and args.steps < 2:
        parser.error("--empty-cache-between-steps needs --steps 2 or more (there is no step between)")
    if args.record and not args.dir:
        parser.error("--record needs --dir (where the recordings go)")
    sys.path.insert(0, HERE)
    from _report import emit

    from dtralloc.traces import list_bundled

    bundled = list_bundled()
    traces = []
    for t in args.traces or ["bundled"]:
        if t == "bundled":
            traces += bundled
        elif os.path.isdir(t):
            found = sorted(glob.glob(os.path.join(t, "*.dtrace")))
            if not found:
                parser.error(f"no *.dtrace file in {t}")
            traces += found
        elif os.path.sep in t or t.endswith(".dtrace"):
            if not os.path.isfile(t):
                parser.error(f"no such trace file: {t}")
            traces.append(t)
        elif t in bundled:
            traces.append(t)
        else:
            parser.error(f"{t!r} is neither a bundled trace ({', '.join(bundled)}) nor a path")
    if args.record:
        traces += record(args.record, args.dir)
    results = {}
    if args.dtr_from:
        try:
            with open(args.dtr_from) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            parser.error(f"--dtr-from {args.dtr_from}: {e}")
        model = dict(saved.get(MODEL_KEY) or {})
        saved_steps = model.pop("steps", 1)
        saved_empty = model.pop("empty_cache_between_steps", False)
        if model != MODEL:
            parser.error(f"--dtr-from {args.dtr_from} was measured under another model of what the program "
                         f"holds ({saved.get(MODEL_KEY)} there, {MODEL} now: before 2026-11-23 what outlives the "
                         f"step was recomputable; before 2026-11-24 so was what outlives the backward, the loss): "
                         f"its dtr figures do not compare with dtralloc's now. Measure both again (drop "
                         f"--dtr-from) and --save them")
        if saved_steps != args.steps:
            parser.error(f"--dtr-from {args.dtr_from} holds dtr's figures for {saved_steps} step(s) a budget, "
                         f"and --steps is {args.steps}: measure dtr with --steps {args.steps} (drop --dtr-from)")
        if saved_empty != args.empty_cache_between_steps:
            parser.error(f"--dtr-from {args.dtr_from} holds dtr's figures "
                         f"{'with' if saved_empty else 'without'} the cache given back between steps: measure "
                         f"dtr as this run does (drop --dtr-from)")
        for t in traces:
            r = saved.get(t, {}).get("dtr")
            if r is None:
                parser.error(f"--dtr-from {args.dtr_from} has no dtr figures for {t}")
            r["overhead"] = {float(b): v for b, v in r["overhead"].items()}
            results[(t, "dtr")] = r
    jobs = [(t, p, args.conf if p == "dtralloc" else None, args.steps, args.empty_cache_between_steps)
            for t in traces for p in ("dtralloc", "dtr") if (t, p) not in results]
    t0 = time.perf_counter()
    with Pool(max(1, args.jobs)) as pool:
        for done, (t, policy, r) in enumerate(pool.imap_unordered(measure, jobs), 1):
            results[(t, policy)] = r
            scan = "-" if r["scan"] is None else f"{r['scan']:.3f}"
            print(f"[{time.perf_counter() - t0:6.0f}s] {done}/{len(jobs)} {label(t)} {policy}: scan {scan}, "
                  f"{len(r['holes'])} holes ({r['seconds']:.0f}s)", file=sys.stderr, flush=True)
    if args.save:
        saved = {MODEL_KEY: dict(MODEL, **({"steps": args.steps} if args.steps > 1 else {}),
                                 **({"empty_cache_between_steps": True} if args.empty_cache_between_steps else {}))}
        for (t, policy), r in results.items():
            saved.setdefault(t, {})[policy] = r
        with open(args.save, "w") as f:
            json.dump(saved, f, indent=1)
    command = shlex.join(["python", "bench/replay_recordings.py", *(sys.argv[1:] if argv is None else argv)])
    emit(report(traces, results, args.conf, command, args.note, args.steps, args.empty_cache_between_steps), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
