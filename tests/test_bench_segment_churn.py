"""bench/segment_churn.py: segments made and released per step under a budget,
counted by the fake CUDA runtime. Its steady state is also a property of the
pool worth holding: at the budget of its own peak, torch's policy makes no
segment after the first step, and a step on VMM segments gives back every
page it makes."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import segment_churn  # noqa: E402


def calls(row: dict) -> dict:
    return dict(zip(segment_churn.CALLS + ("page_cuts",), row["last"]))


def test_steady_state_calls_per_step():
    torch_policy = segment_churn.measure("resnet50", "", 3)
    assert "error" not in torch_policy, torch_policy
    assert set(calls(torch_policy).values()) == {0}, torch_policy

    vmm = calls(segment_churn.measure("resnet50", "policy:dtralloc,unmap_pages:on", 3))
    assert vmm["cudaMalloc"] == 0 and vmm["cuMemCreate"] > 0, vmm
    assert vmm["cuMemCreate"] == vmm["cuMemMap"] == vmm["cuMemUnmap"], vmm  # no page kept past its step
    assert vmm["cudaDeviceSynchronize"] > 0, vmm  # a release waits for the device

    auto = calls(segment_churn.measure("resnet50", "policy:dtralloc", 3))
    assert auto["cuMemCreate"] == 0, f"unmap_pages:auto made VMM segments on cuda: {auto}"
    # split_oversize:auto (on here): the 49, 98 and 196 MiB activations are cut
    # from the oversize segments already made; off, each step gives back and
    # makes segments, and each cudaFree waits for the device.
    assert set(auto.values()) == {0}, auto
    off = calls(segment_churn.measure("resnet50", "policy:dtralloc,split_oversize:off", 3))
    assert off["cudaFree"] > 0 and off["cudaMalloc"] == off["cudaFree"], off


def test_arena_makes_no_segment_after_the_first_step():
    """Llama's 500 MiB logits need more than any one cached segment holds, so
    split_oversize cannot spare it a cudaFree a step; in an arena (one
    segment for the budget, Note [arena]) nothing is made or given back."""
    auto = calls(segment_churn.measure("llama", "policy:dtralloc", 3))
    assert auto["cudaFree"] > 0, auto
    arena = calls(segment_churn.measure("llama", "policy:dtralloc,arena:on", 3))
    assert set(arena.values()) == {0}, arena


def test_report(tmp_path):
    out = tmp_path / "churn.md"
    assert segment_churn.main(["--traces", "mlp", "--steps", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "command: `python bench/segment_churn.py --traces mlp --steps 2`" in text
    assert text.count("| mlp |") == len(segment_churn.CONFIGS)
