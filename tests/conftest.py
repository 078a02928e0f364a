"""Shared helpers for the Python tests.

* Hypothesis profiles: ``ci`` (derandomized: the same examples every run, so a
  red CI run is reproducible) is used when ``CI`` is set; ``dev`` otherwise.
  ``HYPOTHESIS_PROFILE=<name>`` picks one explicitly; ``thorough`` runs many
  more examples for local soak testing.
* ``torch_round_size`` / ``torch_segment_size``: the documented size policy
  (torch's CUDACachingAllocator, kept by dtralloc), written independently of
  the C++ so the tests check the pool against the rule, not against itself.
* ``make_pool``: a fixture that builds pools and, at teardown, checks their
  invariants and returns every block the test still holds, so a failing test
  does not leak host memory into the next one.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import dtralloc

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Torch's constants (c10/cuda/CUDACachingAllocator.cpp), as documented in the
# issue and in allocator/block_pool.h.
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB        # largest request served by the small pool
SMALL_BUFFER = 2 * MiB      # small-pool segment
LARGE_BUFFER = 20 * MiB     # segment for requests up to 10 MiB
MIN_LARGE_ALLOC = 10 * MiB  # from here, segments of the request's own size
ROUND_LARGE = 2 * MiB       # rounding of own-size segments

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("dev", **_COMMON)
settings.register_profile("thorough", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def torch_round_size(size: int, divisions: int = 0) -> int:
    """The block size a request of `size` bytes is rounded to (torch's rule)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor // divisions
        down = size - size % step
        return size if down == size else down + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def torch_pool_kind(rounded: int) -> str:
    """'small' or 'large', the snapshot's segment_type for a rounded request."""
    return "small" if rounded <= SMALL_SIZE else "large"


def torch_segment_size(rounded: int) -> int:
    """Size of the segment the pool asks the backend for, for a rounded request."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


def blocks_by_address(pool) -> dict:
    """{address: (segment, block)} for every block of pool.snapshot()."""
    out = {}
    for seg in pool.snapshot()["segments"]:
        for block in seg["blocks"]:
            out[block["address"]] = (seg, block)
    return out


def stats_delta(before: dict, after: dict) -> dict:
    """The stats keys whose values differ, as {key: (before, after)}."""
    return {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}


class _PoolFactory:
    def __init__(self):
        self.pools = []

    def __call__(self, backend="host", capacity="1G", conf="", **kw):
        pool = dtralloc.Pool(backend=backend, capacity=capacity, conf=conf, **kw)
        self.pools.append(pool)
        return pool

    def close(self):
        for pool in self.pools:
            pool.set_eviction_hook(None)
            pool.check_invariants()
            # Return whatever the test still holds: the pool leaks segments with
            # live blocks at destruction on purpose (see allocator.cpp).
            for seg in pool.snapshot()["segments"]:
                for block in seg["blocks"]:
                    if block["state"] == "active_allocated":
                        pool.free(block["address"])
            pool.complete_events()
            pool.empty_cache()
            pool.check_invariants()
            assert pool.stats()["reserved_bytes.all.current"] == 0
        self.pools.clear()


@pytest.fixture
def make_pool():
    """make_pool(backend="host", capacity="1G", conf="") -> dtralloc.Pool."""
    factory = _PoolFactory()
    yield factory
    factory.close()


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: MKL promises the same bits from run
    to run only so (docs/live.md, Known limits), which bit-exactness against
    a plain run needs."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
