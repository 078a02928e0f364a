"""dtralloc inside real torch (and CuPy) on a GPU. Skipped without one.

Every scenario runs tests/_gpu_worker.py in a fresh process: install() must
come before torch's first CUDA allocation, and the CUDA context of this pytest
process must not leak into the measurement. The workers use the real CUDA
runtime (DTRALLOC_CUDART and DTRALLOC_CONF are removed from their environment).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest

MiB = 1 << 20


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    with warnings.catch_warnings():  # e.g. "CUDA initialization: driver too old"
        warnings.simplefilter("ignore")
        return torch.cuda.is_available()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _cuda_available(), reason="needs torch with a CUDA GPU"),
]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gpu_worker.py")


def run_gpu_worker(*args: str, worker: str = WORKER) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS in both runs
    proc = subprocess.run(
        [sys.executable, worker, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{args} failed (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_training_matches_the_native_allocator():
    native = run_gpu_worker("train", "native")
    ours = run_gpu_worker("train", "dtralloc")
    # Same seed, same kernels: only the addresses differ, so the losses agree
    # (bitwise in practice; the tolerance only absorbs alignment-dependent
    # kernel choices).
    assert ours["losses"] == pytest.approx(native["losses"], rel=1e-5, abs=1e-6)
    assert ours["losses"][-1] < ours["losses"][0]  # it did train
    stats = ours["stats"]
    assert stats["allocated_bytes.all.peak"] > 0  # torch's memory really came from dtralloc
    assert stats["num_device_alloc"] > 0
    assert stats["num_ooms"] == 0
    assert stats["num_invalid_frees"] == 0


def test_stats_stay_consistent_under_load_with_streams():
    result = run_gpu_worker("load")
    stats = result["stats"]
    assert stats["allocated_bytes.all.peak"] > 0
    assert stats["num_ooms"] == 0
    assert stats["allocation.all.allocated"] >= 20 * 16


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy")
def test_cupy_arrays_come_from_the_same_pool():
    result = run_gpu_worker("cupy")
    assert result["during"] - result["before"] >= 4 << 20
    assert result["stats"]["num_ooms"] == 0


def test_memory_fraction_and_empty_cache_reach_dtralloc():
    result = run_gpu_worker("fraction_and_empty_cache")
    assert result["half_budget"] == int(0.5 * result["capacity"])
    assert result["stats"]["num_invalid_frees"] == 0


@pytest.mark.parametrize("variant", ["wired", "unwired"])
def test_record_stream_keeps_a_block_from_reuse_until_the_side_stream_is_done(variant):
    """The control run ('unwired': install() without set_record_stream_fn, as
    before torch's hook names were used) shows the check catches the fault on
    this GPU: the block comes straight back."""
    result = run_gpu_worker("record_stream_reuse", variant)
    if variant == "wired":
        assert not result["reused"] and not result["corrupted"], result
        assert result["stats"]["num_invalid_frees"] == 0
    else:
        assert result["reused"], result


def test_torch_memory_functions_answer_with_dtrallocs_figures():
    r = run_gpu_worker("memory_functions")
    assert r["memory_allocated"] == r["ours_allocated"] >= 3 * MiB
    assert r["max_memory_allocated"] == r["ours_peak"]
    assert r["memory_reserved"] == r["ours_reserved"]
    assert r["same_stats"] and r["summary_ok"]
    assert r["peak_after_reset"] == r["ours_peak_after_reset"] < 3 * MiB
    assert r["snapshot_segments"] == r["ours_segments"] > 0


def test_cuda_graph_capture_is_refused_at_its_start():
    r = run_gpu_worker("graph_capture")
    assert "does not support CUDA graph capture" in r["message"], r
    assert "dtralloc.install()" in r["message"]
    assert r["after"] == 2048.0  # the process keeps working
    assert "does not support CUDA graph capture" in r["raw_message"], r
    # Refused before torch switched streams or put its generators into capture mode.
    assert r["default_stream"] and r["random_ok"], r


def test_a_raw_capture_is_refused_before_it_is_invalidated():
    r = run_gpu_worker("raw_capture")
    assert r["begin"] == 0, r
    assert "is capturing a CUDA graph" in r["message"], r
    assert r["end"] == 0, r  # dtralloc made no call the capture forbids


def test_oom_reaches_python_as_a_recognisable_runtime_error():
    r = run_gpu_worker("oom")
    assert r["is_runtime_error"] and len(r["args"]) == 1, r
    assert "CUDA out of memory." in r["args"][0]
    # torch's pluggable interface turns any allocator exception into
    # RuntimeError; only c10::OutOfMemoryError becomes torch.cuda.OutOfMemoryError.
    assert not r["is_torch_oom"]
    assert r["stats"]["num_ooms"] == 1


def test_unmap_pages_gives_back_pages_of_vmm_segments():
    r = run_gpu_worker("vmm_pages")
    assert r["vmm_unavailable"] == "", r
    assert r["sums"] == [3 * MiB * 7, 36 * MiB * 3], r
    assert r["page_releases"] == 1, r
    assert r["grad_ok"], r
    assert r["reserved_after_empty_cache"] == 0, r


def test_no_stray_context_on_device_0():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    assert run_gpu_worker("no_stray_context")["device0_context"] == 0
