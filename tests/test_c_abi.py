"""libdtralloc.so through the exact call path torch uses, on the fake CUDA runtime.

The process-wide allocators behind the C ABI load the CUDA runtime once per
process, so each test runs one scenario of tests/_abi_worker.py in a fresh
interpreter with DTRALLOC_CUDART pointing at the fake runtime. The worker
calls the C entry points through function pointers with torch's prototypes and
checks, step by step, that the Python API (memory_stats, snapshot,
empty_cache) sees the very same pool and that the fake's cudaMalloc/cudaFree
counts match num_device_alloc/num_device_free. Here we check the exit status
and what a user would read on stderr.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dtralloc.testing import fake_cudart_path

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_abi_worker.py")


def run_worker(scenario: str, conf: str | None = None, cudart: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    env["DTRALLOC_CUDART"] = cudart or fake_cudart_path()
    if conf is not None:
        env["DTRALLOC_CONF"] = conf
    proc = subprocess.run(
        [sys.executable, WORKER, scenario], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and f"PASS {scenario}" in proc.stdout, (
        f"worker scenario {scenario!r} failed (exit {proc.returncode})\n"
        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc


def test_malloc_free_round_trip_shares_one_pool_with_the_python_api():
    proc = run_worker("round_trip", conf="history_entries:4096")  # the worker reads the history
    assert proc.stderr == ""  # nothing went wrong, so nothing was printed


def test_absolute_budget_turns_into_null_and_a_clear_oom():
    proc = run_worker("budget_absolute", conf="budget:64M,history_entries:4096")
    assert "dtralloc: CUDA out of memory. Tried to allocate 8 MiB (8 MiB rounded) on device 0" in proc.stderr
    assert "Budget 64 MiB" in proc.stderr
    assert "raise DTRALLOC_CONF=budget" in proc.stderr


def test_device_call_time_is_counted_with_cudafrees_wait():
    run_worker("device_call_time")


def test_live_sessions_on_the_pool_end_in_any_order():
    run_worker("live_sessions_end_in_any_order", conf="budget:512M")


def test_fractional_budget_uses_the_device_capacity():
    proc = run_worker("budget_fraction", conf="budget:0.5")
    assert "Budget 128 MiB" in proc.stderr
    assert "device capacity 256 MiB" in proc.stderr


def test_failed_cudamalloc_releases_the_cache_and_retries():
    proc = run_worker("cudamalloc_failures")
    # Only the requests that could not be served after the retry are reported.
    assert proc.stderr.count("out of memory") == 2


def test_set_memory_fraction_lowers_and_raises_the_budget():
    proc = run_worker("memory_fraction")
    assert "memory fraction must be in [0, 1], got 1.5" in proc.stderr
    assert "CUDA device 3 does not exist" in proc.stderr


def test_record_stream_defers_reuse_until_the_event_completes():
    run_worker("record_stream")


def test_cuda_graph_capture_is_refused_before_any_illegal_call():
    proc = run_worker("capture")
    assert "does not support CUDA graph capture" in proc.stderr


def test_double_free_and_unknown_pointers_are_reported_not_fatal():
    proc = run_worker("invalid_free")
    assert "a double free" in proc.stderr
    assert "Nothing was changed" in proc.stderr
    assert proc.stderr.count("(in dtralloc_free)") == 4


def test_each_device_has_its_own_pool():
    run_worker("two_devices")


@pytest.mark.parametrize(
    "conf, message",
    [
        ("budget:lots", "DTRALLOC_CONF: bad value 'lots' for key 'budget'"),
        ("bogus_key:1", "DTRALLOC_CONF: unknown key 'bogus_key'"),
        ("expandable_segments:True", "is a PYTORCH_CUDA_ALLOC_CONF setting that dtralloc does not implement"),
    ],
)
def test_bad_conf_fails_allocations_without_crashing(conf, message):
    proc = run_worker("bad_conf", conf=conf)
    assert message in proc.stderr
    assert "(in dtralloc_malloc)" in proc.stderr


def test_missing_runtime_names_dtralloc_cudart():
    proc = run_worker("missing_runtime", cudart="/nonexistent/libcudart.so.12")
    assert "DTRALLOC_CUDART=/nonexistent/libcudart.so.12 could not be loaded" in proc.stderr
    assert "unset it to search the default locations" in proc.stderr


def test_no_visible_device_is_an_error_until_one_appears():
    proc = run_worker("no_device")
    assert "sees no usable GPU" in proc.stderr


def test_threads_through_ctypes_keep_blocks_private_and_the_pool_consistent():
    proc = run_worker("threads")
    assert proc.stderr == ""
