"""bench/replay_device_calls.py: a step replayed under a budget with eviction,
its cudaMalloc/cudaFree per pool setting. The contrast it reports is a
property worth holding: at the same budget the GPU's default pool gives
segments back while an arena gives back none."""
from __future__ import annotations

import os
import sys

import pytest

import dtralloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import replay_device_calls as rdc  # noqa: E402


def _cells(text: str) -> tuple:
    row = next(line for line in text.splitlines() if line.startswith("| resnet50 | 0.5 |"))
    return tuple(c.strip() for c in row.split("|")[3:5])


def test_report_compares_the_settings(tmp_path):
    out = tmp_path / "calls.md"
    assert rdc.main(["--traces", "resnet50", "--budgets", "0.5", "--steps", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "command: `python bench/replay_device_calls.py --traces resnet50 --budgets 0.5" in text
    default, arena = _cells(text)
    default_frees = int(default.split(" calls")[0].split(" / ")[1])
    assert default_frees > 0
    assert arena.startswith("1 / 0 calls, 1 segments")


def test_the_steady_state_is_the_last_of_several_steps(tmp_path):
    """In a loop the pool no longer starts empty: the arena makes no call at
    all after the first step; the default pool still gives segments back."""
    out = tmp_path / "calls.md"
    assert rdc.main(["--traces", "resnet50", "--budgets", "0.5", "--steps", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "the step run 2 times in one pool" in text and "(last steps)" in text
    assert "| break-even, `arena:on` |" in text
    default, arena = _cells(text)
    assert int(default.split(" calls")[0].split(" / ")[1]) > 0
    assert arena.startswith("0 / 0 calls, 1 segments")


def test_the_frees_the_ladder_makes_are_told_apart(tmp_path):
    """Of the default pool's cudaFree, some come at ops where nothing was
    evicted: whole free segments given back to make one of another size.
    Counted from the pool's history and the evictor's log, for the last
    step only (the function checks its count against the pool's)."""
    from dtralloc.replay import replay

    t = dtralloc.traces.load_bundled("resnet50")
    for steps in (1, 2):
        r = replay(t, budget=0.5, policy="dtralloc", conf=rdc.DEFAULT_CONFS[0], steps=steps, history=True)
        frees = r.last_step_device_free_calls if steps > 1 else r.device_free_calls
        quiet = rdc.frees_without_eviction(r, len(t.ops), steps)
        assert 0 < quiet < frees
    # With no budget nothing is ever evicted: every cudaFree is the ladder's (there are none: no budget, no
    # pressure), and a step that gives nothing back counts none.
    r = replay(t, budget=None, policy="dtralloc", steps=2, history=True)
    assert rdc.frees_without_eviction(r, len(t.ops), 2) == 0
    out = tmp_path / "calls.md"
    assert rdc.main(["--traces", "resnet50", "--budgets", "0.5", "--steps", "2", "--out", str(out)]) == 0
    default, arena = _cells(out.read_text())
    assert "at ops that evicted nothing)" in default and "evicted nothing" not in arena


def test_a_cache_given_back_between_steps_is_paid_for_in_calls(tmp_path, capsys):
    """Between steps the cached segments go back (a loop calling
    torch.cuda.empty_cache()); the last step makes them again: more calls on
    the default pool, none more for the arena, which keeps its segment while
    it holds the parameters."""
    out = tmp_path / "calls.md"
    assert rdc.main(["--traces", "resnet50", "--budgets", "0.5", "--steps", "2", "--empty-cache-between-steps",
                     "--out", str(out)]) == 0
    text = out.read_text()
    assert "Between steps the cache is given back" in text
    emptied_default, emptied_arena = _cells(text)
    assert rdc.main(["--traces", "resnet50", "--budgets", "0.5", "--steps", "2", "--out", str(out)]) == 0
    kept_default, _ = _cells(out.read_text())

    def frees(cell):
        return int(cell.split(" calls")[0].split(" / ")[1])

    assert frees(emptied_default) > frees(kept_default)
    assert emptied_arena.startswith("0 / 0 calls")
    with pytest.raises(SystemExit):
        rdc.main(["--empty-cache-between-steps", "--steps", "1"])
    assert "needs --steps 2 or more" in capsys.readouterr().err


def _cell(mallocs, frees, overhead, feasible=True):
    return {"feasible": feasible, "mallocs": mallocs, "frees": frees, "overhead": overhead}


def test_break_even_prices_a_call_pair_against_the_recompute_it_saves():
    # 10 pairs fewer for 0.1 of the step more: cheaper once a pair costs over 1% of the step.
    assert rdc.break_even(_cell(10, 10, 0.1), _cell(0, 0, 0.2)) == "above 1.000%"
    assert rdc.break_even(_cell(10, 10, 0.2), _cell(0, 0, 0.1)) == "always"
    assert rdc.break_even(_cell(0, 0, 0.1), _cell(10, 10, 0.05)) == "below 0.500%"  # more calls, less recompute
    assert rdc.break_even(_cell(0, 0, 0.1), _cell(10, 10, 0.2)) == "never"
    assert rdc.break_even(_cell(5, 5, 0.1), _cell(5, 5, 0.1)) == "never"
    assert rdc.break_even(_cell(5, 5, 0.1, feasible=False), _cell(0, 0, 0.0)) == "-"


def test_budgets_are_fractions(capsys):
    with pytest.raises(SystemExit):
        rdc.main(["--budgets", "1.5"])
    assert "fractions of the peak" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rdc.main(["--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err
