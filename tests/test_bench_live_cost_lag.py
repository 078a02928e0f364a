"""bench/live_cost_lag.py: late op costs in live eviction, on CPU sessions
timed on a simulated GPU (allocator/simulated_timing.h), next to carried
ones. Timings mean nothing on a shared machine; the test checks that every
configuration ran, that the carried one carried, and the report's shape."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import live_cost_lag as lcl  # noqa: E402


def test_report_sets_late_live_costs_beside_carried_ones(tmp_path):
    out = tmp_path / "live_lag.md"
    assert lcl.main(["--models", "vit", "--budgets", "0.8", "--lag", "50", "--rounds", "1", "--steps", "2",
                     "--out", str(out)]) == 0
    text = out.read_text()
    assert "command: `python bench/live_cost_lag.py --models vit --budgets 0.8 --lag 50" in text
    assert "| model | budget | clock: recompute ms (evictions) | lag 50: recompute ms (evictions), x clock" in text
    row = next(line for line in text.splitlines() if line.startswith("| vit | 0.8 |"))
    cells = [c.strip() for c in row.split("|")[3:7]]
    assert "OOM" not in row, row
    assert all("(" in c for c in cells[:3]), row  # recompute ms (evictions) in each configuration
    carried, ops = (int(x) for x in cells[3].split(" / "))
    assert 0.8 * ops <= carried <= ops, row  # all but the intervals a recompute ran in
    assert "- lag 50, carried: recompute seconds over the clock's, median" in text


@pytest.mark.parametrize("args, error", [(["--steps", "1"], "--steps >= 2"),
                                         (["--models", "nope"], "unknown model"),
                                         (["--budgets", "1.5"], "--budgets are fractions")])
def test_bad_arguments_are_refused(args, error, capsys):
    with pytest.raises(SystemExit):
        lcl.main(args)
    assert error in capsys.readouterr().err
