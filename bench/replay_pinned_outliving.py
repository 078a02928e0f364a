"""What pinning the storages a step leaves behind changes in replay.

A storage made during the recorded step and still alive after it
(Storage.outlives: the parameters' gradients, the loss) is held by the
program from the op that makes it; a live dtr() session can never evict it.
replay(pin_outliving=True), the default since 2026-11-23, pins it; before,
the replay took it for a recomputable value. This bench replays every given
trace both ways, side by side: the resident floor, each policy's lowest
feasible budget (scan, step 0.01 of the no-eviction peak) and its
compute_overhead at 0.7 and 0.5 of the peak.

    python bench/replay_pinned_outliving.py [--traces NAME ...] [--policies dtralloc dtr]
        [--jobs 2] [--out bench/results/replay_pinned_outliving-DATE-cpu.md]
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from multiprocessing import Pool

import dtralloc
from dtralloc import _core
from dtralloc.replay import min_feasible_budget, replay, resident_floor
from dtralloc.trace import load
from dtralloc.traces import list_bundled, load_bundled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit, header  # noqa: E402

BUDGETS = (0.7, 0.5)
STEP = 0.01


def measure(job) -> dict:
    name, policies = job
    trace = load_bundled(name) if name in list_bundled() else load(name)
    kept = [s for s in trace.storages if s.outlives and not s.initial]
    # One reference for both ways: the no-eviction peak does not depend on
    # what may be evicted.
    reference = replay(trace).peak_reserved_bytes
    row = {"name": name, "kept": len(kept), "kept_bytes": sum(s.nbytes for s in kept), "peak": reference}
    for pin in (False, True):
        side = row[pin] = {"floor": resident_floor(trace, pin_outliving=pin)}
        for policy in policies:
            side[policy] = {
                "min": min_feasible_budget(trace, policy, tolerance=STEP, method="scan",
                                           reference_bytes=reference, pin_outliving=pin),
                "overhead": {}}
            for f in BUDGETS:
                r = replay(trace, budget=max(1, int(f * reference)), policy=policy, pin_outliving=pin)
                side[policy]["overhead"][f] = r.compute_overhead if r.feasible else None
    print(f"{name}: done", file=sys.stderr, flush=True)
    return row


def _min(x) -> str:
    return "none" if x is None else f"{x:.2f}"


def _ov(x) -> str:
    return "OOM" if x is None else f"{x:.3f}"


def report(rows: list[dict], policies: list[str], command: str) -> str:
    out = [header("Replay with the step's leftovers pinned (gradients, the loss) against without", command), ""]
    out.append(
        f"torch-free replay of each trace twice: `pin_outliving=False` (before 2026-11-23: what outlives the "
        f"step replayed as recomputable) -> `pin_outliving=True` (pinned from the op that makes it, as a live "
        f"session finds it). kept: storages made in the step and alive after it. floor: `resident_floor`. "
        f"min: `min_feasible_budget(method=\"scan\", tolerance={STEP})`, fractions of the no-eviction peak "
        f"reserved (the same either way). Overheads: `compute_overhead` at "
        f"{' / '.join(str(f) for f in BUDGETS)} of the peak; OOM: infeasible.")
    out.append("")
    cols = ["trace", "kept", "floor"]
    for p in policies:
        cols += [f"{p} min"] + [f"{p} @{f}" for f in BUDGETS]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "---|" * len(cols))
    rose = {p: [] for p in policies}
    for r in rows:
        cells = [r["name"], f"{r['kept']} ({_core.format_bytes(r['kept_bytes'])}, "
                             f"{r['kept_bytes'] / r['peak']:.0%} of the peak)",
                 f"{r[False]['floor']:.3f} -> {r[True]['floor']:.3f}"]
        for p in policies:
            a, b = r[False][p], r[True][p]
            cells.append(f"{_min(a['min'])} -> {_min(b['min'])}")
            cells += [f"{_ov(a['overhead'][f])} -> {_ov(b['overhead'][f])}" for f in BUDGETS]
            if a["min"] is not None and b["min"] is not None:
                rose[p].append((b["min"] - a["min"], r["name"]))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for p in policies:
        if rose[p]:
            most = max(rose[p])
            changed = sum(1 for d, _ in rose[p] if abs(d) > 1e-9)
            out.append(f"- {p}: the lowest feasible budget moved on {changed} of {len(rose[p])} traces; "
                       f"most: {most[0]:+.2f} ({most[1]}).")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", default=None, help="bundled names or .dtrace paths (default: all bundled)")
    ap.add_argument("--policies", nargs="+", default=["dtralloc", "dtr"],
                    choices=[p for p in dtralloc.POLICIES if p != "none"])
    ap.add_argument("--jobs", type=int, default=2, help="traces replayed in parallel (processes)")
    ap.add_argument("--out", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    names = args.traces or list_bundled()
    for n in names:
        if n not in list_bundled() and not os.path.exists(n):
            ap.error(f"no bundled trace or file {n!r} (bundled: {', '.join(list_bundled())})")
    jobs = [(n, args.policies) for n in names]
    if args.jobs > 1:
        with Pool(args.jobs) as pool:
            rows = pool.map(measure, jobs, chunksize=1)
    else:
        rows = [measure(j) for j in jobs]
    command = "python bench/replay_pinned_outliving.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    emit(report(rows, args.policies, command.strip()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
