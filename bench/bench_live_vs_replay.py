"""Live DTR against replay: one training step of each zoo model run live under
dtralloc.dtr(budget=F x peak, device="cpu"), next to dtralloc.replay() of the
same step's recorded trace at the same budget in bytes.

For each model: a warm-up step; one step recorded with the project's recorder
(dtralloc.trace.record); the live no-eviction peak (a dtr session without a
budget: the peak reserved bytes of its mirror pool) next to the replay's
no-eviction peak of the recorded trace; then, in alternating rounds, a plain
eager step and one live step per budget fraction F of the live peak. Reported
per cell: step time over plain (minimum of rounds), the bookkeeping share
(the live step at F = 1.0 over plain, where nothing is evicted), the recompute
share ((live at F - live at 1.0) / plain) next to the replay's
compute_overhead, and live evictions / remats next to the replay's. Cells
where live and replay differ by more than 20% are flagged with what explains
them: the replay's spread over one recording per round (op times differ from
step to step), and a check under the `size` policy, which reads no op cost:
one live step and one replay per budget whose event logs (the live session's
Session.events()) are compared, with the first event where they part.

The CPU mirror pool counts what the session allocates: storages made before
the session (parameters, optimizer state, the batch, last step's gradients)
are external and take no mirror memory (docs/live.md). The recorded trace
counts them as initial storages, placed first in the replay's pool. So the
replay here runs the trace as the mirror sees it: initial storages with no
bytes (Trace.session_view); the report gives the full trace's peak too.

    python bench/bench_live_vs_replay.py [--models lstm vit] [--budgets 1.0 0.7 0.5 0.35]
        [--rounds 3] [--policy dtralloc] [--out bench/results/live_vs_replay-DATE-cpu.md]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

import dtralloc
from dtralloc import _core
from dtralloc.dtr import dtr
from dtralloc.replay import POLICIES, min_feasible_budget, resident_floor
from dtralloc.trace import Trace
from dtralloc.trace.recorder import record
from dtralloc.zoo import COMPACT_SIZES, MODELS, NEEDS_TRANSFORMERS, build

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit, header  # noqa: E402
from bench_live_overhead import NoopMode  # noqa: E402

# Sizes at which each model's step peaks at 40-130 MiB of session storages
# and takes 0.2-3 s on one CPU core. The zoo's SMALL sizes are degenerate
# here: a whole small step fits in one 2 MiB small-pool segment, so every
# budget below 1.0 is under one segment and fails before any eviction could
# help. COMPACT_SIZES where the zoo has them; the others scaled down from
# their GPU sizes the same way (fewer layers, narrower, shorter sequences).
BENCH_SIZES: dict[str, dict] = {
    **COMPACT_SIZES,
    "gpt2": dict(batch=4, seq=128, layers=4, hidden=256, heads=4, vocab=8000),
    "bert": dict(batch=4, seq=128, layers=4, hidden=256, heads=4, intermediate=1024, vocab=8000),
    "llama": dict(batch=4, seq=128, layers=4, hidden=256, heads=4, intermediate=704, vocab=8000),
    "resnet50": dict(batch=8, image=64, base=32, classes=100),
    "unet": dict(batch=2, image=96, base=16, levels=4, classes=4),
    "mlp": dict(batch=256, features=1024, width=1024, layers=4, classes=100),
}

DEFAULT_BUDGETS = (1.0, 0.7, 0.5, 0.35)
TOLERANCE = 0.20  # the "agree within 20%"
COST_FREE_POLICY = "size"  # largest first: its choices depend on sizes and state only


def _step_time(step, session=None) -> float:
    gc.collect()  # what the last step left for the collector is not this step's
    start = time.perf_counter()
    if session is None:
        step()
    else:
        with session:
            step()
    return time.perf_counter() - start


def _live(step, budget: int, policy: str, events: bool = False) -> dict:
    """One live step under dtr(budget, device="cpu"): its time and stats,
    "oom" when the budget failed (the stats then count up to the failure)."""
    session = dtr(budget=budget, policy=policy, device="cpu")
    try:
        out = {"seconds": _step_time(step, session)}
    except dtralloc.OutOfMemoryError as e:
        out = {"oom": str(e).splitlines()[0]}
    out.update(session.stats())
    if events:
        out["events"] = {k: v.copy() for k, v in session.events().items()}
    return out


def _replay(trace: Trace, budget: int, policy: str) -> dict:
    r = dtralloc.replay(trace, budget=budget, policy=policy)
    return {"feasible": r.feasible, "compute_overhead": r.compute_overhead,
            "remat_seconds": r.remat_cost / 1e9,  # the recorder's durations are ns
            "evictions": r.evictions, "remats": r.remats, "eviction_calls": r.eviction_calls,
            "events": {k: v.copy() for k, v in r.events.items()}}


_KINDS = ("room asked", "evicted", "recomputed")  # EventKind, allocator/event_log.h


def first_divergence(live: dict, replay: dict, trace: Trace) -> str:
    """Where the live and replay event logs first differ, as (kind, bytes):
    the replay's op there, and what each side did."""
    a = list(zip(live["kind"].tolist(), live["bytes"].tolist()))
    b = list(zip(replay["kind"].tolist(), replay["bytes"].tolist()))
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i == len(a) == len(b):
        return "same events"

    def side(events, i):
        if i >= len(events):
            return "nothing more"
        kind, nbytes = events[i]
        return f"{_KINDS[kind]} {_core.format_bytes(nbytes)}"

    op = int(replay["op"][min(i, len(b) - 1)]) if b else -1
    where = f"replay op {op} ({trace.ops[op].name}, {'backward' if trace.ops[op].backward else 'forward'})" \
        if 0 <= op < len(trace.ops) else "the start"
    return f"event {i} of {len(a)} live / {len(b)} replay, at {where}: live {side(a, i)}, replay {side(b, i)}"


