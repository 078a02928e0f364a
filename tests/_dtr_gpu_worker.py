"""Worker process for tests/test_dtr_gpu.py: live DTR (dtralloc.dtr) on a real GPU.

Each scenario runs in a fresh process: dtralloc.install() must come before
torch's first CUDA allocation. It prints one JSON line with what it measured;
the test asserts on it.

    python _dtr_gpu_worker.py dropout | verify | generator | oom | device_thread | device_full | op_costs | long_lived | async_segments | foreach | hf
    python _dtr_gpu_worker.py flash_dropout float16|bfloat16
    python _dtr_gpu_worker.py amp whole|forward
    python _dtr_gpu_worker.py opinfo [backward|forward-ad|modules] [DTYPE] [SAMPLES_PER_OP] [SECONDS]
"""
from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import json
import sys
import threading
import time

MiB = 1 << 20


def _setup(conf=None):
    import dtralloc

    dtralloc.install(conf)
    import torch

    # Bit-exact comparisons need the same kernels in both runs: deterministic
    # algorithms (flash attention's backward, cuBLAS with the workspace
    # setting the test's environment carries), no TF32, no cuDNN autotuning.
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    return dtralloc, torch


def _pool_ok(dtralloc) -> bool:
    dtralloc._core.global_pool(0).check_invariants()
    return True


def _train(torch, model, batch, loss_fn, steps, session=None):
    """`steps` AdamW steps; forward+backward inside a fresh `session()` when
    given. Returns (losses, parameters, CUDA RNG state) and the last session."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, s = [], None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if session is None:
            loss = loss_fn(model, batch)
            loss.backward()
        else:
            with session() as s:
                loss = loss_fn(model, batch)
                loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    return (losses, [p.detach().clone() for p in model.parameters()], torch.cuda.get_rng_state()), s


def _settle(torch) -> None:
    """What the program dropped is freed and the pool's cache given back."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _mlp_workload(torch, dropout: float = 0.0):
    """Eight Linear(1024) + ReLU (+ Dropout) layers on a 2048-row batch:
    (build, batch, loss_fn), each build() seeded the same."""
    from torch import nn

    def build():
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else []))
                  for _ in range(8)]
        return nn.Sequential(*layers).cuda()

    def loss_fn(model, x):
        return model(x).square().mean()

    return build, torch.randn(2048, 1024, device="cuda"), loss_fn


