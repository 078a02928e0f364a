"""The cuda backend's async segments (async_segments:on: CUDA's
stream-ordered allocator), over the fake runtime's copy of cudaMemPoolCreate,
cudaMallocFromPoolAsync and cudaFreeAsync. Each scenario of
tests/_async_worker.py runs in a fresh interpreter, since the runtime is
loaded once per process. tests/test_gpu.py runs the same path on a GPU."""
from __future__ import annotations

import os

import pytest

from _scenario_main import run_in_fresh_process

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_async_worker.py")

SCENARIOS = {
    "segments_are_made_and_given_back_without_waiting": None,
    "only_async_segments_on_uses_the_stream_ordered_allocator": None,
    "refused_where_it_cannot_run": None,
    "out_of_memory_waits_once_then_answers": None,
    "a_capturing_stream_keeps_its_segment": None,
    "torch_entry_points_get_async_segments": "policy:dtralloc,budget:256M,async_segments:on",
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_async_segments(scenario):
    run_in_fresh_process(WORKER, scenario, SCENARIOS[scenario])