def measure_model(name: str, budgets: list[float], rounds: int, policy: str, echo) -> dict:
    sizes = BENCH_SIZES[name]
    torch.manual_seed(0)
    w = build(name, **sizes)
    w.step()  # optimizer state and lazy initialisation exist, as in any later step
    gc.collect()
    trace = record(w.step, name=name)
    session_trace = trace.session_view()
    replay_full = dtralloc.replay(trace)
    replay_none = dtralloc.replay(session_trace)
    echo(f"{name}: recorded {len(trace.ops)} ops; replay peak {_core.format_bytes(replay_none.peak_reserved_bytes)}")

    probe = dtr(policy=policy, device="cpu")
    _step_time(w.step, probe)
    live_none = probe.stats()
    peak = live_none["peak_bytes"]
    echo(f"{name}: live peak {_core.format_bytes(peak)}, {live_none['ops']} ops")
    cells = {f: {"budget": max(1, int(f * peak)), "live": [], "replay": []} for f in budgets}

    # Costs aside: under a policy that reads no op cost, live and replay see
    # the same sizes, so where the sequence of allocations, frees and reads
    # is the same they must make the same choices; where not, the event logs
    # say where they part.
    same = {}
    for f, cell in cells.items():
        r = _replay(session_trace, cell["budget"], COST_FREE_POLICY)
        live = _live(w.step, cell["budget"], COST_FREE_POLICY, events=True)
        same[f] = {"replay": (r["feasible"], r["evictions"], r["remats"], r["eviction_calls"]),
                   "live": ("oom" not in live, live["evictions"], live["remats"], live["eviction_calls"]),
                   "where": first_divergence(live["events"], r["events"], session_trace)}
    floor = resident_floor(session_trace)
    lowest = min_feasible_budget(session_trace, policy, method="scan", reference_bytes=peak)

    plain, noop = [], []
    for i in range(rounds):  # alternating: plain, then each budget, so load hits all alike
        plain.append(_step_time(w.step))
        noop.append(_step_time(w.step, NoopMode()))
        # One recording a round: the replay's choices follow the recorded op
        # times, which vary from step to step as the live ones do.
        recorded = session_trace if i == 0 else record(w.step, name=name).session_view()
        for f, cell in cells.items():
            cell["live"].append(_live(w.step, cell["budget"], policy))
            cell["replay"].append(_replay(recorded, cell["budget"], policy))
        echo(f"{name}: round {i + 1}/{rounds}: plain {plain[-1] * 1e3:.0f} ms, noop mode {noop[-1] * 1e3:.0f} ms, "
             + ", ".join(
            f"{f:g}: {c['live'][-1]['seconds'] * 1e3:.0f} ms" if "seconds" in c["live"][-1] else f"{f:g}: OOM"
            for f, c in cells.items()))
    return {"name": name, "sizes": sizes, "description": w.description, "trace_ops": len(trace.ops),
            "live_ops": live_none["ops"], "initial_bytes": sum(s.nbytes for s in trace.storages if s.initial),
            "replay_full_peak": replay_full.peak_reserved_bytes, "replay_peak": replay_none.peak_reserved_bytes,
            "replay_peak_allocated": replay_none.peak_allocated_bytes, "live_peak": peak,
            "live_peak_allocated": live_none["peak_allocated_bytes"], "live_none_evictions": live_none["evictions"],
            "plain": plain, "noop": noop, "cells": cells, "same": same,
            "floor": floor * replay_none.peak_reserved_bytes / peak, "lowest": lowest}


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _differs(live: float, replay: float, floor: float = 0.0) -> bool:
    """More than TOLERANCE apart, relative to the larger, and more than
    `floor` apart in absolute terms (0 and 0 agree)."""
    top = max(abs(live), abs(replay))
    return top > 0 and abs(live - replay) / top > TOLERANCE and abs(live - replay) > floor