def _step_bytes(dtralloc, torch, build, batch, loss_fn) -> int:
    """What one forward+backward of a fresh `build()` in a session without a
    budget adds to what is allocated (activations, gradients, temporaries)."""
    model = build()
    before = dtralloc.memory_stats()["allocated_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()  # dtralloc's, once installed (torch_memory.py)
    with dtralloc.dtr():
        loss_fn(model, batch).backward()
    return torch.cuda.max_memory_allocated() - before


def _identical(torch, got, want) -> list:
    """Names of what differs (empty: bit-exact)."""
    diffs = []
    for kind, a, b in zip(("loss", "parameter"), got[:2], want[:2]):
        diffs += [f"{kind} {i}" for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
    if not torch.equal(got[2], want[2]):
        diffs.append("CUDA RNG state")
    return diffs


def _plain_twice_and_live(torch, build, batch, loss_fn, steps, session):
    """Plain, plain again (the control: are the kernels themselves
    deterministic?) and under `session`, each from the same initial weights
    and seed."""
    model = build()
    init = copy.deepcopy(model.state_dict())
    results = []
    for run_session in (None, None, session):
        model.load_state_dict(init)
        torch.manual_seed(7)
        results.append(_train(torch, model, batch, loss_fn, steps, run_session))
    (want, _), (again, _), (got, s) = results
    return _identical(torch, again, want), _identical(torch, got, want), s


def _dropout_mlp(torch):
    """Four Linear + ReLU (in place) + Dropout layers on CUDA, seeded."""
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Dropout(0.3)]
    return nn.Sequential(*layers).cuda()


def dropout() -> dict:
    """nn.Dropout (and ReLU in place) on CUDA under chaos: every dropout mask
    recomputed from the Philox seed and offset it first ran with."""
    dtralloc, torch = _setup()
    x = torch.randn(256, 512, device="cuda")
    control, diffs, s = _plain_twice_and_live(torch, lambda: _dropout_mlp(torch), x,
                                              lambda m, b: m(b).square().mean(), 2,
                                              lambda: dtralloc.dtr(chaos=True, check_invariants=True))
    return {"control": control, "diffs": diffs, "stats": s.stats(), "pool_ok": _pool_ok(dtralloc)}


def verify() -> dict:
    """Session.verify() on CUDA: the dropout model's AdamW step, plain twice
    and under chaos, each from the state it found (the CUDA generator's
    included), and that state put back afterwards."""
    dtralloc, torch = _setup()
    model = _dropout_mlp(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 512, device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    step()  # optimizer state and gradients exist before the check
    before = [p.detach().clone() for p in model.parameters()] + [torch.cuda.get_rng_state()]
    result = dtralloc.dtr(chaos=True).verify(step, model, opt)
    after = [p.detach().clone() for p in model.parameters()] + [torch.cuda.get_rng_state()]
    return {"exact": result.exact, "deterministic": result.deterministic, "compared": result.compared,
            "text": str(result), "stats": result.stats,
            "put_back": all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(before, after)),
            "pool_ok": _pool_ok(dtralloc)}


def amp(recipe: str = "whole") -> dict:
    """float16 autocast with a GradScaler on CUDA, the usual mixed-precision
    recipe, under chaos: the dropout model's eight AdamW steps, the whole step
    in the session or (`recipe` "forward") the forward alone, the scaled
    backward, the scaler's step and update after it. The first scale
    overflows float16's gradients (on CPU the first four steps skip, then
    steps apply): the scaler's CUDA kernels unscale and check them in place,
    its step reads found_inf on the host and skips, and its scale (a tensor
    the first session made) is rewritten in place."""
    from _amp_steps import scaled_steps

    dtralloc, torch = _setup()
    x = torch.randn(256, 512, device="cuda")
    init_scale = 2.0 ** 30

    def run(session):
        (losses, params, scales, _), sessions = scaled_steps(torch, _dropout_mlp(torch), x, "cuda", 8, init_scale,
                                                             recipe, session)
        torch.cuda.synchronize()
        return (losses, params, torch.cuda.get_rng_state()), scales, sessions[-1]

    want, want_scales, _ = run(None)
    again, _, _ = run(None)
    got, got_scales, s = run(lambda: dtralloc.dtr(chaos=True))
    return {"control": _identical(torch, again, want), "diffs": _identical(torch, got, want),
            "init_scale": init_scale, "scales": want_scales, "same_scales": got_scales == want_scales,
            "stats": s.stats(), "pool_ok": _pool_ok(dtralloc)}


def flash_dropout(dtype_name: str) -> dict:
    """scaled_dot_product_attention with dropout on fp16/bf16 inputs, forced
    onto flash attention; under chaos its output is recomputed with the same
    Philox state, so backward sees the same dropout mask."""
    dtralloc, torch = _setup()
    from torch import nn
    from torch.nn import functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    dtype = getattr(torch, dtype_name)

    class Attention(nn.Module):
        def __init__(self, d=512, heads=8):
            super().__init__()
            self.heads = heads
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # flash or an error, never a fallback
                a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
            return x + self.proj(a.transpose(1, 2).reshape(b, t, d))

    def build():
        torch.manual_seed(0)
        return nn.Sequential(Attention(), nn.LayerNorm(512), Attention()).to("cuda", dtype)

    x = torch.randn(4, 256, 512, device="cuda", dtype=dtype)
    loss_fn = lambda m, b: m(b).float().square().mean()  # noqa: E731

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func._schema.name)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:  # which kernels plain runs pick
        loss_fn(build(), x).backward()
    control, diffs, s = _plain_twice_and_live(torch, build, x, loss_fn, 2,
                                              lambda: dtralloc.dtr(chaos=True, check_invariants=True))
    # Where plain differs from plain (on an H100, 2026-11-27, float16's
    # backward did under deterministic algorithms, bfloat16's did not), bit
    # for bit means nothing: one step's gradients, plain, plain again and
    # under chaos, say whether the recomputed dropout masks were the ones
    # drawn (a wrong mask changes the gradients by their own size, a
    # reduction's order by rounding).
    model = build()
    grads = []
    for session in (None, None, lambda: dtralloc.dtr(chaos=True)):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        with session() if session else contextlib.nullcontext():
            loss_fn(model, x).backward()
        grads.append([p.grad.double() for p in model.parameters()])
    scale = max(float(g.abs().max()) for g in grads[0])

    def spread(got):
        return max(float((a - b).abs().max()) for a, b in zip(got, grads[0])) / scale

    return {"ops": sorted(n for n in ops.names if "attention" in n), "control": control, "diffs": diffs,
            "grad_spread_control": spread(grads[1]), "grad_spread_live": spread(grads[2]),
            "stats": s.stats(), "pool_ok": _pool_ok(dtralloc)}


