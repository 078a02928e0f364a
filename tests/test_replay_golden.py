"""The replay figures of every bundled trace x every policy x budgets 1.0 /
0.7 / 0.5 of the no-eviction peak, checked exactly against a committed table.

The table (tests/data/replay_golden.json) was written by the code before a
restructure; a restructure that is meant to change no behaviour must reproduce
it bit for bit (floats compared with ==). A change that is *meant* to move
figures (a policy change) regenerates it and says why in its commit:

    python tests/test_replay_golden.py --write
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import dtralloc
from dtralloc.traces import list_bundled, load_bundled

GOLDEN = Path(__file__).parent / "data" / "replay_golden.json"
BUDGETS = (1.0, 0.7, 0.5)
# Per row; the allocation-only rows (policy none) also carry the per-op
# fragmentation means, which tie the one allocation-only replay to the figures
# the pool gave before.
FIELDS = ("budget_bytes", "feasible", "oom_op", "peak_reserved_bytes", "peak_allocated_bytes",
          "final_reserved_bytes", "segments_peak", "device_alloc_calls", "device_free_calls",
          "evictions", "remats", "compute_overhead")
NONE_FIELDS = ("mean_external_fragmentation", "mean_reserved_fragmentation")


def _policies() -> list[str]:
    return list(dtralloc.POLICIES)


def figures(trace_name: str, trace, policy: str, budget: float) -> dict:
    r = dtralloc.replay(trace, budget=budget, policy=policy)
    row = {"trace": trace_name, "policy": policy, "budget": budget}
    row.update({f: getattr(r, f) for f in FIELDS})
    if policy == "none":
        row.update({f: getattr(r, f) for f in NONE_FIELDS})
    return row


def compute_table() -> list[dict]:
    rows = []
    for name in list_bundled():
        trace = load_bundled(name)
        for policy in _policies():
            for budget in BUDGETS:
                rows.append(figures(name, trace, policy, budget))
    return rows


@pytest.fixture(scope="module")
def golden() -> dict:
    rows = json.loads(GOLDEN.read_text())
    return {(r["trace"], r["policy"], r["budget"]): r for r in rows}


@pytest.mark.parametrize("name", list_bundled())
def test_replay_reproduces_the_golden_table(golden, name):
    trace = load_bundled(name)
    mismatches = []
    for policy in _policies():
        for budget in BUDGETS:
            want = golden.get((name, policy, budget))
            assert want is not None, f"no golden row for {name} {policy} {budget}: regenerate the table"
            got = figures(name, trace, policy, budget)
            for key, value in want.items():
                if got.get(key) != value:
                    mismatches.append(f"{name} {policy}@{budget} {key}: golden {value!r}, now {got.get(key)!r}")
    assert not mismatches, "\n".join(mismatches)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_replay_golden.py --write   (regenerates the golden table)")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(compute_table(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
