"""What a replay measured (ReplayResult), the policy table, and the plain-text
tables of both."""
from __future__ import annotations

from .. import _core

# The eviction policies, in the order of the table they are declared in
# (allocator/policies.h): names, one-line docs and how each chooses.
POLICY_TABLE: tuple[dict, ...] = tuple(_core.policies())
POLICIES: tuple[str, ...] = tuple(p["name"] for p in POLICY_TABLE)

# What one replay measured: a C++ class (allocator/replay_driver.h declares
# its figures once). Fractional budgets are shares of
# `no_eviction_peak_reserved_bytes`; `budget_bytes` is always the cap applied.
ReplayResult = _core.ReplayResult


def format_policies_markdown() -> str:
    """The policy table as markdown (the README's copy is checked against it)."""
    rows = ["| policy | chooses | a victim costs | per byte | what it does |", "|---|---|---|---|---|"]
    for p in POLICY_TABLE:
        if p["choice"] == "none":
            rows.append(f"| `{p['name']}` | - | - | - | {p['doc']} |")
            continue
        per_byte = "yes" if p["per_byte"] else "no"
        if p["free_neighbours"]:
            per_byte += ", free neighbours counted"
        if p["staleness"]:
            per_byte += "; / staleness"
        cost = p["cost"] + (" x penalty^recomputes" if p["penalty"] else "")
        if p["recency"]:
            cost += f" (never recomputed: x (1 + {p['recent_ops']:g} / ops since last use))"
        choice = "one tensor a call" if p["choice"] == "single" else "a window or whole segments"
        rows.append(f"| `{p['name']}` | {choice} | {cost} | {per_byte} | {p['doc']} |")
    return "\n".join(rows)


def table_row(r: ReplayResult, eviction_columns: bool = False, last_step: bool = False) -> dict:
    """One table row; `eviction_columns` adds policy, overhead, evictions and
    remats (format_results adds them when any row used a policy); `last_step`
    the last step's device calls and overhead (replays of several steps)."""
    fb = _core.format_bytes
    sampled = len(r.series["op"]) > 0
    row = {
        "trace": r.name,
        "conf": r.conf or "(defaults)",
        "budget": fb(r.budget_bytes) if r.budget_bytes else "none",
        "feasible": "yes" if r.feasible else (
            (f"OOM at op {r.oom_op}" + (f" of step {r.steps}" if r.steps > 1 else ""))
            if r.oom_op >= 0 else "OOM: initial storages"),
        "peak allocated": fb(r.peak_allocated_bytes),
        "peak reserved": fb(r.peak_reserved_bytes),
        "reserved/allocated": f"{r.reserved_over_allocated:.3f}",
        # Sampled per op; "-" where no op completed.
        "mean 1-alloc/res": f"{r.mean_reserved_fragmentation:.3f}" if sampled else "-",
        "mean ext. frag": f"{r.mean_external_fragmentation:.3f}" if sampled else "-",
        "segments (peak)": str(r.segments_peak),
        "cudaMalloc calls": str(r.device_alloc_calls),
    }
    if eviction_columns:
        row.update({
            "policy": r.policy,
            "overhead": f"{r.compute_overhead:.3f}",
            "evictions": str(r.evictions),
            "remats": str(r.remats),
        })
    if last_step:
        done = r.feasible
        row.update({
            "steps": str(r.steps),
            "last step cudaMalloc/cudaFree": (f"{r.last_step_device_alloc_calls}/{r.last_step_device_free_calls}"
                                              if done else "-"),
        })
        if eviction_columns:
            row["last step overhead"] = f"{r.last_step_compute_overhead:.3f}" if done else "-"
    return row


def format_results(results: list[ReplayResult], last_step: bool = False) -> str:
    """A plain-text table of replay results, one row each; `last_step` adds
    the last step's columns (replays of several steps)."""
    if not results:
        return "(no results)"
    evicting = any(r.policy != "none" for r in results)
    rows = [table_row(r, eviction_columns=evicting, last_step=last_step) for r in results]
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols), "  ".join("-" * width[c] for c in cols)]
    lines += ["  ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)