# tests/_hf_models.py's models on CUDA: every one but wav2vec2, whose CTC loss
# has no deterministic CUDA backward (deterministic algorithms are on here).
HF_MODELS = ("t5", "mixtral", "mamba", "swin", "clip")


def hf() -> dict:
    """Small transformers models (tests/_hf_models.py) on CUDA under chaos:
    two AdamW steps each, plain, plain again and live, every dropout mask,
    drop-path draw and recompute on the GPU. One process for all of them; a
    model that raises is reported, and the others still run."""
    dtralloc, torch = _setup()
    import numpy as np

    from _hf_models import MODELS, on

    result = {}
    for name in HF_MODELS:
        try:
            _, batch_of = MODELS[name]()
            batch = on(batch_of(torch.Generator().manual_seed(7)), "cuda")

            def build(name=name):
                torch.manual_seed(0)
                model, _ = MODELS[name]()
                return model.cuda().train()

            def loss_fn(model, b):
                np.random.seed(0)
                return model(**b).loss

            control, diffs, s = _plain_twice_and_live(torch, build, batch, loss_fn, 2,
                                                      lambda: dtralloc.dtr(chaos=True))
            result[name] = {"control": control, "diffs": diffs, "stats": s.stats()}
        except Exception as e:  # reported; the next model still runs
            result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        _settle(torch)
    result["pool_ok"] = _pool_ok(dtralloc)
    return result


def generator() -> dict:
    """Random ops drawing from an explicit torch.Generator(device="cuda"):
    replayed from that generator's state, which ends as in the plain run (and
    the default generator is not touched)."""
    dtralloc, torch = _setup()
    gen = torch.Generator(device="cuda")
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)

    def step():
        noise = torch.randn(1024, 1024, generator=gen, device="cuda")
        keep = torch.bernoulli(torch.full((1024, 1024), 0.7, device="cuda"), generator=gen)
        return ((x * noise).sin() * keep).tanh().sum()

    results = []
    for session in (None, None, lambda: dtralloc.dtr(chaos=True, check_invariants=True)):
        gen.manual_seed(3)
        torch.manual_seed(5)
        x.grad = None
        if session is None:
            step().backward()
        else:
            with session() as s:
                step().backward()
        torch.cuda.synchronize()
        results.append((x.grad.clone(), gen.get_state(), torch.cuda.get_rng_state()))
    want, again, got = results
    same = lambda a, b: [torch.equal(u, v) for u, v in zip(a, b)]  # noqa: E731
    return {"control": same(again, want), "same": same(got, want), "stats": s.stats(), "pool_ok": _pool_ok(dtralloc)}


def _hold_outputs_until_oom(dtralloc, torch, model, x, budget):
    """Keeps every output: nothing can be evicted, so the budget cannot be
    met. Returns the error's text, its type and the session's stats."""
    kept = []
    try:
        with dtralloc.dtr(budget=budget) as s:
            for i in range(len(model)):
                kept.append(model[: i + 1](x))
    except Exception as e:  # noqa: BLE001 - the type is what is measured
        error = e
    else:
        raise AssertionError(f"no OOM under a budget of {budget}: {s.stats()}")
    s.check_invariants()
    stats = s.stats()
    info = {"message": str(error), "type": type(error).__name__,
            "is_dtralloc_oom": isinstance(error, dtralloc.OutOfMemoryError),
            "is_runtime_error": isinstance(error, RuntimeError), "stats": stats}
    del kept, error, s  # the session's budget holds until the session object goes
    gc.collect()
    return info


