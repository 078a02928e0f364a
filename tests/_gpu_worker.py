"""Worker process for tests/test_gpu.py: real torch on a real GPU.

Each scenario runs in a fresh process (a fresh CUDA context, so that
dtralloc.install() comes before torch's first CUDA allocation) and prints one
JSON line with what it measured; it raises when a check fails.

    python _gpu_worker.py train native|dtralloc
    python _gpu_worker.py load | cupy | fraction_and_empty_cache
    python _gpu_worker.py record_stream_reuse wired|unwired
    python _gpu_worker.py memory_functions | graph_capture | raw_capture | oom
    python _gpu_worker.py no_stray_context
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
    # The last empty_cache() gave back every segment (nothing here keeps
    # device memory): whatever is left is device 0's.
    segments = dtralloc.snapshot()["segments"]
    assert all(seg["device"] == 0 for seg in segments), segments
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


def _install_without_record_stream_hook():
    """install() as it behaved before torch's hook names were used: every
    hook but set_record_stream_fn wired. The control run of
    record_stream_reuse, showing that the check has teeth on this GPU."""
    import dtralloc
    from dtralloc import torch_hooks

    torch_hooks._REQUIRED_HOOKS = tuple(h for h in torch_hooks._REQUIRED_HOOKS if h[0] != "set_record_stream_fn")
    dtralloc.install()


def record_stream_reuse(variant: str) -> dict:
    """A tensor allocated on the default stream is read late on a side stream
    (record_stream), freed, and its size asked for again at once on the
    default stream. With the hook, the block must not come back before the
    side stream is done, and the side stream must read the original values."""
    import dtralloc

    if variant == "unwired":
        _install_without_record_stream_hook()
    else:
        dtralloc.install()
    import torch

    n = 16 * MiB // 4  # float32 elements: 16 MiB, a block of its own
    side = torch.cuda.Stream()
    x = torch.full((n,), 1.0, device="cuda")
    out = torch.empty_like(x)
    ptr = x.data_ptr()
    side.wait_stream(torch.cuda.current_stream())  # side sees x filled and out allocated
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the side stream is still busy below
        out.copy_(x)  # reads x late
    x.record_stream(side)
    out.record_stream(side)
    del x
    y = torch.full((n,), 2.0, device="cuda")  # same size, default stream, side still busy
    reused = y.data_ptr() == ptr
    torch.cuda.synchronize()
    corrupted = not bool((out == 1.0).all().item())
    stats = _check_pool()
    return {"reused": reused, "corrupted": corrupted, "stats": stats}


def memory_functions() -> dict:
    """torch's memory functions answer with dtralloc's figures."""
    import dtralloc

    dtralloc.install()
    import torch

    a = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(1000, dtype=torch.uint8, device="cuda")
    ours = dtralloc.memory_stats(0)
    result = {
        "memory_allocated": torch.cuda.memory_allocated(),
        "ours_allocated": ours["allocated_bytes.all.current"],
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "ours_peak": ours["allocated_bytes.all.peak"],
        "memory_reserved": torch.cuda.memory_reserved(),
        "ours_reserved": ours["reserved_bytes.all.current"],
        "same_stats": dict(torch.cuda.memory_stats()) == dict(ours),
        "summary_ok": "PyTorch CUDA memory summary" in torch.cuda.memory_summary(),
    }
    del a
    torch.cuda.reset_peak_memory_stats()
    result["peak_after_reset"] = torch.cuda.max_memory_allocated()
    result["ours_peak_after_reset"] = dtralloc.memory_stats(0)["allocated_bytes.all.peak"]
    result["snapshot_segments"] = len(torch.cuda.memory_snapshot())
    result["ours_segments"] = len(dtralloc.snapshot()["segments"])
    del b
    result["stats"] = _check_pool()
    return result


def graph_capture() -> dict:
    """torch.cuda.graph is refused at capture begin, with the cause and the
    way out, and the process keeps working."""
    import dtralloc

    dtralloc.install()
    import torch

    x = torch.ones(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    message = ""
    try:
        with torch.cuda.graph(g):
            y = x * 2  # noqa: F841
    except RuntimeError as e:
        message = str(e)
    raw_message = ""
    try:
        g.capture_begin()  # what torch.cuda.graph calls, called directly
    except RuntimeError as e:
        raw_message = str(e)
    torch.cuda.synchronize()
    after = float((x + 1).sum().item())
    # Refused before torch changed anything: the default stream is still
    # current, and CUDA random ops run (a generator left in capture mode
    # raises "Offset increment outside graph capture").
    default_stream = torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.manual_seed(0)
    drawn = torch.rand(4, device="cuda").tolist()
    torch.manual_seed(0)
    again = torch.rand(4, device="cuda").tolist()
    return {"message": message, "raw_message": raw_message, "after": after, "default_stream": default_stream,
            "random_ok": drawn == again, "stats": _check_pool()}


def raw_capture() -> dict:
    """A capture begun outside torch's graph API (no allocator hook): the
    first allocation the cache cannot serve is refused before any CUDA call,
    so the capture itself stays valid (cudaStreamEndCapture succeeds)."""
    import ctypes

    import dtralloc

    dtralloc.install()
    import torch

    torch.ones(1, device="cuda")  # CUDA up, runtime loaded
    cudart = ctypes.CDLL(dtralloc._core.cuda_runtime_path())
    s = torch.cuda.Stream()
    handle = ctypes.c_void_p(s.cuda_stream)
    message = ""
    begin = cudart.cudaStreamBeginCapture(handle, 0)  # cudaStreamCaptureModeGlobal
    try:
        with torch.cuda.stream(s):
            torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # a miss: needs cudaMalloc
    except RuntimeError as e:
        message = str(e)
    graph = ctypes.c_void_p()
    end = cudart.cudaStreamEndCapture(handle, ctypes.byref(graph))
    if graph.value:
        cudart.cudaGraphDestroy(graph)
    torch.cuda.synchronize()
    return {"begin": begin, "end": end, "message": message, "stats": _check_pool()}


def oom() -> dict:
    """An OOM under torch reaches Python as RuntimeError whose text the batch
    size finders (accelerate, Lightning) recognise."""
    import dtralloc

    dtralloc.install("budget:256M")
    import torch

    keep = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    error = None
    try:
        torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    except Exception as e:  # noqa: BLE001 - the type is what is measured
        error = e
    after = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # still works
    del keep, after
    return {
        "type": type(error).__name__,
        "is_runtime_error": isinstance(error, RuntimeError),
        "is_torch_oom": isinstance(error, torch.cuda.OutOfMemoryError),
        "args": list(error.args) if error else [],
        "stats": _check_pool(),
    }


def no_stray_context() -> dict:
    """Two GPUs: a thread that never chose a device frees, with record_stream,
    a tensor of device 1; no context appears on device 0."""
    import ctypes
    import threading

    import dtralloc

    dtralloc.install()
    import torch

    torch.cuda.set_device(1)
    t = torch.ones(MiB, device="cuda:1")
    side = torch.cuda.Stream(device=1)
    t.record_stream(side)
    holder = [t]
    del t

    def drop():
        holder.clear()  # the free, and its event on device 1, from this thread

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join()
    torch.cuda.synchronize(1)
    libcuda = ctypes.CDLL("libcuda.so.1")
    flags, active = ctypes.c_uint(), ctypes.c_int()
    libcuda.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active))
    return {"device0_context": active.value}


def vmm_pages() -> dict:
    """unmap_pages:on on a GPU: VMM segments, whose free pages go back while
    a tensor in the same segment keeps its bytes; autograd's device thread
    allocates from them too."""
    import dtralloc

    # 44 MiB: 20 + 36 > 44 makes the pages go back; the 4 MiB kept then and
    # the 36 leave room for the small segments (2 MiB each) of what follows.
    dtralloc.install("budget:44M,unmap_pages:on")
    import torch

    kept = torch.full((3 * MiB,), 7, dtype=torch.uint8, device="cuda")  # a 20 MiB segment
    scratch = torch.ones(4 * MiB, dtype=torch.uint8, device="cuda")
    del scratch
    big = torch.full((36 * MiB,), 3, dtype=torch.uint8, device="cuda")  # 20 + 36 > 44: pages go back
    # On the host: a sum with dtype=int64 on the device casts first, and the
    # 24 MiB int64 copy of `kept` did not fit the budget (H100, 2026-11-27).
    sums = [int(kept.cpu().sum(dtype=torch.int64)), int(big.cpu().sum(dtype=torch.int64))]
    stats = dtralloc.memory_stats()
    releases = stats["num_page_releases"]
    del big
    x = torch.randn(256, 512, device="cuda")
    w = torch.randn(256, 512, device="cuda", requires_grad=True)
    # Backward runs on autograd's device thread. Elementwise: a matmul would
    # make cuBLAS workspaces (32 MiB per thread on Hopper) that torch keeps
    # for the process, past the budget and past empty_cache().
    (x * w).sum().backward()
    grad_ok = bool(torch.equal(w.grad, x))
    del kept, x, w
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {
        "vmm_unavailable": dtralloc._core.cuda_vmm_unavailable(0),
        "sums": sums,
        "page_releases": releases,
        "grad_ok": grad_ok,
        "reserved_after_empty_cache": dtralloc.memory_stats()["reserved_bytes.all.current"],
        "stats": _check_pool(),
    }


SCENARIOS = {
    "vmm_pages": vmm_pages,
    "train": train,
    "load": load,
    "cupy": cupy_shares_the_pool,
    "fraction_and_empty_cache": fraction_and_empty_cache,
    "record_stream_reuse": record_stream_reuse,
    "memory_functions": memory_functions,
    "graph_capture": graph_capture,
    "raw_capture": raw_capture,
    "oom": oom,
    "no_stray_context": no_stray_context,
}


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result), flush=True)
