"""The `dtralloc` command (also `python -m dtralloc`)."""
from __future__ import annotations

import argparse
import sys

from . import _core


def _cmd_config(args) -> int:
    from .config import format_config_markdown, format_config_table
    from .replay import format_policies_markdown

    if args.policies:
        print(format_policies_markdown())
    else:
        print(format_config_markdown() if args.markdown else format_config_table(args.conf))
    return 0


def _cmd_bench(args) -> int:
    from .microbench import run_hot_path_bench

    print(run_hot_path_bench(quick=args.quick))
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(traces=args.trace, confs=args.conf, policies=args.policy, live=not args.no_live,
             budgets=[float(b) for b in args.budget] if args.budget else None)
    return 0


def _progress_printer(label: str):
    """A progress callback that rewrites one stderr line (only on a terminal)."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        sys.stderr.write(f"\r{label}: {done}/{total} ops ({100 * done // max(total, 1)}%)")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _parse_budget(text):
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return text  # a size such as 6G, parsed by replay
    return value if value <= 1.0 else int(value)


def _cmd_replay(args) -> int:
    from .replay import format_results, replay

    results = []
    for path in args.traces:
        trace = _load_trace(path)
        print(trace.summary(), file=sys.stderr)
        for policy in args.policy or ["none"]:
            for budget in args.budget or [None]:
                results.append(replay(trace, budget=_parse_budget(budget), policy=policy, conf=args.conf,
                                      progress=_progress_printer(trace.meta.get("name", path)),
                                      steps=args.steps))
    print(format_results(results, last_step=args.steps > 1))
    return 0 if all(r.feasible for r in results) else 1


def _load_trace(path: str):
    import os

    from .trace import load

    if os.path.exists(path):
        return load(path)
    from .traces import bundled_path, list_bundled

    if path in list_bundled():
        return load(bundled_path(path))
    raise SystemExit(f"error: no trace file {path!r} and no bundled trace of that name "
                     f"(bundled: {', '.join(list_bundled())})")


def _cmd_record(args) -> int:
    import os
    import time

    def echo(message: str) -> None:
        print(message, file=sys.stderr)

    start = time.perf_counter()
    if ":" in args.target:
        from .trace import record

        step, name = _user_step(args.target)
        if not args.no_warmup:
            echo("warm-up step ...")
            step()
        echo("recording one step ...")
        trace = record(step, name=name)
    else:
        try:
            from .zoo import MODELS, record_model
        except ImportError as e:  # torch is missing
            raise SystemExit(f"error: {e}")
        if args.target not in MODELS:
            raise SystemExit(f"error: unknown zoo model {args.target!r}; choose from "
                             f"{', '.join(sorted(MODELS))} or pass module:function")
        try:
            trace = record_model(args.target, small=args.small, warmup=not args.no_warmup, echo=echo)
        except ImportError as e:  # transformers is missing
            raise SystemExit(f"error: {e}")
    out = args.out or f"{trace.meta['name']}.dtrace"
    trace.save(out)
    print(f"{trace.summary()}\nwrote {out} ({_core.format_bytes(os.path.getsize(out))}) "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


def _core_policies() -> list[str]:
    return [p["name"] for p in _core.policies()]


def _user_step(target: str):
    """(step function, name) from ``module:function``: ``function()`` returns the step.

    The module is imported from the current directory or PYTHONPATH: that is
    where a user's own training code lives (zoo names never look there).
    """
    import importlib
    import os

    module_name, _, func_name = target.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"error: cannot import {module_name!r} for {target}: {e}. "
                         "Run from the directory that holds it or put it on PYTHONPATH.")
    factory = getattr(module, func_name, None)
    if factory is None:
        raise SystemExit(f"error: {module_name} has no attribute {func_name!r}")
    step = factory()
    if not callable(step):
        raise SystemExit(f"error: {target} must return the step function (a callable "
                         f"taking no arguments), got {type(step).__name__}")
    return step, func_name


def _cmd_dashboard(args) -> int:
    from .dashboard import dashboard

    if not args.inputs:
        raise SystemExit("error: give at least one input: a .dtrace file or bundled trace name, or a "
                         "memory snapshot pickle (torch.cuda.memory._dump_snapshot or dtralloc.snapshot())")
    budgets = None
    if args.budget:  # "0.5,6G" and repeated flags; "none" is a run without a budget
        budgets = [None if t.strip().lower() == "none" else _parse_budget(t.strip())
                   for text in args.budget for t in text.split(",") if t.strip()]
    d = dashboard(*args.inputs, budgets=budgets, policies=args.policy, conf=args.conf,
                  sweep=not args.no_sweep, min_budget=not args.no_min_budget, title=args.title)
    d.save(args.output)
    print(f"wrote {args.output} ({len(d.html.encode()) / 2**20:.2f} MiB, {len(d.runs)} runs)")
    return 0


def _cmd_top(args) -> int:
    from .top import run_top

    return run_top(args.pid, once=args.once or args.json, as_json=args.json, interval=args.interval,
                   device=args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtralloc",
        description="dtralloc: caching GPU memory allocator with defragmentation-aware eviction.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("config", help="print the effective DTRALLOC_CONF settings with their docs")
    p.add_argument("--conf", default=None, help="settings to check instead of $DTRALLOC_CONF")
    p.add_argument("--markdown", action="store_true", help="print the option table as markdown")
    p.add_argument("--policies", action="store_true",
                   help="print the eviction policy table (the values of `policy`) as markdown")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("demo", help="replay the bundled training steps under several settings, then train a "
                                    "small model live under a budget")
    p.add_argument("--trace", action="append", help="a bundled trace to replay (repeatable; default all)")
    p.add_argument("--conf", action="append", help="a DTRALLOC_CONF to compare (repeatable)")
    p.add_argument("--policy", action="append",
                   help="an eviction policy for the budget table (repeatable; default dtr, coop, dtralloc)")
    p.add_argument("--budget", action="append",
                   help="a budget fraction of the peak for the budget table (repeatable; default 0.7, 0.5)")
    p.add_argument("--no-live", action="store_true",
                   help="skip the live part (a model trained on CPU under dtralloc.dtr at half its peak)")
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("record", help="record one training step's memory traffic to a trace file")
    p.add_argument("target", help="a zoo model of dtralloc.zoo (gpt2, bert, llama, resnet50, unet, mlp, "
                   "lstm, vit, encdec, convbn, moe), "
                   "or module:function, function() returning your step function (the module is "
                   "imported from the current directory or PYTHONPATH)")
    p.add_argument("-o", "--out", help="output file (default NAME.dtrace)")
    p.add_argument("--small", action="store_true", help="zoo models: tiny sizes of the same architecture (quick)")
    p.add_argument("--no-warmup", action="store_true",
                   help="record the first step (default: run one step first so optimizer state exists)")
    p.set_defaults(func=_cmd_record)
    p = sub.add_parser("replay", help="replay traces through the pool and print a table")
    p.add_argument("traces", nargs="+", help="trace files or bundled trace names")
    p.add_argument("--budget", action="append",
                   help="cap on reserved bytes: a size (6G) or a fraction of the no-eviction peak "
                        "(0.5); repeatable")
    p.add_argument("--policy", action="append",
                   help=f"eviction policy under the budget ({', '.join(_core_policies())}; "
                        "`dtralloc config --policies` says how each chooses); repeatable; default none")
    p.add_argument("--conf", default=None, help="DTRALLOC_CONF settings for the pool")
    p.add_argument("--steps", type=_positive_int, default=1,
                   help="run each trace's step this many times in one pool, as a training loop does; the "
                        "table adds the last step's cudaMalloc/cudaFree calls and overhead (default 1)")
    p.set_defaults(func=_cmd_replay)
    p = sub.add_parser("dashboard", help="one self-contained HTML page for traces and memory snapshots")
    p.add_argument("inputs", nargs="*", help=".dtrace files, bundled trace names, or memory snapshot pickles "
                   "(torch.cuda.memory._dump_snapshot, dtralloc.snapshot())")
    p.add_argument("-o", "--output", default="report.html", help="the page to write (default report.html)")
    p.add_argument("--budget", action="append",
                   help="budgets for traces: fractions of the no-eviction peak (0.5), sizes (6G) or none; "
                        "comma-separated or repeated (default 0.5; a run without a budget is always added)")
    p.add_argument("--policy", action="append",
                   help="eviction policies for traces, comma-separated or repeated (default dtralloc)")
    p.add_argument("--conf", default=None, help="DTRALLOC_CONF settings for the replays")
    p.add_argument("--no-sweep", action="store_true", help="skip the budget sweep behind the overhead curves")
    p.add_argument("--no-min-budget", action="store_true", help="skip the min feasible budget search")
    p.add_argument("--title", default=None, help="page title")
    p.set_defaults(func=_cmd_dashboard)
    p = sub.add_parser("top", help="live terminal view of processes using dtralloc")
    p.add_argument("pid", nargs="?", type=int, help="a process id (default: every process that publishes)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="print one frame as JSON and exit")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes (default 0.5)")
    p.add_argument("--device", type=int, default=None, help="only this device")
    p.set_defaults(func=_cmd_top)
    p = sub.add_parser("bench", help="hot-path malloc+free microbenchmark (ns per pair)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (_core.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