def oom() -> dict:
    """An unmeetable budget raises dtralloc.OutOfMemoryError whose text has
    torch's "CUDA out of memory."; afterwards the same model and optimizer
    train (a plain step, then a step under a session) exactly as a twin that
    never saw the OOM."""
    dtralloc, torch = _setup()
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()) for _ in range(8)]).cuda()
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin))
    x = torch.randn(8192, 2048, device="cuda")  # 64 MiB per layer output
    # The budget: what is resident (both models, x, and the cuBLAS workspace a
    # first matmul makes and torch keeps) plus room for two and a half layer
    # outputs, so that what runs out is the kept outputs.
    twin(x[:8]).sum().item()
    budget_mib = -(-dtralloc.memory_stats()["allocated_bytes.all.current"] // MiB) + 160
    info = _hold_outputs_until_oom(dtralloc, torch, model, x, f"{budget_mib}M")
    info["budget_mib"] = budget_mib
    torch.cuda.synchronize()
    _pool_ok(dtralloc)

    def train(m, o, sessions):
        losses = []
        for session in sessions:
            o.zero_grad(set_to_none=True)
            with session() if session else contextlib.nullcontext():
                loss = m(x).square().mean()
                loss.backward()
            o.step()
            losses.append(loss.detach())
        torch.cuda.synchronize()
        return losses, [p.detach().clone() for p in m.parameters()], torch.cuda.get_rng_state()

    torch.manual_seed(1)
    want = train(twin, twin_opt, [None, None])
    torch.manual_seed(1)
    # 2G: both models' weights, gradients and AdamW state (about 1.3 GB) fit,
    # not all of the step's activations (1 GB more) -- the session evicts.
    got = train(model, opt, [None, lambda: dtralloc.dtr(budget="2G")])
    info.update(diffs_after=_identical(torch, got, want), pool_ok=_pool_ok(dtralloc))
    return info


def device_thread() -> dict:
    """Backward runs on autograd's CUDA device thread (without the GIL); under
    a budget its allocations call the pool's eviction hook from there, which
    must take the GIL, only free, and leave the gradients bit-exact. Both
    inside the block (the device thread runs the session's dispatch mode) and
    after it (no mode: the session, alive, evicts through the pool's hook
    alone; docs/live.md "Costs")."""
    dtralloc, torch = _setup()
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.Tanh()) for _ in range(12)]).cuda()
    x = torch.randn(4096, 2048, device="cuda")  # 32 MiB per activation
    main = threading.get_ident()

    def forward_backward(budget=None, after=False):
        model.zero_grad(set_to_none=True)
        dtralloc.reset_peak_memory_stats()
        threads = []
        with dtralloc.dtr(budget=budget) as s:
            y = model(x)
            y.register_hook(lambda g: threads.append(threading.get_ident()))
            loss = y.square().mean()
            before = s.stats()["evictions"]
            if not after:
                loss.backward()
        if after:
            loss.backward()
        torch.cuda.synchronize()
        pool_peak = dtralloc.memory_stats()["reserved_bytes.all.peak"]
        return [p.grad.clone() for p in model.parameters()], {**s.stats(), "pool_peak": pool_peak}, before, threads

    def resident():
        """Reserved bytes once the cache is given back: what a budget must
        hold before the step (a lowered budget releases nothing by itself, and
        peak_bytes counts reserved bytes on CUDA)."""
        _settle(torch)
        return dtralloc.memory_stats()["reserved_bytes.all.current"]

    at_start = resident()
    want, peak_stats, _, _ = forward_backward()
    peak = peak_stats["peak_bytes"]
    runs = []
    for fraction, after in itertools.product((0.75, 0.6, 0.45), (False, True)):
        got = None  # the last run's gradients are not this run's
        budget = resident() + int((peak - at_start) * fraction)
        try:
            got, stats, before, threads = forward_backward(budget, after)
        except dtralloc.OutOfMemoryError as e:
            runs.append({"fraction": fraction, "after_block": after, "oom": str(e).splitlines()[0]})
            continue
        gc.collect()
        runs.append({"fraction": fraction, "after_block": after, "budget": budget,
                     "exact": all(torch.equal(a, b) for a, b in zip(got, want)),
                     "evictions_in_forward": before, "evictions": stats["evictions"], "remats": stats["remats"],
                     "peak_bytes": stats["peak_bytes"], "pool_peak": stats["pool_peak"],
                     "backward_off_main_thread": bool(threads) and all(t != main for t in threads)})
    return {"peak": peak, "runs": runs, "pool_ok": _pool_ok(dtralloc)}


