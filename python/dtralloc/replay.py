"""Replay a trace's memory traffic through the real pool on the virtual backend.

``dtralloc.replay(trace, budget=None, policy="none", conf=None)`` first
allocates the storages alive at the start of the step, then replays every
allocation and free in order through the same C++ pool that serves torch,
with addresses only (an 80 GB device fits on a laptop). It answers "how would
this step fragment, and how much memory does it really need?".
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

from . import _core
from .config import ConfLike, conf_text
from .trace import Trace

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
        choice = "one tensor a call" if p["choice"] == "single" else "a window or whole segments"
        rows.append(f"| `{p['name']}` | {choice} | {cost} | {per_byte} | {p['doc']} |")
    return "\n".join(rows)


def table_row(r: ReplayResult, eviction_columns: bool = False) -> dict:
    """One table row; `eviction_columns` adds policy, overhead, evictions and
    remats (format_results adds them when any row used a policy)."""
    fb = _core.format_bytes
    sampled = len(r.series["op"]) > 0
    row = {
        "trace": r.name,
        "conf": r.conf or "(defaults)",
        "budget": fb(r.budget_bytes) if r.budget_bytes else "none",
        "feasible": "yes" if r.feasible else (
            f"OOM at op {r.oom_op}" if r.oom_op >= 0 else "OOM: initial storages"),
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
    return row


def replay(
    trace: Union[Trace, str],
    budget: Union[None, int, float, str] = None,
    policy: str = "none",
    conf: ConfLike = None,
    check_invariants: bool = False,
    progress: Optional[Callable[[int, int], None]] = None,
) -> ReplayResult:
    """Run `trace` through a fresh pool and measure it.

    Args:
        trace: a Trace, or a path to a saved one.
        budget: None (no cap), bytes (int or "6G"), or a float in (0, 1]: that
            fraction of the no-eviction peak reserved (measured by a first
            replay without a budget).
        policy: eviction policy; "none" replays allocations only.
        conf: extra DTRALLOC_CONF settings for the pool (not `budget`).
        check_invariants: verify the pool's invariants after every op (slow).
        progress: called as progress(ops_done, ops_total) now and then.
    """
    if isinstance(trace, str):
        from .trace import load

        trace = load(trace)
    if policy not in POLICIES:
        raise ValueError(f"dtralloc.replay: unknown policy {policy!r}; available: {', '.join(POLICIES)}")
    text = _pool_conf(conf)
    if policy == "none":  # DTRALLOC_CONF=policy:... chooses when the call does not
        policy = _core.describe_config(text)[_POLICY_ROW]["value"]
    columns = replay_columns(trace)
    if budget is None and policy == "none":  # the replay is its own no-eviction reference
        result = _run(columns, 0, "none", text, check_invariants, progress)
        result.no_eviction_peak_reserved_bytes = result.peak_reserved_bytes
    else:
        reference = _run(columns, 0, "none", text, False, None).peak_reserved_bytes
        budget_bytes = 0 if budget is None else _resolve_budget(budget, reference)
        result = _run(columns, budget_bytes, policy, text, check_invariants, progress)
        result.no_eviction_peak_reserved_bytes = reference
    result.name = str(trace.meta.get("name", ""))
    result.conf = text
    return result


_POLICY_ROW = [o["name"] for o in _core.describe_config("")].index("policy")


def _pool_conf(conf: ConfLike) -> str:
    """The DTRALLOC_CONF text for a replay's pool; the budget is replay()'s own argument."""
    text = conf_text(conf if conf is not None else "")
    settings = {o["name"]: o["value"] for o in _core.describe_config(text)}  # validates too
    if settings["budget"] != "none":
        raise ValueError("dtralloc.replay: pass the budget as replay(budget=...), not inside conf")
    return text


def _resolve_budget(budget, reference: int) -> int:
    if isinstance(budget, bool):
        raise TypeError("dtralloc.replay: budget must be None, bytes or a fraction, not a bool")
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0) or math.isnan(budget):
            raise ValueError(
                f"dtralloc.replay: a fractional budget must be in (0, 1] (a share of the "
                f"no-eviction peak reserved); got {budget}. Pass an int for bytes."
            )
        return max(1, int(budget * reference))
    if isinstance(budget, str):
        return _core.parse_size(budget)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"dtralloc.replay: budget must be positive, got {budget}")
        return budget
    raise TypeError(f"dtralloc.replay: budget must be None, int, float or str, not {type(budget).__name__}")


def replay_columns(trace: Trace) -> _core.ReplayTrace:
    """`trace` as the replay driver's columns (a bound struct, CSR lists)."""
    def csr(lists):
        offsets, values = [0], []
        for item in lists:
            values.extend(item)
            offsets.append(len(values))
        return offsets, values

    ops = trace.ops
    t = _core.ReplayTrace()
    t.nbytes = [s.nbytes for s in trace.storages]
    t.initial = [int(s.initial) for s in trace.storages]
    t.frees_before = list(trace.frees_before)
    t.inputs_offsets, t.inputs = csr([o.inputs for o in ops])
    t.created_offsets, t.created = csr([o.created for o in ops])
    t.mutated_offsets, t.mutated = csr([o.mutated for o in ops])
    t.frees_offsets, t.frees = csr([o.frees for o in ops])
    # Measured duration when the trace has one, else the FLOP estimate.
    t.cost = [float(o.duration_ns if o.duration_ns > 0 else max(o.flops, 1)) for o in ops]
    t.random = [int(o.random) for o in ops]
    return t


