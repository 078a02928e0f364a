"""The largest batch that trains in a fixed memory: plain torch, torch.utils.checkpoint
on every block, and live DTR (dtralloc.dtr), side by side in one run.

For each model (GPT-2 small, ResNet-50), a batch B that plain training fits
comfortably, and M = the peak *reserved* bytes of plain training at B (every
step, warm-up included, under torch's own caching allocator, in a process of
its own). Reserved, because it is what both caps below bound: torch's
set_per_process_memory_fraction and dtralloc's budget each refuse a request
that would take reserved bytes past the cap, so "trains in M" means the same
for every configuration. Then, each configuration in a fresh process (an
allocator is installed once per process, and an OOM must not poison the
next), the largest batch whose steps all run within M:

* plain           torch's allocator, capped at M (set_per_process_memory_fraction)
* checkpoint      the same, with torch.utils.checkpoint (non-reentrant) on every block
* plain-dtralloc  dtralloc.install("policy:dtralloc,budget:M"), no DTR session: what the pool
                  alone gives (its placement under a budget, no eviction)
* dtr             dtralloc.install("policy:dtralloc"), every step inside dtralloc.dtr(budget=M)
                  (its budget turns the dtralloc placement on; cudaMalloc segments unless --conf says unmap_pages:on)
* dtr-forward     the same, with only the forward and the loss inside the block; backward and
                  the optimizer's step run after it (docs/live.md "Costs": the ops after the block
                  pay no dispatch mode, and the session still evicts under M through the pool)
* dtr [CONF]      with --also-conf CONF (GPU, repeatable): dtr again on install("policy:dtralloc,CONF"),
                  side by side with the default in the same run (e.g. arena:on, docs/allocator.md);
                  budget:M in CONF installs the pool with the budget M too, as the README does
                  (install("budget:20G,policy:dtralloc,arena:on") and dtr() in it)

GPT-2's loss runs in 8 pieces over the tokens in every configuration
(--gpt2-loss-chunks; zoo.workload.chunked_lm_loss): unchunked, its backward
alone needs more than M at 3x B.

Per configuration: max batch / B, and the step time per sample over plain's
at B (the overhead), at every batch probed. Each dtr process then checks one
forward+backward at 2B (evicting; dtr-forward with the backward after the
block) against a plain uncapped one in the same process: loss, gradients, buffers and the CUDA RNG state bit for bit, with
deterministic algorithms on, next to a plain-vs-plain control that shows
whether the kernels themselves are deterministic.

    python bench/bench_gpu_budget.py [--models gpt2,resnet50] [--out FILE.md]
    python bench/bench_gpu_budget.py --smoke --device cpu     # tiny models, a few seconds

On CPU (--device cpu, for checking the bench itself) every configuration runs
inside dtr(device="cpu"), whose virtual pool mirrors every storage: plain and
checkpoint without a budget (they fit when the mirror's peak is within M), dtr
with budget M. Times on CPU mean nothing.

Goal (issue 13): dtr reaches >= 3x B at <= 25% step-time overhead.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20

CONFIGS_GPU = ("plain", "checkpoint", "plain-dtralloc", "dtr", "dtr-forward")
# dtr-forward runs on CPU only where --configs names it: the CPU mirror counts
# what runs inside the block, so its backward and optimizer step are not in M there.
CONFIGS_CPU = ("plain", "checkpoint", "dtr")
CONFIGS_ALL = CONFIGS_GPU
# The configurations that run in dtr(budget=M), one search each.
DTR_CONFIGS = ("dtr", "dtr-forward")
# B per model: plain fits comfortably on an 80 GB GPU in fp32 (GPT-2 small at
# seq 1024 about 15 GB, ResNet-50 at 224x224 about 12 GB), so that the 8x B the
# search may reach under a cap is still a batch the device could hold
# uncapped for the bit-exactness check at 2x B.
BASE_BATCH = {"gpt2": 8, "resnet50": 64}
SMOKE_BATCH = {"gpt2": 4, "resnet50": 8}
# Smoke sizes: the zoo's small models with longer sequences and larger images,
# so that M (about 20 and 14 MiB) is several times the mirror pool's 2 MiB
# small segments; at the zoo's own small sizes one segment is the whole of M,
# and every batch "fits".
SMOKE_SIZES = {"gpt2": {"seq": 128}, "resnet50": {"image": 128}}
# The search ladder in multiples of B, up to the largest: the goal is 3x, and
# every probe beyond 8x costs time. Smoke: fewer rungs, coarser bisection.
LADDER = (1, 2, 3, 4, 6, 8)
SMOKE_LADDER = (1, 2, 4)
# Steps per probe: one warm-up (optimizer state, kernel set-up; it must fit
# too) and two timed, of which the faster counts (the least disturbed).
TIMED_STEPS = 2
SMOKE_TIMED_STEPS = 1
# GPT-2's loss in pieces (zoo.workload.chunked_lm_loss). Unchunked, at 3x B
# (24 x 1024 tokens) the log-softmax's backward holds its output, its
# incoming gradient and its result, each tokens x vocab in float32: 3 x 4.9
# GB, which with the parameters and AdamW state (1.5 GB) is more than the
# 15.9 GB (14.8 GiB) of M, plain's peak at B on an H100 (2026-11-27). In 8
# pieces: 1.9 GB at 3x B.
GPT2_LOSS_CHUNKS = 8


# ---------------------------------------------------------------- models


def _gpt2_torch(layers: int, hidden: int, heads: int, vocab: int, seq: int, loss_chunks: int):
    """GPT-2 in plain torch, for machines without `transformers`: the layout of
    transformers' GPT2LMHeadModel (learned positions, pre-LN blocks with a
    fused qkv projection, causal SDPA with dropout 0.1, GELU(tanh) MLP of 4x
    width, dropout 0.1 on embeddings and residual branches, final LN, LM head
    tied to the token embedding), causal-LM loss on shifted tokens, in
    `loss_chunks` pieces (zoo.workload.chunked_lm_loss)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from dtralloc.zoo.workload import chunked_lm_loss

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.c_attn, self.c_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.c_fc, self.mlp_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            self.drop = nn.Dropout(0.1)
            self.attn_dropout = 0.1  # the attention's dropout probability (transformers' attn_pdrop)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_dropout if self.training else 0.0,
                                               is_causal=True)
            x = x + self.drop(self.c_proj(a.transpose(1, 2).reshape(b, t, d)))
            return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(max(seq, 1024), hidden)
            self.drop = nn.Dropout(0.1)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens):
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.drop(self.wte(tokens) + self.wpe(pos))
            for block in self.blocks:
                x = block(x)
            return chunked_lm_loss(self.ln_f(x), self.wte.weight, None, tokens, loss_chunks)

    model = GPT2().train()
    return model, model.blocks


