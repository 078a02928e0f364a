"""An OOM from dtralloc is recognised where torch's own OOM is.

Batch-size finders decide "too big, halve the batch" by matching the text of
torch's OOM error. Their predicates are restated below from their sources; an
OOM that fails them makes the finder give up instead of shrinking the batch.

Under torch, dtralloc's allocator error reaches Python as RuntimeError(what())
(torch's pluggable-allocator interface translates any C++ exception that way;
tests/cpp/test_c_api_throw.cpp checks that what() carries the same words).
From dtralloc's own API (Pool, CuPy) it is dtralloc.OutOfMemoryError, which is
a RuntimeError like torch.cuda.OutOfMemoryError and a MemoryError like CuPy's.
"""
from __future__ import annotations

import pytest

import dtralloc

MiB = 1 << 20


def accelerate_should_reduce_batch_size(exception: BaseException) -> bool:
    """accelerate/utils/memory.py: should_reduce_batch_size (CUDA branch)."""
    statements = ["CUDA out of memory."]
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(err in exception.args[0] for err in statements)
    return False


def lightning_is_cuda_out_of_memory(exception: BaseException) -> bool:
    """lightning/pytorch/utilities/memory.py: is_cuda_out_of_memory."""
    return (
        isinstance(exception, RuntimeError)
        and len(exception.args) == 1
        and "CUDA" in exception.args[0]
        and "out of memory" in exception.args[0]
    )


@pytest.mark.parametrize("backend", ["host", "virtual"])
def test_pool_oom_is_recognised_by_batch_size_finders(backend):
    pool = dtralloc.Pool(backend, capacity="1G", conf="budget:64M")
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        pool.malloc(100 * MiB)
    error = info.value
    assert accelerate_should_reduce_batch_size(error)
    assert lightning_is_cuda_out_of_memory(error)
    assert str(error).startswith("dtralloc: CUDA out of memory. Tried to allocate 100 MiB")
    # What callers already catch keeps working: MemoryError (CuPy's OOM is one).
    assert isinstance(error, MemoryError) and isinstance(error, RuntimeError)


def test_oom_for_an_impossible_size_is_recognised_too():
    pool = dtralloc.Pool("virtual", capacity="1G")
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        pool.malloc(1 << 63)
    assert accelerate_should_reduce_batch_size(info.value)