def long_lived(installed: str = "configured") -> dict:
    """long_lived on CUDA (docs/live.md, "What outlives the step"): a session
    learns which of its ops' outputs the step kept (the gradients), and the
    next one announces them to the device pool before the same op's kernel
    allocates, on whichever thread runs it (backward: the device thread).
    The sessions' policy (dtralloc) under the budget in force decides, on a
    pool installed with policy:dtralloc and a budget ("configured") as on one
    installed with neither ("plain": dtralloc.install(), then dtr(budget=...)),
    whose own settings resolve long_lived off."""
    dtralloc, torch = _setup({"configured": "policy:dtralloc,budget:0.9", "plain": ""}[installed])
    build, batch, loss_fn = _mlp_workload(torch)

    def allocated():
        return dtralloc.memory_stats()["allocated_bytes.all.current"]

    # Each session's budget 60% of what one step adds over what is allocated
    # when it starts: the parameters, AdamW's state and the results of the
    # plain runs before it. A budget of 60% of the first session's peak alone
    # (before 2026-11-27) sat below that on a GPU: 121 MiB against 294 allocated.
    step_bytes = _step_bytes(dtralloc, torch, build, batch, loss_fn)
    sessions = []

    def session():
        # Not below what the pool holds already (the plain runs' cached
        # segments): placement does not depend on how tight the budget is.
        reserved = dtralloc.memory_stats()["reserved_bytes.all.current"]
        s = dtralloc.dtr(budget=max(reserved, allocated() + int(step_bytes * 0.6)))
        sessions.append(s)
        return s

    control, diffs, _ = _plain_twice_and_live(torch, build, batch, loss_fn, 3, session)
    stats = [s.stats() for s in sessions]
    return {"control_diffs": control, "diffs": diffs, "long_lived": [x["long_lived"] for x in stats],
            "evictions": [x["evictions"] for x in stats], "params": len(list(build().parameters())),
            "pool_ok": _pool_ok(dtralloc)}


def async_segments() -> dict:
    """async_segments:on (docs/allocator.md, Note [async segments]): under a
    budget the sessions evict and the pool gives segments back and makes
    others with cudaFreeAsync and cudaMallocFromPoolAsync on the stream; the
    step stays bit-exact, and memory_stats() reports what the driver's pool
    holds, which empty_cache() (a synchronize and a trim) brings back to the
    pool's own segments."""
    dtralloc, torch = _setup("policy:dtralloc,async_segments:on")
    build, batch, loss_fn = _mlp_workload(torch, dropout=0.1)
    step_bytes = _step_bytes(dtralloc, torch, build, batch, loss_fn)
    sessions = []

    def session():
        # Half of what the step adds over what the pool holds once its cache
        # is given back. Over allocated() alone (before 2026-11-30) the first
        # session's budget sat under the plain runs' cached segments, which
        # served the whole step: no eviction on an H200.
        _settle(torch)
        s = dtralloc.dtr(budget=dtralloc.memory_stats()["reserved_bytes.all.current"] + int(step_bytes * 0.5))
        sessions.append(s)
        return s

    frees_before = dtralloc.memory_stats()["num_device_free"]
    control, diffs, _ = _plain_twice_and_live(torch, build, batch, loss_fn, 3, session)
    stats = dtralloc.memory_stats()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = dtralloc.memory_stats()
    return {"control_diffs": control, "diffs": diffs,
            "evictions": [x.stats()["evictions"] for x in sessions],
            "device_calls": [x.stats()["device_calls"] for x in sessions],
            "device_call_seconds": [x.stats()["device_call_seconds"] for x in sessions],
            "device_pool_waits": [x.stats()["device_pool_waits"] for x in sessions],
            "device_frees": stats["num_device_free"] - frees_before,
            "budgets": [x.stats()["budget_bytes"] for x in sessions],
            "reserved_peak": stats["reserved_bytes.all.peak"],
            "device_pool_peak": stats.get("device_pool_reserved_bytes.peak"),
            "device_pool_before_empty": stats.get("device_pool_reserved_bytes.current"),
            "reserved_after_empty": after["reserved_bytes.all.current"],
            "device_pool_after_empty": after.get("device_pool_reserved_bytes.current"),
            "pool_ok": _pool_ok(dtralloc)}


