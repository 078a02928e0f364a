"""bench/bench_live_first_step.py measures what it says: its "first" steps
announce nothing (another program's lifetimes replaced the model's) and its
"taught" steps announce what the budget-free step before them kept."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_live_first_step as bench  # noqa: E402


def test_first_steps_announce_nothing_and_taught_steps_announce_what_was_kept():
    # Budgets around convbn's lowest (0.42 of its peak, bench/results/live_first_step-*).
    m = bench.measure_model("convbn", [0.36, 0.6], rounds=1, policy="dtralloc", echo=lambda s: None)
    (cells,) = m["rounds"]
    for c in cells:
        assert c["first"]["long_lived"] == 0, c
        assert c["taught"]["long_lived"] > 0, c
    assert [c["first"]["fits"] for c in cells] == [False, True], cells
    assert [c["taught"]["fits"] for c in cells] == [False, True], cells
    text = bench.report([m], {}, [0.36, 0.6], 1, "dtralloc", "cmd")
    assert "| convbn | 1 | 0.60 | 0.60 | none | 0.0 |" in text, text
