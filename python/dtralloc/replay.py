"""Replay a trace's memory traffic through the real pool on the virtual backend.

``dtralloc.replay(trace, budget=None, policy="none", conf=None)`` first
allocates the storages alive at the start of the step, then replays every
allocation and free in order through the same C++ pool that serves torch,
with addresses only (an 80 GB device fits on a laptop). It answers "how would
this step fragment, and how much memory does it really need?".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from . import _core
from .config import ConfLike, conf_text
from .pool import Pool
from .trace import Trace

POLICIES = ("none", "lru", "size", "msps", "dtr", "dtr_eq", "dtr_local", "dte", "coop", "dtralloc")

# Capacity of the simulated device when the budget does not bound it: large
# enough for any trace we record, so only the budget limits the pool.
_VIRTUAL_CAPACITY = 1 << 44  # 16 TiB


@dataclass
class ReplayResult:
    feasible: bool
    budget_bytes: Optional[int]        # None: no budget
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    baseline_peak_bytes: int           # peak reserved of the same replay with no budget
    final_reserved_bytes: int
    segments_peak: int
    device_alloc_calls: int
    device_free_calls: int
    oom_op: Optional[int] = None       # op whose allocation failed; -1: the initial storages
    oom_message: str = ""
    # Per op, sampled after its outputs are allocated:
    reserved_fragmentation: list[float] = field(default_factory=list)  # 1 - allocated/reserved
    external_fragmentation: list[float] = field(default_factory=list)  # 1 - largest free/total free
    conf: str = ""
    policy: str = "none"
    name: str = ""
    # With an eviction policy (zero for "none"):
    compute_overhead: float = 0.0      # recompute cost / cost of running every op once
    evictions: int = 0
    remats: int = 0
    fragmentation: float = 0.0         # mean (budget - allocated) / budget at forced evictions
    search_ns: float = 0.0             # median time to choose victims
    eviction_calls: int = 0
    fake_deletions: int = 0
    random_replays: int = 0            # recomputes of random ops (saved RNG state)
    max_split_size: int = -1           # the pool's block split limit (max_split_size_mb:auto resolved); -1: none
    segment_fit: bool = False          # 1-10 MiB requests got fitted segments (segment_fit:auto resolved)

    @property
    def reserved_over_allocated(self) -> float:
        return self.peak_reserved_bytes / self.peak_allocated_bytes if self.peak_allocated_bytes else 1.0

    @property
    def mean_reserved_fragmentation(self) -> float:
        f = self.reserved_fragmentation
        return sum(f) / len(f) if f else 0.0

    @property
    def mean_external_fragmentation(self) -> float:
        f = self.external_fragmentation
        return sum(f) / len(f) if f else 0.0

    def table_row(self, eviction_columns: bool = False) -> dict:
        """One table row; `eviction_columns` adds policy, overhead, evictions
        and remats (format_results adds them when any row used a policy)."""
        fb = _core.format_bytes
        row = {
            "trace": self.name,
            "conf": self.conf or "(defaults)",
            "budget": fb(self.budget_bytes) if self.budget_bytes else "none",
            "feasible": "yes" if self.feasible else (
                f"OOM at op {self.oom_op}" if self.oom_op >= 0 else "OOM: initial storages"),
            "peak allocated": fb(self.peak_allocated_bytes),
            "peak reserved": fb(self.peak_reserved_bytes),
            "reserved/allocated": f"{self.reserved_over_allocated:.3f}",
            # Sampled per op by the allocation-only replay; "-" where not sampled.
            "mean 1-alloc/res": f"{self.mean_reserved_fragmentation:.3f}" if self.reserved_fragmentation else "-",
            "mean ext. frag": f"{self.mean_external_fragmentation:.3f}" if self.external_fragmentation else "-",
            "segments (peak)": str(self.segments_peak),
            "cudaMalloc calls": str(self.device_alloc_calls),
        }
        if eviction_columns:
            row.update({
                "policy": self.policy,
                "overhead": f"{self.compute_overhead:.3f}",
                "evictions": str(self.evictions),
                "remats": str(self.remats),
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
    text = conf_text(conf if conf is not None else "")
    settings = {o["name"]: o["value"] for o in _core.describe_config(text)}  # validates too
    if settings["budget"] != "none":
        raise ValueError("dtralloc.replay: pass the budget as replay(budget=...), not inside conf")
    if policy == "none":  # DTRALLOC_CONF=policy:... chooses when the call does not
        policy = settings["policy"]
    if policy != "none":
        baseline = _run(trace, None, text, False, None)
        budget_bytes = None if budget is None else _resolve_budget(budget, baseline.peak_reserved_bytes)
        result = _run_remat(trace, budget_bytes, policy, text, check_invariants)
        result.baseline_peak_bytes = baseline.peak_reserved_bytes
        return result

    if budget is None:  # the replay is its own baseline
        return _run(trace, None, text, check_invariants, progress)
    baseline = _run(trace, None, text, False, None)
    budget_bytes = _resolve_budget(budget, baseline.peak_reserved_bytes)
    result = _run(trace, budget_bytes, text, check_invariants, progress)
    result.baseline_peak_bytes = baseline.peak_reserved_bytes
    return result


def _resolve_budget(budget, baseline_peak: int) -> int:
    if isinstance(budget, bool):
        raise TypeError("dtralloc.replay: budget must be None, bytes or a fraction, not a bool")
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0) or math.isnan(budget):
            raise ValueError(
                f"dtralloc.replay: a fractional budget must be in (0, 1] (a share of the "
                f"no-eviction peak); got {budget}. Pass an int for bytes."
            )
        return max(1, int(budget * baseline_peak))
    if isinstance(budget, str):
        return _core.parse_size(budget)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"dtralloc.replay: budget must be positive, got {budget}")
        return budget
    raise TypeError(f"dtralloc.replay: budget must be None, int, float or str, not {type(budget).__name__}")


def _run(trace: Trace, budget_bytes, conf: str, check: bool, progress) -> ReplayResult:
    parts = [conf] if conf else []
    if budget_bytes is not None:
        parts.append(f"budget:{budget_bytes}B")
    pool = Pool(backend="virtual", capacity=_VIRTUAL_CAPACITY, conf=",".join(parts))
    storages = trace.storages
    address: dict[int, int] = {}
    peak_alloc = peak_res = peak_segments = 0
    res_frag: list[float] = []
    ext_frag: list[float] = []
    result = ReplayResult(True, budget_bytes, 0, 0, 0, 0, 0, 0, 0, conf=conf,
                          name=str(trace.meta.get("name", "")))

    def take(sid: int) -> None:
        nbytes = storages[sid].nbytes
        if nbytes > 0:
            address[sid] = pool.malloc(nbytes)

    def release(sid: int) -> None:
        addr = address.pop(sid, None)
        if addr is not None:
            pool.free(addr)

    total = len(trace.ops)
    try:
        result.oom_op = -1  # while placing the storages alive before the step
        for sid, s in enumerate(storages):
            if s.initial:
                take(sid)
        for sid in trace.frees_before:
            release(sid)
        for i, op in enumerate(trace.ops):
            result.oom_op = i
            for sid in op.created:
                take(sid)
            allocated, reserved, largest, free, segments = pool.usage()
            peak_alloc = max(peak_alloc, allocated)
            peak_res = max(peak_res, reserved)
            peak_segments = max(peak_segments, segments)
            res_frag.append(1.0 - allocated / reserved if reserved else 0.0)
            ext_frag.append(1.0 - largest / free if free else 0.0)
            for sid in op.frees:
                release(sid)
            if check:
                pool.check_invariants()
            if progress is not None and (i % 2048 == 0 or i == total - 1):
                progress(i + 1, total)
        result.oom_op = None
    except _core.OutOfMemoryError as e:
        result.feasible = False
        result.oom_message = str(e)
    stats = pool.stats()
    result.peak_allocated_bytes = stats["allocated_bytes.all.peak"]
    result.peak_reserved_bytes = stats["reserved_bytes.all.peak"]
    result.baseline_peak_bytes = result.peak_reserved_bytes
    result.final_reserved_bytes = stats["reserved_bytes.all.current"]
    result.segments_peak = max(peak_segments, stats["segment.all.peak"])
    result.device_alloc_calls = stats["num_device_alloc"]
    result.device_free_calls = stats["num_device_free"]
    result.reserved_fragmentation = res_frag
    result.external_fragmentation = ext_frag
    if check:
        pool.check_invariants()
    return result


def _columns(trace: Trace) -> tuple:
    """The trace as the columns _core.remat_replay takes (CSR lists)."""
    def csr(lists):
        offsets, values = [0], []
        for item in lists:
            values.extend(item)
            offsets.append(len(values))
        return offsets, values

    ops = trace.ops
    return (
        [s.nbytes for s in trace.storages],
        [int(s.initial) for s in trace.storages],
        list(trace.frees_before),
        *csr([o.inputs for o in ops]),
        *csr([o.created for o in ops]),
        *csr([o.mutated for o in ops]),
        *csr([o.frees for o in ops]),
        # Measured duration when the trace has one, else the FLOP estimate.
        [float(o.duration_ns if o.duration_ns > 0 else max(o.flops, 1)) for o in ops],
        [int(o.random) for o in ops],
    )


def _run_remat(trace: Trace, budget_bytes, policy: str, conf: str, check: bool) -> ReplayResult:
    r = _core.remat_replay(*_columns(trace), budget_bytes or 0, policy, conf, check)
    oom_op = None if r["feasible"] else r["oom_op"]
    result = ReplayResult(
        r["feasible"], budget_bytes, r["peak_allocated_bytes"], r["peak_reserved_bytes"],
        r["peak_reserved_bytes"], r["final_reserved_bytes"], r["segments_peak"],
        r["device_alloc_calls"], r["device_free_calls"], oom_op=oom_op, oom_message=r["message"],
        conf=conf, policy=policy, name=str(trace.meta.get("name", "")))
    result.compute_overhead = r["remat_cost"] / r["base_cost"] if r["base_cost"] else 0.0
    result.evictions = r["evictions"]
    result.remats = r["remats"]
    fractions = r["free_fraction"]
    result.fragmentation = sum(fractions) / len(fractions) if fractions else 0.0
    ns = sorted(r["search_ns"])
    result.search_ns = float(ns[len(ns) // 2]) if ns else 0.0
    result.eviction_calls = r["eviction_calls"]
    result.fake_deletions = r["fake_deletions"]
    result.random_replays = r["random_replays"]
    result.max_split_size = r["max_split_size"]
    result.segment_fit = r["segment_fit"]
    return result


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
    text = conf_text(conf if conf is not None else "")
    baseline = _run(trace, None, text, False, None).peak_reserved_bytes
    r = _core.remat_replay(*_columns(trace), 0, "none", text, False)
    return r["resident_floor_bytes"] / baseline if baseline else 0.0


def min_feasible_budget(
    trace: Union[Trace, str], policy: str = "dtralloc", conf: ConfLike = None, tolerance: float = 0.01,
    method: str = "bisect",
) -> Optional[float]:
    """Smallest budget fraction (of the no-eviction peak reserved) at which
    `policy` completes the trace; None if even 1.0 fails.

    Feasibility is not quite monotone in the budget: where the pool puts
    blocks changes with it, and a budget can fail where a smaller one fits.
    ``method="bisect"`` (default) bisects to `tolerance` and reports a point
    on the boundary it finds, in about log2(1/tolerance) replays.
    ``method="scan"`` steps down from 1.0 by `tolerance` and returns the last
    budget before the first failure: every budget on that grid from there up
    is feasible (about (1 - result) / tolerance replays)."""
    if isinstance(trace, str):
        from .trace import load

        trace = load(trace)
    if policy == "none":
        raise ValueError("dtralloc.min_feasible_budget: needs an eviction policy, not 'none'")
    if method not in ("bisect", "scan"):
        raise ValueError(f"dtralloc.min_feasible_budget: method must be 'bisect' or 'scan', not {method!r}")
    if not 0 < tolerance < 1:
        raise ValueError(f"dtralloc.min_feasible_budget: tolerance must be in (0, 1), not {tolerance!r}")
    text = conf_text(conf if conf is not None else "")
    baseline = _run(trace, None, text, False, None).peak_reserved_bytes

    def feasible(fraction: float) -> bool:
        return _run_remat(trace, max(1, int(fraction * baseline)), policy, text, False).feasible

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
    rows = [r.table_row(eviction_columns=evicting) for r in results]
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols), "  ".join("-" * width[c] for c in cols)]
    lines += ["  ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)
