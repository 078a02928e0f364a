"""bench/replay_cost_lag.py: late op costs (a GPU's timing events) in the
replay, next to costs carried from the step before. The contrast it reports
is the reason live CUDA sessions carry costs (Note [carried costs]): late
costs make the evictor take what is dear to bring back; carried ones do not."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import replay_cost_lag as rcl  # noqa: E402


def test_report_sets_late_costs_beside_carried_ones(tmp_path):
    out = tmp_path / "lag.md"
    assert rcl.main(["--traces", "convbn", "--budgets", "0.5", "--lags", "300", "--recordings", "1",
                     "--out", str(out)]) == 0
    text = out.read_text()
    assert "command: `python bench/replay_cost_lag.py --traces convbn --budgets 0.5 --lags 300" in text
    assert "| trace | budget | no lag | lag 300 | lag 300, carried |" in text
    rows = [line for line in text.splitlines() if line.startswith("| convbn")]
    assert [r.split("|")[1].strip() for r in rows] == ["convbn", "convbn (recording 1)"]
    for row in rows:
        exact, late, carried = (float(c) for c in row.split("|")[3:6])
        assert late > 2 * exact and carried == pytest.approx(exact, rel=0.05)
    assert "- lag 300, carried: over no lag, median 1.00x" in text


@pytest.mark.parametrize("args, error", [(["--steps", "1"], "--steps must be at least 2"),
                                         (["--lags", "0"], "--lags are numbers of ops"),
                                         (["--budgets", "1.5"], "--budgets are fractions")])
def test_bad_arguments_are_refused(args, error, capsys):
    with pytest.raises(SystemExit):
        rcl.main(args)
    assert error in capsys.readouterr().err