class Model:
    """One model of the bench: its module, optimizer and loss, batches of any
    size, and checkpointing on every block."""

    def __init__(self, name: str, smoke: bool, device, loss_chunks: int = 1, seq: int | None = None):
        import torch

        from dtralloc import zoo
        from dtralloc.zoo.workload import chunked_causal_lm_loss

        self.name, self.device = name, device
        if name == "resnet50":
            w = zoo.build("resnet50", small=smoke, **{**(SMOKE_SIZES["resnet50"] if smoke else {}), "batch": 1})
            self.model, self.optimizer, self.loss_fn = w.model, w.optimizer, w.loss_fn
            self.description = w.description.split(" batch ")[0] + " (dtralloc.zoo, own code)"
            self.blocks = self.model.stages
            self.classes = self.model.fc.out_features
            self.image = w.batch[0].shape[-1]
        elif name == "gpt2":
            sizes = {**zoo.SMALL_SIZES["gpt2"], **SMOKE_SIZES["gpt2"]} if smoke else dict(batch=1, seq=1024, layers=12, hidden=768,
                                                                        heads=12, vocab=50257)
            if seq:
                sizes["seq"] = seq
            self.seq, self.vocab = sizes["seq"], sizes["vocab"]
            try:
                w = zoo.build("gpt2", **{**sizes, "batch": 1})
            except ImportError:  # no transformers on this machine: the same architecture in plain torch
                torch.manual_seed(0)
                self.model, self.blocks = _gpt2_torch(sizes["layers"], sizes["hidden"], sizes["heads"],
                                                      sizes["vocab"], sizes["seq"], loss_chunks)
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01,
                                                   foreach=True)
                self.loss_fn = lambda model, tokens: model(tokens)
                self.description = (f"GPT-2 ({sizes['layers']} layers, hidden {sizes['hidden']}, vocab "
                                    f"{sizes['vocab']}, seq {self.seq}, dropout 0.1; plain-torch layout of "
                                    f"GPT2LMHeadModel, transformers not installed), AdamW (foreach)")
            else:
                self.model, self.optimizer, self.loss_fn = w.model, w.optimizer, w.loss_fn
                if loss_chunks > 1:
                    self.loss_fn = lambda model, tokens: chunked_causal_lm_loss(model, tokens, loss_chunks)
                self.blocks = None  # transformers' own switch checkpoints every GPT2Block
                self.description = w.description.split(" batch ")[0] + f" seq {self.seq} (dtralloc.zoo)"
            self.description += (f"; loss in {loss_chunks} pieces over the tokens (LM head + cross-entropy "
                                 f"per piece: zoo.workload.chunked_lm_loss), in every configuration"
                                 if loss_chunks > 1 else "; loss unchunked (the logits whole)")
        else:
            raise ValueError(f"unknown model {name!r}; available: gpt2, resnet50")
        self.model.to(device)  # parameters move in place: the optimizer still holds them

    def checkpoint_every_block(self) -> None:
        import torch.utils.checkpoint as cp
        from torch import nn

        if self.blocks is None:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return

        class Checkpointed(nn.Module):
            def __init__(self, block):
                super().__init__()
                self.block = block

            def forward(self, *args):
                return cp.checkpoint(self.block, *args, use_reentrant=False)

        for i in range(len(self.blocks)):
            self.blocks[i] = Checkpointed(self.blocks[i])

    def batch(self, size: int, seed: int = 0) -> tuple:
        import torch

        g = torch.Generator().manual_seed(seed)
        if self.name == "gpt2":
            return (torch.randint(0, self.vocab, (size, self.seq), generator=g).to(self.device),)
        images = torch.randn(size, 3, self.image, self.image, generator=g).to(self.device)
        return images, torch.randint(0, self.classes, (size,), generator=g).to(self.device)

    def step(self, batch, forward_in=None) -> "object":
        """One training step as a training loop runs it; returns the loss.
        `forward_in`: a context (a dtr() session) that only the forward and
        the loss run in; backward and the optimizer's step run after it."""
        self.optimizer.zero_grad(set_to_none=True)
        with forward_in if forward_in is not None else contextlib.nullcontext():
            loss = self.loss_fn(self.model, *batch)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