def op_costs() -> dict:
    """A CUDA op returns to the host once launched: the session must price
    ops by their time on the GPU (timing events, allocator/op_timer.h), not by
    the launch the host sees."""
    dtralloc, torch = _setup()
    a = torch.randn(8192, 8192, device="cuda")
    b = torch.randn(8192, 8192, device="cuda")
    # cuBLAS's start (handle, workspace, kernel loading) before the timed
    # launches: it is host time the GPU idles through.
    warm = a @ b
    torch.cuda.synchronize()
    del warm
    # The GPU's own time of the ops, from before the first to after the last:
    # an op's cost is the GPU's time from the mark before it to its own
    # (op_timer.h), idle time included. The sum after the synchronize waits
    # on the GPU while the host classifies and launches it, so its cost is
    # mostly that idle time (on an H100, 2026-11-27, the ops' costs summed
    # 1.26x the wall clock around the matmuls alone: the sum's 26 ms).
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with dtralloc.dtr() as s:
        start = time.perf_counter()
        first.record()
        outs = [a @ b for _ in range(4)]  # about 20 ms each in fp32 without TF32
        launched = time.perf_counter() - start
        torch.cuda.synchronize()
        ran = time.perf_counter() - start
        # A recorded op after the GPU finished: its mark collects the matmuls'.
        outs.append(outs[-1].sum())
        last.record()
    stats = s.stats()
    last.synchronize()
    del outs
    # A step of another kind in between (a GAN's other step): the device
    # keeps both kinds (Note [recent steps], recent_steps.h).
    with dtralloc.dtr() as other:
        y = (a.cos() @ b).sum()
    torch.cuda.synchronize()
    del y
    # The first kind's step again (Note [carried costs], live_session.cpp):
    # until the GPU has run them, its matmuls are priced at what the GPU
    # measured for the last step of their kind, not at their launch.
    with dtralloc.dtr() as again:
        outs = [a @ b for _ in range(4)]
        early = again.stats()  # the GPU is still on the first matmul
        torch.cuda.synchronize()
    del outs
    return {"launched_s": launched, "ran_s": ran, "gpu_ran_s": first.elapsed_time(last) * 1e-3,
            "op_seconds": stats["op_seconds"], "gpu_timed_ops": stats["gpu_timed_ops"],
            "again_op_seconds_early": early["op_seconds"], "again_carried_costs": early["carried_costs"],
            "again_gpu_timed_ops_early": early["gpu_timed_ops"],
            "other_carried_costs": other.stats()["carried_costs"], "pool_ok": _pool_ok(dtralloc)}


