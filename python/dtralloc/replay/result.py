"""What a replay measured (ReplayResult) and the plain-text table of results."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .. import _core


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
