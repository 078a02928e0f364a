"""Per-op bookkeeping of live DTR (dtralloc.dtr) with no eviction, on small ops,
side by side with plain eager in the same run.

Seven workloads of small ops (where per-op costs show; on real models the
ops' own time dwarfs them): a loop of torch.add on the same two 8-element
tensors (made before the session: a recipe keeps them, not their geometry);
a chain x = x + b (each op reads the one before's output); a
forward + backward of a 32-layer MLP of width 16 (batch 4); the same with
dropout (random ops save their generator state); an SGD step with foreach
ops over 160 parameters (few ops, each reading and writing hundreds of
tensors); a whole training step of ResNet-50's graph at width 8 (a thousand
small ops, with hundreds of saved activations held by the session: on a GPU
the host's per-op cost is what a model of small kernels waits on); an LSTM
and a GRU over a packed batch (their CPU cells write each step's gates in
place after saving some of them). Each runs plainly, under a
TorchDispatchMode that does nothing (the floor any dispatch-based runtime
pays), under that mode with saved-tensor hooks that do nothing (the floor of
one that owns saved tensors), under dtr(device="cpu") without a budget,
with a budget nothing reaches, and (for the workloads with a backward) with
the forward alone in the session and the backward after its block.
Rounds alternate the six, and the minimum over rounds is kept (the least
disturbed by other load). Reported: microseconds per ATen op over plain
eager.

    python bench/bench_live_overhead.py [--rounds 7] [--out bench/results/live_overhead-DATE-cpu.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtralloc.dtr import dtr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit, header  # noqa: E402


class NoopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class NoopModeAndHooks:
    """The noop mode with saved-tensor hooks that hand autograd its tensors
    back: the floor of a runtime that owns saved tensors (on fwd+bwd)."""

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_same, _same)
        self._hooks.__enter__()
        self._mode = NoopMode()
        self._mode.__enter__()

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._hooks.__exit__(*exc)


def _same(t):
    return t


class CountMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def workloads():
    a, b = torch.randn(8), torch.randn(8)

    def adds():
        for _ in range(2000):
            torch.add(a, b)

    def chain():  # each input is the session's own output: its geometry is read per op
        x = a
        for _ in range(2000):
            x = torch.add(x, b)

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(32)])
    x = torch.randn(4, 16)

    def mlp_forward():
        mlp.zero_grad(set_to_none=True)
        return mlp(x).sum()

    drop = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1))
                                 for _ in range(32)])

    def dropout_forward():
        drop.zero_grad(set_to_none=True)
        return drop(x).sum()

    # An optimizer step: foreach ops over a hundred and sixty parameters,
    # each op reading and writing hundreds of tensors (made before the
    # session, as a training loop's parameters, gradients and momentum are).
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(160)]
    for p in params:
        p.grad = torch.randn(64)
    sgd = torch.optim.SGD(params, lr=1e-6, momentum=0.9, weight_decay=1e-4, foreach=True)
    sgd.step()  # the momentum buffers exist from here on

    # A whole model: ResNet-50's graph (bottleneck blocks 3-4-6-3) at width 8
    # on 32x32 images, so that its thousand ops are small: per-op costs that
    # grow with what the session holds (hundreds of saved activations) show.
    from dtralloc.zoo import resnet

    net = resnet.build(batch=2, image=32, base=8, classes=10)

    def net_forward():
        net.optimizer.zero_grad(set_to_none=True)
        return net.loss_fn(net.model, *net.batch)

    def net_finish(loss):  # with net_forward, what net.step() runs
        loss.backward()
        net.optimizer.step()

    # An LSTM and a GRU over a packed batch: torch's CPU cells split the
    # gates of a step into views of one storage and activate them in place
    # one after another, so most saved gates sit on a storage written again
    # after the save.
    lstm, gru = torch.nn.LSTM(16, 16, batch_first=True), torch.nn.GRU(16, 16, batch_first=True)
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(4, 12, 16), torch.tensor([12, 10, 7, 3]),
                                                     batch_first=True)

    def rnn_forward():
        lstm.zero_grad(set_to_none=True)
        gru.zero_grad(set_to_none=True)
        return lstm(packed)[0].data.sum() + gru(packed)[0].data.sum()

    return {"add loop (2000 x torch.add, 8 floats)": adds,
            "add chain (x = x + b, 2000 times, 8 floats)": chain,
            "MLP 32 x Linear(16)+Tanh, fwd+bwd": _training(mlp_forward),
            "MLP 32 x Linear(16)+ReLU+Dropout, fwd+bwd": _training(dropout_forward),
            "SGD step (foreach, momentum, weight decay), 160 x 64 floats": sgd.step,
            "ResNet-50 graph at width 8, 32x32, batch 2: training step": _training(net_forward, net_finish),
            "LSTM + GRU (16 wide) over a packed batch of 4 x 12 steps, fwd+bwd": _training(rnn_forward)}


def _training(forward, finish=lambda loss: loss.backward()):
    """A workload with a backward: its step is finish(forward()), forward()
    returning the loss; both are kept on it for the forward-alone
    configuration."""

    def step():
        finish(forward())

    step.forward, step.finish = forward, finish
    return step


FORWARD = "dtr, forward in the block"


class ForwardAlone:
    """The session around a workload's forward and loss only; backward (and
    the optimizer's step) run after the block (docs/live.md, "The forward
    alone in the block"). A workload with no backward runs whole inside it,
    as under dtr."""

    def __call__(self):
        return dtr(device="cpu")


def run(fn, ctx) -> None:
    """One step of `fn` in configuration `ctx` (a context factory, or None: plainly)."""
    if ctx is None:
        fn()
    elif isinstance(ctx, ForwardAlone) and hasattr(fn, "forward"):
        with ctx():
            loss = fn.forward()
        fn.finish(loss)
    else:
        with ctx():
            fn()


def ops_of(fn) -> int:
    with CountMode() as m:
        fn()
    return m.ops


def timed(fn, ctx) -> float:
    start = time.perf_counter()
    run(fn, ctx)
    return time.perf_counter() - start


# A budget no workload here comes near: the budget's bookkeeping (the mirror
# checks it, the dtralloc placement settings resolve on) and, from the
# second session of a workload on, the lifetimes the step before taught
# (long_lived), with no eviction.
UNREACHED_BUDGET = 1 << 40


def contexts() -> dict:
    """The configurations a workload runs in, by name (None: plainly)."""
    return {"plain": None, "noop mode": NoopMode, "noop mode + hooks": NoopModeAndHooks,
            "dtr": lambda: dtr(device="cpu"),
            "dtr, budget": lambda: dtr(device="cpu", budget=UNREACHED_BUDGET), FORWARD: ForwardAlone()}


def measure(rounds: int):
    rows = []
    for name, fn in workloads().items():
        configs = contexts()
        for ctx in configs.values():  # warm-up: first calls, imports
            timed(fn, ctx)
        n = ops_of(fn)
        best = {k: float("inf") for k in configs}
        for _ in range(rounds):
            for k, ctx in configs.items():
                best[k] = min(best[k], timed(fn, ctx))
        us = {k: v / n * 1e6 for k, v in best.items()}
        with dtr(device="cpu") as s:
            fn()
        rows.append((name, n, us, s.stats()["remats"], hasattr(fn, "forward")))
    return rows


def report(rows, rounds, command) -> str:
    lines = [header("Live DTR per-op bookkeeping, no eviction (CPU)", command),
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; minimum of {rounds} alternating rounds.",
             "",
             "| workload | ATen ops | plain µs/op | noop mode µs/op | noop mode + hooks µs/op | dtr µs/op | "
             "dtr over plain, µs/op | dtr over noop mode + hooks, µs/op | dtr with a budget µs/op | "
             "dtr with a budget over plain, µs/op | dtr, forward in the block µs/op | "
             "dtr, forward in the block over plain, µs/op | recomputes in a dtr step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, n, us, remats, split in rows:
        forward = f"{us[FORWARD]:.2f} | {us[FORWARD] - us['plain']:.2f}" if split else "- | -"
        lines.append(f"| {name} | {n} | {us['plain']:.2f} | {us['noop mode']:.2f} | {us['noop mode + hooks']:.2f} | "
                     f"{us['dtr']:.2f} | {us['dtr'] - us['plain']:.2f} | {us['dtr'] - us['noop mode + hooks']:.2f} | "
                     f"{us['dtr, budget']:.2f} | {us['dtr, budget'] - us['plain']:.2f} | {forward} | {remats} |")
    lines += ["", "noop mode: a TorchDispatchMode whose __torch_dispatch__ only calls the op, the floor "
              "of any runtime built on dispatch; noop mode + hooks: the same with saved-tensor hooks that "
              "return what they get, the floor of a runtime that owns autograd's saved tensors (they cost "
              "only where a backward runs); dtr: dtralloc.dtr(device='cpu') with no budget (registry, "
              "lineage and cost recorded in C++, one call per op); dtr with a budget: the same with a budget "
              "of 1 TiB, which nothing here reaches (no eviction), so the budget's bookkeeping and the lifetimes "
              "learned from the step before (long_lived, docs/live.md) are in; dtr, forward in the block: the "
              "session around the forward and the loss only, backward (and the ResNet step's optimizer step) "
              "after the block (per op of the whole step; '-' where a workload has no backward); recomputes: what one dtr "
              "session without a budget recomputed (nothing is evicted, so only values no longer on their "
              "storage would be)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    rows = measure(args.rounds)
    text = report(rows, args.rounds, "python bench/bench_live_overhead.py " + " ".join(argv or sys.argv[1:]))
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