def device_full() -> dict:
    """No budget anywhere (dtralloc.install() and dtr() as they come), on a
    GPU whose memory something else fills: a ballast cudaMalloc'd behind the
    pool's back, as another process or the CUDA context would hold it. The
    step needs more than the device has left; the session evicts when the
    device refuses a segment, and the gradients equal the run with room."""
    import ctypes

    dtralloc, torch = _setup()
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.Tanh()) for _ in range(12)]).cuda()
    x = torch.randn(4096, 2048, device="cuda")  # 32 MiB per activation

    def forward_backward():
        model.zero_grad(set_to_none=True)
        with dtralloc.dtr() as s:
            loss = model(x).square().mean()
            loss.backward()
        torch.cuda.synchronize()
        return [p.grad.clone() for p in model.parameters()], s.stats()

    _settle(torch)
    before = dtralloc.memory_stats()["reserved_bytes.all.current"]
    allocated_before = dtralloc.memory_stats()["allocated_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()  # dtralloc's (torch_memory.py)
    want, roomy = forward_backward()
    step_bytes = roomy["peak_bytes"] - before  # what the step adds to reserved
    # What it adds to allocated: the room each run leaves is a share of this.
    # A share of step_bytes (before 2026-11-30) was not short enough: at 70%
    # of it an H200 ran the step without evicting (reserved counts the
    # cache's rounding and the blocks it could not reuse).
    step_allocated = torch.cuda.max_memory_allocated() - allocated_before
    cudart = ctypes.CDLL(dtralloc._core.cuda_runtime_path())
    cudart.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    cudart.cudaFree.argtypes = [ctypes.c_void_p]
    runs = []
    for share in (0.7, 0.5, 0.1):  # the last leaves less than the gradients (192 MiB): out of memory
        _settle(torch)
        free, _ = torch.cuda.mem_get_info()
        # What the step can use is the device's free memory and the free
        # blocks of the segments the pool keeps (those hold a live block
        # each: empty_cache cannot give them back). Both together are the
        # share; counting the device alone (the first fix, 2026-11-30) left
        # an H200 room to run the step at 70% without evicting.
        stats_now = dtralloc.memory_stats()
        kept_free = stats_now["reserved_bytes.all.current"] - stats_now["allocated_bytes.all.current"]
        ballast = ctypes.c_void_p()
        room = max(0, int(step_allocated * share) - kept_free)
        err = cudart.cudaMalloc(ctypes.byref(ballast), free - room)
        if err != 0:
            # A refusal is an answer, not an error for torch: its next launch
            # check (cudaGetLastError) would raise it from an unrelated op.
            cudart.cudaGetLastError()
            runs.append({"share": share, "ballast_error": err})
            continue
        try:
            got, stats = forward_backward()
            runs.append({"share": share, "room": room, "kept_free": kept_free,
                         "exact": all(torch.equal(a, b) for a, b in zip(got, want)),
                         "evictions": stats["evictions"], "remats": stats["remats"],
                         "budget_bytes": stats["budget_bytes"]})
        except dtralloc.OutOfMemoryError as e:
            runs.append({"share": share, "room": room, "kept_free": kept_free, "oom": str(e)[:2000]})
        finally:
            got = None
            _settle(torch)
            cudart.cudaFree(ballast)
    return {"step_bytes": step_bytes, "step_allocated": step_allocated, "roomy_evictions": roomy["evictions"],
            "total": torch.cuda.get_device_properties(0).total_memory, "runs": runs, "pool_ok": _pool_ok(dtralloc)}


def foreach() -> dict:
    """Foreach ops split by element on CUDA (LiveSession::elements_of): a
    chain of them under chaos, bit-exact with plain, with float32 lists (one
    dtype: split, fewer recomputes than with every-input recipes) and with
    float32 and bfloat16 alternating (torch's per-tensor loop for the list:
    not split, the same recomputes either way); then lists whose elements
    pass or fail torch's fused route one by one; then three AdamW steps
    after clip_grad_norm_, foreach, inside chaos sessions; then the version
    counters in-place foreach ops leave, plain and inside a session."""
    dtralloc, torch = _setup()
    from _foreach_chain import (foreach_chain, foreach_geometries, foreach_geometry_grads, optimizer_steps,
                                whole_foreach_recipes)

    def grads_equal(a, b):
        return [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]

    n = 6
    chaos = lambda: dtralloc.dtr(chaos=True, check_invariants=True)  # noqa: E731
    chains = {}
    for name, dtypes in (("float32", None), ("mixed", [torch.float32, torch.bfloat16] * (n // 2))):
        for reduction in (True, False):
            run = lambda ctx: foreach_chain(torch, n, ctx, reduction, "cuda", dtypes)  # noqa: E731
            plain, _ = run(contextlib.nullcontext)
            again, _ = run(contextlib.nullcontext)
            split, s = run(chaos)
            with whole_foreach_recipes():
                whole, w = run(chaos)
            chains[f"{name}, {'norm' if reduction else 'no norm'}"] = {
                "control": grads_equal(again, plain), "split_diffs": grads_equal(split, plain),
                "whole_diffs": grads_equal(whole, plain), "split_remats": s.stats()["remats"],
                "whole_remats": w.stats()["remats"]}
            _settle(torch)

    # Lists whose elements pass or fail torch's fused route on their own:
    # split only where all pass or all fail, and recomputed bit-exact either way.
    geometries = {}
    for name, (xs, ys, split) in foreach_geometries(torch, "cuda").items():
        with dtralloc.dtr() as s:
            torch._foreach_add(xs, ys)
        want, _ = foreach_geometry_grads(torch, xs, ys, contextlib.nullcontext)
        again, _ = foreach_geometry_grads(torch, xs, ys, contextlib.nullcontext)
        got, c = foreach_geometry_grads(torch, xs, ys, chaos)
        geometries[name] = {"splits": s.stats()["split_foreach_ops"], "expected": int(split),
                            "control": grads_equal(again, want), "diffs": grads_equal(got, want),
                            "remats": c.stats()["remats"]}
        _settle(torch)

    def adamw(session):
        steps = optimizer_steps(torch, lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True), session, "cuda")
        torch.cuda.synchronize()
        return steps

    want = adamw(contextlib.nullcontext)
    optimizer = {"control": grads_equal(adamw(contextlib.nullcontext), want),
                 "diffs": grads_equal(adamw(chaos), want)}

    # In-place foreach ops move their tensors' version counters as in plain
    # eager: the fused kernel bumps them itself, torch's per-tensor loop
    # (mixed dtypes) does not under a dispatch mode, and the session bumps
    # those (ops.OpInfo.bumps_versions).
    def versions(ctx, dtypes):
        ts = [torch.randn(8, device="cuda", dtype=d) for d in dtypes]
        with ctx():
            torch._foreach_mul_(ts, 0.5)
            torch._foreach_add_(ts, ts)
        return [t._version for t in ts]

    counters = {name: {"plain": versions(contextlib.nullcontext, dtypes), "dtr": versions(dtralloc.dtr, dtypes)}
                for name, dtypes in (("float32", [torch.float32] * 4),
                                     ("mixed", [torch.float32, torch.bfloat16] * 2))}
    return {"chains": chains, "geometries": geometries, "optimizer": optimizer, "versions": counters,
            "pool_ok": _pool_ok(dtralloc)}


def opinfo(kind: str = "backward", dtype_name: str = "float32", samples: str = "4", seconds: str = "60") -> dict:
    """tests/test_dtr_opinfo.py's sweep on CUDA: every OpInfo sample (kind
    backward or forward-ad; "modules": every ModuleInfo sample) plainly, under
    a no-op dispatch mode and inside dtr(device="cuda", chaos=True,
    check_invariants=True) with dtralloc as torch's allocator, deterministic
    algorithms on (ops without a deterministic CUDA kernel raise in the plain
    run and are skipped). No sample starts after `seconds` (the GPU session
    cuts each test off at 100 s)."""
    dtralloc, torch = _setup()
    try:
        import expecttest  # noqa: F401  (torch.testing._internal imports it)
    except ImportError:
        return {"skipped": "expecttest is not installed: torch.testing._internal needs it"}
    import os
    import warnings

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_dtr_opinfo as sweep

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dtype = getattr(torch, dtype_name)
        if kind == "modules":
            tally = sweep._module_sweep(dtype, device="cuda", seconds=float(seconds))
        else:
            tally = sweep._sweep(kind, dtype, device="cuda", samples_per_op=int(samples), seconds=float(seconds))
    return {"compared": tally.compared, "evicted": tally.evicted, "mismatches": tally.mismatches[:40],
            "mismatch_count": len(tally.mismatches), "seconds": round(time.perf_counter() - t0, 1),
            "stopped_at": tally.stopped_at,
            "pool_ok": _pool_ok(dtralloc)}


def distributed(device: str = "cuda") -> dict:
    """tests/test_dtr_distributed.py on CUDA: a one-rank NCCL group, the
    installed pool, chaos. An in-place functional all_reduce_ is launched
    once, as in plain eager (a recompute never reruns it); FSDP2 training
    steps, resharding after forward (the storages FSDP frees and refills) and
    not, match plain bit for bit. `device="cpu"` rehearses it on gloo."""
    import os

    if device == "cpu":
        import dtralloc
        import torch
    else:
        dtralloc, torch = _setup()
    import torch.distributed as dist

    backend = "gloo" if device == "cpu" else "nccl"
    if not dist.is_available() or not dist.is_backend_available(backend):
        return {"skipped": f"torch.distributed with {backend} is not available"}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_dtr_distributed as t

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        def session():
            return dtralloc.dtr(device=device, chaos=True, check_invariants=True)

        torch.manual_seed(0)
        # 64 elements: at 4,096 on gloo, the plain run's gradient (no session
        # involved) was off float64's by up to 1e-4 over the tensor's second
        # half in 2 of about 60 fresh processes, as if read before the
        # all-reduce finished writing; never seen at 64
        w = torch.randn(64, device=device, requires_grad=True)
        launched_plain, plain, _ = t._collective_step("functional", dist.group.WORLD, w)
        launched, got, stats = t._collective_step("functional", dist.group.WORLD, w, session)
        result = {"collectives_plain": launched_plain, "collectives_live": launched,
                  "collective_grads_equal": torch.equal(plain, got),
                  "collective_evictions": stats["evictions"], "fsdp": {}}
        for reshard in (True, False):
            want, _ = t._fsdp_steps(reshard, device=device)
            again, _ = t._fsdp_steps(reshard, device=device)
            got, evictions = t._fsdp_steps(reshard, session, device=device)
            result["fsdp"][str(reshard)] = {
                "control": [i for i, (a, b) in enumerate(zip(want, again)) if not torch.equal(a, b)],
                "diffs": [i for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)],
                "evictions": evictions}
    finally:
        dist.destroy_process_group()
    if device != "cpu":
        result["pool_ok"] = _pool_ok(dtralloc)
    return result


SCENARIOS = {
    "distributed": distributed,
    "opinfo": opinfo,
    "foreach": foreach,
    "device_full": device_full,
    "op_costs": op_costs,
    "dropout": dropout,
    "verify": verify,
    "amp": amp,
    "flash_dropout": flash_dropout,
    "generator": generator,
    "oom": oom,
    "device_thread": device_thread,
    "long_lived": long_lived,
    "async_segments": async_segments,
    "hf": hf,
}


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result, default=str), flush=True)
