"""bench/live_lowest_budget.py: the scan of live budgets per pool setting."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import live_lowest_budget as bench  # noqa: E402


def test_the_scan_goes_down_to_the_first_budget_that_runs_out_and_reports_the_one_above():
    r = bench.child("convbn", "", step=0.2, floor=0.2, smoke=True)
    fractions = [float(f) for f in r["cells"]]
    assert fractions == sorted(fractions, reverse=True) and fractions[0] == 1.0
    fits = [c["fits"] for c in r["cells"].values()]
    # Every budget down to the lowest runs; the scan stops at the first that does not.
    assert all(fits[:-1]) and not fits[-1], "the smoke conv net fits every budget down to 0.2 of its peak"
    assert r["lowest"] == fractions[-2]
    assert "out of memory" in r["cells"][f"{fractions[-1]:g}"]["oom"]
    evictions = [c["evictions"] for c in r["cells"].values() if c["fits"]]
    assert evictions[0] == 0 and evictions[-1] > 0  # the peak needs none; the lowest evicts


def test_the_report_puts_the_settings_side_by_side(tmp_path):
    out = tmp_path / "r.md"
    assert bench.main(["--smoke", "--models", "mlp", "--step", "0.2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "command: `python bench/live_lowest_budget.py --smoke --models mlp --step 0.2 --out" in text
    assert "| model | P | lowest, defaults | lowest, `arena:on` |" in text
    row = next(line for line in text.splitlines() if line.startswith("| mlp | ") and "MiB" in line)
    lowest = row.strip("| ").split(" | ")[2:]
    assert len(lowest) == 2 and all(0.2 <= float(x) <= 1.0 for x in lowest), row
    assert "| mlp | 1 | 0 / 0.000 | 0 / 0.000 |" in text  # nothing evicted at the peak, on either setting


@pytest.mark.parametrize("argv, message", [
    (["--step", "1.5"], "--step is in"),
    (["--smoke", "--models", "nope"], "unknown model"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
