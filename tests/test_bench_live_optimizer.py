"""bench/bench_live_optimizer.py: an optimizer step inside dtr() with foreach
ops split by element and without. Its plumbing on a few parameters: every
optimizer and size is reported, and "whole" turns the split off and back on
(what the split changes is tested in test_dtr_write_path.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_live_optimizer as bo  # noqa: E402
from dtralloc.dtr import dtr, mode  # noqa: E402


def test_report_has_every_optimizer_at_each_size(tmp_path):
    out = tmp_path / "optimizer.md"
    assert bo.main(["--rounds", "1", "--params", "3", "5", "--out", str(out)]) == 0
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| optimizer step")]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [(name, n) for name in bo.OPTIMIZERS for n in (3, 5)]
    for r in rows:
        assert all(float(c) > 0 for c in r[2:5])  # plain, split, whole: each timed


def test_whole_recipes_turns_the_split_off_and_back():
    classify = mode._classify_for_c
    with bo.whole_recipes():
        assert mode._classify_for_c(torch.ops.aten._foreach_add.List)[7] == 0
    assert mode._classify_for_c is classify
    assert classify(torch.ops.aten._foreach_add.List)[7] != 0


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bo.main(["--params", "0"])
