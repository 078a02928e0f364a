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


def _history(events, budget, names=("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                                    "oom", "segment_map", "segment_unmap", "free", "snapshot", "other")):
    """A replay result carrying only what async_waits reads: the pool's
    history as (action, address, bytes, op) events, and the budget."""
    from types import SimpleNamespace

    action, addr, size, op = zip(*[(names.index(a), x, n, o) for a, x, n, o in events])
    return SimpleNamespace(history_wrapped=False, budget_bytes=budget,
                           history={"action": list(action), "addr": list(addr), "size": list(size), "op": list(op),
                                    "action_names": names})


def test_async_waits_models_a_driver_that_reuses_freed_segments_whole():
    """async_segments' waits (Note [async segments]): a segment the driver
    makes from a freed one that fits costs no wait; one it must make new
    waits only where the driver would hold more than the budget, and the wait
    gives back what it held; so does the synchronize between steps. The same
    events as tests/_async_worker.py's first scenario over the fake runtime."""
    M = 1 << 20
    step = [("segment_alloc", 1, 40 * M, 0), ("segment_free", 1, 40 * M, 1),
            ("segment_alloc", 2, 30 * M, 2),   # reuses the 40 MiB freed: no wait
            ("segment_free", 2, 30 * M, 3),
            ("segment_alloc", 3, 50 * M, 4),   # 50 new beside 40 held: 90 > 64, waits
            ("segment_free", 3, 50 * M, 5),
            ("segment_alloc", 4, 20 * M, 6)]   # the 50 freed fits it: no wait
    assert rdc.async_waits(_history(step, 64 * M), 1) == 1
    assert rdc.async_waits(_history(step, 90 * M), 1) == 0  # the driver's 90 MiB fit the budget
    # Two steps: the counted one starts after the synchronize between them,
    # with nothing held, and counts its own waits only. The first step's
    # last segment (20 MiB) kept the whole 50 MiB it reused, so the second
    # step's first 40 MiB made new passes the budget (the model's reuse is
    # whole: a driver that splits would not wait there), and its 50 MiB
    # waits as in the first step.
    second = [(a, x + 10, n, o) for a, x, n, o in step]
    assert rdc.async_waits(_history(step + second, 64 * M), 2) == 2
    assert rdc.async_waits(_history(step + second, 200 * M), 2) == 0
    # Given-back pages (unmap_pages) have no async segments; a wrapped history is unknown.
    assert rdc.async_waits(_history(step + [("segment_unmap", 4, 2 * M, 7)], 64 * M), 1) is None
    wrapped = _history(step, 64 * M)
    wrapped.history_wrapped = True
    assert rdc.async_waits(wrapped, 1) is None


def test_async_waits_of_a_replay_are_at_most_its_segments_made_and_none_in_an_arena():
    from dtralloc.replay import replay

    for conf, none in (("split_oversize:on,unmap_pages:off", False), ("arena:on", True)):
        r = replay("resnet50", budget=0.35, policy="dtralloc", conf=conf, steps=2, history=True)
        waits = rdc.async_waits(r, 2)
        assert r.feasible and waits is not None and 0 <= waits <= r.last_step_device_alloc_calls, (conf, waits)
        assert (waits == 0) if none else r.last_step_device_alloc_calls > 0