# ---------------------------------------------------------------- the worker (one configuration, one process)


def _is_oom(e: BaseException) -> bool:
    import dtralloc

    return isinstance(e, dtralloc.OutOfMemoryError) or "out of memory" in str(e)


def _print(record: dict) -> None:
    print(json.dumps(record), flush=True)


def with_cap(conf: str, cap: int | None) -> str:
    """`conf` with its setting `budget:M` (if any) made the cap in bytes: the
    pool installed with M as its budget too, as the README installs it
    (install("budget:20G,...") and dtr() in it), where the dtr configurations
    otherwise install no budget and give each session M."""
    parts = [part.strip() for part in conf.split(",") if part.strip()]
    if "budget:M" in parts and cap is None:
        raise ValueError("budget:M needs the cap M, which this configuration does not have")
    return ",".join(f"budget:{cap}B" if part == "budget:M" else part for part in parts)


def conf_keys(conf: str) -> set:
    """The settings `conf` names (DTRALLOC_CONF's syntax: key:value, comma-separated)."""
    return {part.split(":", 1)[0].strip() for part in conf.split(",") if part.strip()}


def with_policy(conf: str) -> str:
    """`conf` for the dtralloc configurations' install(): the dtralloc policy
    unless it names one (README: install("budget:20G,policy:dtralloc"))."""
    return conf if "policy" in conf_keys(conf) else ",".join(filter(None, ("policy:dtralloc", conf)))


