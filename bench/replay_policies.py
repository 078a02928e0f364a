"""Eviction policies side by side, by replay of the bundled training steps.

For every bundled trace (the zoo at GPU scale, and the compact 70-150 MiB
ones) x budget {0.9, 0.7, 0.5, 0.4, 0.3, 0.2} of the no-eviction peak x every
policy: feasible?, compute overhead, fragmentation at forced evictions and
median victim-search time. Then each policy's feasibility on a grid of 0.005
of the peak from 1.0 down to the trace's resident floor
(`dtralloc.feasible_budgets`): its lowest feasible budget, the scan minimum
(the last budget before the first failure coming down from 1.0) and its
holes (failing budgets above the lowest feasible one); its minimum by
bisection; each minimum's excess over the resident floor as a share of
dtr's, with the traces where every policy sits at the floor named; next to
the static baselines (Chen's sqrt(n) checkpointing; Checkmate's MILP with
--checkmate, on graphs small enough, at the same bytes as the replays); and
the scan again with dtralloc's placement (max_split_size_mb:32,
segment_fit:on and small_in_large:on) given to every policy. Writes a markdown report and, if
matplotlib is installed, two plots.

    python bench/replay_policies.py [--traces NAME ...] [--checkmate] [--jobs 2] [--out-dir bench/results]
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from types import SimpleNamespace

BUDGETS = (0.9, 0.7, 0.5, 0.4, 0.3, 0.2)
POLICIES = tuple(p for p in __import__("dtralloc").POLICIES if p != "none")
# dtralloc's placement (what max_split_size_mb:auto and segment_fit:auto
# resolve to under dtralloc), given to every policy for the "same placement" table.
SAME_PLACEMENT = "max_split_size_mb:32,segment_fit:on,small_in_large:on"


def scan_with_conf(trace, policy: str, conf: str, peak: int, step: float = 0.01) -> float | None:
    """min_feasible_budget(method="scan") with `conf` for the eviction runs
    only: fractions stay of the default pool's no-eviction `peak`, the same
    denominator as every other table (an explicit conf would also change the
    no-eviction replay's peak)."""
    import dtralloc

    return dtralloc.min_feasible_budget(trace, policy, conf=conf, tolerance=step, method="scan",
                                        reference_bytes=peak)


SEARCH_REPEATS = 5  # replays pooled for the victim-search figures of dtr and dtralloc


def pooled_search_ns(trace, budget_bytes: int, policy: str) -> float:
    """Median victim-search time over the calls of SEARCH_REPEATS identical
    replays (the same victims each time). One replay's median is noisy where
    there are few calls: 2 at 0.9 of the peak on the transformers, so one
    scheduler hiccup is the figure."""
    import dtralloc

    ns = []
    for _ in range(SEARCH_REPEATS):
        ns += list(dtralloc.replay(trace, budget=budget_bytes, policy=policy).search_ns_per_call)
    ns.sort()
    return float(ns[len(ns) // 2]) if ns else 0.0  # the upper median, as ReplayResult.search_ns


# The feasibility grid: fine enough to see holes of one or two percent of
# the peak, which are what a user sees as "more memory and it ran out".
FINE_STEP = 0.005
# A trace is floor-bound when dtr's scan minimum is within this of the
# resident floor: there no policy can do much better than dtr, and the excess
# ratio below is a quotient of two rounding errors.
FLOOR_BOUND = 0.02


def _figures(r) -> SimpleNamespace:
    """What the report reads of a ReplayResult (plain data: it crosses processes)."""
    return SimpleNamespace(**{k: getattr(r, k) for k in (
        "feasible", "compute_overhead", "free_share_at_evictions", "eviction_calls", "evictions", "budget_bytes")})


def scan_of(grid: dict) -> float | None:
    """The scan minimum of a feasible_budgets grid: the last fraction before
    the first failure coming down from 1.0 (None if 1.0 fails)."""
    lowest = None
    for fraction, fits in sorted(grid.items(), reverse=True):
        if not fits:
            break
        lowest = fraction
    return lowest


def measure(name: str) -> dict:
    """Everything the report needs of one bundled trace (one worker's share)."""
    import dtralloc
    from dtralloc.traces import load_bundled

    trace = load_bundled(name)
    t0 = time.perf_counter()
    peak = dtralloc.replay(trace).peak_reserved_bytes
    floor = dtralloc.resident_floor(trace)
    out = {"peak": peak, "floor": floor, "grid": {}, "search": {}, "bisect": {}, "lowest": {}, "scan": {},
           "holes": {}, "same": {}}
    for policy in POLICIES:
        for budget in BUDGETS:
            r = dtralloc.replay(trace, budget=budget, policy=policy)
            out["grid"][policy, budget] = _figures(r)
            if policy in ("dtr", "dtralloc"):
                out["search"][policy, budget] = pooled_search_ns(trace, r.budget_bytes, policy)
        out["bisect"][policy] = dtralloc.min_feasible_budget(trace, policy, tolerance=0.01)
        fine = dtralloc.feasible_budgets(trace, policy, step=FINE_STEP, lowest=max(0.0, floor - FINE_STEP))
        ok = [f for f, fits in fine.items() if fits]
        out["lowest"][policy] = min(ok) if ok else None
        out["scan"][policy] = scan_of(fine)
        out["holes"][policy] = dtralloc.feasibility_holes(fine)
        out["same"][policy] = scan_with_conf(trace, policy, SAME_PLACEMENT, peak)
    out["seconds"] = time.perf_counter() - t0
    return out


def sweep(names, jobs: int, echo):
    """measure() over the traces, `jobs` at a time; keyed as the report reads it."""
    grid, floors, peaks = {}, {}, {}
    if jobs > 1:
        from multiprocessing import Pool

        with Pool(jobs) as pool:
            results = pool.imap(measure, names)
            measured = {}
            for name, m in zip(names, results):
                measured[name] = m
                echo(f"{name:<16} {m['seconds']:.0f}s")
    else:
        measured = {}
        for name in names:
            measured[name] = measure(name)
            echo(f"{name:<16} {measured[name]['seconds']:.0f}s")
    for name, m in measured.items():
        peaks[name] = m["peak"]
        floors[name, "resident floor"] = m["floor"]
        for (policy, budget), r in m["grid"].items():
            grid[name, policy, budget] = r
        for (policy, budget), ns in m["search"].items():
            grid[name, policy, budget, "search"] = ns
        for policy in POLICIES:
            floors[name, policy] = m["bisect"][policy]
            floors[name, policy, "scan"] = m["scan"][policy]
            floors[name, policy, "lowest"] = m["lowest"][policy]
            floors[name, policy, "holes"] = m["holes"][policy]
            floors[name, policy, "same"] = m["same"][policy]
    return grid, floors, peaks


def baselines(names, peaks, checkmate: bool, echo):
    """Chen's plan; where a pool that never fragments would first evict at each
    budget; with `checkmate`, the MILP's optimum at each budget. Budgets are
    bytes, the same fractions of the default pool's no-eviction peak reserved
    (`peaks`, from sweep) as the replays' (the baselines' own fractions are of
    the live-byte peak)."""
    from dtralloc import baselines as B
    from dtralloc.traces import load_bundled

    out = {}
    for name in names:
        trace = load_bundled(name)
        out[name, "chen"] = B.checkpoint_sqrt_n(trace)
        peak = peaks[name]
        for budget in BUDGETS:
            out[name, "packed", budget] = B.first_eviction_packed(trace, int(budget * peak))
        if not checkmate:
            continue
        for budget in BUDGETS:
            t0 = time.perf_counter()
            cm = out[name, "checkmate", budget] = B.checkmate(trace, int(budget * peak), time_limit_s=60)
            echo(f"{name:<9} checkmate {budget}: {cm.status} ({time.perf_counter() - t0:.0f}s)")
            if cm.status == "too large":
                break  # the same at every budget
    return out


def vs_milp(name, grid, base) -> str:
    """dtralloc's overhead / the MILP's, per budget where both have a plan and
    one of them recomputes; the MILP's budget is the same bytes."""
    cells = []
    for b in BUDGETS:
        cm, mine = base.get((name, "checkmate", b)), grid[name, "dtralloc", b]
        if cm is None or not cm.feasible or not mine.feasible:
            continue
        if cm.compute_overhead > 0:
            cells.append(f"{b}: {mine.compute_overhead / cm.compute_overhead:.2f}")
        elif mine.compute_overhead > 0:
            cells.append(f"{b}: MILP 0, ours {mine.compute_overhead:.3f}")
    return ", ".join(cells) or "-"


def floor_bound(name, floors) -> bool:
    """dtr's scan minimum within FLOOR_BOUND of the resident floor (or dtr never runs)."""
    dtr = floors[name, "dtr", "scan"]
    return dtr is not None and dtr - floors[name, "resident floor"] <= FLOOR_BOUND


def excess_ratio(name, policy, floors) -> float | None:
    """(policy's scan minimum - floor) / (dtr's - floor); None where either is missing or floor-bound."""
    mine, dtr, floor = floors[name, policy, "scan"], floors[name, "dtr", "scan"], floors[name, "resident floor"]
    if mine is None or dtr is None or floor_bound(name, floors):
        return None
    return (mine - floor) / (dtr - floor)


def overhead_ratios(name, grid) -> list:
    """(budget, dtralloc's overhead / dtr's) at every bench budget where both
    are feasible and one of them recomputes (inf where only dtralloc does)."""
    out = []
    for b in BUDGETS:
        mine, dtr = grid[name, "dtralloc", b], grid[name, "dtr", b]
        if not (mine.feasible and dtr.feasible) or mine.compute_overhead == dtr.compute_overhead == 0:
            continue
        out.append((b, mine.compute_overhead / dtr.compute_overhead if dtr.compute_overhead > 0 else math.inf))
    return out


OVERHEAD_TARGET = 1.05  # dtralloc's overhead at most 5% above dtr's at every budget where both run
EXCESS_TARGET = 0.6     # mean excess over the floor at most 0.6 of dtr's, traces not floor-bound


def verdict(name, grid, floors) -> tuple:
    """dtralloc against issue 16's targets on one trace: (worst overhead ratio
    as (budget, ratio) or None, min <= dtr's, every target met)."""
    worst = max(overhead_ratios(name, grid), key=lambda x: x[1], default=None)
    mine, dtr = floors[name, "dtralloc", "scan"], floors[name, "dtr", "scan"]
    min_ok = mine is not None and (dtr is None or mine <= dtr + 1e-9)
    met = min_ok and not floors[name, "dtralloc", "holes"] and (worst is None or worst[1] <= OVERHEAD_TARGET)
    return worst, min_ok, met


def mean_excess(names, floors) -> tuple:
    """(dtralloc's summed excess over the floor over dtr's, or None; how many
    traces it counts): the traces that are not floor-bound and where both run."""
    mine = dtr = 0.0
    counted = 0
    for name in names:
        if excess_ratio(name, "dtralloc", floors) is not None:
            mine += floors[name, "dtralloc", "scan"] - floors[name, "resident floor"]
            dtr += floors[name, "dtr", "scan"] - floors[name, "resident floor"]
            counted += 1
    return (mine / dtr if dtr > 0 else None), counted


def scan_cell(name, policy, floors) -> str:
    """A policy's scan minimum, and in brackets the lowest feasible budget
    where it is lower (a hole lies between); '-' where it never runs."""
    scan, lowest = floors[name, policy, "scan"], floors[name, policy, "lowest"]
    if scan is None:
        return "-"
    return f"{scan:.3f}" + (f" ({lowest:.3f})" if lowest is not None and lowest < scan else "")


def targets(names, grid, floors) -> list:
    """Issue 16's targets for dtralloc, computed from the sweep."""
    out = ["\n## Targets for dtralloc, from the numbers above\n",
           (f"Scan minimum on the {FINE_STEP} grid (lowest feasible in brackets where it is lower: a hole lies "
            f"between); holes: failing budgets above the lowest feasible one; excess: (min - floor) / "
            f"(dtr's min - floor), `floor` where dtr's minimum is within {FLOOR_BOUND} of the floor "
            f"(floor-bound: no policy can do much better than dtr there); worst overhead: the largest "
            f"dtralloc / dtr overhead ratio over the budgets {', '.join(map(str, BUDGETS))} where both run "
            f"(target <= {OVERHEAD_TARGET}; inf: only dtralloc recomputes).\n"),
           ("| trace | floor | dtralloc | dtr | msps | dtralloc holes | excess / dtr's | worst overhead / dtr's | "
            "min <= dtr's | all met |"),
           "|---|---|---|---|---|---|---|---|---|---|"]

    bound, failed = [], []
    for name in names:
        holes = floors[name, "dtralloc", "holes"]
        ratio = excess_ratio(name, "dtralloc", floors)
        floor = floors[name, "resident floor"]
        if floor_bound(name, floors):
            bound.append(name)
        worst, min_ok, met = verdict(name, grid, floors)
        if not met:
            failed.append(name)
        out.append(f"| {name} | {floor:.3f} | {scan_cell(name, 'dtralloc', floors)} | {scan_cell(name, 'dtr', floors)} | "
                   f"{scan_cell(name, 'msps', floors)} | "
                   f"{len(holes)}{' (' + ', '.join(f'{h:.3f}' for h in holes) + ')' if holes else ''} | "
                   f"{'floor' if name in bound else (f'{ratio:.2f}' if ratio is not None else '-')} | "
                   f"{f'{worst[1]:.2f} at {worst[0]}' if worst else '-'} | {'yes' if min_ok else 'no'} | "
                   f"{'yes' if met else 'no'} |")
    mean, counted = mean_excess(names, floors)
    out.append("")
    out.append(f"Floor-bound traces: {', '.join(bound) or 'none'}. Mean excess over the floor, dtralloc / dtr, "
               f"over the {counted} traces that are not: "
               f"{f'{mean:.2f}' if mean is not None else '-'} (target <= {EXCESS_TARGET}). "
               f"Traces missing a target: {', '.join(failed) or 'none'}.")
    return out


def earlier_targets(names, grid, floors, base) -> list:
    """Issue 4's figures for dtralloc: best other policy, same placement, the
    MILP, fragmentation and search time."""
    dynamic = [p for p in POLICIES if p != "dtralloc"]
    out = ["\n## dtralloc against the other policies, the MILP, fragmentation and search time\n",
           "Min budgets as bisection / scan; \"same placement\": the best other policy's scan when "
           "it too runs with `" + SAME_PLACEMENT + "`; / MILP: dtralloc's overhead over the "
           "Checkmate optimum at the same bytes, where it solves (`--checkmate`).\n",
           ("| trace | dtralloc min | best other (policy) | same placement (policy) | / dtr min "
            "| overhead <= dtr where both fit | / MILP | frag / dtr's (per budget) | median search us (per budget) |"),
           "|---|---|---|---|---|---|---|---|---|"]

    def best_other(name, key):
        others = [(floors[(name, p) + key], p) for p in dynamic if floors[(name, p) + key] is not None]
        return min(others) if others else (None, "-")

    def pair(a, b, fmt="{:.3f}"):
        return "/".join(fmt.format(x) if x is not None else "-" for x in (a, b))

    for name in names:
        mine = floors[name, "dtralloc"]
        (best, who), (best_s, who_s) = best_other(name, ()), best_other(name, ("scan",))
        best_same, who_same = best_other(name, ("same",))
        same = f"{best_same:.2f} ({who_same})" if best_same is not None else "-"
        mine_s, dtr, dtr_s = floors[name, "dtralloc", "scan"], floors[name, "dtr"], floors[name, "dtr", "scan"]
        ratio = pair(mine / dtr if mine is not None and dtr else None,
                     mine_s / dtr_s if mine_s is not None and dtr_s else None, "{:.2f}")
        both = [b for b in BUDGETS if grid[name, "dtr", b].feasible and grid[name, "dtralloc", b].feasible
                and grid[name, "dtr", b].evictions > 0]
        worse = [f"{b}: {grid[name, 'dtralloc', b].compute_overhead:.3f} vs {grid[name, 'dtr', b].compute_overhead:.3f}"
                 for b in both if grid[name, "dtralloc", b].compute_overhead > grid[name, "dtr", b].compute_overhead]
        overhead = "yes" if both and not worse else ("no forced eviction" if not both else "no (" + "; ".join(worse) + ")")
        frag = ", ".join(
            f"{b}: {grid[name, 'dtralloc', b].free_share_at_evictions / grid[name, 'dtr', b].free_share_at_evictions:.2f}"
            for b in both if grid[name, "dtr", b].free_share_at_evictions > 0)
        search = ", ".join(f"{b}: {grid[name, 'dtralloc', b, 'search'] / 1e3:.0f}"
                           for b in BUDGETS if grid[name, "dtralloc", b].eviction_calls)
        out.append(f"| {name} | {pair(mine, mine_s)} | {pair(best, best_s)} ({who}/{who_s}) | {same} | {ratio} | "
                   f"{overhead} | {vs_milp(name, grid, base)} | {frag or '-'} | {search or '-'} |")
    return out


def policy_columns(names, cell) -> list:
    """A markdown table, a row per trace and a column per policy: cell(name, policy)."""
    lines = ["| trace | " + " | ".join(POLICIES) + " |", "|---|" + "---|" * len(POLICIES)]
    lines += [f"| {name} | " + " | ".join(cell(name, p) for p in POLICIES) + " |" for name in names]
    return lines


def fmt_cell(r) -> str:
    if not r.feasible:
        return "OOM"
    return f"{r.compute_overhead:.3f}"


def report(names, grid, floors, base, command: str) -> str:
    from _report import header

    lines = [header("Eviction policies by replay of the bundled traces", command), ""]
    lines.append("## Minimum feasible budget (fraction of the no-eviction peak reserved; lower is better)\n")
    for title, key in (("By bisection (`min_feasible_budget`, tolerance 0.01)", ()),
                       ((f"By scan on the {FINE_STEP} grid (`feasible_budgets`: every budget on the grid from "
                         f"here up is feasible)"), ("scan",))):
        lines.append(f"{title}:\n")
        lines.append("| trace | " + " | ".join(POLICIES) + " | Chen sqrt(n) peak (of live) | resident floor |")
        lines.append("|---|" + "---|" * (len(POLICIES) + 2))
        for name in names:
            cells = [f"{floors[(name, p) + key]:.3f}" if floors[(name, p) + key] is not None else "-"
                     for p in POLICIES]
            chen = base[name, "chen"]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {chen.peak_fraction:.2f} | "
                         f"{floors[name, 'resident floor']:.3f} |")
        lines.append("")
    lines.append("Chen sqrt(n) peak (of live): the plan's live-byte peak as a share of the step's "
                 "live-byte peak (`BaselineResult.peak_fraction`; the static baselines count live bytes, "
                 "not the pool's reserved bytes). "
                 "resident floor = `dtralloc.resident_floor`: pinned bytes plus the op's own inputs and "
                 "outputs at the worst op; no policy can run below it.\n")
    lines.append(f"Feasibility holes on the {FINE_STEP} grid from 1.0 down to the resident floor: the "
                 "lowest feasible budget, and in brackets how many budgets above it fail (a failing budget "
                 "above a working one: the pool's layout, and so which tensors are evicted when, changes "
                 "with the budget):\n")
    def holes_cell(name, p):
        lowest, holes = floors[name, p, "lowest"], floors[name, p, "holes"]
        return "-" if lowest is None else f"{lowest:.3f}" + (f" ({len(holes)})" if holes else "")

    lines += policy_columns(names, holes_cell)
    lines.append("\nHoles in all, per policy: " + ", ".join(
        f"{p} {sum(len(floors[n, p, 'holes']) for n in names)} on "
        f"{sum(1 for n in names if floors[n, p, 'holes'])} traces" for p in POLICIES) + ".\n")
    lines.append("Excess of each policy's scan minimum over the resident floor, as a share of dtr's "
                 f"(`floor`: the trace is floor-bound, dtr within {FLOOR_BOUND} of the floor):\n")
    def excess_cell(name, p):
        r = excess_ratio(name, p, floors)
        return "floor" if floor_bound(name, floors) else ("-" if r is None else f"{r:.2f}")

    lines += policy_columns(names, excess_cell)
    lines.append("")
    lines.append("By scan with the same placement for every policy: `" + SAME_PLACEMENT + "` (what "
                 "`max_split_size_mb:auto`, `segment_fit:auto` and `small_in_large:auto` give dtralloc alone), fractions still of the default "
                 "pool's peak. It separates what dtralloc's placement gains from what its victim "
                 "choice gains:\n")
    lines += policy_columns(names, lambda name, p: f"{floors[name, p, 'same']:.2f}"
                            if floors[name, p, "same"] is not None else "-")
    lines += targets(names, grid, floors)
    lines += earlier_targets(names, grid, floors, base)
    lines.append("\n## Compute overhead (extra compute / one pass; OOM = infeasible)\n")
    for name in names:
        lines.append(f"### {name}\n")
        lines.append("| policy | " + " | ".join(str(b) for b in BUDGETS) + " |")
        lines.append("|---|" + "---|" * len(BUDGETS))
        for p in POLICIES:
            lines.append(f"| {p} | " + " | ".join(fmt_cell(grid[name, p, b]) for b in BUDGETS) + " |")
        chen = base[name, "chen"]
        lines.append(f"\nChen sqrt(n): overhead {chen.compute_overhead:.3f} at a peak of "
                     f"{chen.peak_fraction:.2f} of the live-byte peak.")
        solved = [(b, base[name, "checkmate", b]) for b in BUDGETS if (name, "checkmate", b) in base]
        if solved and solved[0][1].status == "too large":
            from dtralloc.baselines import MAX_GROUPS

            lines.append(f"Checkmate's MILP: not solved, {solved[0][1].details['groups']} op groups "
                         f"(the exact model takes at most {MAX_GROUPS['exact']}).")
        elif solved:
            lines.append("Checkmate's MILP at the same bytes: " + "; ".join(
                f"{b}: {cm.compute_overhead:.3f}" if cm.feasible else f"{b}: {cm.status}"
                for b, cm in solved) + ".")
        lines.append("")
    lines.append("## dtr vs dtralloc: fragmentation at forced evictions and victim search\n")
    lines.append("| trace | budget | dtr overhead | dtralloc overhead | dtr frag | dtralloc frag | "
                 "packed first frag | dtr search us | dtralloc search us | dtr calls | dtralloc calls |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for b in BUDGETS:
            d, o = grid[name, "dtr", b], grid[name, "dtralloc", b]
            if not (d.feasible or o.feasible):
                continue
            packed = base[name, "packed", b]
            lines.append(f"| {name} | {b} | {fmt_cell(d)} | {fmt_cell(o)} | {d.free_share_at_evictions:.3f} | "
                         f"{o.free_share_at_evictions:.3f} | {f'{packed.free_fraction:.3f}' if packed else '-'} | "
                         f"{grid[name, 'dtr', b, 'search'] / 1e3:.1f} | "
                         f"{grid[name, 'dtralloc', b, 'search'] / 1e3:.1f} | "
                         f"{d.eviction_calls} | {o.eviction_calls} |")
    lines.append("\nfrag = mean (budget - allocated) / budget when the evictor is forced to act; "
                 "packed first frag = the same at the first forced eviction of a pool that never "
                 "fragments (`baselines.first_eviction_packed`; -: it never has to), the reference "
                 "where there are few calls: there the free share is set by when the call comes "
                 "and how big its request is; search = median time to choose victims over the calls of "
                 f"{SEARCH_REPEATS} identical replays.")
    return "\n".join(lines) + "\n"


def plots(names, grid, floors, out_dir: str, stamp: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    cols = min(4, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for p in POLICIES:
            xs = [b for b in BUDGETS if grid[name, p, b].feasible]
            ys = [grid[name, p, b].compute_overhead for b in xs]
            ax.plot(xs, ys, marker="o", label=p, linewidth=2.5 if p == "dtralloc" else 1)
        if not any(grid[name, p, b].feasible for p in POLICIES for b in BUDGETS):
            ax.text(0.5, 0.5, "no policy fits any budget shown", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_title(name)
        ax.set_xlabel("budget / no-eviction peak")
        ax.set_ylabel("compute overhead")
        ax.set_yscale("symlog", linthresh=0.01)
        ax.invert_xaxis()
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, f"replay_policies-overhead-{stamp}.png")
    fig.savefig(path, dpi=90)
    files.append(path)
    fig, ax = plt.subplots(figsize=(max(10, len(names)), 4))
    width = 0.8 / len(POLICIES)
    for i, p in enumerate(POLICIES):
        ax.bar([j + i * width for j in range(len(names))],
               [floors[n, p] if floors[n, p] is not None else 1.0 for n in names], width, label=p)
    ax.set_xticks([j + 0.4 for j in range(len(names))], names)
    ax.set_ylabel("min feasible budget (bisection)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path = os.path.join(out_dir, f"replay_policies-min-budget-{stamp}.png")
    fig.savefig(path, dpi=90)
    files.append(path)
    return files


def main() -> int:
    from dtralloc.traces import list_bundled

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="*", help="bundled trace names (default: all)")
    parser.add_argument("--checkmate", action="store_true", help="also solve Checkmate's MILP (slow)")
    parser.add_argument("--jobs", type=int, default=1, help="traces measured at once (worker processes)")
    parser.add_argument("--out-dir", help="write the report and plots here")
    args = parser.parse_args()
    names = args.traces or list_bundled()

    def echo(text):
        print(text, file=sys.stderr, flush=True)

    command = "python bench/replay_policies.py" + (" --traces " + " ".join(args.traces) if args.traces else "") \
        + (" --checkmate" if args.checkmate else "") + (f" --jobs {args.jobs}" if args.jobs > 1 else "")
    grid, floors, peaks = sweep(names, args.jobs, echo)
    base = baselines(names, peaks, args.checkmate, echo)
    text = report(names, grid, floors, base, command)
    print(text)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        stamp = f"{datetime.date.today().isoformat()}-cpu"
        with open(os.path.join(args.out_dir, f"replay_policies-{stamp}.md"), "w") as f:
            f.write(text)
        for path in plots(names, grid, floors, args.out_dir, stamp):
            echo(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