def _spread(xs) -> tuple:
    return (min(xs), max(xs)) if xs else (float("nan"), float("nan"))


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def summarize(m: dict, base_fraction: float) -> list[dict]:
    """One row per budget: live and replay over rounds, the comparisons, and
    the flags with what explains them."""
    plain = min(m["plain"])
    noise = (max(m["plain"]) - plain) / plain  # how far apart identical plain steps landed
    base = min((r["seconds"] for r in m["cells"][base_fraction]["live"] if "seconds" in r), default=float("nan"))
    rows = []
    for f, cell in m["cells"].items():
        runs = [r for r in cell["live"] if "seconds" in r]
        reps = [r for r in cell["replay"] if r["feasible"]]
        row = {"fraction": f, "budget": cell["budget"], "live_fits": len(runs), "replay_fits": len(reps),
               "rounds": len(cell["live"])}
        if runs:
            t = min(r["seconds"] for r in runs)
            row.update(time_ratio=t / plain, recompute_share=(t - base) / plain,
                       evictions=_median([r["evictions"] for r in runs]), remats=_median([r["remats"] for r in runs]),
                       evictions_range=_spread([r["evictions"] for r in runs]),
                       remats_range=_spread([r["remats"] for r in runs]),
                       live_overhead=_median([r["compute_overhead"] for r in runs]),
                       recompute_seconds_share=min(r["recompute_seconds"] for r in runs) / plain)
        if reps:
            row.update(replay_share=_median([r["remat_seconds"] for r in reps]) / plain,
                       replay_overhead=_median([r["compute_overhead"] for r in reps]),
                       replay_evictions=_median([r["evictions"] for r in reps]),
                       replay_remats=_median([r["remats"] for r in reps]),
                       replay_evictions_range=_spread([r["evictions"] for r in reps]),
                       replay_remats_range=_spread([r["remats"] for r in reps]))
        flags, why = [], []
        if bool(runs) != bool(reps) or (runs and len(runs) != row["rounds"]) or (reps and len(reps) != row["rounds"]):
            flags.append(f"fits: live {len(runs)}/{row['rounds']}, replay {len(reps)}/{row['rounds']}")
        if runs and reps:
            if _differs(row["recompute_share"], row["replay_share"], noise):
                flags.append("time")
                if not _differs(row["recompute_seconds_share"], row["replay_share"]):
                    why.append(f"time: the session's own recompute time agrees with the replay's "
                               f"({row['recompute_seconds_share']:.3f}); the step times differ by more "
                               f"than it, within the machine's noise (plain rounds {noise:.0%} apart)")
                else:
                    why.append(f"time: the session spent {row['recompute_seconds_share']:.3f} of a step "
                               f"recomputing, the replay predicts {row['replay_share']:.3f}")
            if _differs(row["live_overhead"], row["replay_overhead"]):
                flags.append("overhead")
            for k in ("evictions", "remats"):
                if _differs(row[k], row["replay_" + k]):
                    flags.append(k)
                    if _overlap(row[k + "_range"], row["replay_" + k + "_range"]):
                        why.append(f"{k}: live's range meets the replay's over recordings (op-time noise)")
        same = m["same"][f]
        if flags and same["live"] != same["replay"]:
            why.append(f"`{COST_FREE_POLICY}` differs too: {same['where']}")
        elif flags and same["live"] == same["replay"] and same["live"][1]:
            why.append(f"`{COST_FREE_POLICY}` agrees: the choices follow the op costs")
        row["flags"], row["why"] = flags, why
        rows.append(row)
    return rows


