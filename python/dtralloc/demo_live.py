"""`dtralloc demo`, live part: a small model trained for a few AdamW steps on
CPU under dtralloc.dtr() at half its peak, next to the same steps run plainly:
the evictions and recomputes it took, and losses that are identical. Then
one step checked under chaos with Session.verify(): every parameter,
gradient, optimizer state and generator after it, bit for bit."""
from __future__ import annotations

import contextlib
import copy
import time

STEPS = 3
BUDGET_SHARE = 0.5  # of the step's no-eviction peak in the session's mirror pool


def _model():
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Dropout(0.1))
              for _ in range(8)]
    return torch.nn.Sequential(*layers), torch.randn(1024, 512)


def _step(model, opt, x, ctx):
    """One AdamW step, its forward and backward inside `ctx`; returns the loss."""
    opt.zero_grad(set_to_none=True)
    with ctx:
        loss = model(x).square().mean()
        loss.backward()
    opt.step()
    return loss


def _train(model, x, session_factory=None, steps=STEPS):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, sessions = [], []
    torch.manual_seed(1)
    for _ in range(steps):
        ctx = contextlib.nullcontext() if session_factory is None else session_factory()
        losses.append(_step(model, opt, x, ctx).item())
        if session_factory is not None:
            sessions.append(ctx)
    return losses, sessions


def run_live_demo(echo=print) -> dict:
    try:
        import torch
    except ImportError:
        echo("(live part skipped: it needs PyTorch; pip install torch)")
        return {}
    from .dtr import dtr
    from ._core import format_bytes

    model, x = _model()
    init = copy.deepcopy(model.state_dict())
    with dtr(device="cpu") as probe:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    peak = probe.stats()["peak_bytes"]
    budget = int(peak * BUDGET_SHARE)
    echo(f"Live: an 8-layer MLP (GELU, dropout; batch 1024 x 512) trained for {STEPS} AdamW steps on CPU, "
         f"plainly and under dtralloc.dtr(budget={format_bytes(budget)}), half its peak of "
         f"{format_bytes(peak)}")
    _train(model, x, steps=1)  # untimed: the first AdamW step's one-time costs are not the runtime's
    model.load_state_dict(init)
    t0 = time.perf_counter()
    plain, _ = _train(model, x)
    t_plain = time.perf_counter() - t0
    model.load_state_dict(init)
    t0 = time.perf_counter()
    live, sessions = _train(model, x, lambda: dtr(budget=budget, device="cpu"))
    t_live = time.perf_counter() - t0
    echo(f"  {'step':<5} {'plain loss':<22} {'dtr loss':<22} {'evictions':>9} {'remats':>7} "
         f"{'rng replays':>11} {'peak':>10}")
    for i, (a, b, s) in enumerate(zip(plain, live, sessions)):
        st = s.stats()
        echo(f"  {i:<5} {a!r:<22} {b!r:<22} {st['evictions']:>9} {st['remats']:>7} {st['rng_replays']:>11} "
             f"{format_bytes(st['peak_bytes']):>10}")
    same = plain == live
    echo(f"  losses identical: {'yes' if same else 'NO'}; step time {t_live / t_plain:.2f}x plain "
         f"({t_live / STEPS:.2f}s vs {t_plain / STEPS:.2f}s per step)")
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    verified = dtr(chaos=True, device="cpu").verify(lambda: _step(model, opt, x, contextlib.nullcontext()),
                                                     model, opt)
    echo(f"  one step under dtr(chaos=True) (evicting all it can at every op), checked with verify(): {verified}")
    return {"identical": same, "plain": plain, "live": live, "sessions": sessions, "verified": verified}
