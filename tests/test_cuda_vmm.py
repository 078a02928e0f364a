"""The cuda backend's VMM segments (unmap_pages on a GPU), over the fake
runtime's copy of the driver's virtual memory API. Each scenario of
tests/_vmm_worker.py runs in a fresh interpreter, since the runtime is
loaded once per process. tests/test_gpu.py runs the same path on a GPU."""
from __future__ import annotations

import os

import pytest

from _scenario_main import run_in_fresh_process

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
    run_in_fresh_process(WORKER, scenario, SCENARIOS[scenario])
