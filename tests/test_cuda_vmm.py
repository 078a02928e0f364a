"""The cuda backend's VMM segments (unmap_pages on a GPU), over the fake
runtime's copy of the driver's virtual memory API. Each scenario of
tests/_vmm_worker.py runs in a fresh interpreter, since the runtime is
loaded once per process. tests/test_gpu.py runs the same path on a GPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dtralloc.testing import fake_cudart_path

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vmm_worker.py")

SCENARIOS = {
    "pages_go_back_and_the_rest_stays": None,
    "only_unmap_pages_on_makes_vmm_segments": None,
    "without_vmm_auto_runs_and_on_is_refused": None,
    "out_of_memory_midway_leaves_nothing_behind": None,
    "a_thread_without_a_context_allocates": None,
    "torch_entry_points_get_vmm_segments": "policy:dtralloc,budget:256M,unmap_pages:on",
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_vmm_segments(scenario):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    env["DTRALLOC_CUDART"] = fake_cudart_path()
    if SCENARIOS[scenario] is not None:
        env["DTRALLOC_CONF"] = SCENARIOS[scenario]
    proc = subprocess.run([sys.executable, WORKER, scenario], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"PASS {scenario}" in proc.stdout, (
        f"scenario {scenario!r} failed (exit {proc.returncode})\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
