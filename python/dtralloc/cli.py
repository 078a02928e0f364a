"""The `dtralloc` command (also `python -m dtralloc`)."""
from __future__ import annotations

import argparse
import sys

from . import _core


def _cmd_config(args) -> int:
    from .config import format_config_markdown, format_config_table

    print(format_config_markdown() if args.markdown else format_config_table(args.conf))
    return 0


def _cmd_bench(args) -> int:
    from .microbench import run_hot_path_bench

    print(run_hot_path_bench(quick=args.quick))
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(confs=args.conf or None, steps=args.steps)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtralloc",
        description="dtralloc: caching GPU memory allocator with defragmentation-aware eviction.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("config", help="print the effective DTRALLOC_CONF settings with their docs")
    p.add_argument("--conf", default=None, help="settings to check instead of $DTRALLOC_CONF")
    p.add_argument("--markdown", action="store_true", help="print the option table as markdown")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("demo", help="run a training-like allocation pattern under several settings")
    p.add_argument("--conf", action="append", help="a DTRALLOC_CONF to compare (repeatable)")
    p.add_argument("--steps", type=int, default=8, help="training steps to simulate (default 8)")
    p.set_defaults(func=_cmd_demo)
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
