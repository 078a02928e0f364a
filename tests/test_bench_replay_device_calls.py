"""bench/replay_device_calls.py: a step replayed under a budget with eviction,
its cudaMalloc/cudaFree per pool setting. The contrast it reports is a
property worth holding: at the same budget the GPU's default pool gives
segments back while an arena gives back none."""
from __future__ import annotations

import os
import sys

import pytest

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
    default, arena = _cells(text)
    assert int(default.split(" calls")[0].split(" / ")[1]) > 0
    assert arena.startswith("0 / 0 calls, 1 segments")


def test_budgets_are_fractions(capsys):
    with pytest.raises(SystemExit):
        rdc.main(["--budgets", "1.5"])
    assert "fractions of the peak" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rdc.main(["--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err