class Worker:
    def __init__(self, spec: dict, emit=_print):
        self.spec, self.emit = spec, emit
        self.timed_steps = SMOKE_TIMED_STEPS if spec["smoke"] else TIMED_STEPS
        self.config = spec["config"]
        self.cuda = spec["device"] == "cuda"
        self.cap = spec.get("cap_bytes")
        # What the dtralloc configurations install (the others, and M's
        # measurement, which has no cap yet, install nothing).
        installs = self.cuda and self.config in DTR_CONFIGS + ("plain-dtralloc",)
        conf = with_policy(with_cap(spec.get("conf") or "", self.cap)) if installs else ""
        self.async_segments = "async_segments:on" in conf
        if self.cuda and self.config in DTR_CONFIGS:
            import dtralloc

            dtralloc.install(conf)  # no pool budget unless budget:M: the session's budget is the cap
        elif self.cuda and self.config == "plain-dtralloc":
            import dtralloc

            dtralloc.install(conf if "budget" in conf_keys(conf)  # budget:M, made the cap by with_cap
                             else ",".join(filter(None, (conf, f"budget:{self.cap}B"))))
        import torch

        self.torch = torch
        if not self.cuda:
            # One thread: on a shared CPU, torch's thread pool contending with
            # other load makes step times swing tenfold.
            torch.set_num_threads(1)
        torch.backends.cudnn.benchmark = False  # benchmark mode asks a pluggable allocator for cacheInfo
        if self.cuda and self.config in ("plain", "checkpoint") and self.cap:
            total = torch.cuda.get_device_properties(0).total_memory
            # torch caps reserved bytes at int(fraction * total): 1 MiB of slack
            # (under one 2 MiB segment) keeps float rounding from cutting M short.
            torch.cuda.set_per_process_memory_fraction(min(1.0, (self.cap + MiB) / total), 0)
        self.m = Model(spec["model"], spec["smoke"], "cuda" if self.cuda else "cpu", spec.get("loss_chunks", 1),
                       spec.get("seq"))
        if self.config == "checkpoint":
            self.m.checkpoint_every_block()

    def _sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def _clean(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()

    def _session(self, budget):
        from dtralloc.dtr import dtr

        return dtr(budget=budget, device="cuda" if self.cuda else "cpu")

    def run_steps(self, batch, steps: int) -> dict:
        """`steps` training steps under this configuration's cap; raises on OOM."""
        times, peak, evictions, remats, calls = [], 0, 0, 0, []
        for _ in range(steps):
            self._sync()
            before = self._device_calls()
            start = time.perf_counter()
            if self.config in DTR_CONFIGS or not self.cuda:
                # CPU: every configuration inside a session, whose mirror pool
                # measures what a GPU would reserve; only the dtr ones have a budget.
                s = self._session(self.cap if self.config in DTR_CONFIGS else None)
                if self.config == "dtr-forward":
                    self.m.step(batch, forward_in=s)
                else:
                    with s:
                        self.m.step(batch)
                stats = s.stats()
                peak = max(peak, stats["peak_bytes"])
                evictions += stats["evictions"]
                remats += stats["remats"]
            else:
                self.m.step(batch)
            self._sync()
            # The session ends after the GPU caught up: it hands the next
            # step every op cost the GPU measured (Note [carried costs]), as
            # a loop's `s` does when it lives until the next session started.
            s = None
            times.append(time.perf_counter() - start)
            if before is not None:
                calls.append(tuple(a - b for a, b in zip(self._device_calls(), before)))
        if self.cuda:
            # The pool's (or torch's) own peak since _clean(): a session's
            # peak_bytes counts reserved bytes at the ops it records only,
            # and dtr-forward records none of its backward.
            peak = max(peak, self.torch.cuda.max_memory_reserved(), self._device_pool_peak())
        return {"times": times, "peak": peak, "evictions": evictions, "remats": remats, "calls": calls}

    def _device_pool_peak(self) -> int:
        """async_segments:on: the most the driver's pool held since _clean(),
        freed segments it had not given back yet included, which can pass
        the pool's reserved bytes until a synchronize (docs/allocator.md,
        Note [async segments]); 0 elsewhere."""
        if not self._on_dtralloc_pool():
            return 0
        import dtralloc

        return dtralloc.memory_stats().get("device_pool_reserved_bytes.peak", 0)

    def _on_dtralloc_pool(self) -> bool:
        """Whether dtralloc's pool serves this configuration's memory (CUDA,
        installed: the dtr configurations and plain-dtralloc)."""
        return self.cuda and self.config in DTR_CONFIGS + ("plain-dtralloc",)

    def _device_calls(self):
        """dtralloc's pool so far: cudaMalloc + cudaFree calls, and the host
        nanoseconds inside them (a cudaFree waits for the device first);
        None where dtralloc's pool does not serve (CPU, plain, checkpoint)."""
        if not self._on_dtralloc_pool():
            return None
        import dtralloc

        s = dtralloc.memory_stats()
        return (s["num_device_alloc"] + s["num_device_free"], s["device_alloc_ns"] + s["device_free_ns"])

    def probe(self, size: int) -> dict:
        self._clean()
        record = {"event": "probe", "batch": size}
        batch = None
        try:
            batch = self.m.batch(size)
            r = self.run_steps(batch, 1 + self.timed_steps)
            # CPU: plain and checkpoint fit when the mirror's peak is within M.
            # CUDA: the budget holds dtralloc's pool within M, but with
            # async segments the driver's pool may hold more until a
            # synchronize, which must not count as fitting M either.
            over = bool(self.cap and r["peak"] > self.cap + (MiB if self.cuda else 0))  # CUDA: torch's cap slack
            ok = not over or (not self.cuda and self.config in DTR_CONFIGS)
            record.update(ok=ok, step_s=min(r["times"][1:]), peak_bytes=r["peak"], evictions=r["evictions"],
                          remats=r["remats"])
            timed = r["calls"][1:]  # the steps after the warm-up, as step_s
            if timed:
                record.update(device_calls=sum(c for c, _ in timed) / len(timed),
                              device_ms=sum(ns for _, ns in timed) / len(timed) / 1e6)
            if not ok:
                record["error"] = (f"the device held {r['peak']} bytes, over the cap"
                                   + (" (with async_segments, what the driver's pool held counts)"
                                      if self.async_segments else "") if self.cuda else
                                   f"mirror peak {r['peak']} over the cap")
        except Exception as e:  # noqa: BLE001 - an OOM is a result; anything else is reported
            if not _is_oom(e):
                raise
            record.update(ok=False, error=str(e).splitlines()[0][:300])
        finally:
            del batch
            self.m.optimizer.zero_grad(set_to_none=True)
            self._clean()
        return record

    def search(self, base: int, known: dict, deadline: float) -> int:
        """Probes the ladder (B, 2B, 3B, 4B, 6B, 8B) until one fails, then
        bisects (to B/8; smoke B/2) between the largest that fits and the
        smallest that does not. `known`: probes of an earlier process of this
        configuration that died. Returns the largest batch that fits (0: none)."""
        ok = max([b for b, good in known.items() if good], default=0)
        bad = min([b for b, good in known.items() if not good], default=None)
        smoke = self.spec["smoke"]
        ladder = [f * base for f in (SMOKE_LADDER if smoke else LADDER)]
        step = max(1, base // (2 if smoke else 8))
        self.fitted = {b for b, good in known.items() if good}
        probed = False
        # The first probe runs whatever the deadline says: a search that
        # measured nothing would read as "none fits".
        while not probed or time.monotonic() < deadline:
            if bad is None:
                nxt = next((b for b in ladder if b > ok), None)
                if nxt is None:
                    break  # fits at the ladder's top: the search stops there
            else:
                if bad - ok <= (step if ok else 1):
                    break
                nxt = (ok + bad) // 2
                if ok:
                    nxt = max(ok + step, nxt // step * step)
                if nxt >= bad:
                    break
            self.emit({"event": "start", "batch": nxt})
            record = self.probe(nxt)
            self.emit(record)
            probed = True
            if record["ok"]:
                ok = nxt
                self.fitted.add(nxt)
            else:
                bad = nxt if bad is None else min(bad, nxt)
        return ok

    def check(self, size: int) -> dict:
        """One forward+backward at `size`: plain (uncapped) twice, then inside
        dtr(budget=M); losses, gradients, buffers and RNG state compared bit
        for bit, with deterministic algorithms on."""
        torch = self.torch
        torch.backends.cudnn.deterministic = True
        model = self.m.model
        buffers0 = [b.detach().clone() for b in model.buffers()]
        batch = self.m.batch(size, seed=1)

        def once(forward_in=contextlib.nullcontext()):
            for b, b0 in zip(model.buffers(), buffers0):
                b.copy_(b0)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1234)
            with forward_in:
                loss = self.m.loss_fn(model, *batch)
            loss.backward()
            rng = torch.cuda.get_rng_state() if self.cuda else torch.get_rng_state()
            out = [loss.detach().cpu()] + [p.grad.cpu() for p in model.parameters() if p.grad is not None] + \
                [b.detach().cpu() for b in model.buffers()] + [rng]
            model.zero_grad(set_to_none=True)
            return out

        def same(a, b):
            return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._clean()
            # Strict first (it makes flash and memory-efficient attention's
            # backward deterministic); a model with an op that has no
            # deterministic kernel (ResNet's pooling backward) falls back to
            # warnings, and the control below shows what that costs.
            strict = True
            torch.use_deterministic_algorithms(True)
            try:
                first = once()
            except RuntimeError as e:
                if "deterministic" not in str(e):
                    raise
                strict = False
                torch.use_deterministic_algorithms(True, warn_only=True)
                self._clean()
                first = once()
            self._clean()
            second = once()
            self._clean()
            s = self._session(self.cap)
            if self.config == "dtr-forward":  # the forward alone in the session, backward after it
                live = once(forward_in=s)
            else:
                with s:
                    live = once()
            stats = s.stats()
            # The pool's own peak too (_clean reset it): dtr-forward records none of its backward.
            peak = max(stats["peak_bytes"], torch.cuda.max_memory_reserved() if self.cuda else 0)
        nondeterministic = sorted({str(w.message).split(" does not have a deterministic")[0]
                                   for w in caught if "deterministic" in str(w.message)})
        return {"event": "check", "batch": size, "strict_determinism": strict,
                "plain_vs_plain": same(first, second),
                "dtr_vs_plain": same(live, first), "tensors": len(first), "evictions": stats["evictions"],
                "remats": stats["remats"], "rng_replays": stats["rng_replays"],
                "peak_bytes": peak, "nondeterministic_ops": nondeterministic[:8]}


def worker_main(spec: dict, emit=_print) -> int:
    if spec["config"] == "measure":
        # Plain, uncapped, torch's allocator (CPU: the session's mirror): M.
        w = Worker({**spec, "config": "plain", "cap_bytes": None}, emit)
        w._clean()
        r = w.run_steps(w.m.batch(spec["base"]), 1 + w.timed_steps)
        allocated = w.torch.cuda.max_memory_allocated() if w.cuda else None
        emit({"event": "measure", "cap_bytes": r["peak"], "peak_allocated": allocated,
               "step_s": min(r["times"][1:]), "description": w.m.description,
               "device": w.torch.cuda.get_device_name() if w.cuda else "cpu",
               "torch": w.torch.__version__})
        return 0
    w = Worker(spec, emit)
    # From here: building GPT-2 (imports, weights) took most of a short share
    # on the first GPU run, before any probe could start.
    deadline = time.monotonic() + spec["deadline_s"]
    known = {int(b): good for b, good in spec.get("known", {}).items()}
    largest = w.search(spec["base"], known, deadline)
    if spec["config"] in DTR_CONFIGS and spec.get("check"):
        # At 2B when dtr fits there (it must evict: plain needs about 2M),
        # else at the largest batch that fits. Which values dtr evicts follows
        # the op times it measures, and those vary from run to run: a batch
        # that fitted in its probe may not fit in the check. Then the check
        # moves down to the next batch that fitted, and says so.
        for size in sorted((b for b in w.fitted if b <= spec["check"]), reverse=True):
            try:
                emit(w.check(size))
                break
            except Exception as e:  # noqa: BLE001 - reported, the search results stand
                w._clean()
                event = "check_oom" if _is_oom(e) else "check_failed"
                emit({"event": event, "batch": size, "error": f"{type(e).__name__}: {e}"[:400]})
                if event == "check_failed":
                    break
    emit({"event": "done"})
    return 0


# ---------------------------------------------------------------- the parent


def death_reason(stderr: str) -> str:
    """What a dead worker's stderr says, in one line: for a crash that
    faulthandler reported, its "Fatal Python error" line and the innermost
    Python frame (its last line lists extension modules, which says nothing);
    else the last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if fatal is not None:
        frame = next((line for line in lines[fatal + 1:] if line.startswith("File ")), "")
        return f"{lines[fatal]}; {frame}"[:300]
    return (lines or ["(no output)"])[-1][:300]


def run_config(spec: dict, hard_timeout: float, in_process: bool = False) -> list:
    """Runs one configuration's worker; restarts it once if it dies mid-search
    (the batch it was probing counts as not fitting). Returns its records.
    `in_process` (CPU only, where no allocator is installed): the same worker
    in this process, without the start-up cost of one."""
    records, known = [], {}
    if in_process:
        try:
            worker_main(spec, records.append)
        except Exception as e:  # noqa: BLE001 - reported as a death, as in a subprocess
            records.append({"event": "died", "rc": type(e).__name__, "batch": None, "error": str(e)[:300]})
        return [r for r in records if r["event"] not in ("start", "done")]
    for attempt in range(2):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps({**spec, "known": known})]
        start = time.monotonic()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS may then run deterministically (the check)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=hard_timeout, env=env)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = "timeout"
        hard_timeout -= time.monotonic() - start
        pending = None
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r["event"] == "start":
                pending = r["batch"]
            elif r["event"] == "probe":
                known[r["batch"]] = r["ok"]
                pending = None
                records.append(r)
            elif r["event"] != "done":
                records.append(r)
        if rc == 0:
            return records
        records.append({"event": "died", "rc": rc, "batch": pending, "error": death_reason(err)})
        if pending is None or hard_timeout < 30 or spec["config"] == "measure":
            return records
        known[pending] = False
    return records


def _fmt_bytes(n) -> str:
    from dtralloc._core import format_bytes

    return format_bytes(int(n)) if n is not None else "-"


def bench_model(name: str, args, budget_s: float, result: dict, progress) -> None:
    """Fills `result` configuration by configuration, calling `progress()`
    after each (so a run killed from outside keeps what it measured)."""
    device, smoke = args.device, args.smoke
    base = args.base or (SMOKE_BATCH if smoke else BASE_BATCH)[name]
    configs = getattr(args, "configs", None) or (CONFIGS_GPU if device == "cuda" else CONFIGS_CPU)
    also = {f"dtr [{c}]": c for c in (getattr(args, "also_conf", None) or [])}
    configs = tuple(configs) + tuple(also)
    started = time.monotonic()
    common = {"model": name, "device": device, "smoke": smoke, "base": base, "conf": args.conf,
              "loss_chunks": getattr(args, "gpt2_loss_chunks", 1) if name == "gpt2" else 1,
              "seq": getattr(args, "gpt2_seq", None) if name == "gpt2" else None}
    in_process = args.in_process
    # At least 45 s: a fresh process imports torch (and transformers), builds the
    # model and runs its steps before M exists, and without M nothing is measured.
    measured = run_config({**common, "config": "measure", "deadline_s": budget_s}, max(budget_s * 0.3, 45.0),
                          in_process)
    m = next((r for r in measured if r["event"] == "measure"), None)
    result.update(model=name, base=base, measure=m, measure_records=measured, configs={})
    progress()
    if m is None:
        return
    # The dtr search gets twice the others' share: its probes recompute, and it also runs the check.
    weights = {c: (2.0 if c in DTR_CONFIGS or c in also else 1.0) for c in configs}
    # The dtr searches run first: theirs are the figures the bench is for, and
    # a configuration that overruns its share (a process's start is not in its
    # deadline) takes from those after it. The report keeps `configs`' order;
    # overheads divide by plain's time at B whenever it runs (by M's
    # measurement, also plain at B, until then).
    order = [c for c in configs if weights[c] > 1.0] + [c for c in configs if weights[c] == 1.0]
    for i, config in enumerate(order):
        left = budget_s - (time.monotonic() - started)
        share = left * weights[config] / sum(weights[c] for c in order[i:])
        spec = {**common, "config": config, "cap_bytes": m["cap_bytes"], "deadline_s": max(share * 0.7, 5.0)}
        if config in also:  # the dtr search again on other settings (no bit-exactness check: dtr's covers it)
            spec.update(config="dtr", conf=also[config])
        elif config in DTR_CONFIGS:
            spec["check"] = 2 * base
        result["configs"][config] = run_config(spec, max(share, 30.0), in_process)
        result["configs"] = {c: result["configs"][c] for c in configs if c in result["configs"]}
        progress()


def summarize(res: dict) -> dict:
    """Per configuration: max batch, its time per sample, the overhead over plain at B."""
    base, m = res["base"], res["measure"]
    plain_at_b = next((r["step_s"] / base for r in res["configs"].get("plain", [])
                       if r["event"] == "probe" and r["ok"] and r["batch"] == base), None)
    if plain_at_b is None and m:
        plain_at_b = m["step_s"] / base  # the uncapped measurement at B
    rows = {}
    for config, records in res["configs"].items():
        probes = [r for r in records if r["event"] == "probe"]
        fits = [r for r in probes if r["ok"]]
        best = max(fits, key=lambda r: r["batch"], default=None)
        overheads = {r["batch"]: r["step_s"] / r["batch"] / plain_at_b - 1 for r in fits} if plain_at_b else {}
        rows[config] = {"max_batch": best["batch"] if best else 0, "best": best, "overheads": overheads,
                        "probes": probes, "other": [r for r in records if r["event"] not in ("probe",)]}
    return {"plain_per_sample_s": plain_at_b, "rows": rows}


def report(results: list, args, command: str, elapsed: float) -> str:
    sys.path.insert(0, HERE)
    from _report import header

    first = next((r["measure"] for r in results if r["measure"]), None) or {}
    lines = [header("Largest batch in a fixed memory: plain, checkpoint, live DTR", command), "",
             f"device: {first.get('device', args.device)}, torch {first.get('torch', '?')}; total run "
             f"{elapsed:.0f} s", "",
             "M = peak reserved bytes of plain training at batch B (every step, warm-up included), "
             + ("under torch's caching allocator, uncapped, in a process of its own; plain and checkpoint "
                "are capped at M with set_per_process_memory_fraction, plain-dtralloc with the pool's budget "
                "(install('policy:dtralloc,budget:M')), dtr with dtr(budget=M) on install('policy:dtralloc') "
                "around the whole step, dtr-forward the same around the forward and the loss only (backward "
                "and the optimizer step after the block, the session alive and its budget in force). "
                "Reserved, because both caps bound reserved bytes."
                if args.device == "cuda" else
                "as the session's virtual mirror pool counts them (CPU: every configuration runs inside "
                "dtr(device='cpu'); plain and checkpoint fit when the mirror's peak is within M, dtr has "
                "budget M; dtr-forward's mirror counts its block only, the forward, so its backward and "
                "optimizer step are not in M). CPU times mean nothing."),
             "Overhead = step time per sample at that batch / plain's at B - 1; a probe is one warm-up "
             f"step and {SMOKE_TIMED_STEPS if args.smoke else TIMED_STEPS} timed (the fastest counts). Search: "
             + ", ".join(f"{f}B" for f in (SMOKE_LADDER if args.smoke else LADDER))
             + f" until one fails, then bisection to B/{2 if args.smoke else 8}. cudaMalloc + cudaFree: "
             "dtralloc's pool's calls a timed step (mean), and the host time inside them (memory_stats' "
             "device_alloc_ns + device_free_ns; a cudaFree waits for the device first); '-' where torch's "
             "allocator serves.", ""]
    for res in results:
        name, base, m = res["model"], res["base"], res["measure"]
        lines.append(f"## {name}")
        lines.append("")
        if not m:
            died = [r for r in res["measure_records"] if r["event"] == "died"]
            lines += [f"measuring M failed: {died[0]['error'] if died else 'no result'}", ""]
            continue
        s = summarize(res)
        lines += [f"{m['description']}", "",
                  f"B = {base}; M = {_fmt_bytes(m['cap_bytes'])} reserved"
                  + (f" ({_fmt_bytes(m['peak_allocated'])} allocated)" if m.get("peak_allocated") else "")
                  + (f"; plain at B: {1e3 * s['plain_per_sample_s']:.2f} ms per sample"
                     if s["plain_per_sample_s"] else ""), "",
                  "| config | max batch | max / B | ms per sample at max | overhead at max | overhead at B "
                  "| evictions / remats at max | cudaMalloc + cudaFree a step at max (ms in them) |",
                  "|---|---|---|---|---|---|---|---|"]
        for config, row in s["rows"].items():
            best = row["best"]
            if best is None:
                why = next((r.get("error") for r in row["probes"] + row["other"] if r.get("error")), "")
                verdict = "none fits" if row["probes"] or why else "not measured (no probe ran)"
                lines.append(f"| {config} | {verdict} | 0 | - | - | - | - | - |" + (f" {why[:120]}" if why else ""))
                continue
            ov = row["overheads"]
            lines.append(
                f"| {config} | {best['batch']} | {best['batch'] / base:.2f} | "
                f"{1e3 * best['step_s'] / best['batch']:.2f} | {100 * ov[best['batch']]:+.1f}% | "
                + (f"{100 * ov[base]:+.1f}% | " if base in ov else "- | ")
                + f"{best['evictions']} / {best['remats']} | "
                + (f"{best['device_calls']:.0f} ({best['device_ms']:.1f} ms) |" if "device_calls" in best else "- |"))
        lines += ["", "Every probe (batch: fits?, ms per sample, overhead, peak):", "", "```"]
        for config, row in s["rows"].items():
            parts = []
            for p in sorted(row["probes"], key=lambda r: r["batch"]):
                if p["ok"]:
                    parts.append(f"{p['batch']}: ok {1e3 * p['step_s'] / p['batch']:.2f} ms "
                                 f"{100 * row['overheads'][p['batch']]:+.0f}% {_fmt_bytes(p['peak_bytes'])}")
                else:
                    parts.append(f"{p['batch']}: no")
            lines.append(f"{config:<15}" + "; ".join(parts))
            for r in row["other"]:
                if r["event"] == "died":
                    lines.append(f"{'':<15}process died ({r['rc']}) probing batch {r['batch']}: {r['error']}")
        lines.append("```")
        for config in DTR_CONFIGS:
            dtr_row = s["rows"].get(config)
            if not dtr_row:
                continue
            how = "" if config == "dtr" else f" ({config}: the forward in the session, backward after it)"
            for r in dtr_row["other"]:
                if r["event"] == "check_oom":
                    lines += ["", f"The bit-exactness check{how} ran out of memory at batch {r['batch']}, which "
                              "fitted in its probe (what dtr evicts follows measured op times, which vary from run "
                              f"to run): {r['error'].splitlines()[0][:200]}"]
                elif r["event"] == "check_failed":
                    lines += ["", f"The bit-exactness check{how} failed at batch {r['batch']}: {r['error']}"]
            check = next((r for r in dtr_row["other"] if r["event"] == "check"), None)
            if check:
                verdict = ("bit-exact" if check["dtr_vs_plain"] else "DIFFERS") if check["plain_vs_plain"] else \
                    ("not comparable: plain differs from plain (nondeterministic kernels)"
                     + ("; dtr equals the first plain run" if check["dtr_vs_plain"] else ""))
                lines += ["", f"Bit-exactness at batch {check['batch']}{how} (dtr with budget M vs plain uncapped, "
                          f"one forward+backward, {check['tensors']} tensors: loss, gradients, buffers, RNG "
                          f"state; torch.use_deterministic_algorithms(True"
                          f"{')' if check['strict_determinism'] else ', warn_only=True)'}): "
                          f"**{verdict}**; the dtr run evicted {check['evictions']}, recomputed "
                          f"{check['remats']}, replayed RNG {check['rng_replays']} times, peak "
                          f"{_fmt_bytes(check['peak_bytes'])}."]
                if check["nondeterministic_ops"]:
                    lines.append("Ops torch warned have no deterministic implementation: "
                                 + "; ".join(check["nondeterministic_ops"]))
        for config, row in s["rows"].items():
            if not (config in DTR_CONFIGS or config.startswith("dtr [")) or not row["best"]:
                continue
            at3 = {b: o for b, o in row["overheads"].items() if b >= 3 * base}
            met = bool(at3) and min(at3.values()) <= 0.25
            lines += ["", f"Goal (>= 3x B at <= 25% overhead){'' if config == 'dtr' else ', ' + config}: "
                      f"**{'met' if met else 'not met'}**"
                      + (f" (at {min(at3, key=at3.get)}: {100 * min(at3.values()):+.1f}%)" if at3 else
                         " (no batch >= 3x B fits)")]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--models", default="gpt2,resnet50", help="comma-separated: gpt2, resnet50")
    parser.add_argument("--configs", default=None,
                        help="comma-separated, of " + ", ".join(CONFIGS_ALL) + " (default: all of them on a "
                             "GPU; on CPU " + ", ".join(CONFIGS_CPU) + ")")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny models (the zoo's small sizes): checks the bench")
    parser.add_argument("--base", type=int, default=None, help="batch B (default per model: "
                        + ", ".join(f"{k} {v}" for k, v in BASE_BATCH.items()) + "; smoke 4)")
    parser.add_argument("--time-limit", type=float, default=330.0,
                        help="seconds for the whole run, shared by the models (default 330): searches stop "
                             "starting probes when their share is spent")
    parser.add_argument("--in-process", action="store_true",
                        help="CPU only: run the configurations in this process, not one process each")
    parser.add_argument("--conf", default="",
                        help="GPU only: settings (DTRALLOC_CONF's syntax) for the install() of the dtralloc "
                             "configurations, after policy:dtralloc unless they name a policy, e.g. "
                             "unmap_pages:on (VMM segments instead of cudaMalloc ones)")
    parser.add_argument("--also-conf", action="append", default=[], metavar="CONF",
                        help="GPU only, repeatable: run the dtr search again with these settings for its "
                             "install() (as --conf), as configuration 'dtr [CONF]' in the same run, "
                             "e.g. arena:on; budget:M in CONF (or --conf) installs the pool with the cap M "
                             "as its budget too, as the README does (e.g. 'arena:on,budget:M')")
    parser.add_argument("--gpt2-loss-chunks", type=int, default=GPT2_LOSS_CHUNKS, metavar="N",
                        help=f"GPT-2's loss in N pieces over the tokens, in every configuration (default "
                             f"{GPT2_LOSS_CHUNKS}; 1: transformers' own loss, the logits whole). Unchunked, "
                             "the loss's backward holds three tensors of tokens x vocab at once (14.8 GB at "
                             "3x B), more than M leaves")
    parser.add_argument("--gpt2-seq", type=int, default=None, metavar="N",
                        help="GPT-2's sequence length (default 1024; smoke 128). On CPU at GPT-2 small's "
                             "full width (no --smoke), M is mostly the gradients and the AdamW state the warm-up "
                             "step makes inside the mirror unless the tokens are many: a short sequence does not "
                             "model the GPU's M")
    parser.add_argument("--out", help="also write the report (markdown) here, and its data next to it (.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gpt2_seq is not None and args.gpt2_seq < 2:
        parser.error(f"--gpt2-seq is a sequence length >= 2 (a causal-LM loss needs a next token), not {args.gpt2_seq}")
    if args.gpt2_loss_chunks < 1:
        parser.error(f"--gpt2-loss-chunks is a number of pieces >= 1, not {args.gpt2_loss_chunks}")
    if args.worker:
        return worker_main(json.loads(args.worker))
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.in_process and args.device != "cpu":
        parser.error("--in-process is for --device cpu: on CUDA each configuration installs its own allocator")
    # --conf and --also-conf: install() settings, which exist on a GPU only; checked before anything runs.
    settings = ([("--conf", args.conf, "--conf sets what the dtralloc configurations install() on a GPU; on CPU "
                  "they install nothing")] if args.conf else []) + \
        [(f"--also-conf {extra!r}", extra, "--also-conf runs dtr again on other install() settings, which exist "
          "on a GPU only") for extra in args.also_conf]
    for flag, conf, cpu_error in settings:
        if args.device != "cuda":
            parser.error(cpu_error)
        from dtralloc import _core

        try:
            _core.describe_config(with_cap(conf, 1 << 30))  # budget:M stands for the cap, measured later
        except Exception as e:  # noqa: BLE001 - the parser's own words name the bad setting
            parser.error(f"{flag}: {e}")
    if args.configs is not None:
        args.configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
        unknown = [c for c in args.configs if c not in CONFIGS_ALL]
        if unknown or not args.configs:
            parser.error(f"--configs: unknown configuration {', '.join(map(repr, unknown)) or '(none given)'}; "
                         f"available: {', '.join(CONFIGS_ALL)}")
        if args.device != "cuda" and "plain-dtralloc" in args.configs:
            parser.error("--configs: plain-dtralloc installs dtralloc's pool, which exists on a GPU only")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in models:
        if name not in BASE_BATCH:
            parser.error(f"unknown model {name!r}; available: {', '.join(BASE_BATCH)}")
    command = "python bench/bench_gpu_budget.py " + " ".join(argv if argv is not None else sys.argv[1:])
    start = time.monotonic()
    results = []

    def write(final=False):
        text = report([r for r in results if "measure" in r], args, command.strip(), time.monotonic() - start)
        if final:
            print(text)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                f.write(text if final else text + "\n(run in progress)\n")
            with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
                json.dump({"command": command, "results": results}, f, indent=1)

    for i, name in enumerate(models):
        left = args.time_limit - (time.monotonic() - start)
        results.append({})
        bench_model(name, args, left / (len(models) - i), results[-1], write)
        print(f"[{name}] done at {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    write(final=True)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