def _run(columns, budget_bytes: int, policy: str, conf: str, check: bool, progress,
         measure_floor: bool = False) -> ReplayResult:
    return _core.replay(columns, budget_bytes, policy, conf, check, True, measure_floor, progress)


def resident_floor(trace: Union[Trace, str], conf: ConfLike = None) -> float:
    """The budget fraction below which no eviction policy can run `trace`.

    At every op some bytes cannot be evicted: initial storages (parameters,
    optimizer state), values made unrecomputable by an in-place write to
    them, and the op's own inputs and outputs. The largest such sum over the
    step, as a fraction of the no-eviction peak reserved, bounds every
    policy's ``min_feasible_budget`` from below (the pool's fragmentation
    comes on top)."""
    if isinstance(trace, str):
        from .trace import load

        trace = load(trace)
    r = _run(replay_columns(trace), 0, "none", _pool_conf(conf), False, None, measure_floor=True)
    return r.resident_floor_bytes / r.peak_reserved_bytes if r.peak_reserved_bytes else 0.0


def min_feasible_budget(
    trace: Union[Trace, str], policy: str = "dtralloc", conf: ConfLike = None, tolerance: float = 0.01,
    method: str = "bisect", reference_bytes: Optional[int] = None,
) -> Optional[float]:
    """Smallest budget fraction (of the no-eviction peak reserved) at which
    `policy` completes the trace; None if even 1.0 fails.

    Feasibility is not quite monotone in the budget: where the pool puts
    blocks changes with it, and a budget can fail where a smaller one fits.
    ``method="bisect"`` (default) bisects to `tolerance` and reports a point
    on the boundary it finds, in about log2(1/tolerance) replays.
    ``method="scan"`` steps down from 1.0 by `tolerance` and returns the last
    budget before the first failure: every budget on that grid from there up
    is feasible (about (1 - result) / tolerance replays).

    Fractions are of the no-eviction peak reserved under `conf`, or of
    `reference_bytes` when given (to compare settings against one fixed
    reference, such as the default pool's peak)."""
    if isinstance(trace, str):
        from .trace import load

        trace = load(trace)
    if policy == "none":
        raise ValueError("dtralloc.min_feasible_budget: needs an eviction policy, not 'none'")
    if method not in ("bisect", "scan"):
        raise ValueError(f"dtralloc.min_feasible_budget: method must be 'bisect' or 'scan', not {method!r}")
    if not 0 < tolerance < 1:
        raise ValueError(f"dtralloc.min_feasible_budget: tolerance must be in (0, 1), not {tolerance!r}")
    text = _pool_conf(conf)
    columns = replay_columns(trace)
    if reference_bytes is not None and (isinstance(reference_bytes, bool) or not isinstance(reference_bytes, int)
                                        or reference_bytes <= 0):
        raise ValueError(f"dtralloc.min_feasible_budget: reference_bytes must be a positive int, "
                         f"not {reference_bytes!r}")
    reference = reference_bytes or _run(columns, 0, "none", text, False, None).peak_reserved_bytes

    def feasible(fraction: float) -> bool:
        return _run(columns, max(1, int(fraction * reference)), policy, text, False, None).feasible

    if not feasible(1.0):
        return None
    if method == "scan":
        steps = round(1 / tolerance)
        lowest = 1.0
        for k in range(steps - 1, 0, -1):
            fraction = k / steps
            if not feasible(fraction):
                break
            lowest = fraction
        return lowest
    lo, hi = 0.0, 1.0
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def format_results(results: list[ReplayResult]) -> str:
    """A plain-text table of replay results, one row each."""
    if not results:
        return "(no results)"
    evicting = any(r.policy != "none" for r in results)
    rows = [table_row(r, eviction_columns=evicting) for r in results]
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols), "  ".join("-" * width[c] for c in cols)]
    lines += ["  ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)
