"""An optimizer step inside a dtr() session: foreach ops split by element
against each output's recipe of every input, side by side with plain eager.

An optimizer's foreach ops read and write N parameters' worth of tensors a
call. Out of place (weight decay's _foreach_add, AdamW's _foreach_sqrt and
_foreach_div), each of their N outputs reads element i of each list; the
session gives it a recipe of those inputs (ops.PER_ELEMENT_ELEMENTWISE,
LiveSession::elements_of). "whole" turns that off (the classifier answers
PER_ELEMENT_NONE for every op), which is how the session recorded these ops
before: each output's recipe is all 2N or 3N inputs, N x 2N entries an op, and
a write to a parameter walks N dependents per parameter.

Each row: a training loop's optimizer step (gradients and state made before
the step, as a training loop has them) with N parameters of 64 floats, run
plainly, under dtr(device="cpu") with the split, and without it. Rounds
alternate the three; the minimum over rounds is kept.

    python bench/bench_live_optimizer.py [--rounds 5] [--params 160 1000] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

from dtralloc.dtr import dtr, mode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit, header  # noqa: E402

OPTIMIZERS = {
    "SGD (momentum, weight decay)": lambda ps: torch.optim.SGD(ps, lr=1e-6, momentum=0.9, weight_decay=1e-4,
                                                               foreach=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-6, foreach=True),
    "AdamW + clip_grad_norm_": None,  # AdamW, after torch.nn.utils.clip_grad_norm_(foreach=True)
}


def workload(name: str, n: int):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(64)
    make = OPTIMIZERS[name] or OPTIMIZERS["AdamW"]
    opt = make(params)
    opt.step()  # the optimizer state exists from here on

    def step():
        if OPTIMIZERS[name] is None:
            torch.nn.utils.clip_grad_norm_(params, 1e3, foreach=True)
        opt.step()

    return step


@contextlib.contextmanager
def whole_recipes():
    """The session with no foreach op split by element."""
    classify = mode._classify_for_c
    mode._classify_for_c = lambda func: classify(func)[:7] + (0,)
    try:
        yield
    finally:
        mode._classify_for_c = classify


def timed(step, kind: str) -> float:
    start = time.perf_counter()
    if kind == "plain":
        step()
    elif kind == "split":
        with dtr(device="cpu"):
            step()
    else:
        with whole_recipes(), dtr(device="cpu"):
            step()
    return time.perf_counter() - start


KINDS = ("plain", "split", "whole")


def measure(rounds: int, sizes):
    rows = []
    for name in OPTIMIZERS:
        for n in sizes:
            step = workload(name, n)
            for kind in KINDS:  # warm-up
                timed(step, kind)
            best = {k: float("inf") for k in KINDS}
            for _ in range(rounds):
                for kind in KINDS:
                    best[kind] = min(best[kind], timed(step, kind))
            rows.append((name, n, {k: v * 1e3 for k, v in best.items()}))
            print(f"{name}, N = {n}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items()),
                  file=sys.stderr)
    return rows


def report(rows, rounds, command) -> str:
    lines = [header("An optimizer step inside dtr(): foreach ops split by element (CPU)", command),
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; minimum of {rounds} alternating rounds; "
             "N parameters of 64 floats, gradients and optimizer state made before the step.",
             "",
             "| optimizer step | N | plain ms | dtr, split by element ms | dtr, whole recipes ms | "
             "split over plain, ms | whole over plain, ms | whole over split, x |",
             "|---|---|---|---|---|---|---|---|"]
    for name, n, ms in rows:
        lines.append(f"| {name} | {n} | {ms['plain']:.2f} | {ms['split']:.2f} | {ms['whole']:.2f} | "
                     f"{ms['split'] - ms['plain']:.2f} | {ms['whole'] - ms['plain']:.2f} | "
                     f"{(ms['whole'] - ms['plain']) / max(ms['split'] - ms['plain'], 1e-9):.1f} |")
    lines += ["", "split: dtralloc.dtr(device='cpu') as it is (a foreach op's output i reads element i of "
              "its lists); whole: the same session with the classifier answering PER_ELEMENT_NONE for every "
              "op, so each output's recipe is every input, as the session recorded these ops before the split. "
              "The last column divides the two sessions' costs over plain."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--params", type=int, nargs="+", default=[160, 1000],
                        help="parameter counts to run (default: 160 1000)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or any(n < 1 for n in args.params):
        parser.error("--rounds and --params must be positive")
    rows = measure(args.rounds, args.params)
    text = report(rows, args.rounds, "python bench/bench_live_optimizer.py " + " ".join(argv or sys.argv[1:]))
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
