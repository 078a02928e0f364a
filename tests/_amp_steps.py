"""float16 autocast with a GradScaler, the usual mixed-precision recipe, as
one loop for test_dtr.py (CPU) and _dtr_gpu_worker.py's `amp` scenario
(CUDA). torch comes in as an argument: the GPU worker imports it only after
dtralloc.install()."""
from __future__ import annotations

import contextlib


def scaled_steps(torch, model, x, device, steps, init_scale, recipe, session=None):
    """`steps` AdamW steps of `model` on `x` under float16 autocast, the loss
    scaled by a GradScaler (growth every 2 steps from `init_scale`): the
    whole step in a fresh `session()` each step, or (`recipe` "forward")
    the forward alone, the scaled backward, the scaler's step and update
    after it; without `session`, plainly. The seed is set to 7 before the
    first step. Returns (losses, parameters, scales, growth trackers) after
    each step, and each step's session (None without one)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=2)
    torch.manual_seed(7)
    losses, scales, trackers, sessions = [], [], [], []

    def finish(loss):
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with session() if session else contextlib.nullcontext() as s:
            with torch.autocast(device, dtype=torch.float16):
                loss = model(x).float().square().mean()
            if recipe == "whole":
                finish(loss)
        if recipe == "forward":
            finish(loss)
        sessions.append(s)
        losses.append(loss.detach())
        scales.append(scaler.get_scale())
        trackers.append(int(scaler._growth_tracker))
    return (losses, [p.detach().clone() for p in model.parameters()], scales, trackers), sessions