def _range(r) -> str:
    lo, hi = r
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def report(models: list[dict], skipped: dict, budgets: list[float], rounds: int, policy: str, command: str) -> str:
    fb = _core.format_bytes
    base_fraction = max(budgets)
    out = [header("Live DTR against replay, zoo models on CPU", command),
           f"torch {torch.__version__}, {torch.get_num_threads()} threads; policy `{policy}` for both; "
           f"{rounds} alternating rounds (plain, then one live step per budget). The machine was shared "
           f"with other agents (2 cores): times are noisy.", ""]
    out += ["## No-eviction peak: live mirror pool against the replay", "",
            "| model | sizes | trace ops | live ops | live peak reserved | replay peak reserved (session view) "
            "| live / replay | peak allocated live / replay | full trace peak (initial storages in the pool) "
            "| initial storages | replay resident floor | replay lowest feasible |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        sizes = ", ".join(f"{k}={v}" for k, v in m["sizes"].items())
        out.append(f"| {m['name']} | {sizes} | {m['trace_ops']} | {m['live_ops']} | {fb(m['live_peak'])} | "
                   f"{fb(m['replay_peak'])} | {m['live_peak'] / m['replay_peak']:.3f} | "
                   f"{fb(m['live_peak_allocated'])} / {fb(m['replay_peak_allocated'])} | "
                   f"{fb(m['replay_full_peak'])} | {fb(m['initial_bytes'])} | {m['floor']:.2f} | "
                   f"{'-' if m['lowest'] is None else format(m['lowest'], '.2f')} |")
    out += ["", "Resident floor: the most bytes that must be resident at once (pinned values plus the op in "
            "flight), as a fraction of the live peak: no policy runs below it. Lowest feasible: the replay's "
            f"`min_feasible_budget(policy={policy!r}, method='scan')` on a 0.01 grid of the live peak."]
    out += ["", f"## Bookkeeping: the step at F = {base_fraction:g} (nothing evicted) against plain", "",
            "Minimum over rounds. noop mode: a TorchDispatchMode that only runs each op (bench_live_overhead.py), "
            "the floor any runtime built on dispatch pays; dtr: the live session at the budget, no evictions.", "",
            "| model | ATen ops (live) | plain ms | noop mode / plain | dtr / plain | dtr over plain, µs/op | "
            "dtr over noop mode, µs/op |", "|---|---|---|---|---|---|---|"]
    for m in models:
        plain, noop = min(m["plain"]), min(m["noop"])
        base = min((r["seconds"] for r in m["cells"][base_fraction]["live"] if "seconds" in r), default=float("nan"))
        n = m["live_ops"]
        out.append(f"| {m['name']} | {n} | {plain * 1e3:.0f} | {noop / plain:.2f} | {base / plain:.2f} | "
                   f"{(base - plain) / n * 1e6:.0f} | {(base - noop) / n * 1e6:.0f} |")
    out += ["", "## Per budget", "",
            f"Budget: F x the live no-eviction peak, in bytes, the same for live and replay. Times: the "
            f"minimum over rounds (the least disturbed by other load); counts: median (range) over rounds. "
            f"time: live step over plain (at F = {base_fraction:g}, where nothing is evicted, all of it "
            f"is bookkeeping). live extra: (live at F - live at {base_fraction:g}) / plain, the recompute "
            f"share of the step. replay extra: the replay's recompute cost in seconds (recorded op times) "
            f"/ plain, the same share predicted. recompute s: the session's own recompute_seconds / plain. "
            f"Overheads: recompute cost / base cost (compute_overhead), live from the ops' live-measured "
            f"costs, replay from the recorded ones. Replay: one recording per round, each replayed; median "
            f"(range). Flags: more than {TOLERANCE:.0%} apart (times: and more than the spread of the "
            f"plain rounds); fits: in how many rounds the step ran within the budget.", "",
            "| model | F | budget | time | live extra | replay extra | recompute s | live overhead | "
            "replay overhead | live evictions | replay evictions | live remats | replay remats | flags | why |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        for r in summarize(m, base_fraction):
            cols = [m["name"], f"{r['fraction']:g}", fb(r["budget"])]
            if r["live_fits"]:
                cols += [f"{r['time_ratio']:.2f}", f"{r['recompute_share']:+.3f}"]
            else:
                cols += ["OOM", "-"]
            cols.append(f"{r['replay_share']:.3f}" if r["replay_fits"] else "OOM")
            cols.append(f"{r['recompute_seconds_share']:.3f}" if r["live_fits"] else "-")
            cols.append(f"{r['live_overhead']:.3f}" if r["live_fits"] else "-")
            cols.append(f"{r['replay_overhead']:.3f}" if r["replay_fits"] else "-")
            for k in ("evictions", "remats"):
                cols.append(f"{r[k]:g} ({_range(r[k + '_range'])})" if r["live_fits"] else "-")
                rk = "replay_" + k
                cols.append(f"{r[rk]:g} ({_range(r[rk + '_range'])})" if r["replay_fits"] else "-")
            cols.append(", ".join(r["flags"]) or "ok")
            cols.append("; ".join(r["why"]))
            out.append("| " + " | ".join(cols) + " |")
    out += ["", f"## Same sequence, same decisions? (policy `{COST_FREE_POLICY}`, which reads no op cost)", "",
            "One live step and one replay per budget; (fits, evictions, remats, eviction calls). Equal tuples: "
            "the live driver fed the engine the same allocations, frees and reads as the trace, and the "
            "engine chose alike. Where not: the first event (call for room, eviction, recompute; with its "
            "bytes) where the two logs differ.", "", "| model | F | live | replay | equal | first difference |",
            "|---|---|---|---|---|---|"]
    for m in models:
        for f, pair in m["same"].items():
            live, rep = tuple(pair["live"]), tuple(pair["replay"])
            out.append(f"| {m['name']} | {f:g} | {live} | {rep} | {'yes' if live == rep else 'no'} | "
                       f"{'' if live == rep else pair['where']} |")
    if skipped:
        out += ["", "## Left out", ""] + [f"* {name}: {why}" for name, why in skipped.items()]
    return "\n".join(out) + "\n"


def measure_available(names, measure) -> tuple[list, dict]:
    """measure(name) for each zoo model whose packages are installed, and
    why each other one was skipped."""
    models, skipped = [], {}
    for name in names:
        if name in NEEDS_TRANSFORMERS:
            try:
                import transformers  # noqa: F401
            except ImportError:
                skipped[name] = 'needs transformers (pip install "dtralloc[zoo]")'
                continue
        models.append(measure(name))
    return models, skipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(BENCH_SIZES),
                        help=f"zoo models (default: all of {', '.join(BENCH_SIZES)})")
    parser.add_argument("--budgets", nargs="+", type=float, default=list(DEFAULT_BUDGETS),
                        help="fractions of the live no-eviction peak; the largest is the bookkeeping baseline "
                             "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    parser.add_argument("--policy", default="dtralloc", choices=[p for p in POLICIES if p != "none"],
                        help="eviction policy, live and replay (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default: %(default)s; one thread times steadily on a shared machine)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    unknown = [n for n in args.models if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; available: {', '.join(MODELS)}")
    if any(not 0 < f <= 1 for f in args.budgets):
        parser.error("--budgets are fractions in (0, 1]")
    budgets = sorted(set(args.budgets), reverse=True)
    torch.set_num_threads(args.threads)
    models, skipped = measure_available(args.models, lambda name: measure_model(
        name, budgets, args.rounds, args.policy, echo=lambda s: print(s, file=sys.stderr, flush=True)))
    command = "python bench/bench_live_vs_replay.py " + " ".join(argv if argv is not None else sys.argv[1:])
    emit(report(models, skipped, budgets, args.rounds, args.policy, command), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
