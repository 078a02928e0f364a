"""An OOM from dtralloc is recognised where torch's own OOM is.

Batch-size finders decide "too big, lower the batch" by matching the text of
torch's OOM error: accelerate's `should_reduce_batch_size` (behind
transformers' `Trainer(auto_find_batch_size=True)`) and Lightning's
`is_oom_error` (its BatchSizeFinder). Their own functions are called here; an
OOM that fails them makes the finder give up instead of lowering the batch.

Under torch, dtralloc's allocator error reaches Python as RuntimeError(what())
(torch's pluggable-allocator interface translates any C++ exception that way;
tests/cpp/test_c_api_throw.cpp checks that what() carries the same words).
From dtralloc's own API (Pool, CuPy, a dtr() session) it is
dtralloc.OutOfMemoryError, which is a RuntimeError like
torch.cuda.OutOfMemoryError and a MemoryError like CuPy's.
"""
from __future__ import annotations

import pytest

import dtralloc

MiB = 1 << 20

should_reduce_batch_size = pytest.importorskip("accelerate.utils.memory").should_reduce_batch_size


def lightning_is_oom_error(exception: BaseException) -> bool:
    return pytest.importorskip("lightning.pytorch.utilities.memory").is_oom_error(exception)


@pytest.mark.parametrize("backend", ["host", "virtual"])
def test_pool_oom_is_recognised_by_batch_size_finders(backend):
    pool = dtralloc.Pool(backend, capacity="1G", conf="budget:64M")
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        pool.malloc(100 * MiB)
    error = info.value
    assert should_reduce_batch_size(error)
    assert lightning_is_oom_error(error)
    assert str(error).startswith("dtralloc: CUDA out of memory. Tried to allocate 100 MiB")
    # What callers already catch keeps working: MemoryError (CuPy's OOM is one).
    assert isinstance(error, MemoryError) and isinstance(error, RuntimeError)


def test_oom_for_an_impossible_size_is_recognised_too():
    pool = dtralloc.Pool("virtual", capacity="1G")
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        pool.malloc(1 << 63)
    assert should_reduce_batch_size(info.value) and lightning_is_oom_error(info.value)


def test_a_cpu_sessions_oom_is_recognised_by_accelerate():
    """A CPU session's OOM says " out of memory." as torch's does, which is
    what accelerate looks for; Lightning also wants "CUDA" in the text (a
    CUDA session's OOM is the pool's, above) or "DefaultCPUAllocator", and a
    CPU session's has neither (README, "Training under a memory budget")."""
    torch = pytest.importorskip("torch")
    from dtralloc.dtr import dtr

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        with dtr(budget="2M", device="cpu"):
            kept = [model[: i + 1](torch.randn(512, 256)) for i in range(4)]  # noqa: F841  (held)
    error = info.value
    assert str(error).startswith("dtralloc.dtr: out of memory. Tried to allocate 512 KiB for an op's output. ")
    assert should_reduce_batch_size(error)
    assert not lightning_is_oom_error(error)
    assert isinstance(error, RuntimeError) and isinstance(error, MemoryError)
