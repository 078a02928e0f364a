"""The device calls a pool makes in a training step replayed under a budget,
with eviction: cudaMalloc and cudaFree (each cudaFree waits for the device)
next to what the step recomputes, for pool settings side by side.

bench/segment_churn.py counts calls at a budget the step fits without
evicting; here the dtralloc policy evicts, and its release plans (evict a
segment's tensors so that the segment can be given back and one of the
request's size made) and the allocator's steps 3-4 give segments back and
make others all through the step. The replay starts from an empty pool, so
the first `segments (peak)` cudaMalloc calls are the pool filling up; the
rest, and every cudaFree, are churn. With --steps N (default 3) the step
runs N times in the one pool, as a training loop repeats it (replay(...,
steps=N)), and the cells count the last step: the steady state, where the
pool no longer starts empty, which is what every step after the first pays.

Default settings compared: the GPU's default pool (`split_oversize:on,
unmap_pages:off`: cudaMalloc'd segments, what dtralloc.install() runs on
cuda) and `arena:on` (the budget reserved in one segment at the first miss,
Note [arena] in docs/allocator.md). `overhead` is the replay's recompute
time over the step's (recorded op durations); the device calls are not in it.

    python bench/replay_device_calls.py [--traces resnet50 gpt2 ...] [--budgets 0.7 0.5 0.35]
        [--conf "split_oversize:on,unmap_pages:off" --conf arena:on] [--steps 3] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit, header  # noqa: E402

DEFAULT_CONFS = ("split_oversize:on,unmap_pages:off", "arena:on")
DEFAULT_BUDGETS = (0.7, 0.5, 0.35)


def _step_starts(op) -> list[int]:
    """Indices of a replay history's events where a new step begins: the op
    stamps restart at 0 each step (the trace's op index)."""
    import numpy as np

    return (np.flatnonzero((op[1:] < op[:-1]) & (op[1:] >= 0)) + 1).tolist()


def frees_without_eviction(r, num_ops: int, steps: int) -> int | None:
    """Of the counted step's cudaFree calls (the last of `steps`), how many
    came at an op that asked the evictor for nothing: the allocator giving
    back whole free segments of the wrong size to make one of the request's
    (steps 3-4 of its ladder), not room made by evicting. `r` is a feasible
    replay with history=True; None where its history ring wrapped."""
    if r.history_wrapped:
        return None
    import numpy as np

    h = r.history
    op = np.asarray(h["op"])
    action = np.asarray(h["action"])
    segment_free = list(h["action_names"]).index("segment_free")
    # The counted step begins after the last restart.
    restarts = _step_starts(op)
    start = restarts[-1] if steps > 1 and restarts else 0
    frees_at = op[start:][action[start:] == segment_free]
    counted = r.last_step_device_free_calls if steps > 1 else r.device_free_calls
    assert len(frees_at) == counted, f"{len(frees_at)} cudaFree in the step's history; the pool counted {counted}"
    # The event log numbers ops as the engine does, one per trace op per step.
    first = (steps - 1) * num_ops if steps > 1 else 0
    events = r.events
    kind, event_op = np.asarray(events["kind"]), np.asarray(events["op"])
    asked = {int(o) - first for o in event_op[(kind == 0) & (event_op >= first)]}
    return int(sum(int(o) not in asked for o in frees_at))


def async_waits(r, steps: int) -> int | None:
    """Of the counted step's segments made (the last of `steps`), how many
    would make the pool wait for the device under async_segments:on
    (docs/allocator.md, Note [async segments]), for a model of the driver's
    pool: it reuses a freed segment for a later one only whole (the smallest
    that fits), holds the rest until a synchronize (each step's start, and
    each wait), and a segment it had to make new waits where the driver would
    then hold more than the budget and the pool's segments. The fake runtime
    reuses the same way; a real driver may reuse more (it can split and join
    what it holds) or less. `r` is a replay with history=True; None where its
    history ring wrapped or pages were given back (unmap_pages: no async
    segments there)."""
    if r.history_wrapped:
        return None
    import numpy as np

    h = r.history
    names = list(h["action_names"])
    action = np.asarray(h["action"])
    if (action == names.index("segment_unmap")).any():
        return None
    restarts = _step_starts(np.asarray(h["op"]))
    counted_from = restarts[-1] if steps > 1 and restarts else 0
    restarts = set(restarts)
    made, freed = names.index("segment_alloc"), names.index("segment_free")
    live, held, waits = {}, [], 0  # live: address -> (segment bytes, the driver's chunk under it)
    for i, (kind, addr, size) in enumerate(zip(action.tolist(), h["addr"], h["size"])):
        if i in restarts:
            held.clear()  # the synchronize between steps gives back what the driver holds
        if kind == freed:
            held.append(live.pop(addr)[1])
        elif kind == made:
            fitting = [c for c in held if c >= size]
            if fitting:
                chunk = min(fitting)
                held.remove(chunk)
                live[addr] = (size, chunk)
                continue
            live[addr] = (size, size)
            ours = sum(s for s, _ in live.values())
            if sum(c for _, c in live.values()) + sum(held) > max(r.budget_bytes, ours):
                waits += i >= counted_from
                held.clear()
    return waits


def measure(trace, budget, conf: str, steps: int = 1, empty: bool = False) -> dict:
    from dtralloc.replay import replay
    from dtralloc.replay.run import _as_trace  # replay()'s own loader: a Trace, a .dtrace path or a bundled name

    t = _as_trace(trace)
    # A fraction of the default pool's peak, whatever `conf` says (a setting
    # that applies without a budget moves its own peak: Note [one step or a
    # loop], docs/allocator.md).
    reference = replay(t, policy="none", steps=steps, empty_cache_between_steps=empty).peak_reserved_bytes
    r = replay(t, budget=max(1, int(budget * reference)), policy="dtralloc", conf=conf, steps=steps, history=True,
               empty_cache_between_steps=empty)
    quiet = frees_without_eviction(r, len(t.ops), steps) if r.feasible else None
    if steps == 1:
        return {"feasible": r.feasible, "mallocs": r.device_alloc_calls, "frees": r.device_free_calls,
                "segments": r.segments_peak, "evictions": r.evictions, "overhead": r.compute_overhead,
                "frees_without_eviction": quiet}
    return {"feasible": r.feasible, "mallocs": r.last_step_device_alloc_calls if r.feasible else r.device_alloc_calls,
            "frees": r.last_step_device_free_calls if r.feasible else r.device_free_calls,
            "segments": r.segments_peak, "evictions": r.last_step_evictions,
            "overhead": r.last_step_compute_overhead, "failed_step": r.steps,
            "frees_without_eviction": quiet}


def break_even(base: dict, other: dict) -> str:
    """The price of a cudaMalloc + cudaFree pair (a share of the step's
    compute) at which `other` starts to cost less than `base`: the recompute
    it adds over the pairs it saves. "above X": cheaper when a pair costs
    more than X; "below X": when it costs less (`other` calls more);
    "always" / "never": whatever a pair costs; "-": one did not run."""
    if not (base["feasible"] and other["feasible"]):
        return "-"
    saved = (base["mallocs"] + base["frees"] - other["mallocs"] - other["frees"]) / 2
    extra = other["overhead"] - base["overhead"]
    if saved > 0:
        return "always" if extra <= 0 else f"above {extra / saved:.3%}"
    if saved < 0:
        return "never" if extra >= 0 else f"below {extra / saved:.3%}"
    return "always" if extra < 0 else "never"


def report(rows: list, command: str, confs, steps: int = 1, empty: bool = False) -> str:
    what = ("cudaMalloc / cudaFree in the step (from an empty pool: the first `segments (peak)` mallocs fill it), "
            "evictions, and the replay's recompute overhead (not counting the calls). OOM: the step did not fit."
            if steps == 1 else
            f"the step run {steps} times in one pool (a training loop: what a step kept, its gradients, dies as "
            f"the next begins); cudaMalloc / cudaFree in the last step (the steady state), the most segments "
            f"at once, and the last step's evictions and recompute overhead (not counting the calls). OOM "
            f"(step k: calls so far): a step did not fit.")
    if empty:
        what += (" Between steps the cache is given back (replay(empty_cache_between_steps=True), as a loop calling "
                 "torch.cuda.empty_cache() after each step): the last step's calls include those.")
    what += (" In brackets, of the cudaFree, those at ops that asked the evictor for nothing: the allocator "
             "giving back whole free segments to make one of another size (steps 3-4 of its ladder), not room "
             "made by evicting.")
    others = list(confs[1:])
    lines = [header("Device calls of a step replayed under a budget, with eviction (dtralloc policy)", command),
             "Per trace and budget (a fraction of the step's no-eviction peak on the default settings, the "
             "same bytes for every setting), for each pool setting: " + what, "",
             *([f"Break-even: the price of a cudaMalloc + cudaFree pair, as a share of the step's compute, at "
                f"which a setting starts to cost less than `{confs[0]}` (its extra recompute over the pairs it "
                f"saves: 'above 0.05%' means cheaper wherever a pair costs more than 0.05% of the step; "
                f"'always' / 'never': whatever a pair costs). A cudaFree waits for the device.", ""]
               if others else []),
             "| trace | budget | " + " | ".join(f"`{c}`" for c in confs)
             + "".join(f" | break-even, `{c}`" for c in others) + " |",
             "|---|---|" + "---|" * (len(confs) + len(others))]
    for trace, budget, cells in rows:
        out = []
        for c in confs:
            m = cells[c]
            if not m["feasible"]:
                where = f"step {m['failed_step']}: " if steps > 1 else ""
                out.append(f"OOM ({where}{m['mallocs']} / {m['frees']})")
                continue
            quiet = m.get("frees_without_eviction")
            where = f" ({quiet} at ops that evicted nothing)" if m["frees"] and quiet is not None else ""
            out.append(f"{m['mallocs']} / {m['frees']} calls{where}, {m['segments']} segments, "
                       f"{m['evictions']} evictions, overhead {m['overhead']:.3f}")
        out += [break_even(cells[confs[0]], cells[c]) for c in others]
        lines.append(f"| {trace} | {budget:g} | " + " | ".join(out) + " |")
    totals = []
    for c in confs:
        frees = sum(cells[c]["frees"] for _, _, cells in rows if cells[c]["feasible"])
        ran = sum(cells[c]["feasible"] for _, _, cells in rows)
        totals.append(f"`{c}`: {ran} of {len(rows)} ran, {frees} cudaFree in those"
                      + (" (last steps)" if steps > 1 else ""))
    lines += ["", "Totals: " + "; ".join(totals) + ".", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", help="bundled trace names or trace files (default: every bundled one)")
    parser.add_argument("--budgets", nargs="+", type=float, default=list(DEFAULT_BUDGETS))
    parser.add_argument("--conf", action="append", help="pool settings to compare (repeatable; default: "
                        + " and ".join(DEFAULT_CONFS) + ")")
    parser.add_argument("--steps", type=int, default=3,
                        help="run the step this many times in one pool and count the last (default 3; 1: one "
                             "step from an empty pool)")
    parser.add_argument("--empty-cache-between-steps", action="store_true",
                        help="give back the cached segments between steps, as a loop calling torch.cuda.empty_cache() "
                             "after each step does")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    if any(not 0 < b <= 1 for b in args.budgets):
        parser.error("--budgets are fractions of the peak in (0, 1]")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.empty_cache_between_steps and args.steps < 2:
        parser.error("--empty-cache-between-steps needs --steps 2 or more (there is no step between)")
    import dtralloc.traces as bundled

    traces = args.traces or bundled.list_bundled()
    confs = args.conf or list(DEFAULT_CONFS)
    rows = []
    for trace in traces:
        for budget in args.budgets:
            print(f"[replay_device_calls] {trace} at {budget:g}", file=sys.stderr, flush=True)
            cells = {c: measure(trace, budget, c, args.steps, args.empty_cache_between_steps) for c in confs}
            rows.append((os.path.basename(trace), budget, cells))
    command = "python bench/replay_device_calls.py " + " ".join(argv if argv is not None else sys.argv[1:])
    emit(report(rows, command.strip(), confs, args.steps, args.empty_cache_between_steps), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
