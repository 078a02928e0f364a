"""bench/bench_fsdp_budget.py: its plumbing on one family at coarse budgets
(what the engine does at FSDP2's reshards is tested in
test_dtr_distributed.py and tests/cpp/test_remat_engine.cpp). It starts a
one-rank gloo group of its own, so it runs in a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "bench_fsdp_budget.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_report_has_each_mode_of_the_family_asked_for(tmp_path):
    out = tmp_path / "fsdp.md"
    r = _run("--model", "conv", "--steps", "1", "--step", "40", "--misses", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    summary = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| conv |")]
    assert [row[1].strip() for row in summary] == [
        "FSDP2, reshard after forward", "FSDP2, no reshard after forward", "no FSDP"]
    for row in summary:  # the peak fits, so each mode has a smallest budget, bit-exact
        assert row[3].strip().endswith("MiB") and row[5].strip() == "yes"
    assert "- conv: four residual conv blocks" in text and "- mlp:" not in text
    assert "conv, no FSDP: budget" in r.stderr  # progress, one line a budget


@pytest.mark.parametrize("args", [["--step", "0"], ["--misses", "0"], ["--model", "resnet"]])
def test_bad_arguments_are_refused(args):
    r = _run(*args)
    assert r.returncode == 2 and "error" in r.stderr
