"""Worker process for tests/test_gpu.py: real torch on a real GPU.

Each scenario runs in a fresh process (a fresh CUDA context, so that
dtralloc.install() comes before torch's first CUDA allocation) and prints one
JSON line with what it measured; it raises when a check fails.

    python _gpu_worker.py train native|dtralloc
    python _gpu_worker.py load | cupy | fraction_and_empty_cache
"""
from __future__ import annotations

import gc
import json
import sys

MiB = 1 << 20


def _stats_subset(stats: dict) -> dict:
    keys = (
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.current",
        "allocation.all.allocated",
        "num_ooms",
        "num_device_alloc",
        "num_device_free",
        "num_invalid_frees",
        "budget_bytes",
        "capacity_bytes",
    )
    return {k: stats[k] for k in keys}


def _check_pool():
    import dtralloc

    dtralloc._core.global_pool(0).check_invariants()
    return _stats_subset(dtralloc.memory_stats(0))


def train(allocator: str) -> dict:
    if allocator == "dtralloc":
        import dtralloc

        dtralloc.install()
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    # cudnn.benchmark asks the allocator for cacheInfo, which torch's
    # CUDAPluggableAllocator does not implement; it is also a source of
    # run-to-run differences. TF32 off keeps both runs on the same math.
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 16 * 16, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 32, 32, generator=g).cuda()
    y = torch.randint(0, 10, (64,), generator=g).cuda()
    losses = []
    for _ in range(8):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    result = {"losses": losses}
    if allocator == "dtralloc":
        result["stats"] = _check_pool()
    return result


def load() -> dict:
    """Mixed sizes, a side stream with record_stream, frees: stats stay consistent."""
    import dtralloc

    dtralloc.install()
    import torch

    torch.manual_seed(0)
    baseline = None
    side = torch.cuda.Stream()
    for step in range(20):
        tensors = [torch.randn(int(n), device="cuda") for n in torch.randint(1, 3 * MiB, (16,))]
        if baseline is None:
            baseline = dtralloc.memory_stats(0)["allocated_bytes.all.current"] - sum(
                t.untyped_storage().nbytes() for t in tensors
            )
        big = torch.ones(8 * MiB, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            doubled = big * 2  # big is used on the side stream ...
        big.record_stream(side)  # ... so it must not be reused before side is done
        del big
        with torch.cuda.stream(side):
            total = doubled.sum()
        torch.cuda.current_stream().wait_stream(side)
        assert total.item() == 2.0 * 8 * MiB, total.item()
        del tensors, doubled, total
        if step % 5 == 4:
            torch.cuda.empty_cache()
    torch.cuda.synchronize()
    gc.collect()
    stats = _check_pool()
    assert stats["allocated_bytes.all.peak"] > 0, stats
    assert stats["num_ooms"] == 0, stats
    assert stats["num_invalid_frees"] == 0, stats
    assert stats["allocated_bytes.all.current"] <= max(baseline, 0) + 8 * MiB, (stats, baseline)
    segments = dtralloc.snapshot()["segments"]
    assert segments and all(seg["device"] == 0 for seg in segments), segments
    return {"stats": stats, "baseline": baseline}


def cupy_shares_the_pool() -> dict:
    import dtralloc

    dtralloc.install()
    dtralloc.install_cupy()
    import cupy
    import torch

    t = torch.ones(MiB, device="cuda")  # 4 MiB from torch
    before = dtralloc.memory_stats(0)["allocated_bytes.all.current"]
    a = cupy.ones(MiB, dtype=cupy.float32)  # 4 MiB from CuPy; sums exactly in float32
    during = dtralloc.memory_stats(0)["allocated_bytes.all.current"]
    assert during - before >= 4 * MiB, (before, during)
    ptr = a.data.ptr
    assert any(s["address"] <= ptr < s["address"] + s["total_size"] for s in dtralloc.snapshot()["segments"]), ptr
    assert float(a.sum()) == float(MiB), float(a.sum())
    assert float(t.sum().item()) == float(MiB)
    del a
    gc.collect()
    cupy.cuda.Device().synchronize()
    after = dtralloc.memory_stats(0)["allocated_bytes.all.current"]
    assert during - after >= 4 * MiB, (during, after)
    empty = cupy.empty(0, dtype=cupy.float32)  # size 0 goes through cupy_allocator too
    assert empty.size == 0
    return {"before": before, "during": during, "after": after, "stats": _check_pool()}


def fraction_and_empty_cache() -> dict:
    import dtralloc

    dtralloc.install()
    import torch

    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # initializes CUDA
    capacity = dtralloc.memory_stats(0)["capacity_bytes"]
    torch.cuda.set_per_process_memory_fraction(0.5, 0)  # -> dtralloc_set_memory_fraction
    budget = dtralloc.memory_stats(0)["budget_bytes"]
    assert budget == int(0.5 * capacity), (budget, capacity)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert dtralloc.memory_stats(0)["budget_bytes"] == capacity
    del x
    torch.cuda.synchronize()
    cached = dtralloc.memory_stats(0)
    assert cached["reserved_bytes.all.current"] >= 64 * MiB, cached
    torch.cuda.empty_cache()  # -> dtralloc_empty_cache
    emptied = dtralloc.memory_stats(0)
    assert emptied["num_device_free"] > cached["num_device_free"], (cached, emptied)
    assert emptied["reserved_bytes.all.current"] <= cached["reserved_bytes.all.current"] - 64 * MiB
    return {"capacity": capacity, "half_budget": budget, "stats": _check_pool()}


SCENARIOS = {
    "train": train,
    "load": load,
    "cupy": cupy_shares_the_pool,
    "fraction_and_empty_cache": fraction_and_empty_cache,
}


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result), flush=True)
