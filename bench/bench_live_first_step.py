"""Does the first step under a budget fit where the steps after it fit?

A live session places what the step before it kept (gradients, the loss) at
the high end of free blocks (long_lived, docs/live.md "What outlives the
step"). The first step on a device has no step before it: it places as torch
does. This bench measures what that costs, on zoo models at the sizes of
bench_live_vs_replay.py, over a grid of budgets (fractions of the step's
no-eviction peak), each budget tried twice per round:

* first   after budget-free steps of as many other models (two-layer MLPs,
          each with its own activation) as kinds of step a device keeps
          (Note [recent steps]): their lifetimes push this model's out, and
          the session announces nothing, as a program's first step.
* taught  after a budget-free step of the same model (a warm-up, or the
          step that measured the peak): the session announces what it kept.

Reported per model: the lowest budget each fits, and the budgets where the
two differ, per round. The policy reads measured op costs (dtralloc, the
default), so near the lowest budget the rounds differ by op-time noise too.

    python bench/bench_live_first_step.py [--models convbn gpt2] [--rounds 2] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from dtralloc import _core
from dtralloc.replay import POLICIES
from dtralloc.zoo import MODELS, build

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit, header  # noqa: E402
from bench_live_vs_replay import BENCH_SIZES, _live, measure_available  # noqa: E402

DEFAULT_MODELS = ("convbn", "gpt2", "encdec", "unet", "vit", "lstm")


_ACTIVATIONS = (torch.nn.ReLU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Softsign, torch.nn.Hardtanh,
                torch.nn.LogSigmoid)


def _other_steps():
    """Steps of other programs, one for each kind of step a device keeps
    (Note [recent steps]): run in turn, their sessions' lifetimes push out
    every other kind's. Each is its own kind (its own activation), and none
    shares an op sequence with a zoo model."""
    assert _core.RECENT_STEPS <= len(_ACTIVATIONS)
    torch.manual_seed(1)
    x = torch.randn(16, 64)

    def program(activation):
        mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), activation(), torch.nn.Linear(64, 1))

        def step():
            mlp.zero_grad(set_to_none=True)
            mlp(x).sum().backward()

        return step

    return [program(a) for a in _ACTIVATIONS[:_core.RECENT_STEPS]]


def _run(step, budget: int | None, policy: str) -> dict:
    """One step under dtr(budget, device="cpu") (bench_live_vs_replay's
    _live): whether it fit, what it placed high, its peak."""
    out = _live(step, budget, policy)
    return {"fits": "oom" not in out, "long_lived": out["long_lived"], "peak": out["peak_bytes"]}


def measure_model(name: str, fractions: list[float], rounds: int, policy: str, echo) -> dict:
    torch.manual_seed(0)
    w = build(name, **BENCH_SIZES[name])
    w.step()  # optimizer state and lazy initialisation exist, as in any later step
    others = _other_steps()
    peak = _run(w.step, None, policy)["peak"]
    out = {"name": name, "peak": peak, "rounds": []}
    for r in range(rounds):
        cells = []
        for f in fractions:
            budget = max(1, int(f * peak))
            runs = {}
            # Alternate which comes first, so that neither always follows the other.
            for kind in (("first", "taught") if (r + len(cells)) % 2 == 0 else ("taught", "first")):
                if kind == "first":
                    for step in others:  # what the device learns before: other programs' steps alone
                        _run(step, None, policy)
                else:
                    _run(w.step, None, policy)
                runs[kind] = _run(w.step, budget, policy)
            cells.append({"fraction": f, **runs})
        out["rounds"].append(cells)
        lowest = {k: min((c["fraction"] for c in cells if c[k]["fits"]), default=None) for k in ("first", "taught")}
        echo(f"{name} round {r + 1}: lowest first {lowest['first']}, taught {lowest['taught']}")
    return out


def _lowest(cells, kind):
    fits = [c["fraction"] for c in cells if c[kind]["fits"]]
    return f"{min(fits):.2f}" if fits else "none"


def report(models: list[dict], skipped: dict, fractions: list[float], rounds: int, policy: str,
           command: str) -> str:
    lines = [header("Live DTR: the first step under a budget against a step taught by the one before (CPU)",
                    command),
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; policy `{policy}`; budgets "
             f"{fractions[0]:.2f} to {fractions[-1]:.2f} of each model's no-eviction peak, step "
             f"{(fractions[1] - fractions[0]) if len(fractions) > 1 else 0:.2f}; {rounds} round(s).", "",
             "first: the step after budget-free steps of other programs, one for each kind of step a device "
             "keeps (it announces nothing); taught: "
             "the step after a budget-free step of the same model (it announces what that step kept). "
             "long_lived: requests placed at the high end of a block, mean over the budgets each ran.", "",
             "| model | round | lowest fitting, first | lowest fitting, taught | budgets where they differ "
             "(first / taught) | long_lived first | long_lived taught |",
             "|---|---|---|---|---|---|---|"]
    for m in models:
        for r, cells in enumerate(m["rounds"]):
            differ = [f"{c['fraction']:.2f} ({'fits' if c['first']['fits'] else 'OOM'} / "
                      f"{'fits' if c['taught']['fits'] else 'OOM'})" for c in cells
                      if c["first"]["fits"] != c["taught"]["fits"]]
            mean = {k: sum(c[k]["long_lived"] for c in cells) / len(cells) for k in ("first", "taught")}
            lines.append(f"| {m['name']} | {r + 1} | {_lowest(cells, 'first')} | {_lowest(cells, 'taught')} | "
                         f"{', '.join(differ) or 'none'} | {mean['first']:.1f} | {mean['taught']:.1f} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | - | skipped: {why} | | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                        help="zoo models (default: %(default)s)")
    parser.add_argument("--low", type=float, default=0.30, help="lowest budget, a fraction of the peak "
                        "(default: %(default)s)")
    parser.add_argument("--high", type=float, default=0.76, help="highest budget (default: %(default)s)")
    parser.add_argument("--step", type=float, default=0.02, help="grid step (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the grid (default: %(default)s)")
    parser.add_argument("--policy", default="dtralloc", choices=[p for p in POLICIES if p != "none"],
                        help="eviction policy; only dtralloc places what outlives the step (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    unknown = [n for n in args.models if n not in MODELS or n not in BENCH_SIZES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; available: {', '.join(BENCH_SIZES)}")
    if not 0 < args.low <= args.high <= 1 or args.step <= 0:
        parser.error("need 0 < --low <= --high <= 1 and --step > 0")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    n = int(round((args.high - args.low) / args.step)) + 1
    fractions = [round(args.low + i * args.step, 4) for i in range(n)]
    torch.set_num_threads(args.threads)
    models, skipped = measure_available(args.models, lambda name: measure_model(
        name, fractions, args.rounds, args.policy, echo=lambda s: print(s, file=sys.stderr, flush=True)))
    command = "python bench/bench_live_first_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    emit(report(models, skipped, fractions, args.rounds, args.policy, command), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
